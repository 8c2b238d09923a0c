"""What one gossip round costs a member on its own host: the in-process simulator's round loop,
timed, and the host reads (values copied from a tensor into Python) per round and member.

    python bench/gossip_round.py [--sizes 64K,1M] [--bits 4] [--members 4] [--rounds 10]
    python bench/gossip_round.py --count-reads        # host reads per round, no timing
    python bench/gossip_round.py --qcomm OTHER_CHECKOUT   # the same loop on another version

``members`` gossip members on a ring, in one process
(:class:`~qcomm.collectives.memory.GossipSimulator` for the bounded-staleness mode,
:class:`~qcomm.collectives.memory.WaitFreeSimulator` for the wait-free one) run
``rounds`` rounds; the figure is the median time (wall, or the process's CPU time with
``--clock cpu``) of one round of all the members, divided by ``members``, over ``repeat``
loops. A host read on an accelerator waits for the device (a
host sync); on CPU it is cheap, but the count says what the same loop would cost there.
Reads are counted as ``aten._local_scalar_dense`` calls (``item``, ``bool``, ``float``,
``int`` of a tensor) plus ``Tensor.tolist`` calls, during ``rounds`` rounds after a warm-up.
For a before/after comparison, run it alternately with and without ``--qcomm`` (one process
each: both versions are the package ``qcomm``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("choco", "wait-free")


def _simulator(mode: str, members: int, numel: int, bits: int) -> Any:
    """The step function of a simulator (one round of every member)."""
    from qcomm.collectives.memory import GossipSimulator, WaitFreeSimulator
    from qcomm.compress import QuantSpec

    spec = QuantSpec(bits, 128, "stochastic")
    if mode == "choco":
        return GossipSimulator(members, numel, spec=spec, staleness=1).step
    return WaitFreeSimulator(members, numel, spec=spec, staleness=1).tick


class _Reads:
    """Counts host reads while active (see the module docstring)."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.count = 0
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> _Reads:
        import torch

        tolist = self._tolist

        def counted(t: Any) -> Any:
            self.count += 1
            return tolist(t)

        torch.Tensor.tolist = counted
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


def run(mode: str, members: int, numel: int, bits: int, rounds: int, repeat: int,
        count_reads: bool, clock: str = "wall") -> dict:
    """Median seconds per member-round (or host reads per member-round)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    step = _simulator(mode, members, numel, bits)
    xs = [torch.randn(numel, generator=gen) for _ in range(members)]
    for _ in range(3):  # buffers, the first rounds in flight
        step(xs)
    if count_reads:
        with _Reads() as reads:
            for _ in range(rounds):
                step(xs)
        return {"mode": mode, "numel": numel, "reads_per_round": reads.count / rounds / members}
    now = time.perf_counter if clock == "wall" else time.process_time
    times = []
    for _ in range(repeat):
        t0 = now()
        for _ in range(rounds):
            step(xs)
        times.append((now() - t0) / rounds / members)
    return {"mode": mode, "numel": numel, "round_s": statistics.median(times), "times_s": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Time of one gossip round per member in the in-process simulator, and the "
                    "host reads it makes per round (each a host sync on an accelerator).")
    ap.add_argument("--sizes", default="64K,1M",
                    help="comma list of floats per member, with K/M suffixes (default 64K,1M).")
    ap.add_argument("--bits", type=int, default=4, help="code width (default 4).")
    ap.add_argument("--members", type=int, default=4, help="members on the ring (default 4).")
    ap.add_argument("--rounds", type=int, default=10,
                    help="rounds per timed loop (default 10).")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed loops per size; the median is reported (default 5).")
    ap.add_argument("--modes", default="choco,wait-free",
                    help="comma list of gossip modes: choco (bounded staleness) and/or "
                         "wait-free (default both).")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's own choice).")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time, less disturbed by "
                         "other processes on a busy machine (use with --threads 1).")
    ap.add_argument("--count-reads", action="store_true",
                    help="count host reads per round and member instead of timing.")
    ap.add_argument("--qcomm", default=None,
                    help="a checkout whose qcomm package runs instead of this one's (for "
                         "before/after comparisons).")
    args = ap.parse_args(argv)
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    from bench.common import use_qcomm_from

    use_qcomm_from(args.qcomm)
    import torch

    from bench.common import parse_list, parse_size

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = parse_list(args.sizes, parse_size, "--sizes")
    modes = parse_list(args.modes, str, "--modes")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes must be among {MODES}, got {bad}")
    import qcomm

    print(f"# qcomm from {Path(qcomm.__file__).resolve().parent.parent}")
    for mode in modes:
        for numel in sizes:
            r = run(mode, args.members, numel, args.bits, args.rounds, args.repeat,
                    args.count_reads, args.clock)
            if args.count_reads:
                print(f"{mode:9s} numel {numel:>8d}: {r['reads_per_round']:.2f} host reads "
                      f"per round and member")
            else:
                spread = ", ".join(f"{t * 1e3:.2f}" for t in r["times_s"])
                print(f"{mode:9s} numel {numel:>8d}: {r['round_s'] * 1e3:.3f} ms per round "
                      f"and member (loops: {spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
