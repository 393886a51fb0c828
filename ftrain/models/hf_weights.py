"""Hugging Face weights in and out: ``model.init_from`` (a local checkpoint directory) and
``ftrain ckpt export --format hf``.

In: :func:`load_hf_weights` reads a ``save_pretrained`` directory (``config.json`` and
``model.safetensors``, or shards listed by ``model.safetensors.index.json``) into the whole model on
the CPU, before the strategy shards it (so any strategy or pipeline layout takes the weights as
they are). Names map by the model's kind (:func:`name_map`): a model of :mod:`ftrain.models.hf` (or
any with a transformers ``config``) has the Hugging Face names already; the built-in llama maps
through :func:`ftrain.models.llama.hf_name_map`; the reference GPT has no Hugging Face equivalent.
Every tensor of the model must be in the files with its shape, and nothing else may be (rotary
``inv_freq`` buffers that older checkpoints carry excepted); a tied head may be absent. The
config.json's sizes are checked against the model first, so a mismatch names the setting rather
than a tensor. The sha256 of each file read is logged and returned.

Out: :func:`to_hf` turns a checkpoint's model state (its parameter names) and the model config
the manifest recorded into the tensors and ``config.json`` of a ``save_pretrained`` directory;
:func:`ftrain.checkpoint.export.write_hf_dir` writes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ftrain.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

KEY = "model.init_from"
HF_FACTORY = "ftrain.models.hf:causal_lm"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: config.json's keys -> the built-in llama's (ModelConfig attribute, the setting a user changes);
#: checked before any tensor is read
LLAMA_CONFIG_KEYS = {
    "hidden_size": ("d_model", "model.d_model"),
    "num_hidden_layers": ("n_layer", "model.n_layer"),
    "num_attention_heads": ("n_head", "model.n_head"),
    "num_key_value_heads": ("kv_heads", "model.n_kv_heads"),
    "vocab_size": ("vocab_size", "model.vocab_size"),
    "intermediate_size": ("swiglu_dim", "model.ffn_dim"),
    "tie_word_embeddings": ("tie_embeddings", "model.tie_embeddings"),
}
#: the config.json keys compared with a Hugging Face model's own config
HF_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)
#: numbers that change what the model computes but not its tensors: a difference is logged, not refused
HF_NUMERIC_KEYS = ("rms_norm_eps", "rope_theta")


def _rope_theta(config: Mapping[str, Any]) -> Any:
    rope = config.get("rope_parameters") or {}
    return rope.get("rope_theta", config.get("rope_theta")) if isinstance(rope, Mapping) else config.get("rope_theta")


def _warn_numeric(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    for key in HF_NUMERIC_KEYS:
        a, b = (_rope_theta(c) if key == "rope_theta" else c.get(key) for c in (theirs, mine))
        if a is not None and b is not None and a != b:
            log.warning("model.init_from: config.json's %s = %r but the model uses %r", key, a, b)


def safetensors_module() -> Any:
    """``safetensors.torch``, or a ConfigError naming the extra that installs it."""
    try:
        import safetensors.torch
    except ImportError as e:
        raise ConfigError(KEY, f"Hugging Face weights need the hf extra: pip install 'ftrain[hf]' ({e})") from None
    return safetensors


# -- which kind of model ----------------------------------------------------------------------
def kind_of(cfg: ModelConfig) -> str:
    """``hf`` (Hugging Face names), ``llama`` (the built-in llama) or ``gpt`` (no Hugging Face form)."""
    if cfg.factory:
        return "hf"  # ftrain.models.hf, or a user's factory: its own names are taken as they are
    return "llama" if cfg.arch == "llama" else "gpt"


def _no_hf_form(what: str) -> ConfigError:
    return ConfigError(
        "model.arch",
        f'the reference GPT has no Hugging Face equivalent ({what}): use model.arch = "llama" '
        f'or model.factory = "{HF_FACTORY}"',
    )


def name_map(cfg: ModelConfig) -> dict[str, str] | None:
    """The model's names -> the Hugging Face names (None: the same names)."""
    kind = kind_of(cfg)
    if kind == "gpt":
        raise _no_hf_form("no Hugging Face names")
    if kind == "llama":
        from ftrain.models.llama import hf_name_map

        return hf_name_map(cfg.n_layer)
    return None


