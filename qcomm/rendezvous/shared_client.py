"""One connection to the rendezvous that many threads share without one holding it up.

A process's gossip makes its links in threads of their own (one per link), each waiting in the
store for its other end and then handing the store to a Gloo group of two, whose rendezvous
blocks in ``get`` until the other end has published its address. A link used to open a
connection of its own for that, so that one link's blocking wait never held another's calls:
a member of N made ``log2(N)`` connections at its start (one per peer of the one-peer graph),
and N members starting together made ``N log2(N)`` connects at once. Each connect costs the
rendezvous work (and, through a job token's tunnel, an admitted, encrypted connection), and on a
host whose name lookups time out (torch's store client and server name each socket they make)
a burst of them stalled every member's start for 5-15 s.

:class:`SharedClient` is a ``torch.distributed.Store`` over one ``TCPStore`` client: every call
holds the connection for one request, and the calls that would block (``get`` of a key not yet
set, ``wait``) are polled with ``check`` instead, so that a link waiting for a slow or dead peer
never holds up the others. A Gloo group made over it (through a ``PrefixStore``) works as over
the client itself.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from qcomm.validation import check_real

from .waiting import raise_if_abandoned

__all__ = ["SharedClient"]


class SharedClient(dist.Store):
    """A store shared by threads over one client (module docstring).

    Args:
        inner: the connection (a ``TCPStore`` client, or any ``Store``).
        timeout_s: how long a polled ``get`` or ``wait`` waits for its keys when the caller
            gives no timeout (the client's own timeout, as torch's store waits).
        poll_s: seconds between two looks at the keys of a blocked call.
    """

    def __init__(self, inner: dist.Store, timeout_s: float, poll_s: float = 0.01) -> None:
        super().__init__()
        self.inner = inner
        self.timeout_s = check_real("timeout_s", timeout_s, low=0, low_open=True)
        self.poll_s = check_real("poll_s", poll_s, low=0, low_open=True)
        self._lock = threading.Lock()   # one request at a time on the connection

    def _poll(self, keys: list[str], timeout_s: float) -> None:
        """Return once every key of ``keys`` is set; DistStoreError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            raise_if_abandoned()   # a link's wait for its other end, given up by its streams
            with self._lock:
                if self.inner.check(keys):
                    return
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(
                    f"wait timeout after {timeout_s:g} s for the keys {keys} at the "
                    "rendezvous")
            time.sleep(min(self.poll_s, deadline - now))

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._poll([key], self.timeout_s)
        with self._lock:
            return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        with self._lock:
            return self.inner.add(key, value)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        with self._lock:
            return self.inner.compare_set(key, expected_value, desired_value)

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._poll(list(keys), self.timeout_s if timeout is None else timeout.total_seconds())

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self.inner.delete_key(key)

    def num_keys(self) -> int:
        with self._lock:
            return self.inner.num_keys()
