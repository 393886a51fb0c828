"""``ftrain ckpt``: inspect, verify, garbage-collect and export checkpoints.

    ftrain ckpt ls URI                       one line per step directory: state, size, writer
    ftrain ckpt show URI STEP                the manifest and its files
    ftrain ckpt verify URI [STEP]            re-hash every file; exit 1 on any problem
    ftrain ckpt gc URI [--dry-run] [--keep-last N] [--keep-every M] [--grace-s S]
    ftrain ckpt export URI STEP OUT.pt       one plain torch.save file, loadable without ftrain
    ftrain ckpt export URI STEP OUT --format hf   a Hugging Face save_pretrained directory
                                             (a new OUT; --replace swaps an existing one out whole)

Every subcommand takes ``--endpoint-url`` (else ``AWS_ENDPOINT_URL``) and ``--hmac-key-env NAME``
(the variable holding the manifest HMAC key). Exit codes: 0 fine, 1 problems found (or the step
is not there), 2 usage or storage error.

Without ``--hmac-key-env`` a digest proves only that the bytes match a manifest that whoever can
write the bucket could also have rewritten: ``ls``, ``verify`` and ``export`` say so on stderr,
and name the steps whose manifests carry an ``hmac`` that this run did not check.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ftrain.checkpoint.catalog import StepInfo, inspect_step, list_steps
from ftrain.checkpoint.errors import CheckpointError, ChecksumMismatchError, UnsafePickleError
from ftrain.checkpoint.manifest import MANIFEST_NAME, hmac_key_from_env, parse_step_dir, step_dir_name
from ftrain.checkpoint.retention import Retention, apply_gc, gc_survey, plan_gc
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.checkpoint.verify import verify_step
from ftrain.contract import exits

Command = Callable[[argparse.Namespace, list[str]], int]


# -- helpers ---------------------------------------------------------------------------------
def storage_options(args: argparse.Namespace) -> StorageOptions:
    return StorageOptions(endpoint_url=args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", ""))


def _storage(args: argparse.Namespace) -> Storage:
    return Storage(args.uri, storage_options(args))


def _hmac_key(args: argparse.Namespace) -> bytes | None:
    return hmac_key_from_env(args.hmac_key_env)


NO_HMAC_KEY_NOTE = (
    "note: no HMAC key: digests prove integrity against accidents, not against someone who can "
    "write the bucket; set checkpoint.hmac_key_env in the job's config and pass --hmac-key-env NAME "
    "here to check manifest signatures"
)
#: Manifests are read back only this far to look for an ``hmac`` field (real ones are KiBs).
_HMAC_PEEK_MAX_BYTES = 16 << 20
#: At most this many unchecked signed steps are named in the warning.
_HMAC_NAMED_STEPS = 5


def _carries_hmac(storage: Storage, dirname: str) -> bool:
    """Does ``dirname``'s manifest have a top-level ``hmac`` field? False when it cannot tell
    (gone, too large, not a JSON object); storage errors propagate."""
    parts: list[bytes] = []
    size_bytes = 0
    try:
        for chunk in storage.iter_chunks(f"{dirname}/{MANIFEST_NAME}", 1 << 20):
            parts.append(chunk)
            size_bytes += len(chunk)
            if size_bytes > _HMAC_PEEK_MAX_BYTES:
                return False
        obj = json.loads(b"".join(parts))
    except (FileNotFoundError, ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and "hmac" in obj


def hmac_notes(storage: Storage, key: bytes | None, key_env: str, steps: list[StepInfo]) -> list[str]:
    """What this run's HMAC coverage was, for stderr: with a key, which variable held it;
    without one, :data:`NO_HMAC_KEY_NOTE` plus the steps whose signatures went unchecked."""
    if key is not None:
        return [f"note: manifest HMACs checked with the key in ${key_env}"]
    signed = [s.dirname for s in steps if s.manifest is not None and _carries_hmac(storage, s.dirname)]
    notes = [NO_HMAC_KEY_NOTE]
    if signed:
        named = ", ".join(signed[:_HMAC_NAMED_STEPS]) + (", ..." if len(signed) > _HMAC_NAMED_STEPS else "")
        notes.append(
            f"warning: {len(signed)} manifest(s) carry an 'hmac' field that was NOT checked ({named}): "
            "pass --hmac-key-env NAME (the variable checkpoint.hmac_key_env names) to check them"
        )
    return notes


def _print_hmac_notes(storage: Storage, key: bytes | None, args: argparse.Namespace, steps: list[StepInfo]) -> None:
    for line in hmac_notes(storage, key, args.hmac_key_env, steps):
        print(line, file=sys.stderr)


def _step_arg(text: str) -> int:
    """A step as a number (``1200``) or a directory name (``step-000001200``)."""
    step = parse_step_dir(text)
    if step is not None:
        return step
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number or step directory: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"step must be >= 0, got {value}")
    return value


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _guarded(fn: Command) -> Command:
    """Turn checkpoint and storage errors into a message on stderr and exit code 2."""

    def run(args: argparse.Namespace, overrides: list[str]) -> int:
        if overrides:
            print(f"ftrain ckpt {args.ckpt_command}: unrecognised arguments: {' '.join(overrides)}", file=sys.stderr)
            return exits.USAGE
        try:
            return fn(args, overrides)
        except (CheckpointError, OSError, ValueError) as e:
            print(f"ftrain ckpt {args.ckpt_command}: error: {type(e).__name__}: {e}", file=sys.stderr)
            return exits.USAGE

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


# -- subcommands -----------------------------------------------------------------------------
@_guarded
def cmd_ls(args: argparse.Namespace, overrides: list[str]) -> int:
    """Table of every step directory under the root."""
    storage, key = _storage(args), _hmac_key(args)
    steps = list_steps(storage, key, job=args.job)
    _print_hmac_notes(storage, key, args, steps)
    if not steps:
        print(f"no step directories under {args.uri}")
        return exits.OK
    rows = [["STEP", "STATE", "WORLD", "ROUND", "FILES", "SIZE", "CREATED", "NOTE"]]
    for s in steps:
        m = s.manifest
        rows.append(
            [
                str(s.step),
                s.state,
                str(m.world_size) if m else "-",
                str(m.round) if m else "-",
                str(len(m.files)) if m else "-",
                human_bytes(m.total_size_bytes) if m else "-",
                _iso(m.created_time) if m else "-",
                s.error or "",
            ]
        )
    print(_table(rows))
    return exits.OK


@_guarded
def cmd_show(args: argparse.Namespace, overrides: list[str]) -> int:
    """The manifest of one step, pretty-printed, then its files."""
    dirname = step_dir_name(args.step)
    info = inspect_step(_storage(args), dirname, _hmac_key(args), job=args.job)
    if info.manifest is None:
        print(f"{dirname}: {info.state}" + (f": {info.error}" if info.error else " (no manifest)"), file=sys.stderr)
        return exits.FAILED
    m = info.manifest
    header: dict[str, Any] = {k: v for k, v in m.to_dict().items() if k != "files"}
    print(f"{dirname}  state={info.state}" + (f"  ({info.error})" if info.error else ""))
    print(json.dumps(header, indent=2, sort_keys=True))
    rows = [["FILE", "SIZE", "BYTES", f"DIGEST ({m.digest_algorithm})"]]
    rows += [[name, human_bytes(e.size_bytes), str(e.size_bytes), e.digest] for name, e in sorted(m.files.items())]
    rows.append([f"total: {len(m.files)} files", human_bytes(m.total_size_bytes), str(m.total_size_bytes), ""])
    print(_table(rows))
    return exits.OK


def _print_report_line(dirname: str, report: Any) -> None:
    if report.ok:
        print(f"{dirname}: OK ({report.files_checked} files, {human_bytes(report.bytes_checked)})")
        return
    print(f"{dirname}: FAILED ({len(report.problems)} problem{'s' if len(report.problems) != 1 else ''})")
    for p in report.problems:
        print(f"  {p}")


@_guarded
def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    """Re-hash every file of one step, or of every committed step."""
    storage, key = _storage(args), _hmac_key(args)
    failed = 0
    if args.step is not None:
        dirname = step_dir_name(args.step)
        report = verify_step(storage, dirname, key, job=args.job)
        info = inspect_step(storage, dirname, key, job=args.job)
        _print_hmac_notes(storage, key, args, [info])
        _print_report_line(dirname, report)
        if info.marked:
            print(f"  note: {info.error}")
        return exits.OK if report.ok else exits.FAILED
    steps = list_steps(storage, key, job=args.job)
    _print_hmac_notes(storage, key, args, steps)
    if not steps:
        print(f"no step directories under {args.uri}")
    for info in steps:
        if info.state == "uncommitted":
            print(f"{info.dirname}: uncommitted, skipped")
        elif info.state == "corrupt" and info.marked:
            print(f"{info.dirname}: {info.error}, skipped")
        elif info.state == "corrupt":  # a manifest that fails now: a problem found by this run
            failed += 1
            print(f"{info.dirname}: FAILED (1 problem)\n  manifest.json: manifest: {info.error}")
        else:
            report = verify_step(storage, info.dirname, key, job=args.job)
            _print_report_line(info.dirname, report)
            failed += not report.ok
    return exits.FAILED if failed else exits.OK


@_guarded
def cmd_gc(args: argparse.Namespace, overrides: list[str]) -> int:
    """Delete step directories the retention rules no longer keep."""
    storage = _storage(args)
    steps, ages = gc_survey(storage, list_steps(storage, _hmac_key(args), job=args.job))
    plan = plan_gc(
        steps,
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        in_flight=set(),
        now_s=time.time(),
        modified_s=ages,
        grace_s=args.grace_s,
    )
    verb = "would delete" if args.dry_run else "delete"
    for dirname in plan.keep:
        print(f"keep          {dirname}: {plan.reasons[dirname]}")
    for dirname in plan.delete:
        print(f"{verb:<13} {dirname}: {plan.reasons[dirname]}")
    if not args.dry_run:
        apply_gc(storage, plan)
    print(f"{len(plan.delete)} {'to delete' if args.dry_run else 'deleted'}, {len(plan.keep)} kept")
    return exits.OK


@_guarded
def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write one step as a single plain ``torch.save`` file, or a Hugging Face directory."""
    from ftrain.checkpoint.export import HfConverter, export_step  # heavy (torch DCP): imported only here

    to_hf: HfConverter | None = None
    if args.format == "hf":
        if args.with_optimizer:
            print("ftrain ckpt export: --with-optimizer does not go with --format hf", file=sys.stderr)
            return exits.USAGE
        from ftrain.models import hf_weights

        to_hf = hf_weights.to_hf

    storage = _storage(args)
    if not args.hmac_key_env:
        print(NO_HMAC_KEY_NOTE, file=sys.stderr)
    try:
        summary = export_step(
            storage,
            args.step,
            args.out,
            hmac_key_env=args.hmac_key_env,
            job=args.job,
            include_optimizer=args.with_optimizer,
            fmt=args.format,
            to_hf=to_hf,
            replace=args.replace,
        )
    except (ChecksumMismatchError, UnsafePickleError) as e:
        print(f"ftrain ckpt export: {e}", file=sys.stderr)
        return exits.FAILED
    print(
        f"exported step {summary['step']}: {summary['tensors']} tensors, {summary['params']:,} parameters "
        f"-> {summary['path']}"
    )
    return exits.OK


