"""qcomm/checkpoint/checkpoint.py's helpers on their own (the per-rank checkpoints end to end
are tests/sgd/'s and tests/checkpoint/test_checkpoint_file.py's)."""

from __future__ import annotations

import torch

from qcomm.checkpoint.checkpoint import _to_device


def test_qcomm_state_is_moved_to_the_parameters_device() -> None:
    """Checkpoints load on the CPU; qcomm's own state follows the parameters (here to the
    meta device, the one other device every machine has), nested containers kept."""
    state = {"a": torch.ones(2), "b": [torch.zeros(1), (3, torch.ones(1))], "c": "x",
             "d": None}
    moved = _to_device(state, torch.device("meta"))
    assert moved["a"].is_meta and moved["b"][0].is_meta and moved["b"][1][1].is_meta
    assert isinstance(moved["b"][1], tuple) and moved["b"][1][0] == 3
    assert moved["c"] == "x" and moved["d"] is None
    assert state["a"].device.type == "cpu"  # the input is not changed
