"""Sweep driver of the emulated-cluster benchmark: every method on the same workload, per
layout and inter-node rate; a table on the terminal, JSON, and PNG plots. Needs root (netns.sh).

    sudo .venv/bin/python bench/cluster/compare.py --layouts 2x2 --rates 300mbit --methods all

For each (layout, rate) one cluster is built (netns.sh up), every method runs in it in turn
(netns.sh launch: one torchrun per node), and the cluster is torn down, also on failure or
Ctrl-C. Each run writes a JSON (workload.py); this script derives from it:

- median step time and samples/s, time to ``--target`` test accuracy, final test accuracy;
- inter-node bytes per step and node, counted from the namespaces' interface counters and, for
  qcomm methods, from qcomm's own stats (for torch methods: from the algorithm's formula); the
  two must agree within ``--agree`` (5%);
- the share of a step spent communicating: ``1 - compute-only step / step``;
- the issue's targets for assgd-4 against ddp and the torch peers, met or missed and by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import methods as M

HERE = Path(__file__).resolve().parent
NETNS = HERE / "netns.sh"
WORKLOAD = HERE / "workload.py"

# The targets for assgd-4 (measured side by side with ddp and the torch peers).
TARGET_SPEEDUP = 4.95
TARGET_ACC_POINTS = 1.0
TARGET_BYTES_RATIO = 1 / 7


# ---------------------------------------------------------------------------------------------
# pure parts (unit-tested)


def parse_layout(s: str) -> M.Layout:
    """``"2x2"`` (nodes x procs per node) -> Layout."""
    try:
        nodes, procs = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout must look like NODESxPROCS, e.g. 2x2, got {s!r}") from None
    if nodes < 1 or procs < 1:
        raise ValueError(f"layout needs >= 1 node and >= 1 proc per node, got {s!r}")
    return M.Layout(nodes, procs)


def rate_bits_per_s(rate: str) -> float:
    """tc rate (``100mbit``, ``1gbit``, ``500kbit``, ``800bit``) -> bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, mult in units.items():
        if rate.endswith(unit):
            num = rate[: -len(unit)]
            if num.replace(".", "", 1).isdigit():
                return float(num) * mult
    raise ValueError(f"rate must look like 100mbit or 1gbit, got {rate!r}")


def time_to_target(curve: Sequence[dict[str, float]], target: float) -> float | None:
    """Wall-clock seconds (since the timed window opened) of the first snapshot whose test
    accuracy reaches ``target``; None when none does."""
    for point in curve:
        if point["test_acc"] >= target:
            return point["time_s"]
    return None


