"""Compile the Triton codec kernels for sm_90 (H100/H200) on any machine and report on the code.

Used by ``test_compiled_sm90.py``, which runs this file as a script in a subprocess; it can also be
run by hand (``python tests/kernels/compile_sm90.py``, TRITON_INTERPRET unset or 0, prints the
JSON report). No GPU is needed: Triton's wheel ships ptxas and cuobjdump, and
``triton.compile`` takes an explicit target.

It runs as a separate process because the test session imports the kernel module under
``TRITON_INTERPRET=1``, where ``@triton.jit`` returns an interpreter object that cannot be
compiled (and whose helpers, also interpreter objects, the compiler would reject); this process
imports it with ``TRITON_INTERPRET=0`` (set by the caller) and gets the real ``JITFunction``.

The compile arguments are not written here. Each variant is produced by the kernel's own launcher
(``quantize_into`` and co.) called on CPU tensors with every module-level kernel replaced by a
recorder; the recorded call goes through Triton's own binder, as a real launch would. So the
signature, the constexprs, the divisibility attributes and the launch options (``num_warps``,
``enable_fp_fusion``) are those the launcher passes today, and an argument mismatch between a
launcher and its kernel raises here instead of compiling a stale signature.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from qcomm.kernels import triton_codec
from qcomm.kernels.accumulate_guard import AccumulateGuard
from qcomm.kernels.wire_format import QuantSpec, packed_nbytes

TARGET = GPUTarget("cuda", 90, 32)
# Elements per tensor: a multiple of 16 and of every block size, like most real buckets, so the
# integer arguments get the "divisible by 16" specialization a typical launch gets.
N = 1 << 16
# Module-level kernels that need no variant of their own: the random stream of the test hook
# _uniform_kernel is compiled inside every stochastic quantize variant.
NOT_COMPILED = frozenset({"_uniform_kernel"})


@dataclass(frozen=True)
class Variant:
    op: str  # "quantize" | "dequantize" | "accumulate"
    bits: int
    block_size: int
    stochastic: bool = False
    bf16: bool = False  # bfloat16 x (quantize) / out (dequantize)
    guarded: bool = False  # accumulate with a device-side guard (what qcomm.compress launches)
    # Negative controls: compile with fp fusion forced on (must show FMAs), or the _div_probe
    # kernel below (must show a non-IEEE division). They check the checks.
    control: str | None = None  # None | "fma" | "div"

    @property
    def label(self) -> str:
        if self.control == "div":
            return "control: plain fp32 `/`"
        parts = [self.op, f"b{self.bits}", f"bs{self.block_size}"]
        if self.stochastic:
            parts.append("stoch")
        if self.bf16:
            parts.append("bf16")
        if self.guarded:
            parts.append("guard")
        if self.control == "fma":
            parts.insert(0, "control: fp_fusion=True")
        return " ".join(parts)


def default_variants() -> list[Variant]:
    """Every kernel at every code width, at the smallest and the largest block size (the
    largest is the biggest per-thread tile), both rounding modes, the bf16 paths once, and the
    two negative controls."""
    out: list[Variant] = []
    for bits in (1, 2, 4, 8):
        for bs in (32, 4096):
            # 1-bit codes ignore the rounding mode (the launcher compiles one variant)
            for stochastic in (False, True) if bits > 1 else (False,):
                out.append(Variant("quantize", bits, bs, stochastic))
            out.append(Variant("dequantize", bits, bs))
            # the public API's guarded launch at the biggest tile, the gossip's bare one at the
            # smallest: both forms at every width without twice the compiles
            out.append(Variant("accumulate", bits, bs, guarded=bs == 4096))
    out.append(Variant("quantize", 4, 128, stochastic=True, bf16=True))
    out.append(Variant("dequantize", 4, 128, bf16=True))
    out.append(Variant("accumulate", 8, 32, control="fma"))
    out.append(Variant("probe", 0, 0, control="div"))
    return out


@triton.jit
def _div_probe(x_ptr, y_ptr, out_ptr):
    """Negative control: fp32 ``/``, which Triton lowers to an approximate division."""
    i = tl.arange(0, 128)
    tl.store(out_ptr + i, tl.load(x_ptr + i) / tl.load(y_ptr + i))


# ---------------------------------------------------------------------------------------------
# capture the launcher's call


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel: JITFunction, calls: list) -> None:
        self.kernel = kernel
        self.calls = calls

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append((self.kernel, args, kwargs))

        return launch


def module_kernels() -> dict[str, JITFunction]:
    """The module's ``*_kernel`` functions; they must be compilable ``JITFunction`` objects."""
    kernels = {
        name: obj for name, obj in vars(triton_codec).items()
        if name.endswith("_kernel") and not name.startswith("__")
    }
    wrong = {name: type(obj).__name__ for name, obj in kernels.items()
             if not isinstance(obj, JITFunction)}
    if wrong or not kernels:
        raise SystemExit(f"expected triton JITFunction kernels (TRITON_INTERPRET=0), got {wrong}")
    return kernels


