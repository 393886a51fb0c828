"""The whole config file as one job sees it, and ``ftrain config``.

Each package owns its sections (the runtime's in :mod:`ftrain.config`, ``[checkpoint]`` in
:mod:`ftrain.checkpoint.config`, ``[agent]`` in :mod:`ftrain.agents.config`); here they are composed into
:class:`JobConfig`, the view of ``ftrain agent`` and ``ftrain config``, which validate every
section before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from ftrain.agents.config import AccountingConfig, AgentConfig
from ftrain.config import Config
from ftrain.config import sections as runtime_sections
from ftrain.contract import exits
from ftrain.contract.config import load_sections
from ftrain.contract.config import reference_markdown as _reference


@dataclass(kw_only=True, slots=True)
class JobConfig(Config):
    agent: AgentConfig = field(default_factory=AgentConfig)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)


def schema() -> dict[str, type]:
    """Every section of the config file, in file order."""
    return {**runtime_sections(), "agent": AgentConfig, "accounting": AccountingConfig}


def load_job_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """Every section of the file validated (defaults < file < ``--section.key=value``)."""
    typed, _ = load_sections(schema(), path, overrides)
    others = {name: dataclasses.asdict(typed[name]) for name in ("agent", "accounting")}
    return JobConfig(**typed, others=others)


def reference_markdown() -> str:
    """The configuration reference (every key, type, default and meaning) as Markdown."""
    return _reference(schema())


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the resolved configuration, or the reference of all keys")
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--reference", action="store_true", help="print every key, type, default and meaning")
    p.set_defaults(func=_cmd_config)


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.reference:
        print(reference_markdown())
        return exits.OK
    print(json.dumps(load_job_config(args.config, overrides).to_dict(), indent=2))
    return exits.OK
