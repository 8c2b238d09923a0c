"""A drain is a consistent cut: what a member applied of a neighbour when the drain ends is
exactly what that neighbour had sent when it passed its own drain, even when the neighbour
passed first and went on sending while this member still waited in it. The state saved then
(a checkpoint) is what a resumed run starts from on both ends: a member that had applied more
expected rounds its neighbour then sent again, and failed their verification (seen in a job
restarted by torchrun from its checkpoint, on a loaded machine). A neighbour that leaves
(goodbye) leaves nothing it sent unapplied: not past a drain's cut, nor when its goodbye
comes between a take and the look at whether its stream ended."""

from __future__ import annotations

import threading
import time

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
            # Counted on the link, not from the state: member 0 may have counted, closed and
            # said goodbye before this drain's last take, and the one-peer graph closes a link
            # whose peer left at once (no live link in the state then).
            out["after"] = _sent_now(kind, g)
            assert counted.wait(20)   # a goodbye during member 0's drain would end the link
        g.close()
        return out

    return world.run(body, timeout_s=60)


@pytest.mark.parametrize("kind", ["ring", "one-peer"])
def test_what_a_drain_applies_is_what_the_neighbour_sent_before_its_marker(kind: str) -> None:
    res = _run(kind)
    assert res[0]["applied"] == res[1]["sent"], res   # not the PAST rounds after it
    assert res[0]["after"] == res[1]["after"] == res[1]["sent"] + PAST, res



@pytest.mark.parametrize("kind", ["ring", "one-peer"])
def test_what_a_neighbour_sent_past_the_cut_before_its_goodbye_is_applied(kind: str) -> None:
    """Member 1 passes the drain, sends PAST rounds and leaves (its goodbye) while member 0
    still waits in the drain; member 0 then drains again alone. The one-peer goodbye used to
    close the link at once, during the drain, and the rounds held past the cut went with it:
    sent, never applied (the ring holds its goodbyes until the drain is over)."""
    world = MemoryWorld(2, timeout_s=30)
    gone = threading.Event()   # member 1 sent PAST rounds after the drain and closed

    def body(rank: int) -> dict:
        g = _gossip(kind, world.group([0, 1], rank))
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        _steps(g, x, 6)
        if rank == 1:
            g.drain()
            sent = _sent_now(kind, g)   # rounds sent to member 0 before its marker
            _steps(g, x, PAST)
            after = _sent_now(kind, g)
            g.close()
            gone.set()
            return {"sent": sent, "after": after}
        g.send_marker()
        assert gone.wait(20)
        g.await_markers()          # member 1's marker, its PAST rounds and its goodbye wait
        applied = _received_from_1(kind, g)
        g.drain()                  # after the cut: what was held is applied
        after = _received_from_1(kind, g)
        _steps(g, x, 1)            # and the link closes (the ring's at its next step)
        out = {"applied": applied, "after": after, "losses": len(g.losses),
               "live": g.live_members()}
        g.close()
        return out

    res = world.run(body, timeout_s=60)
    assert res[0]["applied"] == res[1]["sent"], res
    assert res[0]["after"] == res[1]["after"] == res[1]["sent"] + PAST, res
    assert res[0]["losses"] == 0 and res[0]["live"] == 1, res   # it left: no loss


def _sent_now(kind: str, g) -> int:
    """Member 1's rounds sent to member 0 so far."""
    return g.rounds_started if kind == "ring" else g.links[0].sent


def _received_from_1(kind: str, g) -> int:
    """Member 0's rounds applied of member 1, its link live or closed."""
    if kind == "ring":
        return max(g._links.received[k] for k, link in enumerate(g.membership.links)
                   if link.peer == 1)
    return g.links[1].received


class _LateGoodbye:
    """Member 0's streams as its receiver thread can make them look: the peer's last
    messages and its goodbye arrive just after a take (that take finds nothing; the goodbye
    is there when looked at next, the messages at the next take)."""

    def __init__(self, streams) -> None:
        self.streams, self.armed, self.hidden = streams, False, False

    def take(self, k: int):
        if self.armed and not self.hidden:
            self.hidden = True   # this take came first: it gets nothing
            return [], None
        return self.streams.take(k)

    def ended(self, k: int) -> bool:
        if self.armed:
            return self.hidden   # the goodbye came right after that take
        return self.streams.ended(k)

    def __getattr__(self, name: str):
        return getattr(self.streams, name)



