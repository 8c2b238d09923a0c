"""The command lines of bench/ and bench/cluster/ do what their ``--help`` says: ``--help`` exits
0 and lists every option the parser defines, each with a help text; every option is accepted
and sets its own setting and no other; every library there, run by path, says it is one and
does nothing; and every command the READMEs and docs show for a script parses.

The scripts run in one subprocess (this file, run as a script), each as ``python <script>
--help`` would run it, without doing any of its work; the parser that ``--help`` reached is
then asked to parse the other command lines."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# The packages' __init__.py files are neither scripts nor libraries of their own.
SCRIPTS = sorted(p for p in [*REPO.glob("bench/*.py"), *REPO.glob("bench/cluster/*.py")]
                 if p.name != "__init__.py")
LIBRARIES = {"bench/common.py", "bench/cluster/charlm.py", "bench/cluster/corpus.py",
             "bench/cluster/link_counters.py", "bench/cluster/lost_node_end.py",
             "bench/cluster/methods.py", "bench/cluster/node_loss.py",
             "bench/cluster/project_targets.py", "bench/cluster/rank_place.py",
             "bench/cluster/rejoining.py", "bench/cluster/repetitions.py",
             "bench/cluster/run_launch.py", "bench/cluster/run_record.py",
             "bench/cluster/run_summary.py", "bench/cluster/sharding.py",
             "bench/cluster/snapshot_eval.py", "bench/cluster/sweep_plan.py",
             "bench/cluster/sweep_plots.py",
             "bench/cluster/sweep_resume.py",
             "bench/cluster/sweep_summary.py", "bench/cluster/sweep_tables.py",
             "bench/cluster/timed_window.py",
             "bench/cluster/torchft_methods.py",
             "bench/cluster/training.py", "bench/cluster/worker_flags.py",
             "bench/cluster/workloads.py", "bench/progress.py"}
# Where the documentation shows commands to run: the fenced bash blocks of the guides. The
# records of past runs (bench/RESULTS.md, bench/results/) show the commands of their commit.
DOCS = sorted([REPO / "README.md", REPO / "bench/README.md", REPO / "bench/cluster/README.md",
               *REPO.glob("docs/*.md"), *REPO.glob("examples/*.md")])
# Values for options whose type accepts only some strings (the generic sample is "1").
SAMPLES = {"--method": "ddp"}


# ---------------------------------------------------------------------------------------------
# the driver: runs in its own interpreter (see `helps` below)


def _sample(action: argparse.Action) -> list[str]:
    """Command-line values for ``action`` that differ from its default, when one can tell."""
    if action.nargs == 0:
        return []
    default = action.default
    flag = action.option_strings[-1] if action.option_strings else action.dest
    if flag in SAMPLES:
        one = [SAMPLES[flag]]
    elif action.choices:
        choices = list(action.choices)
        one = [str(next((c for c in choices if c != default), choices[0]))]
    elif isinstance(default, list):
        # a shorter list (or the one value twice) is another value
        one = [str(x) for x in default[:1]] * (1 if len(default) > 1 else 2) or ["1"]
    elif isinstance(default, bool) or default is None:
        one = ["1"]
    elif isinstance(default, int):
        one = [str(default + 1)]
    elif isinstance(default, float):
        one = [repr(default / 2 if default else 0.5)]
    else:
        one = [f"{default}1"]
    if isinstance(action.nargs, int):
        return (one * action.nargs)[:action.nargs]
    return one


def _parse(parser: argparse.ArgumentParser, argv: list[str], original) -> dict[str, Any]:
    """``parser`` on ``argv``: the settings, or the error argparse would print."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            ns = original(parser, argv)
    except SystemExit:
        return {"ok": False, "error": err.getvalue()[-2000:]}
    return {"ok": True, "settings": {k: repr(v) for k, v in vars(ns).items()}}


def _options(parser: argparse.ArgumentParser, original) -> list[dict[str, Any]]:
    """Every option string of ``parser`` given alone (beside the required arguments): whether
    it parses and which settings it changes."""
    required = [a for a in parser._actions if a.required or not a.option_strings]
    base_argv = [s for a in required
                 for s in ([a.option_strings[0]] if a.option_strings else []) + _sample(a)]
    base = _parse(parser, base_argv, original)
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or not a.option_strings:
            continue
        for flag in a.option_strings:
            got = _parse(parser, [*base_argv, flag, *_sample(a)], original)
            changed = sorted(k for k, v in got.get("settings", {}).items()
                             if base.get("settings", {}).get(k) != v)
            out.append({"flag": flag, "dest": a.dest, "help": a.help, "ok": got["ok"],
                        "required": a.required,
                        "error": got.get("error"), "changed": changed})
    return out


def _run_help(path: Path, documented: list[list[str]]) -> dict:
    """``python path --help``, in this process: the exit code, what it printed, the parser's
    options and how the parser takes each option and each of the ``documented`` argvs."""
    parsers: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def recording(self, *args, **kwargs):
        parsers.append(self)
        return original(self, *args, **kwargs)

    out = io.StringIO()
    code: object = 0  # a library returns normally
    saved = sys.argv, list(sys.path)
    sys.argv = [str(path), "--help"]
    sys.path.insert(0, str(path.parent))  # what `python path` does
    argparse.ArgumentParser.parse_args = recording  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved[0], saved[1]
    parser = parsers[0] if parsers else None
    return {
        "exit": code, "output": out.getvalue(), "has_parser": parser is not None,
        "options": _options(parser, original) if parser else [],
        "documented": [_parse(parser, argv, original) if parser else {"ok": False}
                       for argv in documented],
    }


