"""``ftrain local up``: a local etcd and SeaweedFS S3 on loopback (:class:`ftrain.testbed.stack.LocalStack`),
for trying ftrain on one machine."""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys

from ftrain.contract import exits
from ftrain.testbed.stack import LocalStack


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="local infrastructure for trying ftrain on one machine")
    local = p.add_subparsers(dest="local_command", required=True)
    up = local.add_parser("up", help="start etcd and SeaweedFS S3 on 127.0.0.1 (or --host) until Ctrl-C")
    up.add_argument("--dir", default=None, help="data directory (default: a new temporary directory)")
    up.add_argument("--no-s3", action="store_true", help="etcd only")
    up.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on: one of this machine's addresses that the other hosts reach "
        "(default 127.0.0.1: this machine only). No TLS or auth: use a trusted network.",
    )
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace, overrides: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        address = ipaddress.ip_address(args.host)
    except ValueError:
        print(
            f"ftrain local up: --host {args.host!r} is not an IP address (give one of this machine's)", file=sys.stderr
        )
        return exits.USAGE
    if not address.is_loopback and not _is_local_address(args.host):
        print(
            f"ftrain local up: --host {args.host} is not an address of this machine (`ip -brief address` lists them)",
            file=sys.stderr,
        )
        return exits.USAGE
    stack = LocalStack(args.dir, with_s3=not args.no_s3, host=args.host)
    try:
        stack.start()
        print(f"etcd: {stack.etcd_url}")
        if stack.s3 is not None:
            print(f"s3:   {stack.s3.endpoint_url} (bucket {stack.s3.url()})")
        print(f"data: {stack.base_dir}")
        print("# point workers at its S3:")
        for key, value in stack.env().items():
            print(f"export {key}={value}")
        host = "" if args.host == "127.0.0.1" else " --host <this node's address>"
        print(
            f"# e.g. ftrain agent --etcd {stack.etcd_url} --job demo --nnodes 1:2 --nproc-per-node 1{host} "
            f"-- configs/demo.toml --checkpoint.uri={stack.s3.url('demo') if stack.s3 else '/tmp/ckpt'}"
        )
        print("Ctrl-C to stop.", flush=True)
        code = stack.etcd.wait()
        print(f"etcd exited with code {code}; log {stack.etcd.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.close()


def _is_local_address(host: str) -> bool:
    """Whether this machine can listen on ``host`` (one of its interfaces' addresses)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True
