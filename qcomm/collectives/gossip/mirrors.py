"""The paired mixing's books: the own messages sent, each link's last messages applied, and the
mirror terms owed.

Each term a wait-free member adds with a neighbour's copy compares it with its own copy at a
version; the neighbour, when that message arrives, adds the mirror: the same two copies, the
other way round (its own copy at the ack, the sender's copy at the version). So the mixing
moves no mass between members whatever their paces. To rebuild those versions a member keeps
its own messages until every live neighbour's ack has passed them, and each link's last
``kept`` messages; a mirror owed waits in ``owed`` until the fragment's next round adds it.
"""

from __future__ import annotations

from collections import deque

import torch

from .codec import GossipCodec
from .member import fragment_slice

__all__ = ["MirrorLedger"]

Verified = tuple[int, torch.Tensor, tuple[int, int, int]]  # (round, message, ack fields)


class MirrorLedger:
    """Mirror terms of one wait-free member (module docstring).

    Args:
        codec: the gossip's codec (decodes a fragment's payloads).
        fragments, fragment_numel: the gossiped vector's fragments and their length.
        kept: messages kept per link, and own ones at least (``staleness + fragments``).
        links: links to start with.
    """

    def __init__(self, codec: GossipCodec, fragments: int, fragment_numel: int, kept: int,
                 links: int) -> None:
        self._codec, self.nbytes = codec, codec.nbytes
        self.fragments, self.fragment_numel, self.kept = fragments, fragment_numel, kept
        self.owed: torch.Tensor | None = None     # mirror terms not added yet (weighted)
        self.owed_fragments: set[int] = set()     # the fragments where owed is not zero
        # Sent and not yet acknowledged by every live neighbour: (round, message, its scales
        # known finite and at most MAX_SCALE, so it decodes unchecked; False for one restored
        # from a state_dict).
        self.own_sent: deque[tuple[int, torch.Tensor, bool]] = deque()
        # Per link, its last messages applied (round, codec bytes).
        self.recent: list[deque[tuple[int, torch.Tensor]]] = [deque() for _ in range(links)]

    def add_link(self) -> None:
        self.recent.append(deque())

    def applied(self, k: int, messages: list[tuple[int, torch.Tensor]]) -> None:
        """Link k's messages (round, codec bytes) were applied to its copy."""
        self.recent[k].extend(messages)
        while len(self.recent[k]) > self.kept:
            self.recent[k].popleft()

    def owe(self, k: int, f: int, terms: list[tuple[int, int]], msgs: list[Verified],
            copy: torch.Tensor, hat_own: torch.Tensor, edge_weight: float) -> None:
        """Owe the mirrors of neighbour k's terms on fragment f, each of which compared its copy
        of this member as it held this member's rounds below the ack with its own copy as it
        held its rounds below the version: ``w/2 * sum over the terms of (copy_k[f] at version
        - hat_own[f] at ack)``. Summed in one pass: with n terms, ``n (copy_k[f] - hat_own[f])``
        plus each message of f weighted by how many terms' versions hold it, less each earlier
        one by how many do not, plus each own message of f by how many acks do not hold it.

        Args:
            terms: (version, ack) of each term.
            msgs: the messages being applied (not yet in the copy).
            copy, hat_own: fragment f of k's copy and of this member's fresh copy.
        """
        n = len(terms)
        total = torch.sub(copy, hat_own)
        if n > 1:
            total.mul_(n)
        # the sender's messages: those being applied that a version holds, the earlier ones
        # already in the copy that a version does not
        weighted = [(b[:self.nbytes], sum(v > r for v, _ in terms))
                    for r, b, _ in msgs if r % self.fragments == f]
        weighted += [(b, -sum(v <= r for v, _ in terms))
                     for r, b in self.recent[k] if r % self.fragments == f]
        self._accumulate_counts(total, weighted, n, checked=False)
        # this member's own messages an ack does not hold
        own = [(m[:self.nbytes], sum(a <= r for _, a in terms), bounded)
               for r, m, bounded in self.own_sent if r % self.fragments == f]
        self._accumulate_counts(total, [(b, c) for b, c, _ in own], n,
                                checked=not all(ok for *_, ok in own))
        self.owed[fragment_slice(f, self.fragment_numel)].add_(total, alpha=0.5 * edge_weight)
        self.owed_fragments.add(f)

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

    def own_at(self, hat_own: torch.Tensor, f: int, version: int) -> torch.Tensor:
        """The own copy of fragment f at ``version`` (holding the own rounds below it): a new
        tensor, ``hat_own[f]`` less the own messages of f from that round on."""
        out = hat_own.clone()
        later = [(m[:self.nbytes], bounded) for r, m, bounded in self.own_sent
                 if r >= version and r % self.fragments == f]
        if later:
            minus = torch.full((len(later),), -1.0, dtype=torch.float32, device=out.device)
            self._codec.accumulate(torch.stack([b for b, _ in later]), out, minus,
                                   checked=not all(ok for _, ok in later))
        return out

    def pay(self, x: torch.Tensor, anchor: torch.Tensor | None, gamma: float) -> set[int]:
        """Add the mirror terms owed to their fragments of ``x`` (and of the outer step's
        ``anchor``: a correction is not progress of the fragment); the fragments changed."""
        paid = self.owed_fragments
        for f in paid:
            frag = fragment_slice(f, self.fragment_numel)
            x[frag].add_(self.owed[frag], alpha=gamma)
            if anchor is not None:
                anchor[frag].add_(self.owed[frag], alpha=gamma)
            self.owed[frag].zero_()
        self.owed_fragments = set()
        return paid

    def settle(self, x: torch.Tensor, gamma: float) -> None:
        """Add every mirror term owed to ``x`` (float32 ``[numel]``, in place) at once."""
        if self.owed is not None:
            x.view(-1).add_(self.owed.to(x.device), alpha=gamma)
            self.owed.zero_()
        self.owed_fragments = set()

    def forget_acknowledged(self, oldest_ack: int, rounds: int) -> None:
        """Drop the own messages every live neighbour's ack has passed (``oldest_ack``: the
        fewest own rounds one held) and that no own term will rebuild its version from (the
        last ``kept`` of the ``rounds`` sent stay)."""
        oldest = min(oldest_ack, rounds - self.kept)
        while self.own_sent and self.own_sent[0][0] < oldest:
            self.own_sent.popleft()

    def state(self, links: list[int]) -> dict:
        return {"recent": [[(r, b.clone()) for r, b in self.recent[k]] for k in links],
                "own_sent": [(r, m.clone()) for r, m, _ in self.own_sent],
                "owed_fragments": sorted(self.owed_fragments), "owed": self.owed}

    def restore(self, own_sent: list[tuple[int, torch.Tensor]],
                recent: list[list[tuple[int, torch.Tensor]]], owed: torch.Tensor | None,
                owed_fragments: list[int]) -> None:
        """Restore a checked saved :meth:`state` (tensors already copied)."""
        self.own_sent = deque((r, m, False) for r, m in own_sent)
        self.recent = [deque(h) for h in recent]
        self.owed = owed
        self.owed_fragments = {int(f) for f in owed_fragments}
