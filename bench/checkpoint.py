"""Checkpoint cost on a real S3 server: training pause, save and load throughput against raw
s3fs PUT/GET of the same bytes, and how much an upload in flight slows training steps.

    python bench/checkpoint.py [--state-mb 300] [--repeats 3] [--no-process] [--timeout-s 420] [--smoke]

One SeaweedFS (``ftrain.testbed.seaweed.SeaweedS3``, loopback) serves the whole run; every
measurement writes under a key prefix of its own. One ``torchrun --standalone
--nproc-per-node 2`` job (gloo, CPU, FSDP2, OMP_NUM_THREADS=1, OMP_WAIT_POLICY=PASSIVE) builds
the model and AdamW with ``ftrain.train.Trainer``, takes a few steps so the optimizer state
exists, and then, side by side in the same processes:

(a) blocked time: the training thread's wall time in ``state_dict()`` + ``CheckpointManager.save``
    with ``async_mode`` ``thread`` / ``process`` (called between steps, as the train loop does),
    over the same for ``off`` (a blocking save, training idle). Each async mode's first save
    (async process-group creation, the checkpoint process start) is a warm-up, reported apart,
    and so is the first sync save (S3 connections, lazy imports).
(b) save throughput: bytes of every file of the step (shards, ``.metadata``, ``manifest.json``)
    over the wall time from ``save()`` until the manifest is committed (a sync save returns
    then), against both ranks concurrently ``pipe_file``-ing buffers of exactly their files'
    sizes (raw PUT, same s3fs client and settings). Async uploads are reported too, but they
    share the cores with training.
(c) verified load: ``CheckpointManager.load`` (verify every digest, then DCP read) of a sync
    save's step, against both ranks concurrently reading that step's files raw: ``cat_file``
    (one GET per file) and ``cat_ranges`` of 16 MiB pieces (concurrent ranged GETs). The ratio
    is taken against the faster of the two.
(d) step slowdown: median step time while an async upload is in flight (the loop polls
    ``manager.poll()`` and keeps stepping until no rank has an upload in flight) over the
    median step time of the steps just before, with no upload.

Every figure is the slowest rank's (ranks leave each measurement through a collective), each
measurement is repeated ``--repeats`` times in interleaved order, and medians are reported.
Prints a table with absolute figures and ratios, then one final JSON line. ``--smoke`` (the
test suite's run) is the same run with a few MB of state and one repeat.

**Size.** Over 600 lines: one benchmark of several measurements that share one S3 server and one
state; its summary and report are :mod:`bench.lib.checkpoint_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# Run as a script, this file's directory comes first on sys.path, and this file (bench/checkpoint.py)
# would shadow the ``checkpoint`` package: drop the directory, put the repository first.
# The other benches are then ``bench.<name>`` (a namespace package under the repository).
sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() not in (BENCH, REPO)]

from bench.lib.checkpoint_report import NOTES, RANGE_BYTES, report, summarise
from bench.strategies import config_toml
from ftrain.agents.workers import PidTracker, signal_pids

#: Lines a worker prints for the driver to pass through; everything else is kept for errors.
MARK = "[bench] "
#: Steps before the measurements (AdamW state exists after the first).
WARMUP_STEPS = 3
#: Baseline steps per repeat of (d), and the most steps one in-flight upload may span.
BASELINE_STEPS = 5
MAX_INFLIGHT_STEPS = 80
#: --smoke: a few MB of state (4 blocks of width 64, vocabulary 1024), one repeat, both async modes.
SMOKE_STATE_MB, SMOKE_REPEATS, SMOKE_TIMEOUT_S = 4.0, 1, 180.0


# -- the model: ~--state-mb of fp32 params + AdamW m and v ---------------------------------
def model_shape(state_mb: float) -> dict[str, int]:
    """A GPT whose params + AdamW state (12 bytes/param) come near ``state_mb`` MB: the first
    width (preferring 512) that gives 2-16 blocks, with a vocabulary of 4096 (smaller ones only
    for states under ~17 MB, which 4096 cannot reach)."""
    seq = 64
    target = state_mb * 1e6 / 12
    for vocab, widths in ((4096, (512, 384, 256, 768, 1024, 1536, 2048, 128)), (1024, (128, 64)), (256, (64,))):
        for d in widths:
            block = 12 * d * d + 13 * d
            embed = 2 * vocab * d + seq * d + 2 * d
            n = round((target - embed) / block)
            if 2 <= n <= 16:
                return dict(vocab_size=vocab, seq_len=seq, n_layer=n, n_head=d // 64 or 1, d_model=d)
    raise SystemExit(f"--state-mb {state_mb}: no GPT shape here gives that (try 2-10000)")


def num_params(shape: dict[str, int]) -> int:
    d, v, s, n = shape["d_model"], shape["vocab_size"], shape["seq_len"], shape["n_layer"]
    return n * (12 * d * d + 13 * d) + 2 * v * d + s * d + 2 * d


def _host_bytes() -> tuple[int, int]:
    """This process's resident set and its peak since the last :func:`_reset_peak` (VmRSS, VmHWM),
    the heap's free pages handed back first (glibc's ``malloc_trim``): what is held, not what
    malloc kept of what was freed."""
    from ftrain.observability.metrics import resident_bytes
    from ftrain.recovery.tier_host import give_back_freed

    give_back_freed()
    return resident_bytes(), resident_bytes(peak=True)


def _reset_peak() -> bool:
    """Start VmHWM afresh (Linux's clear_refs 5); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def _own_bytes(tier: Any, rank: int) -> int:
    """The bytes of this rank's own files of the tier's newest snapshot (DCP names a rank's
    shard files ``__<rank>_<n>.distcp``): the state the tier's host memory is measured against."""
    files = tier.snapshots[-1].manifest.files
    return max(1, sum(e.size_bytes for name, e in files.items() if name.startswith(f"__{rank}_")))


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
        self.cache_dir = ""  #: this rank's local cache (the ``cached`` manager's), removed at close
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
        """The manager of ``mode``: an async mode, ``off`` (sync saves), or ``cached`` (sync saves
        that also fill a local cache: a directory of this rank's own, as on a node of its own)."""
        from ftrain.checkpoint.manager import CheckpointManager

        if mode not in self.managers:
            cache = ""
            if mode == "cached":
                self.cache_dir = tempfile.mkdtemp(prefix=f"ftrain-bench-cache-rank{self.rank}-")
                cache = self.cache_dir
            self.managers[mode] = CheckpointManager(
                url=f"{self.args.url}/save-{mode}",
                async_mode="off" if mode == "cached" else mode,
                keep_last=1000,
                gc_grace_s=1e9,
                device_type="cpu",
                local_cache_dir=cache,
            )
        return self.managers[mode]

    def step_files(self, mode: str, step: int) -> dict[str, int]:
        """``{file name: size}`` of a committed step (manifest included), agreed by all ranks."""
        from ftrain.checkpoint.manifest import MANIFEST_NAME, step_dir_name

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
            raise RuntimeError(
                f"{mode} save of step {step} was not committed: "
                f"{self.manager(mode).status.last_error or 'no error recorded'}"
            )
        return box[0]

    def my_files(self, files: dict[str, int]) -> list[str]:
        """Files this rank writes in a DCP save (``__<rank>_<n>.distcp``); the rest are rank 0's."""
        owners = {
            name: int(name[2:].split("_")[0]) if name.startswith("__") and name.endswith(".distcp") else 0
            for name in files
        }
        return sorted(n for n, r in owners.items() if r == self.rank)

    # -- (a) + (b): a blocking save ---------------------------------------------------------
    def sync_save(self, mode: str = "off") -> dict[str, Any]:
        mgr = self.manager(mode)
        step, self.next_step = self.next_step, self.next_step + 1
        fields = self.ckpt.fields()
        self.dist.barrier()
        t0 = time.perf_counter()
        sd = self.ckpt.state()
        t1 = time.perf_counter()
        mgr.save(step, sd, fields)
        t2 = time.perf_counter()
        rows = self.gather((t1 - t0, t2 - t0))
        files = self.step_files(mode, step)
        return {
            "step": step,
            "state_dict_s": max(r[0] for r in rows),
            "blocked_s": max(r[1] for r in rows),
            "bytes": sum(files.values()),
            "files": files,
        }

    # -- (b) raw PUT, (c) raw GET and verified load -------------------------------------------
    def raw_put(self, files: dict[str, int], tag: str) -> float:
        from ftrain.checkpoint.storage import Storage

        storage = Storage(f"{self.args.url}/raw-put/{tag}")
        import numpy as np

        rng = np.random.default_rng(self.rank)
        payload = [(storage.path(name), rng.bytes(files[name])) for name in self.my_files(files)]

        def put() -> None:
            for path, data in payload:
                storage.fs.pipe_file(path, data)

        return self.timed(put)[1]

    def raw_get(self, mode: str, step: int, files: dict[str, int], how: str) -> float:
        """Both ranks read their files concurrently: ``cat_file`` (one GET per file) or ``ranges``
        (``cat_ranges`` of RANGE_BYTES pieces, fetched concurrently: s3fs's multi-stream read)."""
        from ftrain.checkpoint.manifest import step_dir_name

        storage = self.manager(mode).storage
        names = self.my_files(files)
        paths = [storage.path(step_dir_name(step), name) for name in names]

        def get() -> int:
            if how == "cat_file":
                return sum(len(storage.fs.cat_file(p)) for p in paths)
            starts = [
                (p, o, min(o + RANGE_BYTES, files[n]))
                for p, n in zip(paths, names, strict=True)
                for o in range(0, max(files[n], 1), RANGE_BYTES)
            ]
            return sum(
                len(b)
                for b in storage.fs.cat_ranges([x[0] for x in starts], [x[1] for x in starts], [x[2] for x in starts])
            )

        got, seconds = self.timed(get)
        mine = sum(files[n] for n in names)
        if got != mine:
            raise RuntimeError(f"raw GET ({how}) read {got} bytes, expected {mine}")
        return seconds

    def verified_load(self, mode: str, step: int) -> float:
        from ftrain.checkpointing import apply_loaded, load_target

        holder: dict[str, Any] = {}

        def build(manifest: Any) -> dict[str, Any]:
            holder["sd"] = load_target(self.trainer.par, self.rank, manifest)
            return holder["sd"]

        manifest, seconds = self.timed(lambda: self.manager(mode).load(build, load_step=step))
        if manifest is None or manifest.step != step:
            raise RuntimeError(f"load of step {step} returned {manifest}")
        # as resume() does (outside the timing): the step's state into model, optimizer, cursor, RNG
        apply_loaded(self.trainer.par, self.trainer.cursor, self.rank, manifest, holder["sd"])
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

    def save_while_training(self, mode: str) -> dict[str, Any]:
        """As the train loop does: a step, then ``state_dict()`` + ``save()`` (the pause), then
        steps that poll the manager until no rank has the upload in flight."""
        mgr = self.manager(mode)
        step, self.next_step = self.next_step, self.next_step + 1
        fields = self.ckpt.fields()
        waited: list[float] = []

        def wait_staged() -> None:  # as the train loop does, before the next update; it blocks too
            w = time.perf_counter()
            mgr.wait_staged()
            waited.append(time.perf_counter() - w)

        self.trainer.staging_waits[:] = [wait_staged]
        self.dist.barrier()
        t0 = time.perf_counter()
        mgr.save(step, self.ckpt.state(), fields)
        blocked = time.perf_counter() - t0
        times, done_at = [], None
        for _ in range(MAX_INFLIGHT_STEPS):
            inflight = mgr.poll().in_flight_step >= 0
            if not inflight and done_at is None:
                done_at = time.perf_counter()  # the train loop learns of the commit here
            dt, any_inflight = self._step(inflight)
            if not any_inflight:  # no rank had an upload in flight when this step began
                break
            times.append(dt)
        mgr.wait()
        self.trainer.staging_waits[:] = []
        blocked += sum(waited)  # the save's call, and the wait for its copy before the next update
        upload_s = (done_at or time.perf_counter()) - t0
        ok = all(self.gather(mgr.status.last_committed_step == step))
        files = self.step_files(mode, step) if ok else {}
        return {
            "step": step,
            "blocked_s": max(self.gather(blocked)),
            "upload_s": max(self.gather(upload_s)),
            "bytes": sum(files.values()),
            "step_times_s": times,
            "ok": ok,
        }

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args = self.args
        self.steps_baseline(WARMUP_STEPS)
        sd_bytes = sum(t.numel() * t.element_size() for t in _tensors(self.ckpt.state()))
        self.results["state_bytes_per_rank"] = self.gather(sd_bytes)
        # Idle training: blocking saves against raw PUT, verified loads against raw GET.
        sync: list[dict[str, Any]] = []
        raw_put: list[float] = []
        loads: list[float] = []
        raw_get: dict[str, list[float]] = {"cat_file": [], "ranges": []}
        first = self.sync_save()  # first-call costs: lazy imports, S3 connections, DCP caches
        first.pop("files")
        self.results["first_sync"] = first
        self.say(f"warm-up sync save {first['blocked_s']:.2f}s (left out)")
        for r in range(args.repeats):
            s = self.sync_save()
            sync.append(s)
            raw_put.append(self.raw_put(s["files"], f"r{r}"))
            # rotate the order so no read always comes first after the write
            order = ["load", "cat_file", "ranges"]
            for what in order[r % 3 :] + order[: r % 3]:
                if what == "load":
                    loads.append(self.verified_load("off", s["step"]))
                else:
                    raw_get[what].append(self.raw_get("off", s["step"], s["files"], what))
            self.say(
                f"{r + 1}/{args.repeats} sync save {s['blocked_s']:.2f}s ({s['bytes'] / 1e6:.0f} MB), "
                f"raw PUT {raw_put[-1]:.2f}s | verified load {loads[-1]:.2f}s, raw GET cat_file "
                f"{raw_get['cat_file'][-1]:.2f}s, ranges {raw_get['ranges'][-1]:.2f}s"
            )
        # Training: async saves with steps running while they upload; run 0 is the warm-up
        # (async group creation, the checkpoint process start), reported apart.
        async_modes = ["thread"] + ([] if args.no_process else ["process"])
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in async_modes}
        for r in range(args.repeats + 1):
            for mode in list(async_modes):
                base = self.steps_baseline(BASELINE_STEPS)
                try:
                    run = self.save_while_training(mode)
                except Exception as e:  # noqa: BLE001 - reported; the mode is dropped
                    run = {"ok": False, "error": e}
                if not run["ok"]:
                    self._drop_mode(
                        mode, run.get("error") or RuntimeError(self.manager(mode).status.last_error), async_modes
                    )
                    continue
                run.update(baseline_step_times_s=base, warmup=r == 0)
                runs[mode].append(run)
                busy = run["step_times_s"]
                self.say(
                    f"{'warm-up' if r == 0 else f'{r}/{args.repeats}'} {mode} save while training: "
                    f"blocked {run['blocked_s']:.3f}s, upload {run['upload_s']:.2f}s; step "
                    f"{statistics.median(base):.3f}s idle, {statistics.median(busy or [float('nan')]):.3f}s "
                    f"over {len(busy)} steps in flight"
                )
        # The local cache: sync saves that also write it, and loads that read it first.
        cached_saves, cached_loads, from_cache = [], [], []
        for _ in range(args.repeats):
            c = self.sync_save("cached")
            cached_saves.append(c["blocked_s"])
            cached_loads.append(self.verified_load("cached", c["step"]))
            read, cached = map(sum, zip(*self.gather(self.manager("cached").load_reads), strict=True))
            from_cache.append(cached / read)
        self.results.update(cached_save_s=cached_saves, cached_load_s=cached_loads, cached_share=from_cache)
        save_s, load_s = statistics.median(cached_saves), statistics.median(cached_loads)
        self.say(f"local cache: sync save {save_s:.2f}s, load {load_s:.2f}s")
        try:
            self.results["memory_tier"] = self.memory_tier(args.repeats)
        except Exception as e:  # noqa: BLE001 - reported; the other figures stand
            self.results["errors"]["memory_tier"] = f"{type(e).__name__}: {e}"[:400]
            self.say(f"memory tier FAILED: {e}")
        for s in sync:
            s.pop("files", None)
        self.results.update(sync=sync, raw_put_s=raw_put, load_s=loads, raw_get_s=raw_get, runs=runs)
        return self.results

    # -- (e) the memory tier -----------------------------------------------------------------
    def memory_tier(self, repeats: int) -> dict[str, Any]:
        """Snapshots into the memory tier (each rank its own shards and its buddy's: the ranks
        stand for 2 nodes of 1), then a recovery: rank 1 comes back as a new process (its memory
        empty) and every rank restores from the tier, rank 1's shards from rank 0's copy."""
        from ftrain.config import load_config
        from ftrain.recovery.memory_tier import MemoryTier

        cfg = load_config(self.args.config, ["--checkpoint.memory_interval=1"])
        tier = MemoryTier(cfg)
        tier.join_round(self.rank, self.world, 1, "cpu")
        view, parts = self.trainer.tier_view_of(tier), self.trainer.parts  # what the tier sees of the trainer
        blocked, seconds, peaks, between = [], [], [], []
        self.dist.barrier()
        base = _host_bytes()[0]  # this rank's RSS before the tier holds anything
        for _ in range(repeats + 1):  # the first is a warm-up (stager buffers, DCP caches)
            step, self.next_step = self.next_step, self.next_step + 1
            waited: list[float] = []
            self.trainer.staging_waits[:] = [lambda w=waited: w.append(tier.wait_staged())]
            self.dist.barrier()
            peak_known = _reset_peak()
            t0 = time.perf_counter()
            view.mark(step, parts, parts.user_state(step), 0.0)
            tier.maybe_snapshot(step, view, checkpointed=True)
            b = time.perf_counter() - t0
            self._step(False)  # the next step runs beside the copy; its update waits for it
            b += sum(waited)
            self.trainer.staging_waits[:] = []
            tier.wait()
            blocked.append(max(self.gather(b)))
            seconds.append(max(self.gather(time.perf_counter() - t0)))
            rss, hwm = _host_bytes()
            own = _own_bytes(tier, self.rank)
            # host bytes over the state (this rank's own files of a snapshot), the worst rank's
            between.append(max(self.gather((rss - base) / own)))
            peaks.append(max(self.gather((hwm - base) / own if peak_known else float("nan"))))
        restores = []
        for _ in range(repeats):
            held = [s.step for s in tier.snapshots]
            fresh = MemoryTier(cfg) if self.rank == 1 else tier
            fresh.join_round(self.rank, self.world, 1, "cpu")  # a new round: its group, on both ranks
            seen = self.trainer.tier_view_of(fresh)
            step, restore_s = self.timed(lambda t=fresh, v=seen: t.restore(v, committed_step=-1))
            if step is None or step != max(held or [-1]):
                raise RuntimeError(f"memory-tier restore gave step {step}, the newest snapshot is {held}")
            restores.append(restore_s)
            if fresh is not tier:
                fresh.close()
        tier.close()
        self.say(
            f"memory tier: snapshot blocked {statistics.median(blocked[1:]):.3f}s, complete in "
            f"{statistics.median(seconds[1:]):.2f}s; restore with rank 1 empty {statistics.median(restores):.2f}s"
        )
        self.say(
            f"memory tier host memory over the state (own files {_own_bytes(tier, self.rank) / 1e6:.0f} MB): "
            f"{statistics.median(between):.2f}x between snapshots, {max(peaks):.2f}x at the peak of one"
        )
        return {
            "blocked_s": blocked[1:],
            "seconds": seconds[1:],
            "restore_s": restores,
            "warmup_s": seconds[0],
            "host_between_x": between,
            "host_peak_x": peaks,
        }

    def _drop_mode(self, mode: str, err: BaseException, async_modes: list[str]) -> None:
        from ftrain.checkpoint.loading import describe_error

        text = describe_error(err)[:400]
        self.results["errors"][mode] = text
        self.say(f"async_mode={mode} FAILED, left out: {text}")
        async_modes.remove(mode)

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        if self.cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
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

    logging.basicConfig(
        level=logging.WARNING, format=f"[rank{os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s"
    )
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
def run_job(args: argparse.Namespace, workdir: Path, s3: Any) -> tuple[int, str, Path]:
    out_path = workdir / "results.json"
    url = s3.url(f"bench-{int(time.time())}")
    env = dict(os.environ)
    env.update(s3.env())
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        FTRAIN_LOG_LEVEL="WARNING",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(Path(__file__).resolve()),
        "--worker",
        "--config",
        str(workdir / "config.toml"),
        "--url",
        url,
        "--out",
        str(out_path),
        "--repeats",
        str(args.repeats),
    ] + (["--no-process"] if args.no_process else [])
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir, start_new_session=True
    )
    kept: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(MARK):
                print("  " + line[len(MARK) :], end="", flush=True)
            else:
                kept.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    # Workers (own sessions) and DCP's checkpoint daemon are re-parented if torchrun dies first,
    # so remember every descendant seen while the job runs, with its start time (PID reuse).
    seen = PidTracker(proc.pid)
    deadline = time.monotonic() + args.timeout_s
    try:
        while proc.poll() is None:
            seen.refresh()
            if time.monotonic() > deadline:
                kept.append(f"timed out after {args.timeout_s:.0f}s\n")
                break
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
    finally:
        seen.refresh()
        signal_pids(seen.live(), signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(timeout=5)
    return proc.returncode, "".join(kept), out_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mb", type=float, default=300, help="model + AdamW state in MB (default 300)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each measurement (default 3)")
    p.add_argument("--no-process", action="store_true", help="skip async_mode=process")
    p.add_argument("--timeout-s", type=float, default=420, help="limit for the torchrun job (default 420)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"the test suite's run: --state-mb {SMOKE_STATE_MB:g} --repeats {SMOKE_REPEATS}",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke and not args.worker:
        args.state_mb, args.repeats = SMOKE_STATE_MB, SMOKE_REPEATS
        args.timeout_s = min(args.timeout_s, SMOKE_TIMEOUT_S)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.worker:
        return worker_main(args)

    from ftrain.testbed.seaweed import SeaweedS3

    started = time.perf_counter()
    shape = model_shape(args.state_mb)
    params = num_params(shape)
    train = {"global_batch_size": 2, "micro_batch_size": 1}
    print(
        f"model: GPT {params / 1e6:.2f}M params {shape}, fp32 + AdamW = {12 * params / 1e6:.0f} MB; fsdp on 2 "
        f"ranks (gloo, CPU), global batch {train['global_batch_size']} x seq {shape['seq_len']}; "
        f"{args.repeats} repeats; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start",
        flush=True,
    )
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
    summary.update(
        num_params=params,
        shape=shape,
        repeats=args.repeats,
        smoke=args.smoke,
        cores=os.cpu_count(),
        seaweed_rss_bytes=s3_rss,
        wall_s=round(time.perf_counter() - started, 1),
    )
    print()
    print(report(summary))
    print(NOTES)
    load_1m = os.getloadavg()[0]
    summary["load_average_end"] = load_1m
    print(
        f"wall time {summary['wall_s']:.0f}s; load average {load_1m:.1f} at the end (this run alone keeps it ~3-4: "
        "more means other jobs shared the cores)"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