def capture(v: Variant) -> tuple[JITFunction, tuple, dict]:
    """Run the public launcher for ``v`` with every kernel replaced by a recorder."""
    spec = QuantSpec(bits=v.bits, block_size=v.block_size,
                     rounding="stochastic" if v.stochastic else "nearest")
    nbytes = packed_nbytes(N, spec)
    calls: list = []
    kernels = module_kernels()
    try:
        for name, kernel in kernels.items():
            setattr(triton_codec, name, _Recorder(kernel, calls))
        if v.op == "quantize":
            x = torch.zeros(N, dtype=torch.bfloat16 if v.bf16 else torch.float32)
            err = torch.zeros(N)
            payload = torch.zeros(nbytes, dtype=torch.uint8)
            triton_codec.quantize_into(x, spec, payload, err, err.clone(), seed=2**63 + 12345)
        elif v.op == "dequantize":
            out = torch.zeros(N, dtype=torch.bfloat16 if v.bf16 else torch.float32)
            triton_codec.dequantize_into(torch.zeros(nbytes, dtype=torch.uint8), spec, out)
        elif v.op == "accumulate":
            payloads = torch.zeros(3, nbytes, dtype=torch.uint8)
            guard = AccumulateGuard(torch.ones(3), torch.empty((), dtype=torch.bool)) \
                if v.guarded else None
            triton_codec.dequant_accumulate_into(payloads, spec, torch.zeros(N), torch.ones(3),
                                                 guard)
        else:
            raise ValueError(f"unknown op {v.op!r}")
    finally:
        for name, kernel in kernels.items():
            setattr(triton_codec, name, kernel)
    if len(calls) != 1:
        raise RuntimeError(f"{v.label}: expected one kernel launch, recorded {len(calls)}")
    kernel, args, kwargs = calls[0]
    if v.control == "fma":
        kwargs = {**kwargs, "enable_fp_fusion": True}
    return kernel, args, kwargs


# ---------------------------------------------------------------------------------------------
# compile and inspect


def _ptx_opcodes(ptx: str) -> set[str]:
    """Distinct instruction opcodes of a PTX module (also inside inline-asm blocks)."""
    ops = set()
    for line in ptx.splitlines():
        line = line.split("//", 1)[0]
        for stmt in line.split(";"):
            stmt = re.sub(r"^\s*(\$?\w+:)?\s*(@!?%\w+\s+)?", "", stmt)  # label, predicate
            m = re.match(r"([a-z][a-z0-9]*(?:\.[a-z0-9_]+)*)(\s|$)", stmt)
            if m:
                ops.add(m.group(1))
    return ops


def _parse_ptxas_log(log: str, name: str) -> dict[str, int]:
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      log)
    if not (regs and frame):
        raise RuntimeError(f"{name}: cannot parse the ptxas -v log:\n{log}")
    return {"regs": int(regs.group(1)), "stack": int(frame.group(1)),
            "spill_stores": int(frame.group(2)), "spill_loads": int(frame.group(3))}


def _res_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` numbers of a cubin (independent of the ptxas log)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", path],
                             capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot parse cuobjdump -res-usage output:\n{out[:2000]}")
    return dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups()), strict=True))


def compile_variant(v: Variant) -> dict[str, Any]:
    backend = make_backend(TARGET)
    if v.control == "div":
        kernel = _div_probe
        signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32"}
        constexprs: dict = {}
        attrs: dict = {}
        options = backend.parse_options({"enable_fp_fusion": False}).__dict__
    else:
        kernel, args, kwargs = capture(v)
        # What JITFunction.run does before compiling, minus the (CUDA) driver.
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        try:
            bound, specialization, opts = binder(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"the launcher's call does not match {kernel.__name__}"
                            f"({', '.join(kernel.arg_names)}): {e}") from e
        parsed, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, opts)
        options = parsed.__dict__
    # ptxas -v prints registers, stack frame and spills; Triton echoes its log to stdout, but
    # only when it runs ptxas: never take a cached binary (variants may repeat in one run).
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=TARGET, options=options)
    seconds = time.perf_counter() - t0
    ptx = compiled.asm["ptx"]
    ops = _ptx_opcodes(ptx)
    names = kernel.arg_names
    return {
        **asdict(v),
        "label": v.label,
        "kernel": kernel.__name__,
        "constexprs": {names[k[0]]: val for k, val in constexprs.items()},
        "num_warps": options["num_warps"],
        "enable_fp_fusion": options["enable_fp_fusion"],
        "seconds": round(seconds, 3),
        **_parse_ptxas_log(log.getvalue(), v.label),
        "res_usage": _res_usage(compiled.asm["cubin"]),
        # float fused multiply-adds (mad.f32 is an fma too), every float division, any other
        # approximate instruction, any flush-to-zero instruction
        "fma": sorted(op for op in ops if re.match(r"(fma|mad)\..*\b[fb]f?(16|32|64)\b", op)),
        "div": sorted(op for op in ops if re.match(r"div\..*\bf(16|32|64)\b", op)),
        "approx": sorted(op for op in ops if ".approx" in op and not op.startswith("div.")),
        "ftz": sorted(op for op in ops if ".ftz" in op),
    }


def run(variants: list[Variant]) -> dict[str, Any]:
    kernels = module_kernels()
    results = []
    for v in variants:
        try:
            results.append(compile_variant(v))
        except Exception as e:
            results.append({**asdict(v), "label": v.label,
                            "error": "".join(traceback.format_exception_only(e)).strip(),
                            "traceback": traceback.format_exc()})
    compiled = {r["kernel"] for r in results if "kernel" in r and r["control"] is None}
    return {
        "triton": triton.__version__,
        "target": f"{TARGET.backend} sm_{TARGET.arch}",
        "uncovered_kernels": sorted(set(kernels) - compiled - NOT_COMPILED),
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON report here instead of stdout")
    ns = parser.parse_args(argv)
    report = run(default_variants())
    text = json.dumps(report, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
