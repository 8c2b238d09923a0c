"""qcomm.hooks: the DDP comm hook against DDP's fp32 allreduce (2 nodes x 2 ranks over Gloo),
within the codec's bound; the warm-up is DDP's own allreduce, bit for bit; the future completes
when the communication does, and carries its failure; the state object pickles without process
groups or threads."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator

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
    keys = state.allreduce().error_feedback.keys() if state.stats else []
    return {"steps": out, "iter": state.iter, "pickled": pickle.dumps(state), "keys": keys}


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
        # DDP's first bucket and its rebuilt one (another order, the same size) keep apart
        # residuals: one is never added to the other's layout.
        assert len({k.rsplit("/", 1)[0] for k in r["keys"]}) == 2, r["keys"]
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
    assert r["first"][1] == ("hierarchical allreduce (inter-node all-gather): no answer from "
                             "ranks [1] over the inter-node link within 1 s")
    assert r["later"][0] == PeerTimeoutError.__name__ and r["later"][1] < 0.5


def _scaler_body(rank: int, world: int, on_nonfinite: str) -> dict:
    """DDP with the hook (2 nodes of 1) and torch's GradScaler, as mixed precision in float16
    trains: at step 1 rank 1's input holds an Inf, so its gradients overflow."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    warnings.simplefilter("ignore")   # GradScaler on CPU, DDP's own warnings
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    state = HierarchicalQuantState(procs_per_node=1, bits=4, block_size=32,
                                   on_nonfinite=on_nonfinite)
    model.register_comm_hook(state, hierarchical_quantized_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g)
        if step == 1 and rank == 1:
            x[0, 0] = float("inf")
        before = model.module.weight.detach().clone()
        try:
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        except RuntimeError as e:   # DDP hands the future's error on as a RuntimeError
            steps.append(("error", str(e)))
        else:
            steps.append(("moved" if not torch.equal(before, model.module.weight) else "kept",
                          scaler.get_scale()))
    state.close()
    return {"steps": steps, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("on_nonfinite", ["propagate", "raise"])
def test_an_overflowing_step_under_gradscaler(gloo, on_nonfinite: str) -> None:
    """"propagate": the overflowing bucket comes back NaN on both ranks, GradScaler skips that
    step on both and halves its scale, and training goes on. "raise" (the default): both
    ranks' backward raises, naming the option; a caller that goes on trains on (the groups
    and residuals in step). Before, the overflow ended the run on both ranks ("payloads carry
    non-finite values"), and every later bucket failed with it."""
    res = gloo.run(_scaler_body, 2, args=(on_nonfinite,))
    for r in res:
        first, overflow, *after = r["steps"]
        assert first == ("moved", 1024.0), r["steps"]
        if on_nonfinite == "propagate":
            assert overflow == ("kept", 512.0), r["steps"]
            assert after == [("moved", 512.0)] * 2, r["steps"]
        else:
            assert overflow[0] == "error" and "non-finite" in overflow[1], r["steps"]
            assert "on_nonfinite='propagate'" in overflow[1], r["steps"]
            assert after == [("moved", 1024.0)] * 2, r["steps"]
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"],
                                                 strict=True))


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
    with pytest.raises(ValueError, match=r"on_nonfinite must be one of \('raise', 'propagate'\)"):
        HierarchicalQuantState(on_nonfinite="skip")
    state = pickle.loads(pickle.dumps(HierarchicalQuantState(2, bits=8, seed=5, start_iter=3,
                                                             on_nonfinite="propagate")))
    assert (state.procs_per_node, state.bits, state.seed, state.start_iter) == (2, 8, 5, 3)
    assert state.on_nonfinite == "propagate"
    assert state.warming_up and state.iter == 0
    with pytest.raises(TypeError, match="HierarchicalQuantState"):
        hierarchical_quantized_hook(object(), None)  # type: ignore[arg-type]


@pytest.fixture
def fake_world_of_4() -> Iterator[None]:
    """torch.distributed initialized in this process as rank 0 of 4, with torch's fake
    backend (collectives return at once, nothing is sent): a job whose size is known."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


NOT_DIVISIBLE = ("every node must have the same number of ranks: world_size=4 is not divisible "
                 "by procs_per_node=3")


def test_a_bad_node_layout_raises_when_the_state_is_made(fake_world_of_4: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Under an initialized job the layout is checked at construction, whatever the warm-up
    (it used to wait for the first quantized bucket, ``start_iter`` iterations in)."""
    with pytest.raises(ValueError, match=NOT_DIVISIBLE):
        HierarchicalQuantState(3, start_iter=100)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's, when procs_per_node is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=NOT_DIVISIBLE):
        HierarchicalQuantState(start_iter=100)
    state = HierarchicalQuantState(2, start_iter=100)
    assert state._allreduce is None  # checked without making a group (not collective)


