"""Asynchronous CHOCO gossip with compressed messages (Koloskova et al. 2019), bounded staleness.

Per member i (a node's shard on one rail), in fp32 buffers the size of the shard:

* ``hat_own``: i's *fresh* public copy x_hat_i, holding every round i started. Compressing
  against it (``q = Q(x - hat_own)``, ``hat_own += D(q)`` at once) IS error feedback, so no
  :class:`~qcomm.compress.ErrorFeedback` is stacked on top (it would count the error twice).
* ``hat_pub``: x_hat_i as the neighbours know it (the rounds ``<= t - staleness`` at step t),
  built from the decoded payload, the same values the neighbours decode.
* ``mix_acc``: ``m_i = sum_j w_ij hat_pub_j`` (j in N(i) and j = i), one weighted accumulator:
  3 buffers whatever the degree. W is doubly stochastic, so mixing preserves the members'
  average (up to fp32 rounding).

Step t (``t = rounds_started``) of :meth:`CompressedGossip.step`:

1. start round t: ``q = Q(x - hat_own)``, ``hat_own += D(q)``, non-blocking exchange of q with
   the neighbours (receives posted before sends);
2. apply round ``t - staleness``, waiting for it if needed (:class:`PeerTimeoutError` past
   ``timeout_s``): ``hat_pub += D(q_i)``, ``mix_acc += sum_j w_ij D(q_j)``;
3. mix: ``x += gamma * (mix_acc - hat_pub)``.

With staleness 0 this is synchronous CHOCO-SGD exactly. Round t - staleness is applied at step
t exactly, never earlier, so runs are reproducible bit for bit. Progress while the caller
computes: non-blocking ``isend``/``irecv`` that Gloo's own threads carry out, no thread of ours.

In full: docs/design.md, "CompressedGossip's buffers and step" (and why two copies);
docs/gossip_tuning.md, "The default gamma" (:func:`default_gamma`, from :mod:`.gamma`) and
"Progress while the caller computes: non-blocking operations, not a thread".
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives.errors import CorruptPayloadError, PeerError, PeerTimeoutError
from qcomm.collectives.group import CommGroup
from qcomm.collectives.links import RoundHandle
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import WIRE_FORMAT_VERSION, packed_nbytes
from qcomm.seeds import gossip_message_seed
from qcomm.validation import (
    check_seed,
)

from .clock import StepClock
from .codec import check_state_buffers
from .config import GossipConfig
from .gamma import default_gamma
from .graphs import neighbours
from .integrity import SEAL_NBYTES, bad_messages, seal_
from .member import GossipMember
from .mixing import mixing_matrix

__all__ = ["CompressedGossip", "PeerTimeoutError", "consensus_distance", "default_gamma"]

@dataclass
class _Round:
    """A round in flight: row 0 of ``payloads`` is our own message, rows 1.. the neighbours'
    (each a codec payload followed by its seal, :mod:`.integrity`)."""

    round: int
    payloads: torch.Tensor  # uint8 [K + 1, nbytes + SEAL_NBYTES]
    handle: RoundHandle | None  # None: already received (restored from a state_dict)
    verified: bool = False
    # Our own message's scales are known finite and at most MAX_SCALE (found when it was
    # encoded), so it decodes unchecked; False for a round restored from a state_dict.
    own_bounded: bool = False


def _check_group(group_ranks: object, group: CommGroup) -> tuple[list[int], int]:
    """Validate ``group_ranks`` against ``group``'s members; return (ranks, my member index).

    Raises:
        ValueError: not the group's global ranks in group order. RuntimeError: the group is
            torch.distributed's and it is not initialized.
    """
    if not isinstance(group_ranks, (list, tuple)) or not group_ranks or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in group_ranks):
        raise ValueError(f"group_ranks must be a non-empty list of global ranks, got "
                         f"{group_ranks!r}")
    ranks = list(group_ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"group_ranks must not repeat a rank, got {ranks}")
    actual = group.ranks
    if ranks != actual:
        raise ValueError(f"group_ranks must list the global ranks of the group in group "
                         f"order, {actual}; got {ranks}")
    return ranks, group.rank


def _saved_round(payloads: object, rows: int, message_nbytes: int,
                 device: torch.device | None) -> torch.Tensor:
    """A saved round's messages, uint8 ``[rows, message_nbytes]`` (ours, then the
    neighbours', sealed as received), on ``device`` when given. Rounds decode them without
    checking their layout again, so it is checked here."""
    if not isinstance(payloads, torch.Tensor) or payloads.dtype != torch.uint8:
        raise TypeError(f"state['in_flight'] must hold uint8 tensors, got "
                        f"{getattr(payloads, 'dtype', type(payloads).__name__)}")
    if tuple(payloads.shape) != (rows, message_nbytes):
        raise ValueError(f"a saved round holds messages of shape {tuple(payloads.shape)}; "
                         f"this gossip sends [K, {message_nbytes}] with K = {rows} (its own "
                         f"and one per neighbour)")
    if device is not None and payloads.device != device:
        raise ValueError(f"state['in_flight'] must be on {device} (like the buffers), got "
                         f"{payloads.device}")
    return payloads.contiguous()


class CompressedGossip(GossipMember):
    """Compressed, asynchronous CHOCO gossip of one fp32 vector per member.

    Args:
        group_ranks: global ranks of the gossiping members (a rail), in node order.
        group: their group, which makes the transport: a
            :class:`~qcomm.collectives.group.CommGroup` (an in-memory world's, say), a
            torch.distributed process group, or None = the default group (then
            ``group_ranks`` must be all ranks, in order).
        numel: number of floats each member gossips (its shard), >= 1.
        config: the settings (:class:`~.config.GossipConfig`: graph (a static one; the
            time-varying ``"one-peer-exp"`` is :class:`~.one_peer_choco.OnePeerGossip`'s, which
            :func:`~.factory.build_gossip` picks), mixing, spec, gamma,
            staleness, timeout_s, fragments, round_period, the outer step); None: the
            defaults. ``settings``: keywords that replace its fields.
        stats: counts the bytes this member sends, level ``"inter"``; None = a private one
            (``self.stats``).
        seed: base seed of stochastic rounding, int in [0, 2**64).
        first_step, clock: where the step clock starts, or the clock itself (shared with the
            caller, :class:`~.clock.StepClock`).

    Round t is applied at step t + ``staleness`` (0: synchronous), waited for at most
    ``timeout_s`` (then :class:`PeerTimeoutError`); round t carries fragment ``t % fragments``
    (elements ``[f * numel/F, (f+1) * numel/F)``). The outer step, with ``d = x_f - a_f``
    (``a_f``: the fragment right after its previous mix): ``u = mu u + d; x_f = a_f + lr (d +
    mu u)``, then the mixing; the average of the members moves by the outer step on their
    average progress, and the mixing still preserves it.

    Buffers (fp32 ``[numel]`` x 3 (x 4 with momentum), plus ``staleness + 1`` rounds of uint8
    ``[degree + 1, packed_nbytes(numel / F, spec)]``) are created on the first :meth:`step`, on
    x's device. The constructor runs no collective and no blocking call.
    """

    lockstep = True

    def __init__(self, group_ranks: list[int], group: CommGroup | dist.ProcessGroup | None,
                 numel: int, config: GossipConfig | None = None, *,
                 stats: CommStats | None = None, seed: int = 0, first_step: int = 0,
                 clock: StepClock | None = None, **settings: Any) -> None:
        # hyperparameters (checked with the limits every layer shares, then fixed)
        self._set_hyperparameters(numel, GossipConfig.of(config, settings), stats=stats,
                                  seed=seed, first_step=first_step, clock=clock)

        self.group = resolve_group(group)
        self.group_ranks, self.member = _check_group(group_ranks, self.group)
        n = len(self.group_ranks)
        self.size = n
        self.peers = neighbours(self.graph, self.member, n)
        w = mixing_matrix(self.graph, n, self.mixing).to(torch.float32)
        # Row 0 is our own payload, then the neighbours in `peers` order.
        self._weights = torch.stack([w[self.member, self.member]] +
                                    [w[self.member, p] for p in self.peers])
        self.transport_level = "inter"  # gossip runs between nodes
        self.transport = self.group.transport(self.peers, stats=self.stats,
                                              level=self.transport_level)
        self.nbytes = packed_nbytes(self.fragment_numel, self.spec)
        self.message_nbytes = self.nbytes + SEAL_NBYTES  # what crosses the link per message

        # internal state (buffers lazily, on x's device)
        self.rounds_started = 0
        self.rounds_applied = 0
        self._hat_own: torch.Tensor | None = None
        self._hat_pub: torch.Tensor | None = None
        self._mix_acc: torch.Tensor | None = None
        self._momentum, self._anchor = None, None  # the outer step's (member.py)
        self._scratch: torch.Tensor | None = None
        self._weights_here: torch.Tensor | None = None  # _weights on the buffers' device
        self._in_flight: deque[_Round] = deque()
        self._closed = False

    # -----------------------------------------------------------------------------------------
    # the schedule: the two calls a training loop makes around each local update

    def prepare(self) -> None:
        """Before the local update of a step that ends with a round: wait for and verify the
        round that step applies (:meth:`verify_next`), so that a failure surfaces before
        anything of the step changes."""
        if self.round_due():
            self.verify_next()

    def end_step(self, x: torch.Tensor | None) -> list[int]:
        """After the local update: advance the clock and, when a round is due, run it on
        ``x`` (:meth:`step`; ``x`` may be None when none is due). Returns the fragments of
        ``x`` that changed."""
        due = self.round_due()
        if due:
            self._check_x(x)  # a bad x changes nothing, the clock included
        self.steps += 1
        return self.step(x) if due else []

    # -----------------------------------------------------------------------------------------
    # one round

    def step(self, x: torch.Tensor) -> list[int]:
        """One gossip round on ``x`` (float32 ``[numel]``, contiguous, updated in place).

        Starts round t (fragment ``t % fragments``), applies round ``t - staleness`` (waiting
        for it), mixes that round's fragment. ``x`` is read and written only inside this call,
        never after it returns.

        Returns:
            The fragments of ``x`` that changed (empty while no round is due yet).

        Raises:
            PeerTimeoutError: round ``t - staleness`` did not arrive within ``timeout_s``.
            TypeError, ValueError: ``x`` of the wrong dtype, numel, device or layout.
        """
        self.begin(x)
        return self.finish(x)

    def fragments_read_next(self) -> list[int] | None:
        """The fragments of ``x`` the next :meth:`step` reads: the one its round sends and the
        one it mixes (the round started ``staleness`` rounds before); None when it reads all
        of ``x`` (its first round sets up the buffers from it). A caller that keeps ``x``
        elsewhere need only bring these up to date before the step."""
        if self.size == 1:
            return []
        if self._hat_own is None or (self._outer and self._anchor is None):
            return None
        if not self.round_due():
            return []
        t, due = self.rounds_started, self.rounds_started - self.staleness
        return sorted({t % self.fragments} | ({due % self.fragments} if due >= 0 else set()))

    def _ensure_buffers(self, like: torch.Tensor) -> None:
        if self._hat_own is None:
            z = lambda: torch.zeros(self.numel, dtype=torch.float32, device=like.device)
            self._hat_own, self._hat_pub, self._mix_acc = z(), z(), z()
        if self._scratch is None:
            self._scratch = torch.empty(self.fragment_numel, dtype=torch.float32,
                                        device=like.device)
        if self._outer and self._momentum is None:
            self._momentum = torch.zeros(self.numel, dtype=torch.float32, device=like.device)
            self._anchor = like.detach().clone()  # every fragment's start: x at the first round

    def begin(self, x: torch.Tensor) -> None:
        """Phase 1 of a step: compress fragment ``t % F`` of ``x - hat_own`` and start its
        exchange (non-blocking). The simulator runs every member's phase 1 before any phase 2,
        which staleness 0 needs."""
        x = self._check_x(x)
        t = self.rounds_started
        if self.size == 1:  # a lone member: nothing to agree with, nothing sent
            self.rounds_started += 1
            return
        self._ensure_buffers(x)
        frag = self.fragment(t % self.fragments)
        own = self._hat_own[frag]
        torch.sub(x[frag], own, out=self._scratch)
        payloads = torch.empty(len(self.peers) + 1, self.message_nbytes, dtype=torch.uint8,
                               device=x.device)
        mine = payloads[0, :self.nbytes]
        # Raises NonFiniteError on a NaN/Inf in x before anything is sent or changed.
        bounded = self._codec.encode(self._scratch, mine,
                                     gossip_message_seed(self.seed, t, self.member))
        seal_(payloads[0], t, self.member)
        self._codec.accumulate(mine, own, checked=not bounded)
        handle = self.transport.exchange(t, payloads[0], payloads[1:])
        self._in_flight.append(_Round(t, payloads, handle, own_bounded=bounded))
        self.rounds_started += 1

    def finish(self, x: torch.Tensor) -> list[int]:
        """Phase 2 of a step: apply round ``t - staleness``, then mix its fragment into ``x``.
        Returns the fragments of ``x`` that changed."""
        x = x.view(-1)
        if self.size == 1:
            return []
        due = self.rounds_started - 1 - self.staleness
        while self._in_flight and self._in_flight[0].round <= due:
            self._apply(self._in_flight[0])  # raises before changing anything
            self._in_flight.popleft()
        if due < 0 or self.rounds_applied <= due:
            return []
        f = due % self.fragments
        frag = self.fragment(f)
        self._mix_fragment(x, f, lambda: torch.sub(self._mix_acc[frag], self._hat_pub[frag],
                                                   out=self._scratch), self.gamma)
        return [f]

    def _receive(self, r: _Round) -> None:
        """Wait for round ``r`` and verify every neighbour's message; changes nothing else.

        Raises:
            PeerTimeoutError, PeerLostError: the round did not arrive.
            CorruptPayloadError: a message failed verification (the round stays in flight,
                unapplied).
        """
        if r.verified:
            return
        if r.handle is not None:
            r.handle.wait(self.timeout_s)
            r.handle = None
        bad = bad_messages(r.payloads[1:], r.round, self.peers, self.fragment_numel, self.spec)
        if bad:
            ranks = [self.group_ranks[self.peers[k]] for k, _ in bad]
            reasons = sorted({why for _, why in bad})
            raise CorruptPayloadError(f"gossip round {r.round} (rank "
                                      f"{self.group_ranks[self.member]})", ranks,
                                      self.transport_level, ", ".join(reasons))
        r.verified = True

    def verify_next(self) -> bool:
        """Wait for and verify the rounds the next :meth:`step` will apply, so that a failure
        surfaces before the caller changes anything of its own (its local update). Returns
        True when there were such rounds (none with staleness 0: the next step starts that
        round itself).

        Raises:
            what :meth:`step` would raise for those rounds, with nothing changed.
        """
        due = self.rounds_started - self.staleness
        checked = False
        for r in self._in_flight:
            if r.round > due:
                break
            self._receive(r)
            checked = True
        return checked

    def _apply(self, r: _Round) -> None:
        self._receive(r)  # the neighbours' scales: finite, at most MAX_SCALE
        w = self._weights_here
        if w is None:  # moved to the buffers' device once, not every round
            w = self._weights_here = self._weights.to(self._mix_acc.device)
        frag = self.fragment(r.round % self.fragments)
        body = r.payloads[:, :self.nbytes].contiguous()
        # Our own scales were bounded when encoded; a restored round's are looked at once.
        checked = not (r.own_bounded or self._codec.bounded(body[0]))
        self._codec.accumulate(body[0], self._hat_pub[frag], checked=checked)
        self._codec.accumulate(body, self._mix_acc[frag], w, checked=checked)
        self.rounds_applied = r.round + 1

    def flush(self) -> None:
        """Wait for and apply every round in flight to the public copies (no mixing: x is not
        touched). Call it on every member at the same step, or the public copies differ."""
        while self._in_flight:
            self._apply(self._in_flight[0])
            self._in_flight.popleft()

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def _config(self) -> dict:
        return {**super()._config(),
                **({"fragments": self.fragments} if self.fragments > 1 else {}),
                **({"outer_momentum": self.outer_momentum} if self.outer_momentum else {}),
                **({"outer_lr": self.outer_lr} if self.outer_lr != 1 else {})}

    def state_dict(self) -> dict:
        """Internal state, rounds in flight included (waits until their payloads have arrived,
        without applying them). Tensors are references, like torch's state_dicts.

        Returns:
            ``{"config": {...}, "wire_format": int, "gamma", "seed", "rounds_started",
            "rounds_applied", "hat_own" | "hat_pub" | "mix_acc" | "momentum" | "anchor":
            float32 [numel] or None before the first step (momentum, anchor: without an outer
            step),
            "in_flight": [(round, uint8 [degree + 1, nbytes + 8])]}`` (each row a payload and
            its seal).
        """
        for r in self._in_flight:
            if r.handle is not None:
                r.handle.wait(self.timeout_s)
                r.handle = None
        return {"config": self._config(), "wire_format": WIRE_FORMAT_VERSION,
                "gamma": self.gamma, "seed": self.seed,
                "rounds_started": self.rounds_started, "rounds_applied": self.rounds_applied,
                "hat_own": self._hat_own, "hat_pub": self._hat_pub, "mix_acc": self._mix_acc,
                "momentum": self._momentum, "anchor": self._anchor,
                "in_flight": [(r.round, r.payloads) for r in self._in_flight]}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output (tensors copied, onto the device they were saved on).
        The configuration (numel, members, graph, mixing, staleness, spec) must match; gamma and
        seed are taken from ``state``. Call before :meth:`step` with no round in flight."""
        self._check_saved(state, ("config",))
        # Rounds decode into these buffers and from these messages without checking them
        # again: checked here, all before anything is loaded.
        saved = check_state_buffers(
            state, dict.fromkeys(("hat_own", "hat_pub", "mix_acc", "momentum", "anchor"),
                                 self.numel),
            together=[("hat_own", "hat_pub", "mix_acc"), ("momentum", "anchor")])
        device = None if saved["hat_own"] is None else saved["hat_own"].device
        if state["in_flight"] and device is None:
            raise ValueError("state['in_flight'] holds rounds but state['hat_own'] is None "
                             "(no round was started)")
        in_flight = [(int(r), _saved_round(p, len(self.peers) + 1, self.message_nbytes, device))
                     for r, p in state["in_flight"]]
        copy = lambda t: None if t is None else t.detach().clone()
        self.gamma = float(state["gamma"])
        self.seed = check_seed(state["seed"])
        self.rounds_started = int(state["rounds_started"])
        self.rounds_applied = int(state["rounds_applied"])
        self._hat_own, self._hat_pub = copy(saved["hat_own"]), copy(saved["hat_pub"])
        self._mix_acc = copy(saved["mix_acc"])
        self._momentum = copy(saved["momentum"])
        self._anchor = copy(saved["anchor"])
        self._scratch = None
        self._weights_here = None
        self._in_flight = deque(_Round(r, copy(p), None) for r, p in in_flight)

    def _check_saved(self, state: object, keys: tuple[str, ...]) -> None:
        """What every saved state of this class and its subclasses must be before anything of
        it is read: a dict of :meth:`state_dict` (``keys`` present), of this configuration and
        wire format, loaded with no round of this instance in flight."""
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise ValueError(f"state must be a dict from {type(self).__name__}.state_dict()")
        if state["config"] != self._config():
            raise ValueError(f"state was saved with config {state['config']}, this gossip has "
                             f"{self._config()}")
        if state.get("wire_format") != WIRE_FORMAT_VERSION:
            raise ValueError(f"state holds messages in wire format {state.get('wire_format')}; "
                             f"this version decodes format {WIRE_FORMAT_VERSION}")
        if any(r.handle is not None for r in self._in_flight):
            raise RuntimeError("load_state_dict with rounds of this instance in flight")

    def leave(self) -> None:
        """Apply the rounds in flight when the peers still answer (a peer's failure is
        swallowed: after one this only releases), then :meth:`close`."""
        with contextlib.suppress(PeerError):
            self.flush()
        self.close()

    @classmethod
    def mode_words(cls, config: GossipConfig) -> str:
        return f"staleness {config.staleness}"

    def close(self) -> None:
        """Forget rounds in flight and release the transport. Never blocks, also after a
        :class:`PeerTimeoutError` (the group is unusable then; destroy it)."""
        self._in_flight.clear()
        self.transport.close()
        self._closed = True


def consensus_distance(x: torch.Tensor, group: CommGroup | dist.ProcessGroup | None, *,
                       timeout_s: float | None = None) -> float:
    """``sqrt(mean_i ||x_i - mean_j x_j||^2)`` over the members of ``group``; collective.

    Args:
        x: this member's float tensor (any shape; same numel on every member).
        group: the members' group (a process group, None: the default group).
        timeout_s: how long each of the two all-reduces waits (None: the group's own timeout).

    Computed in float64 (two all-reduces) so that distances far below ``|x|`` are still exact
    enough to test convergence to 1e-3 and beyond.
    """
    g = resolve_group(group)
    n = g.size

    def total(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        all_reduce(t, g, timeout_s=timeout_s, operation="consensus distance")
        return t, n

    return distance_from_sums(x, total)


def distance_from_sums(x: torch.Tensor,
                       total: Callable[[torch.Tensor], tuple[torch.Tensor, int]]) -> float:
    """``sqrt(mean_i ||x_i - mean_j x_j||^2)`` in float64, given ``total(t)``: the sum of a
    tensor over the members (collective; it may use ``t`` as its buffer) and their count."""
    v = x.detach().reshape(-1).to(torch.float64)
    mean, n = total(v.clone())
    mean /= n
    sq, _ = total(torch.sum((v - mean) ** 2).reshape(1))
    return math.sqrt(float(sq) / n)

