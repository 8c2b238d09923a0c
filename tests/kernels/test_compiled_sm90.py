"""The Triton codec kernels compiled for sm_90 (H100/H200), checked on their PTX and ptxas report.

Why this exists: CI runs the kernels only under ``TRITON_INTERPRET=1``, which executes the Python
body with numpy and never sees what the compiler makes of it. The bit-exactness of
``qcomm.kernels.triton_codec`` against the CPU reference rests on properties of the compiled code
that the interpreter cannot break and so cannot test:

* no FMA contraction (the launchers pass ``enable_fp_fusion=False``): no ``fma.``/``mad.`` on
  floats in the PTX;
* IEEE division: every float division is ``div.rn`` (``tl.math.div_rn``), never ``div.full``
  or ``div.approx`` (what plain ``/`` on fp32 becomes), and no ``.approx`` instruction at all;
* no flush-to-zero: no ``.ftz`` instruction (subnormal scales must survive);
* no register spills: ptxas reports 0 bytes of spill stores and loads and cuobjdump
  ``LOCAL:0`` (spills would not break exactness, only the memory-bound performance the tile
  sizes were chosen for). The stack frame is reported, not asserted: ptxas also puts small
  local arrays there that are no spill.

No GPU is needed: ``compile_sm90.py`` (run in a subprocess, with ``TRITON_INTERPRET=0``) compiles
for ``GPUTarget("cuda", 90, 32)`` with the ptxas and cuobjdump bundled in Triton's wheel, taking
the signature, constexprs and launch options from the kernels' own launchers. It compiles every
kernel at every code width (block sizes 32 and 4096, both rounding modes, the bf16 paths once)
and two negative controls, which must trip the checks: the accumulate kernel with fp fusion
forced on (must show an FMA) and a probe kernel dividing with plain ``/``.

The test is skipped only where Triton or its bundled NVIDIA tools are missing (e.g. macOS). It
also runs unchanged in a GPU session (``bench/gpu_check.sh``, ``TRITON_INTERPRET=0``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HELPER = Path(__file__).with_name("compile_sm90.py")
REPO = Path(__file__).resolve().parents[2]
IEEE_DIVISIONS = frozenset({"div.rn.f32", "div.rn.f64"})


def _require_toolchain() -> None:
    """Skip where the sm_90 toolchain is absent; on Linux with Triton installed it is there."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as e:
        pytest.skip(f"this triton has no NVIDIA backend: {e}")
    try:
        get_ptxas(90)
        _ = triton.knobs.nvidia.cuobjdump
    except RuntimeError as e:  # raised by triton when the binary cannot be found
        pytest.skip(f"triton's bundled ptxas/cuobjdump is not available: {e}")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _require_toolchain()
    tmp = tmp_path_factory.mktemp("sm90")
    out = tmp / "report.json"
    env = dict(os.environ)
    # The real JITFunction, a throwaway cache (the helper recompiles anyway), the repository's
    # qcomm, and no global fusion override that would mask the launch options.
    env["TRITON_INTERPRET"] = "0"
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TRITON_DEFAULT_FP_FUSION", None)
    env.pop("TRITON_FORCE_DISABLE_FP_FUSION", None)
    proc = subprocess.run([sys.executable, str(HELPER), "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        pytest.fail(f"{HELPER.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _table(results: list[dict[str, Any]]) -> str:
    head = f"{'variant':42} {'warps':>5} {'regs':>4} {'stack':>5} {'spill st/ld':>11} {'s':>5}"
    rows = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            rows.append(f"{r['label']:42} compile error")
            continue
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        rows.append(f"{r['label']:42} {r['num_warps']:5} {r['regs']:4} {r['stack']:5} "
                    f"{spills:>11} {r['seconds']:5.2f}")
    return "\n".join(rows)


def _violations(r: dict[str, Any]) -> list[str]:
    """What is wrong with one compiled variant (empty: nothing)."""
    found = []
    if r["enable_fp_fusion"]:
        found.append("launched with enable_fp_fusion=True")
    if r["fma"]:
        found.append(f"fused multiply-add {r['fma']}")
    if set(r["div"]) - IEEE_DIVISIONS:
        found.append(f"non-IEEE division {sorted(set(r['div']) - IEEE_DIVISIONS)}")
    if r["approx"]:
        found.append(f"approximate instructions {r['approx']}")
    if r["ftz"]:
        found.append(f"flush-to-zero instructions {r['ftz']}")
    if r["spill_stores"] or r["spill_loads"]:
        found.append(f"register spills ({r['spill_stores']} B stored, {r['spill_loads']} B loaded"
                     f" at {r['regs']} registers)")
    if r["res_usage"]["local"]:
        found.append(f"local memory {r['res_usage']['local']} B")
    return found


def test_sm90_compiled_code(report: dict[str, Any],
                            record_property: Callable[[str, object], None]) -> None:
    """Every kernel variant compiles for sm_90 without FMAs, non-IEEE divisions, ftz or spills.

    The register table is part of the failure message and of the JUnit XML report
    (``--junitxml``), never printed on a pass: a passing test run stays quiet.
    ``python tests/kernels/compile_sm90.py`` prints the whole report by hand."""
    variants = [r for r in report["results"] if r["control"] is None]
    table = _table(variants)
    record_property("sm90_register_table", f"triton {report['triton']}\n{table}")
    problems = []
    if report["uncovered_kernels"]:
        problems.append(f"kernels not compiled by any variant: {report['uncovered_kernels']}")
    for r in variants:
        if "error" in r:
            problems.append(f"{r['label']}: does not compile for sm_90:\n{r['error']}")
        else:
            problems += [f"{r['label']}: {v}" for v in _violations(r)]
    assert not problems, (
        f"{len(problems)} problem(s) in the sm_90 code of the Triton codec:\n"
        + "\n".join(problems) + f"\n\n{table}"
    )


def test_sm90_checks_catch_violations(report: dict[str, Any]) -> None:
    """The negative controls trip the checks, so a clean result above is not a blind check."""
    controls = {r["control"]: r for r in report["results"] if r["control"] is not None}
    assert set(controls) == {"fma", "div"}, f"missing controls: {sorted(controls)}"
    for r in controls.values():
        assert "error" not in r, f"{r['label']}: does not compile:\n{r['error']}"
    fma, div = controls["fma"], controls["div"]
    assert any("fused multiply-add" in v for v in _violations(fma)), (
        f"{fma['label']}: no FMA found in the PTX with fusion on (fma={fma['fma']}): "
        "the FMA check cannot see FMAs"
    )
    assert any("non-IEEE division" in v for v in _violations(div)), (
        f"{div['label']}: plain `/` not flagged (div={div['div']}): the division check is blind"
    )


def test_sm90_decode_crosses_no_shared_memory(report: dict[str, Any]) -> None:
    """At the smallest block size (many rows per tile) and the largest (one block laid out as
    rows of 512), the 1-, 2- and 4-bit decode of dequantize and of dequantize-accumulate hands
    each thread its own code bits: no shared memory (and so no barrier per payload). A byte
    tile vectorized across threads would take 1024 B here."""
    decodes = [r for r in report["results"] if r["control"] is None and "error" not in r
               and r["op"] in ("dequantize", "accumulate") and r["bits"] < 8
               and not r["bf16"]]
    assert {r["block_size"] for r in decodes} == {32, 4096}
    assert len(decodes) == 12, [r["label"] for r in decodes]
    shared = {r["label"]: r["res_usage"]["shared"] for r in decodes}
    assert not any(shared.values()), f"shared memory per block: {shared}"
