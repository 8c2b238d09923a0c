"""Training problems shared by the engine and optimizer tests."""

from __future__ import annotations

import torch

DIM, ROWS = 24, 6


def realizable_problem(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s least-squares data ``(a, b, w_star)``, float64, with ``b = a @ w_star``.

    The rows of all ranks together are an orthogonal basis (times 4) of R^DIM, so the global
    problem has the unique minimum ``w_star`` and perfect conditioning, while a node of fewer
    than DIM / ROWS ranks sees only a subspace: alone it stops at its own projection of
    ``w_star`` (:func:`node_alone_gap` away). Realizable on purpose: every rank's gradient
    vanishes at ``w_star``, so it is also the fixed point of local adaptive optimizers (AdamW)
    averaged by gossip. With optima that differ between nodes, local AdamW plus averaging
    settles elsewhere (its fixed point weighs each node's gradient by its own second-moment
    estimate), a property of the algorithm, not of the communication.
    """
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(DIM, DIM, generator=gen, dtype=torch.float64))
    w_star = 1.0 + torch.randn(DIM, generator=torch.Generator().manual_seed(99),
                               dtype=torch.float64)
    a = 4.0 * q[rank * ROWS:(rank + 1) * ROWS]
    return a, a @ w_star, w_star


def node_alone_gap(ranks: range) -> float:
    """Relative distance to ``w_star`` of the minimum-norm solution of the ranks' data alone."""
    a = torch.cat([realizable_problem(r)[0] for r in ranks])
    b = torch.cat([realizable_problem(r)[1] for r in ranks])
    w_star = realizable_problem(0)[2]
    return float((torch.linalg.pinv(a) @ b - w_star).norm() / w_star.norm())


def mlp(seed: int) -> torch.nn.Module:
    """A 6-8-2 MLP whose weights come from ``seed`` alone (a private generator: ranks that run
    as threads share torch's global one)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
    return model


def mlp_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)
