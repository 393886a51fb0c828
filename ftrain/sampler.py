"""A data position that survives a change of world size, for your own loop: the sample order of
``ftrain train`` (:class:`ftrain.data.DataCursor`: a seeded permutation per epoch, cut into
global batches) as a ``torch.utils.data.Sampler`` whose state is a handful of ints.

```python
sampler = ResumableSampler(len(dataset), global_batch_size=64, seed=0)
loader = DataLoader(dataset, batch_sampler=sampler.batches(rank, world_size))
state = {"model": model, "optim": optimizer, "sampler": sampler}  # saved by ftrain.Session
```

The position is counted in *global* batches, so a run saved on 8 ranks resumes on 6 (or 1) at
the same sample: every rank takes its share of the same next global batch (the global batch size
must divide by the world size). A ``DataLoader`` with workers prefetches: the sampler's state is
what the loop *consumed*, as long as it calls :meth:`advance` per step (or iterates
:meth:`batches`, which advances as each batch is handed out; prefetching then runs ahead of the
loop by up to ``prefetch_factor`` batches per worker: use :meth:`advance` with ``num_workers > 0``).

Where the worker's environment names a ledger directory (``FTRAIN_LEDGER_DIR``, which ``ftrain chaos
run`` sets for a script job), each rank also appends what every step handed it to the consumption
ledger (:mod:`ftrain.data.ledger`, the format ``ftrain train`` writes), and the sampler's numbers to
``sampler.json`` beside it, so that one check (:func:`ftrain.data.ledger.check_exactly_once`) proves
each sample consumed once in your loop as in ``ftrain train``. Unset, nothing is written."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ftrain.contract.local_files import replace_file
from ftrain.contract.worker_env import LEDGER_DIR, WorkerEnv
from ftrain.data import DataCursor
from ftrain.data.cursor import GlobalBatch, MicroBatch
from ftrain.data.ledger import Ledger

#: beside the ledger files: the numbers a check replays the sample order from
SAMPLER_FILE = "sampler.json"


class ResumableSampler:
    """Global batches of sample indices in a seeded order, resumable at any world size."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0):
        self.cursor = DataCursor(num_samples, global_batch_size, seed)
        self._ledger: Ledger | None = None  #: open while the worker env names a ledger directory
        self._advanced = False  #: a batch was handed out since the ledger opened (a later load rolls back)

    @property
    def step(self) -> int:
        """Global batches consumed so far."""
        return self.cursor.step

    def _share(self, rank: int, world_size: int) -> tuple[int, int]:
        size = self.cursor.global_batch_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}: need 0 <= rank < world_size")
        if size % world_size:
            raise ValueError(
                f"global_batch_size {size} does not divide by world size {world_size}: pick a batch size that "
                "every world size the job may run at divides (or a world size that divides it)"
            )
        per = size // world_size
        return rank * per, per

    def advance(self, rank: int, world_size: int) -> list[int]:
        """The next global batch: this rank's share of it (``global_batch_size / world_size``
        indices); the position moves on by one global batch."""
        start, per = self._share(rank, world_size)
        batch = self.cursor.next_global_batch()
        share = [int(i) for i in batch.sample_ids[start : start + per]]
        self._record(batch, start, share, rank)
        return share

    def batches(self, rank: int, world_size: int) -> Iterator[list[int]]:
        """This rank's share of every global batch from the current position on, for
        ``DataLoader(batch_sampler=...)``; endless (epochs roll over): the loop decides when to stop."""
        self._share(rank, world_size)  # refuse a bad world size now, not at the first batch
        while True:
            yield self.advance(rank, world_size)

    def state_dict(self) -> dict[str, Any]:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)
        if self._ledger is not None and self._advanced:  # back to a checkpoint within the round
            self._ledger.rolled_back()
            self._advanced = False

    # -- the consumption ledger (FTRAIN_LEDGER_DIR) ---------------------------------------------
    def _record(self, batch: GlobalBatch, start: int, share: list[int], rank: int) -> None:
        """Append this rank's share of ``batch`` to the ledger, where the worker env names one:
        each sample a micro-batch of one at its place in the global batch, so the check can tell
        the order as well as the set (whatever the world size)."""
        ledger = self._ledger_for(rank)
        if ledger is None:
            return
        micros = [MicroBatch(start + k, np.asarray([i], dtype=np.int64)) for k, i in enumerate(share)]
        ledger.record(batch, micros)
        self._advanced = True

    def _ledger_for(self, rank: int) -> Ledger | None:
        """The ledger of this rank in this round (a new round, under live recovery, opens a new one)."""
        if not os.environ.get(LEDGER_DIR):  # the common case, at every step: no parse of the whole env
            return None
        env = WorkerEnv.from_env()
        current = self._ledger
        if current is not None and (current.round, current.dp_rank) == (env.round, rank):
            return current
        if current is not None:
            current.close()
        self._ledger = Ledger(env.ledger_dir, rank, env.round)
        self._advanced = False
        self._describe(Path(env.ledger_dir))
        return self._ledger

    def _describe(self, directory: Path) -> None:
        """``sampler.json``: the numbers that replay this sampler's order (the same from every rank)."""
        numbers = {
            "num_samples": self.cursor.num_samples,
            "global_batch_size": self.cursor.global_batch_size,
            "seed": self.cursor.seed,
        }
        replace_file(directory / SAMPLER_FILE, json.dumps(numbers).encode())
