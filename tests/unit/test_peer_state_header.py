"""A peer's state header is untrusted input (issue 25, item 7): :func:`ftrain.recovery.peer_state.check_header`
compares it with this rank's OWN state, so that a float or bool index, a negative or huge dim, a
shape or dtype unlike this rank's, or a step other than the survey's is a
:class:`~ftrain.recovery.peer_state.PeerStateError` (a refused heal), never a TypeError, a RuntimeError
from a 128 TiB allocation, or state of another step."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from ftrain.recovery.peer_state import HeldState, PeerStateError, _parse, check_header, flatten, tensor_specs, unflatten

STEP = 7


def held(step: int = STEP, lr: float = 0.1, train: bool = True) -> HeldState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    if train:
        model(torch.ones(1, 3)).sum().backward()
        optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    cursor = {"epoch": 0, "next_index": 8 * step, "step": step, "num_samples": 100, "seed": 1, "global_batch_size": 8}
    return HeldState(step, -1, model_sd, optim_sd, cursor)


def header_of(state: HeldState) -> Any:
    return flatten(state.payload())[0]


def raw(header: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)


def first_tensor(header: Any) -> dict[str, Any]:
    """The header node of the model's first tensor."""
    return next(iter(header["d"]["model"]["d"].values()))


@pytest.fixture
def mine() -> Any:
    """The receiver's own header: a fresh optimizer (never stepped), another learning rate."""
    return header_of(held(step=0, lr=0.5, train=False))


def test_a_peer_header_like_this_ranks_own_state_is_accepted_with_its_own_values(mine):
    sender = held()
    header, tensors = flatten(sender.payload())
    got, specs = _parse(raw(header), mine, STEP)
    assert [(d, s) for _, d, s in specs] == [(t.dtype, tuple(t.shape)) for t in tensors]
    obj = unflatten(got, tensors)
    assert obj["step"] == STEP and obj["optim"]["param_groups"][0]["lr"] == 0.1
    assert HeldState(STEP, -1, obj["model"], obj["optim"], obj["cursor"]).digest() == sender.digest()


def _float_index(h: Any) -> None:
    first_tensor(h)["t"] = 0.0


def _bool_index(h: Any) -> None:
    first_tensor(h)["t"] = False


def _string_index(h: Any) -> None:
    first_tensor(h)["t"] = "0"


def _negative_dim(h: Any) -> None:
    first_tensor(h)["shape"] = [-2, -3]


def _bool_dim(h: Any) -> None:
    first_tensor(h)["shape"] = [True, 3]


def _float_dim(h: Any) -> None:
    first_tensor(h)["shape"] = [2.0, 3]


def _huge_shape(h: Any) -> None:  # 128 TiB of float32 if allocated
    first_tensor(h)["shape"] = [1 << 23, 1 << 22]


def _other_shape(h: Any) -> None:
    first_tensor(h)["shape"] = [3, 2]


def _unknown_dtype(h: Any) -> None:
    first_tensor(h)["dtype"] = "complex64"


def _other_dtype(h: Any) -> None:
    first_tensor(h)["dtype"] = "float64"


def _extra_tensor_key(h: Any) -> None:
    first_tensor(h)["storage"] = "elsewhere"


def _missing_key(h: Any) -> None:
    h["d"]["model"]["d"].popitem()


def _extra_key(h: Any) -> None:
    h["d"]["model"]["d"]["planted"] = {"v": 1}


def _longer_list(h: Any) -> None:
    h["d"]["optim"]["d"]["param_groups"]["l"].append({"v": None})


def _value_kind(h: Any) -> None:
    h["d"]["cursor"]["d"]["next_index"] = {"f": "56.0"}  # a float where this rank holds an int


def _bool_step(h: Any) -> None:
    h["d"]["step"] = {"v": True}


def _tensor_for_a_value(h: Any) -> None:
    h["d"]["step"] = {"t": 0, "dtype": "int64", "shape": []}


def _duplicate_index(h: Any) -> None:
    nodes = list(h["d"]["model"]["d"].values())
    nodes[1]["t"] = nodes[0]["t"]


@pytest.mark.parametrize(
    "tamper",
    [
        _float_index,
        _bool_index,
        _string_index,
        _negative_dim,
        _bool_dim,
        _float_dim,
        _huge_shape,
        _other_shape,
        _unknown_dtype,
        _other_dtype,
        _extra_tensor_key,
        _missing_key,
        _extra_key,
        _longer_list,
        _value_kind,
        _bool_step,
        _tensor_for_a_value,
        _duplicate_index,
    ],
)
def test_a_header_unlike_this_ranks_state_is_refused(mine, tamper: Callable[[Any], None]):
    header = copy.deepcopy(header_of(held()))
    tamper(header)
    with pytest.raises(PeerStateError):
        check_header(header, mine)
    with pytest.raises(PeerStateError):
        _parse(raw(header), mine, STEP)


@pytest.mark.parametrize("tamper", [_float_index, _bool_index, _negative_dim, _huge_shape, _unknown_dtype])
def test_tensor_specs_alone_refuses_malformed_tensors(tamper: Callable[[Any], None]):
    header = copy.deepcopy(header_of(held()))
    tamper(header)
    with pytest.raises(PeerStateError):
        tensor_specs(header)


def test_a_header_of_another_step_than_the_survey_announced_is_refused(mine):
    with pytest.raises(PeerStateError, match="survey announced step 8"):
        _parse(raw(header_of(held())), mine, STEP + 1)


@pytest.mark.parametrize(
    "data",
    [b"not json", b"[" * 100_000 + b"]" * 100_000, b"1" * 5000, b'{"d": 1}', b"null"],
    ids=["text", "deep", "huge-int", "no-keys", "null"],
)
def test_bytes_that_are_no_header_are_refused(mine, data: bytes):
    with pytest.raises(PeerStateError):
        _parse(torch.frombuffer(bytearray(data), dtype=torch.uint8), mine, STEP)


def test_the_digest_covers_the_step():
    a, b = held(), held()
    b.step = STEP + 1  # the same tensors and cursor, another step
    b._digest = None
    assert a.digest() != b.digest()


def test_unflatten_refuses_an_index_it_cannot_use():
    with pytest.raises(PeerStateError):
        unflatten({"t": 0.0, "dtype": "float32", "shape": []}, [torch.zeros(())])
    with pytest.raises(PeerStateError):
        unflatten({"t": 3, "dtype": "float32", "shape": []}, [torch.zeros(())])
