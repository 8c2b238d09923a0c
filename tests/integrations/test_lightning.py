"""QcommStrategy under Lightning's DDP over Gloo: 4 processes as 2 emulated nodes of 2."""

from __future__ import annotations

import csv
import importlib
import io
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra: pip install 'qcomm[lightning]'")

from qcomm.integrations.lightning import QcommStrategy, rank_state_dir
from qcomm.sgd import ADAMW_SLOW_LINK, SLOW_LINK
from qcomm.testing.multiprocess import run_world
from tests.integrations.lightning_bodies import (
    BATCH,
    SAMPLES,
    fit_body,
    foreign_checkpoints_body,
    killed_node_body,
    one_node_body,
    overflow_body,
    overflow_resume_body,
    refused_optimizers_body,
    wrong_strategy_body,
)

# SLOW_LINK in lockstep: a wait-free run's bits depend on when messages arrive, so no two runs
# of it (a whole one and a resumed one) can be compared bit for bit; the lockstep form's can.
OPTIONS = {**SLOW_LINK, "wait_free": False, "on_peer_loss": "raise", "procs_per_node": 2}
PARAMS = 178            # the tiny module's parameters
STEPS_PER_EPOCH = SAMPLES // BATCH // 4


@pytest.fixture(scope="module")
def two_epochs(gloo, tmp_path_factory):
    """One fit of 2 epochs, its checkpoints kept: the runs the tests below look at."""
    root = tmp_path_factory.mktemp("fit")
    return gloo.run(fit_body, 4, args=(str(root), 2, None, OPTIONS), timeout_s=240), root


def test_ranks_hold_one_model_after_fit_and_at_validation(two_epochs):
    results, _ = two_epochs
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])
        for mine, first in zip(r["val_params"], results[0]["val_params"], strict=True):
            assert torch.equal(mine, first)
    assert len(results[0]["val_params"]) == 2       # validation ran once per epoch
    # It trained: the model moved, the scheduler stepped the wrapped optimizer (lr 0.1 -> 0.05
    # after 5 of the 16 steps, -> 0.025 after 10: StepLR steps per epoch, so 2 epochs: 0.1).
    assert results[0]["steps"] == 2 * STEPS_PER_EPOCH


def test_bytes_between_nodes_per_step_are_a_tenth_of_ddp(two_epochs):
    results, _ = two_epochs
    for r in results:
        by_step = r["inter_by_step"]
        assert len(by_step) == 2 * STEPS_PER_EPOCH
        # The second epoch's training steps, after the first epoch's validation and checkpoint
        # (whose exact averages are an evaluation's cost, not a step's): rounds at 12 and 16.
        first, last = STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH - 1     # after steps 9 and 16
        sent, steps = by_step[last] - by_step[first], last - first
        assert sent > 0
        # fp32 DDP sends at least the whole gradient every step from every rank (a ring
        # all-reduce of 4 ranks sends 1.5x that): 4 bytes per parameter per step.
        assert sent * 10 <= 4 * PARAMS * steps, (sent, steps)
        assert r["stats"]["bytes_sent"]["inter"] >= by_step[-1]


def test_stats_reach_the_logger(two_epochs):
    results, _ = two_epochs
    rows = list(csv.DictReader(io.StringIO(results[0]["metrics"])))
    logged = [float(row["qcomm/bytes_inter"]) for row in rows if row.get("qcomm/bytes_inter")]
    assert logged and logged == sorted(logged) and logged[-1] > 0
    steps = [float(row["qcomm/steps"]) for row in rows if row.get("qcomm/steps")]
    assert len(steps) == len(logged) and steps == sorted(steps) and steps[-1] > 0


def test_the_progress_bar_shows_the_mb_between_nodes(two_epochs):
    results, _ = two_epochs
    bar = results[0]["bar"]          # rank 0 runs the progress bar
    shown = bar["qcomm/MB_inter"]
    # Set in the last training step, before that step's round: at most the final count.
    assert 0 < shown <= results[0]["stats"]["bytes_sent"]["inter"] / 1e6


