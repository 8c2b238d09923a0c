"""Wait-free CHOCO gossip on the one-peer exponential graph: :class:`OnePeerWaitFree`.

Who talks to whom: in its own round t member i sends fragment ``t % F`` to
``one_peer_partner(i, t, n, F)`` (:mod:`.schedules`) only, whatever round that partner is at,
and takes every message every link brought whenever a round is due. Nobody waits and nobody
needs to agree on a round: each link (i, p) is its own CHOCO pair over an ordered stream
(:mod:`.one_peer_links`), exact at both ends because its messages are applied in the order
sent, and every term over it is paired (the partner adds the mirror when the message naming it
arrives), so mixing moves no mass at any pace. At one pace the two ends of a pair send to each
other in the same rounds, as in lockstep; at different paces a link carries the slower one's
rate of terms.

Links: one per peer of the schedule (``one_peer_peers``: at most K = ceil(log2 n)), opened at
the first round; memory per member ``2 K`` float32 copies of ``[numel]`` (``fresh``,
``theirs``) plus the own messages a partner has not acknowledged, plus ``owed`` (mirror terms
not yet added), against ``degree + 2`` copies on a static graph.

Losses (``on_peer_loss="continue"``): a failed link drops its peer for good; the rounds
scheduled with a lost member are sat out (the schedule keeps the members' numbers: nobody has
to agree on who is live); the exact sum over the survivors floods the links
(:mod:`.one_peer_sum`). Joins (:mod:`.one_peer_joins`, through :mod:`.joining`): a member
that was lost starts again from a live peer's join state, and its peers open new links to it,
both copies from zero.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerError, PeerTimeoutError
from qcomm.collectives.links import MessageStreams, take_through_goodbye
from qcomm.collectives.stats import CommStats
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import packed_nbytes
from qcomm.seeds import gossip_message_seed

from .choco import _check_group
from .clock import StepClock
from .config import GossipConfig
from .integrity import bad_messages, seal_
from .member import GossipMember
from .one_peer_links import PeerLink, message_nbytes, read_header, write_header
from .one_peer_state import links_state, load_links_state
from .one_peer_sum import flood_sum
from .schedules import WAIT_FREE_ONE_PEER_GAMMA, one_peer_partner, one_peer_peers
from .wait_free_message import GOODBYE_ROUND, MARKER_ROUND, MessageLayout

__all__ = ["OnePeerWaitFree"]


class OnePeerWaitFree(GossipMember):
    """Wait-free compressed gossip on ``graph="one-peer-exp"`` (module docstring). Arguments as
    :class:`~.wait_free.WaitFreeGossip` (``staleness`` is not used: a term takes the latest
    copy that arrived); ``gamma=None`` takes :data:`~.schedules.WAIT_FREE_ONE_PEER_GAMMA` (a
    term weighs ``gamma / 4``: its own and its mirror add ``gamma / 2`` per exchange,
    lockstep's weight)."""

    changes_agree_across_rails = False
    lockstep = False
    time_varying = True
    level = "inter"

    def __init__(self, group_ranks: list[int], group: Any, numel: int,
                 config: GossipConfig | None = None, *, stats: CommStats | None = None,
                 seed: int = 0, first_step: int = 0, clock: StepClock | None = None,
                 **settings: Any) -> None:
        config = GossipConfig.of(config, settings)
        self._set_hyperparameters(numel, config, stats=stats, seed=seed, first_step=first_step,
                                  clock=clock)
        if config.gamma is None:   # measured: .schedules
            self.gamma = WAIT_FREE_ONE_PEER_GAMMA
        self.group = resolve_group(group)
        self.group_ranks, self.member = _check_group(group_ranks, self.group)
        self.size = len(self.group_ranks)
        self.peers = one_peer_peers(self.member, self.size)
        self.nbytes = packed_nbytes(self.fragment_numel, self.spec)
        self.message_nbytes = message_nbytes(self.nbytes)
        self._control = MessageLayout(self.nbytes, 0, self.member)  # control messages
        self.lost: set[int] = set()
        self.losses: list[dict] = []
        self.returns: list[dict] = []
        self.rounds_started = 0
        self.links: dict[int, PeerLink] = {}   # by peer, created at the first round
        self._open: list[int] = list(self.peers)   # peers to open streams to
        self._stream_peer: list[int] = []   # the peer of each stream index
        self._streams: MessageStreams | None = None
        self._owed: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._device: torch.device | None = None
        self._drains = 0
        self._cut: int | None = None   # during a drain's wait: the markers sent
        # peers that left during a drain: what they sent past its cut, applied after it
        self._held: set[int] = set()
        self._drained_at: int | None = None

    # -----------------------------------------------------------------------------------------
    # links and streams

    def _streams_now(self) -> MessageStreams:
        if self._streams is None:
            if self._closed:
                raise RuntimeError("OnePeerWaitFree is closed")
            self._stream_peer = list(self._open)
            self._streams = self.group.streams(
                list(self._open), nbytes=self.message_nbytes, max_backlog=self.max_backlog,
                timeout_s=self.timeout_s, stream_end=self._stream_end, stats=self.stats,
                level=self.level)
        return self._streams

    def _stream_end(self, message: torch.Tensor, slot: int) -> str | None:
        return self._control.stream_end(message, slot)   # (no retire on this graph)

    def _ensure(self, device: torch.device) -> None:
        if self._owed is None:
            self._device = device
            self._owed = torch.zeros(self.numel, dtype=torch.float32, device=device)
            self._scratch = torch.empty(self.fragment_numel, dtype=torch.float32, device=device)
            for p in self._open:
                self._new_link(p)

    def _new_link(self, p: int) -> PeerLink:
        self.links[p] = PeerLink(p, self.group_ranks[p], self._codec, self.fragments,
                                 self.numel, self._device, self.gamma / 4)
        return self.links[p]

    def _k(self, p: int) -> int:
        """The live stream to ``p`` (the last opened to it)."""
        return len(self._stream_peer) - 1 - self._stream_peer[::-1].index(p)

    def live_links(self) -> list[int]:
        """The peers whose link is live, ascending."""
        return sorted(p for p, link in self.links.items() if link.live)

    def live_members(self) -> int:
        """How many members are live, as far as this member knows (itself included)."""
        return self.size - len(self.lost)

    def partner(self, round: int) -> int | None:
        """This member's scheduled peer in its ``round`` (None: it sits the round out)."""
        return one_peer_partner(self.member, round, self.size, self.fragments)

    # -----------------------------------------------------------------------------------------
    # taking in

    def prepare(self) -> None:
        """Before the local update of a step that ends with a round: take, verify and apply
        what every link brought. Raises PeerError when a link failed (``on_peer_loss=
        "continue"``: its peer is dropped), CorruptPayloadError when a message fails."""
        if self.size == 1 or not self.round_due() or self._owed is None:
            return
        self._take_in()

    def _take_in(self) -> None:
        streams = self._streams_now()
        for p in sorted(self._held):   # left during a drain: applied once past its cut
            self._apply_inbox(self.links[p])
            if not self.links[p].inbox:
                self._held.discard(p)
        for p in self.live_links():
            k, link = self._k(p), self.links[p]
            msgs, err, ended = take_through_goodbye(streams, k)
            link.inbox.extend(msgs)
            self._apply_inbox(link)
            if err is not None:
                self._fail(p, err)
            elif ended:   # a goodbye: it left on purpose, no loss
                self._close_left(p)

    def _close(self, p: int) -> None:
        """The link to ``p`` is no longer live: out of the sums, its stream dropped."""
        self._streams_now().drop(self._k(p))
        self.links[p].live = False
        self.lost.add(p)

    def _close_left(self, p: int) -> None:
        """Close the link to ``p``, which said goodbye (it left: no loss). What it sent past
        the marker of a drain in progress waits in its inbox and is applied at the first
        take past that drain (:attr:`_held`), not dropped with the link."""
        self._close(p)
        if self.links[p].inbox:
            self._held.add(p)

    def _apply_inbox(self, link: PeerLink) -> None:
        """Apply what ``link`` brought, in order. During a drain nothing past the peer's
        marker of it is applied: the state saved after it is a consistent cut (a peer through
        the drain first sends on meanwhile); it stays in the inbox until a take past the drain
        (also when the peer left meanwhile: :meth:`_close_left`)."""
        while link.inbox and (self._cut is None or link.markers < self._cut):
            self._sort(link, link.inbox[0])   # (a message that fails stays)
            link.inbox.popleft()

    def _sort(self, link: PeerLink, m: torch.Tensor) -> None:
        """One message from ``link``'s peer: its next one (applied), a drain marker, or
        corrupt (raised: nothing of it is applied)."""
        bad = bad_messages(m.view(1, -1), link.received, [link.peer], self.fragment_numel,
                           self.spec)
        if not bad:
            ack, f = read_header(m, self.nbytes)
            if 0 <= f < self.fragments:
                link.apply(m[:self.nbytes], ack, f, self._owed)
                return
            bad = [(0, f"fragment {f} of {self.fragments}")]
        if self._control.is_control(m, MARKER_ROUND + link.markers, link.peer):
            link.markers += 1
            return
        raise CorruptPayloadError(
            f"gossip stream from rank {link.rank} (rank {self.group_ranks[self.member]}), "
            f"message {link.received}", [link.rank], self.level, bad[0][1])

    def _fail(self, p: int, err: PeerError) -> None:
        """``p``'s link failed: raise, or (``"continue"``) drop it for good. A link whose
        peer said goodbye (it left at its end) and then closed is no loss."""
        streams, link = self._streams_now(), self.links[p]
        left = streams.ended(self._k(p))
        if self.on_peer_loss == "raise" and not left:
            raise err
        if left:   # what it sent before its goodbye and was not taken yet, first
            msgs, _ = streams.take(self._k(p))
            link.inbox.extend(msgs)
            self._apply_inbox(link)
            return self._close_left(p)
        self._close(p)
        self.losses.append({"rank": link.rank, "member": p, "step": self.steps,
                            "round": self.rounds_started, "time": time.time(),
                            "error": type(err).__name__, "detail": str(err)})

    # -----------------------------------------------------------------------------------------
    # the round

    def end_step(self, x: torch.Tensor | None) -> list[int]:
        """After the local update: advance the clock; when a round is due, add the mirror
        terms owed to ``x`` (float32 ``[numel]``, in place), send fragment ``t % F`` to the
        round's partner and add the round's own term. Returns the fragments that changed."""
        if not self.round_due():
            self.steps += 1
            return []
        x = self._check_x(x)
        if self.size == 1:
            self.steps += 1
            self.rounds_started += 1
            return []
        self._ensure(x.device)
        changed = self._pay(x)
        t = self.rounds_started
        f, p = t % self.fragments, self.partner(t)
        link = self.links.get(p) if p is not None else None
        self.steps += 1
        self.rounds_started += 1
        if link is None or not link.live:
            return sorted(changed)   # sat out: no partner, or a lost one
        frag = self.fragment(f)
        message = torch.zeros(self.message_nbytes, dtype=torch.uint8, device=x.device)
        diff = torch.sub(x[frag], link.fresh[frag], out=self._scratch)
        bounded = self._codec.encode(diff, message[:self.nbytes],
                                     gossip_message_seed(self.seed, t, self.member))
        ack = link.term_ack(f)
        write_header(message, self.nbytes, ack, f)
        seal_(message, link.sent, self.member)
        err = self._streams_now().send_to(self._k(p), message)
        if err is not None:
            self._fail(p, err)
            return sorted(changed)
        link.sent_message(f, message[:self.nbytes], bounded)
        if ack:
            self._mix_fragment(x, f, lambda: link.own_term(f), link.step)
            changed.add(f)
        return sorted(changed)

    def _pay(self, x: torch.Tensor) -> set[int]:
        """Add the mirrors owed to ``x`` (and to the outer step's anchor: a correction is not
        progress); the fragments they touched."""
        owed = self._owed.view(self.fragments, -1)
        touched = {f for f in range(self.fragments) if bool(owed[f].any())}
        for f in touched:
            frag = self.fragment(f)
            x[frag].add_(self._owed[frag])
            if self._outer and self._anchor is not None:
                self._anchor[frag].add_(self._owed[frag])
        self._owed.zero_()
        return touched

    def _ensure_buffers(self, like: torch.Tensor) -> None:
        if self._outer and self._momentum is None:
            self._momentum = torch.zeros(self.numel, dtype=torch.float32, device=like.device)
            self._anchor = like.detach().clone()

    def _check_x(self, x: object) -> torch.Tensor:
        x = super()._check_x(x)
        if self._device is not None and x.device != self._device:
            raise ValueError(f"x must be on {self._device} (where the gossip state lives), "
                             f"got {x.device}")
        self._ensure_buffers(x)
        return x

    def settle(self, x: torch.Tensor) -> None:
        """Add every mirror term owed to ``x`` (float32 ``[numel]``, in place)."""
        if self._owed is not None:
            x.view(-1).add_(self._owed.to(x.device))
            self._owed.zero_()

    def fragments_read_next(self) -> list[int] | None:
        return None   # conservative: the owed mirrors may touch any fragment

    # -----------------------------------------------------------------------------------------
    # collective points

    def drain(self) -> None:
        """Take and apply every message every live peer sent before its own ``drain`` (call it
        on every member at the same point): a marker on every link, then messages are taken
        until each live link's marker came. Raises PeerTimeoutError past ``timeout_s``."""
        if self.size == 1 or self._owed is None:
            self._drained_at = self.rounds_started
            return
        self.send_marker()
        self.await_markers()

    flush = drain
    before_state_dict = drain

    def send_marker(self) -> None:
        """First half of :meth:`drain`."""
        streams = self._streams_now()
        marker = self._control.control(MARKER_ROUND + self._drains)
        self._drains += 1
        for p in self.live_links():
            err = streams.send_to(self._k(p), marker)
            if err is not None:
                self._fail(p, err)

    def await_markers(self) -> None:
        """Second half of :meth:`drain`."""
        streams = self._streams_now()
        deadline = time.monotonic() + self.timeout_s
        self._cut = self._drains   # (reset however the wait ends)
        try:
            # sending nothing meanwhile: keepalives, or the neighbours would count this one silent
            with streams.keeping_alive(self._control.keepalive()):
                while True:
                    self._take_in()
                    waiting = [p for p in self.live_links()
                               if self.links[p].markers < self._drains]
                    if not waiting:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0 or streams.simulated:
                        raise PeerTimeoutError(
                            f"gossip drain (rank {self.group_ranks[self.member]}): no marker",
                            self.timeout_s, [self.group_ranks[p] for p in waiting], self.level)
                    streams.wait_any(left)
        finally:
            self._cut = None
        self._drained_at = self.rounds_started

    def close(self) -> None:
        """Say goodbye on every link and stop the streams; never raises; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._streams is not None:
            self._streams.close(self._control.control(GOODBYE_ROUND))
            self._streams = None

    def survivors_sum(self, t: torch.Tensor, op: str = "sum") -> tuple[torch.Tensor, int]:
        """The sum (``op="max"``: maximum) of ``t`` (any dtype and shape) over the live
        members, and their count, the same bits on each; collective, after :meth:`drain`
        (:func:`.one_peer_sum.flood_sum`, each part awaited ``2 timeout_s``). Raises
        PeerError when a member was lost during the sum (another call sums the rest)."""
        if self._owed is None and self.size > 1:
            self._ensure(t.device)   # the links, before any round
        if not self.live_links():
            return t.clone(), 1
        streams = self._streams_now()
        with streams.keeping_alive(self._control.keepalive()):   # (as in the drain)
            total, count, told = flood_sum(
                self.member, self.size, lambda: [(p, self._k(p)) for p in self.live_links()],
                streams, t, op, self.lost, 2 * self.timeout_s, self._fail)
        self.lost |= told - set(self.live_links()) - {self.member}
        return total, count

    # -----------------------------------------------------------------------------------------
    # statistics and checkpoints

    def rounds_received(self) -> dict[int, int]:
        """Per live link's global rank: the partner's link messages applied."""
        return {self.links[p].rank: self.links[p].received for p in self.live_links()}

    def public_copies(self) -> int:
        """float32 ``[numel]`` copies held: 2 per link ever opened (0 before the first round)."""
        return 2 * len(self.links)

    def mode_stats(self) -> dict[str, Any]:
        live = [self.links[p] for p in self.live_links()]
        return {"rounds_received": self.rounds_received(), "lag_rounds": {},
                "live_nodes": self.live_members(),
                "dropped_ranks": [e["rank"] for e in self.losses],
                "rejoined_ranks": [e["rank"] for e in self.returns],
                "terms_paired": {"paired": sum(lk.terms for lk in live),
                                 "possible": sum(lk.sent for lk in live)},
                "mix_lag_rounds": {}}

    @classmethod
    def idle_stats(cls) -> dict[str, Any]:
        from .wait_free_stats import idle_wait_free_stats
        return idle_wait_free_stats()

    @classmethod
    def mode_words(cls, config: GossipConfig) -> str:
        return "wait-free on the one-peer graph" + (
            ", going on without lost nodes" if config.on_peer_loss == "continue" else "")

    def _config(self) -> dict:
        return {**super()._config(), "fragments": self.fragments,
                "outer_momentum": self.outer_momentum, "outer_lr": self.outer_lr,
                "round_period": self.round_period, "wait_free": True}

    def state_dict(self) -> dict:
        """This member's state; call :meth:`drain` on every member first, with no round since
        (nothing is then in flight). Tensors are references.

        Raises:
            RuntimeError: a round was sent since the last drain.
        """
        if self.size > 1 and self._drained_at != self.rounds_started:
            raise RuntimeError("OnePeerWaitFree.state_dict() needs drain() on every member "
                               "first, with no round in between: otherwise messages in flight "
                               "would be lost on resume")
        return links_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output before the first round (the same config; checked
        before anything is loaded)."""
        load_links_state(self, state)
