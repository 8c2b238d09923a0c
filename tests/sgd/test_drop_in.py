"""torch.optim's generic optimizer checks, run against qcomm's optimizers in one process.

torch ships the inputs of its generic optimizer tests (``torch.testing._internal.
common_optimizers``: ``optim_db``, one ``OptimizerInfo`` per optimizer with its constructor
arguments, schedulers and error cases); the tests themselves live in torch's source tree, not
in the wheel. The checks below are those tests, written here against four subjects: ``ASSGD``
with SGD's inputs, and ``HierarchicalOptimizer`` wrapping SGD, Adam and AdamW with theirs. A
test named as torch's (``test_forloop_goes_right_direction``, ``test_complex``, ...) makes its
checks; where a check runs an optimizer, the subject also runs beside the plain torch optimizer
and must match it bit for bit (in one process a wrapper adds nothing to the step). The tests
after them check what the wrappers add or refuse (host reads, sparse gradients, peers).

Not here: torch's tests that need CUDA or several GPUs (multi-GPU direction, mixed devices
and dtypes, foreach and fused large tensors, peak memory, default dtype with foreach, CPU
state loaded on CUDA, fused CPU against CUDA, foreach as the CUDA default) and those about
other optimizers (LBFGS's return types, the OptimizerInfo table itself).

Importing ``common_optimizers`` needs ``expecttest`` (the ``test`` extra) and calls
``torch.backends.disable_global_flags()`` for the rest of the session (nothing in this suite
sets ``torch.backends`` flags).
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.nn import Parameter
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum,
    OptimizerInfo,
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)
from torch.utils._python_dispatch import TorchDispatchMode

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.engine import gradients
from qcomm.sgd import ASSGD, HierarchicalOptimizer

DEVICE = "cpu"


def _info(cls: type[Optimizer]) -> OptimizerInfo:
    return next(o for o in optim_db if o.optim_cls is cls)


@dataclass(frozen=True)
class Subject:
    """An optimizer under test: ``make(params, **kwargs)`` builds it with the arguments of
    ``plain``, the torch optimizer it must behave as."""

    name: str
    plain: type[Optimizer]
    make: Callable[..., Optimizer]

    @property
    def info(self) -> OptimizerInfo:
        return _info(self.plain)


def _wrapping(cls: type[Optimizer]) -> Callable[..., Optimizer]:
    def make(params: Any, **kwargs: Any) -> Optimizer:
        return HierarchicalOptimizer(cls(params, **kwargs))
    return make


SUBJECTS = [
    Subject("ASSGD", SGD, ASSGD),
    Subject("Hierarchical(SGD)", SGD, _wrapping(SGD)),
    Subject("Hierarchical(Adam)", Adam, _wrapping(Adam)),
    Subject("Hierarchical(AdamW)", AdamW, _wrapping(AdamW)),
]
each = pytest.mark.parametrize("subject", SUBJECTS, ids=lambda s: s.name)


def _inputs(subject: Subject, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The constructor arguments torch tests the optimizer with on this device, including its
    implementation flags (foreach, fused, differentiable) one at a time, less ``skip``."""
    return [i.kwargs for i in _get_optim_inputs_including_global_cliquey_kwargs(
        DEVICE, torch.float32, subject.info, skip=skip)]


def _base_inputs(subject: Subject) -> list[dict[str, Any]]:
    """The constructor arguments without the implementation flags."""
    return [i.kwargs for i in subject.info.optim_inputs_func(device=DEVICE)]


def _pair(subject: Subject, params_plain: Any, params_ours: Any,
          kwargs: dict[str, Any]) -> tuple[Optimizer, Optimizer]:
    """The plain torch optimizer and the subject, each with its own copy of ``kwargs`` (a
    tensor lr is updated in place by schedulers)."""
    return (subject.plain(params_plain, **copy.deepcopy(kwargs)),
            subject.make(params_ours, **copy.deepcopy(kwargs)))


def _twins(*tensors: torch.Tensor) -> tuple[list[Parameter], list[Parameter]]:
    """Two lists of Parameters holding the same values (contiguous)."""
    return ([Parameter(t.detach().clone()) for t in tensors],
            [Parameter(t.detach().clone()) for t in tensors])


def _weight_bias(contiguous: bool = True, seed: int = 0) -> list[Parameter]:
    """Fresh ``[weight (10, 5), bias (10)]`` Parameters, the same values for the same seed;
    not contiguous: views of every other element of larger tensors."""
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        return [Parameter(torch.randn(10, 5, generator=gen)),
                Parameter(torch.randn(10, generator=gen))]
    return [Parameter(torch.randn(10, 5, 2, generator=gen)[..., 0]),
            Parameter(torch.randn(10, 2, generator=gen)[..., 0])]


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-for-bit equality of nested dicts, lists and tensors (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        if not a.is_meta:
            assert torch.equal(a, b), f"{where}: max diff {(a - b).abs().max()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} {b.keys()}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _assert_same_run(plain: Optimizer, ours: Optimizer, params_plain: Iterable[torch.Tensor],
                     params_ours: Iterable[torch.Tensor]) -> None:
    """Same parameters and the same optimizer state, bit for bit."""
    for i, (pa, pb) in enumerate(zip(params_plain, params_ours, strict=True)):
        _assert_same(pa, pb, f"param {i}")
        _assert_same(dict(plain.state.get(pa, {})), dict(ours.state.get(pb, {})),
                     f"state of param {i}")


