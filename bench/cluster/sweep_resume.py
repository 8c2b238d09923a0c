"""A sweep cut short (a run past ``--timeout``, a killed driver) taken up again: ``compare.py
--resume --out DIR`` reads the runs whose JSON is already in ``DIR/runs`` and runs only the
others. Its settings must be the first invocation's: a run's figures are kept only beside runs
made with the same command line, so the recorded arguments are compared first and a difference
is refused, named.

The first invocation's arguments are read from ``DIR/sweep_args.json`` (written when a sweep
starts) or, for a sweep that finished, its ``summary.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARGS_FILE = "sweep_args.json"
# What may change between the invocations: how long a run may take, where the sweep stops
# (more repetitions run the new ones), and what the report prints; not what a run computes.
FREE = frozenset({"timeout", "resume", "repeats", "strict", "no_plots", "out", "profile"})


def record_args(args: argparse.Namespace, outdir: Path) -> None:
    """Write the sweep's arguments where a later ``--resume`` finds them."""
    (outdir / ARGS_FILE).write_text(json.dumps(vars(args), indent=1, default=str))


def recorded_args(outdir: Path) -> dict[str, Any] | None:
    """The first invocation's arguments: ``sweep_args.json``, else ``summary.json``'s; None
    when the folder has neither."""
    for name, key in ((ARGS_FILE, None), ("summary.json", "args")):
        path = outdir / name
        if path.exists():
            data = json.loads(path.read_text())
            return data if key is None else data[key]
    return None


def resume_problem(args: argparse.Namespace, defaults: argparse.Namespace,
                   outdir: Path) -> str | None:
    """Why ``--resume`` cannot take up the sweep in ``outdir`` with ``args`` (None: it can).
    An argument the first invocation did not record (an older sweep) must be at its default
    (``defaults``), the value that sweep ran with."""
    first = recorded_args(outdir)
    if first is None:
        return (f"--resume: {outdir} holds no sweep to take up (neither {ARGS_FILE} nor "
                "summary.json)")
    now = json.loads(json.dumps(vars(args), default=str))
    base = json.loads(json.dumps(vars(defaults), default=str))
    changed = []
    for key, value in sorted(now.items()):
        if key in FREE:
            continue
        was = first.get(key, base.get(key))
        if was != value:
            changed.append(f"--{key.replace('_', '-')} {was!r} then, {value!r} now")
    if changed:
        return ("--resume: the runs in " f"{outdir} were made with other settings ("
                + "; ".join(changed) + "): resume with the first invocation's, or start a new "
                "--out")
    return None


def reusable(out_json: Path, resume: bool) -> dict[str, Any] | None:
    """A run's JSON kept from the first invocation, when resuming and it is there."""
    if not resume or not out_json.exists():
        return None
    return json.loads(out_json.read_text())


if __name__ == "__main__":  # a library: say so rather than exit silently
    print("bench/cluster/sweep_resume.py is a library of the cluster benchmark (compare.py "
          "--resume); it runs nothing. See bench/cluster/README.md.")
