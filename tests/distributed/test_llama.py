"""The built-in Llama (``model.arch = "llama"``: RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention) trains to the same place under every strategy and pipeline schedule as in one process.

The tolerances are tests/distributed/parity.py's (fp32 on CPU: strategies differ only in the order of
floating-point sums). Four blocks, 4 query and 2 key/value heads, so tensor parallelism splits
both head kinds and every pipeline layout has blocks to place.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ftrain.testbed.jobs import RunResult, optimizer_tensors, train_job
from tests.distributed.batched_runs import batched_runs
from tests.distributed.parity import assert_trains_alike

pytestmark = pytest.mark.dist

LLAMA = ("--model.arch=llama", "--model.n_kv_heads=2", "--model.n_layer=4")


@pytest.fixture
def reference(golden):
    return golden(1, *LLAMA)


def test_the_llama_learns_and_its_parameters_are_llama_shaped(reference):
    assert reference.metrics[-1]["loss"] < reference.metrics[0]["loss"] - 0.3
    model = reference.final["model"]
    assert model["blocks.0.attn.k.weight"].shape == (16, 32)  # 2 kv heads of 8: grouped-query attention
    assert model["blocks.0.mlp.gate.weight"].shape == (128, 32)  # SwiGLU: 8/3 x 32 rounded up to 64s
    assert "pos_emb.weight" not in model and "blocks.0.attn_norm.weight" in model


#: every strategy and pipeline schedule: name -> (ranks, overrides)
STRATEGIES: dict[str, tuple[int, tuple[str, ...]]] = {
    "ddp": (2, ()),
    "zero1": (2, ("--parallel.strategy=zero1",)),
    "zero2": (2, ("--parallel.strategy=zero2",)),
    "fsdp+ac": (2, ("--parallel.strategy=fsdp", "--parallel.activation_checkpointing=true")),
    "hsdp": (4, ("--parallel.strategy=hsdp",)),
    "tp": (2, ("--parallel.strategy=tp",)),
    "fsdp+tp": (4, ("--parallel.strategy=fsdp+tp",)),
    "tp+sp": (2, ("--parallel.strategy=tp", "--parallel.sequence_parallel=true")),
    "fsdp+tp+sp": (4, ("--parallel.strategy=fsdp+tp", "--parallel.sequence_parallel=true")),
    "gpipe": (2, ("--parallel.pp_size=2", "--parallel.pp_schedule=gpipe")),
    "1f1b": (2, ("--parallel.pp_size=2", "--parallel.pp_schedule=1f1b")),
    "interleaved": (2, ("--parallel.pp_size=2", "--parallel.pp_schedule=interleaved_1f1b")),
    "pp2xfsdp2": (4, ("--parallel.pp_size=2", "--parallel.strategy=fsdp")),
}


@pytest.fixture(scope="module")
def strategy_run(tmp_path_factory) -> Callable[[str], RunResult]:
    """``strategy_run(name)``: the run of one case of STRATEGIES; the cases of one world size
    share one torchrun launch (tests/distributed/batched_runs.py)."""
    return batched_runs(tmp_path_factory, {name: (nproc, (*LLAMA, *o)) for name, (nproc, o) in STRATEGIES.items()})


@pytest.mark.timeout(900)  # the first case of a world size waits for all of that size's cases
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_matches_one_process(name, strategy_run, reference):
    result = strategy_run(name)  # also checks that it ran on its ranks and exited 0
    assert_trains_alike(result, reference, " ".join(STRATEGIES[name][1]) or "ddp")


def test_deterministic_mode_is_bitwise_at_one_and_two_ranks(golden):
    det = (*LLAMA, "--parallel.deterministic=true", "--train.global_batch_size=12", "--train.micro_batch_size=1")
    one, two = golden(1, *det), golden(2, *det)
    assert [m["loss"] for m in one.metrics] == [m["loss"] for m in two.metrics]
    for name, tensor in one.final["model"].items():
        assert torch.equal(two.final["model"][name], tensor), name


def test_deterministic_mode_resumes_bitwise_at_another_world_size(tmp_path, golden):
    """Two ranks killed after step 6, resumed on one from the checkpoint of step 4: the final
    weights and optimizer state equal the uninterrupted run's, bit for bit."""
    det = (*LLAMA, "--parallel.deterministic=true", "--train.global_batch_size=12", "--train.micro_batch_size=1")
    ckpt = tmp_path / "ckpt"
    common = (*det, f"--checkpoint.uri={ckpt}", "--checkpoint.interval=4", "--checkpoint.async_mode=off")
    crashed = train_job(tmp_path / "w2", 2, *common, env={"FTRAIN_FAULT_SIGKILL": "6:0"}, check=False, save_final=False)
    assert crashed.returncode != 0 and max(m["step"] for m in crashed.metrics) == 6, crashed.output[-3000:]
    resumed = train_job(tmp_path / "w1", 1, *common, env={"FTRAIN_ROUND": "1"})
    assert resumed.metrics[0]["step"] == 5 and resumed.metrics[0]["world_size"] == 1, resumed.output[-3000:]
    ref = golden(1, *det)
    for name, tensor in ref.final["model"].items():
        assert torch.equal(resumed.final["model"][name], tensor), name
    ref_opt, opt = optimizer_tensors(ref.final["optim"]), optimizer_tensors(resumed.final["optim"])
    assert opt.keys() == ref_opt.keys() and all(torch.equal(opt[k], v) for k, v in ref_opt.items())


def test_sequence_parallelism_runs_the_norms_on_sequence_shards(tmp_path):
    """In one process (a tp mesh of one rank): with parallel.sequence_parallel the norms become
    torch's SequenceParallel (replicated DTensor weights) and the row-split layers leave their
    output sharded along the sequence; without it the norms stay plain parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ftrain.config import ModelConfig
    from ftrain.models.llama import Llama
    from ftrain.parallel.tp import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        plain, sp = (torch.manual_seed(0) and Llama(ModelConfig(arch="llama", size="debug")) for _ in range(2))
        apply_tensor_parallel(plain, mesh["tp"])
        apply_tensor_parallel(sp, mesh["tp"], sequence_parallel=True)
        assert not isinstance(plain.blocks[0].attn_norm.weight, DTensor)
        assert isinstance(sp.blocks[0].attn_norm.weight, DTensor) and isinstance(sp.norm.weight, DTensor)
        seen = []
        sp.blocks[0].attn.o.register_forward_hook(lambda m, i, out: seen.append(out))
        tokens = torch.randint(0, 256, (2, 16))
        assert torch.allclose(sp(tokens), plain(tokens), atol=1e-5)
        assert seen and not isinstance(seen[0], DTensor)  # the local shard (use_local_output)
    finally:
        dist.destroy_process_group()
