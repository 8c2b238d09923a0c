"""Byte counters for collectives, per level of the hierarchy.

Every collective in :mod:`qcomm.collectives` records the bytes *this rank sends* (payloads and
any metadata, not TCP/IP framing) under ``"intra"`` (inside a node) or ``"inter"`` (between
nodes). Thread-safe: gossip may send from a communication thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

LEVELS = ("intra", "inter")


@dataclass
class CommStats:
    """Bytes and messages this rank sent, per level. ``snapshot()`` gives a plain dict."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    messages_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, level: str, nbytes: int, messages: int = 1) -> None:
        """Count ``nbytes`` sent in ``messages`` messages at ``level`` ("intra" or "inter")."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        with self._lock:
            self.bytes_sent[level] += int(nbytes)
            self.messages_sent[level] += int(messages)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"bytes_sent": dict(self.bytes_sent), "messages_sent": dict(self.messages_sent)}

    def load(self, snapshot: dict[str, dict[str, int]]) -> None:
        """Set the counters to a :meth:`snapshot` (a resumed run continues counting)."""
        if not isinstance(snapshot, dict) or set(snapshot) != {"bytes_sent", "messages_sent"}:
            raise ValueError("snapshot must be a dict from CommStats.snapshot()")
        with self._lock:
            for level in LEVELS:
                self.bytes_sent[level] = int(snapshot["bytes_sent"].get(level, 0))
                self.messages_sent[level] = int(snapshot["messages_sent"].get(level, 0))

    def reset(self) -> None:
        with self._lock:
            for level in LEVELS:
                self.bytes_sent[level] = 0
                self.messages_sent[level] = 0

    def __getstate__(self) -> dict:
        # Locks do not pickle; counters do (state objects travel in checkpoints).
        return {"bytes_sent": dict(self.bytes_sent), "messages_sent": dict(self.messages_sent)}

    def __setstate__(self, state: dict) -> None:
        self.bytes_sent = dict(state["bytes_sent"])
        self.messages_sent = dict(state["messages_sent"])
        self._lock = threading.Lock()
