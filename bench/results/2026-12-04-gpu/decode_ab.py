"""Side-by-side timing of two builds of the Triton dequant kernels on one GPU (the run of
2026-12-04 on an H200; see README.md beside this file).

``old``: the kernels of commit 9c14dd6, saved with
``git show 9c14dd6:qcomm/kernels/triton_codec.py > .scratch/old_codec.py``. ``new`` and the
launch variants: ``qcomm.kernels.triton_codec`` of the working tree, which held the decode
variant under test (``decode-3d.patch``). Outputs must be bit-equal to ``old``'s; times are
triton.testing.do_bench medians (L2 cleared before each call), two interleaved rounds.

    python3 bench/results/2026-12-04-gpu/decode_ab.py
"""

from __future__ import annotations

import importlib.util
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, ".")
from qcomm.kernels import reference
from qcomm.kernels import triton_codec as new
from qcomm.kernels.wire_format import (
    QuantSpec,
    codes_nbytes,
    num_blocks,
    packed_nbytes,
    split_payload,
)

DEV = "cuda"
K = 4


def load_old():
    spec = importlib.util.spec_from_file_location("old_codec", ".scratch/old_codec.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launcher(warps: int, tile: int):
    """The working tree's accumulate kernel with another num_warps / tile size."""
    def run(payloads, spec, out, weights):
        n = out.numel()
        k, nbytes = payloads.shape
        rows = max(1, tile // spec.block_size)
        nb = num_blocks(n, spec)
        new._dequant_accumulate_kernel[(triton.cdiv(nb, rows),)](
            payloads, split_payload(payloads, n, spec)[1], out, weights,
            n, nb, codes_nbytes(n, spec), k, nbytes, nbytes // 4,
            BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows, HAS_WEIGHTS=False,
            num_warps=warps, enable_fp_fusion=False)
    return run


def median_ms(fn) -> float:
    return statistics.median(do_bench(fn, return_mode="all", rep=150))


def copy_gbs(n: int) -> float:
    a = torch.empty(n, device=DEV)
    b = torch.empty(n, device=DEV)
    return 8 * n / median_ms(lambda: b.copy_(a)) / 1e6


def compare(old, variants: dict, n: int, bits: int, copy: float) -> str:
    """One line: bit-equality and % of copy bandwidth of every variant at (n, bits)."""
    spec = QuantSpec(bits, 128, "nearest")
    nbytes = packed_nbytes(n, spec)
    payloads = torch.empty(K, nbytes, dtype=torch.uint8, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(bits)
    for i in range(K):
        x = torch.randn(n, device=DEV, generator=g)
        reference.quantize_into(x, spec, payloads[i], None, None, 1)
    out0 = torch.randn(n, device=DEV, generator=g)
    want = out0.clone()
    old.dequant_accumulate_into(payloads, spec, want, None)
    d_old = torch.empty(n, device=DEV)
    d_new = torch.empty(n, device=DEV)
    old.dequantize_into(payloads[0], spec, d_old)
    new.dequantize_into(payloads[0], spec, d_new)
    line = f"{bits}b {n >> 20}M deq_equal={torch.equal(d_old, d_new)}"
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(2):
        for name, fn in variants.items():
            out = out0.clone()
            fn(payloads, spec, out, None)
            if rnd == 0 and not torch.equal(out, want):
                line += f" {name}:UNEQUAL"
            times[name].append(median_ms(lambda fn=fn, out=out: fn(payloads, spec, out, None)))
    for name, ts in times.items():
        t = statistics.median(ts)
        line += f" | {name} {t:.3f}ms {100 * (K * nbytes + 8 * n) / t / 1e6 / copy:.1f}%"
    for name, mod in (("old", old), ("new", new)):
        t = median_ms(lambda mod=mod: mod.dequantize_into(payloads[0], spec, d_new))
        line += f" | deq {name} {100 * (nbytes + 4 * n) / t / 1e6 / copy:.1f}%"
    return line


def main() -> None:
    old = load_old()
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)
    variants = {"old": old.dequant_accumulate_into, "new": new.dequant_accumulate_into,
                "new_w8": launcher(8, 2048), "new_t4k_w8": launcher(8, 4096),
                "new_t1k_w4": launcher(4, 1024)}
    for n in (64 << 20, 256 << 20):
        copy = copy_gbs(n)
        print(f"copy {n >> 20}M {copy:.0f} GB/s", flush=True)
        for bits in (1, 2, 4, 8):
            print(compare(old, variants, n, bits, copy), flush=True)


if __name__ == "__main__":
    main()
