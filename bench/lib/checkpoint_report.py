"""bench/checkpoint.py's results: the summary (every figure, its JSON line) from the raw
measurements the workers return, and the tables and verdicts printed from it."""

from __future__ import annotations

import statistics
from typing import Any

#: Piece size of the multi-stream raw GET (s3fs fetches a file's pieces concurrently).
RANGE_BYTES = 16 << 20
TARGETS = {"blocked_ratio": ("<=", 0.01), "save_vs_raw": (">=", 0.9), "load_vs_raw": (">=", 0.8)}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(res: dict[str, Any], state_mb: float) -> dict[str, Any]:
    sync = res["sync"]
    total_bytes = statistics.median(s["bytes"] for s in sync)
    sync_s = _median([s["blocked_s"] for s in sync])
    raw_put = _median(res["raw_put_s"])
    load = _median(res["load_s"])
    get_cat, get_ranges = _median(res["raw_get_s"]["cat_file"]), _median(res["raw_get_s"]["ranges"])
    raw_get = min(get_cat, get_ranges)  # the ratio is taken against the faster raw read
    out: dict[str, Any] = {
        "bench": "checkpoint",
        "state_mb_requested": state_mb,
        "bytes": total_bytes,
        "state_bytes_per_rank": res["state_bytes_per_rank"],
        "sync_save_s": sync_s,
        "first_sync_save_s": res["first_sync"]["blocked_s"],
        "state_dict_s": _median([s["state_dict_s"] for s in sync]),
        "sync_save_MBps": total_bytes / sync_s / 1e6,
        "raw_put_s": raw_put,
        "raw_put_MBps": total_bytes / raw_put / 1e6,
        "load_s": load,
        "load_MBps": total_bytes / load / 1e6,
        "raw_get_s": raw_get,
        "raw_get_MBps": total_bytes / raw_get / 1e6,
        "raw_get_cat_file_s": get_cat,
        "raw_get_ranges_s": get_ranges,
        "save_vs_raw": raw_put / sync_s,
        "load_vs_raw": raw_get / load,
        "load_vs_raw_cat_file": get_cat / load,
        "modes": {},
    }
    for mode, runs in res["runs"].items():
        warm = [r for r in runs if r["warmup"]]
        runs = [r for r in runs if not r["warmup"]]
        if not runs:
            continue
        busy = [t for r in runs for t in r["step_times_s"]]
        idle = [t for r in runs for t in r["baseline_step_times_s"]]
        blocked, upload = _median([r["blocked_s"] for r in runs]), _median([r["upload_s"] for r in runs])
        out["modes"][mode] = {
            "blocked_s": blocked,
            "blocked_ratio": blocked / sync_s,
            "first_blocked_s": warm[0]["blocked_s"] if warm else None,
            "first_upload_s": warm[0]["upload_s"] if warm else None,
            "upload_s": upload,
            "upload_MBps": total_bytes / upload / 1e6,
            "upload_vs_raw": raw_put / upload,
            "step_idle_s": _median(idle),
            "step_inflight_s": _median(busy),
            "steps_idle": len(idle),
            "steps_inflight": len(busy),
            "step_slowdown": _median(busy) / _median(idle) if busy and idle else None,
        }
    head = "thread" if "thread" in out["modes"] else next(iter(out["modes"]), None)
    out["headline_mode"] = head
    out["blocked_ratio"] = out["modes"][head]["blocked_ratio"] if head else None
    out["step_slowdown"] = out["modes"][head]["step_slowdown"] if head else None
    out["step_slowdown_during_upload"] = out["step_slowdown"]  # (d), under the name the docs use
    cached_load = _median(res["cached_load_s"])
    out["local_cache"] = {
        "save_s": _median(res["cached_save_s"]),
        "load_s": cached_load,
        "save_vs_without": sync_s / _median(res["cached_save_s"]),
        "share_read_from_cache": _median(res["cached_share"]),
    }
    out["local_cache_load_speedup_vs_s3"] = load / cached_load
    tier = res.get("memory_tier")
    if tier:
        restore = _median(tier["restore_s"])
        out["memory_tier"] = {
            "snapshot_blocked_s": _median(tier["blocked_s"]),
            "snapshot_s": _median(tier["seconds"]),
            "restore_s": restore,
            # host memory over the rank's state (RSS; its own files of a snapshot)
            "host_between_x": _median(tier["host_between_x"]),
            "host_peak_x": max(tier["host_peak_x"]),
            "snapshot_blocked_vs_step": _median(tier["blocked_s"]) / out["modes"][head]["step_idle_s"]
            if head
            else None,
        }
        out["memory_tier_load_speedup_vs_s3"] = load / restore
    else:
        out["memory_tier"], out["memory_tier_load_speedup_vs_s3"] = None, None
    out["spread_s"] = {
        "sync_save": _spread([x["blocked_s"] for x in sync]),
        "raw_put": _spread(res["raw_put_s"]),
        "load": _spread(res["load_s"]),
        "raw_get_cat_file": _spread(res["raw_get_s"]["cat_file"]),
        "raw_get_ranges": _spread(res["raw_get_s"]["ranges"]),
    }
    for mode, runs in res["runs"].items():
        measured = [r for r in runs if not r["warmup"]]
        out["spread_s"][f"{mode}_blocked"] = _spread([r["blocked_s"] for r in measured])
        out["spread_s"][f"{mode}_upload"] = _spread([r["upload_s"] for r in measured])
    out["samples"] = {k: res[k] for k in ("sync", "raw_put_s", "load_s", "raw_get_s", "runs")}
    out["errors"] = res["errors"]
    return out


