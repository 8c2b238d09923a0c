"""Host time per call of ``qcomm.compress``'s public API around its kernel.

    python bench/api_overhead.py                   # this checkout
    python bench/api_overhead.py --qcomm OTHER     # another version, same figures

The codec's backend is replaced by one that does nothing (a guarded accumulate's verdict is set
True), so what is timed is what a call costs the host besides its kernel: the argument checks,
the views, the device ops of the checks and the result objects. On a GPU that cost is paid per
call whatever the kernel's size, and it is most of the time of a call on a small bucket (the
per-call target of ``bench/kernels.py``: under 20 us at 1M elements). CPU tensors of
``--numel`` float32 (4-bit stochastic codes, blocks of 128), one thread; each figure is the
median over ``--loops`` loops of ``--calls`` calls, the fastest and slowest loop beside it. For
a before/after comparison run both versions in turn (one process each: both are the package
``qcomm``), in one sweep on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

CALLS = ("quantize", "quantize non_blocking", "quantize in place non_blocking",
         "dequant_accumulate", "dequant_accumulate weights non_blocking")


class _NoKernels:
    """A codec backend that launches nothing."""

    def quantize_into(self, *args: object) -> None:
        pass

    def dequantize_into(self, *args: object) -> None:
        pass

    def dequant_accumulate_into(self, payloads, spec, out, weights, guard=None) -> None:
        verdict = getattr(guard, "verdict", None)  # a backend records its verdict
        if verdict is not None:
            verdict.fill_(True)


def _calls(compress, torch, numel: int) -> dict:
    spec = compress.QuantSpec(4, 128, "stochastic")
    x, error, error_out = torch.randn(numel), torch.zeros(numel), torch.empty(numel)
    nbytes = compress.packed_nbytes(numel, spec)
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    payloads, out = torch.zeros(4, nbytes, dtype=torch.uint8), torch.zeros(numel)
    weights = [0.25] * 4
    q = compress.quantize
    return dict(zip(CALLS, (
        lambda: q(x, spec, error=error, error_out=error_out, seed=1, out=payload),
        lambda: q(x, spec, error=error, error_out=error_out, seed=1, out=payload,
                  non_blocking=True),
        lambda: q(x, spec, error=error, seed=1, out=payload, non_blocking=True),
        lambda: compress.dequant_accumulate(payloads, out, spec),
        lambda: compress.dequant_accumulate(payloads, out, spec, weights, non_blocking=True),
    ), strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Host time per call of qcomm.compress's API with a backend that does "
                    "nothing.")
    ap.add_argument("--numel", type=int, default=4096, help="floats per call (default 4096).")
    ap.add_argument("--calls", type=int, default=2000, help="calls per loop (default 2000).")
    ap.add_argument("--loops", type=int, default=7, help="timed loops (default 7).")
    ap.add_argument("--qcomm", default=None,
                    help="a checkout whose qcomm package runs instead of this one's (for "
                         "before/after comparisons).")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.calls < 1 or args.loops < 1:
        ap.error(f"--numel, --calls and --loops must be >= 1, got {args.numel}, {args.calls} "
                 f"and {args.loops}")
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    from bench.common import cpu_model, format_table, load_average, use_qcomm_from

    use_qcomm_from(args.qcomm)
    import torch

    import qcomm
    from qcomm import compress

    torch.set_num_threads(1)
    # Where the codec looks its backend up: qcomm.compress.unchecked (in a checkout from
    # before the codec became a package, qcomm.compress itself).
    getattr(compress, "unchecked", compress).backend_for = lambda device: _NoKernels()
    source = Path(qcomm.__file__).resolve().parent.parent
    print(f"# qcomm from {source}; cpu {cpu_model()}; load {load_average()}; numel "
          f"{args.numel}, {args.loops} loops of {args.calls} calls")
    rows = []
    for name, call in _calls(compress, torch, args.numel).items():
        call()  # the first call fills the weights cache
        loops = []
        for _ in range(args.loops):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            loops.append((time.perf_counter() - t0) / args.calls * 1e6)
        rows.append([name, statistics.median(loops), min(loops), max(loops)])
    print(format_table(("call", "us per call", "fastest loop", "slowest loop"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
