"""Checkpoints written by qcomm 0.1.0's ASSGD (state format 1) still load, and training goes on
bit for bit: the files in data/legacy_v1 were saved at step 7 of a 2 x 2 run with gossip rounds
in flight, together with every rank's parameters after 7 more steps of that old code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.sgd.data.make_legacy_checkpoint import KW, loss, mlp, train

DATA = Path(__file__).resolve().parent / "data"


def _resume_body(rank: int, world: int, directory: str) -> list:
    from qcomm.sgd import ASSGD, load_checkpoint

    model = mlp(123)  # different start: everything must come from the checkpoint
    opt = ASSGD(model.parameters(), **KW)
    extra = load_checkpoint(directory, opt, model)
    assert extra == {"step": 7}
    assert opt.stats()["steps"] == 7
    train(model, opt, rank, range(7, 14))
    opt.close()
    return [p.detach().clone().numpy() for p in model.parameters()]


def test_format_1_checkpoint_resumes_bit_exact(gloo) -> None:
    expected = torch.load(DATA / "legacy_v1" / "final_params.pt")
    got = gloo.run(_resume_body, 4, args=(str(DATA / "legacy_v1"),))
    for rank, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(torch.from_numpy(a), b), f"rank {rank} differs"


def test_format_1_state_loads_into_a_single_process_with_reinit() -> None:
    from qcomm.sgd import ASSGD

    state = torch.load(DATA / "legacy_v1" / "rank00000.pt", weights_only=False)
    model = mlp(0)
    opt = ASSGD(model.parameters(), **KW)
    with pytest.warns(UserWarning, match="world size changed from 4 to 1"):
        opt.load_state_dict(state["optimizer"], on_world_size_change="reinit")
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    assert opt.stats()["steps"] == 7
    opt.zero_grad()
    loss(model, 0, 0).backward()
    opt.step()
