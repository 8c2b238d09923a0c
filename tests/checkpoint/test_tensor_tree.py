"""A state of nested containers as tensors only, and back (qcomm/checkpoint/tensor_tree.py): the
very same object comes back, types included; anything else is refused naming where it is."""

from __future__ import annotations

import math

import pytest
import torch

from qcomm.checkpoint.tensor_tree import STRUCTURE, from_tensors, to_tensors


def test_every_kind_comes_back_as_it_was() -> None:
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    state = {"config": {"spec": (4, 128, "stochastic"), "numel": 1 << 40, "ok": True},
             "seed": 2**64 - 1, "gamma": 0.3, "none": None,
             "own_sent": [(3, torch.tensor([1, 2], dtype=torch.uint8)), (4, t)],
             "by_rank": {0: 5, 7: [1.5, float("inf")]}, "nan": float("nan"), "s": "é",
             "empty": {}, "tensor": t}
    flat = to_tensors(state)
    assert set(flat) == {STRUCTURE, "t0", "t1", "t2"}
    assert all(isinstance(v, torch.Tensor) for v in flat.values())
    back = from_tensors(flat)
    assert back["config"] == state["config"] and isinstance(back["config"]["spec"], tuple)
    assert back["seed"] == 2**64 - 1 and back["by_rank"][7][1] == float("inf")
    assert list(back["by_rank"]) == [0, 7] and math.isnan(back["nan"])
    assert back["own_sent"][0][0] == 3 and isinstance(back["own_sent"][0], tuple)
    assert torch.equal(back["own_sent"][1][1], t) and back["tensor"] is t
    assert back["empty"] == {} and back["s"] == "é" and back["none"] is None


@pytest.mark.parametrize("bad, where", [
    ({"a": [1, object()]}, "state['a'][1] is a object"),
    ({"spec": {1, 2}}, "state['spec'] is a set"),
    ((1, b"bytes"), "state[1] is a bytes"),
])
def test_another_type_is_refused_naming_where(bad: object, where: str) -> None:
    with pytest.raises(TypeError, match=rf"{__import__('re').escape(where)}: a checkpoint's"):
        to_tensors(bad)


def test_a_broken_structure_is_a_named_error() -> None:
    with pytest.raises(ValueError, match="needs 'structure'"):
        from_tensors({"t0": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a JSON document"):
        from_tensors({STRUCTURE: torch.tensor([0xff, 0xfe], dtype=torch.uint8)})
    flat = to_tensors({"x": torch.zeros(2)})
    del flat["t0"]
    with pytest.raises(ValueError, match="names tensor 't0', which it does not hold"):
        from_tensors(flat)
