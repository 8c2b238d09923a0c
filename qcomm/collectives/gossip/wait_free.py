"""Wait-free compressed gossip: CHOCO where no node ever waits for a neighbour's round.

The bounded-staleness gossip (:mod:`.choco`) waits for round ``t - staleness`` at round t, so
every node runs at its slowest neighbour's pace. Here each member counts its own rounds and each
neighbour's separately, and takes whatever its neighbours have sent whenever a round is due:

* member i sends ``q = Q(x - hat_own)`` every round (error feedback as in CHOCO), on an ordered
  stream to each neighbour (:mod:`.streams`);
* it keeps one copy per neighbour j of ``x_hat_j``, holding exactly the messages of j it has
  taken, every one once and in order (a message's seal names its round and sender);
* the mixing is paired: each term a member adds with a neighbour's copy has a mirror that the
  neighbour adds when the message arrives (from the versions it names: the fragment, the own
  version and an *ack*), so mixing moves no mass between members whatever their paces.

Nothing bounds the lag in rounds; memory is bounded (``max_backlog`` messages per neighbour not
yet taken) and so is silence (``timeout_s``). The members' average of ``x`` plus what they owe
moves only by their local updates. :meth:`drain` (collective) brings every copy up to date and
:meth:`settle` adds what is owed. ``on_peer_loss="continue"`` drops a failed neighbour for good
and closes the graph over the gap; ``"raise"`` (default) raises the stream's error. A round is
due at the last step of every ``round_period`` steps (:meth:`end_step`, once per local step).

This class is the CHOCO state machine; its parts are modules: :mod:`.membership` (who is a
neighbour now and with which weight; the protocol that changes it), :mod:`.wait_free_message`,
:mod:`.copies` (each neighbour's copy, its inbox), :mod:`.mirrors` (the paired mixing's books),
:mod:`.pace`, :mod:`.survivors` (the exact sum over the live members), :mod:`.saved_state`.

In full: docs/engine.md, "Wait-free gossip: `wait_free=True`" (the paired mixing, which
fragment is mixed, the average) and "A lost node: `on_peer_loss="continue"`".
"""

from __future__ import annotations

import time
from typing import Any

import torch

from qcomm.collectives.errors import PeerError, PeerTimeoutError
from qcomm.collectives.links import MessageStreams
from qcomm.collectives.stats import CommStats
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import WIRE_FORMAT_VERSION, packed_nbytes
from qcomm.seeds import gossip_message_seed
from qcomm.validation import check_seed

from .choco import _check_group
from .clock import StepClock
from .config import GossipConfig
from .copies import link_rows
from .integrity import seal_
from .link_records import LinkChanges, OwnState
from .member import GossipMember
from .membership import Membership, survivors_slots
from .options import ON_PEER_LOSS
from .pace import TermCounter, fragment_to_mix
from .saved_state import check_saved_state
from .survivors import survivors_sum
from .wait_free_message import (
    ACK_NBYTES,
    GOODBYE_ROUND,
    HELLO_ROUND,
    MARKER_ROUND,
    MessageLayout,
)
from .wait_free_stats import idle_wait_free_stats, wait_free_stats

__all__ = ["ACK_NBYTES", "GOODBYE_ROUND", "HELLO_ROUND", "MARKER_ROUND", "ON_PEER_LOSS",
           "WaitFreeGossip"]


