"""qcomm.hooks: the DDP comm hook against DDP's fp32 allreduce (2 nodes x 2 ranks over Gloo),
within the codec's bound; the state object pickles without process groups."""

from __future__ import annotations

import pickle

import pytest
import torch

from qcomm.hooks import HierarchicalQuantState, hierarchical_quantized_hook
from qcomm.testing.multiprocess import run_world


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _hook_body(rank: int, world: int, bits: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = DDP(_model())
    ours = DDP(_model())
    state = HierarchicalQuantState(procs_per_node=2, bits=bits, block_size=32,
                                   rounding="nearest")
    ours.register_comm_hook(state, hierarchical_quantized_hook)
    out = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        local = []
        for model in (ref, ours):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        # This rank's own gradients (no averaging), for the bound.
        plain = _model()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        local = max(p.grad.abs().max().item() for p in plain.parameters())
        err = max((a.grad - b.grad).abs().max().item()
                  for a, b in zip(ref.parameters(), ours.parameters(), strict=True))
        out.append((err, local))
    pickled = pickle.dumps(state)
    return {"steps": out, "inter": state.stats.snapshot()["bytes_sent"]["inter"],
            "pickled": pickled}


@pytest.mark.parametrize("bits", [4])
def test_hook_matches_fp32_allreduce_within_codec_bound(bits: int) -> None:
    res = run_world(_hook_body, 4, args=(bits,), timeout_s=120)
    levels = 2 ** (bits - 1) - 1
    gmax = max(local for r in res for _, local in r["steps"])
    for r in res:
        for step, (err, _) in enumerate(r["steps"]):
            # Nearest rounding: a node's decoded shard is within scale / 2 of (node mean +
            # residual), scale <= absmax / levels <= gmax / levels; error feedback adds the
            # previous residual (<= the same) from step 1 on. Mean over 2 nodes.
            bound = (0.5 if step == 0 else 1.0) * gmax / levels * (1 + 1e-5)
            assert err <= bound, (step, err, bound)
        assert max(e for e, _ in r["steps"]) > 0  # it did quantize
        assert r["inter"] > 0
        restored = pickle.loads(r["pickled"])
        assert isinstance(restored, HierarchicalQuantState)
        assert restored.bits == bits and restored._allreduce is None


def test_state_validation_and_pickle_without_groups() -> None:
    with pytest.raises(ValueError, match="bits"):
        HierarchicalQuantState(bits=3)
    with pytest.raises(ValueError, match="procs_per_node"):
        HierarchicalQuantState(procs_per_node=0)
    with pytest.raises(ValueError, match="block_size"):
        HierarchicalQuantState(block_size=48)
    state = pickle.loads(pickle.dumps(HierarchicalQuantState(2, bits=8, seed=5)))
    assert (state.procs_per_node, state.bits, state.seed) == (2, 8, 5)
    with pytest.raises(TypeError, match="HierarchicalQuantState"):
        hierarchical_quantized_hook(object(), None)  # type: ignore[arg-type]
