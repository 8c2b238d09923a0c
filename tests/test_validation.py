"""qcomm.validation: one wording and one set of limits for every argument, whichever class
checks it. Each shared option is given the same bad value through every constructor that takes
it; all must raise the same exception type with the same message."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from qcomm.collectives.gossip import default_gamma, mixing_matrix, neighbours
from qcomm.collectives.hierarchical import HierarchicalAllreduce
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.memory import GossipSimulator, MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec, quantize
from qcomm.engine import CommOptions
from qcomm.hooks import HierarchicalQuantState
from qcomm.validation import (
    check_choice,
    check_instance,
    check_int,
    check_real,
    check_seed,
    check_tensor,
    did_you_mean,
)

LONE = Topology(1, rank=0, world_size=1)
X = torch.zeros(64)


def _gossip(**kw: object) -> None:
    GossipSimulator(3, 64, **kw)


# Every constructor that takes a seed.
SEEDED: list[Callable[[object], object]] = [
    lambda v: CommOptions(seed=v),
    lambda v: _gossip(seed=v),
    lambda v: IntraNodeAllreduce(LONE, seed=v),
    lambda v: HierarchicalAllreduce(LONE, seed=v),
    lambda v: HierarchicalQuantState(seed=v),
    lambda v: quantize(X, QuantSpec(4, 32, "stochastic"), seed=v),
]

# option -> (bad value, expected exception, expected message, constructors taking the option)
SHARED: dict[str, tuple[object, type, str, list[Callable[[object], object]]]] = {
    "seed": (-1, ValueError, "seed must be an int in [0, 2**64), got -1", SEEDED),
    "seed type": (1.5, TypeError, "seed must be an int in [0, 2**64), got 1.5", SEEDED),
    "timeout_s": (0, ValueError, "timeout_s must be a finite float > 0, got 0", [
        lambda v: CommOptions(timeout_s=v),
        lambda v: _gossip(timeout_s=v),
        lambda v: IntraNodeAllreduce(LONE, timeout_s=v),
        lambda v: MemoryWorld(2, timeout_s=v),
        lambda v: HierarchicalQuantState(timeout_s=v),
    ]),
    "timeout_s inf": (math.inf, ValueError, "timeout_s must be a finite float > 0, got inf", [
        lambda v: CommOptions(timeout_s=v),
        lambda v: _gossip(timeout_s=v),
        lambda v: MemoryWorld(2, timeout_s=v),
    ]),
    "gamma": (1.5, ValueError, "gamma must be a float in (0, 1], got 1.5", [
        lambda v: CommOptions(gamma=v),
        lambda v: _gossip(gamma=v),
    ]),
    "staleness": (-1, ValueError, "staleness must be an int >= 0, got -1", [
        lambda v: CommOptions(staleness=v),
        lambda v: _gossip(staleness=v),
        lambda v: default_gamma(4, v),
    ]),
    "staleness type": (1.0, TypeError, "staleness must be an int >= 0, got 1.0", [
        lambda v: CommOptions(staleness=v),
        lambda v: _gossip(staleness=v),
    ]),
    "outer_momentum": (1.0, ValueError, "outer_momentum must be a float in [0, 1), got 1.0", [
        lambda v: CommOptions(outer_momentum=v),
        lambda v: _gossip(outer_momentum=v),
    ]),
    "bucket_mb": (0, ValueError, "bucket_mb must be a finite float > 0, got 0", [
        lambda v: CommOptions(bucket_mb=v),
        lambda v: IntraNodeAllreduce(LONE, bucket_mb=v),
        lambda v: HierarchicalAllreduce(LONE, bucket_mb=v),
        lambda v: HierarchicalQuantState(bucket_mb=v),
    ]),
    # (the simulator and CommOptions take the time-varying graph too, CommOptions None as
    # well: tests of their own, below and in tests/collectives/test_gossip_options.py)
    "graph": ("star", ValueError,
              "graph must be one of ('ring', 'exponential', 'complete'), got 'star'", [
                  lambda v: neighbours(v, 0, 4),
                  lambda v: mixing_matrix(v, 4),
              ]),
    "bits": (3, ValueError, "bits must be one of (1, 2, 4, 8), got 3", [
        lambda v: QuantSpec(bits=v),
        lambda v: CommOptions(bits=v),
        lambda v: HierarchicalQuantState(bits=v),
        lambda v: default_gamma(v, 1),
    ]),
    "procs_per_node": (0, ValueError, "procs_per_node must be an int >= 1", [
        lambda v: CommOptions(procs_per_node=v),
        lambda v: Topology(v, rank=0, world_size=4),
        lambda v: HierarchicalQuantState(v),
    ]),
}


@pytest.mark.parametrize("option", list(SHARED))
def test_every_constructor_says_the_same(option: str) -> None:
    value, exc, message, constructors = SHARED[option]
    seen = []
    for make in constructors:
        with pytest.raises(exc) as info:
            make(value)
        seen.append(str(info.value))
    assert all(s.startswith(message) for s in seen), seen
    assert len(set(seen)) == 1, seen


def test_the_simulator_names_every_graph_it_takes() -> None:
    with pytest.raises(ValueError) as info:
        _gossip(graph="star")
    assert str(info.value) == ("graph must be one of ('ring', 'exponential', 'complete', "
                               "'one-peer-exp'), got 'star'")


@pytest.mark.parametrize(("call", "exc", "message"), [
    (lambda: check_int("n", -1, low=0), ValueError, "n must be an int >= 0, got -1"),
    (lambda: check_int("n", True, low=0), TypeError, "n must be an int >= 0, got True"),
    (lambda: check_int("n", 2.0, low=0), TypeError, "n must be an int >= 0, got 2.0"),
    (lambda: check_int("r", 4, low=0, high=4, high_open=True), ValueError,
     "r must be an int in [0, 4), got 4"),
    (lambda: check_int("k", None, low=1), TypeError, "k must be an int >= 1, got None"),
    (lambda: check_real("g", 0, low=0, high=1, low_open=True), ValueError,
     "g must be a float in (0, 1], got 0"),
    (lambda: check_real("g", math.nan, low=0, high=1), ValueError,
     "g must be a float in [0, 1], got nan"),
    (lambda: check_real("t", "1", low=0, low_open=True), TypeError,
     "t must be a finite float > 0, got '1'"),
    (lambda: check_real("x", math.inf), ValueError, "x must be a finite float, got inf"),
    (lambda: check_choice("m", "x", ("a", "b")), ValueError,
     "m must be one of ('a', 'b'), got 'x'"),
    (lambda: check_choice("b", True, (1, 2)), ValueError, "b must be one of (1, 2), got True"),
    (lambda: check_choice("b", [1], (1, 2)), ValueError, "b must be one of (1, 2), got [1]"),
    (lambda: check_instance("spec", 4, QuantSpec), TypeError,
     "spec must be a qcomm.kernels.wire_format.QuantSpec, got 4"),
    (lambda: IntraNodeAllreduce(LONE, spec=4), TypeError,
     "spec must be a qcomm.compress.QuantSpec or None, got 4"),
    (lambda: GossipSimulator(2, 64, spec="4bit"), TypeError,
     "spec must be a qcomm.compress.QuantSpec, got '4bit'"),
    (lambda: check_seed(2**64), ValueError,
     "seed must be an int in [0, 2**64), got 18446744073709551616"),
    (lambda: check_tensor("x", [1.0]), TypeError, "x must be a torch.Tensor, got list"),
    (lambda: check_tensor("x", torch.zeros(2), dtypes=(torch.uint8,)), TypeError,
     "x must have dtype in (uint8), got torch.float32"),
    (lambda: check_tensor("x", torch.zeros(4, 4).t(), contiguous=True, why="written in place"),
     ValueError, "x must be contiguous (written in place), got a non-contiguous tensor"),
], ids=lambda v: v.__name__ if isinstance(v, type) else v if isinstance(v, str) else "call")
def test_wording(call: Callable[[], object], exc: type, message: str) -> None:
    with pytest.raises(exc) as info:
        call()
    assert str(info.value).startswith(message), str(info.value)


def test_normal_forms_are_returned() -> None:
    assert check_seed(np.uint64(2**64 - 1)) == 2**64 - 1
    assert type(check_int("n", np.int32(3), low=0)) is int
    assert check_real("x", 1) == 1.0 and type(check_real("x", np.float32(0.5))) is float
    assert check_int("n", None, allow_none=True) is None
    assert check_real("x", None, allow_none=True) is None


@pytest.mark.parametrize(("value", "names", "hint"), [
    ("continu", ("raise", "continue"), "; did you mean 'continue'?"),
    ("metropolice", ("uniform", "metropolis"), "; did you mean 'metropolis'?"),
    ("Ring", ("ring", "exponential", "complete"), "; did you mean 'ring'?"),
    ("star", ("ring", "exponential", "complete"), ""),  # far from every name
    ("ignore", ("raise", "continue"), ""),
    (3, (1, 2, 4, 8), ""),  # a number has no near miss
    ("4", (1, 2, 4, 8), ""),
    (None, ("a", "b"), ""),
])
def test_did_you_mean_names_only_a_near_miss(value: object, names: tuple, hint: str) -> None:
    assert did_you_mean(value, names) == hint


def test_a_choice_names_the_nearest_one() -> None:
    with pytest.raises(ValueError) as info:
        check_choice("on_peer_loss", "continu", ("raise", "continue"))
    assert str(info.value) == ("on_peer_loss must be one of ('raise', 'continue'), got "
                               "'continu'; did you mean 'continue'?")
    with pytest.raises(ValueError) as info:
        check_choice("m", "x", ("a", "b"), allow_none=True)
    assert str(info.value) == "m must be one of ('a', 'b') or None, got 'x'"


def test_host_port_is_parsed_and_a_bad_one_named() -> None:
    from qcomm.validation import check_host_port

    assert check_host_port("listen", "[::1]:29500", "x") == ("::1", 29500)
    assert check_host_port("listen", "0.0.0.0:0", "x", low_port=0) == ("0.0.0.0", 0)
    for bad in ("nowhere", "host:", ":80", "h:0", "h:70000", "h:8o", 29500, None):
        with pytest.raises(ValueError, match=r"^listen must be 'HOST:PORT', the address it "
                                             r"accepts on, got "):
            check_host_port("listen", bad, "the address it accepts on")


def test_a_flag_variable_is_0_or_1_and_anything_else_named() -> None:
    from qcomm.validation import env_flag

    assert env_flag("QCOMM_X", True, {}) is True and env_flag("QCOMM_X", False, {}) is False
    assert env_flag("QCOMM_X", True, {"QCOMM_X": " "}) is True
    assert env_flag("QCOMM_X", True, {"QCOMM_X": "0"}) is False
    assert env_flag("QCOMM_X", False, {"QCOMM_X": "1"}) is True
    for raw in ("false", "off", "no", "2", "true"):
        with pytest.raises(ValueError) as info:
            env_flag("QCOMM_X", True, {"QCOMM_X": raw})
        assert str(info.value) == f"environment variable QCOMM_X must be 0 or 1, got {raw!r}"
