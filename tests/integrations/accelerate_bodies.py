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
    counted = scope["opt"].stats()["bytes_sent"] if "state" not in scope else \
        scope["state"].stats.snapshot()["bytes_sent"]
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "bytes": counted, "steps": len(scope["loader"])}
