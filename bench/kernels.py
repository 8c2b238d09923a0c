#!/usr/bin/env python3
"""Kernel benchmark: quantize with fused error feedback, and dequant_accumulate.

For every size, bit width and op it times, on one device:

* ``qcomm``     the public API (:func:`qcomm.compress.quantize` with ``error``/``error_out``,
  :func:`qcomm.compress.dequant_accumulate`): the fused Triton kernel on CUDA, the torch
  reference on CPU, plus the API's checks (one host read per call); ``qcomm-nb``: the same
  calls with ``non_blocking=True``, no host read.
* ``kernel``    the backend function the API dispatches to, called directly: the kernel alone.
* ``reference`` the pure-torch reference codec on the same device (on CPU it *is* the kernel
  row, so it is skipped there).
* ``baseline``  another version of the reference, loaded from a file (``--baseline PATH``, e.g.
  ``git show REV:qcomm/kernels/reference.py > old.py``): before/after in one run, under the same
  load, and its bytes are checked to be the current reference's.
* ``eager``     the torch code a user would write for the same math (below).
* ``compiled``  that code under ``torch.compile`` (default mode; on CUDA with dynamic shapes, one
  compile per op and bit width, which keeps the GPU check within its time budget; on CPU with
  static shapes, one compile per size, as inductor's C++ code is much slower with dynamic ones).

Logical bytes (what the op must move at least): quantize+EF reads x (4 B/elem) and error (4),
writes error_out (4) and the payload; dequant_accumulate reads K payloads and out (4), writes
out (4).
GB/s = logical bytes / median time. The baseline is ``dst.copy_(src)`` of the same number of
float32 on the same device in the same run (2 * 4 B/elem); ``%copy`` is the ratio.

Every output is checked once per size before it is timed: the qcomm rows must equal the
reference's bytes (payload and error_out, or the accumulated tensor), the composites agree
within stated bounds. A failed check is an error.
Options: ``python bench/kernels.py --help``; the rows and targets: bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script from a checkout: make `qcomm` and `bench` importable without installing.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import (
    REPO_ROOT,
    Timer,
    copy_bandwidth,
    environment,
    format_size,
    format_table,
    parse_list,
    parse_size,
    print_environment,
    write_json,
)
from qcomm import compress
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.kernels import backend as codec_backends
from qcomm.kernels import reference
from qcomm.kernels.backend import backend_name
from qcomm.kernels.wire_format import SUPPORTED_BITS, split_payload
from qcomm.validation import did_you_mean

OPS = ("quantize", "accumulate")
IMPLS = ("qcomm", "qcomm-nb", "kernel", "reference", "baseline", "eager", "compiled")
API_IMPLS = ("qcomm", "qcomm-nb")
# Per-call rows on CUDA only: the non-blocking API's calls captured in one CUDA graph.
GRAPH_IMPL = "qcomm-nb graph"
OP_LABEL = {"quantize": "quantize+EF", "accumulate": "dequant_acc"}
GPU_SIZES = "1M,4M,16M,64M,256M"
CPU_SIZES = "1M,4M,16M"
QUICK_SIZES = "64K"
# Targets on the H200, checked by --check-targets on CUDA: the kernels' share of the copy
# bandwidth and speedup over eager torch, the public API's time over its kernel's at >= 64M,
# and the non-blocking API's time per call in a stream of calls on small buckets.
TARGET_MIN_NUMEL = 64 << 20
TARGET_COPY_RATIO = {"quantize": 0.85, "accumulate": 0.90}
TARGET_VS_EAGER = 3.0
TARGET_API_OVER_KERNEL = 1.10
TARGET_PER_CALL_S = 20e-6
TARGET_PER_CALL_NUMEL = 1 << 20
# Per-call sizes: a 1M-element bucket and a 25 MiB one (DDP's default bucket); 4-bit codes.
GPU_PER_CALL_SIZES = "1M,6400K"
CPU_PER_CALL_SIZES = "1M"
PER_CALL_BITS = 4
PER_CALL_CALLS = 200
# Up to this size the oracle is the reference on CPU copies (the one the tests trust); above,
# the reference on the benchmark's device (same arithmetic, same bytes; the CPU is too slow).
CPU_ORACLE_MAX_NUMEL = 4 << 20
SEED = 20240611  # stochastic-rounding seed; any fixed value makes runs comparable
EPS32 = 2.0**-23


# ---------------------------------------------------------------------------------------------
# the composite a user would write (eager torch; also what torch.compile gets)


def make_composite_quantize(spec: QuantSpec) -> Callable[..., None]:
    """``f(x, error, error_out, payload)``: quantize+EF in plain torch ops, same wire layout.

    Needs ``numel % block_size == 0`` (the benchmark's sizes are). Stochastic rounding uses
    torch's own RNG (``rand_like``), not qcomm's counter hash, so its bytes differ from qcomm's.
    """
    bits, block, levels = spec.bits, spec.block_size, spec.max_level
    stochastic = spec.rounding == "stochastic"

    def composite_quantize(x: torch.Tensor, error: torch.Tensor, error_out: torch.Tensor,
                           payload: torch.Tensor) -> None:
        v = x.float() + error
        vb = v.view(-1, block)
        if bits == 1:
            scale = vb.abs().mean(dim=1)
            positive = vb >= 0
            codes = positive.to(torch.uint8)
            dq = torch.where(positive, scale[:, None], -scale[:, None])
        elif bits == 2:  # levels {-1, -1/3, 1/3, 1} * absmax, codes 0..3
            scale = vb.abs().amax(dim=1)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            k = vb / safe[:, None] * 1.5 + 1.5
            c = torch.floor(k + torch.rand_like(k)) if stochastic else torch.round(k)
            codes = c.clamp(0, 3).to(torch.uint8)
            third = scale / 3
            table = torch.stack([-scale, -third, third, scale], dim=1)  # [nblocks, 4]
            dq = table.gather(1, codes.long())
        else:
            scale = vb.abs().amax(dim=1) / levels
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block -> 0
            t = vb / safe[:, None]
            q = torch.floor(t + torch.rand_like(t)) if stochastic else torch.round(t)
            q = q.clamp(-levels, levels)
            codes = (q + levels).to(torch.uint8)
            dq = q * scale[:, None]
        error_out.copy_((vb - dq).view(-1))
        if bits < 8:
            per = 8 // bits
            c = codes.view(-1, per)
            packed = c[:, 0]
            for j in range(1, per):
                packed = packed | (c[:, j] << (j * bits))
        else:
            packed = codes.view(-1)
        ncodes = packed.numel()
        payload[:ncodes].copy_(packed)
        payload[ncodes:].view(torch.float32).copy_(scale)

    return composite_quantize


def make_composite_accumulate(spec: QuantSpec) -> Callable[..., None]:
    """``f(payloads, out)``: ``out += sum_k D(payloads[k])`` in plain torch ops."""
    bits, block, levels = spec.bits, spec.block_size, spec.max_level

    def composite_accumulate(payloads: torch.Tensor, out: torch.Tensor) -> None:
        k = payloads.shape[0]
        ncodes = out.numel() * bits // 8
        codes = payloads[:, :ncodes]
        scales = payloads[:, ncodes:].view(torch.float32)
        if bits < 8:
            shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=payloads.device)
            codes = ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(k, -1)
        if bits == 2:  # levels {-1, -1/3, 1/3, 1} * scale
            s = scales[:, :, None]
            table = torch.stack([-s, -s / 3, s / 3, s], dim=-1).view(k, -1, 4)
            d = table.gather(2, codes.long().view(k, -1, block))
        else:
            q = codes.float() * 2 - 1 if bits == 1 else codes.float() - levels
            d = q.view(k, -1, block) * scales[:, :, None]
        out.add_(d.sum(dim=0).view(-1))

    return composite_accumulate


# ---------------------------------------------------------------------------------------------
# output checks: run once per (op, bits, size, impl) before timing


class CheckFailed(AssertionError):
    """An implementation's output disagrees with the reference."""


def _check_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        diff = (got != want).nonzero()
        first = int(diff[0, 0]) if diff.numel() else -1
        raise CheckFailed(f"{name} differs from the reference at {diff.shape[0]} positions "
                          f"(first {first})")


def check_quantize_composite(spec: QuantSpec, x: torch.Tensor, error: torch.Tensor,
                             payload: torch.Tensor, error_out: torch.Tensor,
                             ref_payload: torch.Tensor) -> None:
    """A composite's payload must decode to within one quantization step of the reference's,
    its scales must match (rtol 1e-4: the 1-bit mean is summed in fp32 here and pairwise in
    fp64 by the reference), and its error_out must be ``v - D(payload)``."""
    n = x.numel()
    v = x.float() + error
    d = torch.empty(n, device=x.device)
    d_ref = torch.empty(n, device=x.device)
    reference.dequantize_into(payload, spec, d)
    reference.dequantize_into(ref_payload, spec, d_ref)
    scale = split_payload(payload, n, spec)[1]
    scale_ref = split_payload(ref_payload, n, spec)[1]
    if not torch.allclose(scale, scale_ref, rtol=1e-4, atol=0.0):
        raise CheckFailed("composite scales differ from the reference's by more than rtol 1e-4")
    spacing = 2 / 3 if spec.bits == 2 else 1.0  # of the levels, in units of the scale
    step = scale_ref.repeat_interleave(spec.block_size) * (spacing * (1 + 1e-4))
    if bool(((d - d_ref).abs() > step).any()):
        raise CheckFailed("composite decodes more than one step away from the reference")
    if spec.rounding == "nearest" or spec.bits == 1:
        # Deterministic codes from (almost) the same scale: they may differ only where v / scale
        # sits at a tie, which the reference's one-ulp scale bump can move.
        codes = reference.unpack_codes(split_payload(payload, n, spec)[0], n, spec)
        codes_ref = reference.unpack_codes(split_payload(ref_payload, n, spec)[0], n, spec)
        mismatch = float((codes != codes_ref).float().mean())
        if mismatch > 1e-3:
            raise CheckFailed(f"composite codes differ from the reference's at {mismatch:.2%}")
    # The composite computes v - q*scale, the decoder (code - L)*scale: the same fp32 ops.
    if not torch.allclose(error_out, v - d, rtol=0.0, atol=4 * EPS32 * float(v.abs().max())):
        raise CheckFailed("composite error_out is not v - D(payload)")


def check_accumulate_close(out: torch.Tensor, ref_out: torch.Tensor, out0: torch.Tensor,
                           payloads: torch.Tensor, spec: QuantSpec) -> None:
    """A composite sums the K decoded payloads first and adds once; the reference adds them to
    out one by one. Each of the K + 1 additions rounds by at most eps/2 of the largest partial
    sum, bounded by max|out0| + K * L * max scale; allow 4x that."""
    n = out.numel()
    k = payloads.shape[0]
    smax = float(split_payload(payloads, n, spec)[1].abs().max())
    bound = float(out0.abs().max()) + k * max(spec.max_level, 1) * smax
    atol = 4 * (k + 1) * EPS32 * bound
    err = float((out - ref_out).abs().max())
    if err > atol:
        raise CheckFailed(f"composite accumulate differs from the reference by {err:.3g} "
                          f"> {atol:.3g}")


# ---------------------------------------------------------------------------------------------
# one (op, bits, size) group: set up inputs and the reference result, then each implementation


def configure_dynamo(limit: int = 64) -> None:
    """Let torch.compile keep one graph per composite. Every composite is a closure of the same
    function, and dynamo counts compilations per code object: past its limit (8) it silently
    runs the function eagerly, and the compiled rows would measure eager code. Raise the limit
    (4 bit widths x 5 sizes fit), and make hitting it an error rather than a fallback."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(limit, getattr(cfg, name)))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


class Runner:
    """Holds the options, the timer and the compiled composites (one per op and bit width)."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args = args
        self.device = device
        self.timer = Timer(device, args.repeat, args.warmup)
        self.backend = backend_name(device)
        if "compiled" in args.impls:
            configure_dynamo()
        self._compiled: dict[tuple[str, int], Callable[..., None]] = {}
        self.baseline = load_baseline(args.baseline) if args.baseline else None

    @property
    def kernels(self) -> compress.CodecBackend:
        """The backend the public API dispatches to, called directly for the kernel row.
        Resolved on use, so a backend that fails to import fails its rows, not the run."""
        return codec_backends.backend_for(self.device)

    def spec(self, bits: int) -> QuantSpec:
        return QuantSpec(bits=bits, block_size=self.args.block_size, rounding=self.args.rounding)

    @property
    def compile_dynamic(self) -> bool:
        """Dynamic shapes for torch.compile: ``auto`` means yes on CUDA (one compile per op and
        bit width instead of one per size keeps the GPU check in its budget) and no on CPU
        (inductor's C++ code for this composite ran ~10x slower with dynamic shapes, measured
        with torch 2.13 at 1M elements, 4 bits)."""
        return runner_dynamic(self.args, self.device)

    def compiled(self, op: str, spec: QuantSpec, n: int) -> Callable[..., None]:
        dynamic = self.compile_dynamic
        key = (op, spec.bits, None if dynamic else n)
        if key not in self._compiled:
            make = make_composite_quantize if op == "quantize" else make_composite_accumulate
            self._compiled[key] = torch.compile(make(spec), dynamic=dynamic)
        return self._compiled[key]

    def _randn(self, n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        t = torch.randn(n, generator=gen, device=self.device)
        return t.mul_(scale) if scale != 1.0 else t

    def run_group(self, op: str, bits: int, n: int) -> list[dict]:
        spec = self.spec(bits)
        if op == "quantize":
            return self._quantize_group(spec, n)
        return self._accumulate_group(spec, n)

    def oracle_device(self, n: int) -> torch.device:
        """Where the reference computes the expected output for size ``n``."""
        return torch.device("cpu") if n <= CPU_ORACLE_MAX_NUMEL else self.device

    def _quantize_group(self, spec: QuantSpec, n: int) -> list[dict]:
        nbytes = packed_nbytes(n, spec)
        x = self._randn(n, 1)
        error = self._randn(n, 2, 0.1)
        oracle = self.oracle_device(n)
        ref_payload = torch.empty(nbytes, dtype=torch.uint8, device=oracle)
        ref_error_out = torch.empty(n, device=oracle)
        reference.quantize_into(x.to(oracle), spec, ref_payload, error.to(oracle),
                                ref_error_out, SEED)
        ref_payload = ref_payload.to(self.device)
        ref_error_out = ref_error_out.to(self.device)
        payload = torch.empty_like(ref_payload)
        error_out = torch.empty_like(ref_error_out)
        logical = n * (x.element_size() + 4 + 4) + nbytes

        def check_exact() -> None:
            _check_equal("payload", payload, ref_payload)
            _check_equal("error_out", error_out, ref_error_out)

        def check_composite() -> None:
            check_quantize_composite(spec, x, error, payload, error_out, ref_payload)

        def make_call(impl: str) -> Callable[[], object]:
            if impl in API_IMPLS:
                return lambda: compress.quantize(x, spec, error=error, error_out=error_out,
                                                 seed=SEED, out=payload,
                                                 non_blocking=impl == "qcomm-nb")
            if impl in ("kernel", "reference", "baseline"):
                mod = self._module(impl)
                return lambda: mod.quantize_into(x, spec, payload, error, error_out, SEED)
            fn = (make_composite_quantize(spec) if impl == "eager"
                  else self.compiled("quantize", spec, n))
            return lambda: fn(x, error, error_out, payload)

        def reset() -> None:
            payload.fill_(0xAA)  # stale bytes from another impl must not pass its check
            error_out.fill_(float("nan"))

        return self._run_impls("quantize", spec, n, logical, make_call, reset, check_exact,
                               check_composite, oracle)

    def _accumulate_group(self, spec: QuantSpec, n: int) -> list[dict]:
        k = self.args.k
        nbytes = packed_nbytes(n, spec)
        payloads = torch.empty(k, nbytes, dtype=torch.uint8, device=self.device)
        for i in range(k):
            # Made by the reference, so a broken quantize kernel cannot hide in these inputs.
            reference.quantize_into(self._randn(n, 10 + i, 1.0 + i), spec, payloads[i], None,
                                    None, SEED + i)
        out0 = self._randn(n, 3)
        oracle = self.oracle_device(n)
        ref_out = out0.to(oracle, copy=True)
        reference.dequant_accumulate_into(payloads.to(oracle), spec, ref_out, None)
        ref_out = ref_out.to(self.device)
        out = out0.clone()
        logical = k * nbytes + 8 * n

        def check_exact() -> None:
            _check_equal("out", out, ref_out)

        def check_composite() -> None:
            check_accumulate_close(out, ref_out, out0, payloads, spec)

        def make_call(impl: str) -> Callable[[], object]:
            if impl in API_IMPLS:
                return lambda: compress.dequant_accumulate(payloads, out, spec,
                                                           non_blocking=impl == "qcomm-nb")
            if impl in ("kernel", "reference", "baseline"):
                mod = self._module(impl)
                return lambda: mod.dequant_accumulate_into(payloads, spec, out, None)
            fn = (make_composite_accumulate(spec) if impl == "eager"
                  else self.compiled("accumulate", spec, n))
            return lambda: fn(payloads, out)

        def reset() -> None:
            out.copy_(out0)  # the check needs out0 + sum; timed calls then keep adding

        return self._run_impls("accumulate", spec, n, logical, make_call, reset, check_exact,
                               check_composite, oracle)

    def _run_impls(self, op: str, spec: QuantSpec, n: int, logical: int,
                   make_call: Callable[[str], Callable[[], object]],
                   reset: Callable[[], None], check_exact: Callable[[], None],
                   check_composite: Callable[[], None], oracle: torch.device) -> list[dict]:
        rows = []
        for impl in self.args.impls:
            row = {"op": op, "bits": spec.bits, "numel": n, "size": format_size(n),
                   "impl": impl, "backend": self._impl_backend(impl), "bytes": logical,
                   "status": "ok", "verified": False, "oracle": oracle.type,
                   "median_s": None, "times_s": None, "gbps": None, "compile_s": None,
                   "error": None}
            rows.append(row)
            if impl == "reference" and self.backend == "reference":
                row["status"] = "skipped"
                row["error"] = "the kernel row runs the reference on this device"
                continue
            stage = "setup"
            try:
                call = make_call(impl)
                reset()
                stage = "first call"
                t0 = time.perf_counter()
                call()
                self.timer.synchronize()
                if impl == "compiled":
                    row["compile_s"] = time.perf_counter() - t0  # dominated by compilation
                stage = "check"
                (check_composite if impl in ("eager", "compiled") else check_exact)()
                row["verified"] = True
                stage = "timing"
                med, ts = self.timer.median(call)
                row.update(median_s=med, times_s=ts, gbps=logical / med / 1e9)
            except Exception as exc:  # one broken row must not end the run: record it
                # torch.compile compiles lazily, on the first call.
                compile_failed = impl == "compiled" and stage in ("setup", "first call")
                row["status"] = "compile_error" if compile_failed else "error"
                row["error"] = f"{stage}: {type(exc).__name__}: {str(exc).strip()[:300]}"
                if self.args.verbose:
                    traceback.print_exc()
            print(f"  {OP_LABEL[op]:<12} {spec.bits}b {format_size(n):>5} {impl:<9} "
                  f"{_progress(row)}", file=sys.stderr, flush=True)
        return rows

    def per_call_group(self, op: str, n: int) -> list[dict]:
        """Time per call of the API (blocking and not) and of its kernel in a stream of
        PER_CALL_CALLS back-to-back calls on ``n`` elements (PER_CALL_BITS-bit codes): the
        launch and check overhead that small buckets pay. Outputs are not checked here (the
        timed rows check the same calls)."""
        spec = self.spec(PER_CALL_BITS)
        x, error = self._randn(n, 1), self._randn(n, 2, 0.1)
        error_out = torch.empty_like(x)
        payloads = torch.empty(self.args.k, packed_nbytes(n, spec), dtype=torch.uint8,
                               device=self.device)
        for i in range(self.args.k):
            self.kernels.quantize_into(self._randn(n, 10 + i), spec, payloads[i], None, None, i)
        out = self._randn(n, 3)
        calls: dict[str, Callable[[], object]]
        if op == "quantize":
            calls = {impl: partial(compress.quantize, x, spec, error=error, error_out=error_out,
                                   seed=SEED, out=payloads[0], non_blocking=impl == "qcomm-nb")
                     for impl in API_IMPLS}
            calls["kernel"] = partial(self.kernels.quantize_into, x, spec, payloads[0], error,
                                      error_out, SEED)
        else:
            calls = {impl: partial(compress.dequant_accumulate, payloads, out, spec,
                                   non_blocking=impl == "qcomm-nb") for impl in API_IMPLS}
            calls["kernel"] = partial(self.kernels.dequant_accumulate_into, payloads, spec, out,
                                      None)
        if self.device.type == "cuda":
            calls[GRAPH_IMPL] = calls["qcomm-nb"]
        rows = []
        for impl, call in calls.items():
            row = {"op": op, "bits": spec.bits, "numel": n, "size": format_size(n),
                   "impl": impl, "calls": PER_CALL_CALLS}
            try:
                med, runs = (self._per_call_in_a_graph(call) if impl == GRAPH_IMPL
                             else self.timer.per_call_in_a_stream(call, PER_CALL_CALLS))
            except Exception as exc:  # a capture refused (any error): reported, not fatal
                row.update(per_call_s=None, runs_s=[], error=f"{type(exc).__name__}: {exc}"[:300])
                print(f"  per call     {OP_LABEL[op]:<12} {format_size(n):>5} {impl:<14} "
                      f"{row['error']}", file=sys.stderr, flush=True)
                rows.append(row)
                continue
            rows.append({**row, "per_call_s": med, "runs_s": runs})
            print(f"  per call     {OP_LABEL[op]:<12} {format_size(n):>5} {impl:<14} "
                  f"{med * 1e6:9.1f} us", file=sys.stderr, flush=True)
        return rows

    def _per_call_in_a_graph(self, call: Callable[[], object]) -> tuple[float, list[float]]:
        """Seconds per call of PER_CALL_CALLS calls captured in one CUDA graph and replayed
        (no launch overhead left: what CUDA graphs would save), median of the runs, and the
        runs. The calls warm up on a side stream first, as torch's graph capture asks."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                call()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(PER_CALL_CALLS):
                call()
        med, runs = self.timer.per_call_in_a_stream(graph.replay, 1)
        return med / PER_CALL_CALLS, [r / PER_CALL_CALLS for r in runs]

    def _module(self, impl: str):
        """The codec module an impl row calls: the backend, the reference or the baseline."""
        return {"kernel": self.kernels, "reference": reference, "baseline": self.baseline}[impl]

    def _impl_backend(self, impl: str) -> str:
        if impl in (*API_IMPLS, "kernel"):
            return self.backend
        return {"reference": "reference", "baseline": "baseline", "eager": "torch",
                "compiled": "inductor"}[impl]


def load_baseline(path: Path):
    """The module in ``path``: another version of qcomm/kernels/reference.py (same functions)."""
    spec = importlib.util.spec_from_file_location("qcomm_bench_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skipped_row(op: str, bits: int, n: int, impl: str, why: str) -> dict:
    """A row that was not run (same fields as a run row)."""
    return {"op": op, "bits": bits, "numel": n, "size": format_size(n), "impl": impl,
            "backend": None, "bytes": None, "status": "skipped", "verified": False,
            "oracle": None, "median_s": None, "times_s": None, "gbps": None,
            "compile_s": None, "error": why}


def _progress(row: dict) -> str:
    if row["status"] == "ok":
        return f"{row['median_s'] * 1e3:9.3f} ms {row['gbps']:8.2f} GB/s"
    return f"{row['status']}: {row['error']}"


def add_ratios(rows: list[dict], copy_gbps: float) -> None:
    """Fill ``copy_gbps``, ``ratio_copy``, ``vs_eager``, ``vs_compiled``, ``vs_baseline`` of one
    group's rows (speedups are time ratios; all rows of a group move the same logical bytes)."""
    by_impl = {r["impl"]: r for r in rows if r["status"] == "ok"}
    for r in rows:
        r["copy_gbps"] = copy_gbps
        r["ratio_copy"] = r["gbps"] / copy_gbps if r["status"] == "ok" else None
        for impl, key in (("eager", "vs_eager"), ("compiled", "vs_compiled"),
                          ("baseline", "vs_baseline")):
            base = by_impl.get(impl)
            r[key] = (base["median_s"] / r["median_s"]
                      if base is not None and r["status"] == "ok" else None)
        kernel = by_impl.get("kernel")  # the API's time over its kernel's: its overhead
        r["over_kernel"] = (r["median_s"] / kernel["median_s"]
                            if kernel is not None and r["status"] == "ok" else None)


# ---------------------------------------------------------------------------------------------
# targets, table, CLI


def check_targets(rows: list[dict]) -> list[dict]:
    """PASS/FAIL per (op, bits, size >= 64M) for the ``kernel`` rows: >= 85% of the copy
    bandwidth and >= 3x the eager composite. A missing row is a FAIL (nothing to pass)."""
    results = []
    groups = sorted({(r["op"], r["bits"], r["numel"]) for r in rows
                     if r["numel"] >= TARGET_MIN_NUMEL})
    if not groups:
        return [{"target": f"sizes >= {format_size(TARGET_MIN_NUMEL)}", "passed": False,
                 "detail": "no size >= 64M was run"}]
    for op, bits, n in groups:
        row = next((r for r in rows if (r["op"], r["bits"], r["numel"], r["impl"])
                    == (op, bits, n, "kernel")), None)
        name = f"{OP_LABEL[op]} {bits}b {format_size(n)}"
        ok = row is not None and row["status"] == "ok"
        ratio = row["ratio_copy"] if ok else None
        want = TARGET_COPY_RATIO[op]
        results.append({"target": f"{name}: >= {want:.0%} of copy",
                        "passed": ratio is not None and ratio >= want,
                        "detail": f"{ratio:.1%}" if ratio is not None else "no kernel result"})
        vs = row["vs_eager"] if ok else None
        results.append({"target": f"{name}: >= {TARGET_VS_EAGER:g}x eager",
                        "passed": vs is not None and vs >= TARGET_VS_EAGER,
                        "detail": f"{vs:.2f}x" if vs is not None else "no kernel/eager result"})
        results += api_targets(rows, op, bits, n, name)
    return results


def api_targets(rows: list[dict], op: str, bits: int, n: int, name: str) -> list[dict]:
    """The public API's rows of one group: time within TARGET_API_OVER_KERNEL of the kernel's."""
    out = []
    for impl in API_IMPLS:
        row = next((r for r in rows if (r["op"], r["bits"], r["numel"], r["impl"])
                    == (op, bits, n, impl)), None)
        if row is None:  # not asked for (--impls)
            continue
        over = row.get("over_kernel") if row["status"] == "ok" else None
        out.append({"target": f"{name}: {impl} within {TARGET_API_OVER_KERNEL - 1:.0%} of its "
                              f"kernel",
                    "passed": over is not None and over <= TARGET_API_OVER_KERNEL,
                    "detail": f"{over:.3f}x the kernel's time" if over is not None
                    else "no API/kernel result"})
    return out


def per_call_targets(per_call: list[dict]) -> list[dict]:
    """The non-blocking API's time per call in a stream at 1M elements: under 20 us."""
    out = []
    graphed = {(r["op"], r["numel"]): r["per_call_s"] for r in per_call
               if r["impl"] == GRAPH_IMPL and r["per_call_s"] is not None}
    for r in per_call:
        if r["impl"] == "qcomm-nb" and r["numel"] == TARGET_PER_CALL_NUMEL:
            target = (f"{OP_LABEL[r['op']]} {r['bits']}b {r['size']}: qcomm-nb under "
                      f"{TARGET_PER_CALL_S * 1e6:g} us per call in a stream")
            if r["per_call_s"] is None:
                out.append({"target": target, "passed": False, "detail": r["error"]})
                continue
            us = r["per_call_s"] * 1e6
            graph_s = graphed.get((r["op"], r["numel"]))
            also = "" if graph_s is None else f"; in a CUDA graph {graph_s * 1e6:.1f} us"
            out.append({"target": target, "passed": us < TARGET_PER_CALL_S * 1e6,
                        "detail": f"{us:.1f} us{also}"})
    return out


TABLE_HEADERS = ("op", "bits", "size", "impl", "backend", "ms", "GB/s", "copy GB/s", "%copy",
                 "x eager", "x compiled", "x baseline", "t/kernel", "status")


def table_rows(rows: list[dict]) -> list[list[object]]:
    out = []
    for r in rows:
        ok = r["status"] == "ok"
        status = "ok" if ok else f"{r['status']}: {(r['error'] or '')[:60]}"
        out.append([
            OP_LABEL[r["op"]], r["bits"], r["size"], r["impl"], r["backend"],
            r["median_s"] * 1e3 if ok else None, r["gbps"] if ok else None,
            r.get("copy_gbps"), 100 * r["ratio_copy"] if ok else None,
            r.get("vs_eager"), r.get("vs_compiled"), r.get("vs_baseline"),
            r.get("over_kernel") if r["impl"] != "kernel" else None, status,
        ])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark qcomm's quantize with fused error feedback and its "
                    "dequant_accumulate against a same-run copy baseline and against eager and "
                    "torch.compile'd torch composites of the same math. Prints the table and "
                    "writes JSON; bench/README.md explains the rows.")
    p.add_argument("--sizes", help=f"Comma-separated element counts, K/M/G = 2**10/20/30 "
                   f"(default: GPU {GPU_SIZES}; CPU {CPU_SIZES}; --quick {QUICK_SIZES}).")
    p.add_argument("--bits", default="1,2,4,8", help="Bit widths (default 1,2,4,8).")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"The operations, a subset of {','.join(OPS)} (default both).")
    p.add_argument("--impls", help=f"The implementations, a subset of {','.join(IMPLS)} "
                   "(default all but baseline, which --baseline adds; --quick leaves out "
                   "compiled).")
    p.add_argument("--baseline", type=Path, metavar="PATH",
                   help="Another version of qcomm/kernels/reference.py or of "
                        "qcomm/kernels/triton_codec.py to time as the 'baseline' row (e.g. git "
                        "show REV:qcomm/kernels/triton_codec.py > old.py): a before/after in "
                        "one run.")
    p.add_argument("--per-call-sizes", metavar="SIZES",
                   help=f"Sizes at which to time calls in a stream (default: GPU "
                        f"{GPU_PER_CALL_SIZES}; CPU {CPU_PER_CALL_SIZES}; --quick none; "
                        f"'none' for none).")
    p.add_argument("--k", type=int, default=4,
                   help="Payloads per dequant_accumulate (default 4).")
    p.add_argument("--repeat", type=int, help="Timed calls per row (default: CUDA 20, CPU 5).")
    p.add_argument("--warmup", type=int, help="Untimed calls first (default: CUDA 3, CPU 1).")
    p.add_argument("--block-size", type=int, default=128,
                   help="Elements per scale (default 128).")
    p.add_argument("--rounding", choices=("nearest", "stochastic"), default="nearest",
                   help="The codec's rounding mode (default nearest).")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="Where to run (default auto: CUDA when available, else CPU).")
    p.add_argument("--compile-dynamic", choices=("auto", "yes", "no"), default="auto",
                   help="torch.compile with dynamic shapes (auto: yes on CUDA, no on CPU).")
    p.add_argument("--threads", type=int, help="Torch CPU threads (default torch's); 1 gives "
                   "steadier CPU figures on a shared machine.")
    p.add_argument("--json", type=Path,
                   help="Output JSON (default bench/out/kernels-<device>.json).")
    p.add_argument("--quick", action="store_true",
                   help=f"A smoke run: sizes {QUICK_SIZES}, repeat 2, warmup 1, no "
                        f"torch.compile.")
    p.add_argument("--check-targets", action="store_true",
                   help="On CUDA: PASS/FAIL per target, exit 1 on a FAIL: at >= 64M "
                        "elements the kernel rows at >= 85%% (quantize) / 90%% (dequant-"
                        "accumulate) of copy and >= 3x eager, the API rows within 10%% of "
                        "their kernel; the non-blocking API under 20 us per call at 1M.")
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="Start no new (op, bits, size) group after S seconds; the rest are "
                        "skipped (sizes run largest first).")
    p.add_argument("--verbose", action="store_true", help="Print tracebacks of failed rows.")
    args = p.parse_args(argv)

    try:
        args.bits = parse_list(args.bits, int, "--bits")
        args.ops = parse_list(args.ops, str, "--ops")
        args.impls = parse_list(args.impls, str, "--impls") if args.impls else [
            i for i in IMPLS if (i != "compiled" or not args.quick)
            and (i != "baseline" or args.baseline is not None)]
        if args.sizes is not None:
            args.sizes = parse_list(args.sizes, parse_size, "--sizes")
        if args.per_call_sizes is not None:
            args.per_call_sizes = ([] if args.per_call_sizes == "none" else parse_list(
                args.per_call_sizes, parse_size, "--per-call-sizes"))
        QuantSpec(bits=4, block_size=args.block_size)  # validates block_size
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    for name, values, allowed in (("--bits", args.bits, SUPPORTED_BITS),
                                  ("--ops", args.ops, OPS), ("--impls", args.impls, IMPLS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"{name}: {bad} not in {list(allowed)}{did_you_mean(bad[0], allowed)}")
    if ("baseline" in args.impls) != (args.baseline is not None):
        p.error("the baseline row needs --baseline PATH, and --baseline needs the row")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.k < 1:
        p.error(f"--k must be >= 1, got {args.k}")
    for name, sizes in (("--sizes", args.sizes), ("--per-call-sizes", args.per_call_sizes)):
        bad = [s for s in sizes or () if s % args.block_size]
        if bad:
            p.error(f"{name} must be multiples of --block-size {args.block_size}: {bad}")
    return args


def runner_dynamic(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether torch.compile gets dynamic shapes (see ``Runner.compile_dynamic``)."""
    if args.compile_dynamic == "auto":
        return device.type == "cuda"
    return args.compile_dynamic == "yes"


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    return torch.device(choice)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    if args.sizes is None:
        args.sizes = [parse_size(s) for s in
                      (QUICK_SIZES if args.quick else GPU_SIZES if cuda else CPU_SIZES).split(",")]
    if args.per_call_sizes is None:
        args.per_call_sizes = [] if args.quick else [parse_size(s) for s in (
            GPU_PER_CALL_SIZES if cuda else CPU_PER_CALL_SIZES).split(",")]
    if args.repeat is None:
        args.repeat = 2 if args.quick else 20 if cuda else 5
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3 if cuda else 1
    json_path = args.json or REPO_ROOT / "bench" / "out" / f"kernels-{device.type}.json"

    env = environment(device)
    env["codec_backend"] = backend_name(device)
    print_environment(env)
    config = {"sizes": args.sizes, "bits": args.bits, "ops": args.ops, "impls": args.impls,
              "baseline": str(args.baseline) if args.baseline else None,
              "k": args.k, "repeat": args.repeat, "warmup": args.warmup,
              "block_size": args.block_size, "rounding": args.rounding, "quick": args.quick,
              "compile_dynamic": runner_dynamic(args, device),
              "threads": torch.get_num_threads(), "weights": None,
              "per_call_sizes": args.per_call_sizes, "per_call_bits": PER_CALL_BITS,
              "per_call_calls": PER_CALL_CALLS,
              "input": "x ~ N(0,1), error ~ N(0, 0.01), fp32",
              "timing": ("cuda events per call, L2 flushed before each, median" if cuda
                         else "perf_counter per call, median")}
    print(f"# config: {config}", flush=True)

    runner = Runner(args, device)
    result = {"schema": 1, "complete": False, "env": env, "config": config, "copy": [],
              "rows": [], "per_call": [], "targets": None}
    t_start = time.perf_counter()
    # Largest sizes first: the targets are about them, and a time budget then cuts small ones.
    for n in sorted(args.sizes, reverse=True):
        copy = copy_bandwidth(runner.timer, n)
        result["copy"].append(copy)
        print(f"  copy         {format_size(n):>8} {copy['median_s'] * 1e3:9.3f} ms "
              f"{copy['gbps']:8.2f} GB/s", file=sys.stderr, flush=True)
        for op in args.ops:
            for bits in args.bits:
                elapsed = time.perf_counter() - t_start
                if args.time_budget is not None and elapsed > args.time_budget:
                    rows = [skipped_row(op, bits, n, impl, f"time budget {args.time_budget:g} s "
                                        "used up") for impl in args.impls]
                else:
                    rows = runner.run_group(op, bits, n)
                add_ratios(rows, copy["gbps"])
                result["rows"].extend(rows)
                write_json(json_path, result)  # partial results survive a timeout
        if cuda:
            torch.cuda.empty_cache()
    result["copy"].sort(key=lambda c: c["numel"])
    for n in args.per_call_sizes:
        for op in args.ops:
            result["per_call"] += runner.per_call_group(op, n)
            write_json(json_path, result)
    result["elapsed_s"] = time.perf_counter() - t_start

    print()
    order = {name: i for i, name in enumerate((*OPS, *IMPLS))}
    shown = sorted(result["rows"], key=lambda r: (r["numel"], order[r["op"]], r["bits"],
                                                  order[r["impl"]]))
    print(format_table(TABLE_HEADERS, table_rows(shown)))
    budget_skips = sum(1 for r in result["rows"] if "time budget" in (r["error"] or ""))
    if budget_skips:
        print(f"{budget_skips} row(s) skipped: --time-budget {args.time_budget:g} s used up")
    print("\ncopy baseline: " + ", ".join(f"{format_size(c['numel'])} {c['gbps']:.1f} GB/s"
                                          for c in result["copy"]))
    if result["per_call"]:
        print(f"\nper call, {PER_CALL_CALLS} calls back to back (median of {args.repeat} runs):")
        print(format_table(("op", "bits", "size", "impl", "us per call"), [
            [OP_LABEL[r["op"]], r["bits"], r["size"], r["impl"],
             r["per_call_s"] * 1e6 if r["per_call_s"] is not None else r["error"][:60]]
            for r in result["per_call"]]))
    errors = [r for r in result["rows"] if r["status"] == "error"]
    compile_errors = [r for r in result["rows"] if r["status"] == "compile_error"]
    if compile_errors:
        print(f"torch.compile failed for {len(compile_errors)} row(s) (reported, not an error "
              f"of qcomm): {compile_errors[0]['error']}")
    rc = 1 if errors else 0
    if errors:
        print(f"{len(errors)} row(s) errored, e.g. {errors[0]['impl']} {errors[0]['op']} "
              f"{errors[0]['bits']}b {errors[0]['size']}: {errors[0]['error']}")

    if args.check_targets:
        if not cuda:
            print("\n--check-targets: the targets are for CUDA (H200); skipped on CPU")
        else:
            result["targets"] = (check_targets(result["rows"])
                                 + per_call_targets(result["per_call"]))
            print("\n# targets (kernel rows, the public API's, per call)")
            for t in result["targets"]:
                print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['target']}  ({t['detail']})")
            api = [r for r in result["rows"] if r["impl"] in API_IMPLS and r["status"] == "ok"
                   and r["numel"] >= TARGET_MIN_NUMEL]
            for r in api:  # the blocking API reads its checks once per call (a host sync)
                print(f"  info  {r['impl']} {OP_LABEL[r['op']]} {r['bits']}b {r['size']}: "
                      f"{r['ratio_copy']:.1%} of copy, {r['vs_eager'] or float('nan'):.2f}x eager")
            if not all(t["passed"] for t in result["targets"]):
                rc = 1

    result["complete"] = True
    result["exit_code"] = rc
    write_json(json_path, result)
    print(f"\nwrote {json_path} ({result['elapsed_s']:.1f} s); exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
