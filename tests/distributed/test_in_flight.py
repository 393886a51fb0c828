""":func:`ftrain.agent_link.flight_recorder.oldest_in_flight` on 2 real gloo ranks with a full recorder
(2,000 entries): a collective that the peer has not joined is in flight (first as a sighting,
then as the buffer's own entry, exactly), completed ones are not, the recorder off says nothing, and a
second world of the same processes starts clean."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import run, worker_env

pytestmark = pytest.mark.dist


def test_a_collective_the_peer_never_joined_is_in_flight_and_completed_ones_are_not(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "tests/distributed/in_flight_worker.py", str(tmp_path),
    ]  # fmt: skip
    proc = run(cmd, timeout_s=180, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = json.loads((tmp_path / "in_flight.json").read_text())
    # 2,000 all_reduces and a barrier, all completed: nothing in flight
    assert got["idle"] is True and got["second_world_idle"] is True, got
    for name, group, seq in (("default", "0", 2002), ("subgroup", "1", 1), ("second_world", "0", 1)):
        held = got[name]
        first, exact = held["first"], held["exact"]
        # a sighting (no op yet) of the held collective, or of one before it: torch's status counters trail
        # the collectives under load (enqueued and completed alike: 1998 and 2000 were seen for 2002), so
        # one already done may still count as in flight for a moment; never a later one
        assert (first["op"], first["done"]) == ("", False) and 1 <= first["seq"] <= seq, (name, held)
        assert first["group"] in ("", group), (name, held)  # named once the buffer showed the group
        assert (exact["group"], exact["seq"], exact["op"], exact["sizes"]) == (group, seq, "gloo:all_reduce", [[4]])
        assert held["enqueued_after_s"] <= exact["enqueued_s"], (name, held)
        if first["seq"] == seq:  # a sighting of the held one itself: never earlier than it, nor than the truth
            assert held["enqueued_after_s"] <= exact["enqueued_s"] <= first["enqueued_s"], (name, held)
        # (a sighting of one before it was made when the trailing counters first showed that one, which
        # may be before the held one was enqueued: seen once under load, seq 2001 sighted 1.5 ms before)
        assert held["recorder_off"] is None and held["settled"] is True, (name, held)