def _step_schedulers(schedulers: list[Any], loss: torch.Tensor) -> None:
    for s in schedulers:
        if isinstance(s, ReduceLROnPlateau):
            s.step(loss.detach())
        else:
            s.step()


def _linear_loss(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w.mv(x) + b).pow(2).sum()


def _closure(opt: Optimizer, w: torch.Tensor, b: torch.Tensor,
             x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _linear_loss(w, b, x)
        loss.backward()
        return loss
    return closure


def _rosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def _without_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(state_dict)
    for group in out["param_groups"]:
        group.pop("param_names", None)
    return out


# =============================================================================================
# torch's generic optimizer tests


@each
def test_errors(subject: Subject) -> None:
    for error in subject.info.optim_error_inputs_func(device=DEVICE, dtype=torch.float32):
        given = error.optimizer_error_input

        def act(given: Any = given, on_step: bool = (
                error.error_on == OptimizerErrorEnum.STEP_ERROR)) -> None:
            opt = subject.make(given.params, **given.kwargs)
            if on_step:
                opt.step()

        if issubclass(error.error_type, Warning):
            with pytest.warns(error.error_type, match=error.error_regex):
                act()
            continue
        with pytest.raises(error.error_type, match=error.error_regex):
            act()


@each
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_lrsched", [True, False])
def test_forloop_goes_right_direction(subject: Subject, contiguous: bool,
                                      with_lrsched: bool) -> None:
    for sched_makers in subject.info.scheduler_inputs if with_lrsched else [[]]:
        for kwargs in _base_inputs(subject):
            kwargs["foreach"] = False  # the for-loop implementation
            (wa, ba), (wb, bb) = _weight_bias(contiguous), _weight_bias(contiguous)
            assert wb.is_contiguous() == contiguous
            x = torch.randn(5, generator=torch.Generator().manual_seed(1))
            plain, ours = _pair(subject, [wa, ba], [wb, bb], kwargs)
            scheds = [[make(o) for make in sched_makers] for o in (plain, ours)]
            with torch.no_grad():
                initial = _linear_loss(wb, bb, x).item()
            for _ in range(20):
                for opt, w, b, ss in ((plain, wa, ba, scheds[0]), (ours, wb, bb, scheds[1])):
                    loss = _closure(opt, w, b, x)()
                    opt.step()
                    _step_schedulers(ss, loss)
            _assert_same_run(plain, ours, [wa, ba], [wb, bb])
            with torch.no_grad():
                final = _linear_loss(wb, bb, x).item()
            assert final > initial if kwargs.get("maximize") else final < initial, kwargs


@each
def test_param_group_with_lrscheduler_goes_right_direction(subject: Subject) -> None:
    for sched_makers in subject.info.scheduler_inputs:
        (wa, ba), (wb, bb) = _twins(*_weight_bias())
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        plain = subject.plain([{"params": [wa]}, {"params": [ba], "lr": 0.01}])
        ours = subject.make([{"params": [wb]}, {"params": [bb], "lr": 0.01}])
        scheds = [[make(o) for make in sched_makers] for o in (plain, ours)]
        with torch.no_grad():
            initial = _linear_loss(wb, bb, x).item()
        for _ in range(20):
            for opt, w, b, ss in ((plain, wa, ba, scheds[0]), (ours, wb, bb, scheds[1])):
                loss = opt.step(_closure(opt, w, b, x))
                _step_schedulers(ss, loss)
        _assert_same_run(plain, ours, [wa, ba], [wb, bb])
        with torch.no_grad():
            assert _linear_loss(wb, bb, x).item() < initial


@each
def test_tensor_lr(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        kwargs.pop("lr", None)
        (w, b), (wt, bt) = _twins(*_weight_bias())
        (wp, bp), _ = _twins(*_weight_bias())
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        ours_float = subject.make([w, b], lr=1e-3, **kwargs)
        try:
            ours = subject.make([wt, bt], lr=torch.tensor(1e-3), **kwargs)
        except ValueError as e:
            assert "lr as a Tensor is not supported" in str(e)
            with pytest.raises(ValueError, match=re.escape(str(e))):
                subject.plain([wp, bp], lr=torch.tensor(1e-3), **kwargs)
            continue
        plain = subject.plain([wp, bp], lr=torch.tensor(1e-3), **kwargs)
        for _ in range(5):
            for opt, ws, bs in ((ours_float, w, b), (ours, wt, bt), (plain, wp, bp)):
                _closure(opt, ws, bs, x)()
                opt.step()
        # A tensor lr and a float lr: as close as torch requires of its own optimizers ...
        torch.testing.assert_close(w, wt)
        torch.testing.assert_close(b, bt)
        # ... and the same bits as the plain optimizer with a tensor lr.
        _assert_same_run(plain, ours, [wp, bp], [wt, bt])


@each
def test_rosenbrock_sparse(subject: Subject) -> None:
    """A documented limit: sparse gradients are refused (TypeError naming them), in one process
    too, with nothing changed (torch runs this test for SGD only: Adam refuses them itself)."""
    param = Parameter(torch.tensor([1.5, 1.5]))
    opt = subject.make([param], lr=4.8e-3)
    _rosenbrock(param).backward()
    opt.step()
    before = (param.detach().clone(), copy.deepcopy(opt.state_dict()))
    param.grad = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([0.5, 1.5]), (2,),
                                         check_invariants=True)
    with pytest.raises(TypeError, match="qcomm does not average sparse gradients"):
        opt.step()
    _assert_same(before[0], param)
    _assert_same(before[1], opt.state_dict())


@each
def test_complex(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable", "fused")):
        gen = torch.Generator().manual_seed(0)
        # the last parameter is real: complex and real ones mix
        values = [torch.randn(10, 5, dtype=torch.complex64, generator=gen),
                  torch.randn(10, dtype=torch.complex64, generator=gen),
                  torch.randn(10, 5, generator=gen)]
        complex_params, plain_params = _twins(*values)
        real_params = [Parameter(torch.view_as_real(v).clone()) if v.is_complex()
                       else Parameter(v.clone()) for v in values]
        plain, ours = _pair(subject, plain_params, complex_params, kwargs)
        ours_real = subject.make(real_params, **copy.deepcopy(kwargs))
        for _ in range(3):
            for pr, pc, pp in zip(real_params, complex_params, plain_params, strict=True):
                pr.grad = torch.randn(pr.shape, generator=gen)
                g = torch.view_as_complex(pr.grad) if pc.is_complex() else pr.grad
                pc.grad, pp.grad = g.clone(), g.clone()
            for opt in (ours_real, ours, plain):
                opt.step()
        # complex and real: as close as torch requires of its own optimizers (Adam's complex
        # path multiplies by the conjugate: not always the same rounding) ...
        for pr, pc in zip(real_params, complex_params, strict=True):
            torch.testing.assert_close(pr, torch.view_as_real(pc) if pc.is_complex() else pc)
        # ... and the same bits as the plain optimizer on the complex parameters
        _assert_same_run(plain, ours, plain_params, complex_params)


@each
def test_complex_2d(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable", "fused")):
        a1 = Parameter(torch.randn(2, dtype=torch.complex64,
                                   generator=torch.Generator().manual_seed(0)))
        a1_plain = Parameter(a1.detach().clone())
        a1_real = Parameter(a1.real.detach().clone())
        a1_imag = Parameter(a1.imag.detach().clone())
        plain, ours = _pair(subject, [a1_plain], [a1], kwargs)
        ours_split = subject.make([a1_real, a1_imag], **copy.deepcopy(kwargs))
        for _ in range(3):
            for opt in (plain, ours, ours_split):
                opt.zero_grad()
            _rosenbrock(a1_plain).abs().backward()
            _rosenbrock(a1).abs().backward()
            # as torch's test does: the split run restarts from the complex run's values, so
            # that only one step's rounding is compared
            with torch.no_grad():
                torch.testing.assert_close(a1_real, a1.real)
                torch.testing.assert_close(a1_imag, a1.imag)
                a1_real.copy_(a1.real)
                a1_imag.copy_(a1.imag)
            _rosenbrock(torch.complex(a1_real, a1_imag)).abs().backward()
            torch.testing.assert_close(a1_real.grad, a1.grad.real)
            torch.testing.assert_close(a1_imag.grad, a1.grad.imag)
            for opt in (plain, ours, ours_split):
                opt.step()
            torch.testing.assert_close(a1.real, a1_real.detach())
            torch.testing.assert_close(a1.imag, a1_imag.detach())
        _assert_same_run(plain, ours, [a1_plain], [a1])


def _tiny_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                               torch.nn.Sigmoid()).to(dtype)


def _compare_between(subject: Subject, kwargs: dict[str, Any], dtype: torch.dtype) -> None:
    """torch's check of an implementation flag, run plain beside the subject: seven steps of a
    small model plus a 0-d parameter, one without gradients, a layer frozen for two; the same
    parameters and state bit for bit after each step."""
    models, params = [], []
    for _ in range(2):
        model = _tiny_model(dtype)
        empty = torch.tensor(0.5, dtype=dtype, requires_grad=True)
        empty.grad = torch.tensor(0.25, dtype=dtype)
        models.append(model)
        params.append([*model.parameters(), empty])
    plain, ours = _pair(subject, params[0], params[1], kwargs)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    for i in range(7):
        for model, opt in zip(models, (plain, ours), strict=True):
            opt.zero_grad()
            if i == 3:
                model[2].requires_grad_(False)
            if i == 5:
                model[2].requires_grad_(True)
            if i != 2:  # no gradients at all: the step is a no-op
                model(x).sum().backward()
            opt.step()
        _assert_same_run(plain, ours, params[0], params[1])


@each
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_foreach_matches_forloop(subject: Subject, dtype: torch.dtype) -> None:
    for kwargs in _base_inputs(subject):
        for foreach in (False, True):
            _compare_between(subject, {**kwargs, "foreach": foreach}, dtype)


@each
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16,
                                   torch.float16])
