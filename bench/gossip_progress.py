"""Which makes gossip progress better while the caller computes: Gloo non-blocking point-to-point
ops posted from the caller's thread, or a communication thread on its own process group?

    python bench/gossip_progress.py [--procs 3] [--numel 1000000]
        [--compute-ms 20] [--steps 30] [--staleness 1]

Each of ``procs`` local processes (one per node, Gloo over loopback) runs ``steps`` gossip steps
(4 bits, ring) on ``numel`` floats, with a fake compute phase (``time.sleep``, which frees the
CPU and the GIL, like a GPU kernel would) between steps, in three modes: ``compute-only``
(the floor), ``nonblocking`` (what :class:`~.choco.CompressedGossip` does) and ``thread`` (the
same exchange handed to a worker thread that posts it on a group of its own and waits on it).
Prints the median time per step of each, and the part of it spent blocked waiting for a
round (what progress during the compute phase should bring to zero), from rank 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import torch
import torch.distributed as dist

from qcomm.collectives.gloo.transport import GlooTransport
from qcomm.collectives.gossip.choco import CompressedGossip
from qcomm.collectives.links import RoundHandle, Transport
from qcomm.compress import QuantSpec

WARMUP_STEPS = 3  # steps of each mode not timed (connections, first allocations)


class _FutureRound(RoundHandle):
    def __init__(self, round: int, fut: concurrent.futures.Future):
        self.round, self._fut = round, fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def wait(self, timeout_s: float) -> None:
        self._fut.result(timeout=timeout_s)


class _TimedTransport(Transport):
    """Adds the seconds spent blocked in ``RoundHandle.wait`` to ``waited``."""

    def __init__(self, inner: Transport):
        self.inner, self.waited = inner, 0.0
        self.member, self.size = inner.member, inner.size
        self.peers, self.peer_ranks = inner.peers, inner.peer_ranks

    def exchange(self, round: int, payload: torch.Tensor, recv: torch.Tensor) -> RoundHandle:
        handle, owner = self.inner.exchange(round, payload, recv), self

        class Timed(RoundHandle):
            def is_completed(self) -> bool:
                return handle.is_completed()

            def wait(self, timeout_s: float) -> None:
                t0 = time.perf_counter()
                handle.wait(timeout_s)
                owner.waited += time.perf_counter() - t0

        return Timed()

    def close(self) -> None:
        self.inner.close()


class ThreadTransport(Transport):
    """A GlooTransport driven by one worker thread (benchmark only)."""

    def __init__(self, inner: GlooTransport, timeout_s: float):
        self.inner, self.timeout_s = inner, timeout_s
        self.member, self.size = inner.member, inner.size
        self.peers, self.peer_ranks = inner.peers, inner.peer_ranks
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gossip-comm")

    def exchange(self, round: int, payload: torch.Tensor, recv: torch.Tensor) -> RoundHandle:
        def run() -> None:
            self.inner.exchange(round, payload, recv).wait(self.timeout_s)
        return _FutureRound(round, self._pool.submit(run))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _body(rank: int, world: int, numel: int, compute_ms: float, steps: int,
          staleness: int) -> dict[str, float]:
    torch.manual_seed(rank)
    ranks = list(range(world))
    comm_group = dist.new_group(ranks)  # collective: every rank, same point
    out: dict[str, float] = {}
    for mode in ("compute-only", "nonblocking", "thread", "nonblocking-again"):
        x = torch.randn(numel)
        kw = dict(spec=QuantSpec(4, 128, "stochastic"), staleness=staleness, gamma=0.2,
                  timeout_s=120.0)
        if mode == "thread":
            g = CompressedGossip(ranks, comm_group, numel, **kw)
            g.transport = ThreadTransport(g.transport, 120.0)
        else:
            g = CompressedGossip(ranks, None, numel, **kw)
        g.transport = timed = _TimedTransport(g.transport)
        dist.barrier()
        times, waits = [], []
        for _ in range(steps):
            t0, w0 = time.perf_counter(), timed.waited
            time.sleep(compute_ms / 1e3)
            if mode != "compute-only":
                g.step(x)
            times.append(time.perf_counter() - t0)
            waits.append(timed.waited - w0)
        g.flush()
        g.close()
        out[mode] = (statistics.median(times[WARMUP_STEPS:]) * 1e3,
                     statistics.median(waits[WARMUP_STEPS:]) * 1e3)
    return out


def main() -> None:
    from qcomm.testing.multiprocess import run_world

    ap = argparse.ArgumentParser(
        description="Which makes gossip progress better while the caller computes: Gloo "
                    "non-blocking point-to-point operations posted from the caller's thread, or "
                    "a communication thread on a process group of its own? Prints, from rank 0, "
                    "the median time per step of each mode and how much of it was spent waiting "
                    "for a round.")
    ap.add_argument("--procs", type=int, default=3,
                    help="Local processes, one per emulated node (default 3).")
    ap.add_argument("--numel", type=int, default=1_000_000,
                    help="Floats each process gossips (default 1000000).")
    ap.add_argument("--compute-ms", type=float, default=20.0,
                    help="The compute phase between steps, a sleep of this many milliseconds "
                         "(default 20).")
    ap.add_argument("--steps", type=int, default=30,
                    help=f"Gossip steps per mode, > {WARMUP_STEPS} (the first {WARMUP_STEPS} "
                         "are not timed; default 30).")
    ap.add_argument("--staleness", type=int, default=1,
                    help="Rounds in flight (default 1).")
    a = ap.parse_args()
    if a.steps <= WARMUP_STEPS or a.procs < 2 or a.numel < 1 or a.compute_ms < 0:
        ap.error(f"--steps must be > {WARMUP_STEPS}, --procs >= 2, --numel >= 1 and "
                 f"--compute-ms >= 0, got {a.steps}, {a.procs}, {a.numel}, {a.compute_ms}")
    res = run_world(_body, a.procs, args=(a.numel, a.compute_ms, a.steps, a.staleness),
                    timeout_s=600)
    print(f"torch {torch.__version__}, {a.procs} procs, numel {a.numel}, compute "
          f"{a.compute_ms} ms, staleness {a.staleness}: median ms per step, and of it blocked "
          f"waiting for the round (rank 0)")
    for mode, (ms, wait_ms) in res[0].items():
        print(f"  {mode:18s} {ms:8.1f} {wait_ms:8.2f}")


if __name__ == "__main__":
    main()
