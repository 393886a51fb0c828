"""``ftrain report RUN_DIR``: a self-contained HTML page (and a PNG, with headless Chromium) of any
job from its logs: curves, a per-rank heatmap, rounds, faults, hangs, checkpoints and stragglers
on one timeline, how each round's state came back (the heals), goodput, and the device time lost by
cause (with its cost, given a price)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftrain.contract import exits
from ftrain.contract.config import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="an HTML report of a job from its metrics and event logs")
    p.add_argument("run_dir", help="a directory holding the job's metrics*.jsonl and events*.jsonl (searched below it)")
    p.add_argument("--out", default=None, help="where report.html/.json/.png go (default: RUN_DIR)")
    p.add_argument(
        "--config", default=None, help="the job's config file: its accounting.device_hour_price prices lost time"
    )
    p.add_argument("--device-hour-price", type=float, default=None, help="overrides accounting.device_hour_price")
    p.add_argument("--json", action="store_true", help="also print the lost time by cause as JSON")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace, overrides: list[str]) -> int:
    from ftrain.observability.run_report import build, collect, said_heal, write

    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        print(f"ftrain report: {run_dir} does not exist", file=sys.stderr)
        return exits.USAGE
    price = 0.0
    if args.config:
        from ftrain.cli.config import load_job_config

        price = load_job_config(args.config, overrides).accounting.device_hour_price
    if args.device_hour_price is not None:
        if not args.device_hour_price >= 0:
            raise ConfigError(
                "accounting.device_hour_price",
                f"must be >= 0, got {args.device_hour_price} (given as --device-hour-price)",
            )
        price = args.device_hour_price
    metrics, events, files = collect(run_dir)
    if not metrics and not events:
        print(f"ftrain report: no metrics*.jsonl or events*.jsonl under {run_dir}", file=sys.stderr)
        return exits.USAGE
    report = build(metrics, events, title=run_dir.resolve().name, device_hour_price=price)
    out = Path(args.out) if args.out else (run_dir if run_dir.is_dir() else run_dir.parent)
    html = write(out, report)
    a = report["accounting"]
    print(f"report: {html} ({len(files)} file(s), {len(metrics)} step line(s), {len(events)} event(s))")
    if report["final"]:
        print(f"job {report['final']['status']}: {report['final']['reason']}")
    print(f"device time (accounted from the {a['source']}), goodput {100 * a['goodput']:.1f}%:")
    for c in a["causes"]:
        cost = f"  cost {c['cost']:.4f}" if c["cost"] is not None else ""
        print(f"  {c['cause']:18s} {c['device_hours']:10.5f} device-hours  {100 * c['share']:5.1f}%{cost}")
    for h in report["heals"]:
        print(f"heal: {said_heal(h)}")
    for d in report["decisions"]:
        print(f"decision: {d['text']}")
    if args.json:
        print(json.dumps(a))
    return exits.OK