def summarize_run(result: dict[str, Any], target: float) -> dict[str, Any]:
    """One run's JSON (workload.py) -> the row of the table.

    Bytes are per training step and per node (what one node puts on its link): interface
    counters are averaged over nodes; qcomm's stats are summed over a node's ranks, then averaged
    over nodes. ``comm_fraction`` is ``1 - compute-only step / step``, averaged over ranks.
    """
    cfg, lay, ranks = result["config"], result["layout"], result["ranks"]
    steps, nodes = cfg["steps"], lay["nodes"]
    step_med = statistics.median(r["step_median_s"] for r in ranks)
    loop = max(r["loop_s"] for r in ranks)
    comm_frac = statistics.fmean(max(0.0, 1.0 - r["baseline_median_s"] / r["step_median_s"])
                                 for r in ranks)
    tx = [r["iface_tx_bytes"] for r in ranks if r["iface_tx_bytes"] is not None]
    iface = sum(tx) / len(tx) / steps if tx else None
    pk = [r["iface_tx_packets"] for r in ranks if r.get("iface_tx_packets") is not None]
    packets = sum(pk) / len(pk) / steps if pk and len(pk) == len(tx) else None
    payload = M.tcp_payload(iface, packets) if packets is not None else None
    qstats = [r["qcomm_bytes"] for r in ranks if r.get("qcomm_bytes") is not None]
    qcomm_inter = (sum(q["inter"] for q in qstats) / nodes / steps) if qstats else None
    qcomm_intra = (sum(q["intra"] for q in qstats) / nodes / steps) if qstats else None
    layout = M.Layout(nodes, lay["procs"])
    expected = M.expected_inter_bytes(
        result["method"], result["model"]["shapes"], layout,
        powersgd_rank=cfg.get("powersgd_rank", 4), localsgd_period=cfg.get("localsgd_period", 8),
        window=(cfg.get("warmup", 0), steps))
    reference = qcomm_inter if qcomm_inter is not None else expected
    ref_kind = "qcomm" if qcomm_inter is not None else ("formula" if expected is not None else None)
    agree = M.agreement(iface, reference) if iface is not None and reference is not None else None
    agree_payload = (M.agreement(payload, reference)
                     if payload is not None and reference is not None else None)
    return {
        "method": result["method"],
        "layout": f"{nodes}x{lay['procs']}",
        "status": "ok",
        "params": result["model"]["params"],
        "step_median_s": step_med,
        "samples_per_s": lay["world"] * cfg["batch"] * steps / loop,
        "time_to_target_s": time_to_target(result["curve"], target),
        "final_test_acc": result["final_test_acc"],
        "inter_bytes_iface": iface,
        "inter_packets_iface": packets,
        "inter_payload_iface": payload,
        "payload_rel_diff": agree_payload,
        "inter_bytes_qcomm": qcomm_inter,
        "intra_bytes_qcomm": qcomm_intra,
        "inter_bytes_formula": expected,
        "bytes_reference": ref_kind,
        "bytes_rel_diff": agree,
        "comm_fraction": comm_frac,
        "compute_step_s": statistics.fmean(r["baseline_median_s"] for r in ranks),
        "fwd_bwd_s": statistics.fmean(r["fwd_bwd_median_s"] for r in ranks),
        "opt_step_s": statistics.fmean(r["opt_step_median_s"] for r in ranks),
        "loop_s": loop,
        "curve": result["curve"],
    }


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets for ``assgd-4`` in one (layout, rate) group of rows: each with
    ``name``, ``ok`` (True/False, None when it cannot be judged), ``value`` and ``need``."""
    by = {r["method"]: r for r in rows if r.get("status") == "ok"}
    a, d = by.get("assgd-4"), by.get("ddp")
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, value: Any, need: str) -> None:
        out.append({"name": name, "ok": ok, "value": value, "need": need})

    if a is None or d is None:
        add("assgd-4 vs ddp", None, None, "needs ok runs of both assgd-4 and ddp")
        return out
    ta, td = a["time_to_target_s"], d["time_to_target_s"]
    if ta is None or td is None:
        add("time-to-target speedup over ddp", None if td is None else False,
            None, f">= {TARGET_SPEEDUP}x (a method did not reach the target)")
    else:
        add("time-to-target speedup over ddp", td / ta >= TARGET_SPEEDUP, td / ta,
            f">= {TARGET_SPEEDUP}x")
    peers = [r for r in by.values() if M.METHODS[r["method"]].family == "torch"]
    for p in peers:
        if p["method"] == "ddp":
            continue
        tp = p["time_to_target_s"]
        ok = None if ta is None else (tp is None or ta < tp)
        add(f"faster than {p['method']}", ok, None if (ta is None or tp is None) else tp / ta,
            "> 1x")
    diff_points = 100.0 * (a["final_test_acc"] - d["final_test_acc"])
    add("final accuracy vs ddp (points)", diff_points >= -TARGET_ACC_POINTS, diff_points,
        f">= -{TARGET_ACC_POINTS}")
    ba, bd = a["inter_bytes_iface"], d["inter_bytes_iface"]
    if ba is not None and bd:
        add("inter-node bytes/step vs ddp", ba / bd <= TARGET_BYTES_RATIO, ba / bd,
            f"<= 1/7 = {TARGET_BYTES_RATIO:.4f}")
    return out


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if v >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def fmt(v: float | None, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table of summarized rows (one per run)."""
    head = ("layout", "rate", "method", "step ms", "samples/s", "t->target s", "final acc",
            "inter B/step (iface)", "(qcomm|formula)", "diff", "diff -hdr", "comm %")
    lines = []
    for r in rows:
        if r.get("status") != "ok":
            lines.append((r["layout"], r["rate"], r["method"], r["status"], "", "", "", "", "",
                          "", "", ""))
            continue
        ref = r["inter_bytes_qcomm"] if r["inter_bytes_qcomm"] is not None else \
            r["inter_bytes_formula"]
        tag = {"qcomm": "q", "formula": "f"}.get(r["bytes_reference"] or "", "")
        lines.append((
            r["layout"], r["rate"], r["method"], fmt(1e3 * r["step_median_s"], ".1f"),
            fmt(r["samples_per_s"], ".0f"), fmt(r["time_to_target_s"], ".1f", "never"),
            fmt(100 * r["final_test_acc"], ".2f"), fmt_bytes(r["inter_bytes_iface"]),
            f"{fmt_bytes(ref)} {tag}".strip(), fmt(None if r["bytes_rel_diff"] is None
                                                   else 100 * r["bytes_rel_diff"], ".2f") + "%",
            fmt(None if r.get("payload_rel_diff") is None else 100 * r["payload_rel_diff"],
                ".2f") + "%",
            fmt(100 * r["comm_fraction"], ".0f"),
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True))
            for line in lines]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# running