# -- in ----------------------------------------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory, sharded or not."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(KEY, f"cannot read {str(index)!r}: {e}") from None
        names = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        outside = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]
        if outside or not names:
            raise ConfigError(
                KEY, f"{INDEX_NAME} must map tensors to file names in {str(directory)!r}, got {outside or names}"
            )
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ConfigError(KEY, f"{INDEX_NAME} lists {', '.join(missing)}, which {str(directory)!r} lacks")
        return [directory / n for n in names]
    if (directory / SINGLE_NAME).is_file():
        return [directory / SINGLE_NAME]
    others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = f" (it holds {', '.join(others)}: only safetensors are read)" if others else ""
    raise ConfigError(KEY, f"{str(directory)!r} has neither {SINGLE_NAME} nor {INDEX_NAME}{hint}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _check_config(model: nn.Module, cfg: ModelConfig, theirs: Mapping[str, Any]) -> None:
    """The config.json's sizes against the model's; a ConfigError names the first that differs."""
    kind = kind_of(cfg)
    if kind == "llama":
        if theirs.get("model_type", "llama") != "llama":
            raise ConfigError(
                KEY, f"config.json's model_type is {theirs['model_type']!r}; the built-in llama reads llama"
            )
        for key, (ours, setting) in LLAMA_CONFIG_KEYS.items():
            value = theirs.get(key)
            if value is None:  # absent (or a null num_key_value_heads: as many as the heads)
                value = cfg.n_head if key == "num_key_value_heads" and key in theirs else None
            mine = getattr(cfg, ours)
            if value is not None and value != mine:
                raise ConfigError(KEY, f"config.json's {key} = {value!r} but the model has {mine!r} ({setting})")
        head_dim = theirs.get("head_dim")
        if head_dim is not None and head_dim != cfg.d_model // cfg.n_head:
            raise ConfigError(KEY, f"config.json's head_dim = {head_dim} but the model has {cfg.d_model // cfg.n_head}")
        _warn_numeric(theirs, {"rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta})
        return
    own = getattr(model, "config", None)
    if own is None or not callable(getattr(own, "to_dict", None)):
        return
    mine_all = own.to_dict()
    for key in HF_CONFIG_KEYS:
        if key in theirs and key in mine_all and theirs[key] != mine_all[key]:
            raise ConfigError(
                KEY, f"config.json's {key} = {theirs[key]!r} but the model has {mine_all[key]!r} (model.args.{key})"
            )
    _warn_numeric(theirs, mine_all)


def _ignorable(hf_name: str) -> bool:
    """Buffers older checkpoints carry that the model computes itself."""
    return hf_name.rsplit(".", 1)[-1] == "inv_freq"


def load_hf_weights(model: nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """Load ``cfg.init_from``'s safetensors into ``model`` (whole, on the CPU, before sharding);
    returns each file read (its name in the directory) -> its sha256."""
    directory = Path(cfg.init_from)
    from ftrain.models.hf import read_config_json

    theirs = read_config_json(directory, KEY)
    names = name_map(cfg)
    _check_config(model, cfg, theirs)
    st = safetensors_module()
    files = weight_files(directory)
    target = model.state_dict()
    hf_of = {k: (names[k] if names is not None and k in names else k) for k in target}
    ours_of = {v: k for k, v in hf_of.items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with st.safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[key] = tuple(f.get_slice(key).get_shape())
    unexpected = sorted(k for k in shapes if k not in ours_of and not _ignorable(k))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(KEY, f"{unexpected[0]!r}{more} is in the checkpoint but not a tensor of the model")
    present_storage = {target[ours_of[k]].untyped_storage().data_ptr() for k in shapes if k in ours_of}
    for ours, hf in hf_of.items():
        if hf in shapes:
            shape = tuple(target[ours].shape)
            if shapes[hf] != shape:
                raise ConfigError(
                    KEY, f"{hf!r} has shape {list(shapes[hf])} in the checkpoint but {list(shape)} in the model"
                )
        elif target[ours].untyped_storage().data_ptr() not in present_storage:  # a tied copy is enough
            raise ConfigError(KEY, f"{hf!r} (the model's {ours!r}) is not in the checkpoint")
    loaded = 0
    with torch.no_grad():
        for file in files:
            with st.safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    if key in ours_of:
                        target[ours_of[key]].copy_(f.get_tensor(key))
                        loaded += 1
    digests = {file.name: sha256_of(file) for file in files}
    log.info(
        "model.init_from: %d tensors from %s (%s)",
        loaded,
        directory,
        ", ".join(f"{name} sha256={digest}" for name, digest in digests.items()),
    )
    return digests


# -- out ---------------------------------------------------------------------------------------
def model_config_from(recorded: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig a manifest recorded (its ``config["model"]``); ``init_from`` dropped (the
    weights are the checkpoint's, and the directory need not exist here)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in recorded.items() if k in known}
    values["init_from"] = ""
    return ModelConfig(**values)


def hf_config_of(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model that computes what ``cfg``'s model does."""
    kind = kind_of(cfg)
    if kind == "gpt":
        raise _no_hf_form("no Hugging Face config")
    if kind == "llama":
        from ftrain.models.llama import hf_config

        return hf_config(cfg)
    if cfg.factory != HF_FACTORY:
        raise ConfigError("model.factory", f"{cfg.factory}: only {HF_FACTORY} models export to Hugging Face")
    from ftrain.models.hf import FAMILIES, hf_model_config

    config = hf_model_config(cfg)
    config.use_cache = True
    out: dict[str, Any] = config.to_dict()
    out["architectures"] = [FAMILIES[config.model_type][1]]
    out["dtype"] = "float32"
    out.pop("torch_dtype", None)
    return out


def to_hf(
    model_state: Mapping[str, Any], recorded: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's model state and recorded ``[model]`` config -> Hugging Face tensors and config.json.

    A tied head is written once (as ``save_pretrained`` does): ``lm_head.weight`` is left out when
    the config ties word embeddings."""
    cfg = model_config_from(recorded)
    config = hf_config_of(cfg)
    names = name_map(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model_state.items():
        if not torch.is_tensor(value):
            continue
        hf = names.get(name, name) if names is not None else name
        if names is not None and name not in names:
            raise ConfigError("model", f"the checkpoint's {name!r} has no Hugging Face name")
        tensors[hf] = value
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return tensors, config
