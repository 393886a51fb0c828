"""Hugging Face weights in and out: ``model.init_from`` (a local checkpoint directory) and
``ftrain ckpt export --format hf``.

In: :func:`load_hf_weights` reads a ``save_pretrained`` directory (``config.json`` and
``model.safetensors``, or shards listed by ``model.safetensors.index.json``) into the whole model on
the CPU, before the strategy shards it (so any strategy or pipeline layout takes the weights as
they are). Names map by the model's kind (:func:`name_map`): a model of :mod:`ftrain.models.hf` (or
any with a transformers ``config``) has the Hugging Face names already; the built-in llama maps
through :func:`ftrain.models.llama.hf_name_map`; the reference GPT has no Hugging Face equivalent.
Before any tensor is read: the config.json's sizes equal the model's (a mismatch names the
setting rather than a tensor), and so do the settings that change what the same tensors compute
(:mod:`ftrain.models.config_match`: ``rope_theta``, ``rms_norm_eps``, ...) unless
``model.override_weights_config`` names them; every tensor of the model is in the files with its
shape and a dtype that can be a weight (a float for a float parameter: an int8 or bool tensor is
a quantized or foreign checkpoint, refused), and nothing else is (rotary ``inv_freq`` buffers
that older checkpoints carry excepted); a tied head may be absent. Each file is then read once
(:mod:`ftrain.models.safetensors_file`: checked as untrusted input), hashed as read, and loaded
from those bytes: the sha256 logged and returned is of what was loaded.

Out: :func:`to_hf` turns a checkpoint's model state (its parameter names) and the model config
the manifest recorded into the tensors, ``config.json`` and ``generation_config.json`` of a
``save_pretrained`` directory (what transformers writes for the same config, without the
classification heads' ``id2label`` defaults); :func:`ftrain.checkpoint.export.write_hf_dir` writes
them. A model of :mod:`ftrain.models.hf` is exported with the config it was built from, recorded in
every checkpoint (:func:`model_record`), not with what ``model.args.config`` holds by then.
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
from ftrain.models import config_match
from ftrain.models.deferred_init import storage_key
from ftrain.models.safetensors_file import Entry, SafetensorsFileError, read_file, read_header

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
#: the built-in llama's settings of the behaviour keys it has (the others it cannot change)
LLAMA_BEHAVIOUR_SETTINGS = {"rope_theta": "model.rope_theta", "rms_norm_eps": "model.norm_eps"}
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
#: where a checkpoint's manifest keeps the config a model of :mod:`ftrain.models.hf` was built from
#: (in its ``config["model"]``, beside the settings), and the sha256 of that config's canonical JSON
RECORD_KEY = "hf_config"
RECORD_DIGEST_KEY = "hf_config_sha256"


#: how an init_from mismatch names the weights' side
INIT_FROM_SIDE = "its config.json"


class WeightsConfigError(ConfigError):
    """The model's config and the config its starting weights were trained with differ in a
    setting that changes what it computes. Restarting cannot help: the agent ends the job."""

    fatal = True


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


# -- the settings that change what the weights compute ----------------------------------------
def _mismatch(differs: list[tuple[str, Any, Any]], setting_of: Mapping[str, str], where: str, fix: str) -> None:
    """Raise :class:`WeightsConfigError` for the first of ``differs`` (key, theirs, mine)."""
    key, theirs, mine = differs[0]
    more = f" (and {', '.join(d[0] for d in differs[1:])})" if len(differs) > 1 else ""
    setting = setting_of.get(key, "")
    from_init = where == INIT_FROM_SIDE
    raise WeightsConfigError(
        KEY if from_init else "model",
        f"{where} {'has' if from_init else 'was trained with'} {key} = {theirs!r} but the model has {mine!r}"
        f"{f' ({setting})' if setting else ''}{more}: {fix}, or name {key!r} in {config_match.OVERRIDE_KEY} "
        "to train with the model's value",
    )


def _behaviour_check(
    theirs: Mapping[str, Any], mine: Mapping[str, Any], cfg: ModelConfig, where: str, fix: str
) -> None:
    """Refuse a difference the override does not name; log those it names."""
    differs = config_match.differences(theirs, mine)
    override = config_match.parse_override(cfg.override_weights_config)
    for key, a, b in differs:
        if key in override:
            log.warning("%s: %s = %r there; the model keeps %r (%s)", where, key, a, b, config_match.OVERRIDE_KEY)
    refused = config_match.refused(differs, override)
    if refused:
        llama = kind_of(cfg) == "llama"
        setting_of = LLAMA_BEHAVIOUR_SETTINGS if llama else {k: f"model.args.{k}" for k, *_ in refused}
        _mismatch(refused, setting_of, where, fix)


def _hf_behaviour(config_cls: type, config: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The behaviour keys of ``config`` as transformers reads it (old names mapped to new)."""
    try:
        normalized = config_cls.from_dict(dict(config)).to_dict()  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - transformers raises huggingface_hub's own errors
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(KEY, f"{what} is not a valid {config_cls.__name__}: {first[:300]}") from e
    return config_match.behaviour_of_hf(normalized)