def test_the_node_size_is_lightnings_devices_unless_given():
    devices = [torch.device("cpu")] * 3
    assert QcommStrategy(parallel_devices=devices).layout_options().procs_per_node == 3
    given = QcommStrategy(parallel_devices=devices, procs_per_node=1, bits=4)
    assert given.layout_options().procs_per_node == 1 and given.layout_options().bits == 4


def test_checkpoints_hold_every_ranks_state(two_epochs):
    results, root = two_epochs
    assert results[0]["ckpts"] == ["epoch=0.ckpt", "epoch=0.ckpt.qcomm", "epoch=1.ckpt",
                                   "epoch=1.ckpt.qcomm"]
    files = sorted(p.name for p in rank_state_dir(root / "ckpt" / "epoch=0.ckpt").iterdir())
    assert files == [f"rank{r:05d}.{ext}" for r in range(4) for ext in ("json", "pt")]


def test_resume_from_a_lightning_checkpoint_is_bit_exact(two_epochs, gloo, tmp_path):
    results, root = two_epochs
    ckpt = root / "ckpt" / "epoch=0.ckpt"
    resumed = gloo.run(fit_body, 4, args=(str(tmp_path), 2, str(ckpt), OPTIONS), timeout_s=240)
    for mine, whole in zip(resumed, results, strict=True):
        assert torch.equal(mine["params"], whole["params"])
        assert mine["steps"] == whole["steps"]
        assert mine["lr"] == whole["lr"]
        assert mine["stats"]["gossip_rounds"] == whole["stats"]["gossip_rounds"]


def test_a_checkpoint_without_its_ranks_state_is_refused_and_a_plain_one_loads(two_epochs,
                                                                              gloo, tmp_path):
    _, root = two_epochs
    ckpt = root / "ckpt" / "epoch=0.ckpt"
    seen = gloo.run(foreign_checkpoints_body, 4, args=(str(tmp_path), str(ckpt), OPTIONS),
                    timeout_s=180)
    for lone, plain in seen:
        assert lone.startswith("CheckpointError:") and "lone.ckpt.qcomm" in lone, lone
        # SGD's momentum of rank 0 for each of the 4 parameter tensors; the gossip fresh.
        assert plain == "loaded: momentum buffers 4", plain


def test_a_killed_node_does_not_end_the_fit_of_the_other(tmp_path):
    """SLOW_LINK (wait-free, on_peer_loss="continue"), 2 nodes of 1: node 1 is killed after
    step 8; node 0 drops it and trains on to max_steps (2.5 epochs: past epoch ends)."""
    options = {**SLOW_LINK, "procs_per_node": 1, "timeout_s": 5.0}
    out = run_world(killed_node_body, 2, args=(str(tmp_path), 8, 40, options), timeout_s=240,
                    allow_exit={1})
    survivor = out[0]
    assert survivor["steps"] == 40 and survivor["finite"]
    assert survivor["stats"]["live_nodes"] == 1 and survivor["stats"]["dropped_ranks"] == [1]
    # It gossiped before the loss (a round every 4 steps) and went on stepping after it.
    assert survivor["stats"]["bytes_sent"]["inter"] > 0
    assert survivor["stats"]["steps"] == 40


def test_lightning_ddp_with_a_qcomm_optimizer_is_refused(gloo, tmp_path):
    errors = gloo.run(wrong_strategy_body, 4, args=(str(tmp_path),), timeout_s=180)
    for e in errors:
        assert e.startswith("WrongStrategyError:") and "QcommStrategy" in e, e


def test_qcomm_or_several_optimizers_or_sync_batchnorm_are_refused(gloo, tmp_path):
    errors = gloo.run(refused_optimizers_body, 4, args=(str(tmp_path),), timeout_s=180)
    for qcomm_opt, several, sync_bn in errors:
        assert sync_bn.startswith("ValueError: sync_batchnorm=True under QcommStrategy"), sync_bn
        assert qcomm_opt.startswith("TypeError:") and "plain torch optimizer" in qcomm_opt
        assert several.startswith("ValueError:") and "exactly one optimizer, got 2" in several


