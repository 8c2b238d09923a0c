"""examples/train_charlm.py with ``--fsdp`` under torchrun: one agent, 4 processes emulating 2
nodes of 2, the model sharded inside each node by FSDP2 and each rank's shard gossiped between
the nodes. Checked: the agent exits 0, the layout line names FSDP2, the validation loss falls,
and every rank ends with the same whole parameters after the final average; a run resumed from
its DCP checkpoint ends with the bytes of the run that did not stop; and the options ``--fsdp``
cannot be combined with are refused before anything starts, naming them.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.test_train_charlm import EXAMPLE, REPO, TINY, TORCHRUN, _digest, _val_loss

LAUNCH_TIMEOUT_S = 150  # a hang fails the test instead of stalling the suite


def _launch(tmp_path: Path, *extra: str) -> str:
    """The example under torchrun, 4 processes emulating 2 nodes of 2, FSDP2 inside each;
    its output once it exited 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(EXAMPLE),
           "--procs-per-node", "2", "--fsdp", *TINY, "--steps", "16", *extra]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def test_fsdp_inside_two_emulated_nodes_trains_and_ends_in_one_model(tmp_path: Path) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    out = _launch(tmp_path)
    assert "2 nodes x 2 ranks; gradients averaged inside each node (FSDP2's reduce-scatter)" \
        in out, out[-4000:]
    before, after = _val_loss(out, 0), _val_loss(out, 16)
    assert math.isfinite(after) and after < before - 0.5, (before, after)
    digests = {_digest(out, rank) for rank in range(4)}
    assert len(digests) == 1, digests
    assert "returned a view" not in out   # the one FSDP2 warning the example answers for


def test_fsdp_resumes_from_a_dcp_checkpoint_with_the_bits_of_the_run_that_did_not_stop(
        tmp_path: Path) -> None:
    """Saved at step 8 (one DCP checkpoint: the sharded model and AdamW state, each rank's
    gossip state and RNG), resumed to step 16: every rank ends with the bytes of the run that
    went through."""
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    full = _launch(tmp_path, "--ckpt-dir", "ck", "--save-every", "8")
    assert "saved ck/step0000008 (DCP, the sharded state of every rank)" in full, full[-4000:]
    resumed = _launch(tmp_path, "--resume", "ck/step0000008")
    assert "resumed from ck/step0000008 at step 8" in resumed, resumed[-4000:]
    for rank in range(4):
        assert _digest(resumed, rank) == _digest(full, rank)


@pytest.mark.parametrize("flag", [["--ddp"], ["--intra-bits", "8"]])
def test_fsdp_refuses_what_it_cannot_combine_with(flag: list[str]) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--fsdp", *flag, "--steps", "1"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, RANK="0"))
    assert done.returncode == 2
    assert re.search(rf"--fsdp cannot be combined with {re.escape(flag[0])}", done.stderr), \
        done.stderr


def test_fsdp_in_one_process_says_to_launch_with_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--fsdp", "--steps", "1"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert "--fsdp shards the model over a node's processes: launch with torchrun" in \
        done.stderr, done.stderr
