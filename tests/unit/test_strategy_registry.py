"""The strategy registry: one contract run against every registered strategy, name lookup and
config checks, no torch at import, no strategy names compared outside ftrain/parallel/strategies/, and
a new strategy found from its module alone."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
import textwrap

import pytest

from ftrain.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from ftrain.parallel import strategies
from ftrain.parallel.strategies import STRATEGIES, Layout, Strategy, Wrapper, compute_layout
from ftrain.testbed.procs import REPO

BUILTIN = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp+tp")

#: A world every built-in strategy runs at: 4 ranks, 2 per node, 4 heads.
WORLD, LOCAL, N_HEAD = 4, 2, 4


def _layouts(strategy: Strategy) -> list[Layout]:
    parallel = ParallelConfig(strategy=strategy.name)
    return [
        compute_layout(parallel, world_size=WORLD, rank=r, local_world_size=LOCAL, n_head=N_HEAD) for r in range(WORLD)
    ]


each_strategy = pytest.mark.parametrize("strategy", strategies.registered(), ids=lambda s: s.name)


# ---------------------------------------------------------------------------------------------
# The contract every registered strategy meets.


@each_strategy
def test_is_found_by_its_name_and_offered_by_the_config(strategy):
    assert strategies.get(strategy.name) is strategy
    (field,) = [f for f in dataclasses.fields(ParallelConfig) if f.name == "strategy"]
    assert strategy.name in field.metadata["choices"]
    assert load_config(None, [f"--parallel.strategy={strategy.name}"]).parallel.strategy == strategy.name


@each_strategy
def test_layout_tiles_the_world(strategy):
    layouts = _layouts(strategy)
    for rank, lo in enumerate(layouts):
        assert (lo.strategy, lo.world_size, lo.rank) == (strategy.name, WORLD, rank)
        assert lo.dp_size * lo.tp_size == WORLD
        assert 0 <= lo.dp_rank < lo.dp_size and 0 <= lo.tp_rank < lo.tp_size
        if lo.mesh_shape is not None:
            shape, names = lo.mesh_shape
            assert math.prod(shape) == WORLD and len(shape) == len(names) == len(set(names))
    # Ranks of one tensor-parallel group read the same data; different groups read different data.
    assert sorted({lo.dp_rank for lo in layouts}) == list(range(layouts[0].dp_size))


@each_strategy
def test_replica_groups_are_all_or_nothing_and_hold_several_ranks(strategy):
    groups = [strategy.replica_group(lo) for lo in _layouts(strategy)]
    if groups[0] is None:
        assert groups == [None] * WORLD
        return
    assert all(isinstance(g, int) for g in groups)
    assert all(groups.count(g) >= 2 for g in groups), "a replica group of one rank compares nothing"


@each_strategy
def test_memory_model_is_complete(strategy):
    from ftrain.planning.memory import GiB, Target, layout_for, model_stats
    from ftrain.planning.plan import estimate, recommend

    assert isinstance(strategy.wrapper, Wrapper)
    cfg = Config(
        model=ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=N_HEAD, d_model=64),
        parallel=ParallelConfig(strategy=strategy.name),
    )
    stats = model_stats(cfg.model, cfg.optim)
    layout = layout_for(cfg, strategy.name, world_size=WORLD, gpus_per_node=LOCAL)
    assert 1 <= strategy.shard_count(layout) <= WORLD
    for target in (Target("cuda", "bf16"), Target("cpu", "fp32")):
        e = estimate(stats, cfg, layout, target)
        assert e.strategy == strategy.name
        assert 0 < e.model_state_bytes <= 16 * stats.num_params  # no dim-0 padding at these sizes
        assert 0 < e.textbook_model_state_bytes <= 16 * stats.num_params
        assert e.total_bytes > e.model_state_bytes and e.phase in ("backward", "step", "init")
        assert strategy.layout_text(e) and strategy.textbook_difference
        assert recommend([e], 1000 * GiB) is e


@each_strategy
def test_a_default_config_passes_its_checks(strategy):
    strategy.check_config(Config(parallel=ParallelConfig(strategy=strategy.name)))


# ---------------------------------------------------------------------------------------------
# What the built-in strategies are.


def test_builtin_strategies_keep_their_order_and_preference():
    assert [s for s in STRATEGIES if s in BUILTIN] == list(BUILTIN)
    preference = [s.name for s in strategies.by_preference() if s.name in BUILTIN]
    assert preference == ["ddp", "zero1", "zero2", "hsdp", "fsdp", "fsdp+tp", "tp"]


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("ddp", [0, 0, 0, 0]),
        ("zero1", [0, 0, 0, 0]),
        ("tp", [0, 0, 0, 0]),
        ("hsdp", [0, 1, 0, 1]),  # shard groups {0, 1} and {2, 3}: rank r holds the same shard as r + 2
        ("zero2", [None] * 4),
        ("fsdp", [None] * 4),
        ("fsdp+tp", [None] * 4),
    ],
)
def test_builtin_replica_groups(name, groups):
    strategy = strategies.get(name)
    assert [strategy.replica_group(lo) for lo in _layouts(strategy)] == groups


def test_builtin_memory_traits():
    wrappers = {s.name: s.wrapper for s in strategies.registered() if s.name in BUILTIN}
    assert wrappers == {
        "ddp": Wrapper.DDP,
        "zero1": Wrapper.DDP,
        "zero2": Wrapper.FSDP,
        "fsdp": Wrapper.FSDP,
        "hsdp": Wrapper.FSDP,
        "tp": Wrapper.NONE,
        "fsdp+tp": Wrapper.FSDP,
    }
    assert [s.name for s in strategies.registered() if not s.reshard_after_forward] == ["zero2"]


# ---------------------------------------------------------------------------------------------
# Names and config checks.


def test_an_unknown_name_is_a_config_error_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError) as err:
        strategies.get("zero4")
    assert err.value.key == "parallel.strategy"
    assert all(name in str(err.value) for name in STRATEGIES)
    with pytest.raises(ConfigError) as err:
        ParallelConfig(strategy="zero4")  # built in code, not only from a file
    assert err.value.key == "parallel.strategy"


def test_deterministic_is_refused_where_unsupported_naming_the_strategies_that_support_it():
    able = [s.name for s in strategies.registered() if s.supports_deterministic]
    assert able == ["ddp"]
    for strategy in strategies.registered():
        if strategy.supports_deterministic:
            assert ParallelConfig(strategy=strategy.name, deterministic=True).deterministic
            continue
        with pytest.raises(ConfigError, match=r"parallel\.strategy=ddp only") as err:
            ParallelConfig(strategy=strategy.name, deterministic=True)
        assert err.value.key == "parallel.deterministic"


def test_a_strategy_rejects_what_it_cannot_run_with():
    with pytest.raises(ConfigError, match="zero1") as err:
        load_config(None, ["--parallel.strategy=zero1", "--checkpoint.uri=/tmp/ck"])
    assert err.value.key == "parallel.strategy"


def test_the_registry_and_the_config_import_no_torch():
    code = (
        "import sys, ftrain.config, ftrain.parallel.strategies\n"
        "assert len(ftrain.parallel.strategies.registered()) >= 7\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_no_strategy_name_is_compared_outside_the_strategy_modules():
    """Callers dispatch through the registry: no ``if strategy == "x"`` or ``{"x": ...}`` tables."""
    found = []
    for path in sorted((REPO / "ftrain").rglob("*.py")):
        if path.parent == REPO / "ftrain" / "parallel" / "strategies":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Dict):
                operands = [k for k in node.keys if k is not None]
            else:
                continue
            for operand in operands:
                for leaf in ast.walk(operand):
                    if isinstance(leaf, ast.Constant) and leaf.value in STRATEGIES:
                        found.append(f"{path.relative_to(REPO)}:{leaf.lineno} {leaf.value!r}")
    assert found == []


# ---------------------------------------------------------------------------------------------
# Discovery: a strategy is one module.

_NEW_STRATEGY = '''
"""A hypothetical strategy: the whole of it is this module."""
from ftrain.parallel.strategies.base import Layout, Strategy, Wrapper


class LocalSGD(Strategy):
    name = "local-sgd"
    position = 10
    preference = 10
    wrapper = Wrapper.NONE

    def layout(self, parallel, *, world_size, rank, local_world_size, n_head):
        return Layout(self.name, world_size, rank, world_size, rank)

    def replica_group(self, layout):
        return None

    def shard_count(self, layout):
        return 1

    def textbook_model_state_bytes(self, num_params, *, shard, tp_split, tp):
        return 16 * num_params


STRATEGY = LocalSGD()
'''


def _package(tmp_path, monkeypatch, name: str, modules: dict[str, str]) -> str:
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    for module, text in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_new_strategy_module_is_found_and_ordered(tmp_path, monkeypatch):
    first = _NEW_STRATEGY.replace("LocalSGD", "First").replace('"local-sgd"', '"first"').replace("= 10", "= 1")
    package = _package(
        tmp_path, monkeypatch, "more_strategies_a", {"local_sgd": _NEW_STRATEGY, "first": first, "_helpers": "X = 1\n"}
    )
    found = strategies.discover(package)
    assert [s.name for s in found] == ["first", "local-sgd"]
    local = found[1]
    assert local.layout(ParallelConfig(), world_size=2, rank=1, local_world_size=2, n_head=None).dp_rank == 1


def test_a_module_without_a_strategy_or_a_clash_is_refused(tmp_path, monkeypatch):
    package = _package(tmp_path, monkeypatch, "more_strategies_b", {"typo": "STRATEGIE = None\n"})
    with pytest.raises(TypeError, match="must define STRATEGY"):
        strategies.discover(package)
    twin = _NEW_STRATEGY.replace('"local-sgd"', '"twin"')
    package = _package(tmp_path, monkeypatch, "more_strategies_c", {"one": _NEW_STRATEGY, "two": twin})
    with pytest.raises(TypeError, match="share a position"):
        strategies.discover(package)
