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
memory_tier = false        # memory-tier snapshots kept per node in <out>/shm (checkpoint.memory_dir, as
                           # on a node's tmpfs): a round whose every worker died restores from them;
                           # a lost node loses its own
# or your own training script (ftrain agent --script) instead of config (docs/chaos.md):
script = "train.py"        # relative to this file; its loop uses ftrain.Session
script_args = ["--ckpt", "{checkpoint}", "--steps", "{steps}"]   # {checkpoint}: where the run saves

[[faults]]                 # fired in order
kind = "worker_kill"
at_step = 30

[random]                   # a seeded random campaign after the listed faults
count = 100                # faults (0: none)
kinds = ["worker_kill", "etcd_pause"]   # drawn uniformly (a kind listed twice: twice as likely)
interval_s = [4.0, 10.0]   # uniform wait between faults, once the previous recovery completed
duration_s = 0             # stop the campaign after this long (0: after count faults)
min_steps_between = 0      # before each fault, training must pass its pre-fault high by this many steps

# or, instead of kinds and interval_s: a failure mix and a rate
every_s = 60.0             # mean seconds between faults (exponential, seeded: a Poisson process);
                           # counted from the previous fault, which still waits for min_steps_between
[random.weights]           # kind -> relative weight (the kinds drawn with these weights, seeded)
agent_kill = 60
worker_kill = 13
```

Each key is checked when the file loads; an error names the key and the file. ``ftrain chaos
run ... --fault-every-s S`` sets ``every_s`` (:meth:`RandomSpec.with_every_s`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
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
    #: the workers keep memory-tier snapshots in a directory per node (``checkpoint.memory_dir``
    #: under the run's folder, as a node's tmpfs would); ``agent_kill`` wipes the lost node's
    memory_tier: bool = False
    #: a user's training script, run by ``ftrain agent --script`` instead of ``ftrain train``
    #: (relative to the scenario file; "": the job is ``ftrain train`` with ``config``)
    script: str = ""
    #: the script's arguments: ``{checkpoint}`` (required) becomes the run's checkpoint location,
    #: ``{steps}`` the number of steps (``steps``)
    script_args: list[str] = field(default_factory=list)


#: the placeholders of ``job.script_args`` the runner fills in
CHECKPOINT_PLACEHOLDER = "{checkpoint}"
STEPS_PLACEHOLDER = "{steps}"
#: ``[job]`` keys that only ``ftrain train`` reads: a script reads its own settings from its arguments
NOT_FOR_SCRIPTS = ("config", "overrides", "checkpoint_interval", "step_sleep_s", "memory_tier")


@dataclass(slots=True)
class RandomSpec:
    count: int = 0
    #: the kinds drawn uniformly (ignored where ``weights`` is given)
    kinds: list[str] = field(default_factory=lambda: ["worker_kill"])
    #: uniform wait between faults (ignored where ``every_s`` is given)
    interval_s: tuple[float, float] = (4.0, 10.0)
    duration_s: float = 0.0  #: no new random fault after this many seconds of the run (0: no limit)
    #: each random fault waits until training passed the highest step before the previous one by
    #: this many steps: one recovery completes (recomputation included) before the next fault
    min_steps_between: int = 0
    fault_params: dict[str, dict[str, Any]] = field(default_factory=dict)  #: kind -> params
    #: kind -> relative weight: the kinds drawn with these weights instead of ``kinds`` (a failure mix)
    weights: dict[str, float] = field(default_factory=dict)
    #: mean seconds between faults (> 0: exponential inter-arrival times instead of ``interval_s``),
    #: counted from the previous fault; a fault still waits for ``min_steps_between``
    every_s: float = 0.0

    @property
    def mix(self) -> dict[str, float]:
        """Kind -> its share of the draws (the weights, or ``kinds`` counted), summing to 1."""
        counts = dict(self.weights) if self.weights else {k: float(self.kinds.count(k)) for k in self.kinds}
        total = sum(counts.values())
        return {k: w / total for k, w in counts.items() if w > 0}

    def with_every_s(self, every_s: float) -> RandomSpec:
        """The same campaign at a mean of ``every_s`` seconds between faults."""
        if not every_s > 0:
            raise ScenarioError(f"every_s: {every_s!r} must be > 0")
        return replace(self, every_s=float(every_s))

    def draw(self, rng: Random) -> list[tuple[float, str]]:
        """(wait, kind) for each of the ``count`` faults, seeded by ``rng``. The uniform form
        draws exactly as it always did (a kind, then its wait), so old seeds replay old campaigns."""
        out = []
        kinds, weights = list(self.weights), list(self.weights.values())
        lo, hi = self.interval_s
        for _ in range(self.count):
            kind = rng.choices(kinds, weights)[0] if self.weights else rng.choice(self.kinds)
            wait_s = rng.expovariate(1.0 / self.every_s) if self.every_s > 0 else rng.uniform(lo, hi)
            out.append((wait_s, kind))
        return out


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

    @property
    def script_path(self) -> Path | None:
        """The user's training script (None: an ``ftrain train`` job)."""
        return (self.path.parent / self.job.script).resolve() if self.job.script else None

    def script_command_args(self, checkpoint: str) -> list[str]:
        """The script's arguments with ``{checkpoint}`` and ``{steps}`` filled in."""
        steps = str(self.job.steps)
        return [
            a.replace(CHECKPOINT_PLACEHOLDER, checkpoint).replace(STEPS_PLACEHOLDER, steps)
            for a in self.job.script_args
        ]

    def worker_env(self) -> dict[str, str]:
        """What the scenario's faults arm in every worker from the start (``FTRAIN_FAULT_*``)."""
        env: dict[str, str] = {}
        for spec in self.faults:
            if spec.fault.worker_env is not None:
                env.update(spec.fault.worker_env(spec))
        return env

    def random_faults(self, rng: Random) -> list[tuple[float, FaultSpec]]:
        """(wait, spec) for the seeded random campaign: the wait after the previous recovery
        (``interval_s``) or after the previous fault (``every_s``)."""
        params = self.random.fault_params
        return [(wait_s, FaultSpec(kind, params=dict(params.get(kind, {})))) for wait_s, kind in self.random.draw(rng)]


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
    _check_script_job(job, set(data.get("job", {})), path)
    if not isinstance(job.memory_tier, bool):
        raise ScenarioError(f"{path}: job.memory_tier: {job.memory_tier!r} must be true or false")
    if job.network not in NETWORKS:
        raise ScenarioError(f"{path}: job.network: {job.network!r} is not one of {', '.join(NETWORKS)}")
    random_spec = _random_spec(dict(data.get("random", {})), path)
    faults = []
    for i, table in enumerate(data.get("faults", [])):
        try:
            faults.append(FaultSpec.from_dict(table))
        except (ValueError, TypeError) as e:
            raise ScenarioError(f"{path}: faults[{i}]: {e}") from None
    scenario = Scenario(data.get("name", path.stem), path, job, faults, random_spec)
    if job.script and not scenario.script_path.is_file():  # type: ignore[union-attr]
        raise ScenarioError(
            f"{path}: job.script: {scenario.script_path} does not exist (relative to the scenario file)"
        )
    if not job.script and not scenario.config_path.exists():
        raise ScenarioError(f"{path}: job.config: {scenario.config_path} does not exist")
    return scenario


def _check_script_job(job: JobSpec, given: set[str], path: Path) -> None:
    """``job.script`` and ``job.script_args``, checked: the arguments are strings and tell the
    script where to save; the keys only ``ftrain train`` reads are refused (a script ignores them)."""
    if not isinstance(job.script, str):
        raise ScenarioError(f"{path}: job.script: {job.script!r} must be the path of your training script")
    args = job.script_args
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ScenarioError(f"{path}: job.script_args: {args!r} must be a list of strings")
    if not job.script:
        if "script_args" in given:
            raise ScenarioError(f"{path}: job.script_args: given without job.script; name the script, or remove it")
        return
    if not any(CHECKPOINT_PLACEHOLDER in a for a in args):
        raise ScenarioError(
            f"{path}: job.script_args: {args!r} never says where the script saves its checkpoints: add its option "
            f'with "{CHECKPOINT_PLACEHOLDER}", e.g. script_args = ["--ckpt", "{CHECKPOINT_PLACEHOLDER}"]'
        )
    for key in NOT_FOR_SCRIPTS:
        if key in given:
            raise ScenarioError(
                f"{path}: job.{key}: does not apply to a script job (job.script): your script reads its own "
                "settings; pass them in job.script_args and remove this key"
            )
    if job.network != "loopback":
        raise ScenarioError(f"{path}: job.network: {job.network!r}: a script job runs on loopback only (for now)")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _random_spec(rand: dict[str, Any], path: Path) -> RandomSpec:
    """The ``[random]`` table, checked: an error names the key and the file."""

    def fail(key: str, why: str) -> ScenarioError:
        return ScenarioError(f"{path}: random.{key}: {why}")

    if "weights" in rand and "kinds" in rand:
        raise fail("weights", "give random.kinds (drawn uniformly) or random.weights, not both")
    if "every_s" in rand and "interval_s" in rand:
        raise fail("every_s", "give random.interval_s (uniform waits) or random.every_s (a mean), not both")
    if "interval_s" in rand:
        lo_hi = rand["interval_s"]
        if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and all(_number(x) for x in lo_hi)):
            raise fail("interval_s", f"{lo_hi!r} is not [low, high] in seconds")
        if not 0 <= lo_hi[0] <= lo_hi[1]:
            raise fail("interval_s", f"{lo_hi!r}: need 0 <= low <= high")
        rand["interval_s"] = (float(lo_hi[0]), float(lo_hi[1]))
    if "every_s" in rand and not (_number(rand["every_s"]) and rand["every_s"] > 0):
        raise fail("every_s", f"{rand['every_s']!r} must be a number of seconds > 0")
    weights = rand.get("weights", {})
    if not isinstance(weights, dict):
        raise fail("weights", "must be a table of kind = weight ([random.weights])")
    for kind, weight in weights.items():
        if not (_number(weight) and weight >= 0):
            raise fail(f"weights.{kind}", f"{weight!r} must be a number >= 0")
    if "weights" in rand and not any(w > 0 for w in weights.values()):
        raise fail("weights", "no kind has a weight > 0")
    for key in ("count", "min_steps_between"):
        if key in rand and not (isinstance(rand[key], int) and not isinstance(rand[key], bool) and rand[key] >= 0):
            raise fail(key, f"{rand[key]!r} must be an integer >= 0")
    if "duration_s" in rand and not (_number(rand["duration_s"]) and rand["duration_s"] >= 0):
        raise fail("duration_s", f"{rand['duration_s']!r} must be a number of seconds >= 0")
    spec = _build(RandomSpec, rand, f"{path}: random")
    named = [("kinds", k) for k in spec.kinds] + [(f"weights.{k}", k) for k in spec.weights]
    named += [(f"fault_params.{k}", k) for k in spec.fault_params]
    for key, kind in named:
        try:
            FAULTS.get(kind)
        except UnknownFaultKind as e:
            raise fail(key.split(".")[0] if key == "kinds" else key, str(e)) from None
    return spec
