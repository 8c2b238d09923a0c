"""Smoke tests of ``bench/kernels.py``: the script runs, checks its outputs, and its JSON holds
every row it claims. Timings are not judged here (this machine is shared and has no GPU)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "kernels.py"
ROW_FIELDS = {"op", "bits", "numel", "size", "impl", "backend", "bytes", "status", "verified",
              "median_s", "times_s", "gbps", "copy_gbps", "ratio_copy", "vs_eager",
              "vs_compiled", "compile_s", "error"}


def _load_bench():
    # pytest puts the repository root on sys.path (tests/ is a package): `bench` imports.
    return importlib.import_module("bench.kernels")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One ``--quick`` run on CPU, shared by the tests below: its process and its JSON."""
    tmp = tmp_path_factory.mktemp("kernels")
    out = tmp / "kernels.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "QCOMM_BACKEND": "reference"}
    # Small and 1 thread: other test processes share this machine's cores.
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--threads", "1",
           "--repeat", "1", "--warmup", "0", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"stdout": proc.stdout, "data": json.loads(out.read_text())}


def test_quick_run_prints_its_environment_and_the_table(quick: dict) -> None:
    assert "# environment" in quick["stdout"] and "torch:" in quick["stdout"]
    assert "copy GB/s" in quick["stdout"]  # the table


def test_quick_run_json_is_complete_with_the_quick_config(quick: dict) -> None:
    data = quick["data"]
    assert data["complete"] is True and data["exit_code"] == 0
    cfg = data["config"]
    assert cfg["sizes"] == [64 << 10] and cfg["bits"] == [1, 2, 4, 8]
    assert cfg["impls"] == ["qcomm", "qcomm-nb", "kernel", "reference", "eager"]
    assert set(data["env"]) >= {"torch", "triton", "cpu_count", "device", "env"}


def test_quick_run_times_a_copy_of_each_size(quick: dict) -> None:
    data = quick["data"]
    assert [c["numel"] for c in data["copy"]] == data["config"]["sizes"]
    assert all(c["gbps"] > 0 for c in data["copy"])


def test_quick_run_has_one_row_per_op_bits_size_and_impl(quick: dict) -> None:
    cfg, rows = quick["data"]["config"], quick["data"]["rows"]
    want = {(op, b, n, impl) for op in cfg["ops"] for b in cfg["bits"] for n in cfg["sizes"]
            for impl in cfg["impls"]}
    assert {(r["op"], r["bits"], r["numel"], r["impl"]) for r in rows} == want
    assert len(rows) == len(want)
    for r in rows:
        assert set(r) >= ROW_FIELDS, r


def test_quick_run_skips_the_reference_row_on_the_reference_backend(quick: dict) -> None:
    # The CPU backend is the reference: not run twice.
    assert {r["status"] for r in quick["data"]["rows"] if r["impl"] == "reference"} == {"skipped"}


