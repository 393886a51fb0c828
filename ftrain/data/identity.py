"""The identity of the data a run trains on, recorded in every checkpoint, and what a resume does
when it changed (``data.on_mixture_change``).

A global sample id means something only under the blend it was drawn from: the sources, in their
order, with their sizes, weights and contents, ``data.seed`` and the epoch size. A resume with the
sources reordered or reweighted walks the same ids, but they now decode to other samples: some
are read twice in the epoch, others never, and a ledger of global ids looks perfect. So the
cursor's checkpoint carries the identity (:func:`identity_of`)::

    {"version": 1, "kind": "mixture" | "file" | "synthetic", "num_samples": N, "seed": s,
     "seq_len": L, "sources": [{"path", "size_bytes", "fingerprint", "token_dtype",
     "num_samples", "weight"}, ...], "params": {...}}

A source is known by its content (size, :func:`~ftrain.data.files.fingerprint`, dtype), not by
its path: a file moved elsewhere is the same source. :func:`describe_changes` names, by config
key, what differs between two identities; :func:`data_digest` is a short digest of what decides
the samples (paths excluded), written into each ledger line so that
:func:`~ftrain.data.ledger.check_exactly_once` can tell steps drawn from different blends.

What the cursor does with a change is :class:`~ftrain.data.cursor.DataCursor`'s (``fail``:
:class:`DataChangeError`; ``new_blend``: the new blend goes on in the same epoch, without the
samples the earlier blends of the epoch read).
"""

from __future__ import annotations

import json
import math
from typing import Any

import xxhash

from ftrain.data.errors import DataError
from ftrain.data.mixture import BlendIndex, MixtureSource
from ftrain.data.synthetic import MarkovSource
from ftrain.data.tokens import TokenFileSource

IDENTITY_VERSION = 1
#: ``data.on_mixture_change`` values
ON_CHANGE = ("fail", "new_blend")
#: bounds on an identity read from a checkpoint (untrusted)
MAX_SOURCES = 100_000
_MAX_INT = 2**63 - 1
_KINDS = ("mixture", "file", "synthetic")
_SOURCE_KEYS = ("path", "size_bytes", "fingerprint", "token_dtype", "num_samples", "weight")


def _file_entry(source: TokenFileSource, weight: float) -> dict[str, Any]:
    return {
        "path": str(source.path),
        "size_bytes": int(source.size_bytes),
        "fingerprint": source.fingerprint,
        "token_dtype": source.dtype.name,
        "num_samples": int(source.num_samples),
        "weight": float(weight),
    }


def identity_of(source: object, seed: int) -> dict[str, Any] | None:
    """The identity of one of :mod:`ftrain.data`'s sources (``seed``: ``data.seed``, which orders
    every source's epochs); None for any other source (a test's, a user's own)."""
    if isinstance(source, MixtureSource):
        return {
            "version": IDENTITY_VERSION,
            "kind": "mixture",
            "num_samples": int(source.num_samples),
            "seed": int(seed),
            "seq_len": int(source.seq_len),
            "sources": [_file_entry(s, spec.weight) for s, spec in zip(source.sources, source.specs, strict=True)],
        }
    if isinstance(source, TokenFileSource):
        return {
            "version": IDENTITY_VERSION,
            "kind": "file",
            "num_samples": int(source.num_samples),
            "seed": int(seed),
            "seq_len": int(source.seq_len),
            "sources": [_file_entry(source, 1.0)],
        }
    if isinstance(source, MarkovSource):
        params = {
            "vocab_size": source.vocab_size,
            "branching": source.branching,
            "concentration": source.concentration,
            "chain_seed": source.seed,
        }
        content = json.dumps({**params, "seq_len": source.seq_len}, sort_keys=True).encode()
        return {
            "version": IDENTITY_VERSION,
            "kind": "synthetic",
            "num_samples": int(source.num_samples),
            "seed": int(seed),
            "seq_len": int(source.seq_len),
            "sources": [
                {
                    "path": "synthetic",
                    "size_bytes": 0,
                    "fingerprint": "synthetic:" + xxhash.xxh3_64(content).hexdigest(),
                    "token_dtype": "",
                    "num_samples": int(source.num_samples),
                    "weight": 1.0,
                }
            ],
            "params": params,
        }
    return None


