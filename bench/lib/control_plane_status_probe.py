"""Times :func:`ftrain.agents.status.job_status` (what ``ftrain status`` calls: one read of the
job, parsed, shaped for the table) in one process, for the control-plane benchmark.

    python bench/lib/control_plane_status_probe.py --etcd URL --job J --repeats 5

Run with ``PYTHONPATH`` naming the tree to measure; prints one JSON line: the import time of the
status module and each call's wall time. What must stay true: it only reads (no dump request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--etcd", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    t0 = time.monotonic()
    from ftrain.agents.etcd import EtcdClient
    from ftrain.agents.status import job_status

    import_s = time.monotonic() - t0
    runs_s = []
    with EtcdClient([args.etcd], timeout_s=30.0) as client:
        for _ in range(args.repeats):
            t0 = time.monotonic()
            shown = job_status(client, args.job)
            runs_s.append(time.monotonic() - t0)
    print(
        json.dumps(
            {
                "import_s": round(import_s, 4),
                "runs_s": [round(s, 4) for s in runs_s],
                "median_s": round(statistics.median(runs_s), 4),
                "nodes": len(shown.get("nodes", [])),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
