"""CHOCO gossip on a time-varying one-peer graph, simulated in memory: :class:`OnePeerMember`.

The static members (:class:`~qcomm.collectives.gossip.CompressedGossip`,
:class:`~qcomm.collectives.gossip.WaitFreeGossip`) keep one public copy ``x_hat_i`` that every
static neighbour mirrors. On ``"one-peer-exp"`` (:mod:`qcomm.collectives.gossip.schedules`) a
node talks to one peer per round, a different one each round, so a peer's mirror of one shared
``x_hat_i`` would miss every message sent to the other peers: the two ends of a link would mix
with different copies and the mixing would stop preserving the average. Here each *link* keeps
its own copies, changed only by the messages on that link, so both ends always hold the same
bits.

The members exchange through a shared dict (the :class:`OnePeerBoard`): no transport, no
seal check, in one process, driven by :class:`~.simulate.GossipSimulator`. The reference for
the lockstep :class:`~qcomm.collectives.gossip.one_peer_choco.OnePeerGossip` (the same bits,
tested), which it predates; it also gossips uncompressed (``spec=None``).
"""

from __future__ import annotations

from collections import deque

import torch

from qcomm.collectives.gossip.codec import GossipCodec
from qcomm.collectives.gossip.integrity import SEAL_NBYTES, seal_
from qcomm.collectives.gossip.options import check_gamma, check_staleness
from qcomm.collectives.gossip.schedules import (
    ONE_PEER_GAMMA,
    live_partner,
    one_peer_gamma,
    one_peer_peers,
)
from qcomm.collectives.stats import CommStats
from qcomm.compress import QuantSpec
from qcomm.seeds import gossip_message_seed
from qcomm.validation import check_int, check_seed

__all__ = ["ONE_PEER_GAMMA", "OnePeerBoard", "OnePeerMember"]


OnePeerBoard = dict[tuple[int, int], torch.Tensor]
"""The messages posted and not yet taken: ``(round, sender) -> message`` (each has one
reader: the sender's partner in that round)."""


