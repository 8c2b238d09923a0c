"""The attached model's buffers: after ``average_parameters()`` every rank holds the same
parameters and the same buffers (floating ones the exact mean over every rank, integer ones the
maximum), so ``eval()`` gives the same outputs everywhere; inside a node they agree after every
step; a model whose buffers differ between ranks is refused on every rank; a resume continues
bit for bit with its buffers. Processes over Gloo (2x1, 2x2, a lost node at 3x1)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from qcomm.sgd import ASSGD, HierarchicalOptimizer, load_checkpoint, save_checkpoint
from qcomm.testing.multiprocess import run_world

STEPS = 30
PROBE = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))


def _model(seed: int = 0, *, extra: torch.Tensor | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if extra is not None:
        model.register_buffer("extra", extra)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    # Each rank's inputs have their own offset and scale: their statistics differ.
    x = torch.randn(16, 8, generator=gen) * (1 + rank) + rank
    return x, torch.randint(0, 3, (16,), generator=gen)


def _train(model, opt, rank: int, steps: range, forward=None) -> None:
    forward = forward or model
    model.train()
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _probe_body(rank: int, world: int, ppn: int, how: str, adamw: bool) -> dict:
    torch.set_num_threads(1)
    model = _model()
    kw = dict(procs_per_node=ppn, bits=4)
    opt = (HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **kw)
           if adamw else ASSGD(model.parameters(), lr=0.05, momentum=0.9, **kw))
    forward = model
    if how == "attach":
        assert opt.attach(model) is model
    elif how == "ddp":
        forward = opt.data_parallel(model)
    _train(model, opt, rank, range(STEPS), forward)
    before = _buffers(model)
    opt.average_parameters()
    model.eval()
    with torch.no_grad():
        out = model(PROBE)
    res = {"before": before, "after": _buffers(model), "out": out,
           "params": [p.detach().clone() for p in model.parameters()]}
    opt.close()
    return res


def _exact_mean(values: list[torch.Tensor]) -> torch.Tensor:
    return (torch.stack([v.double() for v in values]).sum(0) / len(values)).to(values[0].dtype)


@pytest.mark.parametrize(("nodes", "ppn", "how", "adamw"), [
    (2, 1, "attach", False), (2, 2, "attach", False), (2, 2, "ddp", False),
    (2, 2, "attach", True)], ids=["2x1-attach", "2x2-attach", "2x2-ddp", "2x2-attach-adamw"])
def test_after_the_average_every_rank_holds_the_same_buffers(gloo, nodes, ppn, how,
                                                             adamw) -> None:
    res = gloo.run(_probe_body, nodes * ppn, args=(ppn, how, adamw))
    first = res[0]
    for r in res:
        for a, b in zip(r["params"], first["params"], strict=True):
            assert torch.equal(a, b)
        for name, value in r["after"].items():
            assert torch.equal(value, first["after"][name]), name
        assert torch.equal(r["out"], first["out"])   # eval() agrees to the last bit
    # floating buffers: the exact mean over every rank; the batch counter: the maximum
    for name in ("1.running_mean", "1.running_var"):
        expected = _exact_mean([r["before"][name] for r in res])
        assert torch.equal(first["after"][name], expected), name
    assert int(first["after"]["1.num_batches_tracked"]) == STEPS
    # the ranks trained on different data: their statistics did differ
    assert not torch.equal(res[0]["before"]["1.running_mean"],
                           res[-1]["before"]["1.running_mean"])
    if how == "attach" and ppn > 1:
        # inside a node the buffers agreed after every step, so before the average too
        for node in range(nodes):
            a, b = res[node * ppn], res[node * ppn + 1]
            assert all(torch.equal(a["before"][k], b["before"][k]) for k in a["before"])


def test_without_an_attached_model_buffers_stay_each_ranks_own(gloo) -> None:
    """What the docstring of average_parameters says: parameters agree, buffers do not."""
    res = gloo.run(_probe_body, 2, args=(1, "none", False))
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"],
                                                 strict=True))
    assert not torch.equal(res[0]["after"]["1.running_mean"], res[1]["after"]["1.running_mean"])
    assert not torch.equal(res[0]["out"], res[1]["out"])


def _constant_body(rank: int, world: int) -> dict:
    """A model without any buffer, and one whose buffer is the same constant everywhere."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 3)
    const = torch.nn.Linear(8, 3)
    const.register_buffer("scale", torch.full((5,), 0.1))   # 0.1 is not exact in binary
    out = {}
    for name, model in (("plain", plain), ("const", const)):
        opt = ASSGD(model.parameters(), lr=0.1, procs_per_node=1)
        opt.attach(model)
        for step in range(3):
            x, _ = _batch(rank, step)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        opt.average_parameters()
        out[name] = _buffers(model)
        opt.close()
    return out


