"""What a Session commits always loads, and torch's own objects round-trip (issue 38, items 2-5,
18, 19), in one process (a group of one) on a local root:

- every LR scheduler class of ``torch.optim.lr_scheduler``, ``GradScaler`` and the optimizers'
  non-tensor parts come back exactly (``state_dict()`` before == after, NaN-aware, types too) and
  go on as an uninterrupted run would;
- a state that the manifest could not hold (a 2**200 seed, deep nesting, a metrics log past
  16 MiB, a huge string) is committed and loads; what can never be stored is refused at save(),
  naming the entry, before anything is written, and at load()/the first step() before any work;
- a step saved with its state in the manifest (before the state file) still loads; a damaged
  state file marks that step corrupt and the load falls back; a step of ``ftrain train`` is
  refused by name and not marked;
- rank 0 says one line per restore and per commit on stderr, unless asked not to or the program
  configured logging; a save beats "saving", which the agent's hang rule gives its save timeout.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.optim import lr_scheduler

import ftrain
from ftrain.agents.heartbeat import HeartbeatServer
from ftrain.agents.supervision import hung_ranks
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, step_dir_name
from ftrain.session import SessionError
from ftrain.session_state import STATE_FILE
from ftrain.testbed.wait import wait_for
from tests.unit.test_state_codec import same

pytestmark = pytest.mark.usefixtures("alone")  # tests/unit/conftest.py: no launcher's variables, no group left


class Holder:
    """A loop's own object: its state is whatever it holds."""

    def __init__(self, value: Any = None):
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value = state


