"""``parallel.gradient_reduce``: when FSDP strategies reduce-scatter under gradient accumulation.

The setting's checks, ``auto``'s rule (:func:`choose_gradient_reduce`), the plan's memory in each
mode and the table naming it, and the runtime's choice on a world of one (gloo, in process). That
the two modes train alike on two ranks: tests/distributed/test_gradient_reduce.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ftrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ftrain.model import build_model
from ftrain.parallel import strategies
from ftrain.parallel.fsdp import AUTO_MEMORY_FRACTION, FSDPParallel
from ftrain.parallel.strategies._gradient_reduce import EVERY_MICRO_BATCH, LAST_MICRO_BATCH, choose_gradient_reduce
from ftrain.planning.memory import Target, layout_for, model_stats
from ftrain.planning.plan import estimate
from ftrain.planning.plan_report import plan_report

GiB = 2**30
GPU_BF16 = Target("cuda", "bf16")
# dim 0 of every parameter a multiple of 8: no FSDP padding
SMALL: dict[str, Any] = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=128)
FSDP_TYPES = ("zero2", "fsdp", "hsdp", "fsdp+tp")


def _cfg(mode: str = "auto", *, accum: int = 4, world: int = 8, strategy: str = "fsdp") -> Config:
    dp = world // 2 if strategy == "fsdp+tp" else world
    return Config(
        train=TrainConfig(micro_batch_size=2, global_batch_size=2 * dp * accum),
        model=ModelConfig(**SMALL),
        parallel=ParallelConfig(strategy=strategy, gradient_reduce=mode),
    )


def _est(cfg: Config, strategy: str = "fsdp", world: int = 8, target: Target = GPU_BF16):
    stats = model_stats(cfg.model, cfg.optim)
    return stats, estimate(stats, cfg, layout_for(cfg, strategy, world_size=world, gpus_per_node=8), target)


# ---------------------------------------------------------------------------------------------
# The setting.


def test_the_default_is_auto_and_a_bad_value_names_the_key():
    assert ParallelConfig().gradient_reduce == "auto"
    with pytest.raises(ConfigError, match=r"parallel\.gradient_reduce.*'sometimes' is not one of auto"):
        ParallelConfig(strategy="fsdp", gradient_reduce="sometimes")


def test_every_micro_batch_is_refused_inside_a_pipeline():
    with pytest.raises(ConfigError, match=r"parallel\.gradient_reduce.*pipeline"):
        ParallelConfig(strategy="fsdp", gradient_reduce=EVERY_MICRO_BATCH, pp_size=2)
    with pytest.raises(ConfigError, match=r"parallel\.gradient_reduce"):  # a fallback degree counts too
        ParallelConfig(strategy="fsdp", gradient_reduce=EVERY_MICRO_BATCH, pp_size=1, pp_fallback="2")
    ParallelConfig(strategy="fsdp", gradient_reduce=LAST_MICRO_BATCH, pp_size=2)  # today's pipeline behaviour


# ---------------------------------------------------------------------------------------------
# auto's rule.


@pytest.mark.parametrize(
    ("setting", "accum", "last_bytes", "memory_bytes", "chosen"),
    [
        (EVERY_MICRO_BATCH, 4, 1, 100, EVERY_MICRO_BATCH),  # explicit: as it is
        (LAST_MICRO_BATCH, 4, 200, 100, LAST_MICRO_BATCH),
        ("auto", 4, 100, 100, LAST_MICRO_BATCH),  # fits: the faster
        ("auto", 4, 101, 100, EVERY_MICRO_BATCH),  # does not fit: the smaller
        ("auto", 1, 101, 100, LAST_MICRO_BATCH),  # one micro-batch: the modes are the same
        ("auto", 4, None, None, LAST_MICRO_BATCH),  # memory not judged (a CPU)
    ],
)
def test_auto_takes_last_micro_batch_where_it_fits(setting, accum, last_bytes, memory_bytes, chosen):
    assert (
        choose_gradient_reduce(setting, accum_steps=accum, last_bytes=last_bytes, memory_bytes=memory_bytes) == chosen
    )


# ---------------------------------------------------------------------------------------------
# The plan.


@pytest.mark.parametrize("strategy", FSDP_TYPES)
def test_the_modes_differ_by_the_accumulated_unsharded_gradients(strategy):
    every_cfg, last_cfg = _cfg(EVERY_MICRO_BATCH, strategy=strategy), _cfg(LAST_MICRO_BATCH, strategy=strategy)
    stats, every = _est(every_cfg, strategy)
    _, last = _est(last_cfg, strategy)
    assert (every.gradient_reduce, last.gradient_reduce) == (EVERY_MICRO_BATCH, LAST_MICRO_BATCH)
    layout = layout_for(last_cfg, strategy, world_size=8, gpus_per_node=8)
    tp = layout.tp_size
    unsharded = sum(p.numel // tp if p.tp_dim is not None else p.numel for p in stats.params)  # TP-local
    local = last.params_bytes // 4  # the shards this rank stores
    assert last.transient_bytes - every.transient_bytes == 4 * unsharded - 4 * local
    assert last.model_state_bytes == every.model_state_bytes  # the same shards between steps
    assert any(LAST_MICRO_BATCH in n for n in last.notes) and any(EVERY_MICRO_BATCH in n for n in every.notes)


def test_without_accumulation_the_modes_cost_the_same():
    _, every = _est(_cfg(EVERY_MICRO_BATCH, accum=1))
    _, last = _est(_cfg(LAST_MICRO_BATCH, accum=1))
    assert every.total_bytes == last.total_bytes


def test_auto_in_the_plan_follows_the_device_memory():
    _, last = _est(_cfg(LAST_MICRO_BATCH))
    _, every = _est(_cfg(EVERY_MICRO_BATCH))
    assert every.running_bytes < last.running_bytes
    auto = _cfg("auto")
    for memory, chosen in (
        (None, LAST_MICRO_BATCH),  # not judged
        (last.running_bytes, LAST_MICRO_BATCH),
        (last.running_bytes - 1, EVERY_MICRO_BATCH),
        (every.running_bytes - 1, EVERY_MICRO_BATCH),  # nothing fits: the smaller
    ):
        _, e = _est(auto, target=Target("cuda", "bf16", memory_bytes=memory))
        assert e.gradient_reduce == chosen, memory
    # a CPU plan, like a CPU run, treats memory as fitting
    _, e = _est(auto, target=Target("cpu", "fp32", memory_bytes=1))
    assert e.gradient_reduce == LAST_MICRO_BATCH
    # non-FSDP strategies name no mode
    _, ddp = _est(auto, "ddp")
    assert ddp.gradient_reduce == ""


def _table_modes(report: str) -> dict[str, str]:
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in report.splitlines() if line.startswith("| ")]
    header, *body = rows
    column = header.index("gradient_reduce")
    return {row[0]: row[column] for row in body}


def test_the_table_names_the_mode_of_each_fsdp_row():
    cfg = _cfg("auto")
    _, last = _est(_cfg(LAST_MICRO_BATCH))
    roomy = _table_modes(plan_report(cfg, world_size=8, device_memory_bytes=64 * GiB))
    assert {s: roomy[s] for s in FSDP_TYPES} == dict.fromkeys(FSDP_TYPES, LAST_MICRO_BATCH)
    assert roomy["ddp"] == roomy["zero1"] == roomy["tp"] == "-"
    # fsdp's peak with the accumulated gradients does not fit: auto takes every_micro_batch for it
    tight = _table_modes(plan_report(cfg, world_size=8, device_memory_bytes=last.running_bytes - 1))
    assert tight["fsdp"] == EVERY_MICRO_BATCH
    explicit = _table_modes(plan_report(_cfg(EVERY_MICRO_BATCH), world_size=8, device_memory_bytes=64 * GiB))
    assert {s: explicit[s] for s in FSDP_TYPES} == dict.fromkeys(FSDP_TYPES, EVERY_MICRO_BATCH)


# ---------------------------------------------------------------------------------------------
# The runtime, on a world of one.


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _parallel(mode: str, *, accum: int, probe=None) -> FSDPParallel:
    cfg = _cfg(mode, accum=accum, world=1)
    small = ModelConfig(**(SMALL | dict(n_layer=2, d_model=32, n_head=4)))
    cfg = Config(train=cfg.train, model=small, parallel=cfg.parallel)
    strategy = strategies.get("fsdp")
    layout = layout_for(cfg, "fsdp", world_size=1, gpus_per_node=1)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert layout.mesh_shape is not None
    shape, names = layout.mesh_shape
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    cpu = torch.device("cpu")
    model = strategy.apply_data_parallel(model, cfg.parallel, layout, mesh, cpu, torch.float32)
    optimizer = strategy.make_optimizer([{"params": list(model.parameters())}], cfg.optim)
    if probe is None:
        par = strategy.make_parallel(model, optimizer, layout, cpu, torch.float32, accum)
        assert isinstance(par, FSDPParallel)
        return par
    return FSDPParallel(
        model, optimizer, layout, cpu, torch.float32, gradient_reduce=mode, accum_steps=accum, memory_probe=probe
    )


def _micro_batches(par: FSDPParallel, accum: int) -> list[bool]:
    """Run one step's micro-batches; whether each one's backward reduced: the sharded gradients
    (``p.grad``) exist after it (without sync FSDP2 keeps the unsharded ones aside)."""
    synced = []
    par.optimizer.zero_grad(set_to_none=True)
    for i in range(accum):
        with par.grad_sync(is_last=i == accum - 1):
            x = torch.randint(0, 256, (2, 16))
            logits = par.model(x)
            par.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()), i, accum)
        synced.append(all(p.grad is not None for p in par.model.parameters()))
    return synced


def test_on_a_cpu_auto_is_last_micro_batch(world_of_one):
    par = _parallel("auto", accum=3)
    assert par.gradient_reduce == LAST_MICRO_BATCH
    assert _micro_batches(par, 3) == [False, False, True]


def test_every_micro_batch_reduces_after_each(world_of_one):
    par = _parallel(EVERY_MICRO_BATCH, accum=3)
    assert _micro_batches(par, 3) == [True, True, True]


@pytest.mark.parametrize(("total", "chosen"), [(10**12, LAST_MICRO_BATCH), (1, EVERY_MICRO_BATCH)])
def test_auto_decides_at_the_end_of_the_first_forward_from_the_device(world_of_one, total, chosen):
    """With a device's memory to judge (a fake probe here; torch.cuda's on a GPU), ``auto`` is
    undecided until the first forward ends, and its choice governs that micro-batch already."""
    par = _parallel("auto", accum=3, probe=lambda: (0, total))
    assert par.gradient_reduce == "auto"
    synced = _micro_batches(par, 3)
    assert par.gradient_reduce == chosen
    assert synced == ([True, True, True] if chosen == EVERY_MICRO_BATCH else [False, False, True])
    assert 0 < AUTO_MEMORY_FRACTION < 1


def test_both_modes_give_the_same_gradients(world_of_one):
    grads = {}
    for mode in (EVERY_MICRO_BATCH, LAST_MICRO_BATCH):
        par = _parallel(mode, accum=3)
        torch.manual_seed(1)  # the same micro-batches
        _micro_batches(par, 3)
        grads[mode] = [p.grad.full_tensor() for p in par.model.parameters()]
    for every, last in zip(grads[EVERY_MICRO_BATCH], grads[LAST_MICRO_BATCH], strict=True):
        torch.testing.assert_close(every, last, rtol=1e-5, atol=1e-6)
