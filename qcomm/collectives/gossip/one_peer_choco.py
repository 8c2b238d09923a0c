"""Lockstep CHOCO gossip on the one-peer exponential graph: :class:`OnePeerGossip`.

:class:`~.choco.CompressedGossip` on ``graph="one-peer-exp"`` (:mod:`.schedules`): in round t
member i exchanges one message with ``one_peer_partner(i, t, n)`` only (none when it sits the
round out), so a round costs one message whatever n. The schedule, staleness, fragments,
timeouts, seals and the outer step are CompressedGossip's; what differs is the public copies.
One ``x_hat_i`` mirrored by every neighbour cannot work here (a peer sees only the messages
sent to it), so each link (i, p) keeps its own, changed only by that link's messages:
``fresh[p]`` (compressed against), ``mine[p]`` (x_hat_{i->p} as p knows it) and ``theirs[p]``
(x_hat_{p->i}), float32 ``[numel]`` each, for the at most K = ceil(log2 n) peers ever used:
``3 K`` copies per member. Round t - staleness then mixes ``x += gamma / 2 (theirs[p] -
mine[p])`` on its fragment; p adds the exact negation, so the average is kept.

Every link has its own transport (peers ``[p]``); a checkpoint holds every link's copies and
the rounds in flight. The engine builds it for ``CommOptions(graph="one-peer-exp")`` and for
the graph chosen by the node count (:mod:`.graph_choice`); not yet: the wait-free mode.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives.errors import CorruptPayloadError
from qcomm.collectives.group import CommGroup
from qcomm.collectives.stats import CommStats
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import WIRE_FORMAT_VERSION, packed_nbytes
from qcomm.seeds import gossip_message_seed
from qcomm.validation import check_seed

from .choco import CompressedGossip, _check_group, _Round, _saved_round
from .clock import StepClock
from .codec import check_state_buffers
from .config import GossipConfig
from .integrity import SEAL_NBYTES, bad_messages, seal_
from .schedules import one_peer_gamma, one_peer_partner, one_peer_peers

__all__ = ["OnePeerGossip"]


class OnePeerGossip(CompressedGossip):
    """CompressedGossip's arguments, with ``graph="one-peer-exp"`` (any other graph: ValueError
    naming ``graph``); ``gamma=None`` takes :func:`~.schedules.one_peer_gamma`. ``self.peers``:
    every peer ever used, ascending. Buffers (``3 K + 1`` float32 ``[numel]``, K =
    ``len(self.peers)``) are created at the first round with a partner."""

    time_varying = True

    def __init__(self, group_ranks: list[int], group: CommGroup | dist.ProcessGroup | None,
                 numel: int, config: GossipConfig | None = None, *,
                 stats: CommStats | None = None, seed: int = 0, first_step: int = 0,
                 clock: StepClock | None = None, **settings: Any) -> None:
        config = GossipConfig.of(config, settings)
        self._set_hyperparameters(numel, config, stats=stats, seed=seed, first_step=first_step,
                                  clock=clock)
        if config.gamma is None:
            self.gamma = one_peer_gamma(self.staleness)
        self.group = resolve_group(group)
        self.group_ranks, self.member = _check_group(group_ranks, self.group)
        self.size = n = len(self.group_ranks)
        self.peers = one_peer_peers(self.member, n)
        self.transport_level = "inter"
        # One transport per link: a round exchanges with its partner only.
        self._links = {p: self.group.transport([p], stats=self.stats, level="inter")
                       for p in self.peers}
        self.nbytes = packed_nbytes(self.fragment_numel, self.spec)
        self.message_nbytes = self.nbytes + SEAL_NBYTES
        self.rounds_started = self.rounds_applied = 0
        self.fresh: dict[int, torch.Tensor] = {}
        self.mine: dict[int, torch.Tensor] = {}
        self.theirs: dict[int, torch.Tensor] = {}
        self._hat_own = self._hat_pub = self._mix_acc = None  # CompressedGossip's: unused
        self._momentum, self._anchor = None, None
        self._scratch: torch.Tensor | None = None
        self._in_flight: deque[_Round] = deque()
        self._closed = False

    def partner(self, round: int) -> int | None:
        """This member's peer in ``round``, or None: it sits that round out."""
        return one_peer_partner(self.member, round, self.size, self.fragments)

    def _ensure_buffers(self, like: torch.Tensor) -> None:
        if self._scratch is None:
            z = lambda: torch.zeros(self.numel, dtype=torch.float32, device=like.device)
            for p in self.peers:
                self.fresh[p], self.mine[p], self.theirs[p] = z(), z(), z()
            self._scratch = torch.empty(self.fragment_numel, dtype=torch.float32,
                                        device=like.device)
        if self._outer and self._momentum is None:
            self._momentum = torch.zeros(self.numel, dtype=torch.float32, device=like.device)
            self._anchor = like.detach().clone()

    def _check_x(self, x: object) -> torch.Tensor:
        x = super()._check_x(x)
        if self._scratch is not None and x.device != self._scratch.device:
            raise ValueError(f"x must be on {self._scratch.device} (where the gossip state "
                             f"lives), got {x.device}")
        return x

    def fragments_read_next(self) -> list[int] | None:
        return None  # conservative: every step may read all of x

    def begin(self, x: torch.Tensor) -> None:
        """Phase 1: encode fragment ``t % F`` of ``x - fresh[p]`` and start its exchange with
        the round's partner p (nothing sent when there is none)."""
        x = self._check_x(x)
        t = self.rounds_started
        self.rounds_started += 1
        p = self.partner(t) if self.size > 1 else None
        if p is None:
            self._in_flight.append(_Round(t, torch.empty(0, 0, dtype=torch.uint8), None))
            return
        self._ensure_buffers(x)
        frag = self.fragment(t % self.fragments)
        own = self.fresh[p][frag]
        torch.sub(x[frag], own, out=self._scratch)
        payloads = torch.empty(2, self.message_nbytes, dtype=torch.uint8, device=x.device)
        bounded = self._codec.encode(self._scratch, payloads[0, :self.nbytes],
                                     gossip_message_seed(self.seed, t, self.member))
        seal_(payloads[0], t, self.member)
        self._codec.accumulate(payloads[0, :self.nbytes], own, checked=not bounded)
        handle = self._links[p].exchange(t, payloads[0], payloads[1:])
        self._in_flight.append(_Round(t, payloads, handle, own_bounded=bounded))

    def _receive(self, r: _Round) -> None:
        p = self.partner(r.round)
        if r.verified or p is None:
            r.verified = True
            return
        if r.handle is not None:
            r.handle.wait(self.timeout_s)
            r.handle = None
        bad = bad_messages(r.payloads[1:], r.round, [p], self.fragment_numel, self.spec)
        if bad:
            raise CorruptPayloadError(f"gossip round {r.round} (rank "
                                      f"{self.group_ranks[self.member]})",
                                      [self.group_ranks[p]], self.transport_level,
                                      ", ".join(sorted({why for _, why in bad})))
        r.verified = True

    def _apply(self, r: _Round) -> None:
        self._receive(r)
        self.rounds_applied = r.round + 1
        p = self.partner(r.round)
        if p is None:
            return
        frag = self.fragment(r.round % self.fragments)
        body = r.payloads[:, :self.nbytes]
        self._codec.accumulate(body[0], self.mine[p][frag], checked=not r.own_bounded)
        self._codec.accumulate(body[1], self.theirs[p][frag])  # verified: bounded scales

    def finish(self, x: torch.Tensor) -> list[int]:
        """Phase 2: apply round ``t - staleness`` and mix its fragment with that round's
        partner's copies. Returns the fragments of ``x`` that changed."""
        x = x.view(-1)
        due = self.rounds_started - 1 - self.staleness
        while self._in_flight and self._in_flight[0].round <= due:
            self._apply(self._in_flight[0])
            self._in_flight.popleft()
        p = self.partner(due) if due >= 0 and self.size > 1 else None
        if p is None or self.rounds_applied <= due:
            return []
        f = due % self.fragments
        frag = self.fragment(f)
        self._mix_fragment(x, f, lambda: torch.sub(self.theirs[p][frag], self.mine[p][frag],
                                                   out=self._scratch), self.gamma / 2)
        return [f]

    def state_dict(self) -> dict:
        """Internal state, rounds in flight included (waits until their payloads have arrived,
        without applying them). Tensors are references, like torch's state_dicts.

        Returns:
            ``{"config", "wire_format", "gamma", "seed", "rounds_started", "rounds_applied",
            "links": {peer: {"fresh", "mine", "theirs": float32 [numel]}} (empty before the
            first round with a partner), "momentum" | "anchor": float32 [numel] or None,
            "in_flight": [(round, uint8 [2, nbytes + 8], or [0, 0] for a round sat out)]}``.
        """
        for r in self._in_flight:
            if r.handle is not None:
                r.handle.wait(self.timeout_s)
                r.handle = None
        links = {p: {"fresh": self.fresh[p], "mine": self.mine[p], "theirs": self.theirs[p]}
                 for p in self.fresh}
        return {"config": self._config(), "wire_format": WIRE_FORMAT_VERSION,
                "gamma": self.gamma, "seed": self.seed,
                "rounds_started": self.rounds_started, "rounds_applied": self.rounds_applied,
                "links": links, "momentum": self._momentum, "anchor": self._anchor,
                "in_flight": [(r.round, r.payloads) for r in self._in_flight]}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output (tensors copied). The configuration must match, the
        links be this member's peers; everything is checked before anything is loaded. Call
        before :meth:`step` with no round in flight."""
        self._check_saved(state, ("config", "links"))
        links = state["links"]
        if not isinstance(links, dict) or (links and sorted(links) != self.peers):
            raise ValueError(f"state['links'] must hold this member's peers {self.peers} (or "
                             f"none before its first round), got {sorted(links)}")
        # One flat view, so that the codec's checks name each buffer and keep them together.
        flat = {f"{k}/{p}": t for p, per in links.items() for k, t in per.items()}
        flat.update(momentum=state.get("momentum"), anchor=state.get("anchor"))
        names = [f"{k}/{p}" for p in self.peers for k in ("fresh", "mine", "theirs")]
        saved = check_state_buffers(
            flat, dict.fromkeys((*names, "momentum", "anchor"), self.numel),
            together=[tuple(names), ("momentum", "anchor")])
        device = saved[names[0]].device if links else None
        in_flight = []
        for r, p in state["in_flight"]:
            rows = 2 if self.partner(int(r)) is not None and self.size > 1 else 0
            if rows and device is None:
                raise ValueError("state['in_flight'] holds a round with a partner but "
                                 "state['links'] is empty (no such round was started)")
            in_flight.append((int(r), _saved_round(p, rows, self.message_nbytes if rows else 0,
                                                   device if rows else None)))
        copy = lambda t: None if t is None else t.detach().clone()
        self.gamma = float(state["gamma"])
        self.seed = check_seed(state["seed"])
        self.rounds_started = int(state["rounds_started"])
        self.rounds_applied = int(state["rounds_applied"])
        self.fresh = {p: copy(saved[f"fresh/{p}"]) for p in links}
        self.mine = {p: copy(saved[f"mine/{p}"]) for p in links}
        self.theirs = {p: copy(saved[f"theirs/{p}"]) for p in links}
        self._momentum, self._anchor = copy(saved["momentum"]), copy(saved["anchor"])
        self._scratch = None if not links else torch.empty(
            self.fragment_numel, dtype=torch.float32, device=device)
        self._in_flight = deque(_Round(r, copy(p), None) for r, p in in_flight)

    def close(self) -> None:
        """Forget rounds in flight and release every link's transport. Never blocks."""
        self._in_flight.clear()
        for link in self._links.values():
            link.close()
        self._closed = True
