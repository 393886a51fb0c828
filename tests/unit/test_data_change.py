"""Resuming on other data than the checkpoint was trained on (issue 38, item 8): refused by default,
naming what changed; ``data.on_mixture_change = "new_blend"`` goes on without reading a sample
twice in an epoch; the ledger check catches steps drawn from another blend."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.data import (
    DataChangeError,
    DataCursor,
    DataError,
    Ledger,
    MixtureSource,
    SourceSpec,
    TokenFileSource,
    check_exactly_once,
    data_digest,
    identity_of,
    micro_batches,
    read_ledger,
    write_token_file,
)
from ftrain.data.identity import blend_of, content_key

SEQ_LEN, VOCAB, BATCH, SEED = 4, 64, 8, 5


def token_file(path: Path, band: int, num_samples: int) -> str:
    write_token_file(path, band * 20 + np.arange(num_samples * SEQ_LEN + 1) % 20, "uint16")
    return str(path)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    return {
        name: token_file(tmp_path / f"{name}.bin", k, n)
        for k, (name, n) in enumerate({"a": 24, "b": 16, "c": 8}.items())
    }


def mix(paths: list[str], weights: list[float], total: int = 0, seed: int = SEED) -> MixtureSource:
    return MixtureSource([SourceSpec(p, w) for p, w in zip(paths, weights, strict=True)], SEQ_LEN, VOCAB, seed, total)


def cursor(source: Any, on_change: str = "fail", seed: int = SEED) -> DataCursor:
    return DataCursor(source.num_samples, BATCH, seed, data=identity_of(source, seed), on_change=on_change)


def saved_after(source: Any, steps: int, seed: int = SEED) -> dict[str, Any]:
    """A cursor state after ``steps`` steps, through JSON as a manifest holds it."""
    c = cursor(source, seed=seed)
    for _ in range(steps):
        c.next_global_batch()
    return json.loads(json.dumps(c.state_dict()))


# -- fail: a resume on other data is refused, naming what changed -----------------------------
def test_a_reordered_mixture_is_refused_naming_the_sources(files):
    """Same sizes, same seed, same epoch size: the old check (sample count, seed) passed, and every
    id decoded to another sample."""
    state = saved_after(mix([files["a"], files["b"], files["c"]], [3, 2, 1]), 3)
    resumed = cursor(mix([files["b"], files["a"], files["c"]], [2, 3, 1]))
    with pytest.raises(DataChangeError) as info:
        resumed.load_state_dict(state)
    message = str(info.value)
    assert f"data.sources[0] is {files['b']!r}, which was data.sources[1] (the order changed)" in message
    assert f"data.sources[1] is {files['a']!r}, which was data.sources[0]" in message
    assert "data.sources[2]" not in message  # c did not move
    assert "checkpoint step 3" in message and "--data.on_mixture_change=new_blend" in message
    assert info.value.fatal is True  # the node agent ends the job instead of restarting into it


@pytest.mark.parametrize(
    ("paths", "weights", "total", "seed", "words"),
    [
        (["a", "b", "c"], [3, 4, 1], 0, SEED, ["data.sources[1].weight 2 -> 4"]),
        (
            ["a", "b"],
            [3, 2],
            0,
            SEED,
            ["'{c}' (data.sources[2] of the checkpoint) is gone", "samples per epoch) 48 -> 40"],
        ),
        (["a", "b", "c", "d"], [3, 2, 1, 1], 48, SEED, ["data.sources[3] ('{d}') is new"]),
        (["a", "b", "c"], [3, 2, 1], 96, SEED, ["data.mixture_samples (samples per epoch) 48 -> 96"]),
        (["a", "b", "c"], [3, 2, 1], 0, SEED + 1, [f"data.seed {SEED} -> {SEED + 1}"]),
    ],
)
def test_each_change_is_named_by_its_key(files, tmp_path, paths, weights, total, seed, words):
    files["d"] = token_file(tmp_path / "d.bin", 2, 8)
    state = saved_after(mix([files["a"], files["b"], files["c"]], [3, 2, 1]), 2)
    with pytest.raises(DataChangeError) as info:
        cursor(mix([files[p] for p in paths], weights, total, seed), seed=seed).load_state_dict(state)
    for w in words:
        assert w.format(**files) in str(info.value)


def test_a_rewritten_file_is_a_change_and_a_moved_one_is_not(files, tmp_path):
    state = saved_after(mix([files["a"], files["b"]], [3, 2]), 2)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in ("a", "b"):
        for suffix in ("", ".json"):
            shutil.copy(files[name] + suffix, moved / f"{name}.bin{suffix}")
    resumed = cursor(mix([str(moved / "a.bin"), str(moved / "b.bin")], [3, 2]))
    resumed.load_state_dict(state)  # the same content at another path: the same data
    assert resumed.state_dict()["blends"][-1]["data"]["sources"][0]["path"] == str(moved / "a.bin")
    token_file(Path(files["b"]), 3, 16)  # same size, other tokens
    with pytest.raises(DataChangeError, match=r"data\.sources\[1\] \('.*b\.bin'\) is not the file it was: same size"):
        cursor(mix([files["a"], files["b"]], [3, 2])).load_state_dict(state)


def test_a_single_file_or_the_synthetic_chain_changed_under_a_checkpoint_is_refused(files, tmp_path):
    state = saved_after(TokenFileSource(files["a"], SEQ_LEN, VOCAB), 1)
    other = token_file(tmp_path / "other.bin", 1, 24)
    with pytest.raises(DataChangeError, match=r"data\.source \('.*other\.bin'\) is new; '.*a\.bin' \(data\.source of"):
        cursor(TokenFileSource(other, SEQ_LEN, VOCAB)).load_state_dict(state)
    from ftrain.data import MarkovSource

    chain = MarkovSource(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED, num_samples=64, branching=4)
    state = saved_after(chain, 2)
    changed = MarkovSource(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED, num_samples=64, branching=8)
    with pytest.raises(DataChangeError, match="data.branching 4 -> 8"):
        cursor(changed).load_state_dict(state)


def test_a_checkpoint_without_an_identity_loads_with_a_warning(files, caplog):
    source = mix([files["a"], files["b"]], [3, 2])
    old = {k: v for k, v in saved_after(source, 2).items() if k not in ("blends", "segments")}  # an older ftrain's
    resumed = cursor(source)
    with caplog.at_level(logging.WARNING, logger="ftrain.data.cursor"):
        resumed.load_state_dict(old)
    assert "records no data identity" in caplog.text
    assert resumed.step == 2 and [b["step"] for b in resumed.state_dict()["blends"]] == [2]
    plain = DataCursor(source.num_samples, BATCH, SEED)  # a cursor that knows no identity keeps none
    plain.load_state_dict(saved_after(source, 2))
    assert "blends" not in plain.state_dict()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"blends": "x"}, "blends must be a list"),
        ({"blends": []}, "blends must be a list of 1 to"),
        ({"blends": [{"step": 9, "data": None}]}, "blends[0].step must be an int in [0, 3]"),
        ({"blends": [{"step": 0, "data": {"version": 1, "kind": "mixture"}}]}, "num_samples must be an integer"),
        ({"segments": [{"blend": 0, "consumed": 1}]}, "segments must be a list shorter than blends"),
        ({"num_samples": 40, "next_index": 0}, "its last blend is not of its num_samples and seed"),
    ],
)
def test_a_malformed_identity_in_a_checkpoint_is_refused(files, change, words):
    state = saved_after(mix([files["a"], files["b"], files["c"]], [3, 2, 1]), 3) | change
    with pytest.raises(DataError) as info:
        DataCursor.check_state(state)
    assert words in str(info.value)


def test_a_hostile_identity_number_is_refused_not_raised(files):
    state = saved_after(mix([files["a"], files["b"]], [3, 2]), 1)
    state["blends"][0]["data"]["sources"][0]["weight"] = 10**400
    with pytest.raises(DataError, match="weight must be a finite number"):
        DataCursor.check_state(state)


# -- new_blend: at most once per epoch -----------------------------------------------------------
def _reads(c: DataCursor, steps: int) -> list[tuple[int, str, int]]:
    """(epoch, content key, sample) of each id the next ``steps`` steps read."""
    identity = c.blends[-1]["data"]
    keys = [content_key(e, identity["seq_len"]) for e in identity["sources"]]
    out = []
    for _ in range(steps):
        batch = c.next_global_batch()
        which, sample = blend_of(identity).decode(batch.sample_ids)
        out += [(batch.epoch, keys[k], int(s)) for k, s in zip(which.tolist(), sample.tolist(), strict=True)]
    return out


def _epoch_reads(c: DataCursor, epoch: int) -> list[tuple[int, str, int]]:
    reads = []
    while True:
        step = _reads(c, 1)
        if step[0][0] != epoch:
            return reads
        reads += step


def test_new_blend_goes_on_in_the_epoch_without_rereading_and_the_next_epoch_is_whole(files):
    """a, b, c read once each per epoch (48 samples); reweighted after 3 steps to 1:1:1 over 24
    samples per epoch (8 of each): the rest of the epoch reads only samples not read yet."""
    first = cursor(mix([files["a"], files["b"], files["c"]], [3, 2, 1]))
    before = _reads(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = cursor(mix([files["c"], files["a"], files["b"]], [1, 1, 1], total=24), on_change="new_blend")
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.next_index, resumed.step) == (0, 0, 3)
    after = _epoch_reads(resumed, 0)
    seen = [(k, s) for _, k, s in before + after]
    assert len(seen) == len(set(seen)), "a sample read twice in one epoch"
    assert after, "the new blend read nothing in the rest of the epoch"
    # the next epoch is the new blend's, whole: its 24 ids once each
    assert resumed.epoch == 1 and not resumed.segments
    epoch1 = [(k, s) for _, k, s in _reads(resumed, 2)]
    assert len(set(epoch1)) == 16


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.permutations([0, 1, 2]), st.lists(st.integers(1, 4), min_size=3, max_size=3)),
        min_size=1,
        max_size=3,
    ),
    st.integers(0, 2**16),
)
def test_changes_in_one_epoch_never_read_a_sample_twice(tmp_path_factory, changes, seed):
    """Any chain of reorders and reweights, each after a few steps: within an epoch no sample of a
    source read at most once by its share is read twice, across every change."""
    base = tmp_path_factory.getbasetemp() / "chain"
    if not base.exists():
        base.mkdir()
        for k, n in enumerate((24, 16, 12)):
            token_file(base / f"s{k}.bin", k, n)
    paths = [str(base / f"s{k}.bin") for k in range(3)]
    c = cursor(mix(paths, [24, 16, 12], seed=seed), seed=seed)  # each file read once per epoch
    reads = _reads(c, 1)
    for steps, order, weights in changes:
        source = mix([paths[k] for k in order], weights, total=16, seed=seed)  # 16 of 52: never upsampled
        assert all(n >= count for n, count in zip(source.source_samples, source.blend.counts.tolist(), strict=True))
        resumed = cursor(source, on_change="new_blend", seed=seed)
        resumed.load_state_dict(json.loads(json.dumps(c.state_dict())))
        c = resumed
        reads += _reads(c, steps)
    by_epoch: dict[int, list[tuple[str, int]]] = {}
    for epoch, key, sample in reads:
        by_epoch.setdefault(epoch, []).append((key, sample))
    for epoch, seen in by_epoch.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample read twice"


def test_new_blend_cannot_carry_reads_across_another_seq_len(files):
    state = saved_after(TokenFileSource(files["a"], SEQ_LEN, VOCAB), 1)
    longer = TokenFileSource(files["a"], SEQ_LEN * 2, VOCAB)
    with pytest.raises(DataChangeError, match="cannot carry what was read across another model.seq_len"):
        DataCursor(longer.num_samples, 4, SEED, data=identity_of(longer, SEED), on_change="new_blend").load_state_dict(
            state
        )


# -- the ledger ---------------------------------------------------------------------------------
def _run(ledger_dir: Path, c: DataCursor, steps: int, round_: int) -> list[int]:
    """Record ``steps`` steps as one rank of round ``round_``; the epoch of each."""
    epochs = []
    with Ledger(ledger_dir, 0, round_, data=c.data_digest) as ledger:
        for _ in range(steps):
            batch = c.next_global_batch()
            ledger.record(batch, micro_batches(batch, 0, 1, 4))
            epochs.append(batch.epoch)
    return epochs


def test_a_ledger_written_across_a_silent_mixture_change_fails_the_check(files, tmp_path):
    """What the old resume did: the reordered mixture went on from the same position, and the check
    (same sample count, same seed) passed."""
    old = mix([files["a"], files["b"], files["c"]], [3, 2, 1])
    new = mix([files["b"], files["a"], files["c"]], [2, 3, 1])
    first = cursor(old)
    _run(tmp_path / "ledger", first, 3, round_=0)
    silent = DataCursor(new.num_samples, BATCH, SEED, data=identity_of(new, SEED), on_change="new_blend")
    silent.epoch, silent.next_index, silent.step = first.epoch, first.next_index, first.step  # as the old code did
    _run(tmp_path / "ledger", silent, 3, round_=1)
    params = dict(num_samples=48, global_batch_size=BATCH, seed=SEED, steps=6)
    report = check_exactly_once(read_ledger(tmp_path / "ledger"), sources=new, **params)
    assert not report.ok and sorted(report.data_mismatch) == [3, 4, 5], report.summary()
    assert report.data_mismatch[3] == (silent.data_digest, first.data_digest)
    assert "drawn from another data blend" in report.summary()
    told = check_exactly_once(read_ledger(tmp_path / "ledger"), data=silent.data_digest, **params)
    assert sorted(told.data_mismatch) == [0, 1, 2]  # the reference given: the first steps are the odd ones


def test_a_ledger_across_a_new_blend_checks_with_its_blends(files, tmp_path):
    old = mix([files["a"], files["b"], files["c"]], [3, 2, 1])
    new = mix([files["c"], files["a"], files["b"]], [1, 1, 1], total=24)
    first = cursor(old)
    _run(tmp_path / "ledger", first, 3, round_=0)
    ckpt = json.loads(json.dumps(first.state_dict()))
    _run(tmp_path / "ledger", first, 1, round_=0)  # step 3 ran under the old blend, then the job died
    resumed = cursor(new, on_change="new_blend")
    resumed.load_state_dict(ckpt)
    epochs = [0, 0, 0, *_run(tmp_path / "ledger", resumed, 7, round_=1)]
    entries = read_ledger(tmp_path / "ledger")
    params = dict(num_samples=48, global_batch_size=BATCH, seed=SEED, steps=10)
    assert not check_exactly_once(entries, **params).ok  # a plain replay: steps 4.. are another blend's
    blends = resumed.state_dict()["blends"]
    assert [b["step"] for b in blends] == [0, 3]
    report = check_exactly_once(entries, blends=blends, sources=new, **params)
    assert report.ok and report.superseded_entries == 1, report.summary()
    assert [c.name for c in report.sources] == [files["a"], files["b"], files["c"]]
    assert sum(c.reads for c in report.sources) == 10 * BATCH
    in_epoch0 = epochs.count(0)
    assert 3 < in_epoch0 < 10  # the new blend read in epoch 0, then began epoch 1
    epoch0 = check_exactly_once(entries, blends=blends, sources=new, **params | {"steps": in_epoch0})
    assert epoch0.ok and all(c.repeated == 0 for c in epoch0.sources), epoch0.summary()  # at most once
    assert data_digest(blends[-1]["data"]) == resumed.data_digest != first.data_digest


# -- through the checkpoint ----------------------------------------------------------------------
def test_the_identity_rides_in_the_manifest_and_a_change_reaches_the_agent_as_fatal(files):
    from types import SimpleNamespace

    from ftrain.checkpoint.digest import digest_bytes
    from ftrain.checkpoint.manifest import FileEntry, Manifest
    from ftrain.checkpointing import manifest_fields, validate_trainer_state
    from ftrain.config import load_config
    from ftrain.train import say_goodbye

    source = mix([files["a"], files["b"], files["c"]], [3, 2, 1])
    c = cursor(source)
    for _ in range(2):
        c.next_global_batch()
    par = SimpleNamespace(layout=SimpleNamespace(world_size=1, describe=lambda: {"strategy": "ddp"}))
    fields = manifest_fields(load_config(None, []), par, c, 0)  # type: ignore[arg-type]
    manifest = Manifest(
        step=2,
        round=0,
        world_size=1,
        layout={"strategy": "ddp"},
        config_hash="h",
        config={},
        trainer=fields["trainer"],
        digest_algorithm="xxh3_128",
        files={".metadata": FileEntry(3, digest_bytes(b"abc", "xxh3_128"))},
        created_time=1.0,
    )
    read_back = Manifest.from_json(manifest.to_json())  # within the reader's limits
    validate_trainer_state(read_back)
    assert read_back.trainer["cursor"]["blends"][0]["data"] == identity_of(source, SEED)
    with pytest.raises(DataChangeError) as info:
        cursor(mix([files["c"], files["b"], files["a"]], [1, 2, 3])).check_resume(read_back.trainer["cursor"])
    said: dict = {}

    class Heartbeat:
        def exit(self, step: int, **kw: Any) -> None:
            said.update(kw, step=step)

    say_goodbye(Heartbeat(), None, info.value)  # type: ignore[arg-type]
    assert said["fatal"] is True and "DataChangeError: checkpoint step 2 was trained on other data" in said["error"]
