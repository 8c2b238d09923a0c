"""The Hugging Face Accelerate recipes of docs/guide.md, run as written on 2 emulated nodes of 2
(4 Gloo processes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="the recipes need accelerate (the test extra)")

from tests.integrations.accelerate_bodies import recipe_body, with_fp16_scaler

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"
PARAMS = 20 * 64 + 64 + 64 * 3 + 3                # the recipes' model
STEPS = 512 // 16 // 4                            # batches per rank


def recipes() -> list[str]:
    """The python blocks of the guide's section "Hugging Face Accelerate", in order."""
    text = GUIDE.read_text()
    section = text.split("\n## Hugging Face Accelerate\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_guide_has_both_recipes():
    optimizer, hook = recipes()
    assert "HierarchicalOptimizer" in optimizer and "data_parallel" in optimizer
    assert "register_comm_hook" in hook


def test_the_optimizer_recipe_gives_one_model_and_gossips_between_nodes(gloo):
    results = gloo.run(recipe_body, 4, args=(recipes()[0],), timeout_s=180)
    for r in results:
        assert torch.equal(r["params"], results[0]["params"])
        assert r["steps"] == STEPS
        # ADAMW_SLOW_LINK: 4-bit gossip of half of this rank's rail shard every step, against
        # fp32 DDP's whole gradient (4 bytes a parameter) every step.
        assert 0 < r["bytes"]["inter"] * 10 <= 4 * PARAMS * STEPS, r["bytes"]
    assert not torch.equal(results[0]["params"], _initial())   # it trained


def test_the_optimizer_recipe_skips_an_fp16_overflow_on_every_node(gloo):
    """The recipe with a GradScaler (what mixed_precision="fp16" gives on a GPU), rank 1's loss
    Inf in its step 2: every node skips that step (ADAMW_SLOW_LINK is lockstep), the scaler of
    the overflowing node halves its scale, and the job ends in one model, trained."""
    source = with_fp16_scaler(recipes()[0], overflow_rank=1, overflow_step=2)
    results = gloo.run(recipe_body, 4, args=(source,), timeout_s=180)
    for rank, r in enumerate(results):
        assert r["skipped"] == 1, (rank, r["skipped"])
        assert r["scale"] == (128.0 if rank < 2 else 256.0), (rank, r["scale"])
        assert torch.equal(r["params"], results[0]["params"]) and r["params"].isfinite().all()
    assert not torch.equal(results[0]["params"], _initial())


def test_the_hook_recipe_quantizes_between_nodes(gloo):
    results = gloo.run(recipe_body, 4, args=(recipes()[1],), timeout_s=180)
    for r in results:
        assert torch.equal(r["params"], results[0]["params"])   # DDP: one model throughout
        assert r["steps"] == STEPS
        assert r["bytes"]["intra"] > 0
        # 4-bit payloads (4.25 bits a value with the block scales) instead of 32-bit ones.
        assert 0 < r["bytes"]["inter"] * 4 <= 4 * PARAMS * STEPS, r["bytes"]
    assert not torch.equal(results[0]["params"], _initial())


def test_the_hook_recipe_skips_an_fp16_overflow_on_every_rank(gloo):
    """The hook recipe with a GradScaler (mixed_precision="fp16" on a GPU), rank 1's loss Inf
    in its step 2: the bucket comes back NaN on every rank, every scaler skips that step and
    halves its scale, and the ranks hold one model, trained."""
    source = with_fp16_scaler(recipes()[1], overflow_rank=1, overflow_step=2)
    results = gloo.run(recipe_body, 4, args=(source,), timeout_s=180)
    for rank, r in enumerate(results):
        assert r["scale"] == 128.0, (rank, r["scale"])
        assert torch.equal(r["params"], results[0]["params"]) and r["params"].isfinite().all()
    assert not torch.equal(results[0]["params"], _initial())


def _initial() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
