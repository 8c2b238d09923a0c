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

Nothing bounds the lag in rounds; memory is bounded (``max_backlog`` messages per neighbour
sent and not yet taken; beyond it the sender waits) and so is silence (``timeout_s``, then a
:class:`~qcomm.collectives.errors.PeerTimeoutError`). The members' average of ``x`` plus what
they owe moves only by their local updates, so each member weighs in by its steps.
:meth:`drain`, a collective, brings every copy up to date; :meth:`settle` then adds what is
owed, and the engine's exact average follows. ``on_peer_loss="continue"`` drops a failed
neighbour for good and closes the graph over the gap (:meth:`survivors_sum` sums over the live
members); ``"raise"`` (default) raises the stream's error.

Round schedule (the one clock): :meth:`end_step` is called once per local step; a round is
due at the last step of every ``round_period`` steps, carries fragment ``t % fragments`` of
``x`` and mixes the fragment of a round ``staleness`` or more rounds back.

In full: docs/engine.md, "Wait-free gossip: `wait_free=True`" (the paired mixing, which
fragment is mixed, the average) and "A lost node: `on_peer_loss="continue"`".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerError, PeerTimeoutError
from qcomm.collectives.group import resolve_group
from qcomm.collectives.links import MessageStreams
from qcomm.collectives.stats import CommStats
from qcomm.compress import WIRE_FORMAT_VERSION, QuantSpec, packed_nbytes
from qcomm.seeds import gossip_message_seed, seal_key
from qcomm.validation import check_seed

from .choco import _check_group
from .codec import check_state_buffers
from .graphs import neighbours
from .integrity import SEAL_NBYTES, bad_messages, judge, message_facts, seal_, sealed
from .member import GossipMember
from .mixing import mixing_matrix
from .options import ON_PEER_LOSS, check_max_backlog, check_on_peer_loss

__all__ = ["GOODBYE_ROUND", "HELLO_ROUND", "MARKER_ROUND", "ON_PEER_LOSS", "WaitFreeGossip"]

log = logging.getLogger("qcomm")

# The rounds a hello, a marker (the d-th drain: MARKER_ROUND + d) and a goodbye are sealed
# with, far beyond any real round. A hello and a goodbye have zero codec bytes, so their seal is
# the key itself; a marker carries the lost members it knows of (a bit set) under its seal.
HELLO_ROUND = 1 << 60
ACK_NBYTES = 8  # an int64 per member in every message: its ack
MARKER_ROUND = 1 << 61
GOODBYE_ROUND = 1 << 62