def _of(part: str, name: str, doc: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class WaitFreeGossip(GossipMember):
    """Compressed CHOCO gossip of one fp32 vector per member, wait-free (module docstring).

    Args:
        group_ranks, group, numel, config, settings, stats, seed, first_step, clock: as
            :class:`~.choco.CompressedGossip` (the group makes the streams; what each setting
            means here: :class:`~.config.GossipConfig`).

    Buffers (fp32 ``[numel]`` x (degree + 2), 2 more with an outer step) and the streams are
    created at the first round (on x's device); the constructor communicates nothing. A member
    joins a running gossip through :mod:`.joining`.
    """

    # the fragments owed something differ between rails (NodeGossip agrees on them)
    changes_agree_across_rails = False
    lockstep = False
    level = "inter"

    size = _of("membership", "size", "Members in the graph (lost ones included).")
    member = _of("membership", "member", "This member's number.")
    group_ranks = _of("membership", "group_ranks", "Each member's global rank (-1: lost "
                      "before a restart).")
    peers = _of("membership", "peers", "The member at the other end of each link.")
    peer_ranks = _of("membership", "peer_ranks", "The global rank at each link's other end.")
    lost = _of("membership", "lost", "The members known to be lost.")
    losses = _of("membership", "losses", "What was dropped, when and why (dicts).")
    received = _of("_links", "received", "Per link, the neighbour's messages applied.")
    terms = _of("_terms", "tally", "Neighbour terms paired, and possible (:mod:`.pace`).")
    mix_lags = _of("_terms", "lags", "Per lag s, the rounds that mixed round t - s (:mod:`.pace`).")
    _layout = _of("membership", "layout", "The messages' layout (:mod:`.wait_free_message`).")
    message_nbytes = _of("_layout", "message_nbytes", "Bytes of every message on the wire.")

    def __init__(self, group_ranks: list[int], group: Any, numel: int,
                 config: GossipConfig | None = None, *, stats: CommStats | None = None,
                 seed: int = 0, first_step: int = 0, clock: StepClock | None = None,
                 **settings: Any) -> None:
        self._set_hyperparameters(numel, GossipConfig.of(config, settings), stats=stats,
                                  seed=seed, first_step=first_step, clock=clock)
        self.group = resolve_group(group)
        ranks, member = _check_group(group_ranks, self.group)
        self.nbytes = packed_nbytes(self.fragment_numel, self.spec)
        self.membership = Membership(self.graph, self.mixing, ranks, member, self.numel,
                                     MessageLayout(self.nbytes, len(ranks), member),
                                     self._streams_now)
        self._streams: MessageStreams | None = None   # opened at the first use
        self.rounds_started = 0  # (the clock, steps, is the base class's)
        self._links, self._terms, self._ledger = link_rows(
            self.membership, self._codec, self.fragments, self.staleness + self.fragments,
            self.level)
        # buffers (lazily, on x's device)
        self._hat_own: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None  # float32 [fragment_numel]: x - hat_own
        self._drained_at: int | None = None        # rounds_started at the last drain

    def live_members(self) -> int:
        """How many members are live, as far as this member knows (itself included)."""
        return self.membership.live_members()

    def fragments_read_next(self) -> list[int] | None:
        """The fragments of ``x`` the next :meth:`end_step` reads (sends and mixes), [] when no
        round is due; None when it reads all of ``x`` (its first round sets up buffers)."""
        if self.size == 1 or not self.round_due():
            return []
        if self._hat_own is None or (self._outer and self._anchor is None):
            return None
        t = self.rounds_started
        mixed = self._fragment_to_mix(t)
        return sorted({t % self.fragments} | ({mixed[0]} if mixed is not None else set())
                      | self._ledger.owed_fragments)

    def _streams_now(self) -> MessageStreams:
        if self._streams is None:
            if self._closed:
                raise RuntimeError("WaitFreeGossip is closed")
            # in the group's numbers (a restarted run's survivors keep theirs: Membership.slots)
            _, peers = self.membership.stream_endpoints()
            self._streams = self.group.streams(
                peers, nbytes=self.message_nbytes, max_backlog=self.max_backlog,
                timeout_s=self.timeout_s, stream_end=self.membership.stream_end,
                stats=self.stats, level=self.level)
        return self._streams

    # -----------------------------------------------------------------------------------------
    # the two calls around the local update

    def prepare(self) -> None:
        """Before the local update of a step that ends with a round: take what every neighbour
        sent since the previous round, verify it, and apply it to that neighbour's copy.
        Nothing is applied when anything fails: PeerTimeoutError or PeerLostError (a stream
        failed: silence past ``timeout_s``, a broken connection; ``on_peer_loss="continue"``
        drops that neighbour instead), CorruptPayloadError (a message failed verification)."""
        if self.size == 1 or not self.round_due():
            return
        self._take_in()
        self._apply_pending()

    def _take_in(self, goodbyes: bool = True) -> list[tuple[int, PeerError]]:
        """Take, verify, sort what arrived; handle failed links (returned), ended ones."""
        failures = self._links.take(self._streams_now())
        self._links.sort(failures, self._hello_taken,
                         lambda k: self._apply(self.membership.peer_retired(k, self._own())))
        self._handle(failures)
        if self.membership.links_ended(goodbyes, said := self._links.goodbyes):
            self._apply_pending()   # the links close once what came before is applied
            self._apply(self.membership.close_ended(goodbyes, said))
        return failures

    def _handle(self, failures: list[tuple[int, PeerError]]) -> None:
        """Raise the first failure, or (``"continue"``) drop every failed neighbour."""
        if failures and self.on_peer_loss == "raise":
            raise failures[0][1]
        for k, err in failures:
            self._apply(self.membership.lose(k, err, self._own()))

    def _apply_pending(self) -> None:
        """Apply every verified message (:meth:`.copies.NeighbourCopies.apply`), then forget
        the own messages every live neighbour's ack has passed and that no own term will
        rebuild its version from (the last ``staleness + fragments`` stay)."""
        first = next((msgs for msgs in self._links.pending if msgs), None)
        if first is not None and self._links.copies is None:   # on its device, not x's anchor
            self._ensure_buffers(first[0][1].new_empty(0, dtype=torch.float32))
        self._links.apply(self._ledger, self._hat_own, self.membership.edge_weight)
        self._ledger.forget_acknowledged(self._links.oldest_ack(self.rounds_started),
                                         self.rounds_started)

    def end_step(self, x: torch.Tensor | None) -> list[int]:
        """After the local update: advance the clock; when a round is due, send fragment
        ``t % fragments`` of ``x`` (float32 ``[numel]``, updated in place; None when no round
        is due) and mix the fragment of round ``t - staleness``. Returns the fragments of
        ``x`` that changed.

        Raises:
            PeerError: a neighbour's stream failed, or it did not take its messages
                (``max_backlog``) within ``timeout_s``; nothing of the round was applied.
                With ``on_peer_loss="continue"`` that neighbour is dropped instead.
        """
        if not self.round_due():
            self.steps += 1
            return []
        x = self._check_x(x)  # a bad x changes nothing, the clock included
        if self.size == 1:
            self.steps += 1
            self.rounds_started += 1
            return []
        self._ensure_buffers(x)
        streams = self._streams_now()
        t = self.rounds_started
        frag = self.fragment(t % self.fragments)
        own = self._hat_own[frag]
        message = torch.zeros(self.message_nbytes, dtype=torch.uint8, device=x.device)
        if self._scratch is None or self._scratch.device != x.device:
            self._scratch = torch.empty(self.fragment_numel, dtype=torch.float32,
                                        device=x.device)
        diff = torch.sub(x[frag], own, out=self._scratch)
        # Raises NonFiniteError on a NaN/Inf in x before anything is sent or changed.
        bounded = self._codec.encode(diff, message[:self.nbytes],
                                     gossip_message_seed(self.seed, t, self.member))
        mix = self._fragment_to_mix(t)
        paired = self._fresh(t, *mix) if mix is not None else []
        self._layout.write_header(message, {self.peers[k]: self.received[k] + 1
                                            for k in paired}, mix)
        seal_(message, t, self.member)
        failures = streams.send(message)
        if failures and self.on_peer_loss == "raise":
            raise failures[0][1]  # nothing changed
        self.steps += 1
        self._codec.accumulate(message[:self.nbytes], own, checked=not bounded)
        self._ledger.own_sent.append((t, message, bounded))
        self.rounds_started += 1
        # A new neighbour's hello carries hat_own with this round in it.
        self._handle(failures)
        changed = self._ledger.pay(x, self._anchor if self._outer else None, self.gamma)
        if mix is None:
            return sorted(changed)  # nothing to mix yet
        # The terms of the neighbours the acks name, whatever the failures just handled: a
        # neighbour that got this message adds their mirrors.
        self._terms.count(paired, self.received, mix[0])
        self._mix(x, *mix, paired)
        self._ledger.forget_acknowledged(self._links.oldest_ack(self.rounds_started),
                                         self.rounds_started)
        return sorted(changed | {mix[0]})

    def _fresh(self, t: int, f: int, version: int) -> list[int]:
        """Round t's links to pair on fragment f (own copy at ``version``); counts its lag."""
        self._terms.count_lag(t + 1 - version)
        cap = TermCounter.cap(len(self.membership.live_links()), self.gamma,
                              self.membership.edge_weight)
        return self._terms.fresh(self.membership.mixable(), self.received, f, cap)

    def _fragment_to_mix(self, t: int) -> tuple[int, int] | None:
        """What round t mixes (:func:`.pace.fragment_to_mix`)."""
        return fragment_to_mix(t, self.staleness, self.fragments, self._links.lag_after(t))

    def _mix(self, x: torch.Tensor, f: int, version: int, paired: list[int]) -> None:
        """Mix fragment f: own terms ``sum_j w_j/2 (copy_j - own) = (w row) @ copies - (sum w)
        own``, with the own copy at ``version``; their mirrors are owed back."""
        frag = self.fragment(f)

        def own_terms() -> torch.Tensor:
            w, w_sum = self.membership.weights(paired, x.device)
            own = self._ledger.own_at(self._hat_own[frag], f, version)
            return torch.mv(self._links.copies[:, frag].t(), w).add_(own, alpha=-w_sum)

        correction = self._mix_fragment(x, f, own_terms, 2 * self.gamma)
        self._ledger.owed[frag].sub_(correction)
        self._ledger.owed_fragments.add(f)

    def settle(self, x: torch.Tensor) -> None:
        """Add every mirror term owed to ``x`` (float32 ``[numel]``, in place), so that the
        members' ``x`` alone hold their average (after :meth:`drain`, before an exact one)."""
        self._ledger.settle(x, self.gamma)

    def _ensure_buffers(self, like: torch.Tensor) -> None:
        dev = like.device
        if self._hat_own is None:
            self._hat_own = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self._ledger.owed = torch.zeros_like(self._hat_own)
            self._links.ensure(self.numel, dev)
        if self._outer and self._momentum is None and like.numel() == self.numel:
            self._momentum = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self._anchor = like.detach().clone()  # every fragment's start: x at the first round

    # -----------------------------------------------------------------------------------------
    # the membership's steps: what they need of the gossip, what they changed

    def progress(self) -> int:
        """Own steps or the furthest a neighbour's rounds show: a slow member anneals too."""
        return max(self.steps, self._links.furthest * self.round_period)

    def _own(self) -> OwnState:
        return OwnState(self.steps, self.rounds_started, self._hat_own)

    def _apply(self, changes: LinkChanges) -> None:
        """Per-link state for the links ``changes`` opened, forgotten for those it dropped."""
        for _ in changes.opened:   # each at the end
            self._links.add_link(acked=self.rounds_started)  # the hello's copy holds these
            self._terms.add_link()
            self._ledger.add_link()
        for k in changes.dropped:
            self._links.forget(k)

    def _hello_taken(self, k: int, rounds: int, copy: torch.Tensor) -> None:
        if self._links.copies is None:
            self._ensure_buffers(copy.new_empty(0))  # not x: no outer anchor from it
        self._links.greet(k, rounds, copy)

    def survivors_sum(self, t: torch.Tensor, op: str = "sum") -> tuple[torch.Tensor, int]:
        """The sum (``op="max"``: maximum) of ``t`` (any dtype and shape) over the live
        members, and their count, the same bits on each; collective, after :meth:`drain`
        (:func:`.survivors.survivors_sum`: each partial is awaited ``2 timeout_s``, as upstream
        members may each spend ``timeout_s`` finding a loss). Raises PeerError when a member was
        lost during the sum (another call sums the rest)."""
        if self.membership.nearest_live(1) is None:   # alone (or the only one left)
            return t.clone(), 1
        return survivors_sum(self.membership, self._streams_now(), t, op, 2 * self.timeout_s,
                             lambda k, err: self._handle([(k, err)]))

    # -----------------------------------------------------------------------------------------
    # collective points

    def drain(self) -> None:
        """Take and apply every message every neighbour sent before its own ``drain`` (call it
        on every member at the same point, e.g. before the exact average or a checkpoint: each
        member sends a marker on its streams and waits for its neighbours' markers, taking
        messages meanwhile). Parameters are not touched.

        Raises:
            PeerError: a neighbour's stream failed, or its marker did not come within
                ``timeout_s``.
        """
        if self.size == 1:
            return
        self.send_marker()
        self.await_markers()

    flush = drain

    def send_marker(self) -> None:
        """First half of :meth:`drain`: mark the end of what this member sent so far."""
        self._handle(self._streams_now().send(self.membership.marker()))

    def await_markers(self) -> None:
        """Second half of :meth:`drain`: take and apply every message until each neighbour's
        marker of this drain (or its goodbye) has come, none past it (the cut), keepalives
        sent meanwhile (nothing else is: the neighbours would count this member silent)."""
        streams, deadline = self._streams_now(), time.monotonic() + self.timeout_s
        with streams.keeping_alive(self.membership.layout.keepalive()), \
                self._links.cut_at(self.membership.drains):
            while True:
                if self._take_in(goodbyes=False):  # new neighbours get the full time
                    deadline = time.monotonic() + self.timeout_s
                waiting = self.membership.awaiting_markers(ended := streams.ended_now())
                if not waiting:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or streams.simulated:
                    raise PeerTimeoutError(
                        f"gossip drain (rank {self.membership.rank}): no marker",
                        self.timeout_s, [self.peer_ranks[k] for k in waiting], self.level)
                streams.wait_any(left, known_ended=ended)  # not woken by them again
        self._apply_pending()
        self._drained_at = self.rounds_started

    before_state_dict = drain   # the consistent cut state_dict() needs

    def close(self) -> None:
        """Say goodbye to the neighbours (their streams from us end cleanly) and stop the
        streams. Never raises a peer's failure; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._streams is not None:
            self._streams.close(self.membership.goodbye())
            self._streams = None

    # -----------------------------------------------------------------------------------------
    # statistics and checkpoints

    def rounds_received(self) -> dict[int, int]:  # per live neighbour's rank: rounds applied
        return self._links.rounds_received()

    def lag(self) -> dict[int, int]:
        """Per live neighbour's global rank: own rounds minus its rounds applied (< 0: ahead)."""
        return {r: self.rounds_started - n for r, n in self.rounds_received().items()}

    def mode_stats(self) -> dict[str, Any]:
        return wait_free_stats(self)

    @classmethod
    def idle_stats(cls) -> dict[str, Any]:
        return idle_wait_free_stats()

    @classmethod
    def mode_words(cls, config: GossipConfig) -> str:
        return "wait-free" + (", going on without lost nodes"
                              if config.on_peer_loss == "continue" else "")

    def _config(self) -> dict:
        return {**super()._config(), "fragments": self.fragments,
                "outer_momentum": self.outer_momentum, "outer_lr": self.outer_lr,
                "round_period": self.round_period, "wait_free": True}

    def state_dict(self) -> dict:
        """This member's state; call :meth:`drain` on every member first, with no round since
        (then the saved copies are a consistent cut: no message in flight, each copy holding
        every round its member started). Tensors are references.

        Raises:
            RuntimeError: a round was sent since the last drain (or there was none).
        """
        if self.size > 1 and self._drained_at != self.rounds_started:
            raise RuntimeError("WaitFreeGossip.state_dict() needs drain() on every member "
                               "first, with no round in between: otherwise messages in flight "
                               "would be lost on resume")
        live = self.membership.live_links()
        copies = self._links.copies
        if copies is not None and len(live) != len(self.peers):
            copies = copies[live]
        # per live link (after a loss, not the graph's neighbours)
        return {"config": self._config(), "wire_format": WIRE_FORMAT_VERSION,
                "gamma": self.gamma, "seed": self.seed, "steps": self.steps,
                "rounds_started": self.rounds_started, "furthest_rounds": self._links.furthest,
                "received": [self.received[k] for k in live],
                **self.membership.state(), **self._terms.state(live),
                **self._ledger.state(live), "hat_own": self._hat_own, "copies": copies,
                "momentum": self._momentum, "anchor": self._anchor}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output before the first round. The configuration must
        match, or the state was saved after members were lost and this group is its survivors
        (then the member numbers, seeds and links of the saved run go on: the run continues
        as if it had not stopped). Everything is checked before anything is loaded."""
        if not isinstance(state, dict) or "config" not in state:
            raise ValueError("state must be a dict from WaitFreeGossip.state_dict()")
        slots = survivors_slots(state["config"], state["lost"], self._config())
        if self._streams is not None:
            raise RuntimeError("load_state_dict after the streams started")
        saved = check_saved_state(state, self.numel, self.nbytes, self.fragments)
        copy = lambda t: None if t is None else t.detach().clone()
        self.membership.restore(state["peers"], state["lost"], state["losses"], slots,
                                saved.layout, state.get("returns"))
        self.gamma = float(state["gamma"])
        self.seed = check_seed(state["seed"])
        self.steps = int(state["steps"])
        self.rounds_started = int(state["rounds_started"])
        # Saved after a drain: every neighbour had applied every own round, so its acks from
        # now on hold them all; the own messages kept rebuild the own copy's versions.
        self._links.restore([int(r) for r in state["received"]],
                            [self.rounds_started] * len(self.peers), copy(saved.buffers["copies"]),
                            saved.furthest)
        self._terms.restore(saved.termed, saved.terms_on_copy)
        self._hat_own = copy(saved.buffers["hat_own"])
        owed = copy(saved.buffers["owed"])
        if owed is None and self._hat_own is not None:
            owed = torch.zeros_like(self._hat_own)
        self._ledger.restore(saved.own_sent, saved.recent, owed, state.get("owed_fragments", []))
        self._momentum = copy(saved.buffers["momentum"])
        self._anchor = copy(saved.buffers["anchor"])
        self._scratch = None
        self._drained_at = self.rounds_started