def _spread(xs: list[float]) -> list[float]:
    return [min(xs), max(xs)] if xs else []


def _range(pair: list[float], fmt: str = "{:.2f}") -> str:
    return (fmt.format(pair[0]) + "-" + fmt.format(pair[1])) if pair else "-"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        lines.append("  ".join(cells))
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
    out = [
        f"state: {s['bytes'] / 1e6:.0f} MB in the files of a step; per rank in memory "
        + ", ".join(f"{b / 1e6:.0f} MB" for b in s["state_bytes_per_rank"])
        + f"; state_dict() {s['state_dict_s'] * 1e3:.0f} ms",
        "",
    ]
    sp = s["spread_s"]
    rows = [
        ["save (median of repeats)", "training blocked", "vs sync", "until committed", "range", "MB/s", "vs raw PUT"],
        [
            "sync (async_mode=off), idle",
            f"{s['sync_save_s']:.3f} s",
            "1",
            f"{s['sync_save_s']:.2f} s",
            _range(sp["sync_save"]),
            f"{s['sync_save_MBps']:.0f}",
            f"{s['save_vs_raw']:.2f}",
        ],
    ]
    for mode, m in s["modes"].items():
        rows.append(
            [
                f"async_mode={mode}, training",
                f"{m['blocked_s']:.3f} s",
                f"{m['blocked_ratio']:.2%}",
                f"<= {m['upload_s']:.2f} s",
                _range(sp[f"{mode}_upload"]),
                f"{m['upload_MBps']:.0f}",
                f"{m['upload_vs_raw']:.2f}",
            ]
        )
    rows.append(
        [
            "raw s3fs pipe_file, 2 ranks, idle",
            "-",
            "-",
            f"{s['raw_put_s']:.2f} s",
            _range(sp["raw_put"]),
            f"{s['raw_put_MBps']:.0f}",
            "1",
        ]
    )
    out += [_table(rows), f"warm-up, left out: first sync save {s['first_sync_save_s']:.2f} s", ""]
    rows = [
        ["load (median of repeats), idle", "wall", "range", "MB/s", "vs best raw GET"],
        [
            "manager.load (verify + DCP read)",
            f"{s['load_s']:.2f} s",
            _range(sp["load"]),
            f"{s['load_MBps']:.0f}",
            f"{s['load_vs_raw']:.2f}",
        ],
        [
            "raw s3fs cat_file, 2 ranks",
            f"{s['raw_get_cat_file_s']:.2f} s",
            _range(sp["raw_get_cat_file"]),
            f"{s['bytes'] / s['raw_get_cat_file_s'] / 1e6:.0f}",
            f"{s['raw_get_s'] / s['raw_get_cat_file_s']:.2f}",
        ],
        [
            f"raw s3fs cat_ranges {RANGE_BYTES >> 20} MiB, 2 ranks",
            f"{s['raw_get_ranges_s']:.2f} s",
            _range(sp["raw_get_ranges"]),
            f"{s['bytes'] / s['raw_get_ranges_s'] / 1e6:.0f}",
            f"{s['raw_get_s'] / s['raw_get_ranges_s']:.2f}",
        ],
    ]
    out += [_table(rows), ""]
    rows = [
        [
            "training steps (median)",
            "no upload",
            "upload in flight",
            "slowdown",
            "steps",
            "first save: blocked",
            "upload",
        ]
    ]
    for mode, m in s["modes"].items():
        first = (
            (f"{m['first_blocked_s']:.3f} s", f"{m['first_upload_s']:.2f} s") if m["first_blocked_s"] else ("-", "-")
        )
        rows.append(
            [
                f"async_mode={mode}",
                f"{m['step_idle_s']:.3f} s",
                f"{m['step_inflight_s']:.3f} s",
                f"{m['step_slowdown']:.2f}x" if m["step_slowdown"] else "-",
                f"{m['steps_idle']}/{m['steps_inflight']}",
                *first,
            ]
        )
    out += [_table(rows), ""]
    hm = s["headline_mode"]
    if s["blocked_ratio"] is not None:
        out.append(
            f"(a) blocked_ratio ({hm})   = {s['blocked_ratio']:.2%}   [{_verdict('blocked_ratio', s['blocked_ratio'])}]"
        )
    else:
        out.append("(a) blocked_ratio: no async mode worked")
    out.append(f"(b) save_vs_raw (sync)     = {s['save_vs_raw']:.2f}    [{_verdict('save_vs_raw', s['save_vs_raw'])}]")
    out.append(
        f"(c) load_vs_raw            = {s['load_vs_raw']:.2f}    [{_verdict('load_vs_raw', s['load_vs_raw'])}] "
        f"(against cat_file alone: {s['load_vs_raw_cat_file']:.2f})"
    )
    if s["step_slowdown"] is not None:
        out.append(f"(d) step_slowdown ({hm})   = {s['step_slowdown']:.2f}x")
    t = s.get("memory_tier")
    if t:
        share = f" ({t['snapshot_blocked_vs_step']:.1%} of an idle step)" if t["snapshot_blocked_vs_step"] else ""
        out.append(
            f"(e) memory tier: a snapshot blocks {t['snapshot_blocked_s'] * 1e3:.0f} ms{share}, is complete "
            f"(buddy copy checked) in {t['snapshot_s']:.2f} s; a restore with one rank's memory empty takes "
            f"{t['restore_s']:.2f} s against {s['load_s']:.2f} s from S3: "
            f"memory_tier_load_speedup_vs_s3 = {s['memory_tier_load_speedup_vs_s3']:.1f}x; host memory "
            f"{t['host_between_x']:.2f}x the rank's state between snapshots, {t['host_peak_x']:.2f}x at a peak"
        )
    c = s["local_cache"]
    out.append(
        f"(f) local cache: a sync save that also writes it takes {c['save_s']:.2f} s "
        f"({c['save_vs_without']:.2f}x the speed without); a load reading it first "
        f"({c['share_read_from_cache']:.0%} of its bytes from it) takes {c['load_s']:.2f} s against "
        f"{s['load_s']:.2f} s from S3: local_cache_load_speedup_vs_s3 = {s['local_cache_load_speedup_vs_s3']:.1f}x"
    )
    for mode, err in s["errors"].items():
        out.append(f"{mode if mode == 'memory_tier' else 'async_mode=' + mode} FAILED: {err}")
    return "\n".join(out)


