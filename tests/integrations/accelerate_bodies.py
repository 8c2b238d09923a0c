"""What the ranks of the Accelerate tests run: a recipe of docs/guide.md, as written."""

from __future__ import annotations

import os
from typing import Any

import torch

# 2 emulated nodes of 2 ranks (what torchrun's LOCAL_WORLD_SIZE would say on 2 machines), on
# the CPU (what `accelerate launch --cpu` sets: without it Accelerate takes one CPU process alone).
EMULATED_ENV = {"LOCAL_WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "1"}


def recipe_body(rank: int, world_size: int, source: str) -> dict[str, Any]:
    """Run ``source`` (a recipe) on this rank; return its model's parameters and the bytes its
    optimizer or hook counted."""
    from accelerate.state import AcceleratorState

    saved = {k: os.environ.get(k) for k in (*EMULATED_ENV, "LOCAL_RANK")}
    os.environ.update(EMULATED_ENV, LOCAL_RANK=str(rank % 2))
    scope: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(source, "docs/guide.md (Hugging Face Accelerate)", "exec"), scope)
    finally:
        # Accelerate keeps its state per process; the pooled process serves other tests.
        AcceleratorState._reset_state(reset_partial_state=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    model = scope["model"]
    model = getattr(model, "module", model)
    stats = scope["opt"].stats() if "state" not in scope else scope["state"].stats.snapshot()
    scaler = scope["accelerator"].scaler
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "bytes": stats["bytes_sent"], "steps": len(scope["loader"]),
            "skipped": stats.get("skipped_steps"),
            "scale": None if scaler is None else scaler.get_scale()}


def with_fp16_scaler(recipe: str, overflow_rank: int, overflow_step: int) -> str:
    """``recipe`` as ``Accelerator(mixed_precision="fp16")`` runs it on a GPU, on the CPU:
    the accelerator given a GradScaler (Accelerate makes none on a CPU), and the loss of rank
    ``overflow_rank`` Inf in its step ``overflow_step`` (counted from 0), as a float16 overflow
    makes it."""
    made = "accelerator = Accelerator()\n"
    loss = "torch.nn.functional.cross_entropy(model(x), y)"
    assert made in recipe and loss in recipe
    prelude = (
        "import itertools as _itertools\n"
        "import torch.distributed as _dist\n"
        "_steps = _itertools.count()\n"
        "def _overflow():\n"
        f"    hit = next(_steps) == {overflow_step} and _dist.get_rank() == {overflow_rank}\n"
        "    return float('inf') if hit else 1.0\n")
    scaled = made + "accelerator.scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)\n"
    return prelude + recipe.replace(made, scaled, 1).replace(loss, f"{loss} * _overflow()", 1)
