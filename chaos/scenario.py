"""Chaos scenarios as TOML.

```toml
[job]
nodes = 2                  # agents ("nodes") started at the beginning
nproc_per_node = 1
nnodes = "1:2"             # MIN:MAX of every agent
config = "tiny.toml"       # training config, relative to this file
steps = 150
checkpoint_interval = 10
step_sleep_s = 0.02        # slows each step so that faults land mid-run
deterministic = true       # bitwise equality with the golden run even across world sizes
tolerance = 0.0            # max |param - golden| allowed when deterministic = false
timeout_s = 300
network = "loopback"       # or "netns": every node, etcd member and S3 on a host (namespace) of its own
overrides = []             # more --section.key=value for the workers
agent_options = []         # more options for every agent

[[faults]]                 # fired in order
kind = "worker_kill"
at_step = 30

[random]                   # a seeded random campaign after the listed faults
count = 100                # faults (0: none)
kinds = ["worker_kill", "etcd_pause"]
interval_s = [4.0, 10.0]   # uniform wait between faults
duration_s = 0             # stop the campaign after this long (0: after count faults)
min_steps_between = 0      # before each fault, training must pass its pre-fault high by this many steps
```
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import TYPE_CHECKING, Any, TypeVar

from ftrain.chaos.faults import FAULTS, FaultSpec, UnknownFaultKind
from ftrain.chaos.hosts import NETWORKS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Spec = TypeVar("_Spec", bound="DataclassInstance")


class ScenarioError(ValueError):
    """The scenario file is wrong; the message names the key and the file."""


@dataclass(slots=True)
class JobSpec:
    nodes: int = 2
    nproc_per_node: int = 1
    nnodes: str = "1:2"
    config: str = "tiny.toml"
    steps: int = 150
    checkpoint_interval: int = 10
    step_sleep_s: float = 0.02
    deterministic: bool = True
    tolerance: float = 0.0
    timeout_s: float = 300.0
    network: str = "loopback"  #: one of ftrain.chaos.hosts.NETWORKS
    overrides: list[str] = field(default_factory=list)
    agent_options: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RandomSpec:
    count: int = 0
    kinds: list[str] = field(default_factory=lambda: ["worker_kill"])
    interval_s: tuple[float, float] = (4.0, 10.0)
    duration_s: float = 0.0  #: no new random fault after this many seconds of the run (0: no limit)
    #: each random fault waits until training passed the highest step before the previous one by
    #: this many steps: one recovery completes (recomputation included) before the next fault
    min_steps_between: int = 0
    fault_params: dict[str, dict[str, Any]] = field(default_factory=dict)  #: kind -> params


@dataclass(slots=True)
class Scenario:
    name: str
    path: Path
    job: JobSpec
    faults: list[FaultSpec]
    random: RandomSpec

    @property
    def config_path(self) -> Path:
        return (self.path.parent / self.job.config).resolve()

    def worker_env(self) -> dict[str, str]:
        """What the scenario's faults arm in every worker from the start (``FTRAIN_FAULT_*``)."""
        env: dict[str, str] = {}
        for spec in self.faults:
            if spec.fault.worker_env is not None:
                env.update(spec.fault.worker_env(spec))
        return env

    def random_faults(self, rng: Random) -> list[tuple[float, FaultSpec]]:
        """(delay after the previous fault, spec) for the seeded random campaign."""
        lo, hi = self.random.interval_s
        return [
            (rng.uniform(lo, hi), FaultSpec(kind, params=dict(self.random.fault_params.get(kind, {}))))
            for kind in (rng.choice(self.random.kinds) for _ in range(self.random.count))
        ]


def _build(cls: type[_Spec], table: dict[str, Any], where: str) -> _Spec:
    names = set(cls.__dataclass_fields__)
    for key in table:
        if key not in names:
            raise ScenarioError(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
    try:
        return cls(**table)
    except TypeError as e:
        raise ScenarioError(f"{where}: {e}") from None


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: invalid TOML: {e}") from None
    unknown = set(data) - {"job", "faults", "random", "name"}
    if unknown:
        raise ScenarioError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}")
    job = _build(JobSpec, data.get("job", {}), f"{path}: job")
    if job.network not in NETWORKS:
        raise ScenarioError(f"{path}: job.network: {job.network!r} is not one of {', '.join(NETWORKS)}")
    rand = dict(data.get("random", {}))
    if "interval_s" in rand:
        rand["interval_s"] = tuple(rand["interval_s"])
    random_spec = _build(RandomSpec, rand, f"{path}: random")
    for kind in random_spec.kinds:
        try:
            FAULTS.get(kind)
        except UnknownFaultKind as e:
            raise ScenarioError(f"{path}: random.kinds: {e}") from None
    faults = []
    for i, table in enumerate(data.get("faults", [])):
        try:
            faults.append(FaultSpec.from_dict(table))
        except (ValueError, TypeError) as e:
            raise ScenarioError(f"{path}: faults[{i}]: {e}") from None
    scenario = Scenario(data.get("name", path.stem), path, job, faults, random_spec)
    if not scenario.config_path.exists():
        raise ScenarioError(f"{path}: job.config: {scenario.config_path} does not exist")
    return scenario
