"""A drain is a consistent cut: what a member applied of a neighbour when the drain ends is
exactly what that neighbour had sent when it passed its own drain, even when the neighbour
passed first and went on sending while this member still waited in it. The state saved then
(a checkpoint) is what a resumed run starts from on both ends: a member that had applied more
expected rounds its neighbour then sent again, and failed their verification (seen in a job
restarted by torchrun from its checkpoint, on a loaded machine)."""

from __future__ import annotations

import threading

import pytest
import torch

from qcomm.collectives.gossip import WaitFreeGossip
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.memory import MemoryWorld
from qcomm.compress import QuantSpec

NUMEL = 1024
SPEC = QuantSpec(4, 128, "stochastic")
PAST = 3   # rounds the first member through the drain sends while the other still waits


def _gossip(kind: str, group) -> WaitFreeGossip | OnePeerWaitFree:
    if kind == "ring":
        return WaitFreeGossip([0, 1], group, NUMEL, spec=SPEC, timeout_s=20)
    return OnePeerWaitFree([0, 1], group, NUMEL, spec=SPEC, graph="one-peer-exp", timeout_s=20)


def _sent(kind: str, state: dict) -> int:
    """Rounds member 1's saved state says it sent to member 0."""
    return state["rounds_started"] if kind == "ring" else state["links"][0]["sent"]


def _steps(g, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        g.prepare()
        g.end_step(x)


def _run(kind: str) -> list[dict]:
    world = MemoryWorld(2, timeout_s=30)
    through = threading.Event()   # member 1 passed the drain and sent PAST rounds after it
    counted = threading.Event()   # member 0 counted after the second drain (then both leave)

    def body(rank: int) -> dict:
        g = _gossip(kind, world.group([0, 1], rank))
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        _steps(g, x, 6)
        out: dict = {}
        if rank == 1:
            g.drain()
            out["sent"] = _sent(kind, g.state_dict())
            _steps(g, x, PAST)
            through.set()
        else:
            g.send_marker()            # member 1 can pass its drain now
            assert through.wait(20)
            g.await_markers()          # takes member 1's marker and the rounds after it
            g.state_dict()             # (a drained state: a checkpoint could be saved here)
            out["applied"] = g.rounds_received()[1]
        # the rounds held past the cut are applied after it, in order, none lost
        g.drain()
        if rank == 0:
            out["after"] = g.rounds_received()[1]
            counted.set()
        else:
            out["after"] = _sent(kind, g.state_dict())
            assert counted.wait(20)   # a goodbye during member 0's drain would end the link
        g.close()
        return out

    return world.run(body, timeout_s=60)


@pytest.mark.parametrize("kind", ["ring", "one-peer"])
def test_what_a_drain_applies_is_what_the_neighbour_sent_before_its_marker(kind: str) -> None:
    res = _run(kind)
    assert res[0]["applied"] == res[1]["sent"], res   # not the PAST rounds after it
    assert res[0]["after"] == res[1]["after"] == res[1]["sent"] + PAST, res