@pytest.mark.parametrize(("fp16", "trainer_kwargs"), [
    (False, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
    (True, {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}),
], ids=["accumulate-clip-norm", "16-mixed-overflow-clip-value"])
def test_one_node_is_lightnings_ddp_bit_for_bit(gloo, tmp_path, fp16, trainer_kwargs):
    """The 4 ranks as one node: nothing crosses a slow link, and QcommStrategy trains exactly
    as Lightning's own DDP, with gradient accumulation and clipping, and in float16 through a
    step whose loss overflows on one rank (both skip it)."""
    ddp = gloo.run(one_node_body, 4, args=(str(tmp_path / "ddp"), False, fp16, trainer_kwargs),
                   timeout_s=180)
    ours = gloo.run(one_node_body, 4, args=(str(tmp_path / "qcomm"), True, fp16,
                                            trainer_kwargs), timeout_s=180)
    for rank, ((start, theirs), (_, mine)) in enumerate(zip(ddp, ours, strict=True)):
        assert torch.equal(mine, theirs), rank
        assert mine.isfinite().all() and not torch.equal(mine, start), rank   # it trained


@pytest.mark.parametrize("wait_free", [False, True], ids=["ADAMW_SLOW_LINK", "SLOW_LINK"])
def test_a_float16_overflow_is_skipped_as_under_ddp(gloo, tmp_path, wait_free):
    """precision="16-mixed" (a GradScaler), 2 nodes of 2, rank 1's loss Inf at step 3: the
    fit goes on. In lockstep every node skips that step and every scaler halves its scale (as
    under DDP, where the all-reduce spreads the Inf); wait-free node 0 alone skips it."""
    options = {**(SLOW_LINK if wait_free else ADAMW_SLOW_LINK), "procs_per_node": 2}
    results = gloo.run(overflow_body, 4, args=(str(tmp_path), options, 3), timeout_s=180)
    for rank, r in enumerate(results):
        assert "error" not in r, r
        skipped = rank < 2 or not wait_free
        assert r["scales"] == [65536.0] * 3 + [32768.0 if skipped else 65536.0] * 5, rank
        assert r["stats"]["skipped_steps"] == int(skipped), rank
        assert r["stats"]["steps"] == 8 - skipped, rank
        assert torch.equal(r["params"], results[0]["params"]), rank   # averaged at the end
        assert r["params"].isfinite().all(), rank


def test_a_float16_fit_resumes_bit_for_bit(gloo, tmp_path):
    """16-mixed, ADAMW_SLOW_LINK (lockstep), an overflow in each epoch: resumed from the first
    epoch's checkpoint (the scaler's state with the halved scale, each rank's qcomm state),
    every rank ends with the whole run's parameters and scale."""
    options = {**ADAMW_SLOW_LINK, "procs_per_node": 2}
    whole = gloo.run(overflow_resume_body, 4, args=(str(tmp_path / "whole"), options, None),
                     timeout_s=180)
    ckpt = str(tmp_path / "whole" / "ckpt" / "epoch=0.ckpt")
    resumed = gloo.run(overflow_resume_body, 4, args=(str(tmp_path / "resumed"), options, ckpt),
                       timeout_s=180)
    for rank, (a, b) in enumerate(zip(whole, resumed, strict=True)):
        assert torch.equal(a["params"], b["params"]), rank
        assert a["scale"] == b["scale"] == 65536.0 / 4, (rank, a["scale"], b["scale"])


def test_on_nonfinite_raise_under_a_gradscaler_is_refused(gloo, tmp_path):
    options = {**ADAMW_SLOW_LINK, "procs_per_node": 2, "on_nonfinite": "raise"}
    results = gloo.run(overflow_body, 4, args=(str(tmp_path), options, 3), timeout_s=180)
    for r in results:
        assert r["error"].startswith("ValueError: on_nonfinite='raise' under a GradScaler"), r


def test_bad_options_are_refused_when_the_strategy_is_made():
    with pytest.raises(TypeError, match="bitz"):
        QcommStrategy(bitz=4)
    with pytest.raises(ValueError, match="bits"):
        QcommStrategy(bits=3)
    with pytest.raises(TypeError, match="ddp_kwargs"):
        QcommStrategy(ddp_kwargs=["find_unused_parameters"])
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta or None, got 5"):
        QcommStrategy(timeout=5)


def test_without_lightning_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "qcomm.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'qcomm\[lightning\]'"):
        importlib.import_module("qcomm.integrations.lightning")
