"""ASSGD without torch.distributed: bit-identical to torch.optim.SGD, validation, non-finite
gradients, state_dict and checkpoint round trips."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

from qcomm.sgd import ASSGD, NonFiniteGradientError, load_checkpoint, save_checkpoint

STEPS = 40

# Every valid combination (nesterov needs momentum > 0 and dampening 0).
COMBOS = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
    for m, d, n, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.3), (False, True),
                                             (0.0, 1e-2), (False, True))
    if not (n and (m == 0 or d != 0))
]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    # Two groups with their own lr (and one overriding momentum when it is used).
    return [{"params": list(model[0].parameters()), "lr": 0.05},
            {"params": list(model[2].parameters())}]


def _set_grads(model: torch.nn.Module, gen: torch.Generator, step: int) -> None:
    for i, p in enumerate(model.parameters()):
        # The second layer's bias has no gradient on odd steps (skipped by SGD, as by ASSGD).
        if i == 3 and step % 2:
            p.grad = None
            continue
        p.grad = torch.randn(p.shape, generator=gen) * 3.0


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, oa: torch.optim.Optimizer,
                 ob: torch.optim.Optimizer) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), (pa - pb).abs().max()
        sa, sb = oa.state.get(pa, {}), ob.state.get(pb, {})
        assert sa.keys() == sb.keys()
        if "momentum_buffer" in sa:
            assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("hp", COMBOS, ids=lambda h: "-".join(f"{k}={v}" for k, v in h.items()))
def test_bit_identical_to_torch_sgd(hp: dict, foreach: bool | None) -> None:
    ref, ours = _model(), _model()
    sgd = torch.optim.SGD(_groups(ref), lr=0.1, foreach=foreach, **hp)
    assgd = ASSGD(_groups(ours), lr=0.1, foreach=foreach, **hp)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(STEPS):
        _set_grads(ref, gen_a, step)
        _set_grads(ours, gen_b, step)
        sgd.step()
        assgd.step()
    _assert_same(ref, ours, sgd, assgd)


def test_scheduler_closure_zero_grad_and_add_param_group() -> None:
    ref, ours = _model(), _model()
    kw = dict(lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-3)
    sgd = torch.optim.SGD(list(ref[0].parameters()), **kw)
    assgd = ASSGD(list(ours[0].parameters()), **kw)
    sgd.add_param_group({"params": list(ref[2].parameters()), "lr": 0.01})
    assgd.add_param_group({"params": list(ours[2].parameters()), "lr": 0.01})
    sched_a = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=[0.3, 0.05], total_steps=STEPS)
    sched_b = torch.optim.lr_scheduler.OneCycleLR(assgd, max_lr=[0.3, 0.05], total_steps=STEPS)
    torch.manual_seed(3)
    data = [(torch.randn(16, 7), torch.randint(0, 3, (16,))) for _ in range(STEPS)]
    for x, y in data:
        for model, opt, sched in ((ref, sgd, sched_a), (ours, assgd, sched_b)):
            def closure(model=model, opt=opt, x=x, y=y) -> torch.Tensor:
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            loss = opt.step(closure)
            assert loss is not None and loss.requires_grad
            sched.step()
    assert [g["lr"] for g in sgd.param_groups] == [g["lr"] for g in assgd.param_groups]
    _assert_same(ref, ours, sgd, assgd)
    assgd.zero_grad()
    assert all(p.grad is None for p in ours.parameters())


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(lr=float("nan")), "lr"),
    (dict(momentum=-0.1), "Invalid momentum value: -0.1"),
    (dict(weight_decay=-1e-4), "Invalid weight_decay value: -0.0001"),
    (dict(dampening=1.5), "dampening"),
    (dict(nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), "Nesterov momentum requires"),
    (dict(bits=3), "bits"),
    (dict(block_size=100), "block_size"),
    (dict(rounding="up"), "rounding"),
    (dict(graph="star"), "graph"),
    (dict(mixing="random"), "mixing"),
    (dict(staleness=-1), "staleness"),
    (dict(gamma=0.0), "gamma"),
    (dict(gamma=1.5), "gamma"),
    (dict(intra_bits=16), "intra_bits"),
    (dict(procs_per_node=0), "procs_per_node"),
    (dict(on_nonfinite="ignore"), "on_nonfinite"),
    (dict(timeout_s=0), "timeout_s"),
])
def test_bad_hyperparameters_raise_valueerror_naming_them(kwargs: dict, match: str) -> None:
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ASSGD(_model().parameters(), **kwargs)


def test_bad_types_and_bad_param_group() -> None:
    with pytest.raises(TypeError, match="staleness"):
        ASSGD(_model().parameters(), lr=0.1, staleness=1.5)
    with pytest.raises(TypeError, match="nesterov"):
        ASSGD(_model().parameters(), lr=0.1, momentum=0.9, nesterov="yes")
    model = _model()
    opt = ASSGD(list(model[0].parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"Invalid learning rate: -2\.0"):
        opt.add_param_group({"params": list(model[2].parameters()), "lr": -2.0})
    assert len(opt.param_groups) == 1


def _snapshot(model: torch.nn.Module, opt: ASSGD) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()
            if "momentum_buffer" in opt.state.get(p, {})]
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raises_and_changes_nothing(bad: float) -> None:
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        _set_grads(model, gen, step)
        opt.step()
    before = _snapshot(model, opt)
    _set_grads(model, gen, 4)
    next(iter(model[2].parameters())).grad[1, 2] = bad
    with pytest.raises(NonFiniteGradientError, match=r"non-finite.*\(0, 2\)") as err:
        opt.step()
    assert err.value.params == [(0, 2)]
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert opt.stats()["steps"] == 3


def test_nonfinite_skip_changes_nothing_then_training_continues() -> None:
    ref, ours = _model(), _model()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = ASSGD(ours.parameters(), lr=0.1, momentum=0.9, on_nonfinite="skip")
    gen_a, gen_b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for step in range(6):
        _set_grads(ref, gen_a, step)
        _set_grads(ours, gen_b, step)
        if step == 3:  # a NaN step: ASSGD skips it, the reference simply does not step
            next(iter(ours.parameters())).grad[0, 0] = float("nan")
            before = _snapshot(ours, opt)
            opt.step()
            assert all(torch.equal(a, b) for a, b in
                       zip(before, _snapshot(ours, opt), strict=True))
            continue
        sgd.step()
        opt.step()
    _assert_same(ref, ours, sgd, opt)
    assert opt.stats()["skipped_steps"] == 1 and opt.stats()["steps"] == 5


def test_state_dict_round_trip_continues_bit_identically(tmp_path) -> None:
    kw = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    full, resumed = _model(), _model()
    opt_full = ASSGD(full.parameters(), **kw)
    gen = torch.Generator().manual_seed(0)
    grads = []
    for step in range(10):
        _set_grads(full, gen, step)
        grads.append([None if p.grad is None else p.grad.clone() for p in full.parameters()])
    # Uninterrupted run.
    for g in grads:
        for p, gi in zip(full.parameters(), g, strict=True):
            p.grad = None if gi is None else gi.clone()
        opt_full.step()
    # Interrupted at step 6: save, build everything afresh, load, continue.
    first = _model()
    opt_first = ASSGD(first.parameters(), **kw)
    for g in grads[:6]:
        for p, gi in zip(first.parameters(), g, strict=True):
            p.grad = None if gi is None else gi.clone()
        opt_first.step()
    save_checkpoint(tmp_path, opt_first, first, extra={"step": 6})
    resumed = _model(seed=99)  # different init: the checkpoint must overwrite it
    opt_resumed = ASSGD(resumed.parameters(), **kw)
    assert load_checkpoint(tmp_path, opt_resumed, resumed) == {"step": 6}
    for g in grads[6:]:
        for p, gi in zip(resumed.parameters(), g, strict=True):
            p.grad = None if gi is None else gi.clone()
        opt_resumed.step()
    _assert_same(full, resumed, opt_full, opt_resumed)
    assert opt_resumed.stats()["steps"] == 10


def test_load_state_dict_bad_input_changes_nothing() -> None:
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on_world_size_change"):
        opt.load_state_dict(opt.state_dict(), on_world_size_change="drop")
    sd = copy.deepcopy(opt.state_dict())
    sd["qcomm"]["world_size"] = 8
    sd["qcomm"]["procs_per_node"] = 4
    with pytest.raises(ValueError, match=r"world size 8.*world size 1"):
        opt.load_state_dict(sd)


def test_deepcopy_keeps_options_and_state() -> None:
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9, bits=2, staleness=2)
    gen = torch.Generator().manual_seed(0)
    _set_grads(model, gen, 0)
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin.comm == opt.comm and twin.stats()["steps"] == 1
    assert len(twin.state) == len(opt.state)


def test_single_process_extras_are_noops() -> None:
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.average_parameters()
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    st = opt.stats(consensus=True)
    assert st["bytes_sent"] == {"intra": 0, "inter": 0} and st["consensus_distance"] is None


def test_a_missing_own_file_of_the_same_world_size_says_so(tmp_path) -> None:
    """The directory was saved by a world of this size but this rank's file is not there
    (a directory per machine, handed to the wrong one): FileNotFoundError naming the file,
    not a world-size error; nothing loaded."""
    model = _model()
    opt = ASSGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, opt, model)
    (tmp_path / "rank00000.pt").rename(tmp_path / "rank00001.pt")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FileNotFoundError, match=r"no file rank00000\.pt .*world of 1"):
        load_checkpoint(tmp_path, opt, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_comm_options_object_and_keywords_build_the_same_options() -> None:
    """comm= is the one options object; keywords build it, or replace its fields."""
    from qcomm.engine import CommOptions

    base = CommOptions(bits=2, sync_every=4, fragments=2, rounding="nearest")
    a = ASSGD(_model().parameters(), lr=0.1, comm=base)
    b = ASSGD(_model().parameters(), lr=0.1, bits=2, sync_every=4, fragments=2,
              rounding="nearest")
    c = ASSGD(_model().parameters(), lr=0.1, comm=base, bits=8)
    assert a.comm == b.comm == base
    assert c.comm == CommOptions(bits=8, sync_every=4, fragments=2, rounding="nearest")
    with pytest.raises(TypeError, match="comm must be a CommOptions"):
        ASSGD(_model().parameters(), lr=0.1, comm={"bits": 2})
    with pytest.raises(ValueError, match="bits"):  # keywords over comm are validated again
        ASSGD(_model().parameters(), lr=0.1, comm=base, bits=3)


def test_outer_momentum_around_an_adaptive_optimizer_warns_at_the_callers_line() -> None:
    from qcomm.sgd import HierarchicalOptimizer

    model = _model()
    with pytest.warns(UserWarning, match=r"outer_momentum=0.5 around AdamW") as caught:
        HierarchicalOptimizer(torch.optim.AdamW(model.parameters()), sync_every=4,
                              fragments=2, outer_momentum=0.5)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SGD: the outer momentum is what SGD needs, no warning
        ASSGD(model.parameters(), lr=0.1, sync_every=4, fragments=2, outer_momentum=0.5)
