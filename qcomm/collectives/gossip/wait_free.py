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

Round schedule (the one clock): :meth:`end_step` is called once per local step; a round is
due at the last step of every ``round_period`` steps and carries fragment ``t % fragments`` of
``x``; it mixes the fragment of round ``t - staleness``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerError, PeerTimeoutError
from qcomm.collectives.memory import MemoryGroup
from qcomm.collectives.stats import CommStats
from qcomm.compress import (
    WIRE_FORMAT_VERSION,
    QuantSpec,
    dequant_accumulate,
    packed_nbytes,
    quantize,
)
from qcomm.seeds import gossip_message_seed, seal_key
from qcomm.validation import (
    check_int,
    check_seed,
)

from .choco import _check_group
from .graphs import neighbours
from .integrity import SEAL_NBYTES, bad_messages, seal_
from .member import GossipMember
from .mixing import mixing_matrix
from .streams import GlooStreams, MemoryStreams, MessageStreams

__all__ = ["GOODBYE_ROUND", "MARKER_ROUND", "WaitFreeGossip"]

# The rounds a marker (the d-th drain: MARKER_ROUND + d) and a goodbye are sealed with, far
# beyond any real round. Both have all-zero codec bytes, so their seal is the key itself.
MARKER_ROUND = 1 << 61
GOODBYE_ROUND = 1 << 62


