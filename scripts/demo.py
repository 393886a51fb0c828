"""The demo job (``make demo``): 2-rank training that checkpoints to a real local S3 server,
loses a worker to SIGKILL mid-run, and resumes by itself from the last committed checkpoint.

Until the node agent lands, the restart is done here by a minimal supervisor loop (relaunch
torchrun while the job is unfinished, up to a restart budget); the resume itself is ftrain's:
it finds the newest verified checkpoint on S3 and continues bitwise where it left off.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoint.catalog import list_steps
from checkpoint.seaweed import SeaweedS3
from checkpoint.storage import Storage
from ftrain.config import load_config
from ftrain.data import build_source
from ftrain.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int, default=130, help="a worker SIGKILLs itself after this step")
    parser.add_argument("--max-restarts", type=int, default=3)
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    floor = build_source(cfg.data, cfg.model).entropy_floor_nats
    work = Path(tempfile.mkdtemp(prefix="ftrain-demo-"))
    metrics_path = work / "metrics.jsonl"
    print(f"demo: working directory {work}")
    with SeaweedS3(data_dir=work / "s3", bucket="ftrain-demo") as s3:
        url = s3.url("demo-job")
        print(f"demo: S3 (SeaweedFS) at {s3.endpoint_url}, checkpoints to {url}")
        env = {**os.environ, **s3.env(), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "FTRAIN_FAULT_SIGKILL": f"{args.kill_at_step}:1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "ftrain", "train", args.config, f"--checkpoint.uri={url}",
               f"--logging.metrics_path={metrics_path}", f"--logging.events_path={work / 'events.jsonl'}"]
        restarts, crash_times = 0, []
        while True:
            started = time.time()
            code = subprocess.call(cmd, env=env, cwd=REPO)
            if code == 0:
                break
            crash_times.append(time.time())
            if restarts >= args.max_restarts:
                print(f"demo: giving up after {restarts} restarts (exit {code})")
                return 1
            restarts += 1
            env.pop("FTRAIN_FAULT_SIGKILL", None)  # the fault happens once
            print(f"\ndemo: training exited with {code} after {time.time() - started:.1f}s "
                  f"(a worker was SIGKILLed); restart {restarts}: resuming from the last committed checkpoint\n")
        committed = [s.step for s in list_steps(Storage(url, s3.storage_options())) if s.state == "committed"]

    records = read_metrics(metrics_path)
    final = records[-1]
    print("\n=== demo summary ===")
    print(f"steps completed      : {final['step']} of {cfg.train.steps}")
    print(f"restarts             : {restarts}")
    for crash_t in crash_times:
        before = [r for r in records if r["time"] <= crash_t]
        after = [r for r in records if r["time"] > crash_t]
        if before and after:
            print(f"recovery             : last step before the crash {before[-1]['step']}, resumed at step "
                  f"{after[0]['step']} (replayed {before[-1]['step'] - after[0]['step'] + 1} steps), "
                  f"{after[0]['time'] - before[-1]['time']:.1f}s from the last step before the crash to "
                  "the first step after it")
    print(f"committed checkpoints: {committed}")
    print(f"final loss           : {final['loss']:.4f} (entropy floor {floor:.4f}, gap {final['loss'] - floor:+.4f} nats)")
    return 0 if final["step"] == cfg.train.steps else 1


if __name__ == "__main__":
    sys.exit(main())
