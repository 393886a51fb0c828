"""Checkpoint cost on a real S3 server: training pause, save and load throughput against raw
s3fs PUT/GET of the same bytes, and how much an upload in flight slows training steps.

    python bench/checkpoint.py [--state-mb 300] [--repeats 3] [--no-process] [--timeout-s 420]

One SeaweedFS (``checkpoint.seaweed.SeaweedS3``, loopback) serves the whole run; every
measurement writes under a key prefix of its own. One ``torchrun --standalone
--nproc-per-node 2`` job (gloo, CPU, FSDP2, OMP_NUM_THREADS=1, OMP_WAIT_POLICY=PASSIVE) builds
the model and AdamW with ``ftrain.train.Trainer``, takes a few steps so the optimizer state
exists, and then, side by side in the same processes:

(a) blocked time: wall time of the training thread in ``state_dict()`` + ``CheckpointManager.save``
    with ``async_mode`` ``thread`` / ``process``, over the same for ``off`` (a blocking save).
    Each async mode's first save (async process-group creation, the process start) is timed
    apart and left out of the medians.
(b) save throughput: bytes of every file of the step (shards, ``.metadata``, ``manifest.json``)
    over the wall time from ``save()`` until the manifest is committed (a sync save returns
    then; async: ``save()`` + ``wait()``), against both ranks concurrently ``pipe_file``-ing
    buffers of exactly those file sizes (raw PUT, same s3fs client settings).
(c) verified load: ``CheckpointManager.load`` (verify every digest, then DCP read) of a sync
    save's step, against both ranks concurrently ``cat_file``-ing that step's files (raw GET).
(d) step slowdown: median step time while an async upload is in flight (the loop polls
    ``manager.poll()`` and keeps stepping until no rank has an upload in flight) over the
    median step time of the steps just before, with no upload.

Every figure is the slowest rank's (ranks leave each measurement through a collective), each
measurement is repeated ``--repeats`` times in interleaved order, and medians are reported.
Prints a table with absolute figures and ratios, then one final JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# Run as a script, this file's directory comes first on sys.path, and this file (bench/checkpoint.py)
# would shadow the ``checkpoint`` package: drop the directory, put the repository first.
sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() not in (BENCH, REPO)]


def _load_strategies():
    spec = importlib.util.spec_from_file_location("bench_strategies", BENCH / "strategies.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_strategies = _load_strategies()
_descendants, config_toml = _strategies._descendants, _strategies.config_toml

#: Lines a worker prints for the driver to pass through; everything else is kept for errors.
MARK = "[bench] "
#: Steps before the measurements (AdamW state exists after the first).
WARMUP_STEPS = 3
#: Baseline steps per repeat of (d), and the most steps one in-flight upload may span.
BASELINE_STEPS = 6
MAX_INFLIGHT_STEPS = 80
TARGETS = {"blocked_ratio": ("<=", 0.01), "save_vs_raw": (">=", 0.9), "load_vs_raw": (">=", 0.8)}


# -- the model: ~--state-mb of fp32 params + AdamW m and v ---------------------------------
def model_shape(state_mb: float) -> dict[str, int]:
    """A GPT whose params + AdamW state (12 bytes/param) come near ``state_mb`` MB: the first
    width (preferring 512) that gives 2-16 blocks."""
    vocab, seq = 4096, 64
    target = state_mb * 1e6 / 12
    for d in (512, 384, 256, 768, 1024, 128):
        block = 12 * d * d + 13 * d
        embed = 2 * vocab * d + seq * d + 2 * d
        n = round((target - embed) / block)
        if 2 <= n <= 16:
            return dict(vocab_size=vocab, seq_len=seq, n_layer=n, n_head=d // 64 or 1, d_model=d)
    raise SystemExit(f"--state-mb {state_mb}: no GPT shape here gives that (try 40-1500)")


def num_params(shape: dict[str, int]) -> int:
    d, v, s, n = shape["d_model"], shape["vocab_size"], shape["seq_len"], shape["n_layer"]
    return n * (12 * d * d + 13 * d) + 2 * v * d + s * d + 2 * d


# -- worker (one per rank, under torchrun) --------------------------------------------------
class Bench:
    """Runs every measurement in lockstep on all ranks; rank 0 collects the results."""

    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.distributed as dist

        from ftrain.checkpointing import Checkpointing
        from ftrain.config import load_config
        from ftrain.distributed import init_distributed, select_device, select_dtype
        from ftrain.train import Trainer

        self.torch, self.dist = torch, dist
        self.args = args
        cfg = load_config(args.config)
        device = select_device(cfg.train)
        self.rank, self.world, local = init_distributed(cfg.parallel, device)
        self.trainer = Trainer(cfg, device, select_dtype(cfg.train, device), self.rank, self.world, local)
        # The train loop's own state dict and manifest fields (model, optimizer, RNG; config...).
        ckpt_cfg = load_config(args.config, [f"--checkpoint.uri={args.url}/unused"])
        self.ckpt = Checkpointing(ckpt_cfg, self.trainer.par, self.trainer.cursor, self.trainer.events)
        self.managers: dict[str, Any] = {}
        self.next_step = 1000
        self.results: dict[str, Any] = {"errors": {}}

    # -- helpers ---------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.rank == 0:
            print(MARK + text, flush=True)

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Run ``fn`` on every rank from a common start; the slowest rank's seconds."""
        self.dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        return result, max(self.gather(time.perf_counter() - t0))

    def manager(self, mode: str):
        from checkpoint.manager import CheckpointManager

        if mode not in self.managers:
            self.managers[mode] = CheckpointManager(url=f"{self.args.url}/save-{mode}", async_mode=mode,
                                                    keep_last=1000, gc_grace_s=1e9, device_type="cpu")
        return self.managers[mode]

    def step_files(self, mode: str, step: int) -> dict[str, int]:
        """``{file name: size}`` of a committed step (manifest included), agreed by all ranks."""
        from checkpoint.manifest import MANIFEST_NAME, step_dir_name

        files = None
        if self.rank == 0:
            mgr = self.manager(mode)
            info = next((s for s in mgr.committed_steps() if s.step == step), None)
            if info is not None:
                files = {name: e.size_bytes for name, e in info.manifest.files.items()}
                files[MANIFEST_NAME] = mgr.storage.size_bytes(f"{step_dir_name(step)}/{MANIFEST_NAME}")
        box = [files]
        self.dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise RuntimeError(f"{mode} save of step {step} was not committed: "
                               f"{self.manager(mode).status.last_error or 'no error recorded'}")
        return box[0]

    def my_files(self, files: dict[str, int]) -> list[str]:
        """Files this rank writes in a DCP save (``__<rank>_<n>.distcp``); the rest are rank 0's."""
        owners = {name: int(name[2:].split("_")[0]) if name.startswith("__") and name.endswith(".distcp") else 0
                  for name in files}
        return sorted(n for n, r in owners.items() if r == self.rank)

    # -- (a) + (b): one save ---------------------------------------------------------------
    def save_once(self, mode: str) -> dict[str, float]:
        mgr = self.manager(mode)
        step, self.next_step = self.next_step, self.next_step + 1
        fields = self.ckpt._fields()
        self.dist.barrier()
        t0 = time.perf_counter()
        sd = self.ckpt._state_dict()
        t1 = time.perf_counter()
        mgr.save(step, sd, fields)
        t2 = time.perf_counter()
        mgr.wait()
        t3 = time.perf_counter()
        del sd
        rows = self.gather((t1 - t0, t2 - t0, t3 - t0))
        files = self.step_files(mode, step)
        return {"step": step, "state_dict_s": max(r[0] for r in rows), "blocked_s": max(r[1] for r in rows),
                "commit_s": max(r[2] for r in rows), "bytes": sum(files.values()), "files": files}

    # -- (b) raw PUT, (c) raw GET and verified load -------------------------------------------
    def raw_put(self, files: dict[str, int], tag: str) -> float:
        from checkpoint.storage import Storage

        storage = Storage(f"{self.args.url}/raw-put/{tag}")
        import numpy as np

        rng = np.random.default_rng(self.rank)
        payload = [(storage.path(name), rng.bytes(files[name])) for name in self.my_files(files)]

        def put() -> None:
            for path, data in payload:
                storage.fs.pipe_file(path, data)

        return self.timed(put)[1]

    def raw_get(self, mode: str, step: int, files: dict[str, int]) -> float:
        from checkpoint.manifest import step_dir_name

        storage = self.manager(mode).storage
        paths = [storage.path(step_dir_name(step), name) for name in self.my_files(files)]

        def get() -> int:
            return sum(len(storage.fs.cat_file(p)) for p in paths)

        got, seconds = self.timed(get)
        mine = sum(files[n] for n in self.my_files(files))
        if got != mine:
            raise RuntimeError(f"raw GET read {got} bytes, expected {mine}")
        return seconds

    def verified_load(self, mode: str, step: int) -> float:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        holder: dict[str, Any] = {}

        def build(manifest: Any) -> dict[str, Any]:
            holder["sd"] = self.ckpt._state_dict()
            return holder["sd"]

        manifest, seconds = self.timed(lambda: self.manager(mode).load(build, load_step=step))
        if manifest is None or manifest.step != step:
            raise RuntimeError(f"load of step {step} returned {manifest}")
        sd = holder["sd"]  # as resume() does (outside the timing)
        set_state_dict(self.trainer.par.model, self.trainer.par.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        return seconds

    # -- (d) steps with and without an upload in flight -------------------------------------
    def _step(self, inflight: bool) -> tuple[float, bool]:
        t0 = time.perf_counter()
        self.trainer._step()  # the train loop's own step: data, fwd/bwd, reduce, clip, AdamW, report
        dt = time.perf_counter() - t0
        box = self.torch.tensor([dt, 1.0 if inflight else 0.0], dtype=self.torch.float64)
        self.dist.all_reduce(box, op=self.dist.ReduceOp.MAX)
        return float(box[0]), bool(box[1])

    def steps_baseline(self, n: int) -> list[float]:
        return [self._step(False)[0] for _ in range(n)]

    def steps_with_upload(self, mode: str) -> dict[str, Any]:
        mgr = self.manager(mode)
        step, self.next_step = self.next_step, self.next_step + 1
        fields = self.ckpt._fields()
        self.dist.barrier()
        t0 = time.perf_counter()
        mgr.save(step, self.ckpt._state_dict(), fields)
        blocked = time.perf_counter() - t0
        times = []
        for _ in range(MAX_INFLIGHT_STEPS):
            dt, any_inflight = self._step(mgr.poll().in_flight_step >= 0)
            times.append(dt)
            if not any_inflight:
                times.pop()  # no rank had an upload in flight when this step ended
                break
        mgr.wait()
        upload_s = time.perf_counter() - t0
        ok = mgr.status.last_committed_step == step
        return {"blocked_s": max(self.gather(blocked)), "upload_s": max(self.gather(upload_s)),
                "step_times_s": times, "ok": all(self.gather(ok))}

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args = self.args
        self.steps_baseline(WARMUP_STEPS)
        sd_bytes = sum(t.numel() * t.element_size() for t in _tensors(self.ckpt._state_dict()))
        self.results["state_bytes_per_rank"] = self.gather(sd_bytes)
        modes = ["off", "thread"] + ([] if args.no_process else ["process"])
        async_modes = [m for m in modes if m != "off"]
        saves: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        first: dict[str, dict[str, Any]] = {}
        raw_put: list[float] = []
        loads: list[float] = []
        raw_get: list[float] = []
        for mode in async_modes:  # first saves: async group, background process
            try:
                first[mode] = self.save_once(mode)
                self.say(f"first {mode} save: blocked {first[mode]['blocked_s']:.3f}s, "
                         f"committed after {first[mode]['commit_s']:.2f}s (left out of the medians)")
            except Exception as e:  # noqa: BLE001 - reported; the mode is skipped
                self._drop_mode(mode, e, modes, async_modes)
        for r in range(args.repeats):
            for mode in list(modes):
                try:
                    s = self.save_once(mode)
                except Exception as e:  # noqa: BLE001
                    self._drop_mode(mode, e, modes, async_modes)
                    continue
                saves[mode].append(s)
                self.say(f"repeat {r + 1}/{args.repeats}: {mode:7s} save blocked {s['blocked_s']:.3f}s, "
                         f"committed after {s['commit_s']:.2f}s ({s['bytes'] / 1e6:.0f} MB)")
            sync = saves["off"][-1]
            raw_put.append(self.raw_put(sync["files"], f"r{r}"))
            self.say(f"repeat {r + 1}/{args.repeats}: raw PUT {raw_put[-1]:.2f}s")
            # alternate the order so neither read always comes first after the write
            order = ("load", "get") if r % 2 == 0 else ("get", "load")
            for what in order:
                if what == "load":
                    loads.append(self.verified_load("off", sync["step"]))
                else:
                    raw_get.append(self.raw_get("off", sync["step"], sync["files"]))
            self.say(f"repeat {r + 1}/{args.repeats}: verified load {loads[-1]:.2f}s, raw GET {raw_get[-1]:.2f}s")
        inflight: dict[str, list[dict[str, Any]]] = {m: [] for m in async_modes}
        for r in range(args.repeats):
            for mode in list(async_modes):
                base = self.steps_baseline(BASELINE_STEPS)
                run = self.steps_with_upload(mode)
                if not run["ok"]:
                    self._drop_mode(mode, RuntimeError(self.manager(mode).status.last_error), modes, async_modes)
                    continue
                run["baseline_step_times_s"] = base
                inflight[mode].append(run)
                self.say(f"repeat {r + 1}/{args.repeats}: {mode:7s} steps: median {statistics.median(base):.3f}s "
                         f"idle, {statistics.median(run['step_times_s'] or [float('nan')]):.3f}s over "
                         f"{len(run['step_times_s'])} steps of a {run['upload_s']:.2f}s upload")
        for s in (*first.values(), *(x for v in saves.values() for x in v)):
            s.pop("files", None)
        self.results.update(modes=modes, first=first, saves=saves, raw_put_s=raw_put, load_s=loads,
                            raw_get_s=raw_get, inflight=inflight)
        return self.results

    def _drop_mode(self, mode: str, err: BaseException, modes: list[str], async_modes: list[str]) -> None:
        from checkpoint.manager import describe_error

        if mode == "off":
            raise err
        text = describe_error(err)[:400]
        self.results["errors"][mode] = text
        self.say(f"{mode} saves FAILED, left out: {text}")
        for lst in (modes, async_modes):
            if mode in lst:
                lst.remove(mode)

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        self.trainer.close()


def _tensors(obj: Any):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def worker_main(args: argparse.Namespace) -> int:
    import logging

    from ftrain.distributed import shutdown_distributed

    logging.basicConfig(level=logging.WARNING, format=f"[rank{os.environ.get('RANK', '?')}] %(levelname)s "
                        "%(name)s: %(message)s")
    bench = None
    try:
        bench = Bench(args)
        results = bench.run()
        if bench.rank == 0:
            Path(args.out).write_text(json.dumps(results))
    finally:
        if bench is not None:
            bench.close()
        shutdown_distributed()
    return 0


# -- driver ---------------------------------------------------------------------------------
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(res: dict[str, Any], state_mb: float) -> dict[str, Any]:
    sync = res["saves"]["off"]
    total_bytes = statistics.median(s["bytes"] for s in sync)
    sync_blocked = _median([s["blocked_s"] for s in sync])
    sync_commit = _median([s["commit_s"] for s in sync])
    raw_put = _median(res["raw_put_s"])
    load, raw_get = _median(res["load_s"]), _median(res["raw_get_s"])
    out: dict[str, Any] = {
        "bench": "checkpoint", "state_mb_requested": state_mb, "bytes": total_bytes,
        "state_bytes_per_rank": res["state_bytes_per_rank"],
        "sync_save_s": sync_commit, "sync_blocked_s": sync_blocked,
        "state_dict_s": _median([s["state_dict_s"] for m in res["saves"].values() for s in m]),
        "sync_save_MBps": total_bytes / sync_commit / 1e6,
        "raw_put_s": raw_put, "raw_put_MBps": total_bytes / raw_put / 1e6,
        "load_s": load, "load_MBps": total_bytes / load / 1e6,
        "raw_get_s": raw_get, "raw_get_MBps": total_bytes / raw_get / 1e6,
        "save_vs_raw": raw_put / sync_commit, "load_vs_raw": raw_get / load,
        "modes": {},
    }
    for mode in res["modes"]:
        if mode == "off":
            continue
        saves = res["saves"][mode]
        blocked = _median([s["blocked_s"] for s in saves])
        commit = _median([s["commit_s"] for s in saves])
        runs = res["inflight"].get(mode, [])
        busy = [t for r in runs for t in r["step_times_s"]]
        idle = [t for r in runs for t in r["baseline_step_times_s"]]
        out["modes"][mode] = {
            "blocked_s": blocked, "blocked_ratio": blocked / sync_blocked,
            "first_blocked_s": res["first"].get(mode, {}).get("blocked_s"),
            "upload_s": commit, "upload_MBps": total_bytes / commit / 1e6, "save_vs_raw": raw_put / commit,
            "blocked_while_training_s": _median([r["blocked_s"] for r in runs]),
            "upload_while_training_s": _median([r["upload_s"] for r in runs]),
            "step_idle_s": _median(idle), "step_inflight_s": _median(busy),
            "steps_inflight": len(busy), "step_slowdown": _median(busy) / _median(idle) if busy and idle else None,
        }
    head = out["modes"].get("thread") or next(iter(out["modes"].values()), None)
    out["blocked_ratio"] = head["blocked_ratio"] if head else None
    out["step_slowdown"] = head["step_slowdown"] if head else None
    out["headline_mode"] = "thread" if "thread" in out["modes"] else next(iter(out["modes"]), None)
    out["raw"] = {k: res[k] for k in ("raw_put_s", "load_s", "raw_get_s")}
    out["raw"]["saves"] = res["saves"]
    out["raw"]["first"] = res["first"]
    out["raw"]["inflight"] = {m: [{k: v for k, v in r.items()} for r in runs] for m, runs in res["inflight"].items()}
    out["errors"] = res["errors"]
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _verdict(name: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    op, target = TARGETS[name]
    ok = value <= target if op == "<=" else value >= target
    return f"target {op} {target:g}: {'met' if ok else 'MISSED'}"


def report(s: dict[str, Any]) -> str:
    mb = s["bytes"] / 1e6
    out = [f"state: {mb:.0f} MB in all files of a step (per rank in memory: "
           + ", ".join(f"{b / 1e6:.0f} MB" for b in s["state_bytes_per_rank"]) + ")", ""]
    rows = [["save (median)", "training blocked", "vs sync", "until committed", "MB/s", "vs raw PUT"]]
    rows.append(["sync (async_mode=off)", f"{s['sync_blocked_s']:.3f} s", "1", f"{s['sync_save_s']:.2f} s",
                 f"{s['sync_save_MBps']:.0f}", f"{s['save_vs_raw']:.2f}"])
    for mode, m in s["modes"].items():
        rows.append([f"async_mode={mode}", f"{m['blocked_s']:.3f} s", f"{m['blocked_ratio']:.2%}",
                     f"{m['upload_s']:.2f} s", f"{m['upload_MBps']:.0f}", f"{m['save_vs_raw']:.2f}"])
    rows.append(["raw s3fs PUT, 2 ranks", "-", "-", f"{s['raw_put_s']:.2f} s", f"{s['raw_put_MBps']:.0f}", "1"])
    out.append(_table(rows))
    out.append("")
    rows = [["load (median)", "wall", "MB/s", "vs raw GET"],
            ["manager.load (verify + DCP read)", f"{s['load_s']:.2f} s", f"{s['load_MBps']:.0f}",
             f"{s['load_vs_raw']:.2f}"],
            ["raw s3fs cat_file, 2 ranks", f"{s['raw_get_s']:.2f} s", f"{s['raw_get_MBps']:.0f}", "1"]]
    out.append(_table(rows))
    out.append("")
    rows = [["steps (median)", "idle step", "step, upload in flight", "slowdown", "steps", "blocked", "upload"]]
    for mode, m in s["modes"].items():
        rows.append([f"async_mode={mode}", f"{m['step_idle_s']:.3f} s", f"{m['step_inflight_s']:.3f} s",
                     f"{m['step_slowdown']:.2f}x" if m["step_slowdown"] else "-", str(m["steps_inflight"]),
                     f"{m['blocked_while_training_s']:.3f} s", f"{m['upload_while_training_s']:.2f} s"])
    out.append(_table(rows))
    out.append("")
    hm = s["headline_mode"]
    out.append(f"(a) blocked_ratio ({hm}) = {s['blocked_ratio']:.2%}  [{_verdict('blocked_ratio', s['blocked_ratio'])}]"
               if s["blocked_ratio"] is not None else "(a) blocked_ratio: no async mode worked")
    out.append(f"(b) save_vs_raw (sync)  = {s['save_vs_raw']:.2f}  [{_verdict('save_vs_raw', s['save_vs_raw'])}]")
    out.append(f"(c) load_vs_raw         = {s['load_vs_raw']:.2f}  [{_verdict('load_vs_raw', s['load_vs_raw'])}]")
    out.append(f"(d) step_slowdown ({hm}) = {s['step_slowdown']:.2f}x" if s["step_slowdown"] else "(d) step_slowdown: -")
    for mode, err in s["errors"].items():
        out.append(f"async_mode={mode} FAILED: {err}")
    return "\n".join(out)


NOTES = """\
notes:
- One host, 2 shared cores: 2 training ranks, the upload threads/processes and SeaweedFS all
  compete for them, and "network" is loopback. Raw PUT/GET and our saves/loads run under the
  same conditions (idle training), so the ratios are fair; the absolute MB/s are not a network's.
- blocked = the training thread's time in state_dict() + CheckpointManager.save() (state-dict
  building is the same in every mode). In async modes it is staging (a CPU copy of this rank's
  state) plus DCP's setup; a sync save also plans, serializes, digests, uploads and commits.
- A save's bytes are the step's files (shards + .metadata + manifest.json). Sync saves and raw
  PUT both end when the last byte is stored (sync: manifest committed, retention applied).
- manager.load reads every byte twice: verification streams each file once (files split across
  ranks), then DCP reads the shards again; raw GET reads each file once. Its ratio cannot pass
  0.5 by construction unless the two reads overlap or the verified bytes are reused.
- In-flight steps run while both ranks' uploads compete with training for the 2 cores; the
  slowdown is CPU contention, which a GPU host (training on the GPU, spare CPU cores) avoids."""


def run_job(args: argparse.Namespace, workdir: Path, s3: Any) -> tuple[int, str, Path]:
    out_path = workdir / "results.json"
    url = s3.url(f"bench-{int(time.time())}")
    env = dict(os.environ)
    env.update(s3.env())
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", FTRAIN_LOG_LEVEL="WARNING",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--worker", "--config", str(workdir / "config.toml"), "--url", url,
           "--out", str(out_path), "--repeats", str(args.repeats)] + (["--no-process"] if args.no_process else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=workdir, start_new_session=True)
    kept: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(MARK):
                print("  " + line[len(MARK):], end="", flush=True)
            else:
                kept.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        kept.append(f"timed out after {args.timeout_s:.0f}s\n")
    finally:
        if proc.poll() is None:
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        else:  # the agent is gone; kill any worker or checkpoint daemon it left behind
            for pid in _descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        reader.join(timeout=5)
    return proc.returncode, "".join(kept), out_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mb", type=float, default=300, help="model + AdamW state in MB (default 300)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each measurement (default 3)")
    p.add_argument("--no-process", action="store_true", help="skip async_mode=process")
    p.add_argument("--timeout-s", type=float, default=420, help="limit for the torchrun job (default 420)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.worker:
        return worker_main(args)

    from checkpoint.seaweed import SeaweedS3

    started = time.perf_counter()
    shape = model_shape(args.state_mb)
    params = num_params(shape)
    train = {"global_batch_size": 4, "micro_batch_size": 2}
    print(f"model: GPT {params / 1e6:.2f}M params {shape}, fp32 + AdamW = {12 * params / 1e6:.0f} MB; fsdp on 2 "
          f"ranks (gloo, CPU), global batch {train['global_batch_size']} x seq {shape['seq_len']}; "
          f"{args.repeats} repeats; {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="ftrain-bench-ckpt-") as tmp:
        workdir = Path(tmp)
        text = config_toml(shape, train, steps=100_000) + '\n[parallel]\nstrategy = "fsdp"\n'
        (workdir / "config.toml").write_text(text)
        with SeaweedS3(workdir / "s3") as s3:
            print(f"SeaweedFS {s3.endpoint_url} ready in {s3.last_ready_s:.1f}s", flush=True)
            code, log_text, out_path = run_job(args, workdir, s3)
            s3_rss = s3.rss_bytes()
        if code != 0 or not out_path.exists():
            tail = "".join(log_text.splitlines(keepends=True)[-40:])
            print(f"benchmark job failed (exit {code}):\n{tail}", file=sys.stderr)
            return 1
        res = json.loads(out_path.read_text())
    summary = summarise(res, args.state_mb)
    summary.update(num_params=params, shape=shape, repeats=args.repeats, cores=os.cpu_count(),
                   seaweed_rss_bytes=s3_rss, wall_s=round(time.perf_counter() - started, 1))
    print()
    print(report(summary))
    print(NOTES)
    print(f"wall time {summary['wall_s']:.0f}s")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