def _check_config(model: nn.Module, cfg: ModelConfig, theirs: Mapping[str, Any]) -> None:
    """The config.json's sizes and behaviour settings against the model's; a ConfigError names
    the first that differs."""
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
        _behaviour_check(
            config_match.behaviour_of_hf(theirs),
            config_match.behaviour_of_llama(cfg.rope_theta, cfg.norm_eps),
            cfg,
            INIT_FROM_SIDE,
            "set the model's value to the checkpoint's (the built-in llama computes default rotary embeddings and "
            f'SiLU only: for another, use model.factory = "{HF_FACTORY}" with config = the directory)',
        )
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
    _behaviour_check(
        _hf_behaviour(type(own), theirs, "init_from's config.json"),
        config_match.behaviour_of_hf(mine_all),
        cfg,
        INIT_FROM_SIDE,
        "give the model the checkpoint's value (simplest: model.args.config = the init_from directory)",
    )


# -- in ----------------------------------------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory, sharded or not."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
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


def damaged(e: Exception) -> ConfigError:
    return ConfigError(
        KEY,
        f"{e}. Download or copy the file again (or write the directory again with save_pretrained)",
    )


def _ignorable(hf_name: str) -> bool:
    """Buffers older checkpoints carry that the model computes itself."""
    return hf_name.rsplit(".", 1)[-1] == "inv_freq"


def _dtype_problem(entry: Entry, target: torch.Tensor) -> str:
    """Why a tensor stored as ``entry`` cannot fill ``target`` ("" if it can)."""
    source = entry.torch_dtype
    if target.is_floating_point():
        if source.is_floating_point:
            return ""
        return (
            f"is {entry.dtype}, which cannot be the model's {str(target.dtype).removeprefix('torch.')} weight "
            "(a quantized or non-float checkpoint: give unquantized float weights)"
        )
    if source != target.dtype:
        return f"is {entry.dtype} but the model's buffer is {str(target.dtype).removeprefix('torch.')}"
    return ""


def _survey(files: list[Path]) -> dict[str, tuple[Path, Entry]]:
    """Every tensor the files' headers name -> (its file, its entry); a name in two files is an error."""
    found: dict[str, tuple[Path, Entry]] = {}
    for file in files:
        try:
            entries = read_header(file)
        except (SafetensorsFileError, OSError) as e:
            raise damaged(e) from e
        for name, entry in entries.items():
            if name in found:
                raise ConfigError(KEY, f"{name!r} is in both {found[name][0].name} and {file.name}")
            found[name] = (file, entry)
    return found


def _check_tensors(target: Mapping[str, torch.Tensor], hf_of: Mapping[str, str], found: Mapping[str, Any]) -> None:
    ours_of = {v: k for k, v in hf_of.items()}
    unexpected = sorted(k for k in found if k not in ours_of and not _ignorable(k))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(KEY, f"{unexpected[0]!r}{more} is in the checkpoint but not a tensor of the model")
    present_storage = {storage_key(target[ours_of[k]]) for k in found if k in ours_of}
    for ours, hf in hf_of.items():
        if hf in found:
            file, entry = found[hf]
            shape = tuple(target[ours].shape)
            if entry.shape != shape:
                raise ConfigError(
                    KEY, f"{hf!r} has shape {list(entry.shape)} in the checkpoint but {list(shape)} in the model"
                )
            problem = _dtype_problem(entry, target[ours])
            if problem:
                raise ConfigError(KEY, f"{hf!r} in {file.name} {problem}")
        elif storage_key(target[ours]) not in present_storage:  # a tied copy is enough
            raise ConfigError(KEY, f"{hf!r} (the model's {ours!r}) is not in the checkpoint")


@dataclasses.dataclass(frozen=True, slots=True)
class InitFrom:
    """``model.init_from`` checked against a model (headers read, no tensor): what to read from where."""

    directory: Path
    files: list[Path]
    found: dict[str, tuple[Path, Entry]]  #: every tensor the files hold -> (its file, its entry)
    hf_of: dict[str, str]  #: each of the model's state-dict names -> its name in the files


