"""Who a wait-free gossip member mixes with now, and how each of its links stands.

The gossip (:mod:`.wait_free`) asks it "who are my neighbours now, with which weight" and
tells it "this link failed"; it keeps:

* the members, numbered as in the run the gossip started in (a job restarted with the survivors
  only keeps those numbers: its seeds, seals and graph), and each member's index in this run's
  group (``slots``, -1: lost) and global rank;
* the links, one record per stream k (:class:`.link_records.Link`), in the order they were
  opened: the graph's neighbours first, then the members linked to when a neighbour was lost
  (the ring closes over the gap). A link is *live* until its neighbour is lost, and *greeted*
  once the neighbour's copy is set up (a new link starts with a hello: the neighbour's public
  copy and its counts); it counts the drain markers received on it;
* the members known to be lost (own losses and those the neighbours' markers name) and what
  was dropped, when and why;
* the drain markers sent.

And it speaks the protocol that changes them: a failed link is dropped and a link opened to
the nearest live member on each side that is not a neighbour already (the hello: a control
message, then the opener's round and drain counts and its public copy); a drain marker tells
the neighbours which members this one knows to be lost; a goodbye ends a member's streams
cleanly (a member that leaves on purpose is not lost). What a link holds of the gossip itself
(the neighbour's copy, the messages on their way) stays with the gossip: each step of the
protocol returns the links it opened and dropped (:class:`.link_records.LinkChanges`), and the
gossip applies them; what a step needs of the gossip is handed to it
(:class:`.link_records.OwnState`).

Every edge has the graph's edge weight, a closing edge too, so the mixing stays symmetric.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import torch

from qcomm.collectives.errors import PeerError
from qcomm.collectives.links import MessageStreams

from .graphs import neighbours
from .integrity import sealed
from .link_records import Link, LinkChanges, OwnState
from .mixing import mixing_matrix
from .wait_free_message import (
    GOODBYE_ROUND,
    HELLO_ROUND,
    MARKER_ROUND,
    RETIRE_ROUND,
    MessageLayout,
)

__all__ = ["Link", "LinkChanges", "Membership", "OwnState", "close_retiring",
           "survivors_slots"]

log = logging.getLogger("qcomm")


def edge_weight(graph: str, mixing: str, member: int, size: int) -> float:
    """The weight of ``member``'s edges in the graph over ``size`` members: every edge of a
    regular graph has this one, and a new edge after a loss gets it too."""
    first = neighbours(graph, member, size)[:1]
    w = mixing_matrix(graph, size, mixing).to(torch.float32)
    return float(w[member, first[0]]) if first else 0.0


def _returned(rank: int, member: int, steps: int) -> dict:
    """The record of a dropped member that joined again (a report of the losses alone would
    still name it lost)."""
    return {"rank": rank, "member": member, "step": steps, "time": time.time()}


class Membership:
    """The members and links of one wait-free gossip member, and its membership protocol
    (module docstring). The steps of the protocol return the :class:`LinkChanges` they made.

    Args:
        graph, mixing: the gossip graph and its weights (:mod:`.graphs`, :mod:`.mixing`).
        group_ranks: the members' global ranks, by index in this run's group.
        member: this member's index.
        numel: floats of a public copy (a hello's).
        layout: its messages' layout (control messages are sealed in it).
        streams: the gossip's streams (opened at the first call: a step that sends nothing
            opens none).
    """

    def __init__(self, graph: str, mixing: str, group_ranks: list[int], member: int,
                 numel: int, layout: MessageLayout,
                 streams: Callable[[], MessageStreams]) -> None:
        self.graph, self.mixing, self.numel = graph, mixing, numel
        self.layout, self.streams = layout, streams
        self._run_ranks = list(group_ranks)   # by index in this run's group
        self.size, self.member = len(group_ranks), member
        self.group_ranks = list(group_ranks)  # by member number
        self.slots = list(range(self.size))
        self.links = self._links_to(neighbours(graph, member, self.size), greeted=True)
        self.edge_weight = edge_weight(graph, mixing, member, self.size)
        self.retired_in: list[int] = []          # links whose neighbour's retire came
        self.drains = 0                          # drain markers sent
        self.lost: set[int] = set()              # members known to be lost
        self.losses: list[dict] = []             # what was dropped, when, why
        self.returns: list[dict] = []            # dropped here, joined again: back, not lost
        self._weights: tuple | None = None       # cached (links, weights, their sum)
        # Called when a neighbour retires a link for a joiner this member was not told of yet
        # (it learns of joins from elsewhere: the engine's watcher of the rendezvous).
        self.on_unknown_join: Callable[[], None] | None = None
        self._unknown_join = False

    def _links_to(self, peers: list[int], greeted: bool) -> list[Link]:
        return [Link(p, self.group_ranks[p], greeted=greeted) for p in peers]

    @property
    def peers(self) -> list[int]:
        """The member at the other end of each link."""
        return [link.peer for link in self.links]

    @property
    def peer_ranks(self) -> list[int]:
        """The global rank at each link's other end."""
        return [link.rank for link in self.links]

    @property
    def rank(self) -> int:
        """This member's global rank."""
        return self.group_ranks[self.member]

    # -----------------------------------------------------------------------------------------
    # who is there

    def live_links(self) -> list[int]:
        """The links whose neighbour is not lost."""
        return [k for k, link in enumerate(self.links) if link.live]

    def mixable(self) -> list[int]:
        """The links this member mixes over now: live, the neighbour's copy set up, not being
        retired."""
        return [k for k, link in enumerate(self.links)
                if link.live and link.greeted and not link.retiring]

    def live_peers(self) -> list[int]:
        """The members at the other end of the live links."""
        return [link.peer for link in self.links if link.live]

    def live_members(self) -> int:
        """How many members are live, as far as this member knows (itself included)."""
        return self.size - len(self.lost)

    def nearest_live(self, side: int) -> int | None:
        """The nearest member on ``side`` (+1: higher indices, cyclic) not known to be lost;
        None when this member is the only one."""
        for d in range(1, self.size):
            j = (self.member + side * d) % self.size
            if j not in self.lost:
                return j
        return None

    def link_to(self, peer: int) -> int:
        """The live link to member ``peer``."""
        for k in self.live_links():
            if self.links[k].peer == peer:
                return k
        raise RuntimeError(f"no live stream to member {peer}")

    def stream_endpoints(self) -> tuple[int, list[int]]:
        """This member's index in its process group and its neighbours' (what its streams
        address)."""
        return self.slots[self.member], [self.slots[link.peer] for link in self.links]

    def weights(self, paired: list[int], device: torch.device) -> tuple[torch.Tensor, float]:
        """float32 ``[links]``: each neighbour's weight in a round's own terms (half the
        edge's weight for the links ``paired``, 0 for the others), and their sum."""
        key = (tuple(paired), len(self.links))
        cached = self._weights
        if cached is None or cached[0] != key or cached[1].device != device:
            w = torch.zeros(len(self.links), dtype=torch.float32)
            w[list(paired)] = 0.5 * self.edge_weight
            self._weights = cached = (key, w.to(device), float(w.sum()))
        return cached[1], cached[2]

    # -----------------------------------------------------------------------------------------
    # changes

    def add_link(self, peer: int) -> int:
        """A new link to member ``peer``, live and waiting for its hello; its index."""
        self.links.append(Link(peer, self.group_ranks[peer], greeted=False))
        return len(self.links) - 1

    def greet(self, k: int, drains: int) -> None:
        """Link k's hello came: its neighbour has sent ``drains`` markers before it."""
        self.links[k].markers = drains
        self.links[k].greeted = True

    def drop(self, k: int, err: PeerError, *, steps: int, rounds: int) -> dict | None:
        """Link k failed: its neighbour is lost for good. Returns the loss's record (rank,
        member, step, round, time, error, detail), None when the link was dropped before."""
        link = self.links[k]
        if not link.live:
            return None
        link.live = False
        self.lost.add(link.peer)
        event = {"rank": link.rank, "member": link.peer, "step": steps, "round": rounds,
                 "time": time.time(), "error": type(err).__name__, "detail": str(err)}
        self.losses.append(event)
        return event

    def to_link(self, side: int) -> int | None:
        """The member to open a link to on ``side`` after a loss (the nearest live one), None
        when it is a live neighbour already."""
        j = self.nearest_live(side)
        return j if j is not None and j not in self.live_peers() else None

    def learn(self, told: set[int], took_part: set[int] = frozenset()) -> None:
        """Members others say are lost: known lost here too, but for this member's live
        neighbours (a broken link between two others is theirs); members that ``took_part``
        in a sum over the live ones are live (a joiner not linked to here yet; links stay)."""
        self.lost = (self.lost | (told - set(self.live_peers()) - {self.member})) - took_part

    # -----------------------------------------------------------------------------------------
    # the protocol

    def lose(self, k: int, err: PeerError, own: OwnState) -> LinkChanges:
        """Drop link k for good (its neighbour is lost) and open a link to the nearest live
        member on each side that is not a neighbour already; a retiring link that fails is
        closed instead, no loss (:func:`close_retiring`)."""
        if self.links[k].live and self.links[k].retiring:
            return close_retiring(self, k, err)
        changes = LinkChanges()
        event = self.drop(k, err, steps=own.steps, rounds=own.rounds_started)
        if event is None:
            return changes
        changes.dropped.append(k)
        self.streams().drop(k)
        linked = []
        for side in (1, -1):
            j = self.to_link(side)
            if j is not None:
                changes += self.open_link(j, own)
                linked.append(self.group_ranks[j])
        _log_loss(self, event, err, linked)
        return changes

    def open_link(self, peer: int, own: OwnState) -> LinkChanges:
        """Open a link to ``peer`` and send it the hello: a control message, then two
        vectors: int64 ``[rounds started, drains]`` and the public copy."""
        streams = self.streams()
        k = streams.open(self.slots[peer], self.group_ranks[peer])
        assert k == len(self.links), "streams and membership disagree on the link count"
        self.add_link(peer)
        changes = LinkChanges(opened=[k])
        err = streams.send_to(k, self.layout.control(HELLO_ROUND))
        if err is not None:
            changes += self.lose(k, err, own)
            return changes
        streams.send_vector(k, torch.tensor([own.rounds_started, self.drains],
                                            dtype=torch.int64))
        # the public copy, on the CPU (a copy: the stream holds it until it has left)
        streams.send_vector(k, own.hat_own.cpu().clone() if own.hat_own is not None
                            else torch.zeros(self.numel, dtype=torch.float32))
        return changes

    def is_hello(self, k: int, message: torch.Tensor) -> bool:
        """Whether ``message``, the first on link k, is its neighbour's hello."""
        return self.layout.is_control(message, HELLO_ROUND, self.links[k].peer)

    def take_hello(self, k: int) -> tuple[int, torch.Tensor] | PeerError:
        """The hello's vectors of link ``k`` (after its control message): its round and drain
        counts and its public copy (float32 ``[numel]``, on the CPU). The link is greeted;
        returned are the neighbour's rounds and its copy, for the gossip to set up, or the
        stream's error when they do not come."""
        streams = self.streams()
        meta = torch.zeros(2, dtype=torch.int64)
        err = streams.recv_vector(k, meta)
        copy = torch.zeros(self.numel, dtype=torch.float32)
        err = err or streams.recv_vector(k, copy)
        if err is not None:
            return err
        rounds, drains = (int(v) for v in meta)
        self.greet(k, drains)
        return rounds, copy

    def marker(self) -> torch.Tensor:
        """This member's next drain marker (it names the members known to be lost)."""
        m = self.layout.control(MARKER_ROUND + self.drains, self.layout.lost_bits(self.lost))
        self.drains += 1
        return m

    def is_marker(self, k: int, message: torch.Tensor) -> bool:
        """Whether ``message`` is link k's next marker; if so it is counted and the members it
        names lost are learnt."""
        link = self.links[k]
        if not sealed(message, MARKER_ROUND + link.markers, link.peer):
            return False
        link.markers += 1
        self.learn(self.layout.read_lost(message))
        return True

    def awaiting_markers(self, ended: Collection[int]) -> list[int]:
        """The live links whose hello or marker of the last drain has not come (and whose
        stream is not among the ``ended``)."""
        return [k for k in self.live_links()
                if (not self.links[k].greeted or self.links[k].markers < self.drains)
                and k not in ended]

    def goodbye(self) -> torch.Tensor:
        return self.layout.control(GOODBYE_ROUND)

    def stream_end(self, message: torch.Tensor, slot: int) -> str | None:
        """What ``message`` from the member at index ``slot`` of the group is to its stream
        (:meth:`MessageLayout.stream_end`: a goodbye, a retire, a keepalive, or None)."""
        return self.layout.stream_end(message, self.slots.index(slot))

    # -----------------------------------------------------------------------------------------
    # a member arrives: the ring opens

    def retire(self, k: int, own: OwnState) -> LinkChanges:
        """Stop mixing over link k, which both ends keep no longer (a member arrived between
        them): send the retire, the stream's last message. No own term is added on it from
        now; the neighbour's messages are still applied (their mirrors owed) until its own
        retire comes (:meth:`peer_retired`), then the link is closed (:meth:`close_ended`).
        Every term on the link thus has its mirror: no mass moves."""
        link = self.links[k]
        if not link.live or link.retiring:
            return LinkChanges()
        link.retiring = True
        err = self.streams().finish(k, self.layout.control(RETIRE_ROUND))
        return self.lose(k, err, own) if err is not None else LinkChanges()

    def is_retire(self, k: int, message: torch.Tensor) -> bool:
        """Whether ``message`` on link k is its neighbour's retire (the stream's last)."""
        return self.layout.is_control(message, RETIRE_ROUND, self.links[k].peer)

    def peer_retired(self, k: int, own: OwnState) -> LinkChanges:
        """Link k's neighbour retired it: answer with this member's retire (when not sent
        yet); the link closes once the messages before it are applied."""
        link = self.links[k]
        self._unknown_join |= link.live and not link.retiring
        changes = self.retire(k, own)
        if link.live:
            self.retired_in.append(k)
        return changes

    def links_ended(self, goodbyes: bool, said_goodbye: set[int]) -> bool:
        """Whether a link is to close: retired at both ends, or (``goodbyes``) its neighbour
        said goodbye (it is in ``said_goodbye``: the goodbyes a take found with every message
        before them, :func:`~qcomm.collectives.links.take_through_goodbye`). Not goodbyes
        during a drain: a member that passed the drain may say goodbye before the others
        have, and the drain's cut (a checkpoint's) holds its link."""
        return bool(self.retired_in) or (goodbyes and any(
            k in said_goodbye for k in self.live_links()))

    def close_ended(self, goodbyes: bool, said_goodbye: set[int]) -> LinkChanges:
        """Close the links :meth:`links_ended` found (after their last messages were applied):
        no loss. A retired link's neighbour stays live; one that said goodbye left on purpose:
        it is no longer live here, but no loss is recorded and the ring is not closed over it
        (a ring less one member is still connected). Returns the links closed (dropped)."""
        if self._unknown_join and self.on_unknown_join is not None:
            # before the link over the gap closes: admit the joiner (link to it) first
            self._unknown_join = False
            self.on_unknown_join()
        streams, changes = self.streams(), LinkChanges()
        for k in self.live_links():
            link = self.links[k]
            left = goodbyes and k in said_goodbye
            if k not in self.retired_in and not left:
                continue
            link.live = False
            if left:
                self.lost.add(link.peer)
            changes.dropped.append(k)
            streams.drop(k)
            log.info("qcomm: rank %d closed its link to rank %d (%s)", self.rank, link.rank,
                     "it left" if left else "a member joined between them")
        self.retired_in = []
        return changes

    def admit(self, member: int, own: OwnState) -> LinkChanges:
        """``member`` joins (new, or back after it was lost): it is live again here; when it
        is now this member's nearest live one on a side, the link over its gap on that side
        is retired and a link opened to it (its hello sent). Call it on every member; the
        joiner starts with :meth:`start_joining`."""
        if not 0 <= member < self.size or member == self.member:
            raise ValueError(f"member must be another member of the {self.size}, got {member}")
        changes = LinkChanges()
        if member in self.live_peers():
            # A join is a new process: the link to its old one is to a process that is gone
            # (its failure not seen yet): lost, as it would be at its next message.
            changes += self.lose(self.link_to(member), PeerError(
                f"member {member} started again: the link to its old process is lost",
                "join", [self.group_ranks[member]], "inter"), own)
        if any(e["member"] == member for e in self.losses):
            self.returns.append(_returned(self.group_ranks[member], member, own.steps))
        self.lost.discard(member)
        near = {self.nearest_live(side) for side in (1, -1)} - {None}
        if member not in near:
            log.info("qcomm: rank %d: member %d joins; %d of %d nodes live as far as it knows",
                     self.rank, member, self.live_members(), self.size)
            return changes
        keep = near | set(neighbours(self.graph, self.member, self.size))
        for k in self.live_links():
            if self.links[k].peer not in keep:
                changes += self.retire(k, own)
        if member not in self.live_peers():
            changes += self.open_link(member, own)
        log.info("qcomm: rank %d linked to member %d, which joins; %d of %d nodes live as "
                 "far as it knows", self.rank, member, self.live_members(), self.size)
        return changes

    def start_joining(self, lost: set[int], drains: int) -> None:
        """This member joins a running gossip whose lost members are ``lost`` and whose
        members have drained ``drains`` times: no links yet (the gossip resets its per-link
        state); :meth:`link_up` opens them."""
        self.lost, self.drains = set(lost) - {self.member}, drains
        self.links = []
        self._weights = None

    def start_without(self, absent: set[int]) -> None:
        """Members ``absent`` have not started (seats a job may grow into): before any stream
        is open, this member links to the nearest present one on each side in their place, as
        a ring closes over a loss, with nothing to greet (every copy starts from zero). The
        relation stays symmetric: the nearest present member above i has i as its nearest
        below."""
        self.lost = set(absent) - {self.member}
        peers = [p for p in neighbours(self.graph, self.member, self.size) if p not in self.lost]
        for side in (1, -1):
            j = self.nearest_live(side)
            if j is not None and j not in peers:
                peers.append(j)
        self.links = self._links_to(peers, greeted=True)
        self._weights = None

    def link_up(self, own: OwnState) -> LinkChanges:
        """Open a link to the nearest live member on each side (a joiner's first links)."""
        changes = LinkChanges()
        for side in (1, -1):
            j = self.to_link(side)
            if j is not None:
                changes += self.open_link(j, own)
        return changes

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def state(self) -> dict:
        """The live links' neighbours, the members known lost, the losses and the returns."""
        return {"peers": self.live_peers(), "lost": sorted(self.lost),
                "losses": list(self.losses), "returns": list(self.returns)}

    def restore(self, peers: list[int], lost: list[int], losses: list[dict],
                slots: list[int] | None, layout: MessageLayout,
                returns: list[dict] | None = None) -> None:
        """Restore a saved :meth:`state` (``slots``: the saved members' indices in this run's
        group when this group holds the survivors of a larger run, see
        :func:`survivors_slots`; then the saved run's size and member number, ``layout``'s,
        go on)."""
        self.layout, self._weights = layout, None
        size, member = layout.size, layout.member
        if slots is not None:
            self.slots = slots
            self.size, self.member = size, member
            self.group_ranks = [self._run_ranks[s] if s >= 0 else -1 for s in slots]
            self.edge_weight = edge_weight(self.graph, self.mixing, member, size)
        # Markers restart with the streams (every record's count at 0).
        self.links = self._links_to([int(p) for p in peers], greeted=True)
        self.retired_in = []
        self.lost = {int(m) for m in lost}
        self.losses = [dict(e) for e in losses]
        self.returns = [dict(e) for e in returns or ()]   # none in a state saved before them
        self.drains = 0


