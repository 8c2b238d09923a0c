"""HierarchicalOptimizer in one process: exactly the wrapped optimizer (bit for bit, with
schedulers and param groups), the torch.optim surface (hooks, state_dict, pickling), and the
errors a user meets first."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from qcomm.sgd import ASSGD, HierarchicalOptimizer, NonFiniteGradientError

STEPS = 20


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters()), "lr": 0.02},
            {"params": list(model[2].parameters()), "weight_decay": 0.0}]


INNER = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.05),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer,
           sched: torch.optim.lr_scheduler.LRScheduler, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 7, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step % 3 == 2:
            model[2].bias.grad = None  # a parameter without gradient on some steps
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    sb.pop("qcomm", None)
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(
        (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb)
        for k in sa["state"] for (ka, va), (kb, vb) in
        zip(sorted(sa["state"][k].items()), sorted(sb["state"][k].items()), strict=True))


@pytest.mark.parametrize("name", sorted(INNER))
def test_bit_identical_to_the_wrapped_optimizer(name: str) -> None:
    ref, ours = _model(), _model()
    plain = INNER[name](_groups(ref))
    wrapped = HierarchicalOptimizer(INNER[name](_groups(ours)), bits=4)
    sched_a = torch.optim.lr_scheduler.CosineAnnealingLR(plain, T_max=STEPS)
    sched_b = torch.optim.lr_scheduler.CosineAnnealingLR(wrapped, T_max=STEPS)
    _train(ref, plain, sched_a, range(STEPS))
    _train(ours, wrapped, sched_b, range(STEPS))
    for pa, pb in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert _same_state(plain, wrapped)
    assert [g["lr"] for g in plain.param_groups] == [g["lr"] for g in wrapped.param_groups]
    assert wrapped.stats()["steps"] == STEPS


def test_its_groups_state_and_defaults_are_the_wrapped_optimizers() -> None:
    model = _model()
    inner = torch.optim.AdamW(_groups(model), lr=0.01)
    opt = HierarchicalOptimizer(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.5})
    assert len(inner.param_groups) == 3


def test_step_hooks_run_once_around_a_step() -> None:
    model = _model()
    opt = HierarchicalOptimizer(torch.optim.AdamW(_groups(model), lr=0.01))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    assert calls == ["pre", "post"]


@pytest.mark.parametrize(("make", "exc", "match"), [
    (lambda m: HierarchicalOptimizer(
        HierarchicalOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))),
     TypeError, "already a HierarchicalOptimizer"),
    (lambda m: HierarchicalOptimizer(m.parameters()), TypeError,
     r"must be a torch\.optim\.Optimizer"),
    (lambda m: HierarchicalOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bitz=4), TypeError,
     "unknown communication option 'bitz'"),
    (lambda m: HierarchicalOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), bits=3), ValueError,
     "bits must be one of"),
    (lambda m: HierarchicalOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), seed=2**70),
     ValueError, r"seed must be an int in \[0, 2\*\*64\), got \d+"),
], ids=["wrapped-twice", "not-an-optimizer", "unknown-option", "bits", "seed"])
def test_bad_construction_names_the_argument(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make(_model())


def test_closure_loss_and_state_dict_round_trip() -> None:
    model, copy_model = _model(), _model()
    opt = HierarchicalOptimizer(torch.optim.AdamW(_groups(model), lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    _train(model, opt, sched, range(5))
    sd = opt.state_dict()
    assert sd["qcomm"]["format"] == 2 and sd["qcomm"]["steps"] == 5
    copy_model.load_state_dict(model.state_dict())
    opt2 = HierarchicalOptimizer(torch.optim.AdamW(_groups(copy_model), lr=0.01))
    opt2.load_state_dict(copy.deepcopy(sd))
    assert opt2.stats()["steps"] == 5
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3)
    sched2.load_state_dict(sched.state_dict())
    _train(model, opt, sched, range(5, 9))
    _train(copy_model, opt2, sched2, range(5, 9))
    assert all(torch.equal(a, b) for a, b in
               zip(model.parameters(), copy_model.parameters(), strict=True))
    # A plain AdamW state dict loads too (the communication state starts fresh).
    opt3 = HierarchicalOptimizer(torch.optim.AdamW(_groups(_model()), lr=0.01))
    plain = dict(sd)
    del plain["qcomm"]
    opt3.load_state_dict(plain)
    assert opt3.stats()["steps"] == 0

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(1, 7)).sum()
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)


def test_load_errors_change_nothing() -> None:
    model = _model()
    opt = HierarchicalOptimizer(torch.optim.AdamW(_groups(model), lr=0.01))
    _train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 3), range(3))
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["qcomm"]["world_size"] = 4
    with pytest.raises(ValueError, match=r"world size 4 .*world size 1"):
        opt.load_state_dict(bad)
    wrong_groups = copy.deepcopy(before)
    wrong_groups["param_groups"] = wrong_groups["param_groups"][:1]
    with pytest.raises(ValueError):
        opt.load_state_dict(wrong_groups)
    after = opt.state_dict()
    assert after["qcomm"]["steps"] == before["qcomm"]["steps"] == 3
    for k in before["state"]:
        for name, v in before["state"][k].items():
            assert torch.equal(v, after["state"][k][name])


def test_nonfinite_gradient_raises_and_changes_nothing() -> None:
    model = _model()
    opt = HierarchicalOptimizer(torch.optim.AdamW(_groups(model), lr=0.01))
    _train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 3), range(2))
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    model(torch.randn(2, 7)).sum().backward()
    model[2].weight.grad[0, 1] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"\(1, 0\)") as info:
        opt.step()
    assert info.value.params == [(1, 0)]
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert opt.state_dict()["qcomm"]["steps"] == state["qcomm"]["steps"]
    skip = HierarchicalOptimizer(torch.optim.AdamW(_groups(model), lr=0.01),
                                 on_nonfinite="skip")
    skip.step()
    assert skip.stats()["skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


def test_sparse_gradient_raises_typeerror_and_changes_nothing() -> None:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = HierarchicalOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(TypeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(before, emb.weight)


def test_world_size_without_process_group_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    model = _model()
    opt = HierarchicalOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE=4 is set but torch.distributed"):
        model(torch.randn(2, 7)).sum().backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once only


def test_pickle_and_deepcopy_keep_options_and_counters() -> None:
    model = _model()
    opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), bits=8,
                                staleness=2)
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.comm == opt.comm and clone.stats()["steps"] == 1
        assert clone.engine.owner is clone.optimizer
        clone.step()
        assert clone.stats()["steps"] == 2


def test_assgd_is_sgd_on_the_engine_and_unknown_options_are_named() -> None:
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1, graph="exponential")
    assert isinstance(opt.optimizer, torch.optim.SGD) and opt.comm.graph == "exponential"
    with pytest.raises(TypeError, match=r"unknown communication option 'topology'; accepted: "
                                        r"bits, block_size, .*graph"):
        ASSGD(model.parameters(), lr=0.1, topology="ring")
