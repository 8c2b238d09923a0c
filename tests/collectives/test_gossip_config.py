"""qcomm.collectives.gossip.config, .clock and .factory: the gossip's settings are listed once
(GossipConfig), built from CommOptions by one function, taken by both member classes as that
object; one factory picks the class for the mode; one step clock, shared."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import qcomm
from qcomm.collectives.gossip import CompressedGossip, WaitFreeGossip
from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.config import GossipConfig
from qcomm.collectives.gossip.factory import build_gossip, gossip_class
from qcomm.collectives.memory import MemoryWorld
from qcomm.compress import QuantSpec
from qcomm.engine import CommOptions

NUMEL = 1024
SETTINGS = {f.name for f in fields(GossipConfig)}
PACKAGE = Path(qcomm.__file__).resolve().parent

# Every option that feeds the gossip, away from its default.
OPTIONS = CommOptions(bits=2, block_size=64, rounding="nearest", graph="complete",
                      mixing="metropolis", gamma=0.3, staleness=2, timeout_s=7.0, sync_every=4,
                      fragments=2, outer_momentum=0.5, outer_lr=0.7, total_steps=99, wait_free=True,
                      max_backlog=3, on_peer_loss="continue")


def _group() -> object:
    return MemoryWorld(2, clock=lambda: 0.0).group([0, 1], 0)


def test_comm_options_set_every_gossip_setting() -> None:
    config, default = OPTIONS.gossip_config(), GossipConfig()
    unset = [name for name in SETTINGS if getattr(config, name) == getattr(default, name)]
    assert not unset, f"settings CommOptions does not reach: {unset}"
    assert config.spec == QuantSpec(2, 64, "nearest") == OPTIONS.gossip_spec
    assert config.round_period == OPTIONS.round_period == 2
    for name in SETTINGS - {"spec"}:
        assert getattr(config, name) == getattr(OPTIONS, name), name


def test_the_default_options_give_the_default_settings() -> None:
    # the graph is chosen by the node count: the ring up to 6 nodes, as it always was
    for n in (1, 2, 3, 4, 6):
        assert CommOptions().gossip_config(n) == GossipConfig()
    assert CommOptions().gossip_config(7) == GossipConfig(graph="one-peer-exp")
    assert CommOptions(wait_free=True).gossip_config(6) == GossipConfig(wait_free=True)
    assert CommOptions(wait_free=True).gossip_config(64) == GossipConfig(wait_free=True,
                                                                         graph="one-peer-exp")
    assert CommOptions(wait_free=True, on_peer_loss="continue").gossip_config(64) == \
        GossipConfig(wait_free=True, on_peer_loss="continue", graph="one-peer-exp")
    with pytest.raises(ValueError, match="num_nodes must be given when graph is None"):
        CommOptions().gossip_config()
    assert CommOptions(graph="ring").gossip_config(64) == GossipConfig()   # named: kept


@pytest.mark.parametrize("cls", [CompressedGossip, WaitFreeGossip])
def test_the_members_take_the_config_object_not_a_list_of_settings(cls: type) -> None:
    params = inspect.signature(cls).parameters
    assert "config" in params
    spelled = SETTINGS & set(params)
    assert not spelled, f"{cls.__name__} spells settings out again: {sorted(spelled)}"
    config = GossipConfig(gamma=0.25, staleness=2, fragments=4, round_period=3)
    g = cls([0, 1], _group(), NUMEL, config)
    assert g.config is config
    assert (g.gamma, g.staleness, g.fragments, g.round_period) == (0.25, 2, 4, 3)
    # keywords replace the config's fields
    g = cls([0, 1], _group(), NUMEL, config, gamma=0.5)
    assert g.config == GossipConfig(gamma=0.5, staleness=2, fragments=4, round_period=3)


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown gossip setting 'stalenes'; accepted: "):
        CompressedGossip([0, 1], _group(), NUMEL, stalenes=2)
    with pytest.raises(TypeError, match=r"config must be a GossipConfig"):
        WaitFreeGossip([0, 1], _group(), NUMEL, {"gamma": 0.5})


def test_the_factory_picks_the_class_for_the_mode() -> None:
    lockstep, wait_free = GossipConfig(), GossipConfig(wait_free=True)
    assert gossip_class(lockstep) is CompressedGossip and CompressedGossip.lockstep
    assert gossip_class(wait_free) is WaitFreeGossip and not WaitFreeGossip.lockstep
    for config, cls in ((lockstep, CompressedGossip), (wait_free, WaitFreeGossip)):
        clock = StepClock(5)
        g = build_gossip(config, [0, 1], _group(), NUMEL, seed=3, clock=clock)
        assert type(g) is cls and g.config is config and g.seed == 3
        assert g.clock is clock and g.steps == 5


@pytest.mark.parametrize("wait_free", [False, True])
def test_the_member_advances_the_clock_it_was_given(wait_free: bool) -> None:
    clock = StepClock(7)
    g = build_gossip(GossipConfig(wait_free=wait_free, round_period=3), [0, 1], _group(),
                     NUMEL, clock=clock)
    assert not g.round_due()
    g.end_step(None)
    assert clock.steps == g.steps == 8
    g.restart_clock(2)
    assert clock.steps == 2
    clock.tick()
    assert g.steps == 3


def test_the_mode_answers_before_any_member_exists() -> None:
    assert CompressedGossip.idle_stats() == {}
    assert set(WaitFreeGossip.idle_stats()) == {"rounds_received", "lag_rounds", "live_nodes",
                                                 "dropped_ranks", "rejoined_ranks",
                                                 "terms_paired",
                                                 "mix_lag_rounds"}
    assert CompressedGossip.mode_words(GossipConfig(staleness=2)) == "staleness 2"
    assert WaitFreeGossip.mode_words(GossipConfig(on_peer_loss="continue")) == (
        "wait-free, going on without lost nodes")


def _branches_on_wait_free(tree: ast.AST) -> list[int]:
    """Lines of the conditions (if, conditional expressions, and/or) that read ``.wait_free``."""
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [n for n in ast.walk(tree) if isinstance(n, ast.BoolOp)]
    return sorted({t.lineno for t in tests for n in ast.walk(t)
                   if isinstance(n, ast.Attribute) and n.attr == "wait_free"})


def test_only_the_factory_branches_on_the_mode() -> None:
    # CommOptions checks the option's own value (on_peer_loss="continue" needs it), which is
    # no choice of behaviour; every other place asks the member (or its class).
    allowed = {"collectives/gossip/factory.py", "engine/options.py"}
    found = [f"{path.relative_to(PACKAGE).as_posix()}:{line}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).as_posix() not in allowed
             for line in _branches_on_wait_free(ast.parse(path.read_text()))]
    assert not found, f"branches on wait_free outside the factory: {found}"
