"""The gossip's bits pinned: two seeded simulated runs (lockstep with the slow-link setting's
gossip; wait-free with a member at half speed, messages three ticks late and stochastic 4-bit
rounding) hash to the value both gave before the engine, the gossip's settings and its
membership were reshaped (commit 64b2c37) and after. A change of this hash is a change of
behaviour: say so in the changelog, or find the cause.

The runs go in a subprocess on one thread with torch's portable CPU kernels
(``ATEN_CPU_CAPABILITY=default``) and MKL's portable code path (``MKL_CBWR=COMPATIBLE``): the
vectorized ones round sums differently on AVX2 and AVX-512 machines, and MKL takes its own
AVX2/AVX-512 path on Intel CPUs only (the bits of an Intel Xeon differed from an AMD EPYC's
without it); the pinned bits must hold on any of them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import torch

from qcomm.collectives.gossip.choco import CompressedGossip
from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
from qcomm.compress import QuantSpec

PINNED = "b7e227f3da814a867a1aee977bae573880a0482542966dd4565b1923ff1bf7cd"
SLOW = dict(spec=QuantSpec(2, 128, "nearest"), gamma=0.8, staleness=1, fragments=4,
            round_period=4, outer_momentum=0.9, outer_lr=0.5)
N, NUMEL = 4, 1024


def _targets() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(NUMEL, generator=g) for _ in range(N)]


def _lockstep(targets: list[torch.Tensor]) -> torch.Tensor:
    clock = {"t": 0}
    world = MemoryWorld(N, clock=lambda: float(clock["t"]))
    ranks = list(range(N))
    members = [CompressedGossip(ranks, world.group(ranks, i), NUMEL, **SLOW) for i in ranks]
    xs = [torch.zeros(NUMEL) for _ in ranks]
    for t in range(64):
        for m, x, c in zip(members, xs, targets, strict=True):
            m.prepare()
            x.sub_(0.05 * (x - c))
            m.end_step(x)
        clock["t"] = t + 1
    return torch.stack(xs)


def _wait_free(targets: list[torch.Tensor]) -> torch.Tensor:
    periods = [1, 1, 1, 2]
    sim = WaitFreeSimulator(N, NUMEL, periods=periods, delay=3,
                            **{**SLOW, "spec": QuantSpec(4, 128, "stochastic")})
    xs = [torch.zeros(NUMEL) for _ in range(N)]
    for tick in range(96):
        for i, (m, x, c) in enumerate(zip(sim.members, xs, targets, strict=True)):
            if tick % periods[i] or sim._blocked(i):
                continue
            m.prepare()
            x.sub_(0.05 * (x - c))
            m.end_step(x)
        sim.now = float(tick + 1)
    return torch.stack(xs)


def digest() -> str:
    """The SHA-256 of both runs' final parameters (float32 ``[4, 1024]`` each)."""
    targets = _targets()
    h = hashlib.sha256()
    for run in (_lockstep(targets), _wait_free(targets)):
        assert torch.isfinite(run).all()
        h.update(run.numpy().tobytes())
    return h.hexdigest()


def test_seeded_simulated_runs_give_the_pinned_bits() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    code = ("import torch; torch.set_num_threads(1); "
            "from tests.collectives.test_same_bits import digest; print(digest())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=240, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == PINNED
