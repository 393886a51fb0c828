"""Hugging Face causal LMs under every strategy: ``model.factory = "ftrain.models.hf:causal_lm"``.

``[model.args]`` says which model: ``config`` (a ``config.json`` or a directory holding one: its
``model_type`` picks the family) or ``family`` (one of :data:`FAMILIES`), and any setting of that
family's config (``hidden_size = 64``, ``num_key_value_heads = 2``, ...; a setting the family does
not have is an error naming it; ``rope_theta`` and ``rope_scaling``, transformers 4's names, go into
transformers 5's ``rope_parameters``). ``model.vocab_size`` and ``model.seq_len`` fill ``vocab_size`` and
``max_position_embeddings`` when the args leave them out. The model is built from its config with
fresh weights (``model.init_from`` loads a checkpoint's) and SDPA attention, without a KV cache.

The families :data:`FAMILIES` share one structure (``model.embed_tokens``, ``model.layers``,
``model.rotary_emb``, ``model.norm``, ``lm_head``), which :func:`hf_layout` declares to the
runtime: the decoder layers are the FSDP units and the pipeline's blocks, the tensor-parallel
plan is the family's own ``base_model_tp_plan``. Parameter names are the Hugging Face ones, so a
checkpoint exports to a ``save_pretrained`` directory as it is.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ftrain.config import ConfigError, ModelConfig
from ftrain.models.layout import TP_STYLES, ModelLayout, Parts, declare

#: ``model.args.family`` -> the transformers config and model classes
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
#: the args this factory reads itself (the rest are the family config's settings)
OWN_ARGS = ("config", "family")
#: transformers 4's rotary settings, which transformers 5 keeps in ``rope_parameters``: accepted in
#: ``[model.args]`` and put there
LEGACY_ROPE_ARGS = ("rope_theta", "rope_scaling")


def transformers_module() -> Any:
    """``transformers``, or a ConfigError naming the extra that installs it."""
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(
            "model.factory", f"Hugging Face models need the hf extra: pip install 'ftrain[hf]' ({e})"
        ) from None
    return transformers


def read_config_json(path: str | Path, key: str = "model.args.config") -> dict[str, Any]:
    """A Hugging Face ``config.json`` (or the one in directory ``path``) as a dict; ConfigError naming ``key``."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(key, f"{str(file)!r} does not exist (give a config.json or a directory with one)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(key, f"cannot read {str(file)!r} as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(key, f"{str(file)!r} is not a JSON object")
    return data


def family_of(model_type: str, key: str) -> str:
    if model_type not in FAMILIES:
        close = difflib.get_close_matches(model_type, list(FAMILIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(key, f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}{hint}")
    return model_type


def hf_model_config(cfg: ModelConfig) -> Any:
    """The transformers config ``[model.args]`` describes, checked against ``cfg``."""
    transformers = transformers_module()
    args = dict(cfg.args)
    settings: dict[str, Any] = {}
    if "config" in args:
        settings = read_config_json(str(args["config"]))
        family = family_of(str(settings.get("model_type", "")), "model.args.config")
        if "family" in args and args["family"] != family:
            raise ConfigError("model.args.family", f"{args['family']!r} but the config's model_type is {family!r}")
    elif "family" in args:
        family = family_of(str(args["family"]), "model.args.family")
    else:
        raise ConfigError(
            "model.args",
            'say which model: config = "path/to/config.json" (or its directory), or family = '
            + " | ".join(repr(f) for f in FAMILIES),
        )
    config_cls = getattr(transformers, FAMILIES[family][0])
    known = set(config_cls().to_dict())
    rope: dict[str, Any] = {}  #: rope_theta / rope_scaling given in the args (transformers 4's names)
    for name, value in args.items():
        if name in OWN_ARGS:
            continue
        if name in LEGACY_ROPE_ARGS and name not in known and "rope_parameters" in known:
            rope[name] = value
            continue
        if name not in known:
            hint = difflib.get_close_matches(name, sorted(known), n=1)
            where = " (transformers 5 keeps the rotary settings in rope_parameters)" if name.startswith("rope") else ""
            raise ConfigError(
                f"model.args.{name}",
                f"not a setting of {config_cls.__name__}" + (f" (did you mean {hint[0]!r}?)" if hint else "") + where,
            )
        settings[name] = value
    settings.setdefault("vocab_size", cfg.vocab_size)
    settings.setdefault("max_position_embeddings", cfg.seq_len)
    settings.pop("model_type", None)
    settings.pop("architectures", None)
    if rope:
        settings["rope_parameters"] = _with_rope_args(config_cls, settings, rope, given="rope_parameters" in args)
    config = _construct(config_cls, settings, "model.args.config" if "config" in args else "model.args")
    if config.vocab_size < cfg.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.vocab_size} exceeds the model's vocab_size {config.vocab_size}: the data's token ids must fit it",
        )
    if config.max_position_embeddings < cfg.seq_len:
        raise ConfigError(
            "model.seq_len",
            f"{cfg.seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}",
        )
    config.use_cache = False
    return config


def _construct(config_cls: Any, settings: dict[str, Any], key: str) -> Any:
    """``config_cls(**settings)``; what transformers refuses (its own exception types) as a ConfigError."""
    try:
        return config_cls(**settings)
    except Exception as e:  # noqa: BLE001 - transformers raises huggingface_hub's own (non-ValueError) errors
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(key, f"{config_cls.__name__} refuses these settings: {first[:300]}") from e


def _with_rope_args(config_cls: Any, settings: dict[str, Any], rope: dict[str, Any], *, given: bool) -> dict[str, Any]:
    """The family's ``rope_parameters`` with the args' ``rope_theta`` / ``rope_scaling`` (the keys a
    transformers 4 config used) put into it: what ``config_cls(rope_theta=...)`` would take, except
    that a value given here wins over one in the config file."""
    if given:
        raise ConfigError(
            f"model.args.{next(iter(rope))}",
            "and model.args.rope_parameters are both given: put the rotary settings in rope_parameters only",
        )
    base = dict(_construct(config_cls, settings, "model.args").rope_parameters or {})
    scaling = rope.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ConfigError("model.args.rope_scaling", f"must be a table, got {scaling!r}")
        scaling = dict(scaling)
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        base = {"rope_theta": base.get("rope_theta"), **scaling}
    if "rope_theta" in rope:
        base["rope_theta"] = rope["rope_theta"]
    return base


def causal_lm(cfg: ModelConfig) -> nn.Module:
    """The factory: a Hugging Face causal LM built from ``[model.args]``, its layout declared."""
    transformers = transformers_module()
    config = hf_model_config(cfg)
    family = family_of(config.model_type, "model.args")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if type(model).__name__ != FAMILIES[family][1]:
        raise ConfigError("model.args", f"built a {type(model).__name__}, expected {FAMILIES[family][1]}")
    declare_layout(model, cfg.seq_len)
    return model


def declare_layout(model: nn.Module, seq_len: int) -> nn.Module:
    """Give a Hugging Face causal LM of one of :data:`FAMILIES`' structure its ``ftrain_layout()``
    (for a model built elsewhere: a user's factory can call this on it)."""
    return declare(model, hf_layout(model, seq_len))


def hf_layout(model: nn.Module, seq_len: int) -> ModelLayout:
    config: Any = model.config
    missing = [
        p
        for p in ("model.embed_tokens", "model.layers", "model.rotary_emb", "model.norm", "lm_head")
        if not _has(model, p)
    ]
    if missing:
        raise ConfigError(
            "model.factory",
            f"{type(model).__name__} lacks {', '.join(missing)}: only the Llama-like structure of "
            f"{', '.join(FAMILIES)} is known; declare an ftrain_layout() for it (docs/models.md)",
        )
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan = (
        {f"model.{fqn}": style for fqn, style in base_plan.items()}
        if set(base_plan.values()) <= set(TP_STYLES)
        else None
    )
    heads = getattr(config, "num_attention_heads", None)
    # num_key_value_heads unset: one key/value head per query head, as transformers reads it
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    window = getattr(config, "sliding_window", None)
    splittable = window is None or window >= seq_len  # a narrower window needs its own mask in every stage
    return ModelLayout(
        blocks="model.layers",
        embed=("model.embed_tokens",),
        head=("model.norm", "lm_head"),
        shared=("model.rotary_emb",),
        tp_plan=plan,
        call_embed=_embed if splittable else None,
        context=_rotary,
        call_block=_layer if splittable else None,
        call_head=_head if splittable else None,
        tied=("lm_head.weight",) if getattr(config, "tie_word_embeddings", False) else (),
        heads=heads,
        kv_heads=kv_heads,
    )


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _embed(parts: Parts, tokens: torch.Tensor) -> torch.Tensor:
    return parts["model.embed_tokens"](tokens)


def _rotary(parts: Parts, x: torch.Tensor) -> Any:
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    return positions, parts["model.rotary_emb"](x, position_ids=positions)


def _layer(parts: Parts, layer: nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    positions, rotary = ctx
    out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    return out[0] if isinstance(out, tuple) else out  # transformers 4 returned a tuple


def _head(parts: Parts, x: torch.Tensor) -> torch.Tensor:
    return parts["lm_head"](parts["model.norm"](x))
