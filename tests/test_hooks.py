"""qcomm.hooks: the DDP comm hook against DDP's fp32 allreduce (2 nodes x 2 ranks over Gloo),
within the codec's bound; the warm-up is DDP's own allreduce, bit for bit; the future completes
when the communication does, and carries its failure; the state object pickles without process
groups or threads."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.errors import PeerTimeoutError
from qcomm.hooks import HierarchicalQuantState, hierarchical_quantized_hook
from qcomm.testing.multiprocess import run_world


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _hook_body(rank: int, world: int, bits: int, start_iter: int, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = DDP(_model())
    ours = DDP(_model())
    state = HierarchicalQuantState(procs_per_node=2, bits=bits, block_size=32,
                                   rounding="nearest", start_iter=start_iter)
    ours.register_comm_hook(state, hierarchical_quantized_hook)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for model in (ref, ours):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        # This rank's own gradients (no averaging), for the bound.
        plain = _model()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        local = max(p.grad.abs().max().item() for p in plain.parameters())
        err = max((a.grad - b.grad).abs().max().item()
                  for a, b in zip(ref.parameters(), ours.parameters(), strict=True))
        inter = state.stats.snapshot()["bytes_sent"]["inter"] if state.stats else 0
        out.append((err, local, inter))
    state.close()
    return {"steps": out, "iter": state.iter, "pickled": pickle.dumps(state)}


def test_hook_matches_fp32_allreduce_within_codec_bound(gloo) -> None:
    bits = 4
    res = gloo.run(_hook_body, 4, args=(bits, 0, 4))
    levels = 2 ** (bits - 1) - 1
    gmax = max(local for r in res for _, local, _ in r["steps"])
    for r in res:
        for step, (err, _, _) in enumerate(r["steps"]):
            # Nearest rounding: a node's decoded shard is within scale / 2 of (node mean +
            # residual), scale <= absmax / levels <= gmax / levels; error feedback adds the
            # previous residual (<= the same) from step 1 on. Mean over 2 nodes.
            bound = (0.5 if step == 0 else 1.0) * gmax / levels * (1 + 1e-5)
            assert err <= bound, (step, err, bound)
        assert max(e for e, _, _ in r["steps"]) > 0  # it did quantize
        assert r["steps"][-1][2] > 0
        restored = pickle.loads(r["pickled"])
        assert isinstance(restored, HierarchicalQuantState)
        assert restored.bits == bits and restored._allreduce is None
        assert restored.iter == 4 and restored._worker is None


def test_warm_up_is_ddps_own_allreduce_then_quantized(gloo) -> None:
    """start_iter=2: iterations 0 and 1 give DDP's gradients bit for bit and send nothing
    through the hierarchy; from iteration 2 on the gradients are quantized."""
    res = gloo.run(_hook_body, 4, args=(4, 2, 4))
    for r in res:
        (e0, _, b0), (e1, _, b1), (e2, _, b2), (_, _, b3) = r["steps"]
        assert e0 == e1 == 0.0 and b0 == b1 == 0
        assert e2 > 0 and 0 < b2 < b3
        assert r["iter"] == 4


def _async_body(rank: int, world: int) -> dict:
    """The future of a bucket is pending until every rank has joined (rank 1 is 1 s late), then
    holds the mean; the hook call itself returned at once."""
    state = HierarchicalQuantState(procs_per_node=1, process_group=dist.group.WORLD, bits=8,
                                   block_size=32, rounding="nearest")
    state.allreduce()  # the groups exist before the delay (their creation is collective)
    if rank == 1:
        time.sleep(1.0)
    t = torch.full((64,), float(rank))
    t0 = time.monotonic()
    fut = state._submit(t, key="bucket0:64")
    returned_after = time.monotonic() - t0
    pending = not fut.done()
    value = fut.wait()
    state.close()
    return {"returned_after": returned_after, "pending": pending, "value": value.tolist()}


def test_future_completes_when_the_communication_does(gloo) -> None:
    res = gloo.run(_async_body, 2)
    assert res[0]["pending"] and res[0]["returned_after"] < 0.5
    for r in res:
        assert r["value"] == [0.5] * 64  # (0 + 1) / 2: exact in 8 bits


def _failure_body(rank: int, world: int) -> object:
    """Rank 1 never sends its bucket: rank 0's future fails with PeerTimeoutError (within the
    state's timeout), and so does every later bucket, at once."""
    state = HierarchicalQuantState(procs_per_node=1, bits=8, timeout_s=1.0)
    state.allreduce()
    if rank == 1:
        time.sleep(3.0)
        return None
    fut = state._submit(torch.ones(64), key="b0")
    try:
        fut.wait()
    except Exception as e:
        first = (type(e).__name__, str(e))
    else:
        return "no error"
    t0 = time.monotonic()
    try:
        state._submit(torch.ones(64), key="b1").wait()
    except Exception as e:
        later = (type(e).__name__, time.monotonic() - t0)
    return {"first": first, "later": later}


@pytest.mark.timeout(150)
def test_a_failed_bucket_fails_its_future() -> None:
    r = run_world(_failure_body, 2, timeout_s=120)[0]
    assert r["first"][0] == PeerTimeoutError.__name__
    assert r["first"][1] == "hierarchical allreduce: no answer from ranks [1] within 1 s"
    assert r["later"][0] == PeerTimeoutError.__name__ and r["later"][1] < 0.5


def test_state_validation_and_pickle_without_groups() -> None:
    with pytest.raises(ValueError, match="bits"):
        HierarchicalQuantState(bits=3)
    with pytest.raises(ValueError, match="procs_per_node"):
        HierarchicalQuantState(procs_per_node=0)
    with pytest.raises(ValueError, match="block_size"):
        HierarchicalQuantState(block_size=48)
    with pytest.raises(ValueError, match="start_iter must be an int >= 0"):
        HierarchicalQuantState(start_iter=-1)
    with pytest.raises(TypeError, match="timeout_s"):
        HierarchicalQuantState(timeout_s="1")
    with pytest.raises(ValueError, match="process_group must be None or the default group"):
        HierarchicalQuantState(process_group=object())
    state = pickle.loads(pickle.dumps(HierarchicalQuantState(2, bits=8, seed=5, start_iter=3)))
    assert (state.procs_per_node, state.bits, state.seed, state.start_iter) == (2, 8, 5, 3)
    assert state.warming_up and state.iter == 0
    with pytest.raises(TypeError, match="HierarchicalQuantState"):
        hierarchical_quantized_hook(object(), None)  # type: ignore[arg-type]
