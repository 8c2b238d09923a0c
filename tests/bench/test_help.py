"""Every script of bench/ and bench/cluster/ answers ``--help`` with whole sentences and a help
text for every option; every library there says it is one. The scripts run in one subprocess
(this file, run as a script), each as ``python <script> --help`` would run it, without doing
any of its work."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The packages' __init__.py files are neither scripts nor libraries of their own.
SCRIPTS = sorted(p for p in [*REPO.glob("bench/*.py"), *REPO.glob("bench/cluster/*.py")]
                 if p.name != "__init__.py")
LIBRARIES = {"bench/common.py", "bench/cluster/charlm.py", "bench/cluster/corpus.py",
             "bench/cluster/methods.py", "bench/cluster/torchft_methods.py",
             "bench/cluster/training.py", "bench/cluster/workloads.py"}
SENTENCE_END = (".", "?", "!")


def _run_help(path: Path) -> dict:
    """``python path --help``, in this process: stdout, exit code, and the parser (if any)."""
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
        "exit": code, "output": out.getvalue(),
        "description": parser.description if parser else None,
        "options": [(a.option_strings, a.help) for a in parser._actions
                    if not isinstance(a, argparse._HelpAction)] if parser else [],
    }


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, *map(str, SCRIPTS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def test_the_lists_cover_bench() -> None:
    assert {_rel(p) for p in SCRIPTS} >= LIBRARIES


@pytest.mark.parametrize("script", [_rel(p) for p in SCRIPTS if _rel(p) not in LIBRARIES])
def test_script_help_is_whole_sentences_with_every_option_explained(helps, script: str) -> None:
    h = helps[script]
    assert h["exit"] == 0, h["output"]
    desc = " ".join((h["description"] or "").split())
    assert desc and desc[0].isupper() and desc.endswith(SENTENCE_END), desc
    # printed whole, not cut (argparse wraps lines, at hyphens too: compare without spaces)
    assert "".join(desc.split()) in "".join(h["output"].split())
    missing = [opts for opts, text in h["options"] if not text or text == argparse.SUPPRESS]
    assert not missing, f"options without help: {missing}"
    unfinished = [(opts, text) for opts, text in h["options"]
                  if not text.rstrip().endswith((*SENTENCE_END, ")"))]
    assert not unfinished, f"help texts that are not whole sentences: {unfinished}"


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_library_says_it_is_one(helps, library: str) -> None:
    h = helps[library]
    assert h["exit"] == 0 and "library" in h["output"] and h["description"] is None, h


if __name__ == "__main__":
    # The driver the fixture runs: one interpreter for every script.
    results = {}
    for arg in sys.argv[1:]:
        results[_rel(Path(arg))] = _run_help(Path(arg))
    print(json.dumps(results))
