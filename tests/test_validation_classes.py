"""qcomm.validation, a class given where one of its instances goes: every user-facing check of
an instance (the shared ``check_instance``/``check_tensor``, and the constructors and functions
that use them) names it as a class and suggests the call that was probably meant, in one
wording: ``"<name> must be a <Kind> instance, got the class <Name>; did you mean <Name>(...)?"``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.memory import MemoryGroup, MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import Packed, QuantSpec, dequantize, quantize
from qcomm.engine import CommOptions
from qcomm.hooks import HierarchicalQuantState, hierarchical_quantized_hook
from qcomm.sgd import ASSGD, HierarchicalOptimizer, load_checkpoint, save_checkpoint
from qcomm.validation import check_instance, check_tensor, describe

LONE = Topology(1, rank=0, world_size=1)
X = torch.zeros(64)
def _attach_class() -> None:
    ASSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1).attach(torch.nn.Linear)  # type: ignore


# (what is called, the message): every user-facing check of an instance says it the same way
CLASS_FOR_INSTANCE: list[tuple[Callable[[], object], str]] = [
    (lambda: check_instance("model", torch.nn.Linear, torch.nn.Module, what="a torch.nn.Module"),
     "model must be a torch.nn.Module instance, got the class Linear; "
     "did you mean Linear(...)?"),
    (_attach_class, "model must be a torch.nn.Module instance, got the class Linear; "
                    "did you mean Linear(...)?"),
    (lambda: HierarchicalOptimizer(torch.optim.SGD),  # type: ignore[arg-type]
     "optimizer must be a torch.optim.Optimizer instance, got the class SGD; "
     "did you mean SGD(...)?"),
    (lambda: save_checkpoint("unused", ASSGD),  # type: ignore[arg-type]
     "optimizer must be a qcomm.sgd.HierarchicalOptimizer instance, got the class ASSGD; "
     "did you mean ASSGD(...)?"),
    (lambda: load_checkpoint("unused", ASSGD),  # type: ignore[arg-type]
     "optimizer must be a qcomm.sgd.HierarchicalOptimizer instance, got the class ASSGD; "
     "did you mean ASSGD(...)?"),
    (lambda: quantize(X, QuantSpec),  # type: ignore[arg-type]
     "spec must be a qcomm.compress.QuantSpec instance, got the class QuantSpec; "
     "did you mean QuantSpec(...)?"),
    (lambda: IntraNodeAllreduce(LONE, spec=QuantSpec),  # type: ignore[arg-type]
     "spec must be a qcomm.compress.QuantSpec instance, got the class QuantSpec; "
     "did you mean QuantSpec(...)?"),
    (lambda: Topology(1, rank=0, world_size=1, world=MemoryWorld),  # type: ignore[arg-type]
     "world must be a qcomm.collectives.group.World instance, got the class MemoryWorld; "
     "did you mean MemoryWorld(...)?"),
    (lambda: resolve_group(MemoryGroup),
     "group must be a qcomm.collectives.group.CommGroup instance, got the class MemoryGroup; "
     "did you mean MemoryGroup(...)?"),
    (lambda: hierarchical_quantized_hook(HierarchicalQuantState, None),  # type: ignore
     "state must be a qcomm.hooks.HierarchicalQuantState instance, got the class "
     "HierarchicalQuantState; did you mean HierarchicalQuantState(...)?"),
    (lambda: HierarchicalQuantState(comm=CommOptions),
     "comm must be a CommOptions instance, got the class CommOptions; "
     "did you mean CommOptions(...)?"),
    (lambda: dequantize(Packed),  # type: ignore[arg-type]
     "packed must be a qcomm.compress.Packed instance, got the class Packed; "
     "did you mean Packed(...)?"),
    (lambda: check_tensor("x", torch.Tensor),
     "x must be a torch.Tensor instance, got the class Tensor; did you mean Tensor(...)?"),
]


@pytest.mark.parametrize(("call", "message"), CLASS_FOR_INSTANCE,
                         ids=lambda c: c[:60] if isinstance(c, str) else c.__name__.strip("<>"))
def test_a_class_for_an_instance_names_the_call_meant(call: Callable[[], object],
                                                      message: str) -> None:
    with pytest.raises(TypeError) as info:
        call()
    assert str(info.value) == message


def test_a_class_that_is_not_the_kind_is_shown_as_a_class_without_a_hint() -> None:
    """``int(...)`` would not be a module either: no call is suggested, but the value is shown
    as the class it is, not as ``<class 'int'>``."""
    assert describe(torch.nn.Linear) == "the class Linear"
    with pytest.raises(TypeError) as info:
        check_instance("model", int, torch.nn.Module, what="a torch.nn.Module")
    assert str(info.value) == "model must be a torch.nn.Module, got the class int"
    with pytest.raises(TypeError) as info:
        resolve_group(int)
    assert str(info.value) == ("group must be a CommGroup, a torch.distributed process group or "
                               "None, got the class int")


def test_a_class_among_several_kinds_is_named_by_the_one_it_derives_from() -> None:
    with pytest.raises(TypeError) as info:
        check_instance("x", torch.nn.Linear, (torch.Tensor, torch.nn.Module), allow_none=True)
    assert str(info.value) == ("x must be a torch.nn.modules.module.Module instance, got the "
                               "class Linear; did you mean Linear(...)?")
    # an instance is still refused in the plain wording
    with pytest.raises(TypeError, match=r"^x must be a torch.Tensor, got int$"):
        check_tensor("x", 3)
