"""A process that serves a later round under another rank (a live worker, a user's loop under
Session.run) shards by its new rank: DTensor's caches of sharding propagation compare device
meshes without the process's rank, so they must be emptied when a round's groups are torn
down (:func:`ftrain.distributed.abort_distributed`). Two real gloo processes swap ranks between
two rounds; in each, FSDP2 shards a module and DCP saves it (its global plan checks that the
ranks' chunks cover every tensor once)."""

from __future__ import annotations

import json
import subprocess
import sys

from ftrain.testbed.etcd import free_ports
from ftrain.testbed.jobs import worker_env
from ftrain.testbed.procs import kill_tree

WORKER = """
import json, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from ftrain.distributed import abort_distributed

first_rank, ports, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
seen = []
for round_, rank in enumerate((first_rank, 1 - first_rank)):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[round_]}", rank=rank, world_size=2)
    model = torch.nn.Linear(4, 8)
    fully_shard(model)
    coordinate = model.weight.device_mesh.get_coordinate()
    try:
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{out}/round{round_}")
        saved = "ok"
    except Exception as e:
        saved = str(e)[:300]
    seen.append({"rank": rank, "coordinate": list(coordinate), "saved": saved})
    abort_distributed()
json.dump(seen, open(f"{out}/proc{first_rank}.json", "w"))
"""


def test_a_process_that_changes_rank_between_rounds_shards_and_saves_by_its_new_rank(tmp_path):
    ports = ",".join(str(p) for p in free_ports(2))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(first), ports, str(tmp_path)],
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for first in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    for first in (0, 1):
        rounds = json.loads((tmp_path / f"proc{first}.json").read_text())
        assert [r["rank"] for r in rounds] == [first, 1 - first]
        assert [r["coordinate"] for r in rounds] == [[first], [1 - first]], rounds  # the new rank's shard
        assert [r["saved"] for r in rounds] == ["ok", "ok"], rounds
