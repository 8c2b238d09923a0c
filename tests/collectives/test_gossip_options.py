"""qcomm.collectives.gossip.options: every option that the gossip members and CommOptions both
take is refused by the one function that checks it, with the same message whichever class the
user built."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import fields

import pytest

from qcomm.collectives.gossip import CompressedGossip, WaitFreeGossip
from qcomm.collectives.gossip.config import GossipConfig
from qcomm.collectives.gossip.options import OPTION_CHECKS, check_fragments
from qcomm.collectives.memory import MemoryWorld
from qcomm.engine import CommOptions

NUMEL = 1024
WAIT_FREE_ONLY = ("max_backlog", "on_peer_loss")

# option -> bad values: out of range, of the wrong kind, and a near miss of a choice
BAD: dict[str, list[object]] = {
    "mixing": ["even", "metropolice"],
    "staleness": [-1, 1.0, True],
    "gamma": [0, 1.5, math.nan, "0.5"],
    "timeout_s": [0, math.inf, "60"],
    "seed": [-1, 2**64, 1.5],
    "outer_momentum": [1.0, -0.1],
    "outer_lr": [0, 2.5, None],
    "total_steps": [0, -3, 2.5, "100"],
    "max_backlog": [0, 2.5],
    "on_peer_loss": ["continu", "ignore", None],
}
CASES = [(name, value) for name, values in BAD.items() for value in values]


def _group() -> object:
    return MemoryWorld(2, clock=lambda: 0.0).group([0, 1], 0)


def _members(name: str) -> list[Callable[[object], object]]:
    """The member constructors that take option ``name``, each given ``value`` for it."""
    makers = [lambda v: WaitFreeGossip([0, 1], _group(), NUMEL, **{name: v})]
    if name not in WAIT_FREE_ONLY:
        makers.append(lambda v: CompressedGossip([0, 1], _group(), NUMEL, **{name: v}))
    return makers


def _refusal(make: Callable[[], object]) -> Exception:
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    return info.value


def test_the_table_holds_every_option_both_take() -> None:
    # A member takes its settings as a GossipConfig (or its fields as keywords) and its seed;
    # wait_free picks the member's class (the factory), so no member checks it; the graphs a
    # member takes are its class's, CommOptions takes its mode's and None (test_graph_*).
    member = ({f.name for f in fields(GossipConfig)}
              | set(inspect.signature(WaitFreeGossip).parameters))
    both = member & set(CommOptions.__dataclass_fields__)
    assert set(OPTION_CHECKS) | {"fragments", "wait_free", "graph"} == both


@pytest.mark.parametrize(("name", "value"), CASES, ids=str)
def test_each_option_is_refused_in_the_same_words_everywhere(name: str, value: object) -> None:
    want = _refusal(lambda: OPTION_CHECKS[name](value))
    assert str(want).startswith(f"{name} must be "), want
    for make in [lambda v: CommOptions(**{name: v}), *_members(name)]:
        got = _refusal(lambda make=make: make(value))
        assert (type(got), str(got)) == (type(want), str(want))


@pytest.mark.parametrize("value", [0, 1.5, "2"], ids=str)
def test_fragments_are_refused_by_one_function_against_what_they_divide(value: object) -> None:
    by_options = _refusal(lambda: CommOptions(sync_every=4, fragments=value))
    by_member = _refusal(lambda: WaitFreeGossip([0, 1], _group(), NUMEL, fragments=value))
    assert str(by_options) == str(_refusal(lambda: check_fragments(value, 4, "sync_every")))
    assert str(by_member) == str(_refusal(lambda: check_fragments(value, NUMEL, "numel")))
    assert type(by_options) is type(by_member)


def test_fragments_must_divide() -> None:
    with pytest.raises(ValueError, match=r"fragments must be an int >= 1 dividing numel=1024, "
                                         r"got 3$"):
        CompressedGossip([0, 1], _group(), NUMEL, fragments=3)
    with pytest.raises(ValueError, match=r"dividing sync_every=4, got 3$"):
        CommOptions(sync_every=4, fragments=3)


def test_a_misspelled_choice_gets_the_nearest_one() -> None:
    with pytest.raises(ValueError, match=r"got 'continu'; did you mean 'continue'\?$"):
        WaitFreeGossip([0, 1], _group(), NUMEL, on_peer_loss="continu")
    with pytest.raises(ValueError, match=r"got 'rign'; did you mean 'ring'\?$"):
        CompressedGossip([0, 1], _group(), NUMEL, graph="rign")
    with pytest.raises(ValueError, match=r"got 'star'$"):  # no graph is near it
        CommOptions(graph="star")
    with pytest.raises(ValueError, match=r"got 'one-peer-ex'; did you mean 'one-peer-exp'\?$"):
        CommOptions(graph="one-peer-ex")


STATIC = "('ring', 'exponential', 'complete')"
EVERY = "('ring', 'exponential', 'complete', 'one-peer-exp')"


@pytest.mark.parametrize("value", ["star", 1, "Ring"], ids=str)
def test_graph_is_refused_with_the_graphs_each_one_takes(value: object) -> None:
    # a static member: the static graphs; CommOptions: every graph of its mode, or None
    for make in (lambda v: CompressedGossip([0, 1], _group(), NUMEL, graph=v),
                 lambda v: WaitFreeGossip([0, 1], _group(), NUMEL, graph=v)):
        assert str(_refusal(lambda make=make: make(value))).startswith(
            f"graph must be one of {STATIC}, got {value!r}")
    got = _refusal(lambda: CommOptions(graph=value))
    assert type(got) is ValueError
    assert str(got).startswith(f"graph must be one of {EVERY} or None, got {value!r}")
    got = _refusal(lambda: CommOptions(graph=value, wait_free=True))
    assert str(got).startswith(f"graph must be one of {EVERY} or None, got {value!r}")


def test_graph_one_peer_exp_is_an_option_of_both_modes() -> None:
    assert CommOptions(graph="one-peer-exp").graph == "one-peer-exp"
    assert CommOptions(graph="one-peer-exp", wait_free=True,
                       on_peer_loss="continue").graph == "one-peer-exp"
    assert CommOptions().graph is None   # chosen by the node count


def test_a_default_gamma_is_still_taken_from_bits_and_staleness() -> None:
    from qcomm.collectives.gossip import default_gamma

    g = WaitFreeGossip([0, 1], _group(), NUMEL, gamma=None, staleness=2)
    assert g.gamma == default_gamma(4, 2)
    assert CompressedGossip([0, 1], _group(), NUMEL, gamma=0.25).gamma == 0.25
