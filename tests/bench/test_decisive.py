"""bench/cluster/decisive.py: one command per scenario, each with its own flags and output
folder, then the table over all of them; bad arguments are refused by name."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cluster" / "decisive.py"


def _dry(*args: str) -> list[list[str]]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", "/tmp/d", *args],
                         capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in out.splitlines()]


def test_every_scenario_is_one_sweep_with_its_flags_then_one_table_and_its_verdicts() -> None:
    cmds = _dry()
    sweeps, table, judges = cmds[:4], cmds[4], cmds[5:]
    assert [c[1].endswith("compare.py") for c in sweeps] == [True] * 4
    flags = {c[c.index("--out") + 1].rsplit("/", 1)[1]: c for c in sweeps}
    assert "--slow-nodes" in flags["slow"] and "--delay-ms" in flags["latency"]
    assert "--kill-node" in flags["lost"]
    assert not {"--slow-nodes", "--delay-ms", "--kill-node"} & set(flags["healthy"])
    # every sweep compares the same methods, three runs a cell
    methods = {c[c.index("--methods") + 1] for c in sweeps}
    assert len(methods) == 1 and {c[c.index("--repeats") + 1] for c in sweeps} == {"3"}
    assert table[1].endswith("scenarios.py")
    assert [a.split("=")[0] for a in table if "=" in a] == list(flags)
    # each scenario's cells judged on several targets and budgets, from its own summary
    assert [c[1].endswith("verdicts.py") for c in judges] == [True] * 4
    assert [c[2] for c in judges] == [f"/tmp/d/{s}/summary.json" for s in flags]


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_each_workload_runs_its_own_tuned_methods_target_and_budget() -> None:
    mnist = _dry("--scenarios", "healthy")[0]
    charlm = _dry("--scenarios", "healthy", "--workload", "charlm")[0]
    assert value(mnist, "--workload") == "mnist1d" and value(charlm, "--workload") == "charlm"
    assert value(mnist, "--target") == "0.65" and value(charlm, "--target") == "1.9"
    assert value(mnist, "--time-budget") == value(charlm, "--time-budget") == "fastest"
    assert value(mnist, "--methods") != value(charlm, "--methods")
    given = _dry("--scenarios", "healthy", "--target", "0.7", "--methods", "ddp,localsgd-p8")[0]
    assert value(given, "--target") == "0.7" and value(given, "--methods") == "ddp,localsgd-p8"


def test_the_wait_free_runs_end_with_the_fastest_node_unless_seconds_are_given() -> None:
    by_scenario = {value(c, "--out").rsplit("/", 1)[1]: value(c, "--time-budget")
                   for c in _dry()[:4]}
    assert by_scenario == dict.fromkeys(("healthy", "slow", "latency", "lost"), "fastest")
    # seconds given on the command line hold for every scenario and layout
    given = _dry("--time-budget", "12")
    assert {value(c, "--time-budget") for c in given[:4]} == {"12.0"}


def test_equal_cpu_and_a_seed_per_repeat_pass_on_to_every_sweep() -> None:
    plain = _dry("--scenarios", "healthy,slow")
    assert not any("--equal-cpu" in c or "--seed-per-repeat" in c for c in plain)
    both = _dry("--scenarios", "healthy,slow", "--equal-cpu", "--seed-per-repeat")
    assert all("--equal-cpu" in c and "--seed-per-repeat" in c for c in both[:2])


def test_a_part_of_it() -> None:
    cmds = _dry("--scenarios", "lost", "--layouts", "4x1", "--repeats", "1")
    assert len(cmds) == 3 and "--kill-node" in cmds[0]
    assert cmds[0][cmds[0].index("--layouts") + 1] == "4x1"


@pytest.mark.parametrize(("args", "match"), [(["--scenarios", "flood"], "--scenarios"),
                                             (["--repeats", "0"], "--repeats"),
                                             (["--time-budget", "0"], "--time-budget"),
                                             (["--workload", "imagenet"], "--workload")])
def test_bad_arguments_name_themselves(args: list[str], match: str) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args],
                       capture_output=True, text=True)
    assert r.returncode == 2 and match in r.stderr
