"""ASSGD's bits pinned as processes: two ranks over Gloo on localhost (two nodes of one rank),
the slow-link gossip in lockstep, seeded, 48 steps; the SHA-256 of both ranks' final parameters.
A change of it is a change of behaviour: say so in the changelog, or find the cause.

Run in a subprocess on one thread with torch's portable CPU kernels
(``ATEN_CPU_CAPABILITY=default``) and MKL's portable code path (``MKL_CBWR=COMPATIBLE``), and
the model's layers computed without BLAS (:class:`_Affine`), so the bits hold on AVX2 and
AVX-512 machines, Intel's and AMD's, alike. (The pin before that last change, taken on AMD
EPYC machines, was another value on an Intel Xeon whatever MKL was told; this one is the same
under every ``MKL_CBWR`` path there, and was the same before and after the public codec moved
its overflow check into the kernel.)"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PINNED = "3eeb4ec07aea9cb31be8389d150534acf4d3eac46fff27e22fabb12e7e0a2819"
REPO = Path(__file__).resolve().parents[2]


class _Affine(torch.nn.Linear):
    """``torch.nn.Linear`` (its parameters, its initialization) computed without BLAS, as a
    broadcast product and a sum: MKL's matrix products round differently on Intel and AMD CPUs
    whatever ``MKL_CBWR`` says, ATen's portable kernels do not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-2) * self.weight).sum(-1) + self.bias


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    from qcomm.sgd import ASSGD

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Affine(20, 64), torch.nn.ReLU(), _Affine(64, 3))
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, bits=2, sync_every=16, fragments=4,
                gamma=0.8, rounding="nearest", outer_momentum=0.9, outer_lr=0.5,
                procs_per_node=1, timeout_s=60)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(256, 20, generator=g), torch.randint(0, 3, (256,), generator=g)
    for step in range(48):
        idx = torch.arange(step * 16, step * 16 + 16) % 256
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    opt.flush()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out.put((rank, flat.numpy().tobytes()))
    opt.close()
    dist.destroy_process_group()


def digest() -> str:
    """Run both ranks; the SHA-256 of rank 0's then rank 1's final parameters (float32)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(60)
    h = hashlib.sha256()
    for r in (0, 1):
        h.update(got[r])
    return h.hexdigest()


def test_a_seeded_two_process_run_gives_the_pinned_bits() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    run = subprocess.run([sys.executable, "-m", "tests.sgd.test_same_bits"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == PINNED


if __name__ == "__main__":
    print(digest(), flush=True)
