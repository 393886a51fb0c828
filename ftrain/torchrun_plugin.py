"""The ``torchrun.handlers`` entry point of ``--rdzv-backend=etcd-v3``.

torch loads every installed rendezvous entry point whenever ``torch.distributed.elastic.rendezvous``
is imported, in every process that imports it: each training worker among them. So the entry
point is this tiny module, and the backend (:mod:`ftrain.agents.torchrun_rdzv`, with its etcd client)
is imported only when torchrun creates a handler, in the launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The entry point: returns the handler creator."""
    return _create_handler


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from ftrain.agents.torchrun_rdzv import create_handler

    return create_handler(params)