def test_quick_run_rows_are_verified_and_their_rates_follow_from_their_times(quick: dict) -> None:
    for r in quick["data"]["rows"]:
        if r["impl"] == "reference":
            continue
        assert r["status"] == "ok" and r["verified"] is True, r
        assert r["gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        assert r["ratio_copy"] == pytest.approx(r["gbps"] / r["copy_gbps"])
        assert r["vs_eager"] is not None and r["vs_compiled"] is None


def test_quick_run_counts_the_bytes_each_op_moves(quick: dict) -> None:
    nbytes = {(r["op"], r["bits"]): r["bytes"] for r in quick["data"]["rows"]}
    n = 64 << 10
    # quantize: fp32 in, residual in and out, 4-bit codes, one fp32 scale per 128
    assert nbytes[("quantize", 4)] == 12 * n + n // 2 + 4 * (n // 128)
    # accumulate: 4 payloads of 8-bit codes and scales in, fp32 accumulator in and out
    assert nbytes[("accumulate", 8)] == 4 * (n + 4 * (n // 128)) + 8 * n


def test_broken_kernel_and_failed_compile_are_reported(tmp_path: Path, monkeypatch,
                                                        capsys) -> None:
    """A kernel whose bytes are wrong is an error (exit 1); a torch.compile failure is
    reported in its rows without ending the run."""
    bench = _load_bench()
    from qcomm.kernels.backend import ReferenceBackend

    class Broken(ReferenceBackend):
        def quantize_into(self, x, spec, payload, error_in, error_out, seed):
            super().quantize_into(x, spec, payload, error_in, error_out, seed)
            payload[0] ^= 1

    def failing_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(bench.codec_backends, "backend_for", lambda device: Broken())
    monkeypatch.setattr(torch, "compile", failing_compile)
    # Leave torch._dynamo's global config alone for the other tests in this process.
    monkeypatch.setattr(bench, "configure_dynamo", lambda: None)
    out = tmp_path / "k.json"
    # No per-call group: its default 1M-element stream costs a minute here and is not judged.
    rc = bench.main(["--device", "cpu", "--sizes", "4K", "--bits", "2", "--ops", "quantize",
                     "--impls", "kernel,eager,compiled", "--repeat", "1", "--warmup", "0",
                     "--per-call-sizes", "none", "--json", str(out)])
    capsys.readouterr()
    assert rc == 1
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kernel"]["status"] == "error" and "payload differs" in rows["kernel"]["error"]
    assert rows["eager"]["status"] == "ok"
    assert rows["compiled"]["status"] == "compile_error"
    assert "no compiler here" in rows["compiled"]["error"]


def _run_baseline(bench, tmp_path: Path, source: str) -> tuple[int, dict]:
    """bench/kernels.py with --baseline a reference module of ``source``: exit code and rows
    by impl."""
    path = tmp_path / "old_reference.py"
    path.write_text(source)
    out = tmp_path / "k.json"
    rc = bench.main(["--device", "cpu", "--sizes", "4K", "--bits", "4", "--ops", "quantize",
                     "--impls", "kernel,baseline", "--baseline", str(path), "--repeat", "1",
                     "--warmup", "0", "--per-call-sizes", "none", "--json", str(out)])
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    return rc, rows


def test_baseline_rows_are_timed_beside_the_kernel(tmp_path: Path, capsys) -> None:
    """--baseline PATH times another version of the reference side by side (x baseline = its
    time / a row's time)."""
    bench = _load_bench()
    reference = (REPO / "qcomm" / "kernels" / "reference.py").read_text()
    rc, rows = _run_baseline(bench, tmp_path, reference)
    assert "x baseline" in capsys.readouterr().out
    assert rc == 0
    assert rows["baseline"]["status"] == "ok" and rows["baseline"]["verified"]
    assert rows["kernel"]["vs_baseline"] == pytest.approx(
        rows["baseline"]["median_s"] / rows["kernel"]["median_s"])


def test_a_baseline_with_wrong_bytes_is_an_error(tmp_path: Path, capsys) -> None:
    """The baseline is held to the current reference's bytes like the kernel row."""
    bench = _load_bench()
    broken = ((REPO / "qcomm" / "kernels" / "reference.py").read_text()
              + "\n\n_orig = quantize_into\n\n"
              "def quantize_into(x, spec, payload, *args):\n"
              "    _orig(x, spec, payload, *args)\n"
              "    payload[0] ^= 1\n")
    rc, rows = _run_baseline(bench, tmp_path, broken)
    assert "x baseline" in capsys.readouterr().out
    assert rc == 1
    assert "payload differs" in rows["baseline"]["error"]


def test_the_baseline_row_needs_its_file() -> None:
    with pytest.raises(SystemExit):
        _load_bench().parse_args(["--impls", "baseline"])


def test_a_misspelled_implementation_names_the_nearest(capsys) -> None:
    with pytest.raises(SystemExit):
        _load_bench().parse_args(["--impls", "qcom"])
    assert "['qcom'] not in" in (err := capsys.readouterr().err)
    assert err.rstrip().endswith("; did you mean 'qcomm'?")


def test_targets_pass_and_fail() -> None:
    """The kernel rows against the copy (85% for quantize, 90% for dequant-accumulate) and
    eager; the API rows against their kernel's time (within 10%)."""
    bench = _load_bench()
    n = 64 << 20

    def row(impl: str, ratio: float, vs_eager: float, op: str = "quantize",
            over_kernel: float | None = None) -> dict:
        return {"op": op, "bits": 4, "numel": n, "impl": impl, "status": "ok",
                "ratio_copy": ratio, "vs_eager": vs_eager, "over_kernel": over_kernel}

    good = bench.check_targets([row("kernel", 0.9, 5.0), row("qcomm", 0.5, 1.0, over_kernel=1.08),
                                row("qcomm-nb", 0.5, 1.0, over_kernel=1.02)])
    assert [t["passed"] for t in good] == [True, True, True, True]
    assert "qcomm within 10% of its kernel" in good[2]["target"]
    bad = bench.check_targets([row("kernel", 0.8, 2.0), row("qcomm", 0.5, 1.0, over_kernel=1.2)])
    assert [t["passed"] for t in bad] == [False, False, False]
    acc = bench.check_targets([row("kernel", 0.88, 5.0, op="accumulate")])
    assert [t["passed"] for t in acc] == [False, True]
    assert acc[0]["target"] == "dequant_acc 4b 64M: >= 90% of copy"


def test_per_call_targets_judge_the_non_blocking_api_at_1m() -> None:
    bench = _load_bench()

    def row(impl: str, n: int, us: float) -> dict:
        return {"op": "accumulate", "bits": 4, "numel": n, "size": "1M", "impl": impl,
                "per_call_s": us * 1e-6}

    got = bench.per_call_targets([row("qcomm-nb", 1 << 20, 12.0), row("qcomm", 1 << 20, 40.0),
                                  row("qcomm-nb", 6400 << 10, 30.0)])
    assert [(t["passed"], t["detail"]) for t in got] == [(True, "12.0 us")]
    assert not bench.per_call_targets([row("qcomm-nb", 1 << 20, 20.0)])[0]["passed"]
    graphed = bench.per_call_targets([row("qcomm-nb", 1 << 20, 25.0),
                                      row("qcomm-nb graph", 1 << 20, 6.5)])
    assert [(t["passed"], t["detail"]) for t in graphed] == [
        (False, "25.0 us; in a CUDA graph 6.5 us")]  # shown beside, judged on the eager calls
    failed = {**row("qcomm-nb", 1 << 20, 1.0), "per_call_s": None, "error": "RuntimeError: x"}
    assert [(t["passed"], t["detail"]) for t in bench.per_call_targets([failed])] == [
        (False, "RuntimeError: x")]


def test_targets_without_a_large_row_do_not_pass() -> None:
    assert _load_bench().check_targets([])[0]["passed"] is False  # nothing at >= 64M


@pytest.mark.parametrize("text,value", [("64K", 65536), ("1M", 1 << 20), ("3000", 3000)])
def test_parse_size(text: str, value: int) -> None:
    from bench.common import format_size, parse_size

    assert parse_size(text) == value
    assert parse_size(format_size(value)) == value


def test_per_call_rows_time_the_api_both_ways_and_the_kernel(tmp_path: Path, capsys) -> None:
    bench = _load_bench()
    out = tmp_path / "k.json"
    rc = bench.main(["--device", "cpu", "--sizes", "4K", "--bits", "4", "--impls",
                     "qcomm,kernel", "--per-call-sizes", "4K", "--repeat", "2", "--warmup", "0",
                     "--threads", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out.read_text())["per_call"]
    assert {(r["op"], r["impl"]) for r in rows} == {
        (op, impl) for op in ("quantize", "accumulate") for impl in ("qcomm", "qcomm-nb", "kernel")}
    for r in rows:
        assert r["numel"] == 4096 and r["bits"] == 4 and len(r["runs_s"]) == 2
        assert r["per_call_s"] > 0 and r["calls"] == 200
    assert "per call, 200 calls back to back" in printed
