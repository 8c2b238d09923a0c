"""Each neighbour's public copy as a wait-free member holds it, and the messages on their way
into it: taken from the streams, verified in order, sorted into rounds to apply, drain markers
and hellos, and applied.

Each message is taken to be its sender's next round (what it is, unless a marker comes first),
and verified with one host read per device for all the messages waiting; a failure or a marker
switches to one by one (the rounds after it shift). A message that fails stays in its box.
Applying a neighbour's messages first owes the mirrors of the terms its sender added with this
member's copy (:mod:`.mirrors`), then decodes them into the copy, per fragment in one decode
whatever their number (a slow member takes many at a time, and its time per message must not
grow with its lag).

During a drain nothing a neighbour sent after its marker of that drain is applied: it waits in
its box until the drain is over (:meth:`NeighbourCopies.cut_at`). A neighbour that passed the
drain first goes on and sends rounds while this member still waits for another's marker;
applied, they made the saved state hold rounds its sender's own state had not sent yet, and a
run resumed from the two expected rounds the sender then sent again (a failed verification).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerError
from qcomm.collectives.links import MessageStreams, take_through_goodbye

from .codec import GossipCodec
from .integrity import bad_messages, judge, message_facts
from .member import fragment_slice
from .membership import Membership
from .mirrors import MirrorLedger, Verified
from .pace import TermCounter

__all__ = ["NeighbourCopies", "link_rows"]


def link_rows(members: Membership, codec: GossipCodec, fragments: int, kept: int,
              level: str) -> tuple[NeighbourCopies, TermCounter, MirrorLedger]:
    """A wait-free member's per-link state, new, for the links ``members`` holds now: the
    neighbours' copies, the terms per copy and the mirror books (keeping ``kept`` own
    messages)."""
    links = len(members.links)
    return (NeighbourCopies(members, codec, fragments, level), TermCounter(fragments, links),
            MirrorLedger(codec, fragments, codec.numel, kept, links))


class NeighbourCopies:
    """Per link k: the neighbour's copy (``copies[k]``, float32 ``[numel]``, created at the
    first message or hello), its messages applied (``received[k]``), the own rounds it held
    when it last mixed (``acked[k]``), its messages taken and not yet verified (``boxes[k]``)
    and those verified and not yet applied (``pending[k]``: round, message, ack fields).

    Args:
        members: the member's links (which are live and greeted; markers are counted there).
        codec: the gossip's codec; ``fragments``: of the gossiped vector.
        level: the link level named in errors.
    """

    def __init__(self, members: Membership, codec: GossipCodec, fragments: int,
                 level: str) -> None:
        self.members, self._codec, self.fragments, self.level = members, codec, fragments, level
        self.fragment_numel, self.spec = codec.numel, codec.spec
        links = len(members.links)
        self.copies: torch.Tensor | None = None   # [links, numel]
        self.received = [0] * links
        # The most rounds a neighbour is known to have started, over every link ever held (a
        # lost neighbour does not take it back): the job's progress (WaitFreeGossip.progress).
        self.furthest = 0
        self.acked = [0] * links
        self.boxes: list[deque[torch.Tensor]] = [deque() for _ in range(links)]
        self.pending: list[list[Verified]] = [[] for _ in range(links)]
        self.cut: int | None = None   # the drain in progress (markers sent), None: none
        self.goodbyes: set[int] = set()   # links whose goodbye the last take found (take)

    @contextmanager
    def cut_at(self, drains: int) -> Iterator[None]:
        """While the body runs (a drain's wait, ``drains`` markers sent), what comes after a
        neighbour's marker of that drain stays in its box (module docstring)."""
        self.cut = drains
        try:
            yield
        finally:
            self.cut = None

    def ensure(self, numel: int, device: torch.device) -> None:
        if self.copies is None:
            self.copies = torch.zeros(len(self.received), numel, dtype=torch.float32,
                                      device=device)

    def add_link(self, acked: int) -> None:
        """A new link, its neighbour's copy to come with its hello (holding ``acked`` of this
        member's rounds)."""
        self.received.append(0)
        self.acked.append(acked)
        self.boxes.append(deque())
        self.pending.append([])
        if self.copies is not None:
            self.copies = torch.cat([self.copies, self.copies.new_zeros(1, self.copies.shape[1])])

    def forget(self, k: int) -> None:
        """Link k was dropped: nothing of it is applied."""
        self.boxes[k].clear()
        self.pending[k] = []

    def greet(self, k: int, rounds: int, copy: torch.Tensor) -> None:
        """Link k's hello: the neighbour's copy, holding its ``rounds`` rounds."""
        self.copies[k].copy_(copy)
        self.received[k] = rounds
        self.furthest = max(self.furthest, rounds)

    def restore(self, received: list[int], acked: list[int], copies: torch.Tensor | None,
                furthest: int = 0) -> None:
        """A saved state's (after a drain: nothing in flight)."""
        self.received, self.acked, self.copies = received, acked, copies
        self.furthest = max([furthest, *received])
        self.boxes = [deque() for _ in received]
        self.pending = [[] for _ in received]

    def rounds_received(self) -> dict[int, int]:
        """Per live neighbour (its global rank), its rounds applied here."""
        return {self.members.links[k].rank: self.received[k] for k in self.members.live_links()}

    def lag_after(self, t: int) -> int:
        """How far behind round t the rounds applied of the links mixed over lag at most."""
        return max((t + 1 - self.received[k] for k in self.members.mixable()), default=0)

    def take(self, streams: MessageStreams) -> list[tuple[int, PeerError]]:
        """Move what arrived on the live links into the boxes; the links that failed. The
        links whose goodbye came with all that their peer sent before it are in
        :attr:`goodbyes` until the next take (:func:`~qcomm.collectives.links.
        take_through_goodbye`: closed on them, nothing is left behind)."""
        failures = []
        self.goodbyes = set()
        for k in self.members.live_links():
            msgs, err, ended = take_through_goodbye(streams, k)
            self.boxes[k].extend(msgs)
            if ended:
                self.goodbyes.add(k)
            if err is not None:
                failures.append((k, err))
        return failures

    def _next_round(self, k: int) -> int:
        return self.received[k] + len(self.pending[k])

    def _verdicts(self) -> dict[int, list[tuple[str | None, tuple[int, int, int]]]]:
        """Per link, for each message waiting in a live, greeted box taken as its sender's
        next round: ``(None, ack fields)`` when it passes, else ``(why it fails, ...)``."""
        links = self.members.links
        facts: dict[torch.device, list[torch.Tensor]] = {}
        where: dict[torch.device, list[tuple[int, int, int]]] = {}  # (link, round, sender)
        for k, box in enumerate(self.boxes):
            if not (box and links[k].live and links[k].greeted):
                continue
            expected = self._next_round(k)
            for i, m in enumerate(box):
                facts.setdefault(m.device, []).append(torch.cat([
                    message_facts(m.view(1, -1), self.fragment_numel, self.spec),
                    self.members.layout.ack_field(m).view(3, 1)]))
                where.setdefault(m.device, []).append((k, expected + i, links[k].peer))
        verdicts: dict[int, list[tuple[str | None, tuple[int, int, int]]]] = {}
        for device, rows in facts.items():
            links, rounds, senders = zip(*where[device], strict=True)
            table = torch.cat(rows, dim=1).tolist()
            bad = dict(judge(table[:4], rounds, senders))
            for j, k in enumerate(links):
                verdicts.setdefault(k, []).append(
                    (bad.get(j), (table[4][j], table[5][j], table[6][j])))
        return verdicts

    def sort(self, failures: list[tuple[int, PeerError]],
             hello: Callable[[int, int, torch.Tensor], None],
             retired: Callable[[int], None]) -> None:
        """Verify the boxes' messages in order: rounds go to ``pending``, markers are counted
        (and the lost members they name learnt), a hello's vectors are taken (an error is
        added to ``failures``) and passed to ``hello(k, rounds, copy)``, which sets up the
        neighbour's ``copy`` (float32 ``[numel]``, holding its ``rounds``), a retire to
        ``retired(k)`` (the gossip's membership answers it; the link closes once what came
        before it is applied).

        Raises:
            CorruptPayloadError: at the first message that fails (it stays in its box).
        """
        members, verdicts = self.members, self._verdicts()
        for k, box in enumerate(self.boxes):
            link = members.links[k]
            batch, taken = verdicts.get(k, []), 0  # the verdicts hold while rounds pass
            while box and link.live and (self.cut is None or link.markers < self.cut):
                m = box[0]
                if taken < len(batch) and batch[taken][0] is None:
                    self.pending[k].append((self._next_round(k), m, batch[taken][1]))
                    box.popleft()
                    taken += 1
                    continue
                batch = []  # a failure or a marker: one by one from here (rounds may shift)
                if not link.greeted:
                    if not members.is_hello(k, m):
                        raise self._corrupt(k, "its first message", "not a hello")
                    box.popleft()
                    got = members.take_hello(k)
                    if isinstance(got, PeerError):
                        failures.append((k, got))
                        break
                    hello(k, *got)
                    continue
                expected = self._next_round(k)
                bad = bad_messages(m.view(1, -1), expected, [link.peer], self.fragment_numel,
                                   self.spec)
                if bad and members.is_marker(k, m):
                    # (a marker is looked for only when not the next round: rounds are common)
                    box.popleft()
                    continue
                if bad and members.is_retire(k, m):   # the stream's last message
                    box.popleft()
                    retired(k)
                    break
                if bad:
                    raise self._corrupt(k, f"round {expected}", bad[0][1] + (
                        "" if bad[0][1] != "checksum" else
                        " (corrupted, or not the next round of this sender)"))
                self.pending[k].append((expected, m, tuple(members.layout.ack_field(m).tolist())))
                box.popleft()

    def apply(self, ledger: MirrorLedger, hat_own: torch.Tensor, edge_weight: float) -> None:
        """Apply every verified message to its sender's copy, owing (``ledger``) the mirror of
        each term its sender added with this member's copy ``hat_own`` (module docstring)."""
        fragment = lambda f: fragment_slice(f, self.fragment_numel)
        for k, msgs in enumerate(self.pending):
            if not msgs:
                continue
            # mirrors first, from the copy as it was before these messages
            mirrors: dict[int, list[tuple[int, int]]] = {}   # fragment -> [(version, ack)]
            for _, _, (ack, mixed, version) in msgs:
                if ack > 0 and 0 < mixed <= self.fragments:
                    mirrors.setdefault(mixed - 1, []).append((version, ack - 1))
                    self.acked[k] = max(self.acked[k], ack - 1)
            for f, terms in mirrors.items():
                ledger.owe(k, f, terms, msgs, self.copies[k, fragment(f)], hat_own[fragment(f)],
                           edge_weight)
            by_fragment: dict[int, list[torch.Tensor]] = {}
            for r, m, _ in msgs:
                by_fragment.setdefault(r % self.fragments, []).append(m[:ledger.nbytes])
            for f, bodies in by_fragment.items():
                # verified: finite scales at most MAX_SCALE, so decoded unchecked (.codec)
                self._codec.accumulate(torch.stack(bodies), self.copies[k, fragment(f)])
            ledger.applied(k, [(r, m[:ledger.nbytes]) for r, m, _ in msgs])
            self.received[k] += len(msgs)
            self.furthest = max(self.furthest, self.received[k])
            self.pending[k] = []

    def oldest_ack(self, default: int) -> int:
        """The fewest own rounds a live neighbour held when it last mixed (``default`` when
        none is live)."""
        return min((self.acked[k] for k in self.members.live_links()), default=default)

    def _corrupt(self, k: int, what: str, why: str) -> CorruptPayloadError:
        rank = self.members.links[k].rank
        return CorruptPayloadError(
            f"gossip stream from rank {rank} (rank {self.members.rank}), {what}", [rank],
            self.level, why)
