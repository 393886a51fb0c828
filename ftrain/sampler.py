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
loop by up to ``prefetch_factor`` batches per worker: use :meth:`advance` with ``num_workers > 0``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ftrain.data import DataCursor


class ResumableSampler:
    """Global batches of sample indices in a seeded order, resumable at any world size."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0):
        self.cursor = DataCursor(num_samples, global_batch_size, seed)

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
        return [int(i) for i in batch.sample_ids[start : start + per]]

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
