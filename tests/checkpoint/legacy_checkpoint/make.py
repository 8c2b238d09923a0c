"""Writes the checkpoints of this folder: 2 nodes x 1 rank, ASSGD with momentum and 4-bit
lockstep gossip (a round in flight), saved at step 5.

``plain/`` holds only plain data; ``fraction/`` has ``extra=Fraction(1, 3)``, an object torch's
safe loader refuses. They were written by qcomm 0.1.0 before checkpoints had a metadata record
(commit 205fd4e):
``PYTHONPATH=<that checkout> python tests/checkpoint/legacy_checkpoint/make.py``.
Run with today's code, this writes today's format, which is not what the files are kept for.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STEPS = 5
OPTIONS = dict(lr=0.05, momentum=0.9, bits=4, procs_per_node=1, staleness=1, seed=3)


def model() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return net


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def _write(rank: int, world: int) -> None:
    from qcomm.sgd import ASSGD, save_checkpoint

    for name, extra in (("plain", {"step": STEPS}), ("fraction", Fraction(1, 3))):
        net = model()
        opt = ASSGD(net.parameters(), **OPTIONS)
        train(net, opt, rank, range(STEPS))
        save_checkpoint(HERE / name, opt, net, extra=extra)
        opt.close()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[2]))
    from qcomm.testing.multiprocess import run_world

    run_world(_write, 2)
