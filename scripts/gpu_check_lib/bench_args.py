"""Parse a benchmark's arguments with the benchmark's own parser, and stop there (the trick
tests/unit/test_docs.py uses): the dry run's proof that the options the GPU run passes still exist.

    python scripts/gpu_check_lib/bench_args.py bench/checkpoint.py --state-mb 4096 ...

Prints one JSON line: the parsed arguments, whether the parser offers ``--device``, and, for
``bench/checkpoint.py``, whether its ``model_shape`` accepts ``--state-mb`` (the first thing its
run does). Exit 2 (the parser's) on an option the benchmark does not take.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace):
        super().__init__()
        self.parser, self.namespace = parser, args


def main() -> int:
    script, argv = sys.argv[1], sys.argv[2:]
    spec = importlib.util.spec_from_file_location("bench_under_check", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    parse = argparse.ArgumentParser.parse_args

    def parsed(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(self, parse(self, args, namespace))

    argparse.ArgumentParser.parse_args = parsed  # type: ignore[method-assign]
    try:
        module.main(argv)
    except _Parsed as p:
        out: dict[str, Any] = {"args": vars(p.namespace), "takes_device": "--device" in p.parser.format_help()}
        shape = getattr(module, "model_shape", None)
        if shape is not None and getattr(p.namespace, "state_mb", None) is not None:
            try:
                out["shape"] = shape(p.namespace.state_mb)
            except SystemExit as e:
                out["state_mb_refused"] = str(e)
        print(json.dumps(out))
        return 0
    raise SystemExit(f"{script}: main() returned without parsing its arguments")


if __name__ == "__main__":
    sys.exit(main())