def _log_loss(m: Membership, event: dict, err: PeerError, linked: list[int]) -> None:
    log.warning("qcomm: rank %d dropped its gossip neighbour rank %d at step %d (%s: %s); "
                "%d of %d nodes live as far as it knows%s", m.rank, event["rank"],
                event["step"], event["error"], err, m.live_members(), m.size,
                f"; linked to rank(s) {linked}" if linked else "")


def close_retiring(m: Membership, k: int, err: PeerError) -> LinkChanges:
    """``m``'s link k, retired (a member arrived between its ends), failed before its retire
    exchange ended: closed as the exchange would have closed it. Its neighbour is not lost:
    it is no neighbour any more, and the ring does not close over it (should it have died,
    the members now beside it find that on their own links). What of its messages was not
    applied leaves its mirror unadded, as a loss would. Returns the link dropped."""
    link = m.links[k]
    link.live = False
    m.retired_in = [j for j in m.retired_in if j != k]
    m.streams().drop(k)
    log.info("qcomm: rank %d closed its retired link to rank %d, which failed before the "
             "retire exchange ended (%s: %s); not a loss", m.rank, link.rank,
             type(err).__name__, err)
    return LinkChanges(dropped=[k])


def survivors_slots(saved: dict, lost: list[int], mine: dict) -> list[int] | None:
    """When a state saved with config ``saved`` in a run that lost the members ``lost`` is
    loaded into a group that holds exactly its survivors (in member order, this member at the
    saved one's place), with config ``mine``: each saved member's index here (-1: lost). None
    when the state is of this very group.

    Raises:
        ValueError: the state is of neither this group nor its survivors.
    """
    if saved == mine:
        return None
    given, saved = saved, dict(saved)
    size, member = saved.pop("size"), saved.pop("member")
    live = [m for m in range(size) if m not in set(lost)]
    if (saved != {k: v for k, v in mine.items() if k not in ("size", "member")}
            or len(live) != mine["size"] or member not in live
            or live.index(member) != mine["member"]):
        raise ValueError(f"state was saved with config {given} "
                         f"(lost members {lost}), this gossip has {mine}")
    return [live.index(m) if m in live else -1 for m in range(size)]