class Warmup:
    """A callable LR factor with state of its own (LambdaLR saves such an object's __dict__)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


Build = Callable[[torch.optim.Optimizer], Any]
#: every scheduler class, with realistic arguments (LambdaLR twice: a plain function, whose state
#: is None and stays the constructor's, and a callable object, whose attributes are saved)
SCHEDULERS: list[tuple[str, Build]] = [
    ("LambdaLR", lambda o: lr_scheduler.LambdaLR(o, lambda s: 0.95**s)),
    ("LambdaLR", lambda o: lr_scheduler.LambdaLR(o, [Warmup(6)])),
    ("MultiplicativeLR", lambda o: lr_scheduler.MultiplicativeLR(o, lambda s: 0.9)),
    ("StepLR", lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
    ("MultiStepLR", lambda o: lr_scheduler.MultiStepLR(o, milestones=[2, 5, 5, 9], gamma=0.5)),
    ("ConstantLR", lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=6)),
    ("LinearLR", lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=6)),
    ("ExponentialLR", lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9)),
    (
        "SequentialLR",
        lambda o: lr_scheduler.SequentialLR(
            o, [lr_scheduler.LinearLR(o, 0.1, total_iters=3), lr_scheduler.ExponentialLR(o, 0.9)], milestones=[3]
        ),
    ),
    ("PolynomialLR", lambda o: lr_scheduler.PolynomialLR(o, total_iters=10, power=2.0)),
    ("CosineAnnealingLR", lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=1e-4)),
    (
        "ChainedScheduler",
        lambda o: lr_scheduler.ChainedScheduler(
            [lr_scheduler.ConstantLR(o, 0.5, total_iters=6), lr_scheduler.ExponentialLR(o, 0.9)], optimizer=o
        ),
    ),
    ("ReduceLROnPlateau", lambda o: lr_scheduler.ReduceLROnPlateau(o, mode="min", patience=1, factor=0.5)),
    ("CyclicLR", lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3)),
    ("CosineAnnealingWarmRestarts", lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2)),
    ("OneCycleLR", lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20)),
]
LOSSES = [1.0, 0.9, 0.95, 0.97, 0.99, 0.98]  #: ReduceLROnPlateau's metric: it plateaus and reduces


def _every_scheduler_class() -> set[str]:
    bases = (lr_scheduler.LRScheduler, lr_scheduler._LRScheduler)
    return {
        name
        for name, cls in vars(lr_scheduler).items()
        if inspect.isclass(cls)
        and issubclass(cls, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau))
        and cls not in bases
    }


def _parts(build: Build, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR/ChainedScheduler warn about their order of steps
        return {"model": model, "optim": optim, "sched": build(optim)}


def _train(state: dict[str, Any], steps: range) -> None:
    model, optim, sched = state["model"], state["optim"], state["sched"]
    for i in steps:
        model(torch.ones(2, 4)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(LOSSES[i % len(LOSSES)])
        else:
            sched.step()


def test_every_torch_scheduler_the_scaler_and_the_optimizers_round_trip_exactly(tmp_path):
    assert {name for name, _ in SCHEDULERS} == _every_scheduler_class(), "a scheduler class is not covered"
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        for step, (name, build) in enumerate(SCHEDULERS, start=1):
            straight = _parts(build, seed=0)
            _train(straight, range(4))
            assert session.save(step, straight, sync=True), (name, session.wait().last_error)
            resumed = _parts(build, seed=1)
            assert session.load(resumed, step=step) == step
            same(straight["sched"].state_dict(), resumed["sched"].state_dict(), name)
            same(straight["optim"].state_dict()["param_groups"], resumed["optim"].state_dict()["param_groups"], name)
            _train(straight, range(4, 7))  # and they go on alike (MultiStepLR decays at its milestones)
            _train(resumed, range(4, 7))
            lrs = [[g["lr"] for g in s["optim"].param_groups] for s in (straight, resumed)]
            assert lrs[0] == lrs[1], (name, lrs)

        def two_optimizers(model: torch.nn.Sequential) -> dict[str, torch.optim.Optimizer]:
            return {
                "adam": torch.optim.Adam(model[0].parameters(), lr=1e-3, betas=(0.8, 0.99), amsgrad=True),
                "rprop": torch.optim.Rprop(model[1].parameters(), etas=(0.4, 1.3), step_sizes=(1e-6, 40.0)),
            }

        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        optimizers = two_optimizers(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=7)
        scaler.load_state_dict({**scaler.state_dict(), "scale": 1024.0, "_growth_tracker": 3})
        for optimizer in optimizers.values():
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        saved = {"model": model, **optimizers, "scaler": scaler}
        assert session.save(100, saved, sync=True)
        before = {k: v.state_dict() for k, v in saved.items() if k != "model"}
        fresh_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fresh = {"model": fresh_model, **two_optimizers(fresh_model), "scaler": torch.amp.GradScaler("cpu")}
        assert session.load(fresh, step=100) == 100
        for key, sd in before.items():
            after = fresh[key].state_dict()
            if key != "scaler":  # tensors (DCP's part) compared by value; the rest exactly
                for index, entry in sd["state"].items():
                    for name, value in entry.items():
                        assert torch.equal(value, after["state"][index][name]), (key, name)
                sd, after = sd["param_groups"], after["param_groups"]
            same(sd, after, key)


@pytest.mark.parametrize(
    ("what", "value"),
    [
        ("a seed of 2**200", {"seed": 2**200, "small": 3}),
        ("100 levels of nesting", "deep"),
        ("a metrics log past 16 MiB", "log"),
        ("a 20 MB string", "x" * 20_000_000),
        ("inf, NaN and int keys", {0: math.inf, 1: [math.nan, -math.inf], "best": (1, 2.5)}),
    ],
)
def test_what_save_commits_load_reads(tmp_path, what, value):
    if value == "deep":
        value = 1
        for _ in range(ftrain.state_codec.MAX_STATE_DEPTH):
            value = [value]
    elif value == "log":
        value = [{"loss": 2.0 - i * 1e-6, "step": i, "note": f"{i:06d}" + "." * 430} for i in range(40_000)]
    model = torch.nn.Linear(2, 2)
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        assert session.finish(1, {"model": model, "extra": Holder(value)}).last_committed_step == 1
    step_dir = tmp_path / "ckpt" / step_dir_name(1)
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    state_file = (step_dir / STATE_FILE).read_bytes()
    entry = manifest["files"][STATE_FILE]
    assert entry == {"size_bytes": len(state_file), "digest": digest_bytes(state_file, manifest["digest_algorithm"])}
    assert (step_dir / MANIFEST_NAME).stat().st_size < 4096, "the loop's state went into the manifest"
    if what == "a metrics log past 16 MiB":
        assert len(state_file) > MAX_MANIFEST_BYTES  # what the manifest could never have held
    back = Holder()
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        assert session.load({"model": torch.nn.Linear(2, 2), "extra": back}) == 1, what
    same(value, back.value, what)
    assert not list((tmp_path / "ckpt").rglob(CORRUPT_NAME))


def test_what_can_never_be_stored_is_refused_at_save_naming_the_entry_and_nothing_is_written(tmp_path, monkeypatch):
    deep: Any = 1
    for _ in range(ftrain.state_codec.MAX_STATE_DEPTH + 1):
        deep = [deep]
    model = torch.nn.Linear(2, 2)
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        for value, why in [
            ({"seed": 10**4300}, r"'extra' \(Holder\).*at \['seed'\]: an int of more than 4300 digits"),
            (deep, r"'extra' \(Holder\).*nested deeper than 100 levels"),
            ({"t": torch.ones(2)}, r"'extra' \(Holder\).*at \['t'\]: torch.Tensor values cannot be stored"),
        ]:
            with pytest.raises(SessionError, match=why):
                session.save(1, {"model": model, "extra": Holder(value)}, sync=True)
        monkeypatch.setattr(ftrain.state_codec, "MAX_STATE_BYTES", 1 << 20)
        with pytest.raises(SessionError, match=r"take \d+ bytes, more than the 1048576.*'log': \d+ bytes"):
            session.save(1, {"model": model, "log": Holder(["x" * 1000] * 2000), "n": Holder(1)}, sync=True)
    assert not list((tmp_path / "ckpt").glob("step-*")), "a refused save wrote files"


class HoldsATensor(Holder):
    def __init__(self) -> None:
        super().__init__({"ema": torch.zeros(3)})


def test_a_state_that_could_never_be_saved_is_refused_at_load_and_at_the_first_step(tmp_path):
    model = torch.nn.Linear(2, 2)
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        with pytest.raises(SessionError, match=r"'ema_holder' \(HoldsATensor\).*\['ema'\]: torch.Tensor"):
            session.load({"model": model, "ema_holder": HoldsATensor()})  # before any work: not at the first save
    with ftrain.Session(str(tmp_path / "ckpt"), interval_steps=100) as session:  # a loop that never loads
        with pytest.raises(SessionError, match=r"'ema_holder' \(HoldsATensor\)"):
            session.step(1, {"model": model, "ema_holder": HoldsATensor()})
    plateau = lr_scheduler.ReduceLROnPlateau(torch.optim.SGD(model.parameters(), lr=0.1))
    with ftrain.Session(str(tmp_path / "ckpt")) as session:  # torch's own: inf in its state, stored
        state = {"model": model, "sched": plateau}
        assert session.load(state) == 0
        assert session.finish(1, state).last_committed_step == 1


def test_a_step_saved_with_its_state_in_the_manifest_still_loads(tmp_path):
    """Steps written before the state file: ``trainer.user_state`` in the manifest, plain JSON."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    old = CheckpointManager(url=str(tmp_path / "ckpt"), job="own-loop", async_mode="off")
    fields = {
        "round": 0,
        "world_size": 1,
        "layout": {"writer": "session", "optim_state_form": "per_param"},
        "config": {},
        "config_hash": "",
        "trainer": {"step": 3, "user_state": {"sampler": {"epoch": 1, "0": "str key then"}}},
    }
    assert old.save(3, {}, fields, sync=True), old.status.last_error
    old.close()
    sampler = Holder()
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        assert session.load({"sampler": sampler}) == 3
    assert sampler.value == {"epoch": 1, "0": "str key then"}  # as it was saved, plain JSON (no tags read)


