"""Every command README.md and docs/*.md show in a bash block is run by a test.

Each command (a line of a bash block, continuation lines joined, split at ``&&``) is matched by
one row of ``RUNNERS``:

* ``Here``: run here, as written but in a tiny configuration where the real one takes minutes
  (the row says which options it replaces and why);
* ``By``: run by another test, or by ``.ci/run``; that file's source must name the command's
  script and every option the command gives (so a test that stops running an option, or a
  guide that shows a new one, fails here).

A command no row matches fails: a guide that shows a new command says here how it is run.
``python -c PROGRAM`` commands are Python blocks, run by tests/test_docs.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.test_docs import _rel, fences

REPO = Path(__file__).resolve().parents[1]
GUIDES = [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
RUN_TIMEOUT_S = 180


@dataclass(frozen=True)
class Here:
    """Run here: the documented command as written, but the values of the options ``tiny``
    names replaced by its values (those it does not give appended): a tiny configuration,
    ``why`` says what it cuts."""

    tiny: dict[str, tuple[str, ...]]
    why: str

    def argv(self, words: tuple[str, ...], out: Path) -> list[str]:
        start = next(i for i, w in enumerate(words) if w.endswith(".py"))
        argv, replacing = [], False
        for w in words[start + 1:]:
            if w.startswith("--"):
                replacing = w in self.tiny or w == "--out"
                argv.append(w)
                argv += [str(out)] if w == "--out" else list(self.tiny.get(w, ()))
            elif not replacing:
                argv.append(w)
        for option, values in self.tiny.items():
            if option not in words:
                argv += [option, *values]
        return [sys.executable, str(REPO / words[start]), *argv]


@dataclass(frozen=True)
class By:
    """Run by ``path`` (relative to the repository), whose source names the script and every
    option of the command."""

    path: str


# (what the command runs, how it is run). The key: the script's path, ``-m MODULE``, or the
# program for commands without a script (``venv``, ``pip install``).
RUNNERS: dict[str, Here | By] = {
    # CI runs the README's test command itself (the install included), .ci/run reads it there.
    "-m venv": By(".ci/run"),
    "pip install": By(".ci/run"),
    "-m pytest": By(".ci/run"),
    # The demo (251 s): its steps cut to a few, every figure and the verdict checked.
    "examples/train_mnist1d.py": By("tests/examples/test_train_mnist1d.py"),
    # The launches, with a tiny model (tests.examples.test_train_charlm.TINY).
    "examples/train_charlm.py": By("tests/examples/test_train_charlm.py"),
    "-m qcomm.rendezvous": By("tests/rendezvous/test_launch.py"),
    # The reader's own script, as launched in the guide: the example stands for it.
    "train.py": By("tests/examples/test_train_charlm.py"),
    # docs/gossip_tuning.md's measurements, each on a small vector and a few cases (minutes as
    # documented).
    "bench/tune_gamma.py": Here(
        {"--numel": ("256",), "--bits": ("4",), "--taus": ("1",), "--fragments": ("1", "2"),
         "--gammas": ("0.5", "1.0")}, "256 floats, 4 bits, staleness 1, two fragment counts "
        "and two gammas"),
    "bench/gossip_progress.py": Here({"--steps": ("5",), "--numel": ("4096",),
                                      "--compute-ms": ("2",)}, "5 steps of 4096 floats"),
    "bench/gossip_transport.py": Here({"--rounds": ("10",), "--nbytes": ("4096",)},
                                      "10 rounds of 4 KiB per order"),
    "bench/socket_links.py": Here({"--rounds": ("4",), "--nbytes": ("4096",)},
                                  "4 rounds of 4 KiB per kind of link"),
}
# The reader's own script in a command, and the example that stands for it.
STANDS_FOR = {"train.py": "train_charlm.py"}
# A command's runner file per launch flavour of train_charlm.py (the flags pick the test).
CHARLM_BY_FLAG = {"--fsdp": "tests/examples/test_train_charlm_fsdp.py",
                  "--procs-per-node": "tests/examples/test_train_charlm_fsdp.py",
                  "--wait-free": "tests/rendezvous/test_launch.py",
                  "--standalone": "tests/rendezvous/test_launch.py"}


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    words: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{_rel(self.doc)}:{self.line}:{self.key}"

    @property
    def key(self) -> str:
        w = self.words
        for i, word in enumerate(w):
            if word == "-m" and i + 1 < len(w):
                return f"-m {w[i + 1]}"
            if word.endswith((".py", ".sh")):
                return word
        if len(w) > 1 and w[0].endswith("pip") and w[1] == "install":
            return "pip install"
        return " ".join(w)

    @property
    def options(self) -> list[str]:
        return [w.split("=")[0] for w in self.words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)]


def _lines(body: str):
    """A bash block's command lines, each as (its first line's offset, words): continuation
    lines joined, a quoted argument over several lines (a ``python -c`` program) kept
    whole."""
    pending, first = "", 0
    for k, line in enumerate(body.splitlines()):
        if not pending:
            first = k
        pending += line + "\n"
        try:
            words = shlex.split(pending.replace("\\\n", ""), comments=True)
        except ValueError:
            continue  # an open quote: the argument goes on
        if pending.endswith("\\\n"):
            continue  # a continuation line follows
        pending = ""
        yield first, words


def _commands() -> list[Command]:
    out = []
    for doc in GUIDES:
        for fence in fences(doc):
            if fence.lang not in ("bash", "sh", "shell"):
                continue
            for offset, words in _lines(fence.body):
                part: list[str] = []
                for w in [*words, "&&"]:
                    if w != "&&":
                        part.append(w)
                        continue
                    # environment assignments are not the command
                    body = [x for x in part if not re.fullmatch(r"[A-Z_]+=\S*", x)]
                    part = []
                    if body and not (len(body) > 1 and body[1] == "-c"):
                        # (a python -c program is a Python block: tests/test_docs.py)
                        out.append(Command(doc, fence.line + 1 + offset, tuple(body)))
    return out


COMMANDS = _commands()


def _runner(cmd: Command) -> Here | By | None:
    runner = RUNNERS.get(cmd.key)
    if isinstance(runner, By) and cmd.key == "examples/train_charlm.py":
        flagged = [CHARLM_BY_FLAG[o] for o in cmd.options if o in CHARLM_BY_FLAG]
        return By(flagged[0]) if flagged else runner
    return runner


def test_the_guides_show_commands() -> None:
    keys = {c.key for c in COMMANDS}
    assert {"examples/train_charlm.py", "-m qcomm.rendezvous", "-m pytest",
            "bench/tune_gamma.py"} <= keys, sorted(keys)


def test_every_command_has_a_runner() -> None:
    missing = [c.id for c in COMMANDS if _runner(c) is None]
    assert not missing, ("commands the guides show that no test runs (add a row to RUNNERS):\n"
                         + "\n".join(missing))


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if isinstance(_runner(c), By)],
                         ids=lambda c: c.id)
def test_a_command_run_elsewhere_is_run_there_with_its_options(cmd: Command) -> None:
    runner = _runner(cmd)
    source = (REPO / runner.path).read_text()
    if runner.path == ".ci/run":
        # .ci/run runs the README's test command: the command must be part of it.
        test_command = re.search(r"<!-- test-command -->\n```bash\n(.+)\n",
                                 (REPO / "README.md").read_text()).group(1)
        source += "\n" + test_command
    # the script by its file name (a placeholder by the example that stands for it)
    name = STANDS_FOR.get(cmd.key, Path(cmd.key.removeprefix("-m ")).name)
    missing = [x for x in [name, *cmd.options] if x not in source]
    assert not missing, (f"{cmd.id}: {runner.path} does not run {' '.join(cmd.words)!r}: it "
                         f"never names {missing}")


def _extras(words: tuple[str, ...] | list[str]) -> set[str]:
    """The extras of the ``pip install ... -e '.[a,b]'`` in ``words``."""
    found = [re.fullmatch(r"\.\[([\w,]+)\]", w) for w in words]
    return {e for m in found if m for e in m.group(1).split(",")}


def _closure(extras: set[str]) -> set[str]:
    """The extras ``extras`` install, those they name (``qcomm[...]``) included."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    todo, seen = list(extras), set()
    while todo:
        e = todo.pop()
        if e not in seen:
            seen.add(e)
            todo += [x for d in table[e] for x in _extras(["." + d.removeprefix("qcomm")])]
    return seen


def test_every_install_the_guides_show_is_within_the_tested_one() -> None:
    """.ci/run installs the README's test command's extras; every other install line asks for
    no more (the demo's extras are among the bench's)."""
    test_command = re.search(r"<!-- test-command -->\n```bash\n(.+)\n",
                             (REPO / "README.md").read_text()).group(1)
    tested = _closure(_extras(shlex.split(test_command)))
    for cmd in COMMANDS:
        if cmd.key == "pip install":
            assert _closure(_extras(cmd.words)) <= tested, (cmd.id, cmd.words)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if isinstance(_runner(c), Here)],
                         ids=lambda c: c.id)
def test_a_command_run_here_runs_in_its_tiny_configuration(cmd: Command,
                                                            tmp_path: Path) -> None:
    argv = _runner(cmd).argv(cmd.words, tmp_path / "out.json")
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{cmd.id}: {' '.join(argv)}\n{done.stderr[-3000:]}"
    if "--out" in cmd.options:
        assert (tmp_path / "out.json").stat().st_size > 0, cmd.id
