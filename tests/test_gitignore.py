"""What the documented commands write stays out of git: every ``--ckpt-dir DIR`` a guide's command
passes (a relative folder, written in the checkout the reader runs it from) is ignored, so that a
run's checkpoints (hundreds of MB with ``--fsdp``) never show up in ``git status``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _checkpoint_dirs() -> set[str]:
    found = set()
    for guide in GUIDES:
        found.update(re.findall(r"--ckpt-dir[ =]([\w.\-/]+)", guide.read_text()))
    return {d for d in found if not d.startswith("/")}


def test_the_guides_name_checkpoint_dirs() -> None:
    assert "ck" in _checkpoint_dirs()   # README.md's FSDP command


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="not a git checkout")
@pytest.mark.parametrize("folder", sorted(_checkpoint_dirs()))
def test_a_documented_checkpoint_dir_is_ignored_by_git(folder: str) -> None:
    # a file as the example writes it, with DCP's metadata beside it (--fsdp)
    for name in ("step0000008/rank00000.pt", "step0000008/.metadata"):
        p = subprocess.run(["git", "check-ignore", "-q", f"{folder}/{name}"], cwd=REPO,
                           capture_output=True, timeout=30)
        assert p.returncode == 0, f"{folder}/{name} is not ignored by .gitignore"