def test_a_state_made_before_init_checks_its_layout_at_the_first_warm_up_bucket() -> None:
    """Made before ``init_process_group`` (the job unknown), a state is checked at the first
    hook call, a warm-up bucket, before DDP's allreduce runs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    state = HierarchicalQuantState(3, start_iter=100)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        ddp.register_comm_hook(state, hierarchical_quantized_hook)
        with pytest.raises(ValueError, match=NOT_DIVISIBLE):
            ddp(torch.randn(3, 4)).sum().backward()
        assert state.iter == 0
    finally:
        dist.destroy_process_group()


def _grads(model: torch.nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 40, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _layers() -> torch.nn.Module:
    """One parameter tensor: DDP's first bucket and its rebuilt one then hold the same layout
    (with several, the order changes at the rebuild), so a fresh DDP after a restart quantizes
    the very layout the saved residuals belong to from its first iteration on."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 40, bias=False), torch.nn.Tanh())


def _resume_body(rank: int, world: int, rail: str) -> dict:
    """3 iterations, state_dict saved (pickled: a copy), 2 more; a fresh DDP and state loaded
    from the copy run the same 2: the same gradients bit for bit, both residuals restored."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    first = DDP(_layers())
    state = HierarchicalQuantState(procs_per_node=1, bits=4, block_size=32, seed=4,
                                   rounding="stochastic", rail_collective=rail)
    first.register_comm_hook(state, hierarchical_quantized_hook)
    for step in range(3):
        _grads(first, rank, step)
    state.close()
    saved = pickle.dumps(state.state_dict())
    keys = sorted(state.state_dict()["allreduce_state"]["error_feedback"]["residuals"])
    after = [_grads(first, rank, step) for step in (3, 4)]
    state.close()

    second = DDP(_layers())
    resumed = HierarchicalQuantState()
    resumed.load_state_dict(pickle.loads(saved))
    second.register_comm_hook(resumed, hierarchical_quantized_hook)
    again = [_grads(second, rank, step) for step in (3, 4)]
    resumed.close()
    same = all(torch.equal(a, b) for x, y in zip(after, again, strict=True)
               for a, b in zip(x, y, strict=True))
    return {"same": same, "keys": keys, "form": state.allreduce().rail_form,
            "inter": state.stats.snapshot()["bytes_sent"]["inter"], "iter": resumed.iter}


@pytest.mark.parametrize("rail", ["auto", "all_gather"])
def test_state_dict_resumes_the_hook_bit_for_bit_with_both_residuals(gloo, rail) -> None:
    res = gloo.run(_resume_body, 4, args=(rail,))
    for r in res:
        assert r["same"] and r["iter"] == 5
        owner = [k for k in r["keys"] if k.endswith("/owner")]
        if rail == "auto":  # 4 nodes: the two-stage reduce-scatter, two residuals per bucket
            assert r["form"] == "reduce_scatter" and owner and len(r["keys"]) == 2 * len(owner)
        else:
            assert r["form"] == "all_gather" and not owner


def test_reduce_scatter_sends_half_the_all_gathers_bytes_at_four_nodes(gloo) -> None:
    """Counted by the hook's stats over the same 5 iterations (1 bucket of 640 parameters,
    whole blocks): 2 (N-1)/N payloads of the shard against N - 1."""
    rs = gloo.run(_resume_body, 4, args=("reduce_scatter",))[0]["inter"]
    ag = gloo.run(_resume_body, 4, args=("all_gather",))[0]["inter"]
    assert rs / ag == pytest.approx(0.5, rel=0.02)


def test_load_state_dict_refuses_bad_state_and_keeps_its_own() -> None:
    state = HierarchicalQuantState(2, bits=8, start_iter=3)
    with pytest.raises(ValueError, match="state must be a dict from"):
        state.load_state_dict([1])
    bad = HierarchicalQuantState(2, bits=4).state_dict() | {"rail_collective": "ring"}
    with pytest.raises(ValueError, match="rail_collective"):
        state.load_state_dict(bad)
    assert (state.bits, state.start_iter, state.rail_collective) == (8, 3, "auto")


def test_the_hook_takes_the_optimizers_options_object() -> None:
    from qcomm.engine import CommOptions

    state = HierarchicalQuantState(comm=CommOptions(bits=2, block_size=64, procs_per_node=4,
                                                    seed=3, timeout_s=30.0),
                                   start_iter=2)
    assert (state.bits, state.block_size, state.procs_per_node, state.seed, state.timeout_s,
            state.start_iter) == (2, 64, 4, 3, 30.0, 2)
    with pytest.raises(TypeError, match="pass bits in comm= or as keywords, not both"):
        HierarchicalQuantState(bits=8, comm=CommOptions())
    with pytest.raises(ValueError, match="comm sets sync_every, fragments, which the DDP hook"):
        HierarchicalQuantState(comm=CommOptions(sync_every=4, fragments=2))
    with pytest.raises(TypeError, match="comm must be a CommOptions"):
        HierarchicalQuantState(comm={"bits": 2})
