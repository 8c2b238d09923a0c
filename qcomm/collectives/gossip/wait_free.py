"""Wait-free compressed gossip: CHOCO where no node ever waits for a neighbour's round.

The bounded-staleness gossip (:mod:`.choco`) applies round ``t - staleness`` at round t and
waits for it: every node runs at its slowest neighbour's pace, ``staleness`` rounds later. Here
each member counts its own rounds and each neighbour's separately, and takes whatever its
neighbours have sent whenever a round of its own is due:

* member i sends ``q = Q(x - hat_own)`` every round (``hat_own += D(q)``, error feedback as in
  CHOCO), on an ordered stream to each neighbour (:mod:`.streams`);
* it keeps one copy per neighbour j of ``x_hat_j``, holding exactly the messages of j it has
  taken, every one once and in order (the seal of each message names its round and sender, so
  a message out of order fails verification); several that arrived together are applied in
  one ``dequant_accumulate`` per fragment;
* the mixing step uses the copies as they are:
  ``x_f += gamma * sum_j w_ij (copy_j[f] - own_pub[f])``, where ``own_pub`` is ``hat_own``
  without the member's last ``staleness`` messages, i.e. its own copy as its neighbours hold it
  when their messages arrive within ``staleness`` rounds.

Nothing bounds the lag in rounds: a node twice as fast sends twice as many rounds, and its
neighbours apply them in batches. What is bounded is memory (``max_backlog`` messages per
neighbour sent and not yet taken; beyond it the sender waits) and silence (a neighbour not
heard from for ``timeout_s`` is a :class:`~qcomm.collectives.errors.PeerTimeoutError`).

The average. When every member's messages reach its neighbours within ``staleness`` rounds of
its own and all run at one pace, each copy holds the same rounds as the ``own_pub`` it is
compared with, the mixing term is antisymmetric, and the average over members is preserved as
in the synchronous mode. Otherwise it is not exactly: a fast member mixes more often with a
slow neighbour's older copy than the neighbour mixes with it, so the average drifts toward the
faster members (measured by ``bench/wait_free_mixing.py``, docs/decisions.md; training still
ends at the optimum of all the members' data, ``tests/collectives/test_wait_free.py``).
:meth:`drain`, a collective, brings every copy up to date; the engine's exact average follows
it.

A lost neighbour (``on_peer_loss="continue"``): when a neighbour's stream fails (a broken
connection, or silence past ``timeout_s``) the member drops it for good and the graph closes
over the gap: on each side it links to the nearest member it does not know to be lost (in
member order, cyclic), unless that one is a neighbour already. The new neighbours greet each
other with a hello (their round count, drains and their ``hat_own``, sent whole), so each
starts with an exact copy of the other; the new edge enters the mixing at round
``max(r_i, r_j) + staleness`` on both sides (``r``: the rounds each had started when it
linked), when both copies hold the same rounds as the lagged own copies they meet. Every edge
keeps the graph's edge weight (on a regular graph all edges have one weight, so an edge's two
ends agree without asking anyone): the weights stay symmetric and the survivors' average is
preserved from the drop on, as before it. Both ends of a lost member decide the same link
without a coordinator; a member that linked to one that is lost too finds out the same way and
moves on. :meth:`survivors_sum` sums a vector over the live members along the closed ring.
``on_peer_loss="raise"`` (default) raises the stream's error instead.

Round schedule (the one clock): :meth:`end_step` is called once per local step; a round is
due at the last step of every ``round_period`` steps and carries fragment ``t % fragments`` of
``x``; it mixes the fragment of round ``t - staleness``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerError, PeerTimeoutError
from qcomm.collectives.stats import CommStats
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import WIRE_FORMAT_VERSION, QuantSpec, packed_nbytes
from qcomm.seeds import gossip_message_seed, seal_key
from qcomm.validation import (
    check_choice,
    check_int,
    check_seed,
)

from .choco import _check_group
from .codec import check_state_buffers
from .graphs import neighbours
from .integrity import SEAL_NBYTES, bad_messages, judge, message_facts, seal_, sealed
from .member import GossipMember
from .mixing import mixing_matrix
from .streams import MessageStreams

__all__ = ["GOODBYE_ROUND", "HELLO_ROUND", "MARKER_ROUND", "ON_PEER_LOSS", "WaitFreeGossip"]

log = logging.getLogger("qcomm")

# The rounds a hello, a marker (the d-th drain: MARKER_ROUND + d) and a goodbye are sealed
# with, far beyond any real round. A hello and a goodbye have zero codec bytes, so their seal is
# the key itself; a marker carries the lost members it knows of (a bit set) under its seal.
HELLO_ROUND = 1 << 60
MARKER_ROUND = 1 << 61
GOODBYE_ROUND = 1 << 62
ON_PEER_LOSS = ("raise", "continue")


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

    def __init__(self, group_ranks: list[int], group: Any, numel: int, *,
                 graph: str = "ring", mixing: str = "uniform",
                 spec: QuantSpec = QuantSpec(4, 128, "stochastic"),  # noqa: B008 (frozen)
                 gamma: float | None = None, staleness: int = 1, timeout_s: float = 300.0,
                 stats: CommStats | None = None, seed: int = 0, fragments: int = 1,
                 outer_momentum: float = 0.0, outer_lr: float = 1.0, round_period: int = 1,
                 max_backlog: int = 64, on_peer_loss: str = "raise") -> None:
        self._set_hyperparameters(
            numel, graph=graph, mixing=mixing, spec=spec, gamma=gamma, staleness=staleness,
            timeout_s=timeout_s, seed=seed, fragments=fragments,
            outer_momentum=outer_momentum, outer_lr=outer_lr, round_period=round_period,
            stats=stats)
        self.max_backlog = check_int("max_backlog", max_backlog, low=1)
        self.on_peer_loss = check_choice("on_peer_loss", on_peer_loss, ON_PEER_LOSS)
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
        self.message_nbytes = self.nbytes + SEAL_NBYTES
        self._streams: MessageStreams | None = None   # opened at the first use
        self.level = "inter"

        # the counters (the clock, steps, is the base class's)
        self.rounds_started = 0
        # Per stream k (to and from peers[k]; a stream of a lost neighbour stays, dead):
        self.received = [0] * len(self.peers)     # messages of each neighbour applied
        self._live = [True] * len(self.peers)     # not lost
        self._greeted = [True] * len(self.peers)  # its copy is set up (a new one: hello)
        self._joins = [0] * len(self.peers)       # the first round it is mixed in
        self._mix_weights: tuple | None = None    # cached (who is mixed, weights, their sum)
        self.lost: set[int] = set()               # members known to be lost
        self.losses: list[dict] = []              # what was dropped, when, why
        # buffers (lazily, on x's device)
        self._hat_own: torch.Tensor | None = None
        self._own_pub: torch.Tensor | None = None
        self._copies: torch.Tensor | None = None  # [degree, numel]
        self._momentum: torch.Tensor | None = None
        self._anchor: torch.Tensor | None = None
        # Sent, not in own_pub yet: (round, message, its scales known finite and at most
        # MAX_SCALE, so it decodes unchecked; False for one restored from a state_dict).
        self._own_delay: deque[tuple[int, torch.Tensor, bool]] = deque()
        self._scratch: torch.Tensor | None = None  # float32 [fragment_numel]: x - hat_own
        # Taken from the streams and not yet verified (inbox) or not yet applied (pending,
        # verified, with their rounds); a failed verification leaves the message in the inbox.
        self._inbox: list[deque[torch.Tensor]] = [deque() for _ in self.peers]
        self._pending: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.peers]
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
        t, mixed = self.rounds_started, self.rounds_started - self.staleness
        return sorted({t % self.fragments} | ({mixed % self.fragments} if mixed >= 0 else set()))

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
        return int.from_bytes(m[self.nbytes:].cpu().numpy().tobytes(), "little", signed=True)

    def _verify_inboxes(self) -> dict[int, list[str | None]]:
        """Verdicts on every message waiting in a live, greeted inbox, each taken to be its
        sender's next round in order (what it is, unless a marker comes first), with one host
        read per device for all of them: per stream, None for each message that passes, else
        the reason it fails."""
        facts: dict[torch.device, list[torch.Tensor]] = {}
        where: dict[torch.device, list[tuple[int, int, int]]] = {}  # (stream, round, sender)
        for k, box in enumerate(self._inbox):
            if not (box and self._live[k] and self._greeted[k]):
                continue
            expected = self.received[k] + len(self._pending[k])
            for i, m in enumerate(box):
                facts.setdefault(m.device, []).append(
                    message_facts(m.view(1, -1), self.fragment_numel, self.spec))
                where.setdefault(m.device, []).append((k, expected + i, self.peers[k]))
        verdicts: dict[int, list[str | None]] = {}
        for device, rows in facts.items():
            streams, rounds, senders = zip(*where[device], strict=True)
            bad = dict(judge(torch.cat(rows, dim=1).tolist(), rounds, senders))
            for j, k in enumerate(streams):
                verdicts.setdefault(k, []).append(bad.get(j))
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
                if taken < len(batch) and batch[taken] is None:
                    self._pending[k].append((self.received[k] + len(self._pending[k]), m))
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
                self._pending[k].append((expected, m))
                box.popleft()

    def _apply_pending(self) -> None:
        """Apply every verified message to its sender's copy, in batches per fragment."""
        for k, msgs in enumerate(self._pending):
            if not msgs:
                continue
            if self._copies is None:
                self._ensure_buffers(msgs[0][1].new_empty(0, dtype=torch.float32))
            by_fragment: dict[int, list[torch.Tensor]] = {}
            for r, m in msgs:
                by_fragment.setdefault(r % self.fragments, []).append(m[:self.nbytes])
            for f, bodies in by_fragment.items():
                # verified: finite scales at most MAX_SCALE, so decoded unchecked (.codec)
                self._codec.accumulate(torch.stack(bodies), self._copies[k, self.fragment(f)])
            self.received[k] += len(msgs)
            self._pending[k] = []

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
        message = torch.empty(self.message_nbytes, dtype=torch.uint8, device=x.device)
        if self._scratch is None or self._scratch.device != x.device:
            self._scratch = torch.empty(self.fragment_numel, dtype=torch.float32,
                                        device=x.device)
        diff = torch.sub(x[frag], own, out=self._scratch)
        # Raises NonFiniteError on a NaN/Inf in x before anything is sent or changed.
        bounded = self._codec.encode(diff, message[:self.nbytes],
                                     gossip_message_seed(self.seed, t, self.member))
        seal_(message, t, self.member)
        failures = streams.send(message)
        if failures and self.on_peer_loss == "raise":
            raise failures[0][1]  # nothing changed
        self.steps += 1
        self._codec.accumulate(message[:self.nbytes], own, checked=not bounded)
        self._own_delay.append((t, message, bounded))
        while len(self._own_delay) > self.staleness:
            r, m, bounded = self._own_delay.popleft()
            body = m[:self.nbytes]
            self._codec.accumulate(body, self._own_pub[self.fragment(r % self.fragments)],
                                   checked=not (bounded or self._codec.bounded(body)))
        self.rounds_started += 1
        # A new neighbour's hello carries hat_own with this round in it.
        self._handle(failures)
        mixed = t - self.staleness
        if mixed < 0:
            return []  # nothing to mix yet: x is as it was
        f = mixed % self.fragments
        self._mix(x, f, t)
        return [f]

    def _weights_at(self, t: int, device: torch.device) -> tuple[torch.Tensor, float]:
        """float32 ``[streams]``: each neighbour's weight in the mixing of round t (0 for a
        lost one, and for a new one before it joins), and their sum."""
        mixed = tuple(live and greeted and t >= join for live, greeted, join
                      in zip(self._live, self._greeted, self._joins, strict=True))
        cached = self._mix_weights
        if cached is None or cached[0] != mixed or cached[1].device != device:
            w = torch.tensor([self._edge_weight if m else 0.0 for m in mixed],
                             dtype=torch.float32)
            self._mix_weights = cached = (mixed, w.to(device), float(w.sum()))
        return cached[1], cached[2]

    def _mix(self, x: torch.Tensor, f: int, t: int) -> None:
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
        # sum_j w_ij (copy_j - own_pub) = (W row) @ copies - (sum_j w_ij) own_pub
        w, w_sum = self._weights_at(t, x.device)
        correction = torch.mv(self._copies[:, frag].t(), w)
        correction.add_(self._own_pub[frag], alpha=-w_sum)
        xf.add_(correction, alpha=self.gamma)
        if self._outer:
            self._anchor[frag].copy_(xf)

    def _ensure_buffers(self, like: torch.Tensor) -> None:
        dev = like.device
        if self._hat_own is None:
            z = lambda: torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self._hat_own, self._own_pub = z(), z()
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
        self._joins.append(self.rounds_started)  # raised to the later side's once greeted
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
            self._ensure_buffers(copy)
        self._copies[k].copy_(copy)
        self.received[k] = rounds
        self._markers[k] = drains
        # Both ends mix the edge from the same round on: both copies then hold the rounds of
        # the lagged own copies they are compared with.
        self._joins[k] = max(self._joins[k], rounds) + self.staleness
        self._greeted[k] = True
        self._mix_weights = None
        return None

    def survivors_sum(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The sum of ``t`` (any float dtype and shape) over the live members and their
        count; every live member gets the same bits. Collective: every live member calls it
        at the same point, after :meth:`drain`. The sum runs along the closed ring from the
        lowest live member, and the total is passed around.

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
                "joins": [self._joins[k] for k in live],
                "lost": sorted(self.lost), "losses": list(self.losses),
                "hat_own": self._hat_own, "own_pub": self._own_pub, "copies": copies,
                "momentum": self._momentum, "anchor": self._anchor,
                "own_delay": [(r, m) for r, m, _ in self._own_delay]}

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

    def _saved_buffers(self, state: dict) -> tuple[dict[str, torch.Tensor | None],
                                                    list[tuple[int, torch.Tensor]]]:
        """The saved buffers and own messages not yet in ``own_pub``, checked (dtype, shape,
        device): rounds decode into and from them without checking them again."""
        n = self.numel
        saved = check_state_buffers(
            state, {"hat_own": n, "own_pub": n, "copies": (len(state["peers"]), n),
                    "momentum": n, "anchor": n},
            together=[("hat_own", "own_pub", "copies"), ("momentum", "anchor")])
        device = None if saved["hat_own"] is None else saved["hat_own"].device
        own_delay = []
        for r, m in state["own_delay"]:
            if device is None:
                raise ValueError("state['own_delay'] holds messages but state['hat_own'] is "
                                 "None (no round was started)")
            if not isinstance(m, torch.Tensor) or m.dtype != torch.uint8 \
                    or tuple(m.shape) != (self.message_nbytes,) or m.device != device:
                raise ValueError(
                    f"state['own_delay'] must hold uint8 messages of shape "
                    f"[{self.message_nbytes}] on {device}, got "
                    f"{getattr(m, 'dtype', type(m).__name__)} "
                    f"{list(getattr(m, 'shape', []))} on {getattr(m, 'device', None)}")
            own_delay.append((int(r), m))
        return saved, own_delay

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
        saved, own_delay = self._saved_buffers(state)
        if slots is not None:
            cfg = state["config"]
            self._slots = slots
            self.size, self.member = int(cfg["size"]), int(cfg["member"])
            self.group_ranks = [self._group_ranks[s] if s >= 0 else -1 for s in slots]
            self._edge_weight = self._graph_edge_weight()
        copy = lambda t: None if t is None else t.detach().clone()
        self.gamma = float(state["gamma"])
        self.seed = check_seed(state["seed"])
        self.steps = int(state["steps"])
        self.rounds_started = int(state["rounds_started"])
        self.peers = [int(p) for p in state["peers"]]
        self.peer_ranks = [self.group_ranks[p] for p in self.peers]
        self.received = [int(r) for r in state["received"]]
        self._joins = [int(j) for j in state["joins"]]
        self._live = [True] * len(self.peers)
        self._greeted = [True] * len(self.peers)
        self._mix_weights = None
        self.lost = {int(m) for m in state["lost"]}
        self.losses = [dict(e) for e in state["losses"]]
        self._hat_own, self._own_pub = copy(saved["hat_own"]), copy(saved["own_pub"])
        self._copies = copy(saved["copies"])
        self._momentum, self._anchor = copy(saved["momentum"]), copy(saved["anchor"])
        self._own_delay = deque((r, copy(m), False) for r, m in own_delay)
        self._scratch = None
        # A drain preceded the save on every member: nothing was in flight. Markers restart
        # with the streams.
        self._inbox = [deque() for _ in self.peers]
        self._pending = [[] for _ in self.peers]
        self._drains, self._markers = 0, [0] * len(self.peers)
        self._drained_at = self.rounds_started

