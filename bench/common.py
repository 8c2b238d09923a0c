"""Helpers shared by qcomm's benchmarks: size parsing, the environment record, median timing on
CPU and CUDA, a same-run copy-bandwidth baseline, plain-text tables and JSON output.

Benchmarks run as scripts (``python bench/kernels.py``) from a checkout that need not be
pip-installed; :func:`add_repo_to_path` makes ``qcomm`` and ``bench`` importable from there.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# Bigger than any GPU's last-level cache (H200: 60 MB of L2): zeroing it before every timed call
# evicts the previous call's data, so small sizes measure DRAM, not L2 (as triton's do_bench).
CUDA_FLUSH_BYTES = 256 << 20


def add_repo_to_path() -> None:
    """Put the repository root first on sys.path (the package is not installed on GPU hosts)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def use_qcomm_from(checkout: str | None) -> None:
    """Put ``checkout`` (another clone of the repository, for before/after comparisons) first
    on sys.path, so that ``import qcomm`` takes its package; None: this one. Call it before
    anything imports qcomm."""
    root = str(Path(checkout).resolve()) if checkout else str(REPO_ROOT)
    sys.path.insert(0, root)


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"3000"`` -> 3000 (binary suffixes K, M, G)."""
    t = text.strip().upper()
    mult = 1
    if t and t[-1] in _SUFFIXES:
        mult = _SUFFIXES[t[-1]]
        t = t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise ValueError(
            f"size must be an int with an optional K/M/G suffix, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    """Inverse of :func:`parse_size` where exact (1048576 -> "1M"), else the plain number."""
    for suffix in ("G", "M", "K"):
        mult = _SUFFIXES[suffix]
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def parse_list(text: str, item: Callable[[str], object], name: str) -> list:
    """Comma-separated list, each item parsed by ``item``; ValueError names the option."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{name} must be a non-empty comma-separated list, got {text!r}")
    try:
        return [item(p.strip()) for p in parts]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints), or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(device: torch.device) -> dict:
    """Everything that changes the numbers: versions, device, threads, relevant env vars, and
    how busy the machine was at the start (CPU figures on a shared machine depend on it)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_runtime": torch.version.cuda,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "cpu"),
        "git_commit": _git_commit(),
        "env": {k: os.environ.get(k) for k in ("QCOMM_BACKEND", "TRITON_INTERPRET",
                                                "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")},
    }
    return env


def print_environment(env: dict, file=None) -> None:
    file = sys.stdout if file is None else file  # looked up per call (pytest swaps sys.stdout)
    print("# environment", file=file)
    for key, value in env.items():
        if key == "env":
            for var, val in value.items():
                print(f"  {var}={val if val is not None else '(unset)'}", file=file)
        else:
            print(f"  {key}: {value}", file=file)
    file.flush()


class Timer:
    """Median wall time of a callable on one device.

    CUDA: one pair of events around each call, the L2 cache flushed before each call outside
    the events, one synchronize at the end, so the figures are device time per call (host work
    that leaves the GPU idle, e.g. a host sync inside the call, is included: it costs users too).
    CPU: ``time.perf_counter`` around each call.
    """

    def __init__(self, device: torch.device, repeat: int, warmup: int):
        if repeat < 1 or warmup < 0:
            raise ValueError(f"repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
        self.device = device
        self.repeat = repeat
        self.warmup = warmup
        self._flush = (torch.empty(CUDA_FLUSH_BYTES, dtype=torch.uint8, device=device)
                       if device.type == "cuda" else None)

    def times(self, fn: Callable[[], object]) -> list[float]:
        """Seconds per call, ``repeat`` of them, after ``warmup`` untimed calls."""
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            out = []
            for _ in range(self.repeat):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeat)]
        torch.cuda.synchronize(self.device)
        for start, end in zip(starts, ends, strict=True):
            self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]

    def median(self, fn: Callable[[], object]) -> tuple[float, list[float]]:
        ts = self.times(fn)
        return statistics.median(ts), ts

    def per_call_in_a_stream(self, fn: Callable[[], object],
                             calls: int) -> tuple[float, list[float]]:
        """Seconds per call of ``calls`` back-to-back calls with no sync between them (the
        host's work for one call overlaps the device's work for the ones before, as in a
        training step), wall time over the whole run to the device's last call; the median of
        ``repeat`` such runs, and the runs. After ``warmup`` untimed calls."""
        for _ in range(self.warmup):
            fn()
        self.synchronize()
        runs = []
        for _ in range(self.repeat):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            self.synchronize()
            runs.append((time.perf_counter() - t0) / calls)
        return statistics.median(runs), runs

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def copy_bandwidth(timer: Timer, numel: int) -> dict:
    """Same-run baseline: ``dst.copy_(src)`` of ``numel`` float32 on the timer's device.
    Logical bytes = 2 * 4 * numel (one read, one write)."""
    src = torch.randn(numel, device=timer.device)
    dst = torch.empty_like(src)
    med, ts = timer.median(lambda: dst.copy_(src))
    nbytes = 8 * numel
    return {"numel": numel, "bytes": nbytes, "median_s": med, "times_s": ts,
            "gbps": nbytes / med / 1e9}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Fixed-width text table; numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_num(row[i]) for row in rows if row[i] not in (None, ""))
               for i in range(len(headers))]
    lines = []
    for j, row in enumerate(cells):
        parts = [c.rjust(w) if numeric[i] else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:  # NaN
            return "nan"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_json(path: Path, data: dict) -> None:
    """Write atomically (tmp + rename): a run killed by a timeout leaves the last full write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/common.py is a library of qcomm's benchmarks (sizes, timers, the copy baseline, "
        "tables, JSON), imported by bench/kernels.py and bench/checksum.py; it runs nothing. See "
        "bench/README.md."
    )