# -- parser ----------------------------------------------------------------------------------
def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``ckpt`` and its subcommands; each sets ``func(args, overrides) -> int``."""
    ckpt = subparsers.add_parser(
        "ckpt",
        help="inspect, verify, garbage-collect and export checkpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)

    def command(name: str, help_text: str, func: Command) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("uri", help="checkpoint root: s3://bucket/prefix, file:///path, a path, memory://...")
        p.add_argument("--endpoint-url", default="", help="S3 endpoint (default: $AWS_ENDPOINT_URL)")
        p.add_argument(
            "--hmac-key-env",
            default="",
            metavar="NAME",
            help="environment variable holding the manifest HMAC key (default: no HMAC check)",
        )
        p.add_argument(
            "--job",
            default=None,
            metavar="ID",
            help="refuse steps written by any other job (default: accept every job's steps)",
        )
        p.set_defaults(func=func)
        return p

    command("ls", "list step directories: step, state, world size, round, files, size, created", cmd_ls)

    p = command("show", "print one step's manifest and per-file sizes", cmd_show)
    p.add_argument("step", type=_step_arg, help="step number or step directory name")

    p = command("verify", "re-hash files against manifests; exit 1 on any problem", cmd_verify)
    p.add_argument(
        "step",
        type=_step_arg,
        nargs="?",
        default=None,
        help="one step (any state); default: every committed step (steps already marked "
        "corrupt are listed and skipped, uncommitted ones skipped)",
    )

    p = command("gc", "delete step directories outside the retention rules", cmd_gc)
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.add_argument(
        "--keep-last",
        type=int,
        default=Retention().keep_last,
        metavar="N",
        help=f"keep the newest N committed steps ({Retention().keep_last})",
    )
    p.add_argument(
        "--keep-every", type=int, default=0, metavar="M", help="also keep every step that is a multiple of M (0: off)"
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=Retention().grace_s,
        metavar="S",
        help=f"uncommitted/corrupt directories younger than this are kept ({Retention().grace_s:g})",
    )

    p = command("export", "write one step as a single torch.save file or a Hugging Face directory", cmd_export)
    p.add_argument("step", type=_step_arg, help="step number or step directory name")
    p.add_argument("out", help="output file (.pt); with --format hf, a directory")
    p.add_argument(
        "--format",
        choices=("torch", "hf"),
        default="torch",
        help="torch: one torch.save file of the model's state dict (default); hf: config.json, "
        "generation_config.json + model.safetensors "
        "(shards of at most 2 GB and their index above that), loadable with transformers' from_pretrained "
        "(the built-in llama and model.factory = ftrain.models.hf:causal_lm models)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="replace an existing OUT whole (written beside it, swapped in once complete); default: refuse an "
        "existing file or a directory that is not empty",
    )
    p.add_argument(
        "--with-optimizer",
        action="store_true",
        help='also export optimizer state ({"model": ..., "optim": ...}); default: model parameters only',
    )
