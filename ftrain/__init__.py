"""ftrain: one import namespace for the whole project.

The runtime (configuration, model, data, parallel strategies, the train loop) is this package's
own modules; ``ftrain.agents``, ``ftrain.checkpoint``, ``ftrain.chaos``, ``ftrain.contract`` and
``ftrain.testbed`` are the top-level folders of the checkout, linked in here (see pyproject.toml).
The runtime may import ``ftrain.contract``, ``ftrain.checkpoint`` and torch; never
``ftrain.agents`` or ``ftrain.chaos`` (tests/unit/test_import_boundaries.py). Importing this
package imports nothing else: torch loads ``ftrain.torchrun_plugin`` in every process that imports
its rendezvous package. The library API for your own loop (docs/library.md) is loaded on first
use: ``ftrain.Session``, ``ftrain.SessionError``, ``ftrain.RoundChanged``, ``ftrain.ResumableSampler``,
``ftrain.PerRank``, ``ftrain.RNGState``.
"""

from typing import Any

__version__ = "0.1.0"

#: the public names loaded on first use, and the module that defines each
_LAZY = {
    "Session": "ftrain.session",
    "SessionError": "ftrain.session",
    "RoundChanged": "ftrain.session",
    "ResumableSampler": "ftrain.sampler",
    "PerRank": "ftrain.session_per_rank",
    "RNGState": "ftrain.session_per_rank",
}
__all__ = ["PerRank", "RNGState", "ResumableSampler", "RoundChanged", "Session", "SessionError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ftrain' has no attribute {name!r}")