def test_a_damaged_state_file_marks_that_step_corrupt_and_the_load_falls_back(tmp_path):
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(2, 2)
    with ftrain.Session(str(root), keep_last=5) as session:
        for step in (1, 2, 3):
            session.save(step, {"model": model, "n": Holder({"step": step})}, sync=True)
    flipped = root / step_dir_name(3) / STATE_FILE
    data = bytearray(flipped.read_bytes())
    data[data.index(b"3")] = ord("4")  # same size, another digest
    flipped.write_bytes(bytes(data))
    forged_dir = root / step_dir_name(2)  # digest-valid bytes that are not a state file: a structure failure
    forged = b'{"entries": {"n": {"$pickle": "x"}}, "format": 1}'
    (forged_dir / STATE_FILE).write_bytes(forged)
    manifest = json.loads((forged_dir / MANIFEST_NAME).read_text())
    manifest["files"][STATE_FILE] = {"size_bytes": len(forged), "digest": digest_bytes(forged, "xxh3_128")}
    (forged_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    back = Holder()
    with ftrain.Session(str(root)) as session:
        assert session.load({"model": torch.nn.Linear(2, 2), "n": back}) == 1
    assert back.value == {"step": 1}
    marks = {p.parent.name: p.read_text() for p in root.rglob(CORRUPT_NAME)}
    assert set(marks) == {step_dir_name(2), step_dir_name(3)}
    assert "digest" in marks[step_dir_name(3)] and "$pickle" in marks[step_dir_name(2)]


def test_a_step_of_ftrain_train_is_refused_by_name_and_not_marked(tmp_path):
    from ftrain.checkpointing import SCHEDULE_KEY

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train = CheckpointManager(url=str(tmp_path / "ckpt"), job="shared", async_mode="off")
    cursor = {"epoch": 0, "next_index": 8, "step": 4, "num_samples": 100, "seed": 0, "global_batch_size": 2}
    fields = {"round": 0, "world_size": 1, "layout": {"strategy": "ddp", "optim_state_form": "per_param"}}
    fields |= {"config": {}, "config_hash": "h", "trainer": {"cursor": cursor, SCHEDULE_KEY: {}}}
    model = torch.nn.Linear(2, 2)
    assert train.save(4, {"model": model.state_dict()}, fields, sync=True), train.status.last_error
    train.close()
    with ftrain.Session(str(tmp_path / "ckpt"), job="shared") as session:
        with pytest.raises(
            SessionError,
            match=r"step 4 under .* was written by ftrain train \(its layout names no writer\), not by a Session",
        ):
            session.load({"model": model})
    assert not list((tmp_path / "ckpt").rglob(CORRUPT_NAME))


def _said(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ftrain: ")]


def test_rank_0_says_one_line_per_restore_and_per_commit_unless_asked_not_to(tmp_path, capfd, monkeypatch):
    root_logger = logging.getLogger()
    monkeypatch.setattr(root_logger, "handlers", [])  # a script that configured no logging (pytest's taken away)
    model = torch.nn.Linear(2, 2)
    with ftrain.Session(str(tmp_path / "ckpt"), interval_steps=2) as session:
        state = {"model": model}
        session.load(state)
        for step in range(1, 5):
            session.step(step, state)
        session.finish(4, state)
    said = _said(capfd.readouterr().err)
    assert said[0] == f"ftrain: no committed step under {tmp_path / 'ckpt'}: starting from step 0", said
    assert [line.split(" (")[0] for line in said[1:]] == [
        f"ftrain: committed step {s} under {tmp_path / 'ckpt'}" for s in (2, 4)
    ], said
    with ftrain.Session(str(tmp_path / "ckpt")) as session:
        session.load({"model": model})
    assert _said(capfd.readouterr().err) == [
        f"ftrain: resumed after step 4, loaded from {tmp_path / 'ckpt'} (saved at world size 1)"
    ]
    with ftrain.Session(str(tmp_path / "ckpt"), verbose=False) as session:
        session.load({"model": model})
        session.finish(5, {"model": model})
    assert _said(capfd.readouterr().err) == []

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    monkeypatch.setattr(root_logger, "handlers", [Keep()])  # the program configured logging: it decides
    level = root_logger.level
    root_logger.setLevel(logging.INFO)
    try:
        with ftrain.Session(str(tmp_path / "ckpt")) as session:
            session.load({"model": model})
    finally:
        root_logger.setLevel(level)
    assert _said(capfd.readouterr().err) == []
    assert "resumed after step 5, loaded from" in " ".join(got)


HANG_TIMEOUT_S = 2.0


def test_a_save_beats_saving_and_the_agents_hang_rule_gives_it_the_save_timeout(tmp_path, monkeypatch):
    """A save that outlasts the hang timeout (held in the commit here) is no hang: the session's
    last beat says "saving", and the agent's rule applies its start (save) timeout to that phase."""
    where = tempfile.mkdtemp(prefix="ftrain-hb-", dir="/tmp")  # a socket path short enough for AF_UNIX
    server = HeartbeatServer(os.path.join(where, "hb.sock"))
    server.reset(0)
    monkeypatch.setenv("FTRAIN_HEARTBEAT", server.path)
    seen: dict[str, Any] = {}

    def during_the_commit(step: int) -> None:
        def judged() -> bool:
            beat = server.beats().get(0)
            now = time.monotonic()
            return beat is not None and now - beat.received_at > HANG_TIMEOUT_S and now - beat.alive_at < 1.5

        wait_for(judged, 15, "the save to outlast the hang timeout with the process alive")
        beat, now = server.beats()[0], time.monotonic()
        limits = {"nproc_per_node": 1, "started_at": 0.0, "now": now, "hang_timeout_s": HANG_TIMEOUT_S}
        seen["phase"] = beat.phase
        seen["hung"] = hung_ranks({0: beat}, start_timeout_s=600.0, **limits)
        seen["hung as training"] = hung_ranks(
            {0: dataclasses.replace(beat, phase="training")}, start_timeout_s=600.0, **limits
        )

    model = torch.nn.Linear(2, 2)
    try:
        with ftrain.Session(str(tmp_path / "ckpt"), interval_steps=2, async_save=False) as session:
            session._manager.after_fence = during_the_commit
            session.step(1, {"model": model})
            wait_for(lambda: server.beats().get(0) is not None and server.beats()[0].step == 1, 10, "step 1's beat")
            assert server.beats()[0].phase == "training"
            assert session.step(2, {"model": model})  # the periodic save, held in its commit
            wait_for(lambda: server.beats()[0].phase == "training", 10, "the training beat after the save")
    finally:
        server.close()
    assert seen == {"phase": "saving", "hung": [], "hung as training": [0]}, seen


def test_a_closed_session_says_so_and_a_committed_step_is_not_saved_again(tmp_path, recwarn):
    model = torch.nn.Linear(2, 2)
    session = ftrain.Session(str(tmp_path / "ckpt"))
    with session:
        session.finish(1, {"model": model})
        assert not session.save(1, {"model": model}, sync=True)  # committed already: nothing runs
        assert session.wait().saves_failed == 0
    with pytest.raises(SessionError, match=r"Session.save\(\) after Session.close\(\): the session is closed"):
        session.save(2, {"model": model})
    with ftrain.Session(str(tmp_path / "ckpt")) as again:  # a session that does not know step 1 is committed
        assert not again.save(1, {"model": model}, sync=True)
        assert "already committed" in again.wait().last_error
    assert not [w for w in recwarn if "overwriting" in str(w.message)], [str(w.message) for w in recwarn]
    assert not list((tmp_path / "ckpt").rglob(CORRUPT_NAME))


def test_each_ranks_own_entries_come_back_as_saved_and_a_bad_record_of_them_marks_the_step(tmp_path):
    """An RNG state (and any entry marked PerRank) is the rank's own: saved as a tensor of its
    shards, loaded back exactly (what was drawn after the save is drawn again). A step saved before
    the entry joined the state is refused naming it; a malformed record of the entries in the
    manifest (read from storage: untrusted) marks the step corrupt and the load falls back."""
    root = tmp_path / "ckpt"
    model, mine = torch.nn.Linear(2, 2), Holder({"shard_position": 7})
    with ftrain.Session(str(root), keep_last=5) as session:
        session.save(1, {"model": model}, sync=True)  # before the per-rank entries joined
        state = {"model": model, "rng": ftrain.RNGState(), "mine": ftrain.PerRank(mine)}
        for step in (2, 3):
            torch.manual_seed(step)
            session.save(step, state, sync=True)
    drawn = torch.rand(4)  # what step 3's generator draws next
    manifest_path = root / step_dir_name(3) / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    assert manifest["trainer"]["per_rank"]["rng"] > 0 and manifest["trainer"]["per_rank"]["mine"] > 0
    manifest["trainer"]["per_rank"]["rng"] = "a lot"
    manifest_path.write_text(json.dumps(manifest))

    back, rng = Holder(), ftrain.RNGState()
    torch.manual_seed(99)
    with ftrain.Session(str(root)) as session:
        assert session.load({"model": torch.nn.Linear(2, 2), "rng": rng, "mine": ftrain.PerRank(back)}) == 2
        assert back.value == {"shard_position": 7}
        torch.manual_seed(2)
        again = torch.rand(4)
        torch.manual_seed(99)
        assert session.load({"model": torch.nn.Linear(2, 2), "rng": rng}, step=2) == 2
        assert torch.equal(torch.rand(4), again)  # step 2's generator, as saved
        with pytest.raises(SessionError, match=r"step 1 holds no 'rng'"):
            session.load({"model": torch.nn.Linear(2, 2), "rng": rng}, step=1)
    assert "per_rank" in (root / step_dir_name(3) / CORRUPT_NAME).read_text()
    assert not torch.equal(drawn, again)
    with pytest.raises(TypeError, match="state_dict"):
        ftrain.PerRank(42)


def test_a_per_rank_tensor_that_lies_about_its_length_is_refused():
    from ftrain.checkpoint.errors import ManifestError
    from ftrain.session_per_rank import pack, unpack

    tensors, capacities = pack({"x": ftrain.state_codec.encode({"a": (1, 2)})}, rank=0)
    (t,) = tensors.values()
    assert unpack(t, "x", 5) == {"a": (1, 2)} and capacities == {"x": t.numel() - 8}
    t[0] = 255  # the length header says more than the tensor holds
    with pytest.raises(ManifestError, match="step 5: the per-rank entry 'x' says"):
        unpack(t, "x", 5)


def test_a_loops_own_manifest_fields_are_recorded_and_read_back_and_what_a_manifest_cannot_hold_is_refused(tmp_path):
    """``Session(manifest_fields=...)``: the loop's config, its digest, layout and trainer fields in
    each step's manifest (what ``ftrain ckpt show`` prints), beside the session's own keys, which it
    may not set; ``session.manifest`` is the loaded step's, ``check_resume`` sees it before the
    step's files are read and may refuse it. What a manifest could not hold, or its
    reader would refuse, is refused at save() before anything is written."""
    root = tmp_path / "ckpt"
    own: dict[str, Any] = {
        "config": {"model": {"d_model": 32}, "lr": 0.01},
        "config_hash": "c0ffee",
        "layout": {"pp_size": 2},
        "trainer": {"cursor": {"epoch": 1, "offset": 96}},
    }
    model = torch.nn.Linear(2, 2)
    with ftrain.Session(str(root), manifest_fields=lambda: own) as session:
        assert session.save(4, {"model": model}, sync=True)
    written = json.loads((root / step_dir_name(4) / MANIFEST_NAME).read_text())
    assert written["config"] == own["config"] and written["config_hash"] == "c0ffee"
    assert written["layout"]["pp_size"] == 2 and written["layout"]["writer"] == "session"
    assert written["trainer"]["cursor"] == {"epoch": 1, "offset": 96} and written["trainer"]["step"] == 4
    seen: list[int] = []

    def check(manifest: Manifest) -> None:  # the loop's own check, before a file of the step is read
        seen.append(manifest.step)
        if manifest.config["model"] != {"d_model": 64}:
            raise ValueError(f"step {manifest.step} has model {manifest.config['model']}, this run d_model 64")

    target = torch.nn.Linear(2, 2)
    before = target.weight.detach().clone()
    with ftrain.Session(str(root), check_resume=check) as session:
        with pytest.raises(ValueError, match=r"step 4 has model \{'d_model': 32\}, this run d_model 64"):
            session.load({"model": target})
    assert seen == [4] and torch.equal(target.weight, before), "the refused step was read"
    assert not list(root.rglob("corrupt.json")), "a step the loop refused was marked corrupt"
    with ftrain.Session(str(root), check_resume=lambda m: seen.append(m.step)) as session:
        assert session.manifest is None
        assert session.load({"model": target}) == 4 and seen == [4, 4]
        assert session.manifest is not None and session.manifest.config == own["config"]
        assert session.manifest.trainer["cursor"] == {"epoch": 1, "offset": 96}

    for fields, why in [
        ({"trainer": {"step": 9}}, r"at step 5: trainer.step is the session's own"),
        ({"layout": {"writer": "train"}}, r"layout.writer is the session's own"),
        ({"world_size": 3}, r"return a dict with some of config, config_hash, layout, trainer"),
        ({"config": {"loss": math.nan}}, r"not what a manifest holds"),
        ({"config": {"t": torch.ones(1)}}, r"not what a manifest holds"),
        ({"config_hash": 7}, r"config_hash is text, not int"),
    ]:
        with ftrain.Session(str(root), manifest_fields=lambda f=fields: f) as session:  # type: ignore[misc]
            with pytest.raises(SessionError, match=why):
                session.save(5, {"model": model}, sync=True)
    assert not (root / step_dir_name(5)).exists(), "a refused save wrote files"
