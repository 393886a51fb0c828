"""ftrain.state_codec: a loop's non-tensor state comes back exactly (type and value: inf, NaN,
-0.0, int keys, tuples, Counter, bytes, big ints), what can never be stored is refused naming
where it is, and bytes that are not this encoding are refused with StateDecodeError, never with
another exception, whatever they hold."""

from __future__ import annotations

import collections
import json
import math
import random
from typing import Any

import pytest

from ftrain import state_codec
from ftrain.state_codec import StateDecodeError, StateEncodeError


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal in type and value, NaN equal to NaN and -0.0 told from 0.0."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b) if isinstance(a, collections.OrderedDict) else set(a) == set(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


VALUES = [
    None,
    True,
    0,
    -(2**200),
    10**4299,  # 4300 digits: the most Python itself converts
    0.1,
    -0.0,
    1e308,
    5e-324,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "a\udc80b \u2603 $tuple",  # a lone surrogate (what a byte-decoded name may hold) and a tag-like text
    b"\x00\xffbytes",
    [1, [2, [3.5, None]]],
    (1, (2.0, "x")),
    (),
    {0: "int key", 1.5: "float key", None: "none key", (1, 2): "tuple key", True: "bool key"},
    {"$float": "inf", "$not a tag": 1},  # str keys that look like tags: stored as pairs
    {"plain": {"nested": [{"k": math.nan}]}},
    collections.Counter({5: 2, 2: 1, 9: 1}),  # MultiStepLR's milestones
    collections.OrderedDict([("b", 1), ("a", 2)]),
    {1, 2, 3},
    frozenset({"x", ("y", 1)}),
    {"mode_worse": math.inf, "best": -math.inf, "min_lrs": [0, 1e-6]},  # ReduceLROnPlateau's
]


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:30] for v in VALUES])
def test_a_value_comes_back_exactly(value):
    same(value, state_codec.decode(state_codec.encode(value)))


def test_subclasses_come_back_as_their_base_kind_as_plain_json_always_did():
    point = collections.namedtuple("point", "x y")(1, 2)
    lazy = collections.defaultdict(list, {"a": [1]})

    class Ratio(float):
        pass

    got = state_codec.decode(state_codec.encode({"p": point, "d": lazy, "r": Ratio(0.5)}))
    same(got, {"p": (1, 2), "d": {"a": [1]}, "r": 0.5})


def test_a_state_file_holds_each_entry_and_reads_back():
    entries = {"sched": state_codec.encode({"best": math.inf}), "n": state_codec.encode(3)}
    data = state_codec.file_bytes(entries)
    assert len(data) == state_codec.entries_size_bytes(entries)
    same(state_codec.load_file(data), {"sched": {"best": math.inf}, "n": 3})
    assert json.loads(data)["format"] == state_codec.FORMAT  # plain JSON: any tool reads it


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "where", "why"),
    [
        ({"a": [1, Opaque()]}, "['a'][1]", "Opaque values cannot be stored"),
        ({"seed": 10**4300}, "['seed']", "more than 4300 digits"),
        ({0: {"x": bytearray(b"ok"), "y": object()}}, "[0]['y']", "object values cannot be stored"),
    ],
)
def test_what_can_never_be_stored_is_refused_naming_where(value, where, why):
    with pytest.raises(StateEncodeError, match=why) as e:
        state_codec.encode(value)
    assert e.value.where == where


def test_nesting_past_the_bound_and_a_structure_that_holds_itself_are_refused():
    deep: Any = 1
    for _ in range(state_codec.MAX_STATE_DEPTH):
        deep = [deep]
    same(deep, state_codec.decode(state_codec.encode(deep)))  # at the bound: stored
    with pytest.raises(StateEncodeError, match=f"deeper than {state_codec.MAX_STATE_DEPTH}"):
        state_codec.encode([deep])
    loop: list[Any] = []
    loop.append({"again": loop})
    with pytest.raises(StateEncodeError, match="contains itself"):
        state_codec.encode(loop)


HOSTILE = [
    b"",
    b"\xff\xfe",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"$float": "Infinity"}',
    b"NaN",
    b"1" * 5000,
    b'{"$tuple": 3}',
    b'{"$dict": [[[1], 2]]}',  # an unhashable key
    b'{"$dict": [[1, 2], [1, 3]]}',  # a repeated key
    b'{"$dict": [[1]]}',
    b'{"$set": [[1]]}',
    b'{"$bytes": "not base64!"}',
    b'{"$bytes": 5}',
    b'{"$float": "inf", "x": 1}',
    b'{"$pickle": "cos\\nsystem\\n"}',
    b'{"$counter": {"a": 1}}',
]


@pytest.mark.parametrize("data", HOSTILE, ids=[repr(d)[:30] for d in HOSTILE])
def test_bytes_that_are_not_this_encoding_are_refused_as_such(data):
    with pytest.raises(StateDecodeError):
        state_codec.decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"[]",
        b'{"entries": {}}',
        b'{"entries": [], "format": 1}',
        b'{"entries": {}, "format": 2}',
        b'{"entries": {}, "format": true}',
        b'{"entries": {"a": {"$float": "x"}}, "format": 1}',
    ],
)
def test_a_state_file_that_is_not_one_is_refused(data):
    with pytest.raises(StateDecodeError):
        state_codec.load_file(data)


def test_a_file_larger_than_the_bound_is_refused_unparsed(monkeypatch):
    data = state_codec.file_bytes({"log": state_codec.encode(list(range(1000)))})
    monkeypatch.setattr(state_codec, "MAX_STATE_BYTES", len(data) - 1)
    with pytest.raises(StateDecodeError, match="more than the"):
        state_codec.load_file(data)


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 6 else 4)
    if kind == 0:
        return rng.choice([None, True, False, 0, -1, 2**70, 1.5, "s", "$float", "$tuple"])
    if kind == 1:
        return rng.choice(["inf", "nan", "-inf", "x", "", "QUJD"])
    if kind == 2:
        return rng.randrange(-(10**6), 10**6)
    if kind == 3:
        return rng.random() * 10 ** rng.randrange(-300, 300)
    if kind in (4, 5):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["$float", "$tuple", "$dict", "$counter", "$ordereddict", "$set", "$frozenset", "$bytes", "a", "$x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(1, 3))}


def test_generated_hostile_json_is_refused_or_decoded_never_anything_else():
    rng = random.Random(38)
    for _ in range(3000):
        data = json.dumps(_random_json(rng)).encode()
        try:
            state_codec.decode(data)
        except StateDecodeError:
            pass
