"""Exceptions raised by qcomm collectives."""

from __future__ import annotations


class PeerTimeoutError(TimeoutError):
    """A peer did not answer within the configured timeout (it died, hung or left).

    Attributes:
        peers: global ranks that did not answer (when known).
        timeout_s: the timeout that expired, in seconds.
        operation: what was waiting (e.g. ``"gossip round 12 recv"``).
    """

    def __init__(self, operation: str, timeout_s: float, peers: list[int] | None = None):
        who = f" from ranks {peers}" if peers else ""
        super().__init__(f"{operation}: no answer{who} within {timeout_s:g} s")
        self.operation = operation
        self.timeout_s = timeout_s
        self.peers = list(peers or [])