class WaitFreeGossip(GossipMember):
    """Compressed CHOCO gossip of one fp32 vector per member, wait-free (module docstring).

    Args:
        group_ranks, group: the members' global ranks (node order) and their process group, a
            :class:`~qcomm.collectives.memory.MemoryGroup` (members as threads), or None with
            ``_streams`` (the simulator).
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
                 max_backlog: int = 64, _streams: MessageStreams | None = None) -> None:
        self._set_hyperparameters(
            numel, graph=graph, mixing=mixing, spec=spec, gamma=gamma, staleness=staleness,
            timeout_s=timeout_s, seed=seed, fragments=fragments,
            outer_momentum=outer_momentum, outer_lr=outer_lr, round_period=round_period,
            stats=stats)
        self.max_backlog = check_int("max_backlog", max_backlog, low=1)
        if _streams is not None:
            self.group_ranks, self.member = list(range(_streams.size)), _streams.member
        else:
            self.group_ranks, self.member = _check_group(group_ranks, group)
        self.group = group
        self.size = len(self.group_ranks)
        self.peers = neighbours(self.graph, self.member, self.size)
        self.peer_ranks = [self.group_ranks[p] for p in self.peers]
        if _streams is not None and _streams.peers != self.peers:
            raise ValueError(f"the streams' peers {_streams.peers} != the graph's {self.peers}")
        w = mixing_matrix(self.graph, self.size, self.mixing).to(torch.float32)
        self._weights = torch.stack([w[self.member, p] for p in self.peers]) if self.peers \
            else torch.zeros(0)
        self._weight_sum = float(self._weights.sum())
        self.nbytes = packed_nbytes(self.fragment_numel, spec)
        self.message_nbytes = self.nbytes + SEAL_NBYTES
        self._streams = _streams
        self._streams_given = _streams is not None
        self.level = "inter"

        # the counters (the clock, steps, is the base class's)
        self.rounds_started = 0
        self.received = [0] * len(self.peers)     # messages of each neighbour applied
        # buffers (lazily, on x's device)
        self._hat_own: torch.Tensor | None = None
        self._own_pub: torch.Tensor | None = None
        self._copies: torch.Tensor | None = None  # [degree, numel]
        self._momentum: torch.Tensor | None = None
        self._anchor: torch.Tensor | None = None
        self._own_delay: deque[tuple[int, torch.Tensor]] = deque()  # sent, not in own_pub
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
            if isinstance(self.group, MemoryGroup):
                self._streams = MemoryStreams(
                    self.group.mailboxes, self.member, self.peers,
                    max_backlog=self.max_backlog, timeout_s=self.timeout_s, stats=self.stats,
                    peer_ranks=self.peer_ranks)
            else:
                self._streams = GlooStreams(
                    self.group_ranks, self.group, self.member, self.peers,
                    self.message_nbytes, max_backlog=self.max_backlog,
                    timeout_s=self.timeout_s, is_goodbye=self._is_goodbye, stats=self.stats)
        return self._streams

    def prepare(self) -> None:
        """Before the local update of a step that ends with a round: take what every neighbour
        sent since the previous round, verify it, and apply it to that neighbour's copy.
        Nothing is applied when anything fails.

        Raises:
            PeerTimeoutError, PeerLostError: a neighbour's stream failed (silence past
                ``timeout_s``, or a broken connection).
            CorruptPayloadError: a message failed verification (or came out of order).
        """
        if self.size == 1 or not self.round_due():
            return
        failure = self._take()
        self._sort_inbox()
        if failure is not None:
            raise failure
        self._apply_pending()

    def _take(self) -> PeerError | None:
        """Move what arrived into the inboxes; the first stream failure, if any."""
        streams = self._streams_now()
        failure = None
        for k in range(len(self.peers)):
            msgs, err = streams.take(k)
            self._inbox[k].extend(msgs)
            failure = failure or err
        return failure

    def _stored_seal(self, m: torch.Tensor) -> int:
        return int.from_bytes(m[self.nbytes:].cpu().numpy().tobytes(), "little", signed=True)

    def _sort_inbox(self) -> None:
        """Verify the inboxes' messages in order: rounds go to ``_pending``, markers are
        counted. Raises CorruptPayloadError at the first that fails (it stays in the inbox)."""
        for k, box in enumerate(self._inbox):
            peer = self.peers[k]
            while box:
                m = box[0]
                if self._is_control(m, MARKER_ROUND + self._markers[k], peer):
                    self._markers[k] += 1
                    box.popleft()
                    continue
                expected = self.received[k] + len(self._pending[k])
                bad = bad_messages(m.view(1, -1), expected, [peer], self.fragment_numel,
                                   self.spec)
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
                dequant_accumulate(torch.stack(bodies), self._copies[k, self.fragment(f)],
                                   self.spec)
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
        diff = torch.sub(x[frag], own)
        quantize(diff, self.spec, seed=gossip_message_seed(self.seed, t, self.member),
                 out=message[:self.nbytes])
        seal_(message, t, self.member)
        streams.send(message)  # may raise (a neighbour's stream failed): nothing changed
        self.steps += 1
        dequant_accumulate(message[:self.nbytes], own, self.spec)
        self._own_delay.append((t, message))
        while len(self._own_delay) > self.staleness:
            r, m = self._own_delay.popleft()
            dequant_accumulate(m[:self.nbytes], self._own_pub[self.fragment(r % self.fragments)],
                               self.spec)
        self.rounds_started += 1
        mixed = t - self.staleness
        if mixed < 0:
            return []  # nothing to mix yet: x is as it was
        f = mixed % self.fragments
        self._mix(x, f)
        return [f]

    def _mix(self, x: torch.Tensor, f: int) -> None:
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
        correction = torch.mv(self._copies[:, frag].t(), self._weights.to(x.device))
        correction.add_(self._own_pub[frag], alpha=-self._weight_sum)
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
        marker = self._control_message(MARKER_ROUND + self._drains)
        self._drains += 1
        self._streams_now().send(marker)

    def await_markers(self) -> None:
        """Second half of :meth:`drain`: take and apply every message until each neighbour's
        marker of this drain (or its goodbye) has come."""
        streams = self._streams_now()
        deadline = time.monotonic() + self.timeout_s
        while True:
            failure = self._take()
            self._sort_inbox()
            if failure is not None:
                raise failure
            waiting = [k for k in range(len(self.peers))
                       if self._markers[k] < self._drains and not streams.ended(k)]
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

    def _control_message(self, round: int) -> torch.Tensor:
        """A marker or goodbye: all-zero codec bytes sealed with ``round``."""
        m = torch.zeros(self.message_nbytes, dtype=torch.uint8)
        seal_(m, round, self.member)
        return m

    def _is_control(self, message: torch.Tensor, round: int, sender: int) -> bool:
        """Whether ``message`` from member ``sender`` is its control message ``round``: zero
        codec bytes sum to zero, so the seal is the key itself."""
        return (self._stored_seal(message) == seal_key(round, sender)
                and not bool(message[:self.nbytes].any()))

    def _is_goodbye(self, message: torch.Tensor, sender: int) -> bool:
        """Whether ``message`` from member ``sender`` is its goodbye."""
        return self._is_control(message, GOODBYE_ROUND, sender)

    def close(self) -> None:
        """Say goodbye to the neighbours (their streams from us end cleanly) and stop the
        streams. Never raises a peer's failure; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._streams is not None:
            self._streams.close(self._control_message(GOODBYE_ROUND))
            if not self._streams_given:
                self._streams = None

    # -----------------------------------------------------------------------------------------
    # statistics and checkpoints

    def lag(self) -> list[int]:
        """Per neighbour, this member's rounds minus the neighbour's rounds it has applied
        (negative: the neighbour is ahead)."""
        return [self.rounds_started - r for r in self.received]

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
        return {"config": self._config(), "wire_format": WIRE_FORMAT_VERSION,
                "gamma": self.gamma, "seed": self.seed, "steps": self.steps,
                "rounds_started": self.rounds_started, "received": list(self.received),
                "hat_own": self._hat_own, "own_pub": self._own_pub, "copies": self._copies,
                "momentum": self._momentum, "anchor": self._anchor,
                "own_delay": [(r, m) for r, m in self._own_delay]}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output before the first round (configuration must match)."""
        if not isinstance(state, dict) or "config" not in state:
            raise ValueError("state must be a dict from WaitFreeGossip.state_dict()")
        if state["config"] != self._config():
            raise ValueError(f"state was saved with config {state['config']}, this gossip has "
                             f"{self._config()}")
        if self._streams is not None and not self._streams_given:
            raise RuntimeError("load_state_dict after the streams started")
        copy = lambda t: None if t is None else t.detach().clone()
        self.gamma = float(state["gamma"])
        self.seed = check_seed(state["seed"])
        self.steps = int(state["steps"])
        self.rounds_started = int(state["rounds_started"])
        self.received = [int(r) for r in state["received"]]
        self._hat_own, self._own_pub = copy(state["hat_own"]), copy(state["own_pub"])
        self._copies = copy(state["copies"])
        self._momentum, self._anchor = copy(state["momentum"]), copy(state["anchor"])
        self._own_delay = deque((int(r), copy(m)) for r, m in state["own_delay"])
        # A drain preceded the save on every member: nothing was in flight. Markers restart
        # with the streams.
        self._inbox = [deque() for _ in self.peers]
        self._pending = [[] for _ in self.peers]
        self._drains, self._markers = 0, [0] * len(self.peers)
        self._drained_at = self.rounds_started