def test_fused_matches_forloop(subject: Subject, dtype: torch.dtype) -> None:
    assert DEVICE in subject.info.supports_fused_on
    for kwargs in subject.info.optim_inputs_func(device=DEVICE, dtype=dtype):
        for fused in (False, True):
            _compare_between(subject, {**kwargs.kwargs, "fused": fused}, dtype)


@each
def test_fused_error_on_params_on_meta(subject: Subject) -> None:
    with torch.device("meta"):
        model = _tiny_model(torch.float32)
    opt = subject.make(model.parameters(), fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError,
                       match="`fused=True` requires all the params to be floating point Tensors"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.to_empty(device=DEVICE)
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()


@each
@pytest.mark.parametrize("no_grad_scale", [False, True])
def test_fused_does_not_step_if_foundinf(subject: Subject, no_grad_scale: bool) -> None:
    """torch runs this one on CUDA only; the fused kernels of these optimizers run on CPU."""
    for kwargs in _base_inputs(subject):
        params = [torch.ones(1) for _ in range(5)]
        before = [p.clone() for p in params]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = subject.make(params, fused=True, **kwargs)
        opt.grad_scale = None if no_grad_scale else torch.ones(1)
        opt.found_inf = torch.ones(())
        opt.step()
        for p in params:
            if "step" in opt.state[p]:
                _assert_same(torch.zeros(()), opt.state[p]["step"])
        _assert_same(before, params)
        del opt.grad_scale, opt.found_inf
        assert opt.grad_scale is None and opt.found_inf is None


@each
def test_param_groups_weight_decay(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        (wa, ba), (wb, bb) = _twins(*_weight_bias())
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        plain, ours = (make([{"params": [w], **copy.deepcopy(kwargs)},
                             {"params": [b], **copy.deepcopy(kwargs), "weight_decay": 0.0}])
                       for make, w, b in ((subject.plain, wa, ba), (subject.make, wb, bb)))
        with torch.no_grad():
            initial = _linear_loss(wb, bb, x).item()
        for _ in range(20):
            for opt, w, b in ((plain, wa, ba), (ours, wb, bb)):
                loss = _closure(opt, w, b, x)()
                opt.step()
        _assert_same_run(plain, ours, [wa, ba], [wb, bb])
        assert loss.item() > initial if kwargs.get("maximize") else loss.item() < initial


@each
def test_param_groups_lr(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        if not kwargs.get("lr"):
            kwargs["lr"] = 1e-3
        (wa, ba, ia), (wb, bb, ib) = _twins(*_weight_bias(), torch.randn(2))
        irrelevant = ib.detach().clone()
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        plain = subject.plain([{"params": [wa, ba], **copy.deepcopy(kwargs)},
                               {"params": [ia]}], lr=1e-28)
        ours = subject.make([{"params": [wb, bb], **copy.deepcopy(kwargs)},
                             {"params": [ib]}], lr=1e-28)
        with torch.no_grad():
            initial = _linear_loss(wb, bb, x).item()
        for step in range(20):
            for opt, w, b, i in ((plain, wa, ba, ia), (ours, wb, bb, ib)):
                loss = _closure(opt, w, b, x)()
                i.grad = torch.rand(2, generator=torch.Generator().manual_seed(step))
                opt.step()
        _assert_same_run(plain, ours, [wa, ba, ia], [wb, bb, ib])
        assert loss.item() > initial if kwargs.get("maximize") else loss.item() < initial
        _assert_same(irrelevant, ib.detach())


@each
def test_step_is_noop_when_params_have_no_grad(subject: Subject) -> None:
    params = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    before = [p.clone() for p in params]
    for kwargs in _inputs(subject):
        opt = subject.make(params, **kwargs)
        assert torch.equal(opt.step(lambda: torch.tensor([1.0])), torch.tensor([1.0]))
        _assert_same(before, params)


@each
def test_step_is_noop_for_zero_grads(subject: Subject) -> None:
    param = torch.randn(5, 1, requires_grad=True, generator=torch.Generator().manual_seed(0))
    before = param.detach().clone()
    for kwargs in _inputs(subject):
        if kwargs.get("weight_decay", 0) != 0:
            continue  # weight decay moves parameters without gradients
        if subject.plain is AdamW:  # as torch's test: AdamW's decay at the default lr
            lr = kwargs.get("lr", 1e-5)
            kwargs["lr"] = torch.tensor(1e-5) if isinstance(lr, torch.Tensor) else 1e-5
        # a differentiable step updates a non-leaf (a leaf that requires grad cannot be)
        params = [param.clone()] if kwargs.get("differentiable") else [param]
        plain_param = param.detach().clone().requires_grad_()
        if kwargs.get("differentiable"):
            plain_param = plain_param.clone()
        plain, opt = _pair(subject, [plain_param], params, kwargs)
        for p in (params[0], plain_param):
            p.grad = torch.zeros_like(p)
        plain.step(lambda: torch.tensor([1.0]))
        opt.step(lambda: torch.tensor([1.0]))
        # torch's tolerance: AdamW decays even without gradients (lr 1e-5 x decay 0.01) ...
        torch.testing.assert_close(before, params[0].detach())
        # ... and the same bits as the plain optimizer
        _assert_same(plain_param.detach(), params[0].detach())
        with torch.no_grad():
            param.copy_(before)


@each
def test_optimizer_can_be_printed(subject: Subject) -> None:
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for kwargs in _inputs(subject):
        text = repr(subject.make(params, **kwargs))
        assert repr(subject.plain(params, **kwargs)) in text


def _named(params: list[Parameter], named: bool) -> list[Any]:
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


@each
@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_state_dict_deterministic(subject: Subject, named0: bool, named1: bool) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        w, b = (Parameter(t) for t in _weight_bias())
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        opt = subject.make(_named([w, b], named0), **copy.deepcopy(kwargs))
        for _ in range(10):
            _closure(opt, w, b, x)()
            opt.step()
        with torch.no_grad():
            wc, bc = Parameter(w.clone()), Parameter(b.clone())
        opt_c = subject.make(_named([wc, bc], named1), **copy.deepcopy(kwargs))
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(10):
            for o, ws, bs in ((opt, w, b), (opt_c, wc, bc)):
                _closure(o, ws, bs, x)()
                o.step()
            _assert_same([w, b], [wc, bc])
        _assert_same(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
        # repeated parameters have identical representations
        opt_c.param_groups.extend(opt_c.param_groups)
        _assert_same(_without_names(opt.state_dict())["param_groups"][-1],
                     _without_names(opt_c.state_dict())["param_groups"][-1])


def _conv_bn() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2),
                                torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))
    return model, torch.rand(1, 4, 16, 16)


def _fwd_bwd(opt: Optimizer, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).sum()
    loss.backward()
    return loss


@each
def test_can_load_older_state_dict(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        model, x = _conv_bn()
        opt = subject.make(model.parameters(), **kwargs)
        for _ in range(3):
            _fwd_bwd(opt, model, x)
            opt.step()
        old = copy.deepcopy(opt.state_dict())
        for group in old["param_groups"]:
            for flag in subject.info.not_og_supported_flags:
                group.pop(flag, None)
        opt.load_state_dict(old)
        _fwd_bwd(opt, model, x)
        opt.step()


@each
@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_can_load_from_to_named_state_dict(subject: Subject, named0: bool,
                                           named1: bool) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        model, x = _conv_bn()
        opt = subject.make(model.named_parameters() if named0 else model.parameters(), **kwargs)
        for _ in range(3):
            _fwd_bwd(opt, model, x)
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        opt2 = subject.make(model.named_parameters() if named1 else model.parameters(), **kwargs)
        opt2.load_state_dict(saved)
        _fwd_bwd(opt2, model, x)
        opt2.step()
        if named0 or named1:
            assert opt2.state_dict()["param_groups"][0]["param_names"] == [
                "0.weight", "0.bias", "1.weight", "1.bias"]


@each
@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(subject: Subject, named: bool) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        w, b = (Parameter(t) for t in _weight_bias())
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        opt = subject.make(_named([w, b], named), **kwargs)
        for _ in range(3):
            opt.step(_closure(opt, w, b, x))
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        for weights_only in (False, True):
            buf.seek(0)
            _assert_same(sd, torch.load(buf, weights_only=weights_only))


@each
def test_load_nontensor_step(subject: Subject) -> None:
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for kwargs in _inputs(subject, skip=("differentiable",)):
        opt = subject.make(params, **kwargs)
        for _ in range(3):
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        for state in sd["state"].values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].item()
        opt.load_state_dict(sd)
        opt.step()


def _state_dict_pre_hook(opt: Optimizer) -> None:
    opt.state["test"] = 1


def _state_dict_post_hook(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    state_dict["ran_state_dict_pre_hook"] = "test" in state_dict["state"]
    state_dict["state"].pop("test", None)
    return state_dict


@each
def test_state_dict_pre_hook(subject: Subject) -> None:
    for kwargs in _inputs(subject):
        opt = subject.make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
        assert opt.state_dict()["state"]["test"] == 1


@each
def test_state_dict_post_hook(subject: Subject) -> None:
    for kwargs in _inputs(subject):
        opt = subject.make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_state_dict_post_hook(_state_dict_post_hook)
        assert opt.state_dict()["ran_state_dict_pre_hook"] is False


@each
def test_state_dict_pre_post_hook(subject: Subject) -> None:
    for kwargs in _inputs(subject):
        opt = subject.make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
        opt.register_state_dict_post_hook(_state_dict_post_hook)
        sd = opt.state_dict()
        assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True


def _load_pre_hook1(opt: Optimizer, state_dict: dict[str, Any]) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post_hook(opt: Optimizer) -> None:
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


@each
def test_load_state_dict_pre_hook_and_prepend(subject: Subject) -> None:
    for kwargs in _inputs(subject):
        opt = subject.make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        sd = opt.state_dict()
        opt.register_load_state_dict_pre_hook(_load_pre_hook1)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002
        opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002  # prepended: hook1 runs last


@each
def test_load_state_dict_post_hook(subject: Subject) -> None:
    for kwargs in _inputs(subject):
        opt = subject.make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_load_state_dict_post_hook(_load_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert not opt.state["ran_load_state_dict_pre_hook2"]
        assert opt.state["ran_load_state_dict_post_hook"]


@each
def test_load_state_dict_pre_post_hook(subject: Subject) -> None:
    for kwargs in _inputs(subject):
        opt = subject.make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_load_state_dict_pre_hook(_load_pre_hook2)
        opt.register_load_state_dict_post_hook(_load_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"]
        assert opt.state["ran_load_state_dict_post_hook"]


@each
@pytest.mark.parametrize("kind", ["pre", "post"])
def test_step_pre_and_post_hook(subject: Subject, kind: str) -> None:
    params = [torch.tensor([1.0, 1.0])]
    for kwargs in _inputs(subject):
        opt = subject.make(params, **kwargs)
        calls: list[Optimizer] = []
        register = opt.register_step_pre_hook if kind == "pre" else opt.register_step_post_hook
        handle = register(lambda o, args, kw, calls=calls: calls.append(o))
        opt.step()
        opt.step()
        assert calls == [opt, opt]
        handle.remove()
        opt.step()
        assert calls == [opt, opt]


@each
def test_step_all_hooks(subject: Subject) -> None:
    params = [torch.tensor([1.0, 1.0])]
    for kwargs in _inputs(subject):
        opt, opt2 = subject.make(params, **kwargs), SGD(params)
        data: list[int] = []

        def mark(value: int, data: list[int] = data) -> Callable[..., None]:
            return lambda o, a, k: data.append(value)

        handles = [
            register_optimizer_step_pre_hook(mark(0)),
            register_optimizer_step_post_hook(mark(5)),
            opt.register_step_pre_hook(mark(1)),
            opt.register_step_post_hook(mark(2)),
            opt2.register_step_pre_hook(mark(1)),
            opt2.register_step_post_hook(mark(2)),
        ]
        try:
            opt.step()
            assert data == [0, 1, 2, 5]  # the global hooks once, around the whole step
            opt2.step()
            assert data == [0, 1, 2, 5] * 2
            opt.step()
            assert data == [0, 1, 2, 5] * 3
        finally:
            for h in handles:
                h.remove()
        opt.step()
        opt2.step()
        assert data == [0, 1, 2, 5] * 3


@each
def test_deepcopy_copies_all_public_attrs(subject: Subject) -> None:
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)

    def public(obj: object) -> set[str]:
        return {k for k in obj.__dict__ if not k.startswith("_")}

    for kwargs in _inputs(subject, skip=("differentiable",)):
        opt = subject.make(params, **kwargs)
        for _ in range(3):
            opt.step()
        twin = copy.deepcopy(opt)
        assert public(opt) == public(twin)
        _assert_same(opt.state_dict(), twin.state_dict())


@each
def test_non_empty_state(subject: Subject) -> None:
    model = torch.nn.Linear(5, 5)
    for kwargs in _base_inputs(subject):
        plain, opt = _pair(subject, model.parameters(), model.parameters(), kwargs)
        for o in (plain, opt):
            o.zero_grad()
            model(torch.rand(2, 5)).sum().backward()
            o.step()
        # SGD without momentum keeps no state at all
        assert len(opt.state) == len(plain.state)
        assert all(len(s) > 0 for s in opt.state.values())


# =============================================================================================
# what torch's own optimizers do and the generic tests take for granted, checked side by side


@each
def test_differentiable(subject: Subject) -> None:
    """differentiable=True in one process: the step is the wrapped optimizer's, derivatives
    included (through the parameters, their gradients and the lr), bit for bit."""
    for kwargs in _base_inputs(subject):
        kwargs = {**kwargs, "differentiable": True}
        gen = torch.Generator().manual_seed(0)
        p0 = torch.randn(10, dtype=torch.float64, generator=gen, requires_grad=True)
        g = torch.randn(10, dtype=torch.float64, generator=gen, requires_grad=True)
        outs = []
        for make in (subject.plain, subject.make):
            p = p0.clone()  # a non-leaf: the step updates it inside autograd
            p.grad = g.clone()
            make([p], **copy.deepcopy(kwargs)).step()
            # unused: SGD's first momentum buffer is a detached copy of the gradient
            outs.append((p, torch.autograd.grad(p.square().sum(), (p0, g), allow_unused=True)))
        _assert_same(outs[0][0], outs[1][0])
        assert [d is None for d in outs[0][1]] == [d is None for d in outs[1][1]]
        _assert_same([d for d in outs[0][1] if d is not None],
                     [d for d in outs[1][1] if d is not None])


@each
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_closure_and_add_param_group_later(subject: Subject,
                                                     set_to_none: bool) -> None:
    """Closures (their loss returned), zero_grad either way, and a param group added after
    steps: the same as the plain optimizer, bit for bit."""
    for kwargs in _base_inputs(subject):
        (wa, ba, ca), (wb, bb, cb) = _twins(*_weight_bias(), torch.randn(10))
        x = torch.randn(5, generator=torch.Generator().manual_seed(1))
        plain, ours = _pair(subject, [wa], [wb], kwargs)
        for step in range(8):
            if step == 3:
                plain.add_param_group({"params": [ba], "lr": 0.05})
                ours.add_param_group({"params": [bb], "lr": 0.05})
            if step == 5:
                plain.add_param_group({"params": [ca]})
                ours.add_param_group({"params": [cb]})
            losses = []
            for opt, w, b, c in ((plain, wa, ba, ca), (ours, wb, bb, cb)):
                def closure(opt: Optimizer = opt, w: Any = w, b: Any = b, c: Any = c,
                            x: torch.Tensor = x) -> torch.Tensor:
                    opt.zero_grad(set_to_none=set_to_none)
                    loss = _linear_loss(w, b, x) + (c * b).sum()
                    loss.backward()
                    return loss
                losses.append(opt.step(closure))
            _assert_same(losses[0], losses[1])
            _assert_same_run(plain, ours, [wa, ba, ca], [wb, bb, cb])
        for opt in (plain, ours):
            opt.zero_grad(set_to_none=set_to_none)
        _assert_same([p.grad for p in (wa, ba, ca)], [p.grad for p in (wb, bb, cb)])


def test_a_scheduler_or_an_override_on_the_wrapped_optimizer_sees_every_step() -> None:
    """The wrapped optimizer's update runs without torch's global hooks, but a scheduler
    built on the wrapped optimizer still counts its steps (no "scheduler before optimizer"
    warning, the same schedule), and an override of its ``step`` set by the user runs."""
    param = Parameter(torch.ones(3))
    inner = SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = HierarchicalOptimizer(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            param.grad = torch.ones(3)
            opt.step()
            sched.step()
    assert inner.param_groups[0]["lr"] == 0.1 * 0.5**3
    _assert_same(param.detach(), torch.full((3,), 1 - 0.1 - 0.05 - 0.025))
    calls = []
    scheduled = inner.step
    inner.step = lambda *a, **k: calls.append(1) or scheduled(*a, **k)
    opt.step()
    assert calls == [1]


def _step_without_values(subject: Subject, kwargs: dict[str, Any],
                         where: Callable[[], Any]) -> None:
    """Where the plain optimizer steps parameters without values (made and stepped inside the
    context ``where()``: a meta device or a fake tensor mode), the subject does too, with the
    same state; where it raises, the subject raises an error of the same type (a real tensor
    lr in a fake mode fails on the first op that reads it: not the same op in both)."""
    runs = []
    for make in (subject.plain, subject.make):
        kw = copy.deepcopy(kwargs)  # outside: a fake mode cannot copy real tensors
        with where():
            params = [Parameter(torch.empty(4, 3)), Parameter(torch.empty(3))]
            for p in params:
                p.grad = torch.ones_like(p)
            try:
                opt = make(params, **kw)
                for _ in range(2):
                    opt.step()
            except Exception as e:  # compared with the plain optimizer's
                runs.append(type(e))
                continue
        runs.append([{k: (v.shape, v.dtype, v.device) if torch.is_tensor(v) else v
                      for k, v in opt.state[p].items()} for p in params])
    assert runs[0] == runs[1], runs


@each
def test_meta_parameters_step_as_the_plain_optimizer(subject: Subject) -> None:
    for kwargs in _inputs(subject, skip=("differentiable",)):
        if kwargs.get("fused"):
            continue  # test_fused_error_on_params_on_meta
        _step_without_values(subject, kwargs, lambda: torch.device("meta"))


@each
def test_fake_parameters_step_as_the_plain_optimizer(subject: Subject) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for kwargs in _inputs(subject, skip=("differentiable",)):
        _step_without_values(subject, kwargs, FakeTensorMode)


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value into Python (``item``, ``bool``, ``float``,
    ``int``: all go through ``aten._local_scalar_dense``, which on an accelerator waits for the
    device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@each
@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_one_process_reads_no_value_the_plain_optimizer_does_not(
        subject: Subject, on_nonfinite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, a step reads on the host only what the wrapped optimizer reads (on an
    accelerator a read is a host sync). Host memory is made to count as an accelerator's
    here, so every read is seen on this CPU-only machine; ``on_nonfinite="skip"`` asks for one
    read per step and device (the skip needs the answer)."""
    monkeypatch.setattr(gradients, "HOST_DEVICE_TYPES", ())
    tolist_calls = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda t: tolist_calls.append(1) or tolist(t))
    for kwargs in _inputs(subject, skip=("differentiable",)):
        (wa, ba), (wb, bb) = _twins(*_weight_bias())
        plain = subject.plain([wa, ba], **copy.deepcopy(kwargs))
        if subject.make is ASSGD:
            ours = ASSGD([wb, bb], **copy.deepcopy(kwargs), on_nonfinite=on_nonfinite)
        else:
            ours = HierarchicalOptimizer(subject.plain([wb, bb], **copy.deepcopy(kwargs)),
                                         on_nonfinite=on_nonfinite)
        reads = []
        for opt, params in ((plain, [wa, ba]), (ours, [wb, bb])):
            for p in params:
                p.grad = torch.ones_like(p)
            with _HostReads() as counter:
                for _ in range(3):
                    opt.step()
            reads.append(counter.count)
        assert reads[1] == reads[0] + (3 if on_nonfinite == "skip" else 0), (kwargs, reads)
        assert not tolist_calls
        _assert_same_run(plain, ours, [wa, ba], [wb, bb])


# =============================================================================================
# bad input: a clear error naming the argument, and nothing changed


# What torch.optim.SGD refuses itself: ASSGD raises SGD's exception with SGD's message, at
# construction, for an added param group and for a loaded one (the last two SGD does not check).
SGD_REFUSES = [
    dict(lr=-0.1),
    dict(lr=float("-inf")),
    dict(lr=torch.tensor(-0.1)),
    dict(lr=torch.tensor([0.1, 0.1])),
    dict(momentum=-0.5),
    dict(weight_decay=-1e-4),
    dict(weight_decay=torch.tensor(-1e-4)),
    dict(nesterov=True),
    dict(nesterov=True, momentum=0.9, dampening=0.1),
    dict(nesterov=True, momentum=0.9, dampening=1.5),  # SGD's check before qcomm's range
    dict(lr=-1.0, momentum=-1.0, weight_decay=-1.0),  # SGD's order: lr first
]


def _sgd_error(kwargs: dict[str, Any]) -> Exception:
    """What ``torch.optim.SGD`` raises for ``kwargs``."""
    with pytest.raises(Exception) as raised:
        SGD([Parameter(torch.randn(3))], **kwargs)
    return raised.value


def _assert_raises_as(expected: Exception, act: Callable[[], Any]) -> None:
    """``act()`` raises ``expected``'s exact type with its message, word for word."""
    with pytest.raises(Exception) as raised:
        act()
    assert type(raised.value) is type(expected)
    assert str(raised.value) == str(expected)


@pytest.mark.parametrize("kwargs", SGD_REFUSES, ids=repr)
def test_what_sgd_refuses_raises_sgds_own_error(kwargs: dict[str, Any]) -> None:
    expected = _sgd_error(kwargs)
    _assert_raises_as(expected, lambda: ASSGD([Parameter(torch.randn(3))], **kwargs))
    opt = ASSGD([Parameter(torch.randn(3))], lr=0.1)
    _assert_raises_as(expected, lambda: opt.add_param_group(
        {"params": [Parameter(torch.randn(3))], **kwargs}))
    assert len(opt.param_groups) == 1
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["param_groups"][0].update(kwargs)
    _assert_raises_as(expected, lambda: opt.load_state_dict(bad))
    _assert_same(sd, opt.state_dict())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr=float("nan")), ValueError, "lr must be a finite float >= 0, got nan"),
    (dict(lr=float("inf")), ValueError, "lr must be a finite float >= 0, got inf"),
    (dict(momentum=torch.tensor(float("nan"))), ValueError,
     "momentum must be a finite float >= 0, got nan"),
    (dict(dampening=1.5), ValueError, r"dampening must be a float in \[0, 1\], got 1.5"),
    (dict(dampening=-0.1), ValueError, r"dampening must be a float in \[0, 1\], got -0.1"),
])
def test_what_sgd_lets_through_raises_in_qcomms_words(kwargs: dict[str, Any], error: type,
                                                      match: str) -> None:
    """Values SGD accepts but no run can train with: qcomm's check, qcomm's wording."""
    kwargs = {"lr": 0.1, **kwargs}
    SGD([Parameter(torch.randn(3))], **kwargs)
    with pytest.raises(error, match=match):
        ASSGD([Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr="0.1"), "lr must be a finite float >= 0 or a 1-element tensor, got '0.1'"),
    (dict(momentum=None), "momentum must be a finite float >= 0 or a 1-element tensor, "
                          "got None"),
    (dict(dampening=True), r"dampening must be a float in \[0, 1\], got True"),
    (dict(nesterov="yes", momentum=0.9), "nesterov must be a bool, got 'yes'"),
])
def test_a_wrong_kind_raises_typeerror_naming_it(kwargs: dict[str, Any], match: str) -> None:
    """Where SGD fails inside a comparison (or not at all), qcomm names the argument."""
    with pytest.raises(TypeError, match=match):
        ASSGD([Parameter(torch.randn(3))], **{"lr": 0.1, **kwargs})


