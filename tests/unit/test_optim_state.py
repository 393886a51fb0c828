"""Optimizer state in checkpoints (ftrain.optim_state): new steps pack each parameter's group
settings into one item, and steps in the two older forms still load, bitwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from ftrain import optim_state
from ftrain.checkpoint.errors import CheckpointError
from ftrain.checkpoint.manifest import Manifest
from ftrain.checkpoint.safe_pickle import SafeLoadPlanner
from ftrain.checkpointing import apply_loaded, load_target, manifest_fields, training_state
from ftrain.config import Config, ModelConfig, OptimConfig
from ftrain.data import DataCursor
from ftrain.model import build_model
from ftrain.optim import param_groups


def _trained(seed: int) -> SimpleNamespace:
    """A GPT and AdamW (two param groups, as ftrain builds them) after two steps."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16))
    optimizer = torch.optim.AdamW(param_groups(model, OptimConfig(weight_decay=0.1)), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return SimpleNamespace(model=model, optimizer=optimizer, layout=SimpleNamespace(pp_size=1))


def _manifest(form: str | None) -> Manifest:
    layout = {} if form is None else {optim_state.FORMAT_KEY: form}
    cursor = DataCursor(64, 4, 0)
    return Manifest(
        step=2,
        round=0,
        world_size=1,
        layout=layout,
        config_hash="h",
        config={},
        trainer={"cursor": cursor.state_dict()},
        digest_algorithm="xxh3_128",
        files={},
        created_time=1.7e9,
    )


def test_per_param_packs_each_parameters_settings_into_one_item_and_unpacks_to_torchs_flat_form():
    par = _trained(0)
    _, flat = get_state_dict(par.model, par.optimizer, options=optim_state.state_options(optim_state.FLAT))
    packed = optim_state.packed(flat)
    names = [n for n, _ in par.model.named_parameters()]
    groups = [k for k in packed if k.startswith("param_groups.")]
    assert sorted(groups) == sorted(f"param_groups.{n}" for n in names)  # one item per parameter
    settings = sum(k.startswith("param_groups.") for k in flat)
    assert settings >= 10 * len(names)  # torch's form: one per setting (lr, betas, eps, weight_decay, ...)
    assert optim_state.unpacked(packed) == flat


@pytest.mark.parametrize("value", [0.1, ("lr", 0.1), (("lr",),), ((1, 0.1),)])
def test_a_packed_item_that_is_not_setting_value_pairs_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"param_groups\.w"):
        optim_state.unpacked({"param_groups.w": value})


def test_new_steps_record_the_per_param_form():
    par = SimpleNamespace(layout=SimpleNamespace(world_size=1, describe=lambda: {"strategy": "ddp"}))
    fields = manifest_fields(Config(), par, DataCursor(64, 4, 0), 0)  # type: ignore[arg-type]
    assert fields["layout"][optim_state.FORMAT_KEY] == optim_state.PER_PARAM


@pytest.mark.parametrize("form", [optim_state.PER_PARAM, optim_state.FLAT, None])
def test_a_step_in_every_form_loads_bitwise_into_a_fresh_model_and_optimizer(form, tmp_path):
    saved, fresh = _trained(0), _trained(1)
    manifest = _manifest(form)
    state = training_state(saved, 0, manifest)  # type: ignore[arg-type]
    optim_items = [k for k in state["optim"] if k.startswith("param_groups")]
    if form == optim_state.PER_PARAM:
        assert all(isinstance(state["optim"][k], tuple) for k in optim_items)
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)

    target = load_target(fresh, 0, manifest)  # type: ignore[arg-type]
    dcp.load(target, checkpoint_id=tmp_path, planner=SafeLoadPlanner(), no_dist=True)  # weights-only unpickling
    apply_loaded(fresh, DataCursor(64, 4, 0), 0, manifest, target)  # type: ignore[arg-type]

    for (name, a), (_, b) in zip(saved.model.state_dict().items(), fresh.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    want, got = saved.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for key, per_param in want["state"].items():
        for field, value in per_param.items():
            assert torch.equal(got["state"][key][field], value), (key, field)


def test_a_damaged_packed_item_is_a_checkpoint_error_naming_the_step():
    par = _trained(0)
    manifest = _manifest(optim_state.PER_PARAM)
    state = training_state(par, 0, manifest)  # type: ignore[arg-type]
    key = next(k for k in state["optim"] if k.startswith("param_groups."))
    state["optim"][key] = "garbage"
    with pytest.raises(CheckpointError, match=rf"step 2: optimizer item '{key}'"):
        apply_loaded(par, DataCursor(64, 4, 0), 0, manifest, state)  # type: ignore[arg-type]
