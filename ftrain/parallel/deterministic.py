"""Fixed-order gradient reduction: bitwise identical training at any world size.

Floating-point addition is not associative, so a ring all-reduce whose order depends on the
rank count gives different bits at different world sizes. Here the order is fixed by the data,
not the world: a step's M micro-batches are the leaves of one canonical binary tree over
``[0, M)`` (each node ``[l, r)`` splits at ``l + 2**floor(log2(r - l - 1))``, so left children
are perfect). A rank that holds micro-batches ``[a, b)`` sums them into the tree nodes that
exactly cover its block (a segment-tree decomposition, usually one node), the nodes of all
ranks are all-gathered, and every rank completes the same tree in the same order. The blocks
need not be equal: when the data-parallel size does not divide M they differ in size by one
(:func:`ftrain.data.cursor.micro_block`), some ranks cover theirs with a few more nodes, and the
result is still the same bits — so a job can shrink or grow to any world size up to M.

Cost: the gather holds ``world_size x nodes_per_rank`` flattened gradients (nodes_per_rank is 1
when the per-rank micro-batch count is a power of two that divides M), plus O(log A) partial
sums while accumulating; communication is an all-gather of that size instead of an all-reduce
(about world_size / 2 times the bytes of a ring all-reduce). Parameters and optimizer state
are replicated as with DDP; only ``parallel.strategy = "ddp"`` supports it.
"""

from __future__ import annotations

import torch

from ftrain.data.cursor import micro_block
from ftrain.parallel.base import Parallel
from ftrain.torch_compat import all_gather_single


def _split(length: int) -> int:
    """Size of the left (perfect) child of a node of ``length`` leaves."""
    return 1 << ((length - 1).bit_length() - 1)


def cover(lo: int, hi: int, block_lo: int, block_hi: int) -> list[tuple[int, int]]:
    """Canonical tree nodes under ``[lo, hi)`` that exactly tile ``[block_lo, block_hi)``, in order."""
    if block_lo <= lo and hi <= block_hi:
        return [(lo, hi)]
    if hi <= block_lo or lo >= block_hi:
        return []
    mid = lo + _split(hi - lo)
    return cover(lo, mid, block_lo, block_hi) + cover(mid, hi, block_lo, block_hi)


class StreamingTreeSum:
    """Sums leaves pushed in order with exactly the canonical tree's association, in O(log n) memory.

    A binary counter: equal-sized perfect subtrees merge as soon as they exist, and the remainder
    is folded right to left, which reproduces the left-perfect canonical split.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []

    def push(self, leaf: torch.Tensor) -> None:
        size, value = 1, leaf
        while self._stack and self._stack[-1][0] == size:
            left_size, left = self._stack.pop()
            size, value = left_size + size, left + value
        self._stack.append((size, value))

    def result(self) -> torch.Tensor:
        size, value = self._stack.pop()
        while self._stack:
            left_size, left = self._stack.pop()
            size, value = left_size + size, left + value
        return value


def tree_sum(nodes: dict[tuple[int, int], torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Complete the canonical tree over ``[lo, hi)`` from already-summed nodes."""
    if (lo, hi) in nodes:
        return nodes[(lo, hi)]
    mid = lo + _split(hi - lo)
    return tree_sum(nodes, lo, mid) + tree_sum(nodes, mid, hi)


class DeterministicParallel(Parallel):
    """Replicated model; gradients reduced in a world-size-independent order."""

    def __init__(self, *args, micro_per_step: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.total_micro = micro_per_step
        dp = self.layout.dp_size
        #: every rank's nodes: the cover of its block (blocks may differ in size by one)
        self.nodes_of = [cover(0, micro_per_step, *micro_block(micro_per_step, r, dp)) for r in range(dp)]
        self.my_nodes = self.nodes_of[self.layout.dp_rank]
        self.max_nodes = max(len(nodes) for nodes in self.nodes_of)
        self._node_sums: list[torch.Tensor] = []
        self._partial = StreamingTreeSum()
        self._micro_seen = 0

    def backward(self, loss: torch.Tensor, micro_index: int, accum_steps: int) -> None:
        loss.backward()  # the mean over micro-batches is taken once, after the tree sum
        flat = torch.cat([_grad(p).reshape(-1).float() for p in self.params])
        for p in self.params:
            p.grad = None
        self._partial.push(flat)
        self._micro_seen += 1
        lo, hi = self.my_nodes[len(self._node_sums)]
        if self._micro_seen == hi - lo:
            self._node_sums.append(self._partial.result())
            self._partial, self._micro_seen = StreamingTreeSum(), 0

    def reduce_gradients(self) -> None:
        numel = self._node_sums[0].numel()
        local = torch.zeros(self.max_nodes, numel, dtype=torch.float32, device=self._node_sums[0].device)
        for i, node_sum in enumerate(self._node_sums):
            local[i] = node_sum
        gathered = torch.empty(self.layout.dp_size * self.max_nodes, numel, dtype=local.dtype, device=local.device)
        all_gather_single(gathered, local)
        nodes: dict[tuple[int, int], torch.Tensor] = {}
        for r, rank_nodes in enumerate(self.nodes_of):
            for i, node in enumerate(rank_nodes):
                nodes[node] = gathered[r * self.max_nodes + i]
        total = tree_sum(nodes, 0, self.total_micro) / self.total_micro
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
        self._node_sums = []


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient; every parameter takes part in the loss, so a missing one is a bug to name."""
    if p.grad is None:
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} got no gradient: the fixed-order reduction "
            "needs every parameter to take part in the loss"
        )
    return p.grad
