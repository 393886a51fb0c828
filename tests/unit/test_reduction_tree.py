"""The fixed-order reduction's tree: every way of splitting the leaves over ranks gives the same bits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.data.cursor import micro_block
from ftrain.parallel.deterministic import StreamingTreeSum, cover, tree_sum


def canonical(leaves: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    if hi - lo == 1:
        return leaves[lo]
    mid = lo + (1 << ((hi - lo - 1).bit_length() - 1))
    return canonical(leaves, lo, mid) + canonical(leaves, mid, hi)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 40), data=st.data())
def test_any_split_over_ranks_reproduces_the_canonical_tree_bitwise(total, data):
    world = data.draw(st.integers(1, total))  # divisors give equal blocks, the others uneven ones
    gen = torch.Generator().manual_seed(total * 100 + world)
    # values of very different magnitudes make association visible in the last bits
    leaves = [
        torch.randn(7, generator=gen) * 10.0 ** float(torch.randint(-4, 5, (1,), generator=gen)) for _ in range(total)
    ]
    nodes = {}
    for rank in range(world):
        lo, hi = micro_block(total, rank, world)
        block_nodes = cover(0, total, lo, hi)
        assert block_nodes[0][0] == lo and block_nodes[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(block_nodes, block_nodes[1:], strict=False))  # contiguous tiling
        i = lo
        for node in block_nodes:
            acc = StreamingTreeSum()
            for _ in range(node[1] - node[0]):
                acc.push(leaves[i])
                i += 1
            nodes[node] = acc.result()
    assert torch.equal(tree_sum(nodes, 0, total), canonical(leaves, 0, total))


def test_sequential_sum_differs_so_the_order_matters():
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1000, generator=gen) * 10.0 ** (i % 7 - 3) for i in range(12)]
    sequential = leaves[0]
    for leaf in leaves[1:]:
        sequential = sequential + leaf
    assert not torch.equal(sequential, canonical(leaves, 0, 12))


def test_aligned_power_of_two_blocks_are_single_nodes():
    assert cover(0, 16, 4, 8) == [(4, 8)]
    assert cover(0, 12, 0, 6) == [(0, 4), (4, 6)]