def survey_init_from(model: nn.Module, cfg: ModelConfig) -> InitFrom:
    """Check ``cfg.init_from`` against ``model`` (whole, or built on the meta device) before any
    tensor is read: the directory, its config.json, every tensor's presence, shape and dtype."""
    directory = Path(cfg.init_from)
    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "has no config.json"
        raise ConfigError(
            KEY,
            f"{cfg.init_from!r} {what}: it is read because no checkpoint step is there to resume; give a "
            "Hugging Face save_pretrained directory (config.json + model.safetensors), or leave model.init_from empty",
        )
    from ftrain.models.hf import read_config_json

    theirs = read_config_json(directory, KEY)
    names = name_map(cfg)
    _check_config(model, cfg, theirs)
    files = weight_files(directory)
    target = model.state_dict()
    hf_of = {k: (names[k] if names is not None and k in names else k) for k in target}
    found = _survey(files)
    _check_tensors(target, hf_of, found)
    return InitFrom(directory, files, found, hf_of)


def load_hf_weights(model: nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """Load ``cfg.init_from``'s safetensors into ``model`` (whole, on the CPU, before sharding);
    returns each file read (its name in the directory) -> the sha256 of the bytes loaded from it."""
    init = survey_init_from(model, cfg)
    directory, files, found = init.directory, init.files, init.found
    target = model.state_dict()
    ours_of = {v: k for k, v in init.hf_of.items()}
    loaded = 0
    digests: dict[str, str] = {}
    with torch.no_grad():
        for file in files:
            try:
                whole = read_file(file)
            except (SafetensorsFileError, OSError) as e:
                raise damaged(e) from e
            for key, tensor in whole.tensors.items():
                if key not in ours_of:
                    continue
                if found.get(key, (None, None))[1] != whole.entries[key]:
                    raise damaged(SafetensorsFileError(f"{str(file)!r} changed while it was read ({key!r})"))
                target[ours_of[key]].copy_(tensor)
                loaded += 1
            digests[file.name] = whole.sha256
    log.info(
        "model.init_from: %d tensors from %s (%s)",
        loaded,
        directory,
        ", ".join(f"{name} sha256={digest}" for name, digest in digests.items()),
    )
    return digests


# -- what a checkpoint records -----------------------------------------------------------------
def _canonical_sha256(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_record(model: nn.Module, cfg: ModelConfig) -> dict[str, Any]:
    """What a checkpoint's manifest keeps (in its ``config["model"]``) of the model as built: for a
    model of :mod:`ftrain.models.hf`, the config it was built from (``model.args.config``'s content
    as it was read, with the args applied) and its digest; nothing for the other kinds, whose
    settings are all in ``[model]``."""
    own = getattr(model, "config", None)
    if cfg.factory != HF_FACTORY or own is None or not callable(getattr(own, "to_dict", None)):
        return {}
    config = json.loads(json.dumps(own.to_dict(), default=str))  # plain JSON, as the manifest keeps it
    return {RECORD_KEY: config, RECORD_DIGEST_KEY: _canonical_sha256(config)}


def recorded_hf_config(recorded: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config a manifest's ``config["model"]`` recorded (:func:`model_record`); None for a step
    saved before ftrain recorded it; a ConfigError when the record is malformed."""
    if RECORD_KEY not in recorded:
        return None
    config, digest = recorded.get(RECORD_KEY), recorded.get(RECORD_DIGEST_KEY)
    if not isinstance(config, dict) or not isinstance(digest, str):
        raise ConfigError("model", f"the checkpoint's record of the model config ({RECORD_KEY}) is malformed")
    if _canonical_sha256(config) != digest:
        raise ConfigError(
            "model", f"the checkpoint's {RECORD_KEY} does not match its {RECORD_DIGEST_KEY}: the manifest was altered"
        )
    return config


def check_resumed_model(recorded: Mapping[str, Any], cfg: ModelConfig, record: Mapping[str, Any], step: int) -> None:
    """Before a resume reads any file: the model's behaviour settings equal those the checkpoint's
    step was trained with (``recorded``: its manifest's ``config["model"]``; ``record``: this
    model's :func:`model_record`); :class:`WeightsConfigError` naming the first that differs."""
    where = f"checkpoint step {step}"
    if kind_of(cfg) == "llama" and not recorded.get("factory") and recorded.get("arch") == "llama":
        theirs_values = (recorded.get("rope_theta"), recorded.get("norm_eps"))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in theirs_values):
            _behaviour_check(
                config_match.behaviour_of_llama(*theirs_values),  # type: ignore[arg-type]
                config_match.behaviour_of_llama(cfg.rope_theta, cfg.norm_eps),
                cfg,
                where,
                "resume with the value it was trained with",
            )
        return
    theirs = recorded_hf_config(recorded) if recorded.get("factory") == HF_FACTORY else None
    mine = record.get(RECORD_KEY)
    if theirs is None or not isinstance(mine, Mapping):
        return
    _behaviour_check(
        config_match.behaviour_of_hf(theirs),
        config_match.behaviour_of_hf(mine),
        cfg,
        where,
        "resume with the model.args (and model.args.config file) it was trained with",
    )


# -- out ---------------------------------------------------------------------------------------
def model_config_from(recorded: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig a manifest recorded (its ``config["model"]``); ``init_from`` dropped (the
    weights are the checkpoint's, and the directory need not exist here)."""
    if not isinstance(recorded, Mapping):
        raise ConfigError("model", f"the checkpoint records a {type(recorded).__name__} as its [model] section")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in recorded.items() if k in known}
    values["init_from"] = ""
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:  # a ConfigError names the key already; a wrong type does not
        if isinstance(e, ConfigError):
            raise
        raise ConfigError("model", f"the checkpoint's recorded [model] section is not a model config: {e}") from e


def _hf_config_object(cfg: ModelConfig, recorded: Mapping[str, Any]) -> Any:
    """The transformers config of the model ``recorded`` describes (for export)."""
    from ftrain.models.hf import FAMILIES, family_of, transformers_module

    kind = kind_of(cfg)
    if kind == "gpt":
        raise _no_hf_form("no Hugging Face config")
    transformers = transformers_module()
    if kind == "llama":
        from ftrain.models.llama import hf_config

        return transformers.LlamaConfig.from_dict(hf_config(cfg))
    if cfg.factory != HF_FACTORY:
        raise ConfigError("model.factory", f"{cfg.factory}: only {HF_FACTORY} models export to Hugging Face")
    built_from = recorded_hf_config(recorded)
    if built_from is None:
        from ftrain.models.hf import hf_model_config

        log.warning(
            "this step records no model config (saved by an older ftrain): exporting the config that "
            "model.args%s describes now; if %s changed since the step was trained, this is another model's config",
            f" (and {cfg.args['config']!r})" if "config" in cfg.args else "",
            "that file or transformers' defaults" if "config" in cfg.args else "transformers' defaults",
        )
        return hf_model_config(cfg)
    family = family_of(str(built_from.get("model_type", "")), "model")
    config_cls = getattr(transformers, FAMILIES[family][0])
    try:
        return config_cls.from_dict(dict(built_from))
    except Exception as e:  # noqa: BLE001 - transformers raises huggingface_hub's own errors
        raise ConfigError("model", f"the checkpoint's recorded {config_cls.__name__} does not load: {e}") from e


def hf_files_of(config: Any) -> dict[str, dict[str, Any]]:
    """``config.json`` and ``generation_config.json`` of a model with the transformers ``config``, as
    ``save_pretrained`` writes them (only what differs from transformers' defaults: no
    ``id2label``/``label2id`` of a classification head the model does not have)."""
    from ftrain.models.hf import FAMILIES, transformers_module

    transformers = transformers_module()
    config.use_cache = True
    config.architectures = [FAMILIES[config.model_type][1]]
    out = config.to_diff_dict()
    for noise in ("id2label", "label2id", "_name_or_path", "torch_dtype"):
        out.pop(noise, None)
    out["dtype"] = "float32"
    generation = transformers.GenerationConfig.from_model_config(config)
    return {"config.json": out, "generation_config.json": json.loads(generation.to_json_string(use_diff=True))}


def to_hf(
    model_state: Mapping[str, Any], recorded: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """A checkpoint's model state and recorded ``[model]`` config -> Hugging Face tensors and the
    JSON files beside them (``config.json``, ``generation_config.json``).

    A tied head is written once (as ``save_pretrained`` does): ``lm_head.weight`` is left out when
    the config ties word embeddings."""
    cfg = model_config_from(recorded)
    config = _hf_config_object(cfg, recorded)
    files = hf_files_of(config)
    names = name_map(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model_state.items():
        if not torch.is_tensor(value):
            continue
        hf = names.get(name, name) if names is not None else name
        if names is not None and name not in names:
            raise ConfigError("model", f"the checkpoint's {name!r} has no Hugging Face name")
        tensors[hf] = value
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors, files