# ---------------------------------------------------------------------------------------------
# the commands the documentation shows


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```bash\n(.*?)^ *```", text, flags=re.MULTILINE | re.DOTALL)


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, script, argv) of every command in a bash block of DOCS that runs a script of
    bench/ or examples/ (directly, through python, torchrun or netns.sh). Lines that are not
    shell words on their own (the inside of a ``python -c`` string) are passed over."""
    found = []
    for doc in DOCS:
        for block in _bash_blocks(doc.read_text()):
            # A backslash-newline joins two lines into one, as the shell reads it.
            for line in block.replace("\\\n", "").splitlines():
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    continue
                for i, w in enumerate(words):
                    if re.fullmatch(r"(bench|examples)/[\w/]+\.py", w) and (REPO / w).is_file():
                        argv = []
                        for x in words[i + 1:]:
                            if x in ("&&", "||", "|", ";", ">", ">>", "<"):
                                break
                            argv.append(x)
                        found.append((_rel(doc), w, argv))
                        break
    return found


DOCUMENTED = documented_commands()


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    todo: dict[str, list[list[str]]] = {_rel(p): [] for p in SCRIPTS}
    for _, script, argv in DOCUMENTED:
        todo.setdefault(script, []).append(argv)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, json.dumps(todo)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the tests

COMMANDS = [_rel(p) for p in SCRIPTS if _rel(p) not in LIBRARIES]


def test_the_lists_cover_bench() -> None:
    assert {_rel(p) for p in SCRIPTS} >= LIBRARIES


def test_the_docs_show_commands() -> None:
    # Guards the extraction below: a change of the docs' fences must not empty it silently.
    assert {s for _, s, _ in DOCUMENTED} >= {"bench/kernels.py", "bench/cluster/compare.py"}


@pytest.mark.parametrize("script", COMMANDS)
def test_help_exits_0_and_lists_every_option(helps, script: str) -> None:
    h = helps[script]
    assert h["exit"] == 0 and h["has_parser"], h["output"]
    missing = [o["flag"] for o in h["options"] if o["flag"] not in h["output"]]
    assert not missing, f"options --help does not list: {missing}"


@pytest.mark.parametrize("script", COMMANDS)
def test_every_option_has_a_help_text(helps, script: str) -> None:
    missing = [o["flag"] for o in helps[script]["options"]
               if not (o["help"] or "").strip() or o["help"] == argparse.SUPPRESS]
    assert not missing, f"options without help: {missing}"


@pytest.mark.parametrize("script", COMMANDS)
def test_every_option_is_accepted_and_sets_its_own_setting(helps, script: str) -> None:
    opts = helps[script]["options"]
    refused = [(o["flag"], o["error"]) for o in opts if not o["ok"]]
    assert not refused, f"options the parser refuses: {refused}"
    # Each flag changes nothing but its own destination ...
    stray = [(o["flag"], o["changed"]) for o in opts if set(o["changed"]) - {o["dest"]}]
    assert not stray, f"options that change other settings: {stray}"
    # ... and some spelling of each option changes it (both of --x/--no-x cannot both be no-ops).
    by_dest: dict[str, list[dict]] = {}
    for o in opts:
        by_dest.setdefault(o["dest"], []).append(o)
    # (A required option is in every command line: there is no line without it to compare.)
    inert = [d for d, os_ in by_dest.items()
             if not any(o["changed"] or o["required"] for o in os_)]
    assert not inert, f"options that change nothing: {inert}"


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_library_run_by_path_says_it_is_one_and_does_nothing(helps, library: str) -> None:
    h = helps[library]
    assert h["exit"] == 0 and "library" in h["output"] and not h["has_parser"], h


@pytest.mark.parametrize(("doc", "script", "argv"), DOCUMENTED,
                         ids=[f"{d}:{s}:{i}" for i, (d, s, _) in enumerate(DOCUMENTED)])
def test_documented_command_parses(helps, doc: str, script: str, argv: list[str]) -> None:
    h = helps[script]
    got = h["documented"][[a for _, s, a in DOCUMENTED if s == script].index(argv)]
    assert got["ok"], f"{doc}: {script} {shlex.join(argv)}: {got.get('error')}"


def test_documented_compare_methods_are_known(helps) -> None:
    """compare.py checks --methods only once it runs: every documented selection names
    methods of the registry."""
    from bench.cluster import methods as M

    script = "bench/cluster/compare.py"
    parsed = helps[script]["documented"]  # in the order of DOCUMENTED's lines of compare.py
    assert parsed
    for got in parsed:
        M.parse_methods(ast.literal_eval(got["settings"]["methods"]))  # the driver sends reprs


if __name__ == "__main__":
    # The driver the fixture runs: one interpreter for every script.
    results = {}
    for script, argvs in json.loads(sys.argv[1]).items():
        results[script] = _run_help(REPO / script, argvs)
    print(json.dumps(results))
