"""A weighted mixture of token files (``[[data.sources]]``): the blend index, the realised mixture,
the ledger's per-source proof, and the configuration errors that name the key."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ftrain.cli.config import load_job_config
from ftrain.config import ConfigError, DataConfig, ModelConfig
from ftrain.data import (
    BlendIndex,
    DataCursor,
    Ledger,
    MixtureSource,
    SourceSpec,
    TokenFileSource,
    build_source,
    check_exactly_once,
    micro_batches,
    read_ledger,
    write_token_file,
)
from ftrain.data.mixture import blend_counts

SEQ_LEN, VOCAB = 4, 64
#: each source's tokens lie in its own band of the vocabulary, so a row names its source
BAND = 20


def token_file(path: Path, source: int, num_samples: int) -> Path:
    """A token file of exactly ``num_samples`` samples whose every token is in band ``source``."""
    tokens = source * BAND + np.arange(num_samples * SEQ_LEN + 1) % BAND
    write_token_file(path, tokens, "uint16")
    return path


def mixture(tmp_path: Path, sizes: list[int], weights: list[float], total: int = 0, seed: int = 7) -> MixtureSource:
    specs = [
        SourceSpec(str(token_file(tmp_path / f"s{k}.bin", k, n)), w)
        for k, (n, w) in enumerate(zip(sizes, weights, strict=True))
    ]
    return MixtureSource(specs, SEQ_LEN, VOCAB, seed, total)


# -- the blend -------------------------------------------------------------------------------
def test_counts_sum_to_the_total_and_stay_within_one_of_each_share():
    for weights, total in (([0.5, 0.3, 0.2], 100), ([1, 1, 1], 100), ([3, 1e-3, 7], 12_345), ([2.5], 17)):
        counts = blend_counts(weights, total)
        assert counts.sum() == total
        shares = np.asarray(weights) / sum(weights) * total
        assert np.all(np.abs(counts - shares) < 1), (weights, counts)
    assert blend_counts([1, 1, 1], 100).tolist() == [34, 33, 33]  # ties go to the earlier source


def test_each_pass_reads_every_sample_once_and_the_partial_pass_a_distinct_subset():
    sizes, weights, total = [10, 7, 50], [5.0, 3.0, 2.0], 67
    blend = BlendIndex(sizes, weights, total, seed=1)
    assert blend.counts.tolist() == [34, 20, 13]  # 3.4 passes, 2.86 passes, 0.26 of one
    source, sample = blend.decode(np.arange(total))
    for k, n in enumerate(sizes):
        reads = np.bincount(sample[source == k], minlength=n)
        full, rest = divmod(int(blend.counts[k]), n)
        assert sorted(set(reads.tolist())) == sorted({full, full + 1} if rest else {full})
        assert int((reads == full + 1).sum()) == rest
    # Draws of one pass never repeat a sample: a pass is the block of n consecutive draws.
    draws = np.arange(total) - blend.offsets[source]
    for k, n in enumerate(sizes):
        for q in range(math.ceil(blend.counts[k] / n)):
            in_pass = (source == k) & (draws // n == q)
            assert len(set(sample[in_pass].tolist())) == int(in_pass.sum())


def test_decode_is_a_pure_function_of_each_id():
    blend = BlendIndex([10, 7, 50], [5.0, 3.0, 2.0], 67, seed=1)
    ids = np.random.default_rng(0).permutation(67)
    src, idx = blend.decode(ids)
    for i, s, j in zip(ids[:20].tolist(), src.tolist(), idx.tolist(), strict=False):
        one_src, one_idx = blend.decode(np.array([i]))
        assert (int(one_src[0]), int(one_idx[0])) == (s, j)
    again = BlendIndex([10, 7, 50], [5.0, 3.0, 2.0], 67, seed=1).decode(ids)
    assert np.array_equal(again[0], src) and np.array_equal(again[1], idx)
    other_seed = BlendIndex([10, 7, 50], [5.0, 3.0, 2.0], 67, seed=2).decode(np.arange(67))[1]
    assert not np.array_equal(other_seed, blend.decode(np.arange(67))[1])  # the partial passes move


def test_rows_come_from_the_source_and_sample_the_id_decodes_to(tmp_path):
    mix = mixture(tmp_path, [30, 20, 10], [1.0, 1.0, 1.0])
    assert mix.num_samples == 60 and mix.blend.counts.tolist() == [20, 20, 20]
    ids = np.random.default_rng(1).permutation(60)
    rows = mix.sample(ids)
    assert rows.shape == (60, SEQ_LEN + 1) and rows.dtype == np.int64
    source, index = mix.decode(ids)
    for k in range(3):
        at = source == k
        assert np.all(rows[at] // BAND == k)
        assert np.array_equal(rows[at], mix.sources[k].sample(index[at]))
    for i in (0, 17, 59):  # a row does not depend on the ids asked with it
        assert np.array_equal(mix.sample(np.array([i]))[0], rows[np.flatnonzero(ids == i)[0]])
    assert mix.entropy_floor_nats is None


def test_realised_mixture_matches_the_weights_within_four_sigma(tmp_path):
    """The ids of the first m samples of an epoch are a uniform draw without replacement from the
    mixture, so each source's count is hypergeometric around its weight: within 4 binomial sigma."""
    weights = [0.5, 0.3, 0.2]
    mix = mixture(tmp_path, [2000, 1000, 500], weights)  # 1750 of 2000, 1050 of 1000, 700 of 500
    batch, steps = 40, 25  # m = 1000 samples, under a third of the epoch
    m = batch * steps
    for seed in range(20):
        cursor = DataCursor(mix.num_samples, batch, seed)
        ids = np.concatenate([cursor.next_global_batch().sample_ids for _ in range(steps)])
        rows = mix.sample(ids)
        counts = np.bincount(rows[:, 0] // BAND, minlength=3)
        for k, p in enumerate(weights):
            sigma = math.sqrt(m * p * (1 - p))
            assert abs(counts[k] - m * p) <= 4 * sigma, (seed, k, counts.tolist())


def test_a_weight_too_small_to_get_a_sample_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.weight: 1e-06 gives .*raise its weight"):
        mixture(tmp_path, [10, 10], [1.0, 1e-6])


def test_mixture_samples_sizes_the_epoch(tmp_path):
    mix = mixture(tmp_path, [10, 10], [3.0, 1.0], total=100)
    assert mix.num_samples == 100 and mix.blend.counts.tolist() == [75, 25]
    source, sample = mix.decode(np.arange(100))
    # 25 draws of 10 samples: two full passes, then 5 distinct samples a third time
    assert sorted(np.bincount(sample[source == 1], minlength=10).tolist()) == [2] * 5 + [3] * 5


# -- the ledger's proof ----------------------------------------------------------------------
def _train(directory: Path, mix: MixtureSource, *, world: int, round_: int, steps: range, batch: int, seed: int):
    """``world`` ranks of one round run ``steps`` and record what they read, as the trainer does."""
    cursor = DataCursor(mix.num_samples, batch, seed)
    ledgers = [Ledger(directory, r, round_) for r in range(world)]
    try:
        for step in range(steps.stop):
            global_batch = cursor.next_global_batch()
            if step in steps:
                for rank, ledger in enumerate(ledgers):
                    micros = micro_batches(global_batch, rank, world, 2)
                    ledger.record(global_batch, micros)
                    for micro in micros:
                        mix.sample(micro.sample_ids)  # what the rank reads
    finally:
        for ledger in ledgers:
            ledger.close()


def test_ledger_proves_every_sample_of_every_source_once_across_a_resize(tmp_path):
    mix = mixture(tmp_path, [24, 16, 8], [3.0, 2.0, 1.0])  # shares equal to the sizes: one pass each
    batch, seed, steps = 8, 11, 6  # 6 x 8 = 48: the whole mixture epoch
    ledger = tmp_path / "ledger"
    _train(ledger, mix, world=2, round_=0, steps=range(4), batch=batch, seed=seed)  # died during step 3,
    _train(ledger, mix, world=1, round_=1, steps=range(2, steps), batch=batch, seed=seed)  # resumed from 2
    report = check_exactly_once(
        read_ledger(ledger), num_samples=mix.num_samples, global_batch_size=batch, seed=seed, steps=steps, sources=mix
    )
    assert report.ok and report.superseded_entries == 4, report.summary()
    assert report.every_sample_once, report.summary()
    assert [(c.name, c.num_samples, c.reads) for c in report.sources] == [
        (str(tmp_path / f"s{k}.bin"), n, n) for k, n in enumerate((24, 16, 8))
    ]
    assert "all 24 samples read exactly once" in report.summary()


def test_ledger_counts_repeats_of_an_upsampled_source_and_reads_left_out(tmp_path):
    mix = mixture(tmp_path, [24, 16, 8], [1.0, 1.0, 1.0])  # 16 draws each: 2/3 of s0, 1 pass of s1, 2 of s2
    ledger = tmp_path / "ledger"
    _train(ledger, mix, world=2, round_=0, steps=range(6), batch=8, seed=3)
    params = dict(num_samples=48, global_batch_size=8, seed=3, sources=mix)
    report = check_exactly_once(read_ledger(ledger), steps=6, **params)
    assert report.ok and not report.every_sample_once
    s0, s1, s2 = report.sources
    assert (s0.unread, s0.once, s0.repeated) == (8, 16, 0)
    assert s1.exactly_once
    assert (s2.unread, s2.once, s2.repeated, s2.max_reads) == (0, 0, 8, 2)
    assert "8 unread" in report.summary()
    partial = check_exactly_once(read_ledger(ledger), steps=3, **params)  # half an epoch: some unread
    assert partial.ok and not partial.every_sample_once


def test_a_sample_read_twice_shows_in_its_source(tmp_path):
    mix = mixture(tmp_path, [24, 16, 8], [3.0, 2.0, 1.0])
    ledger = tmp_path / "ledger"
    _train(ledger, mix, world=1, round_=0, steps=range(6), batch=8, seed=3)
    entries = read_ledger(ledger)
    entries[1]["sample_ids"][0] = entries[0]["sample_ids"][0]  # step 1 re-read a sample of step 0
    report = check_exactly_once(entries, num_samples=48, global_batch_size=8, seed=3, steps=6, sources=mix)
    assert not report.ok and not report.every_sample_once
    assert sum(c.repeated for c in report.sources) == 1 and sum(c.unread for c in report.sources) == 1
    assert sum(c.reads for c in report.sources) == 48


# -- configuration ---------------------------------------------------------------------------
@pytest.fixture
def files(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.chdir(tmp_path)
    return [token_file(tmp_path / f"s{k}.bin", k, 10).name for k in range(3)]


def test_sources_from_a_file_and_from_the_command_line(files, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        "[model]\nvocab_size = 64\nseq_len = 4\n"
        + "".join(f'[[data.sources]]\npath = "{f}"\nweight = {k + 1}\n' for k, f in enumerate(files))
        + '[[data.sources]]\npath = "s0.bin"\nweight = 0.5\ntoken_dtype = "uint16"\n'
    )
    cfg = load_job_config(config)
    assert [s["weight"] for s in cfg.data.sources] == [1, 2, 3, 0.5]
    source = build_source(cfg.data, cfg.model)
    assert isinstance(source, MixtureSource) and source.num_samples == 40
    cli = load_job_config(None, ['--data.sources=[{path="s1.bin", weight=1.0}, {path="s2.bin", weight=2}]'])
    assert [s["path"] for s in cli.data.sources] == ["s1.bin", "s2.bin"]
    one = load_job_config(None, ["--data.source=s1.bin", "--model.seq_len=4"])
    assert isinstance(build_source(one.data, one.model), TokenFileSource)


@pytest.mark.parametrize(
    ("sources", "key", "words"),
    [
        ('[{path="s0.bin", wieght=1.0}]', "data.sources[0].wieght", "did you mean 'weight'"),
        ('[{path="s0.bin", weight=1}, {path="s1.bin", weight=1, dtype="uint16"}]', "data.sources[1].dtype", "unknown"),
        ('[{path="s0.bin"}]', "data.sources[0].weight", "missing"),
        ("[{weight=1.0}]", "data.sources[0].path", "missing"),
        ('[{path="nope.bin", weight=1.0}]', "data.sources[0].path", "'nope.bin' does not exist"),
        ("[{path=3, weight=1.0}]", "data.sources[0].path", "must be the path"),
        ('[{path="s0.bin", weight=0}]', "data.sources[0].weight", "finite number > 0"),
        ('[{path="s0.bin", weight=-2.0}]', "data.sources[0].weight", "finite number > 0"),
        ('[{path="s0.bin", weight=nan}]', "data.sources[0].weight", "finite number > 0"),
        ('[{path="s0.bin", weight=inf}]', "data.sources[0].weight", "finite number > 0"),
        ('[{path="s0.bin", weight=true}]', "data.sources[0].weight", "finite number > 0"),
        ('[{path="s0.bin", weight="1"}]', "data.sources[0].weight", "finite number > 0"),
        # a TOML integer float() cannot hold: refused here, not an OverflowError in the blend
        (f'[{{path="s0.bin", weight={10**400}}}]', "data.sources[0].weight", "an integer of more than 1000 bits"),
        ('[{path="s0.bin", weight=1, token_dtype="int8"}]', "data.sources[0].token_dtype", "not one of"),
        ('{path="s0.bin", weight=1}', "data.sources", "array of tables"),
    ],
)
def test_a_bad_source_names_its_key(files, sources, key, words):
    with pytest.raises(ConfigError) as err:
        load_job_config(None, [f"--data.sources={sources}"])
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_data_source_and_sources_together_name_both(files):
    with pytest.raises(ConfigError) as err:
        load_job_config(None, ["--data.source=s0.bin", '--data.sources=[{path="s1.bin", weight=1}]'])
    assert err.value.key == "data.sources" and "data.source = 's0.bin'" in str(err.value)


def test_mixture_samples_and_document_token_are_checked(files):
    with pytest.raises(ConfigError, match=r"data\.mixture_samples: sizes a data\.sources mixture"):
        DataConfig(mixture_samples=10)
    with pytest.raises(ConfigError, match=r"data\.mixture_samples: must be in"):
        DataConfig(mixture_samples=-1, sources=[{"path": "s0.bin", "weight": 1}])
    with pytest.raises(ConfigError, match=r"data\.document_token: must be in \[-1"):
        DataConfig(document_token=-2)
    assert DataConfig(document_token=63).document_token == 63
    with pytest.raises(ConfigError, match=r"data\.document_token: 64 is not a token of model\.vocab_size=64"):
        build_source(DataConfig(document_token=64), ModelConfig(vocab_size=64))
