"""Rerun the "who wins where" comparison in one command: the decisive cells, healthy and in each
scenario of the real world (one slow node, 50 ms of latency, a lost node), every method with the
peers at their tuned settings, medians of 3; one markdown table at the end.

    sudo python bench/cluster/decisive.py --out bench/out/decisive
    python bench/cluster/decisive.py --dry-run            # the commands, nothing run

Each scenario is one ``compare.py`` sweep (root: network namespaces) into ``OUT/<scenario>/``;
``scenarios.py`` then puts their ``summary.json`` side by side into ``OUT/table.md``. On the
2-vCPU machine the results were measured on, the default takes about 3 hours (DDP at 100 Mbit/s
is 2 minutes a run): ``--scenarios``, ``--layouts`` and ``--rates`` run a part of it.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The peers at the best setting of their own grid on MNIST-1D (bench/RESULTS.md, "Peers tuned"),
# qcomm's recommended setting, and its wait-free variants where nodes may differ in pace.
METHODS = (
    "ddp", "ddp-powersgd-r4", "localsgd-p32", "torchft-diloco-h32-o7-m5",
    "torchft-streaming-diloco-h32-o7-m5", "assgd-2-h16f4-g80-m9-o5-n-ddp",
    "assgd-2-h16f4-g80-m9-o5-n-ddp-cont",
)

# What each scenario adds to the sweep's command line.
SCENARIOS: dict[str, list[str]] = {
    "healthy": [],
    "slow": ["--slow-nodes", "1", "--slowdown", "2"],
    "latency": ["--delay-ms", "50"],
    "lost": ["--kill-node", "1", "--kill-at", "0.33"],
}


def sweep_command(scenario: str, out: Path, args: argparse.Namespace) -> list[str]:
    """The ``compare.py`` command line of one scenario."""
    return [sys.executable, str(HERE / "compare.py"), "--workload", "mnist1d",
            "--layouts", args.layouts, "--rates", args.rates, "--target", str(args.target),
            "--methods", ",".join(args.methods), "--repeats", str(args.repeats),
            "--time-budget", str(args.time_budget), "--pg-timeout", "30", "--no-plots",
            "--out", str(out / scenario), *SCENARIOS[scenario]]


def table_command(scenarios: list[str], out: Path) -> list[str]:
    """The ``scenarios.py`` command that puts the sweeps side by side."""
    pairs = [f"{s}={out / s / 'summary.json'}" for s in scenarios]
    slow = ["--fast-nodes-of", "slow:1"] if "slow" in scenarios else []
    return [sys.executable, str(HERE / "scenarios.py"), *pairs, *slow,
            "--json", str(out / "table.json")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out/decisive",
                   help="Where each scenario's sweep and the table go.")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"Which scenarios to run, a comma list of {', '.join(SCENARIOS)}.")
    p.add_argument("--layouts", default="4x1,2x2", help="The layouts of every sweep.")
    p.add_argument("--rates", default="100mbit,1gbit", help="The link rates of every sweep.")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="The methods of every sweep (default: the peers tuned, and qcomm).")
    p.add_argument("--repeats", type=int, default=3, help="Interleaved runs per cell.")
    p.add_argument("--target", type=float, default=0.65, help="Test accuracy to reach.")
    p.add_argument("--time-budget", type=float, default=8.0,
                   help="Seconds per node for the wait-free variants (the others take their "
                        "steps).")
    p.add_argument("--dry-run", action="store_true", help="Print the commands, run nothing.")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown or not args.scenarios:
        p.error(f"--scenarios must name some of {', '.join(SCENARIOS)}, got {unknown or '[]'}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    commands = [sweep_command(s, out, args) for s in args.scenarios]
    table = table_command(args.scenarios, out)
    if args.dry_run:
        for cmd in [*commands, table]:
            print(shlex.join(cmd))
        return 0
    for cmd in commands:
        print("+", shlex.join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            return 1
    md = subprocess.run(table, capture_output=True, text=True, check=True).stdout
    (out / "table.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
