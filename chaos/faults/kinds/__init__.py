"""One module per fault kind, named after the kind; each registers its :class:`~ftrain.chaos.faults.registry.Fault`
in :data:`~ftrain.chaos.faults.registry.FAULTS`. Importing this package imports (and so registers) every
module in it: a new kind is a new module here, nothing else."""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
