"""A wait-free member's membership on its own (qcomm/collectives/gossip/membership.py): one
record per link, and each step of the protocol returns the links it opened and dropped, for the
gossip to apply, and sends its hello on the streams it is given. Here over streams that record
what is sent (no gossip, no world)."""

from __future__ import annotations

import torch

from qcomm.collectives.errors import PeerError, PeerLostError
from qcomm.collectives.gossip.link_records import Link, LinkChanges, OwnState
from qcomm.collectives.gossip.membership import Membership
from qcomm.collectives.gossip.wait_free_message import MessageLayout

RANKS = [10, 11, 12, 13, 14]   # global ranks of members 0..4
NUMEL = 8


class _Streams:
    """Records the calls a membership makes on its streams; sends succeed unless ``fail``."""

    def __init__(self, links: int) -> None:
        self.links, self.calls, self.fail = links, [], set()

    def open(self, slot: int, rank: int) -> int:
        self.calls.append(("open", slot, rank))
        self.links += 1
        return self.links - 1

    def drop(self, k: int) -> None:
        self.calls.append(("drop", k))

    def send_to(self, k: int, message: torch.Tensor) -> PeerError | None:
        self.calls.append(("send_to", k))
        return PeerLostError("hello", [RANKS[0]], "inter") if k in self.fail else None

    def send_vector(self, k: int, vector: torch.Tensor) -> None:
        self.calls.append(("send_vector", k, vector.clone()))

    def finish(self, k: int, message: torch.Tensor) -> PeerError | None:
        self.calls.append(("finish", k))
        return None


def _member(streams: _Streams) -> Membership:
    return Membership("ring", "uniform", RANKS, 0, NUMEL, MessageLayout(16, len(RANKS), 0),
                      lambda: streams)


def test_each_link_is_one_record() -> None:
    m = _member(_Streams(2))
    assert sorted(m.peers) == [1, 4]
    assert all(isinstance(link, Link) and link.live and link.greeted and not link.retiring
               and link.markers == 0 for link in m.links)
    assert m.peer_ranks == [RANKS[p] for p in m.peers]


def test_a_loss_returns_the_links_dropped_and_opened_and_sends_the_hello() -> None:
    streams = _Streams(2)
    m = _member(streams)
    k = m.link_to(1)
    hat_own = torch.arange(NUMEL, dtype=torch.float32)
    changes = m.lose(k, PeerLostError("gossip", [RANKS[1]], "inter"),
                     OwnState(steps=7, rounds_started=5, hat_own=hat_own))
    assert changes == LinkChanges(opened=[2], dropped=[k])
    assert not m.links[k].live and m.lost == {1}
    assert m.links[2] == Link(peer=2, rank=RANKS[2], greeted=False)   # waits for its hello
    assert [(e["member"], e["step"], e["round"]) for e in m.losses] == [(1, 7, 5)]
    # dropped, then the hello on the new link: control message, counts, public copy
    assert [c[:2] for c in streams.calls] == [("drop", k), ("open", 2), ("send_to", 2),
                                              ("send_vector", 2), ("send_vector", 2)]
    assert streams.calls[3][2].tolist() == [5, 0]
    assert torch.equal(streams.calls[4][2], hat_own)
    # the same loss again changes nothing
    assert m.lose(k, PeerLostError("gossip", [RANKS[1]], "inter"),
                  OwnState(8, 6, hat_own)) == LinkChanges()


def test_a_hello_that_fails_drops_the_link_it_opened() -> None:
    streams = _Streams(2)
    streams.fail = {2}
    m = _member(streams)
    changes = m.lose(m.link_to(1), PeerLostError("gossip", [RANKS[1]], "inter"),
                     OwnState(1, 1, None))
    # the new link to 2 failed at once: dropped too, and the ring closed over it to 3
    assert changes.opened == [2, 3] and changes.dropped == [0, 2]
    assert m.lost == {1, 2} and sorted(m.live_peers()) == [3, 4]
    sent = [c for c in streams.calls if c[0] == "send_vector" and c[1] == 3]
    # before the first round there is no public copy yet: the hello sends zeros
    assert sent[0][2].tolist() == [1, 0] and torch.equal(sent[1][2], torch.zeros(NUMEL))


def test_a_dropped_member_that_joins_again_is_recorded_as_back_and_saved() -> None:
    """A report of the losses alone would still name a node that came back and is live: its
    return is recorded (rank, step) beside its loss, and a member never dropped here that
    joins is no return."""
    m = _member(_Streams(2))
    hat_own = torch.arange(NUMEL, dtype=torch.float32)
    m.lose(m.link_to(1), PeerLostError("gossip", [RANKS[1]], "inter"),
           OwnState(steps=7, rounds_started=5, hat_own=hat_own))
    assert m.returns == []
    m.admit(1, OwnState(steps=40, rounds_started=38, hat_own=hat_own))
    assert 1 in m.live_peers() and m.lost == set()
    assert [(e["rank"], e["member"], e["step"]) for e in m.returns] == [(RANKS[1], 1, 40)]
    m.admit(3, OwnState(steps=41, rounds_started=39, hat_own=hat_own))   # never dropped here
    assert [e["member"] for e in m.returns] == [1]
    saved = m.state()
    again = _member(_Streams(2))
    again.restore(saved["peers"], saved["lost"], saved["losses"], None,
                  MessageLayout(16, len(RANKS), 0), saved["returns"])
    assert again.returns == m.returns and again.losses == m.losses