class WaitFreeGossip(GossipMember):
    """Compressed CHOCO gossip of one fp32 vector per member, wait-free (module docstring).

    Args:
        group_ranks, group: the members' global ranks (node order) and their group (a
            :class:`~qcomm.collectives.group.CommGroup`, a process group, or None: the default
            group), which makes the streams.
        numel: floats each member gossips (its shard), >= 1.
        graph, mixing, spec, seed, fragments, outer_momentum, outer_lr: as
            :class:`~.choco.CompressedGossip`.
        gamma: consensus step in (0, 1]; None: :func:`~.gamma.default_gamma` (bits, staleness).
        staleness: rounds by which the member's own copy in the mixing lags its fresh copy
            (the delay its messages are expected to take), >= 0.
        timeout_s: silence after which a neighbour's stream fails, > 0.
        round_period: steps per round (``sync_every / fragments``), >= 1.
        max_backlog: messages per neighbour sent and not yet taken, >= 1.
        stats: counts the bytes sent (level ``"inter"``); None: a private one.
        on_peer_loss: ``"raise"`` a neighbour's failure, or ``"continue"`` without it (the
            module docstring).

    Buffers (fp32 ``[numel]`` x (degree + 2), 2 more with an outer step) are created at the
    first round on x's device; the streams (and their threads, over Gloo) at the first
    :meth:`prepare` or :meth:`end_step`. The constructor communicates nothing.
    """

    # the fragments owed something differ between rails (NodeGossip agrees on them)
    changes_agree_across_rails = False

    def __init__(self, group_ranks: list[int], group: Any, numel: int, *,
                 graph: str = "ring", mixing: str = "uniform",
                 spec: QuantSpec = QuantSpec(4, 128, "stochastic"),  # noqa: B008 (frozen)
                 gamma: float | None = None, staleness: int = 1, timeout_s: float = 300.0,
                 stats: CommStats | None = None, seed: int = 0, fragments: int = 1,
                 outer_momentum: float = 0.0, outer_lr: float = 1.0, round_period: int = 1,
                 max_backlog: int = 64, on_peer_loss: str = "raise",
                 first_step: int = 0) -> None:
        self._set_hyperparameters(
            numel, graph=graph, mixing=mixing, spec=spec, gamma=gamma, staleness=staleness,
            timeout_s=timeout_s, seed=seed, fragments=fragments,
            outer_momentum=outer_momentum, outer_lr=outer_lr, round_period=round_period,
            stats=stats, first_step=first_step)
        self.max_backlog = check_max_backlog(max_backlog)
        self.on_peer_loss = check_on_peer_loss(on_peer_loss)
        self.group = resolve_group(group)
        self.group_ranks, self.member = _check_group(group_ranks, self.group)
        self.size = len(self.group_ranks)
        # Members are numbered as in the run the gossip started in; a job restarted with the
        # survivors only (load_state_dict) keeps those numbers (its seeds, seals and graph),
        # and _slots maps each member to its index in this run's group (-1: lost).
        self._group_ranks = list(self.group_ranks)   # by index in this run's group
        self._slots = list(range(self.size))
        self.peers = neighbours(self.graph, self.member, self.size)
        self.peer_ranks = [self.group_ranks[p] for p in self.peers]
        self._edge_weight = self._graph_edge_weight()
        self.nbytes = packed_nbytes(self.fragment_numel, spec)
        # A message: codec payload | header | seal. The header, int64s: per member of the
        # group, its ack (1 + the rounds of it the copy mixed this round held, 0 when not mixed
        # with), then 1 + the fragment mixed (0: none).
        self.message_nbytes = self.nbytes + self._header_nbytes() + SEAL_NBYTES
        self._streams: MessageStreams | None = None   # opened at the first use
        self.level = "inter"

        # the counters (the clock, steps, is the base class's)
        self.rounds_started = 0
        # Per stream k (to and from peers[k]; a stream of a lost neighbour stays, dead):
        self.received = [0] * len(self.peers)     # messages of each neighbour applied
        self._live = [True] * len(self.peers)     # not lost
        self._greeted = [True] * len(self.peers)  # its copy is set up (a new one: hello)
        self._acked = [0] * len(self.peers)       # own rounds it held when it last mixed
        # per fragment: its messages the copy held at this member's last term on it, and how
        # many terms used the copy as it holds them (_fresh)
        self._termed = [[0] * self.fragments for _ in self.peers]
        self._terms_on_copy = [[0] * self.fragments for _ in self.peers]
        self._mix_weights: tuple | None = None    # cached (who is mixed, weights, their sum)
        self.lost: set[int] = set()               # members known to be lost
        self.losses: list[dict] = []              # what was dropped, when, why
        # buffers (lazily, on x's device)
        self._hat_own: torch.Tensor | None = None
        self._owed: torch.Tensor | None = None    # mirror terms not applied yet (weighted)
        self._owed_fragments: set[int] = set()    # the fragments where _owed is not zero
        self._copies: torch.Tensor | None = None  # [degree, numel]
        self._momentum: torch.Tensor | None = None
        self._anchor: torch.Tensor | None = None
        # Sent and not yet acknowledged by every live neighbour (a mirror term rebuilds the
        # own copy at an ack from them): (round, message, its scales known finite and at most
        # MAX_SCALE, so it decodes unchecked; False for one restored from a state_dict).
        self._own_sent: deque[tuple[int, torch.Tensor, bool]] = deque()
        self._scratch: torch.Tensor | None = None  # float32 [fragment_numel]: x - hat_own
        # Taken from the streams and not yet verified (inbox) or not yet applied (pending,
        # verified, with their rounds and acks); a failed verification leaves the message in
        # the inbox.
        self._inbox: list[deque[torch.Tensor]] = [deque() for _ in self.peers]
        self._pending: list[list[tuple[int, torch.Tensor, tuple[int, int, int]]]] = [
            [] for _ in self.peers]
        # Its last messages applied (round, codec bytes): a mirror term rebuilds its copy at the
        # version the sender's own term used.
        self._recent: list[deque[tuple[int, torch.Tensor]]] = [deque() for _ in self.peers]
        self._drains = 0                           # markers sent
        self._drained_at: int | None = None        # rounds_started at the last drain
        self._markers = [0] * len(self.peers)      # markers received per neighbour
        self._closed = False

    # -----------------------------------------------------------------------------------------
    # the schedule

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
                      | self._owed_fragments)

    # -----------------------------------------------------------------------------------------
    # the two calls around the local update

    def _streams_now(self) -> MessageStreams:
        if self._streams is None:
            if self._closed:
                raise RuntimeError("WaitFreeGossip is closed")
            # The group's own index for this member: the survivors of a restarted run keep
            # their old member numbers (_slots), the group numbers them afresh.
            _, peers = self.stream_endpoints()
            self._streams = self.group.streams(
                peers, nbytes=self.message_nbytes, max_backlog=self.max_backlog,
                timeout_s=self.timeout_s, is_goodbye=self._is_goodbye_from, stats=self.stats,
                level=self.level)
        return self._streams

    def _graph_edge_weight(self) -> float:
        """The weight of this member's edges in the graph over ``size`` members: every edge of
        a regular graph has this one, and a new edge after a loss gets it too."""
        first = neighbours(self.graph, self.member, self.size)[:1]
        w = mixing_matrix(self.graph, self.size, self.mixing).to(torch.float32)
        return float(w[self.member, first[0]]) if first else 0.0

    def stream_endpoints(self) -> tuple[int, list[int]]:
        """This member's index in its process group and its neighbours' (what its streams
        address)."""
        return self._slots[self.member], [self._slots[p] for p in self.peers]

    def prepare(self) -> None:
        """Before the local update of a step that ends with a round: take what every neighbour
        sent since the previous round, verify it, and apply it to that neighbour's copy.
        Nothing is applied when anything fails (with ``on_peer_loss="continue"`` a failed
        stream is dropped instead, see the module docstring).

        Raises:
            PeerTimeoutError, PeerLostError: a neighbour's stream failed (silence past
                ``timeout_s``, or a broken connection).
            CorruptPayloadError: a message failed verification (or came out of order).
        """
        if self.size == 1 or not self.round_due():
            return
        failures = self._take()
        self._sort_inbox(failures)
        self._handle(failures)
        self._apply_pending()

    def _take(self) -> list[tuple[int, PeerError]]:
        """Move what arrived into the inboxes; the live streams that failed."""
        streams = self._streams_now()
        failures = []
        for k in self._live_streams():
            msgs, err = streams.take(k)
            self._inbox[k].extend(msgs)
            if err is not None:
                failures.append((k, err))
        return failures

    def _live_streams(self) -> list[int]:
        return [k for k, live in enumerate(self._live) if live]

    def _handle(self, failures: list[tuple[int, PeerError]]) -> None:
        """Raise the first failure, or (``on_peer_loss="continue"``) drop every failed
        neighbour."""
        if failures and self.on_peer_loss == "raise":
            raise failures[0][1]
        for k, err in failures:
            self._lose(k, err)

    def _stored_seal(self, m: torch.Tensor) -> int:
        return int.from_bytes(m[-SEAL_NBYTES:].cpu().numpy().tobytes(), "little", signed=True)

    def _header_nbytes(self) -> int:
        return ACK_NBYTES * (self.size + 2)

    def _ack_field(self, m: torch.Tensor) -> torch.Tensor:
        """int64 ``[3]``: a message's ack for this member (1 + the rounds of this member the
        sender's copy held when it mixed with it; 0: it did not mix with it), 1 + the fragment
        it mixed (0: none), and the version of its own copy in its terms (its rounds below)."""
        at, end = self.nbytes + ACK_NBYTES * self.member, self.nbytes + ACK_NBYTES * self.size
        return torch.cat([m[at:at + ACK_NBYTES],
                          m[end:end + 2 * ACK_NBYTES]]).view(torch.int64)

    def _verify_inboxes(self) -> dict[int, list[tuple[str | None, tuple[int, int, int]]]]:
        """Verdicts on every message waiting in a live, greeted inbox, each taken to be its
        sender's next round in order (what it is, unless a marker comes first), with one host
        read per device for all of them: per stream, ``(None, ack fields)`` for each message
        that passes, else ``(the reason it fails, ack fields)``."""
        facts: dict[torch.device, list[torch.Tensor]] = {}
        where: dict[torch.device, list[tuple[int, int, int]]] = {}  # (stream, round, sender)
        for k, box in enumerate(self._inbox):
            if not (box and self._live[k] and self._greeted[k]):
                continue
            expected = self.received[k] + len(self._pending[k])
            for i, m in enumerate(box):
                facts.setdefault(m.device, []).append(torch.cat([
                    message_facts(m.view(1, -1), self.fragment_numel, self.spec),
                    self._ack_field(m).view(3, 1)]))
                where.setdefault(m.device, []).append((k, expected + i, self.peers[k]))
        verdicts: dict[int, list[tuple[str | None, tuple[int, int, int]]]] = {}
        for device, rows in facts.items():
            streams, rounds, senders = zip(*where[device], strict=True)
            table = torch.cat(rows, dim=1).tolist()
            bad = dict(judge(table[:4], rounds, senders))
            for j, k in enumerate(streams):
                verdicts.setdefault(k, []).append(
                    (bad.get(j), (table[4][j], table[5][j], table[6][j])))
        return verdicts

    def _sort_inbox(self, failures: list[tuple[int, PeerError]]) -> None:
        """Verify the inboxes' messages in order: rounds go to ``_pending``, markers are
        counted, a hello sets up the copy. Raises CorruptPayloadError at the first that fails
        (it stays in the inbox); a hello whose vectors do not come adds to ``failures``."""
        verdicts = self._verify_inboxes()
        for k, box in enumerate(self._inbox):
            peer = self.peers[k]
            batch, taken = verdicts.get(k, []), 0  # the verdicts hold while rounds pass
            while box and self._live[k]:
                m = box[0]
                if taken < len(batch) and batch[taken][0] is None:
                    self._pending[k].append((self.received[k] + len(self._pending[k]), m,
                                             batch[taken][1]))
                    box.popleft()
                    taken += 1
                    continue
                batch = []  # a failure or a marker: one by one from here (rounds may shift)
                if not self._greeted[k]:
                    if not self._is_control(m, HELLO_ROUND, peer):
                        raise CorruptPayloadError(
                            f"gossip stream from rank {self.peer_ranks[k]} (rank "
                            f"{self.group_ranks[self.member]}), its first message",
                            [self.peer_ranks[k]], self.level, "not a hello")
                    box.popleft()
                    err = self._take_hello(k)
                    if err is not None:
                        failures.append((k, err))
                        break
                    continue
                expected = self.received[k] + len(self._pending[k])
                bad = bad_messages(m.view(1, -1), expected, [peer], self.fragment_numel,
                                   self.spec)
                if bad and sealed(m, MARKER_ROUND + self._markers[k], peer):
                    # a marker (checked only when not the next round: the round is common)
                    self._markers[k] += 1
                    self._learn_lost(m)
                    box.popleft()
                    continue
                if bad:
                    raise CorruptPayloadError(
                        f"gossip stream from rank {self.peer_ranks[k]} (rank "
                        f"{self.group_ranks[self.member]}), round {expected}",
                        [self.peer_ranks[k]], self.level,
                        bad[0][1] + ("" if bad[0][1] != "checksum" else
                                     " (corrupted, or not the next round of this sender)"))
                self._pending[k].append((expected, m, tuple(self._ack_field(m).tolist())))
                box.popleft()

    def _apply_pending(self) -> None:
        """Apply every verified message to its sender's copy and owe the mirror of each term
        its sender added with this member's copy (docs/engine.md, "Wait-free gossip"): per
        stream and fragment, one decode of the messages together, whatever their number (a
        slow member takes many at a time, and its time per message must not grow with its
        lag)."""
        for k, msgs in enumerate(self._pending):
            if not msgs:
                continue
            if self._copies is None:
                self._ensure_buffers(msgs[0][1].new_empty(0, dtype=torch.float32))
            # mirrors first, from the copy as it was before these messages
            mirrors: dict[int, list[tuple[int, int]]] = {}   # fragment -> [(version, ack)]
            for _, _, (ack, mixed, version) in msgs:
                if ack > 0 and 0 < mixed <= self.fragments:
                    mirrors.setdefault(mixed - 1, []).append((version, ack - 1))
                    self._acked[k] = max(self._acked[k], ack - 1)
            for f, terms in mirrors.items():
                self._owe_mirrors(k, f, terms, msgs)
                self._owed_fragments.add(f)
            by_fragment: dict[int, list[torch.Tensor]] = {}
            for r, m, _ in msgs:
                by_fragment.setdefault(r % self.fragments, []).append(m[:self.nbytes])
                self._recent[k].append((r, m[:self.nbytes]))
            for f, bodies in by_fragment.items():
                # verified: finite scales at most MAX_SCALE, so decoded unchecked (.codec)
                self._codec.accumulate(torch.stack(bodies), self._copies[k, self.fragment(f)])
            while len(self._recent[k]) > self._kept:
                self._recent[k].popleft()
            self.received[k] += len(msgs)
            self._pending[k] = []
        self._forget_acknowledged()

    def _owe_mirrors(self, k: int, f: int, terms: list[tuple[int, int]],
                     msgs: list[tuple[int, torch.Tensor, tuple[int, int, int]]]) -> None:
        """Owe the mirrors of neighbour k's terms on fragment f, each of which compared its copy
        of this member as it held this member's rounds below the ack with its own copy as it
        held its rounds below the version: ``w/2 * sum over the terms of (copy_k[f] at version
        - hat_own[f] at ack)``. Summed in one pass: with n terms, ``n (copy_k[f] - hat_own[f])``
        plus each message of f weighted by how many terms' versions hold it, less each earlier
        one by how many do not, plus each own message of f by how many acks do not hold it.
        ``msgs``: the messages being applied (not yet in the copy)."""
        frag, n = self.fragment(f), len(terms)
        total = torch.sub(self._copies[k, frag], self._hat_own[frag])
        if n > 1:
            total.mul_(n)
        # the sender's messages: those being applied that a version holds, the earlier ones
        # already in the copy that a version does not
        weighted = [(b[:self.nbytes], sum(v > r for v, _ in terms))
                    for r, b, _ in msgs if r % self.fragments == f]
        weighted += [(b, -sum(v <= r for v, _ in terms))
                     for r, b in self._recent[k] if r % self.fragments == f]
        self._accumulate_counts(total, weighted, n, checked=False)
        # this member's own messages an ack does not hold
        own = [(m[:self.nbytes], sum(a <= r for _, a in terms), bounded)
               for r, m, bounded in self._own_sent if r % self.fragments == f]
        self._accumulate_counts(total, [(b, c) for b, c, _ in own], n,
                                checked=not all(ok for *_, ok in own))
        self._owed[frag].add_(total, alpha=0.5 * self._edge_weight)

    def _accumulate_counts(self, out: torch.Tensor, weighted: list[tuple[torch.Tensor, int]],
                           n: int, *, checked: bool) -> None:
        """``out += sum of count * D(payload)`` over ``weighted`` (counts within [-n, n]), in
        one decode: the codec's weights are at most 1 in magnitude, so it decodes with
        ``count / n`` into a scratch and adds n times that."""
        weighted = [(b, c) for b, c in weighted if c]
        if not weighted:
            return
        part = torch.zeros_like(out)
        self._codec.accumulate(torch.stack([b for b, _ in weighted]), part,
                               torch.tensor([c / n for _, c in weighted], dtype=torch.float32,
                                            device=out.device), checked=checked)
        out.add_(part, alpha=n)

    def _add_own_since(self, out: torch.Tensor, f: int, version: int,
                       sign: float = 1.0) -> None:
        """``out += sign * (the own messages of fragment f from round ``version`` on)``: what
        ``hat_own[f]`` holds beyond the own copy at that version."""
        later = [(m[:self.nbytes], bounded) for r, m, bounded in self._own_sent
                 if r >= version and r % self.fragments == f]
        if later:
            weights = None if sign == 1.0 else self._minus_ones(len(later), out.device)
            self._codec.accumulate(torch.stack([b for b, _ in later]), out, weights,
                                   checked=not all(ok for _, ok in later))

    @staticmethod
    def _minus_ones(n: int, device: torch.device) -> torch.Tensor:
        return torch.full((n,), -1.0, dtype=torch.float32, device=device)

    def _forget_acknowledged(self) -> None:
        """Drop the own messages every live neighbour's ack has passed and that no own term
        will rebuild its version from (the last ``staleness + fragments`` stay)."""
        live = self._live_streams()
        oldest = min((self._acked[k] for k in live), default=self.rounds_started)
        oldest = min(oldest, self.rounds_started - self._kept)
        while self._own_sent and self._own_sent[0][0] < oldest:
            self._own_sent.popleft()

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
        paired = self._fresh(mix[0]) if mix is not None else []
        self._write_header(message, paired, mix)
        seal_(message, t, self.member)
        failures = streams.send(message)
        if failures and self.on_peer_loss == "raise":
            raise failures[0][1]  # nothing changed
        self.steps += 1
        self._codec.accumulate(message[:self.nbytes], own, checked=not bounded)
        self._own_sent.append((t, message, bounded))
        self.rounds_started += 1
        # A new neighbour's hello carries hat_own with this round in it.
        self._handle(failures)
        changed = self._pay_owed(x)
        if mix is None:
            return sorted(changed)  # nothing to mix yet
        # The terms of the neighbours the acks name, whatever the failures just handled: a
        # neighbour that got this message adds their mirrors.
        self._count_terms(paired, mix[0])
        self._mix(x, *mix, paired)
        self._forget_acknowledged()
        return sorted(changed | {mix[0]})

    def _mixable(self) -> list[int]:
        """The streams whose neighbour this member mixes with now: live, copy set up."""
        return [k for k in self._live_streams() if self._greeted[k]]

    def _held(self, k: int, f: int) -> int:
        """How many messages of fragment f neighbour k's copy holds (its rounds r below
        ``received[k]`` with ``r % fragments == f``)."""
        return (self.received[k] - f + self.fragments - 1) // self.fragments

    def _terms_per_copy(self) -> int:
        """How many terms may use one neighbour's copy of a fragment before it changes: m with
        ``degree (m + 1) gamma w / 2 <= 1/2`` (at least 1): a slow member's own terms and the
        mirrors its fast neighbours owe it then move it by at most half the way per round."""
        degree = max(1, len(self._live_streams()))
        return max(1, int(1.0 / (degree * self.gamma * self._edge_weight)) - 1)

    def _fresh(self, f: int) -> list[int]:
        """The mixable neighbours this member pairs a term on fragment f with: those whose copy
        of f has changed since the last term on it, or has served fewer than
        :meth:`_terms_per_copy` terms. Each term owes the neighbour a mirror; a member n times
        faster than its neighbour would otherwise owe it n mirrors per round of its own, and
        with n gamma w / 2 past 1 the pair's difference grows instead of shrinking (a member
        20 times faster at gamma 0.3 on a ring). Capped, the neighbour's terms and mirrors per
        round of its own add up to at most half the way, whatever the paces, and nobody
        waits."""
        cap = self._terms_per_copy()
        return [k for k in self._mixable()
                if self._held(k, f) > self._termed[k][f] or self._terms_on_copy[k][f] < cap]

    def _count_terms(self, paired: list[int], f: int) -> None:
        """Count this round's terms on fragment f with the neighbours ``paired``."""
        for k in paired:
            held = self._held(k, f)
            if held > self._termed[k][f]:
                self._termed[k][f], self._terms_on_copy[k][f] = held, 0
            self._terms_on_copy[k][f] += 1

    @property
    def _kept(self) -> int:
        """Messages kept per stream (and own ones at least) to rebuild a copy's version."""
        return self.staleness + self.fragments

    def _fragment_to_mix(self, t: int) -> tuple[int, int] | None:
        """What round t mixes: the fragment of round ``t - s`` and the own copy holding the
        rounds up to it (version ``t - s + 1``), where s is the smallest lag, at least
        ``staleness``, at which every neighbour mixed with has sent its round ``t - s`` and that
        round has arrived (then both copies of a term hold the same rounds of the fragment); at
        most ``staleness + fragments - 1``. None before round ``staleness``."""
        if t < self.staleness:
            return None
        lag = max((t + 1 - self.received[k] for k in self._mixable()), default=0)
        s = min(max(self.staleness, lag), self.staleness + self.fragments - 1, t)
        return (t - s) % self.fragments, t - s + 1

    def _write_header(self, message: torch.Tensor, paired: list[int],
                      mix: tuple[int, int] | None) -> None:
        """A message's header: for each neighbour mixed with, 1 + its rounds in the copy; then
        1 + the fragment mixed (0: none) and the own copy's version in the terms."""
        head = torch.zeros(self.size + 2, dtype=torch.int64)
        for k in paired:
            head[self.peers[k]] = self.received[k] + 1
        if mix is not None:
            head[self.size], head[self.size + 1] = mix[0] + 1, mix[1]
        message[self.nbytes:self.nbytes + self._header_nbytes()].copy_(head.view(torch.uint8))

    def _weights_of(self, paired: list[int], device: torch.device) -> tuple[torch.Tensor, float]:
        """float32 ``[streams]``: each neighbour's weight in this round's own terms (half the
        edge's weight for the paired ones, 0 for the others), and their sum."""
        key = tuple(paired)
        cached = self._mix_weights
        if cached is None or cached[0] != key or cached[1].device != device:
            w = torch.zeros(len(self.peers), dtype=torch.float32)
            w[list(paired)] = 0.5 * self._edge_weight
            self._mix_weights = cached = (key, w.to(device), float(w.sum()))
        return cached[1], cached[2]

    def _mix(self, x: torch.Tensor, f: int, version: int, paired: list[int]) -> None:
        frag = self.fragment(f)
        xf = x[frag]
        if self._outer:
            # Outer Nesterov step on this fragment's progress since its previous mix (as in
            # CompressedGossip): d = x - a; u <- mu u + d; x <- a + lr (d + mu u).
            a, u = self._anchor[frag], self._momentum[frag]
            d = torch.sub(xf, a)
            u.mul_(self.outer_momentum).add_(d)
            d.add_(u, alpha=self.outer_momentum)
            torch.add(a, d, alpha=self.outer_lr, out=xf)
        # own terms: sum_j w_j/2 (copy_j - own) = (w row) @ copies - (sum w) own, with the own
        # copy at ``version`` (hat_own less the own messages of f since)
        w, w_sum = self._weights_of(paired, x.device)
        own = self._hat_own[frag].clone()
        self._add_own_since(own, f, version, sign=-1.0)
        correction = torch.mv(self._copies[:, frag].t(), w)
        correction.add_(own, alpha=-w_sum)
        xf.add_(correction, alpha=2 * self.gamma)
        self._owed[frag].sub_(correction)
        self._owed_fragments.add(f)
        if self._outer:
            self._anchor[frag].copy_(xf)

    def _pay_owed(self, x: torch.Tensor) -> set[int]:
        """Add the mirror terms owed to their fragments of ``x`` (and of the outer step's
        anchor: a correction is not progress of the fragment); the fragments changed."""
        paid = self._owed_fragments
        for f in paid:
            frag = self.fragment(f)
            x[frag].add_(self._owed[frag], alpha=self.gamma)
            if self._outer and self._anchor is not None:
                self._anchor[frag].add_(self._owed[frag], alpha=self.gamma)
            self._owed[frag].zero_()
        self._owed_fragments = set()
        return paid

    def settle(self, x: torch.Tensor) -> None:
        """Add every mirror term owed to ``x`` (float32 ``[numel]``, in place) at once, so that
        the members' ``x`` alone hold their average (after :meth:`drain`, before an exact
        average)."""
        if self._owed is not None:
            x.view(-1).add_(self._owed.to(x.device), alpha=self.gamma)
            self._owed.zero_()
        self._owed_fragments = set()

    def _ensure_buffers(self, like: torch.Tensor) -> None:
        dev = like.device
        if self._hat_own is None:
            z = lambda: torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self._hat_own, self._owed = z(), z()
            self._copies = torch.zeros(len(self.peers), self.numel, dtype=torch.float32,
                                       device=dev)
        if self._outer and self._momentum is None and like.numel() == self.numel:
            self._momentum = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self._anchor = like.detach().clone()  # every fragment's start: x at the first round

    # -----------------------------------------------------------------------------------------
    # a lost neighbour: drop it, close the graph over the gap

    def _lose(self, k: int, err: PeerError) -> None:
        """Drop neighbour ``k`` for good and link to the nearest live member on each side
        that is not a neighbour already."""
        if not self._live[k]:
            return
        peer = self.peers[k]
        self._live[k] = False
        self._mix_weights = None
        self._inbox[k].clear()
        self._pending[k] = []
        self._streams_now().drop(k)
        self.lost.add(peer)
        event = {"rank": self.peer_ranks[k], "member": peer, "step": self.steps,
                 "round": self.rounds_started, "time": time.time(),
                 "error": type(err).__name__, "detail": str(err)}
        self.losses.append(event)
        linked = []
        for side in (1, -1):
            j = self._nearest_live(side)
            if j is not None and j not in self._live_peers():
                self._greet(j)
                linked.append(self.group_ranks[j])
        log.warning("qcomm: rank %d dropped its gossip neighbour rank %d at step %d (%s: %s); "
                    "%d of %d nodes live as far as it knows%s", self.group_ranks[self.member],
                    event["rank"], self.steps, event["error"], err,
                    self.live_members(), self.size,
                    f"; linked to rank(s) {linked}" if linked else "")

    def _live_peers(self) -> list[int]:
        return [self.peers[k] for k in self._live_streams()]

    def live_members(self) -> int:
        """How many members are live, as far as this member knows (itself included)."""
        return self.size - len(self.lost)

    def _nearest_live(self, side: int) -> int | None:
        """The nearest member on ``side`` (+1: higher indices, cyclic) not known to be lost;
        None when this member is the only one."""
        for d in range(1, self.size):
            j = (self.member + side * d) % self.size
            if j not in self.lost:
                return j
        return None

    def _greet(self, peer: int) -> None:
        """Open streams to ``peer`` and send it the hello: a control message, then two
        vectors: int64 ``[rounds_started, drains]`` and this member's ``hat_own``."""
        streams = self._streams_now()
        k = streams.open(self._slots[peer], self.group_ranks[peer])
        assert k == len(self.peers), "streams and gossip disagree on the stream count"
        self.peers.append(peer)
        self.peer_ranks.append(self.group_ranks[peer])
        self.received.append(0)
        self._live.append(True)
        self._greeted.append(False)
        self._acked.append(self.rounds_started)  # the hello's copy holds these rounds
        self._termed.append([0] * self.fragments)
        self._terms_on_copy.append([0] * self.fragments)
        self._recent.append(deque())
        self._inbox.append(deque())
        self._pending.append([])
        self._markers.append(0)
        self._mix_weights = None
        if self._copies is not None:
            self._copies = torch.cat([self._copies, torch.zeros_like(self._copies[:1])])
        err = streams.send_to(k, self._control_message(HELLO_ROUND))
        if err is not None:
            self._lose(k, err)
            return
        streams.send_vector(k, torch.tensor([self.rounds_started, self._drains],
                                            dtype=torch.int64))
        own = self._hat_own.cpu().clone() if self._hat_own is not None \
            else torch.zeros(self.numel, dtype=torch.float32)
        streams.send_vector(k, own)

    def _take_hello(self, k: int) -> PeerError | None:
        """The hello's vectors of stream ``k``: its copy, its round and drain counts."""
        streams = self._streams_now()
        meta = torch.zeros(2, dtype=torch.int64)
        err = streams.recv_vector(k, meta)
        copy = torch.zeros(self.numel, dtype=torch.float32)
        err = err or streams.recv_vector(k, copy)
        if err is not None:
            return err
        rounds, drains = (int(v) for v in meta)
        if self._copies is None:
            self._ensure_buffers(copy.new_empty(0))  # not x: no outer anchor from it
        self._copies[k].copy_(copy)
        self.received[k] = rounds
        self._markers[k] = drains
        self._greeted[k] = True
        self._mix_weights = None
        return None

    def survivors_sum(self, t: torch.Tensor, op: str = "sum") -> tuple[torch.Tensor, int]:
        """The sum (``op="max"``: the element-wise maximum) of ``t`` (any dtype and shape)
        over the live members, and their count; every live member gets the same bits.
        Collective: every live member calls it at the same point, after :meth:`drain`. The
        sum runs along the closed ring from the lowest live member, and the total is passed
        around.

        Raises:
            PeerError: a member was lost during the sum (nothing is returned; the graph has
                closed over it, and another call sums the remaining members).
        """
        right, left = self._nearest_live(1), self._nearest_live(-1)
        if self.size == 1 or right is None:
            return t.clone(), 1
        streams = self._streams_now()
        kr, kl = self._stream_of(right), self._stream_of(left)
        cpu = t.detach().to("cpu", copy=True).contiguous()
        leader = left > self.member  # the lowest live member: its left wraps around
        last = right < self.member   # its right is the lowest

        # Upstream members may each spend up to timeout_s finding a loss in their drain.
        wait_s = 2 * self.timeout_s
        # Beside the sum goes int64 [1 + size]: the count, and a 1 for every member someone
        # knows to be lost; every member learns the union (stats say how many are live).
        lost = torch.zeros(1 + self.size, dtype=torch.int64)
        lost[1 + torch.tensor(sorted(self.lost), dtype=torch.int64)] = 1

        def recv(k: int) -> tuple[torch.Tensor, torch.Tensor]:
            out, info = torch.empty_like(cpu), torch.empty_like(lost)
            err = streams.recv_vector(k, out, wait_s) or streams.recv_vector(k, info, wait_s)
            if err is not None:
                self._handle([(k, err)])
                raise err
            return out, info

        def send(k: int, v: torch.Tensor, info: torch.Tensor) -> None:
            streams.send_vector(k, v)
            streams.send_vector(k, info)

        lost[0] = 1
        if leader:
            send(kr, cpu, lost)
            total, info = recv(kl)      # from the last
            send(kr, total, info)       # around the ring, up to the last
        else:
            total, info = recv(kl)
            if op == "max":
                torch.maximum(total, cpu, out=total)
            else:
                total.add_(cpu)
            upstream = int(info[0])
            info = torch.maximum(info, lost)
            info[0] = upstream + 1      # the count: the partial's and this member
            send(kr, total, info)       # the last sends the total to the leader
            if last:
                recv(kl)                # the total, come around: already known here
            else:
                total, info = recv(kl)
                send(kr, total, info)
        count = int(info[0])
        self._learn({m for m in range(self.size) if info[1 + m]})
        # a copy: the tensor sent is the streams' until it has left
        return total.to(t.device, copy=True), count

    def _stream_of(self, peer: int) -> int:
        for k in self._live_streams():
            if self.peers[k] == peer:
                return k
        raise RuntimeError(f"no live stream to member {peer}")

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
        # it tells the neighbours which members this one knows to be lost
        marker = self._control_message(MARKER_ROUND + self._drains, self._lost_bits())
        self._drains += 1
        self._handle(self._streams_now().send(marker))

    def await_markers(self) -> None:
        """Second half of :meth:`drain`: take and apply every message until each neighbour's
        marker of this drain (or its goodbye) has come."""
        streams = self._streams_now()
        deadline = time.monotonic() + self.timeout_s
        while True:
            failures = self._take()
            self._sort_inbox(failures)
            self._handle(failures)
            if failures:  # new neighbours get the full time to answer
                deadline = time.monotonic() + self.timeout_s
            waiting = [k for k in self._live_streams()
                       if (not self._greeted[k] or self._markers[k] < self._drains)
                       and not streams.ended(k)]
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0 or streams.simulated:
                raise PeerTimeoutError(
                    f"gossip drain (rank {self.group_ranks[self.member]}): no marker",
                    self.timeout_s, [self.peer_ranks[k] for k in waiting], self.level)
            streams.wait_any(left)
        self._apply_pending()
        self._drained_at = self.rounds_started

    # -----------------------------------------------------------------------------------------
    # goodbye and close

    def _control_message(self, round: int, body: torch.Tensor | None = None) -> torch.Tensor:
        """A hello, marker or goodbye: codec bytes ``body`` (uint8, zero-padded; None: all
        zero) sealed with ``round``."""
        m = torch.zeros(self.message_nbytes, dtype=torch.uint8)
        if body is not None:
            m[:body.numel()] = body
        seal_(m, round, self.member)
        return m

    def _lost_bits(self) -> torch.Tensor | None:
        """The lost members as a bit set, uint8 ``[ceil(size / 8)]`` (None when it does not
        fit in a message's codec bytes)."""
        if (self.size + 7) // 8 > self.nbytes or not self.lost:
            return None
        bits = torch.zeros(self.size, dtype=torch.bool)
        bits[sorted(self.lost)] = True
        bits = torch.nn.functional.pad(bits, (0, -self.size % 8)).view(-1, 8)
        return (bits.to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(1).to(
            torch.uint8)

    def _learn_lost(self, marker: torch.Tensor) -> None:
        """Learn the members a neighbour's marker says are lost (:meth:`_learn`)."""
        n = (self.size + 7) // 8
        if n > self.nbytes:
            return
        body = marker[:n].cpu()
        bits = ((body.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)
        self._learn({int(i) for i in bits[:self.size].nonzero().view(-1)})

    def _learn(self, told: set[int]) -> None:
        """Members others say are lost: known lost here too, but for this member's live
        neighbours (a broken link between two others is theirs)."""
        self.lost |= told - set(self._live_peers()) - {self.member}

    def _is_control(self, message: torch.Tensor, round: int, sender: int) -> bool:
        """Whether ``message`` from member ``sender`` is its control message ``round``: zero
        codec bytes sum to zero, so the seal is the key itself."""
        return (self._stored_seal(message) == seal_key(round, sender)
                and not bool(message[:self.nbytes].any()))

    def _is_goodbye_from(self, message: torch.Tensor, slot: int) -> bool:
        """Whether ``message`` from the member at index ``slot`` of the group is its
        goodbye."""
        return self._is_control(message, GOODBYE_ROUND, self._slots.index(slot))

    def close(self) -> None:
        """Say goodbye to the neighbours (their streams from us end cleanly) and stop the
        streams. Never raises a peer's failure; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._streams is not None:
            self._streams.close(self._control_message(GOODBYE_ROUND))
            self._streams = None

    # -----------------------------------------------------------------------------------------
    # statistics and checkpoints

    def rounds_received(self) -> dict[int, int]:
        """Per live neighbour (its global rank), the rounds of it applied here."""
        return {self.peer_ranks[k]: self.received[k] for k in self._live_streams()}

    def lag(self) -> dict[int, int]:
        """Per live neighbour (its global rank), this member's rounds minus the neighbour's
        rounds it has applied (negative: the neighbour is ahead)."""
        return {r: self.rounds_started - n for r, n in self.rounds_received().items()}

    def _config(self) -> dict:
        return {"numel": self.numel, "size": self.size, "member": self.member,
                "graph": self.graph, "mixing": self.mixing, "staleness": self.staleness,
                "spec": (self.spec.bits, self.spec.block_size, self.spec.rounding),
                "fragments": self.fragments, "outer_momentum": self.outer_momentum,
                "outer_lr": self.outer_lr, "round_period": self.round_period,
                "wait_free": True}

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
        live = self._live_streams()
        copies = self._copies if self._copies is None or len(live) == len(self.peers) \
            else self._copies[live]
        return {"config": self._config(), "wire_format": WIRE_FORMAT_VERSION,
                "gamma": self.gamma, "seed": self.seed, "steps": self.steps,
                "rounds_started": self.rounds_started,
                # the live neighbours (after a loss, not the graph's), per neighbour
                "peers": [self.peers[k] for k in live],
                "received": [self.received[k] for k in live],
                "termed": [list(self._termed[k]) for k in live],
                "terms_on_copy": [list(self._terms_on_copy[k]) for k in live],
                "recent": [[(r, b.clone()) for r, b in self._recent[k]] for k in live],
                "own_sent": [(r, m.clone()) for r, m, _ in self._own_sent],
                "owed_fragments": sorted(self._owed_fragments),
                "lost": sorted(self.lost), "losses": list(self.losses),
                "hat_own": self._hat_own, "owed": self._owed, "copies": copies,
                "momentum": self._momentum, "anchor": self._anchor}

    def _survivors_slots(self, state: dict) -> list[int] | None:
        """When ``state`` was saved in a run that lost members and this group holds exactly
        its survivors (in member order, this member at the saved one's place): each saved
        member's index here (-1: lost). None when the state is of this very group."""
        saved, mine = dict(state["config"]), self._config()
        if saved == mine:
            return None
        size, member = saved.pop("size"), saved.pop("member")
        live = [m for m in range(size) if m not in set(state["lost"])]
        if (saved != {k: v for k, v in mine.items() if k not in ("size", "member")}
                or len(live) != self.size or member not in live
                or live.index(member) != self.member):
            raise ValueError(f"state was saved with config {state['config']} (lost members "
                             f"{state['lost']}), this gossip has {mine}")
        return [live.index(m) if m in live else -1 for m in range(size)]

    @staticmethod
    def _saved_message(m: object, nbytes: int) -> torch.Tensor:
        """A saved message (uint8 ``[nbytes]``), checked: rounds decode from it."""
        if not isinstance(m, torch.Tensor) or m.dtype != torch.uint8 or tuple(m.shape) != (
                nbytes,):
            raise ValueError(f"a saved message must be a uint8 tensor of shape [{nbytes}], got "
                             f"{getattr(m, 'dtype', type(m).__name__)} "
                             f"{list(getattr(m, 'shape', []))}")
        return m.detach().clone()

    def _saved_counts(self, state: dict, key: str) -> list[list[int]]:
        """A saved per-neighbour, per-fragment count (``termed``, ``terms_on_copy``),
        checked: one row of ``fragments`` ints >= 0 per saved neighbour (a state saved before
        terms were counted has none: every copy counts as not mixed with yet)."""
        n = len(state["peers"])
        rows = state.get(key, [[0] * self.fragments for _ in range(n)])
        ok = isinstance(rows, list) and len(rows) == n and all(
            isinstance(row, list) and len(row) == self.fragments
            and all(isinstance(c, int) and c >= 0 for c in row) for row in rows)
        if not ok:
            raise ValueError(f"state[{key!r}] must be {n} lists of "
                             f"{self.fragments} ints >= 0 (one per neighbour and fragment), "
                             f"got {rows!r}")
        return [list(row) for row in rows]

    def _saved_buffers(self, state: dict) -> dict[str, torch.Tensor | None]:
        """The saved buffers, checked (dtype, shape, device): rounds decode into and from them
        without checking them again. A state without ``owed`` (saved before the mixing was
        paired) owes nothing."""
        n = self.numel
        return check_state_buffers(
            state, {"hat_own": n, "owed": n, "copies": (len(state["peers"]), n),
                    "momentum": n, "anchor": n},
            together=[("hat_own", "copies"), ("momentum", "anchor")])

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output before the first round. The configuration must
        match, or the state was saved after members were lost and this group is its survivors
        (then the member numbers, seeds and links of the saved run go on: the run continues
        as if it had not stopped)."""
        if not isinstance(state, dict) or "config" not in state:
            raise ValueError("state must be a dict from WaitFreeGossip.state_dict()")
        slots = self._survivors_slots(state)
        if self._streams is not None:
            raise RuntimeError("load_state_dict after the streams started")
        saved = self._saved_buffers(state)
        size = int(state["config"]["size"])
        message_nbytes = self.nbytes + ACK_NBYTES * (size + 2) + SEAL_NBYTES
        own_sent = [(int(r), self._saved_message(m, message_nbytes))
                    for r, m in state.get("own_sent", [])]
        recent = [[(int(r), self._saved_message(b, self.nbytes)) for r, b in h]
                  for h in state.get("recent", [[] for _ in state["peers"]])]
        termed = self._saved_counts(state, "termed")
        terms_on_copy = self._saved_counts(state, "terms_on_copy")
        if slots is not None:
            cfg = state["config"]
            self._slots = slots
            self.size, self.member = int(cfg["size"]), int(cfg["member"])
            self.group_ranks = [self._group_ranks[s] if s >= 0 else -1 for s in slots]
            self._edge_weight = self._graph_edge_weight()
            self.message_nbytes = self.nbytes + self._header_nbytes() + SEAL_NBYTES
        copy = lambda t: None if t is None else t.detach().clone()
        self.gamma = float(state["gamma"])
        self.seed = check_seed(state["seed"])
        self.steps = int(state["steps"])
        self.rounds_started = int(state["rounds_started"])
        self.peers = [int(p) for p in state["peers"]]
        self.peer_ranks = [self.group_ranks[p] for p in self.peers]
        self.received = [int(r) for r in state["received"]]
        self._termed, self._terms_on_copy = termed, terms_on_copy
        # Saved after a drain: every neighbour had applied every own round, so its acks from
        # now on hold them all; the own messages kept rebuild the own copy's versions.
        self._acked = [self.rounds_started] * len(self.peers)
        self._own_sent = deque((r, m, False) for r, m in own_sent)
        self._recent = [deque(h) for h in recent]
        self._owed_fragments = {int(f) for f in state.get("owed_fragments", [])}
        self._live = [True] * len(self.peers)
        self._greeted = [True] * len(self.peers)
        self._mix_weights = None
        self.lost = {int(m) for m in state["lost"]}
        self.losses = [dict(e) for e in state["losses"]]
        self._hat_own, self._copies = copy(saved["hat_own"]), copy(saved["copies"])
        self._owed = copy(saved["owed"])
        if self._owed is None and self._hat_own is not None:
            self._owed = torch.zeros_like(self._hat_own)
        self._momentum, self._anchor = copy(saved["momentum"]), copy(saved["anchor"])
        self._scratch = None
        # A drain preceded the save on every member: nothing was in flight. Markers restart
        # with the streams.
        self._inbox = [deque() for _ in self.peers]
        self._pending = [[] for _ in self.peers]
        self._drains, self._markers = 0, [0] * len(self.peers)
        self._drained_at = self.rounds_started

