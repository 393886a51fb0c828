"""Does a model compute what the weights it starts from were trained to compute? Pure functions
over config dicts (torch-free: :mod:`ftrain.config` checks the override's names with them).

Settings that change a tensor's shape (``hidden_size``, the head counts, ...) cannot differ: the
weights would not fit. The settings here change what the same tensors compute — the rotary base
``rope_theta``, the rest of the rotary parameters (``rope_parameters``: its type and scaling),
``rms_norm_eps``, ``hidden_act``, the attention window (``sliding_window``, ``layer_types``) —
and a difference is an error naming the key unless ``model.override_weights_config`` names it
(a longer context's ``rope_theta`` is deliberate; a config file that drifted is not). They are
compared between the model and ``model.init_from``'s ``config.json``, and on a resume between the
model and the config the checkpoint recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: the settings compared, in the order differences are named
BEHAVIOUR_KEYS = ("rope_theta", "rope_parameters", "rms_norm_eps", "hidden_act", "sliding_window", "layer_types")
OVERRIDE_KEY = "model.override_weights_config"


def rope_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary parameters of a Hugging Face config dict, old form or new: ``rope_parameters``
    (transformers 5) or ``rope_theta`` + ``rope_scaling`` (earlier); ``rope_type`` filled in."""
    params = config.get("rope_parameters")
    if not isinstance(params, Mapping):
        scaling = config.get("rope_scaling")
        params = dict(scaling) if isinstance(scaling, Mapping) else {}
        if "rope_theta" in config:
            params["rope_theta"] = config["rope_theta"]
    out = dict(params)
    kind = out.pop("type", None)
    out.setdefault("rope_type", kind or "default")
    return out


def behaviour_of_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`BEHAVIOUR_KEYS` of a Hugging Face config dict (absent ones left out)."""
    rope = rope_of(config)
    out: dict[str, Any] = {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope.pop("rope_theta")
    out["rope_parameters"] = rope
    for key in ("rms_norm_eps", "hidden_act", "sliding_window", "layer_types"):
        if key in config:
            out[key] = config[key]
    return out


def behaviour_of_llama(rope_theta: float, norm_eps: float) -> dict[str, Any]:
    """The :data:`BEHAVIOUR_KEYS` of the built-in llama (default rotary embeddings, SiLU)."""
    return {
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default"},
        "rms_norm_eps": norm_eps,
        "hidden_act": "silu",
    }


def differences(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, theirs, mine)`` for each behaviour key both sides give and that differs."""
    out = []
    for key in BEHAVIOUR_KEYS:
        if key in theirs and key in mine and theirs[key] is not None and not _same(theirs[key], mine[key]):
            out.append((key, theirs[key], mine[key]))
    return out


def _same(a: Any, b: Any) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if numbers:
        return float(a) == float(b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def parse_override(text: str) -> tuple[str, ...]:
    """The keys ``model.override_weights_config`` names (comma-separated); ValueError naming an
    unknown one (with the closest known key)."""
    import difflib

    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    for key in keys:
        if key not in BEHAVIOUR_KEYS:
            close = difflib.get_close_matches(key, BEHAVIOUR_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{key!r} is not one of {', '.join(BEHAVIOUR_KEYS)}{hint}")
    return keys


def refused(diffs: Iterable[tuple[str, Any, Any]], override: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """The differences that the override does not name."""
    allowed = set(override)
    return [d for d in diffs if d[0] not in allowed]