NOTES = """\
notes:
- One host, 2 shared cores: 2 training ranks, upload threads/processes and SeaweedFS all compete
  for them, and the "network" is loopback. Sync saves, loads and raw PUT/GET all run with
  training idle, so those ratios compare like with like; the MB/s are not a real network's.
- blocked = the training thread's time in state_dict() + CheckpointManager.save(), plus, async,
  its wait for the background copy of the state before the next optimizer update (the copy runs
  beside the next forward and backward); sync: also plan, serialize, digest, upload, commit.
  Async saves are measured as the train loop runs them: between steps, with steps continuing
  while they upload; the upload end is seen at the next poll() (so "<=", one step of slack), and
  it competes with training for the cores, so its MB/s is not the save path's idle speed.
- A save's bytes are its step's files (shards, their block listings, .metadata, manifest.json);
  a sync save ends when the manifest is committed (retention runs beside training after it);
  raw PUT ends when both ranks' PUTs did.
- manager.load reads every byte once: each rank fetches the 64 KiB blocks its DCP load plan
  needs (ranged GETs of up to 16 MiB), checks each block's digest, and DCP copies the tensors
  out of those bytes in memory (one small torch.load per tensor: DCP's own cost). A single
  cat_file of a large object is itself slower here than ranged reads, so the ratio is taken
  against the faster raw read.
- Step times are the slowest rank's. With an upload in flight, the uploader and SeaweedFS take
  CPU from the two training ranks (and, with threads, the GIL): a GPU host with spare cores
  would show far less."""