def test_a_model_without_buffers_and_a_constant_buffer(gloo) -> None:
    res = gloo.run(_constant_body, 3)
    for r in res:
        assert r["plain"] == {}
        # the mean of three equal values is that value, bit for bit (sums in float64)
        assert torch.equal(r["const"]["scale"], torch.full((5,), 0.1))


_EXTRA = {  # rank 1's extra buffer, where rank 0 has torch.zeros(2) (or none: "extra")
    "extra": torch.zeros(2), "dtype": torch.zeros(2, dtype=torch.float64),
    "shape": torch.zeros(3), "attach-one": torch.zeros(2)}


def _mismatch_body(rank: int, world: int, kind: str) -> str:
    torch.set_num_threads(1)
    mine = _EXTRA[kind] if rank == 1 else (None if kind == "extra" else torch.zeros(2))
    model = _model(extra=mine)
    opt = ASSGD(model.parameters(), lr=0.05, procs_per_node=1)
    if kind != "attach-one" or rank == 0:
        opt.attach(model)
    try:
        _train(model, opt, rank, range(1))
    except ValueError as exc:
        return str(exc)
    finally:
        opt.close()
    return "trained"


@pytest.mark.parametrize(("kind", "field"), [
    ("extra", "attached model's buffers"), ("dtype", "buffer names, shapes and dtypes"),
    ("shape", "buffer names, shapes and dtypes"), ("attach-one", "attached model's buffers")])
def test_buffers_that_differ_between_ranks_are_refused_on_every_rank(gloo, kind,
                                                                     field) -> None:
    res = gloo.run(_mismatch_body, 2, args=(kind,))
    for message in res:
        assert f"ranks disagree on {field}" in message, message


def test_attach_refuses_a_model_of_other_parameters_and_a_late_call() -> None:
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="none of its parameters is this optimizer's"):
        opt.attach(_model())
    with pytest.raises(TypeError, match="model"):
        opt.attach(object())


def _resume_body(rank: int, world: int, directory: str) -> dict:
    torch.set_num_threads(1)
    kw = dict(lr=0.05, momentum=0.9, procs_per_node=1, bits=4, seed=3)
    full = _model()
    opt = ASSGD(full.parameters(), **kw)
    opt.attach(full)
    _train(full, opt, rank, range(5))
    save_checkpoint(directory, opt, full)
    _train(full, opt, rank, range(5, 10))
    opt.average_parameters()
    opt.close()
    resumed = _model(seed=9)
    opt2 = ASSGD(resumed.parameters(), **kw)
    opt2.attach(resumed)
    load_checkpoint(directory, opt2, resumed)
    _train(resumed, opt2, rank, range(5, 10))
    opt2.average_parameters()
    opt2.close()
    return {"same": all(torch.equal(a, b) for a, b in zip(full.state_dict().values(),
                                                          resumed.state_dict().values(),
                                                          strict=True))}


def test_a_resumed_run_continues_bit_exact_with_its_buffers(gloo, tmp_path) -> None:
    res = gloo.run(_resume_body, 2, args=(str(tmp_path),))
    assert all(r["same"] for r in res), res


def _lost_body(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, procs_per_node=1, wait_free=True,
                on_peer_loss="continue", timeout_s=20)
    opt.attach(model)
    for step in range(STEPS):
        if rank == 1 and step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        _train(model, opt, rank, range(step, step + 1))
    before = _buffers(model)
    opt.average_parameters()
    live = opt.stats()["live_nodes"]
    opt.close()
    return {"before": before, "after": _buffers(model), "live": live}


def test_a_lost_node_leaves_the_survivors_with_the_mean_of_their_buffers() -> None:
    res = run_world(_lost_body, 3, timeout_s=120, allow_exit={1})
    survivors = [res[0], res[2]]
    for r in survivors:
        assert r["live"] == 2
        assert all(torch.equal(r["after"][k], survivors[0]["after"][k]) for k in r["after"])
    for name in ("1.running_mean", "1.running_var"):
        assert torch.equal(survivors[0]["after"][name],
                           _exact_mean([r["before"][name] for r in survivors]))