def content_key(entry: dict[str, Any], seq_len: int) -> str:
    """What makes two sources' samples the same samples: the content, its dtype and the window."""
    return f"{entry['fingerprint']}/{entry['token_dtype']}/{seq_len}"


def data_digest(identity: dict[str, Any] | None) -> str:
    """A short digest of what decides the samples of every global id (paths excluded); "" for None."""
    if identity is None:
        return ""
    decisive = {
        **{k: v for k, v in identity.items() if k != "sources"},
        "sources": [{k: v for k, v in s.items() if k != "path"} for s in identity["sources"]],
    }
    return xxhash.xxh3_64(json.dumps(decisive, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def blend_of(identity: dict[str, Any]) -> BlendIndex:
    """The blend index an identity's global ids decode through (a file or the synthetic chain:
    one source of weight 1, ids map to themselves)."""
    sources = identity["sources"]
    return BlendIndex(
        [int(s["num_samples"]) for s in sources],
        [float(s["weight"]) for s in sources],
        int(identity["num_samples"]),
        int(identity["seed"]),
    )


def check_identity(obj: Any, where: str) -> None:
    """DataError unless ``obj`` has the shape of an :func:`identity_of` (it comes from storage)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where} must be an object, got {type(obj).__name__}")
    if obj.get("version") != IDENTITY_VERSION:
        raise DataError(f"{where}: version {str(obj.get('version'))[:20]} is not {IDENTITY_VERSION}")
    if obj.get("kind") not in _KINDS:
        raise DataError(f"{where}: kind {str(obj.get('kind'))[:40]!r} is not one of {', '.join(_KINDS)}")
    for key, minimum in (("num_samples", 1), ("seed", 0), ("seq_len", 1)):
        _int(obj.get(key), f"{where}.{key}", minimum)
    sources = obj.get("sources")
    if not isinstance(sources, list) or not 1 <= len(sources) <= MAX_SOURCES:
        raise DataError(f"{where}.sources must be a list of 1 to {MAX_SOURCES} sources")
    for i, s in enumerate(sources):
        at = f"{where}.sources[{i}]"
        if not isinstance(s, dict) or any(k not in s for k in _SOURCE_KEYS):
            raise DataError(f"{at} must be an object with {', '.join(_SOURCE_KEYS)}")
        for key in ("path", "fingerprint", "token_dtype"):
            if not isinstance(s[key], str) or len(s[key]) > 4096:
                raise DataError(f"{at}.{key} must be a string")
        _int(s["size_bytes"], f"{at}.size_bytes", 0)
        _int(s["num_samples"], f"{at}.num_samples", 1)
        if not _positive_finite(s["weight"]):
            raise DataError(f"{at}.weight must be a finite number > 0, got {str(s['weight'])[:40]}")
    params = obj.get("params", {})
    if not isinstance(params, dict) or len(params) > 64:
        raise DataError(f"{where}.params must be an object of a few settings")


def _positive_finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return 0 < float(value) < math.inf  # a huge int overflows float(): not a weight either
    except OverflowError:
        return False


def _int(value: Any, where: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
        raise DataError(f"{where} must be an integer in [{minimum}, 2**63), got {str(value)[:40]}")


# -- what changed, by config key ---------------------------------------------------------------
_PARAM_KEYS = {
    "vocab_size": "model.vocab_size",
    "branching": "data.branching",
    "concentration": "data.concentration",
    "chain_seed": "data.seed (the chain)",
}


def _name(identity: dict[str, Any]) -> str:
    kind = identity["kind"]
    if kind == "synthetic":
        return "the synthetic chain"
    if kind == "file":
        return f"the token file {identity['sources'][0]['path']!r}"
    return f"a mixture of {len(identity['sources'])} token files"


def describe_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs from ``saved`` to ``current`` that changes the samples, each naming its key
    (a source moved to another path with the same content is no change)."""
    if saved["kind"] != current["kind"]:
        return [
            f"data.source / data.sources: the checkpoint was trained on {_name(saved)}, this run reads {_name(current)}"
        ]
    changes = []
    if saved["seed"] != current["seed"]:
        changes.append(f"data.seed {saved['seed']} -> {current['seed']}")
    if saved["seq_len"] != current["seq_len"]:
        changes.append(f"model.seq_len {saved['seq_len']} -> {current['seq_len']} (every sample is another window)")
    if current["kind"] == "synthetic":
        old, new = saved.get("params", {}), current.get("params", {})
        for key, setting in _PARAM_KEYS.items():
            if key != "chain_seed" and old.get(key) != new.get(key):
                changes.append(f"{setting} {old.get(key)} -> {new.get(key)}")
        if saved["num_samples"] != current["num_samples"]:
            changes.append(f"data.num_samples {saved['num_samples']} -> {current['num_samples']}")
        return changes
    if current["kind"] == "mixture" and saved["num_samples"] != current["num_samples"]:
        changes.append(f"data.mixture_samples (samples per epoch) {saved['num_samples']} -> {current['num_samples']}")
    return changes + _source_changes(saved["sources"], current["sources"], current["kind"] == "mixture")


def _source_changes(saved: list[dict[str, Any]], current: list[dict[str, Any]], mixture: bool) -> list[str]:
    def key(i: int) -> str:
        return f"data.sources[{i}]" if mixture else "data.source"

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return (a["fingerprint"], a["size_bytes"], a["token_dtype"]) == (
            b["fingerprint"],
            b["size_bytes"],
            b["token_dtype"],
        )

    changes: list[str] = []
    unmatched = list(range(len(saved)))
    for i, entry in enumerate(current):
        j = next((j for j in unmatched if same(saved[j], entry)), None)
        if j is None:
            j = next((j for j in unmatched if saved[j]["path"] == entry["path"]), None)
            if j is None:
                changes.append(f"{key(i)} ({entry['path']!r}) is new")
                continue
            unmatched.remove(j)
            changes.append(f"{key(i)} ({entry['path']!r}) is not the file it was: {_file_change(saved[j], entry)}")
            continue
        unmatched.remove(j)
        if j != i:
            changes.append(f"{key(i)} is {entry['path']!r}, which was {key(j)} (the order changed)")
        if saved[j]["weight"] != entry["weight"]:
            changes.append(f"{key(i)}.weight {saved[j]['weight']:g} -> {entry['weight']:g}")
    changes += [f"{saved[j]['path']!r} ({key(j)} of the checkpoint) is gone" for j in unmatched]
    return changes


def _file_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old["token_dtype"] != new["token_dtype"]:
        return f"read as {old['token_dtype']} then, as {new['token_dtype']} now"
    if old["size_bytes"] != new["size_bytes"]:
        return f"{old['size_bytes']} bytes then, {new['size_bytes']} now"
    return "same size, other content (its fingerprint differs)"


class DataChangeError(DataError):
    """A resume would read other data than its checkpoint was trained on, and
    ``data.on_mixture_change=fail``."""

    #: Restarting cannot help (the same config meets the same checkpoint): the node agent ends the
    #: job with the message instead.
    fatal = True

    def __init__(self, step: int, changes: list[str]):
        self.step = step
        self.changes = list(changes)
        super().__init__(
            f"checkpoint step {step} was trained on other data than data.sources / data.source name now: "
            f"{'; '.join(self.changes)}. Set them back to what the checkpoint was trained on, or resume with "
            f"--data.on_mixture_change=new_blend: the data as configured now takes over at step {step}, and no "
            "sample read so far in this epoch is read again in it."
        )
