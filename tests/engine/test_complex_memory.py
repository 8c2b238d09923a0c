"""Complex parameters across nodes (ranks as threads): a complex parameter is communicated as its
real view, two floats per value, so a run with complex parameters is, bit for bit, the run of
their real views, and the nodes' average is the average of the real views."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.sgd import ASSGD, HierarchicalOptimizer

STEPS = 12


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s complex least-squares data ``(a [8, 6], b [8, 3])``."""
    gen = torch.Generator().manual_seed(100 + rank)
    a = torch.randn(8, 6, dtype=torch.complex64, generator=gen)
    return a, torch.randn(8, 3, dtype=torch.complex64, generator=gen)


def _loss(weight: torch.Tensor, bias: torch.Tensor, rank: int) -> torch.Tensor:
    """A real loss of a complex weight [6, 3] and a real bias [3]."""
    a, b = _data(rank)
    return (a @ weight + bias - b).abs().square().mean()


def _initial() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (0.3 * torch.randn(6, 3, dtype=torch.complex64, generator=gen),
            0.3 * torch.randn(3, generator=gen))


def _optimizer(name: str, params: list[torch.Tensor], layout: Topology) -> torch.optim.Optimizer:
    comm = dict(layout=layout, procs_per_node=2, bits=4, staleness=1, seed=3)
    if name == "assgd":
        return ASSGD(params, lr=0.05, momentum=0.9, **comm)
    return HierarchicalOptimizer(torch.optim.Adam(params, lr=0.01), **comm)


def _run(world: MemoryWorld, rank: int, name: str, as_real: bool) -> dict:
    """STEPS steps on ``rank`` with the complex weight as a complex parameter, or (``as_real``)
    as its real view [6, 3, 2] with the gradient's real view."""
    torch.set_num_threads(1)
    w0, b0 = _initial()
    weight = torch.nn.Parameter(torch.view_as_real(w0).clone() if as_real else w0.clone())
    bias = torch.nn.Parameter(b0.clone())
    layout = Topology(2, rank=rank, world_size=world.world_size, world=world)
    opt = _optimizer(name, [weight, bias], layout)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        if as_real:
            # The same complex gradient as the complex run's, laid out as its real view.
            w = torch.view_as_complex(weight.detach()).requires_grad_()
            b = bias.detach().requires_grad_()
            loss = _loss(w, b, rank)
            loss.backward()
            weight.grad, bias.grad = torch.view_as_real(w.grad).clone(), b.grad
        else:
            loss = _loss(weight, bias, rank)
            loss.backward()
        losses.append(loss.item())
        opt.step()
    trained = [torch.view_as_real(weight.detach()).clone() if weight.is_complex()
               else weight.detach().clone(), bias.detach().clone()]
    opt.average_parameters()
    averaged = [torch.view_as_real(weight.detach()).clone() if weight.is_complex()
                else weight.detach().clone(), bias.detach().clone()]
    inter = opt.stats()["bytes_sent"]["inter"]
    opt.close()
    return {"trained": trained, "averaged": averaged, "losses": losses, "inter": inter}


def _runs(name: str, as_real: bool) -> list[dict]:
    threads = torch.get_num_threads()
    try:
        world = MemoryWorld(4, timeout_s=60)
        return world.run(lambda r: _run(world, r, name, as_real))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["assgd", "adam"])
def test_complex_parameters_train_and_average_to_the_mean_of_their_real_views(
        name: str) -> None:
    runs = _runs(name, as_real=False)
    for run in runs:
        assert run["inter"] > 0  # the gossip ran
        assert run["losses"][-1] < 0.8 * run["losses"][0]  # and the complex parameter trained
    # the nodes differ before averaging; after it every rank holds exactly the mean of the
    # nodes' real views (2 nodes: one sum and one halving, each rounded once, in float32)
    node0, node1 = runs[0]["trained"], runs[2]["trained"]
    assert not torch.equal(node0[0], node1[0])
    mean = [(x + y) / 2 for x, y in zip(node0, node1, strict=True)]
    for run in runs:
        for got, want in zip(run["averaged"], mean, strict=True):
            assert torch.equal(got, want)


def test_a_complex_run_is_the_run_of_its_real_views() -> None:
    """Adam updates a complex parameter through its real view, so with the communication
    seeing the same floats, the two runs are one, bit for bit. (SGD's momentum multiplies
    complex numbers as such: a few ulps from the real view's, torch's rounding, not ours.)"""
    complex_runs, real_runs = _runs("adam", as_real=False), _runs("adam", as_real=True)
    for c, r in zip(complex_runs, real_runs, strict=True):
        assert c["losses"] == r["losses"] and c["inter"] == r["inter"] > 0
        for x, y in zip(c["trained"] + c["averaged"], r["trained"] + r["averaged"], strict=True):
            assert torch.equal(x, y)