class OnePeerMember:
    """Member ``member`` of ``n`` in CHOCO gossip (Koloskova et al. 2019) on ``"one-peer-exp"``.

    Args:
        member, n: this member's index and the group's size.
        numel: floats gossiped, >= 1.
        board: the members' shared :data:`OnePeerBoard`.
        spec: the codec of every message, or None: no compression (the message is ``x`` in
            fp32 and the copies are set to it, so each copy equals the x it was sent from:
            CHOCO with the identity operator).
        gamma: consensus step in (0, 1]; None:
            :func:`~qcomm.collectives.gossip.schedules.one_peer_gamma`.
        staleness: tau >= 0: round t is applied at round t + tau.
        seed: base seed of stochastic rounding.
        stats: counts the bytes sent (level ``"inter"``): one message of
            ``packed_nbytes + 8`` (payload and seal) per round with a partner.

    Per link (i, p), for every p in :func:`~qcomm.collectives.gossip.schedules.one_peer_peers`
    (at most K = ceil(log2 n)), member i keeps three float32 ``[numel]`` copies:

    * ``fresh[p]``: x_hat_{i->p} with every message to p encoded so far; compressing against
      it (``q = Q(x - fresh[p])``, ``fresh[p] += D(q)``) is CHOCO's error feedback;
    * ``mine[p]``: x_hat_{i->p} as p knows it (messages applied); the same bits as p's
      ``theirs[i]``, built from the same payloads in the same order;
    * ``theirs[p]``: x_hat_{p->i}, from p's messages.

    Memory per member: ``3 K`` copies of ``[numel]`` float32 (K = 10 at n = 1024), created at
    the first round, against 3 whatever the degree for the static CHOCO member; plus
    ``staleness + 1`` of its own messages in flight. (When staleness < K a link's next message
    is encoded after its previous one was applied, so ``fresh`` and ``mine`` hold the same
    values and a wired member could keep 2 K.)

    Round t: with ``p = live_partner(i, t, self.live)`` (None: no message, nothing applied;
    :meth:`set_live` drops lost members from the schedule, and a link new to either end starts
    its copies from zero at both),
    :meth:`begin` encodes and posts ``q``; :meth:`finish` applies round ``t - tau``:
    ``mine[p] += D(q_i)``, ``theirs[p] += D(q_p)``, then ``x += gamma / 2 (theirs[p] -
    mine[p])``. Partner p adds ``gamma / 2`` times the same difference negated (the same two
    copies, swapped; a float subtraction negates exactly), so the pair's sum, and the
    members' average, is preserved up to the rounding of the two additions to x.
    """

    graph = "one-peer-exp"

    def __init__(self, member: int, n: int, numel: int, board: OnePeerBoard, *,
                 spec: QuantSpec | None = QuantSpec(4, 128, "stochastic"),  # noqa: B008 (frozen)
                 gamma: float | None = None, staleness: int = 1, seed: int = 0,
                 stats: CommStats | None = None) -> None:
        self.size = check_int("n", n, low=1)
        self.member = check_int("member", member, low=0, high=n, high_open=True)
        self.numel = check_int("numel", numel, low=1)
        self.staleness = check_staleness(staleness)
        self.seed = check_seed(seed)
        self.spec = spec
        self._codec = None if spec is None else GossipCodec(spec, self.numel)
        gamma = check_gamma(gamma)
        self.gamma = one_peer_gamma(self.staleness, spec is not None) if gamma is None else gamma
        self.board = board
        self.stats = stats if stats is not None else CommStats()
        self.peers = one_peer_peers(self.member, self.size)
        self.live = list(range(self.size))   # the members the schedule runs over
        payload = self.numel * 4 if self._codec is None else self._codec.nbytes
        self.message_nbytes = payload + SEAL_NBYTES
        self.rounds_started = 0
        self.rounds_applied = 0
        self.fresh: dict[int, torch.Tensor] = {}
        self.mine: dict[int, torch.Tensor] = {}
        self.theirs: dict[int, torch.Tensor] = {}
        self._in_flight: deque[tuple[int, int | None, torch.Tensor | None]] = deque()
        self._scratch: torch.Tensor | None = None

    def _check_x(self, x: object) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise TypeError(f"x must be a float32 torch.Tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.numel() != self.numel or not x.is_contiguous():
            raise ValueError(f"x must be contiguous with numel {self.numel}, got "
                             f"{tuple(x.shape)}")
        return x.view(-1)

    def set_live(self, live: list[int]) -> None:
        """From the next round on, the schedule runs over ``live`` (ascending member numbers,
        this member among them): every live member is told the same list at the same round.
        A round in flight with a member no longer live is dropped (its mirror will never be
        added, so neither is its term: the live members' sum is kept)."""
        live_partner(self.member, 0, live)   # checks live
        self.live = list(live)

    def _ensure_buffers(self, x: torch.Tensor, p: int) -> None:
        z = lambda: torch.zeros(self.numel, dtype=torch.float32, device=x.device)
        if self._scratch is None:
            for q in self.peers:
                self.fresh[q], self.mine[q], self.theirs[q] = z(), z(), z()
            self._scratch = z()
        if p not in self.fresh:   # a peer of the schedule over the live members only
            self.fresh[p], self.mine[p], self.theirs[p] = z(), z(), z()

    def _publish(self, message: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy += D(message)`` (a codec message), or ``copy = message`` (an fp32 one)."""
        body = message[:-SEAL_NBYTES]
        if self._codec is None:
            copy.copy_(body.view(torch.float32))
        else:  # checked decode unless the scales are bounded (one host read; a simulation)
            self._codec.accumulate(body, copy, checked=not self._codec.bounded(body))

    def begin(self, x: torch.Tensor) -> None:
        """Phase 1 of round t: encode ``x`` against this link's fresh copy and post it for
        the round's partner (nothing when this member sits the round out)."""
        x = self._check_x(x)
        t = self.rounds_started
        self.rounds_started += 1
        p = live_partner(self.member, t, self.live)
        if p is None:
            self._in_flight.append((t, None, None))
            return
        self._ensure_buffers(x, p)
        message = torch.empty(self.message_nbytes, dtype=torch.uint8, device=x.device)
        if self._codec is None:
            message[:-SEAL_NBYTES].view(torch.float32).copy_(x)
        else:
            torch.sub(x, self.fresh[p], out=self._scratch)
            # Raises NonFiniteError on a NaN/Inf in x before anything is posted or changed.
            self._codec.encode(self._scratch, message[:-SEAL_NBYTES],
                               gossip_message_seed(self.seed, t, self.member))
        seal_(message, t, self.member)
        self._publish(message, self.fresh[p])
        self.board[(t, self.member)] = message
        self.stats.record("inter", self.message_nbytes)
        self._in_flight.append((t, p, message))

    def finish(self, x: torch.Tensor) -> None:
        """Phase 2: apply round ``t - staleness`` (its partner's message must be posted: the
        simulator runs every member's :meth:`begin` first) and mix it into ``x``."""
        x = self._check_x(x)
        due = self.rounds_started - 1 - self.staleness
        while self._in_flight and self._in_flight[0][0] <= due:
            r, p, message = self._in_flight.popleft()
            self.rounds_applied = r + 1
            if p is None:
                continue
            if p not in self.live:   # lost: its message and the one it will never read go
                self.board.pop((r, p), None)
                self.board.pop((r, self.member), None)
                continue
            self._publish(message, self.mine[p])
            self._publish(self.board.pop((r, p)), self.theirs[p])
            torch.sub(self.theirs[p], self.mine[p], out=self._scratch)
            x.add_(self._scratch, alpha=self.gamma / 2)

    def public_copies(self) -> int:
        """float32 ``[numel]`` copies this member holds (3 per peer ever used), 0 before its
        first round."""
        return len(self.fresh) + len(self.mine) + len(self.theirs)
