"""Writes ``legacy_v1/``: per-rank ASSGD checkpoints in state format 1 (saved by qcomm 0.1.0's
ASSGD, 2 nodes x 2 ranks, step 7, gossip rounds in flight) and the parameters every rank held
after 7 more steps. ``tests/sgd/test_legacy_checkpoint.py`` loads them with today's code and
checks that training continues bit for bit.

    python tests/sgd/data/make_legacy_checkpoint.py   # rewrites legacy_v1/ (needs format 1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

KW = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3, bits=4, procs_per_node=2,
          staleness=2, seed=11)


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss(model, rank, step).backward()
        opt.step()


def body(rank: int, world: int, directory: str) -> list:
    import torch.distributed as dist

    from qcomm.sgd import ASSGD, save_checkpoint

    model = mlp(0)
    opt = ASSGD(model.parameters(), **KW)
    train(model, opt, rank, range(0, 7))
    dist.barrier()
    save_checkpoint(directory, opt, model, extra={"step": 7})
    train(model, opt, rank, range(7, 14))
    opt.close()
    return [p.detach().clone().numpy() for p in model.parameters()]


if __name__ == "__main__":
    from qcomm.testing.multiprocess import run_world

    out = HERE / "legacy_v1"
    out.mkdir(exist_ok=True)
    finals = run_world(body, 4, args=(str(out),), timeout_s=120)
    torch.save([[torch.from_numpy(a) for a in r] for r in finals], out / "final_params.pt")
    print(f"wrote {sorted(p.name for p in out.iterdir())}")
