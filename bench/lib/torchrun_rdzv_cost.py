"""What the ``etcd-v3`` torchrun rendezvous costs etcd per node: N in-process torch
``DynamicRendezvousHandler``s (one per simulated node, each with its own client, as torchrun
creates them) on a real etcd, measured server side from etcd's ``/metrics``
(:mod:`bench.lib.control_plane_probe`: request messages and gRPC bytes).

Two phases per size: **rendezvous** (every handler's ``next_rendezvous`` from the first call to
the last return) and **steady state** (``steady_s`` seconds afterwards while each node does what
torchrun's agent does between rounds: ``num_nodes_waiting()`` every ``monitor_interval_s``, and
torch's own keep-alive timer). Figures are per node (and per node per second in steady state).

``before`` is the backend as of commit 7ea75c8 (every keep-alive a compare-and-swap of the whole
state, every read the whole state), loaded from git under another module name; ``after`` the
working tree's. ``python -m bench.lib.torchrun_rdzv_cost [--smoke]`` prints both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

from bench.lib.control_plane_probe import etcd_rates, scrape
from ftrain.testbed.etcd import EtcdServer

BEFORE_COMMIT = "7ea75c8"
REPO = Path(__file__).resolve().parents[2]


def before_module(commit: str = BEFORE_COMMIT) -> types.ModuleType:
    """``agents/torchrun_rdzv.py`` as of ``commit``, imported as ``ftrain.agents._torchrun_rdzv_<commit>``."""
    name = f"ftrain.agents._torchrun_rdzv_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    source = subprocess.run(
        ["git", "show", f"{commit}:agents/torchrun_rdzv.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    if spec is None:
        raise RuntimeError(f"cannot make a module spec for {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, f"<{commit}:agents/torchrun_rdzv.py>", "exec"), module.__dict__)  # noqa: S102 - our own git history
    return module


def after_module() -> types.ModuleType:
    from ftrain.agents import torchrun_rdzv

    return torchrun_rdzv


def _per_node(rates: dict[str, Any], nodes: int) -> dict[str, float]:
    return {
        "requests_per_node_s": round(rates["requests_per_s"] / nodes, 3),
        "rx_bytes_per_node_s": round(rates["rx_bytes_per_s"] / nodes, 1),
        "tx_bytes_per_node_s": round(rates["tx_bytes_per_s"] / nodes, 1),
    }


def measure_one(
    module: types.ModuleType,
    etcd: EtcdServer,
    nodes: int,
    run_id: str,
    *,
    steady_s: float = 15.0,
    monitor_interval_s: float = 0.1,
    keep_alive_interval_s: int = 5,
) -> dict[str, Any]:
    """One rendezvous of ``nodes`` handlers built by ``module.create_handler``, then ``steady_s`` of
    steady state; etcd's counters per node for each phase."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no TCPStore server per handler
    params = [
        RendezvousParameters(
            "etcd-v3",
            etcd.endpoint.removeprefix("http://"),
            run_id,
            nodes,
            nodes,
            local_addr="127.0.0.1",
            keep_alive_interval=keep_alive_interval_s,
            last_call_timeout=1,
            join_timeout=300,
        )
        for _ in range(nodes)
    ]
    handlers = [module.create_handler(p) for p in params]
    errors: list[BaseException] = []
    stop = threading.Event()

    def join(h: Any) -> None:
        try:
            h.next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def monitor(h: Any) -> None:
        while not stop.wait(monitor_interval_s):
            try:
                h.num_nodes_waiting()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    try:
        first = scrape(etcd.endpoint)
        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        formed = scrape(etcd.endpoint)
        if errors:
            raise RuntimeError(f"rendezvous of {nodes} failed: {errors[0]!r}") from errors[0]
        rdzv_s = formed.at - first.at
        rdzv = etcd_rates(first, formed)
        monitors = [threading.Thread(target=monitor, args=(h,), daemon=True) for h in handlers]
        for t in monitors:
            t.start()
        time.sleep(2.0)  # let the monitor loops and keep-alive timers settle in
        start = scrape(etcd.endpoint)
        time.sleep(steady_s)
        end = scrape(etcd.endpoint)
        stop.set()
        for t in monitors:
            t.join(timeout=30)
        if errors:
            raise RuntimeError(f"steady state of {nodes} failed: {errors[0]!r}") from errors[0]
        steady = etcd_rates(start, end)
        return {
            "nodes": nodes,
            "rendezvous_s": round(rdzv_s, 2),
            "per_rendezvous": {
                "requests_per_node": round(rdzv["requests_per_s"] * rdzv_s / nodes, 1),
                "rx_bytes_per_node": round(rdzv["rx_bytes_per_s"] * rdzv_s / nodes),
                "tx_bytes_per_node": round(rdzv["tx_bytes_per_s"] * rdzv_s / nodes),
            },
            "steady": _per_node(steady, nodes),
            "steady_by_method_per_node_s": {
                m: round(r / nodes, 3) for m, r in steady["requests_per_s_by_method"].items()
            },
        }
    finally:
        stop.set()
        for h in handlers:
            try:
                h._stop_heartbeats()  # noqa: SLF001 - no public way; shutdown() would close the round
            except Exception:  # noqa: BLE001, S110 - best effort
                pass


def measure_rdzv(
    sizes: Sequence[int], *, versions: Sequence[str] = ("before", "after"), steady_s: float = 15.0
) -> dict[str, dict[int, dict[str, Any]]]:
    """``{version: {N: figures}}`` for each of ``sizes``, every run on one fresh etcd."""
    modules = {"before": before_module, "after": after_module}
    out: dict[str, dict[int, dict[str, Any]]] = {}
    with EtcdServer() as etcd:
        for version in versions:
            module = modules[version]()
            out[version] = {n: measure_one(module, etcd, n, f"{version}-{n}", steady_s=steady_s) for n in sizes}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,64")
    parser.add_argument("--steady-s", type=float, default=15.0)
    parser.add_argument("--smoke", action="store_true", help="4 nodes, 6 s of steady state")
    args = parser.parse_args(argv)
    sizes = [4] if args.smoke else [int(s) for s in args.sizes.split(",")]
    result = measure_rdzv(sizes, steady_s=6.0 if args.smoke else args.steady_s)
    print(
        f"{'version':8} {'N':>4} {'req/node/s':>10} {'rxB/node/s':>10} {'txB/node/s':>10} "
        f"{'rdzv s':>7} {'req/node/rdzv':>13} {'rxB/node/rdzv':>13} {'txB/node/rdzv':>13}"
    )
    for version, by_n in result.items():
        for n, r in by_n.items():
            s, p = r["steady"], r["per_rendezvous"]
            print(
                f"{version:8} {n:>4} {s['requests_per_node_s']:>10} {s['rx_bytes_per_node_s']:>10} "
                f"{s['tx_bytes_per_node_s']:>10} {r['rendezvous_s']:>7} {p['requests_per_node']:>13} "
                f"{p['rx_bytes_per_node']:>13} {p['tx_bytes_per_node']:>13}"
            )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