@pytest.mark.parametrize("kind", ["ring", "one-peer"])
def test_a_goodbye_that_comes_just_after_a_take_leaves_no_message_behind(kind: str) -> None:
    """Member 1 sends PAST rounds and leaves; member 0's look takes nothing, and then finds
    the goodbye (both came in between, as a receiver thread can make it). The link used to
    close then, its last rounds never taken; they are applied first, then it closes."""
    world = MemoryWorld(2, timeout_s=30)
    gone = threading.Event()

    def body(rank: int) -> dict:
        g = _gossip(kind, world.group([0, 1], rank))
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        _steps(g, x, 6)
        g.drain()
        if rank == 1:
            _steps(g, x, PAST)
            sent = _sent_now(kind, g)
            g.close()
            gone.set()
            return {"sent": sent}
        assert gone.wait(20)
        before = _received_from_1(kind, g)
        late = _LateGoodbye(g._streams_now())
        g._streams, late.armed = late, True
        g._take_in()
        if kind == "ring":
            g._apply_pending()
        out = {"before": before, "after": _received_from_1(kind, g),
               "live": g.live_members(), "losses": len(g.losses)}
        g._streams = late.streams
        g.close()
        return out

    res = world.run(body, timeout_s=60)
    assert res[0]["before"] == res[1]["sent"] - PAST, res
    assert res[0]["after"] == res[1]["sent"], res           # every round it sent, applied
    assert res[0]["live"] == 1 and res[0]["losses"] == 0, res   # and it left: no loss


class _WakesOnEveryEnd:
    """Member 0's streams waking as socket and Gloo streams do: an ended stream not dropped
    ends a wait at once unless the caller says it knows that end (``known_ended``). Counts
    the waits."""

    def __init__(self, streams) -> None:
        self.streams, self.waits = streams, 0

    def wait_any(self, timeout_s: float, known_ended=()) -> None:
        self.waits += 1
        s = self.streams
        if any(s.ended(k) and k not in known_ended and k not in s._dropped
               for k in range(len(s.peers))):
            return
        self.streams.wait_any(timeout_s, known_ended)

    def __getattr__(self, name: str):
        return getattr(self.streams, name)


def test_a_drain_beside_a_neighbour_that_left_waits_without_spinning() -> None:
    """In a ring of three, member 2 leaves (goodbye); member 0 drains while member 1 comes to
    its drain only a second later. Member 0 waits for member 1's marker; the stream that
    ended woke each of its waits at once, so the drain spun on a core for the whole second
    (thousands of waits), and does not now (a few)."""
    world = MemoryWorld(3, timeout_s=30)
    gone, drained, stepped = threading.Event(), threading.Event(), threading.Barrier(3)

    def body(rank: int) -> dict:
        g = WaitFreeGossip([0, 1, 2], world.group([0, 1, 2], rank), NUMEL, spec=SPEC,
                           timeout_s=20)
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        _steps(g, x, 6)
        stepped.wait(20)   # member 2's goodbye comes after the others' last steps
        out: dict = {}
        if rank == 2:
            g.close()
            gone.set()
            return out
        assert gone.wait(20)
        if rank == 1:
            time.sleep(1.0)
            g.drain()
        else:
            g._take_in(goodbyes=False)   # member 2's goodbye seen (held) before the drain
            streams = g._streams_now()
            assert [k for k in range(2) if streams.ended(k) and k not in streams._dropped]
            counting = _WakesOnEveryEnd(g._streams_now())
            g._streams = counting
            t0 = time.monotonic()
            g.drain()
            out = {"waits": counting.waits, "took_s": time.monotonic() - t0}
            g._streams = counting.streams
            drained.set()
        assert drained.wait(20)
        g.close()
        return out

    res = world.run(body, timeout_s=60)
    assert res[0]["took_s"] >= 0.5, res   # it did wait for member 1's marker
    assert res[0]["waits"] < 20, res
