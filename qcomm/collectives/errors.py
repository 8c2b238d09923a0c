"""Exceptions raised when a peer fails: every one names the peer(s), the link and what was waiting.

    PeerError                    a peer failed (catch this one to handle them all)
    ├── PeerTimeoutError         no answer within the timeout (the peer hung, or is too slow)
    ├── PeerLostError            the connection to the peer broke (the peer died)
    └── CorruptPayloadError      a message failed verification (checksum, length, scales);
                                 nothing of its round was applied

After any of them the process group is in an unknown state (messages may still be in flight):
treat it as fatal, ``close()`` the optimizer and destroy the group.
"""

from __future__ import annotations

LINKS = ("intra", "inter")


def backend_detail(e: BaseException) -> str:
    """What a backend's exception says, for the detail of a :class:`PeerError`: its first
    non-empty line, whole (the rest stays on the chained exception), or its type's name when
    it says nothing."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__


class PeerError(RuntimeError):
    """A peer failed.

    Attributes:
        operation: what was waiting (e.g. ``"gossip round 12"``).
        peers: global ranks of the peers concerned (when known).
        link: ``"intra"`` (inside a node), ``"inter"`` (between nodes) or None when unknown.
    """

    def __init__(self, message: str, operation: str, peers: list[int] | None = None,
                 link: str | None = None) -> None:
        if link is not None and link not in LINKS:
            raise ValueError(f"link must be one of {LINKS} or None, got {link!r}")
        super().__init__(message)
        self.operation = operation
        self.peers = sorted(set(peers or []))
        self.link = link


def _where(peers: list[int] | None, link: str | None) -> str:
    who = f" from ranks {sorted(set(peers))}" if peers else ""
    over = f" over the {link}-node link" if link else ""
    return who + over


class PeerTimeoutError(PeerError, TimeoutError):
    """A peer did not answer within the configured timeout (it hung, left or is too slow).

    Attributes:
        timeout_s: the timeout that expired, in seconds.
    """

    def __init__(self, operation: str, timeout_s: float, peers: list[int] | None = None,
                 link: str | None = None) -> None:
        super().__init__(f"{operation}: no answer{_where(peers, link)} within {timeout_s:g} s",
                         operation, peers, link)
        self.timeout_s = timeout_s


class PeerLostError(PeerError, ConnectionError):
    """The connection to a peer broke before the operation finished (the peer died)."""

    def __init__(self, operation: str, peers: list[int] | None = None,
                 link: str | None = None, detail: str = "") -> None:
        more = f" ({detail})" if detail else ""
        who = f"ranks {sorted(set(peers))}" if peers else "a peer"
        over = f" over the {link}-node link" if link else ""
        super().__init__(f"{operation}: connection to {who}{over} lost{more}", operation, peers,
                         link)


class CorruptPayloadError(PeerError, ValueError):
    """A received message failed verification; nothing of its round was applied.

    Attributes:
        reason: what failed (``"checksum"``, ``"non-finite scale"``, ...).
    """

    def __init__(self, operation: str, peers: list[int], link: str | None, reason: str) -> None:
        super().__init__(f"{operation}: message{_where(peers, link)} failed verification "
                         f"({reason}); nothing of this round was applied", operation, peers, link)
        self.reason = reason