def make_data(path: Path, num_samples: int, seed: int) -> None:
    """MNIST-1D generated procedurally (no download), standardized, saved as npz."""
    import numpy as np
    from mnist1d.data import get_dataset_args, make_dataset

    a = get_dataset_args()
    a.num_samples = num_samples
    a.seed = seed
    d = make_dataset(a)
    np.savez(path, x=d["x"].astype(np.float32), y=d["y"].astype(np.int64),
             x_test=d["x_test"].astype(np.float32), y_test=d["y_test"].astype(np.int64))


def netns(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], check=check, **kw)


def run_one(cluster: str, layout: M.Layout, method: str, args: argparse.Namespace,
            data: Path, out_json: Path, log: Path, bar: Any) -> tuple[int, str]:
    """Launch one method on the cluster; stream node 0's progress into ``bar``."""
    out_json.unlink(missing_ok=True)
    cmd = ["bash", str(NETNS), "launch", "--id", cluster, "--nodes", str(layout.nodes),
           "--procs", str(layout.procs), "--timeout", str(args.timeout),
           "--logdir", str(log.parent / log.stem), "--",
           str(WORKLOAD), "--method", method, "--data", str(data), "--out", str(out_json),
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
           "--lr", str(args.lr), "--momentum", str(args.momentum), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--powersgd-rank", str(args.powersgd_rank),
           "--localsgd-period", str(args.localsgd_period), *(["--profile"] if args.profile else [])]
    # torchrun of this interpreter's environment (netns.sh looks for TORCHRUN first).
    torchrun = Path(sys.executable).with_name("torchrun")
    extra = {"TORCHRUN": str(torchrun)} if torchrun.exists() else {}
    env = dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with open(log, "w") as logf, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        tail: list[str] = []
        try:
            for line in proc.stdout:
                logf.write(line)
                if line.startswith("QCB_PROGRESS"):
                    done = int(line.split()[1])
                    bar.update(done - bar.n)
                else:
                    tail = [*tail[-30:], line]
            rc = proc.wait()
        except BaseException:
            # Interrupted (SIGTERM, Ctrl-C): stop the launch, which stops its nodes, before
            # Popen's exit waits for it; the caller then removes the cluster.
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return rc, "".join(tail)


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def plot(rows: Sequence[dict[str, Any]], outdir: Path, target: float) -> list[Path]:
    """Accuracy against wall-clock per (layout, rate), and inter-node bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in rows if r.get("status") == "ok"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in ok:
        groups.setdefault((r["layout"], r["rate"]), []).append(r)
    for (layout, rate), rs in groups.items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        for r in rs:
            t = [p["time_s"] for p in r["curve"]]
            a = [100 * p["test_acc"] for p in r["curve"]]
            style = "-" if M.METHODS[r["method"]].family == "qcomm" else "--"
            ax1.plot(t, a, style, label=r["method"])
        ax1.axhline(100 * target, color="grey", lw=0.8, ls=":")
        ax1.set_xlabel("wall-clock time in the timed window (s)")
        ax1.set_ylabel("test accuracy (%)")
        ax1.set_title(f"MNIST-1D, {layout} (nodes x procs), {rate} between nodes")
        ax1.legend(fontsize=8)
        names = [r["method"] for r in rs]
        iface = [r["inter_bytes_iface"] or 0 for r in rs]
        ax2.bar(names, iface, color=["C0" if M.METHODS[n].family == "torch" else "C1"
                                     for n in names])
        ax2.set_yscale("log")
        ax2.set_ylabel("inter-node bytes per step per node (interface counters)")
        ax2.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        p = outdir / f"acc_time_{layout}_{rate}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="2x2,4x1", help="NODESxPROCS list")
    p.add_argument("--rates", default="100mbit,300mbit,1gbit")
    p.add_argument("--methods", default="all", help="all, torch, qcomm or a comma list")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=12000, help="MNIST-1D, 80%% train")
    p.add_argument("--target", type=float, default=0.70, help="test accuracy for time-to-target")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--localsgd-period", type=int, default=8)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--agree", type=float, default=0.05, help="bytes: allowed relative diff")
    p.add_argument("--out", default="", help="output dir (default bench/out/cluster/<time>)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless every available method finished and bytes agree")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="cProfile every rank's timed steps (runs/<run>.json.prof<rank>.txt)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("compare.py: needs root (netns.sh creates network namespaces, a bridge and tc "
              "qdiscs); run it as root or with sudo", file=sys.stderr)
        return 1
    from tqdm import tqdm

    layouts = [parse_layout(s) for s in args.layouts.split(",")]
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        rate_bits_per_s(r)
    names = M.parse_methods(args.methods)
    outdir = Path(args.out or HERE.parent / "out" / "cluster" / time.strftime("%Y%m%d-%H%M%S"))
    (outdir / "runs").mkdir(parents=True, exist_ok=True)
    env = environment()
    print(f"environment: {json.dumps(env)}")
    data = outdir / "mnist1d.npz"
    make_data(data, args.num_samples, args.seed)

    # SIGTERM (e.g. from a CI timeout) must run the `finally` that removes the cluster.
    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    netns("clean")
    rows: list[dict[str, Any]] = []
    combos = [(lay, rate) for lay in layouts for rate in rates]
    overall = tqdm(total=len(combos) * len(names), desc="runs", position=0, leave=True)
    for lay, rate in combos:
        cluster = secrets.token_hex(3)
        tag = f"{lay.nodes}x{lay.procs}"
        try:
            netns("up", "--id", cluster, "--nodes", str(lay.nodes), "--rate", rate,
                  "--owner", str(os.getpid()))
            for name in names:
                overall.set_description(f"{tag} {rate} {name}")
                base = {"method": name, "layout": tag, "rate": rate}
                ok, why = M.availability(name)
                if not ok:
                    rows.append({**base, "status": why})
                    overall.update(1)
                    continue
                stem = f"{tag}_{rate}_{name}"
                out_json = outdir / "runs" / f"{stem}.json"
                with tqdm(total=args.steps, desc=f"  {name}", position=1, leave=False) as bar:
                    rc, tail = run_one(cluster, lay, name, args, data, out_json,
                                       outdir / "runs" / f"{stem}.log", bar)
                if rc != 0 or not out_json.exists():
                    tqdm.write(f"{stem}: FAILED (exit {rc}); log {outdir}/runs/{stem}.log\n"
                               f"{tail}")
                    rows.append({**base, "status": f"failed (exit {rc})"})
                else:
                    row = summarize_run(json.loads(out_json.read_text()), args.target)
                    rows.append({**row, "rate": rate})
                overall.update(1)
        finally:
            netns("down", "--id", cluster, check=False)
    overall.close()

    print()
    print(table(rows))
    checks = {}
    for lay, rate in combos:
        tag = f"{lay.nodes}x{lay.procs}"
        group = [r for r in rows if r["layout"] == tag and r["rate"] == rate]
        checks[f"{tag} {rate}"] = c = check_targets(group)
        print(f"\ntargets, {tag} at {rate} (target accuracy {100 * args.target:.0f}%):")
        for t in c:
            mark = {True: "met", False: "MISSED", None: "n/a"}[t["ok"]]
            val = "-" if t["value"] is None else f"{t['value']:.3f}"
            print(f"  {t['name']:<36} {mark:<7} value {val:<9} need {t['need']}")
    bad_bytes = [r for r in rows if r.get("status") == "ok" and r["bytes_reference"] == "qcomm"
                 and (r["bytes_rel_diff"] is None or r["bytes_rel_diff"] > args.agree)]
    failed = [r for r in rows if r.get("status", "").startswith("failed")]
    summary = {"environment": env, "args": vars(args), "rows": rows, "targets": checks,
               "bytes_disagree": [r["method"] for r in bad_bytes],
               "failed": [f"{r['layout']} {r['rate']} {r['method']}" for r in failed]}
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.no_plots:
        for p in plot(rows, outdir, args.target):
            print(f"plot: {p}")
    print(f"json: {outdir / 'summary.json'}")
    if bad_bytes:
        print(f"bytes disagree by more than {100 * args.agree:.0f}% for "
              f"{[r['method'] for r in bad_bytes]}")
    if args.strict and (failed or bad_bytes):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
