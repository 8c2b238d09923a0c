"""The pace of the wait-free mixing: which fragment a round mixes, and how many terms a member
may add with one neighbour's copy before it changes.

Each term a member adds with a neighbour's copy owes that neighbour a mirror. A member n times
faster than its neighbour would otherwise add a term every round of its own with the same stale
copy and owe the slow one n mirrors per round of that one's; with ``n gamma w / 2`` past 1 the
pair's difference grows instead of shrinking (a member 20 times faster at gamma 0.3 on a ring).
So a neighbour's copy of a fragment serves at most m terms until a new message of that fragment
changes it, with ``degree (m + 1) gamma w / 2 <= 1/2``: the slow member's own terms and the
mirrors its fast neighbours owe it then move it by at most half the way per round, whatever
the paces, and nobody waits. Both ends count the same terms (the acks name them).
"""

from __future__ import annotations

__all__ = ["TermCounter", "fragment_to_mix", "held"]


def fragment_to_mix(t: int, staleness: int, fragments: int, lag: int) -> tuple[int, int] | None:
    """What round t mixes: the fragment of round ``t - s`` and the own copy holding the rounds
    up to it (version ``t - s + 1``), where s is the smallest lag, at least ``staleness``, at
    which every neighbour mixed with has sent its round ``t - s`` and that round has arrived
    (``lag``: the largest ``t + 1 - rounds applied`` over them; then both copies of a term
    hold the same rounds of the fragment); at most ``staleness + fragments - 1``. None before
    round ``staleness``."""
    if t < staleness:
        return None
    s = min(max(staleness, lag), staleness + fragments - 1, t)
    return (t - s) % fragments, t - s + 1


def held(received: int, f: int, fragments: int) -> int:
    """How many messages of fragment f a copy holds that holds the sender's rounds below
    ``received`` (its rounds r with ``r % fragments == f``)."""
    return (received - f + fragments - 1) // fragments


class TermCounter:
    """Per link and fragment: the messages the neighbour's copy held at this member's last
    term on it (``termed``) and how many terms used the copy as it holds them
    (``terms_on_copy``).

    Args:
        fragments: fragments of the gossiped vector.
        links: links to start with (rows of zeros).
    """

    def __init__(self, fragments: int, links: int) -> None:
        self.fragments = fragments
        # the terms paired, and those there would be with every link offered, and per lag s
        # the rounds that mixed round t - s (for stats)
        self.tally = {"paired": 0, "possible": 0}
        self.lags: dict[int, int] = {}
        self.termed = [[0] * fragments for _ in range(links)]
        self.terms_on_copy = [[0] * fragments for _ in range(links)]

    def add_link(self) -> None:
        self.termed.append([0] * self.fragments)
        self.terms_on_copy.append([0] * self.fragments)

    @staticmethod
    def cap(degree: int, gamma: float, edge_weight: float) -> int:
        """m, the terms one copy may serve: ``degree (m + 1) gamma w / 2 <= 1/2``, at least
        1."""
        return max(1, int(1.0 / (max(1, degree) * gamma * edge_weight)) - 1)

    def count_lag(self, s: int) -> None:
        """Count a round that mixed the fragment of the round ``s`` before it."""
        self.lags[s] = self.lags.get(s, 0) + 1

    def fresh(self, links: list[int], received: list[int], f: int, cap: int) -> list[int]:
        """The links among ``links`` a term on fragment f may pair with: those whose copy of f
        has changed since the last term on it, or has served fewer than ``cap`` terms."""
        paired = [k for k in links
                  if held(received[k], f, self.fragments) > self.termed[k][f]
                  or self.terms_on_copy[k][f] < cap]
        self.tally["paired"] += len(paired)
        self.tally["possible"] += len(links)
        return paired

    def count(self, paired: list[int], received: list[int], f: int) -> None:
        """Count a round's terms on fragment f with the links ``paired``."""
        for k in paired:
            h = held(received[k], f, self.fragments)
            if h > self.termed[k][f]:
                self.termed[k][f], self.terms_on_copy[k][f] = h, 0
            self.terms_on_copy[k][f] += 1

    def state(self, links: list[int]) -> dict:
        return {"termed": [list(self.termed[k]) for k in links],
                "terms_on_copy": [list(self.terms_on_copy[k]) for k in links]}

    def restore(self, termed: list[list[int]], terms_on_copy: list[list[int]]) -> None:
        self.termed, self.terms_on_copy = termed, terms_on_copy
