"""Leaving a round whose rendezvous never completed: the next round's default group must get the
name a fresh process gives it, or a kept worker and a warm spare rendezvous under different keys
and both wait until the timeout (seen in the partitions scenario: a 60 s hang after a rejoin)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ftrain.distributed import abort_distributed


def test_an_interrupted_init_leaves_the_next_group_named_like_a_fresh_processs():
    try:
        with pytest.raises(RuntimeError):  # rank 1 never comes: gloo's rendezvous times out
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=2, timeout=timedelta(seconds=0.5)
            )
        assert not dist.is_initialized()
        abort_distributed()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.group.WORLD.group_name == "0"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
