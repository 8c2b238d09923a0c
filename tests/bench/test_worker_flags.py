"""bench/cluster/worker_flags.py: the worker's flags are declared once, and every parser that
takes one (workload.py, compare.py, ddp_reference.py) has it with the same type, default and
help; compare.py's command line for a run is built from the same table and parses back, in
workload.py, to the values the sweep was given."""

from __future__ import annotations

import argparse

import pytest

from bench.cluster import compare as C
from bench.cluster import ddp_reference as D
from bench.cluster import recovery as R
from bench.cluster import worker_flags as F
from bench.cluster import workload as WL

WORKER_ARGS = ["--method", "ddp", "--data", "d.npz", "--out", "o.json"]


def _parser(parse_args, argv: list[str]) -> argparse.ArgumentParser:
    """The parser ``parse_args`` builds (caught as it parses ``argv``)."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        seen.append(self)
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    try:
        parse_args(argv)
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return seen[0]


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


PARSERS = {
    "workload.py": lambda: _parser(WL.parse_args, WORKER_ARGS),
    "compare.py": lambda: _parser(C.parse_args, []),
    "ddp_reference.py": lambda: _parser(D.parse_args, []),
}

RECOVERY_ARGS = ["--method", "localsgd-p32", "--data", "d.npz", "--out", "o.json",
                 "--time-budget", "8", "--kill-node", "1", "--kill-at", "0.3", "--join-at", "0.6"]


@pytest.mark.parametrize("parse_args, argv", [(WL.parse_args, WORKER_ARGS),
                                              (R.parse_args, RECOVERY_ARGS)],
                         ids=["workload.py", "recovery.py"])
def test_both_workers_take_the_run_files_as_declared(parse_args, argv) -> None:
    actions = _actions(_parser(parse_args, argv))
    for f in F.RUN_FILES.values():
        a = actions[f.flag]
        assert (a.dest, a.help, a.type, a.required) == (f.dest, f.help, f.type, f.required)
        assert a.choices == (None if f.choices is None else f.choices), f.flag
    # the order of the table is the order of --help: the run's files first, then the training
    assert list(actions)[1:5] == [f.flag for f in F.RUN_FILES.values()]


@pytest.mark.parametrize("parse_args", [WL.parse_args, R.parse_args],
                         ids=["workload.py", "recovery.py"])
@pytest.mark.parametrize("missing", ["--method", "--data", "--out"])
def test_a_worker_without_a_run_file_names_it(parse_args, missing, capsys) -> None:
    argv = RECOVERY_ARGS if parse_args is R.parse_args else WORKER_ARGS
    i = argv.index(missing)
    with pytest.raises(SystemExit):
        parse_args(argv[:i] + argv[i + 2:])
    assert f"the following arguments are required: {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("script", list(PARSERS))
def test_every_parser_takes_the_tables_flags_as_declared(script: str) -> None:
    actions = _actions(PARSERS[script]())
    shared = [f for f in F.FLAGS.values() if f.flag in actions]
    assert shared
    for f in shared:
        a = actions[f.flag]
        unset = script == "compare.py" and f.dest == "pg_timeout"
        assert a.dest == f.dest and a.help.startswith(f.help), f.flag
        assert a.default == (None if unset else f.default), f.flag
        assert a.type is f.type or (f.type is None and a.nargs == 0), f.flag


def test_the_worker_takes_every_flag_of_the_table() -> None:
    assert set(F.FLAGS) <= set(vars(WL.parse_args(WORKER_ARGS)))


def test_compare_declares_every_flag_it_passes_on() -> None:
    assert set(F.PASSED_ON) | {"max_steps"} <= set(vars(C.parse_args([])))


def test_a_run_gets_the_sweeps_values_and_the_worker_its_defaults(tmp_path) -> None:
    sweep = C.parse_args(["--workload", "charlm", "--lr", "0.0012345678", "--warmup", "2",
                          "--powersgd-rank", "8", "--pg-timeout", "60", "--profile",
                          "--kill-node", "1", "--kill-at", "0.25", "--max-steps", "900",
                          "--layouts", "2x2", "--time-budget", "30"])
    cmd = C.workload_command("charlm", "ddp", sweep, tmp_path / "d.npz", tmp_path / "o.json",
                             "2x2")
    run = WL.parse_args(cmd[1:])
    for name in [*F.PASSED_ON, "max_steps"]:
        want = C.settings("charlm", sweep).get(name, getattr(sweep, name))
        assert getattr(run, name) == want, name
    assert "--pg-timeout" in cmd and cmd[cmd.index("--pg-timeout") + 1] == "60"
    # left at the worker's default: not on the command line at all
    healthy = C.workload_command("charlm", "ddp", C.parse_args(["--workload", "charlm"]),
                                 tmp_path / "d.npz", tmp_path / "o.json", "2x2")
    for flag in ("--warmup", "--seed", "--powersgd-rank", "--pg-timeout", "--profile",
                 "--kill-node", "--max-steps"):
        assert flag not in healthy
    assert WL.parse_args(healthy[1:]).pg_timeout == F.FLAGS["pg_timeout"].default


@pytest.mark.parametrize(("value", "word"), [
    (60.0, "60"), (0.003, "0.003"), (0.0012345678, "0.0012345678"), (1e-07, "1e-07"),
    (3, "3"),
])
def test_a_value_is_written_as_the_worker_reads_it_back(value: object, word: str) -> None:
    assert F.FLAGS["lr"].words(value) == ["--lr", word]
    assert float(word) == value