def test_a_tensor_of_several_elements_where_sgd_compares_with_0_is_refused() -> None:
    with pytest.raises(ValueError, match="weight_decay must be a float >= 0 or a 1-element "
                                         "tensor, got a tensor of 2 elements"):
        ASSGD([Parameter(torch.randn(3))], lr=0.1, weight_decay=torch.zeros(2))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fused=1), TypeError, "fused must be a bool or None, got 1"),
    (dict(differentiable=None), TypeError, "differentiable must be a bool, got None"),
    (dict(fused=True, foreach=True), RuntimeError, "`fused` and `foreach` cannot be `True`"),
    (dict(fused=True, differentiable=True), RuntimeError,
     "`fused` does not support `differentiable`"),
])
def test_sgd_flags_bad_values_raise_naming_them(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ASSGD([Parameter(torch.randn(3))], lr=0.1, **kwargs)
    if error is RuntimeError:  # SGD's own check and message
        with pytest.raises(error, match=match):
            SGD([Parameter(torch.randn(3))], lr=0.1, **kwargs)


def test_bad_group_flags_change_nothing() -> None:
    params = [Parameter(torch.randn(3)) for _ in range(2)]
    opt = ASSGD(params[:1], lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(3)
    opt.step()
    with pytest.raises(TypeError, match="fused must be a bool or None, got 'yes'"):
        opt.add_param_group({"params": params[1:], "fused": "yes"})
    assert len(opt.param_groups) == 1
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["differentiable"] = 1
    with pytest.raises(TypeError, match="differentiable must be a bool, got 1"):
        opt.load_state_dict(bad)
    _assert_same(sd, opt.state_dict())


def _with_peers(params: list[Parameter], **kwargs: Any) -> ASSGD:
    """ASSGD on rank 0 of an in-memory world of two (no collective runs at construction)."""
    layout = Topology(1, rank=0, world_size=2, world=MemoryWorld(2, timeout_s=5))
    return ASSGD(params, lr=0.1, layout=layout, **kwargs)


def test_differentiable_with_peers_raises_naming_it() -> None:
    params = [Parameter(torch.randn(3)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"differentiable=True \(param group 0\) is supported "
                                         "in a single process only"):
        _with_peers(params[:1], differentiable=True)
    opt = _with_peers(params[:1])
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.add_param_group({"params": params[1:], "differentiable": True})
    assert len(opt.param_groups) == 1
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["differentiable"] = True
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.load_state_dict(bad)
    _assert_same(sd, opt.state_dict())
    assert opt.param_groups[0]["differentiable"] is False


def test_fused_where_torch_cannot_fuse_raises_before_the_gradient_mean() -> None:
    """With peers, torch's own error for fused=True on parameters its kernels refuse comes at
    the first step before anything is communicated or averaged."""
    with torch.device("meta"):
        params = [Parameter(torch.randn(3))]
        params[0].grad = torch.ones(3)
    opt = _with_peers(params, fused=True)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be "
                                           "floating point Tensors of supported devices"):
        opt.step()
    assert opt.engine.topology is None and opt.stats()["steps"] == 0
