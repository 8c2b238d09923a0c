"""Joins announced through the rendezvous: a member that starts while the job runs says so, the
running members see it, and one of them hands it the state to start from.

    joiner:   seq = announce(store, member, incarnation)      # then
              state = await_state(store, seq, timeout_s)      # bytes from a running member
    running:  watcher = JoinWatcher(host, port)               # a thread polls the store
              for seq, member, incarnation in watcher.new(): ...; offer_state(store, seq, b)

The store holds ``qcomm/joins`` (how many joins were announced) and per join ``qcomm/join/<seq>``
(``"member:incarnation"``) and ``qcomm/join/<seq>/state`` (the first offer wins: it names the
offer, ``"<offer id>:<parts>:<bytes>"``, whose parts lie under
``qcomm/join/<seq>/state/<offer id>/<i>``). A state goes in parts because torch's TCPStore
server refuses a value over 8 MiB, and drops the connection that sent it. The watcher
polls from a thread of its own, on a connection of its own, so a rendezvous that is down or slow
never stops a training step: it warns once and keeps trying; joins wait until it is back.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
from collections.abc import Callable

import torch.distributed as dist

from .sealed_state import open_state, seal_state
from .tunnel import store_client
from .waiting import wait_keys

__all__ = ["JoinWatcher", "announce", "await_state", "offer_state"]

log = logging.getLogger("qcomm")

JOINS_KEY = "qcomm/joins"


def _join_key(seq: int) -> str:
    return f"qcomm/join/{seq}"


def _state_key(seq: int) -> str:
    """The key naming the offer taken by join ``seq``; its parts lie below it."""
    return _join_key(seq) + "/state"


def announce(store: dist.Store, member: int, incarnation: int) -> int:
    """Announce that ``member`` (at ``incarnation``) joins the running job; its join's number."""
    seq = int(store.add(JOINS_KEY, 1))
    store.set(_join_key(seq), f"{member}:{incarnation}")
    return seq


# The largest part of a state in one store value: torch's TCPStore server (its libuv backend)
# refuses a message over 8 MiB and closes the connection that sent it.
STATE_PART_BYTES = 4 << 20


def offer_state(store: dist.Store, seq: int, payload: bytes, token: bytes | None = None
                ) -> bool:
    """Offer join ``seq`` the state to start from; True when this offer is the one taken (the
    first). The parts go first, under this offer's own keys, then one small compare-and-set
    names the offer; an offer not taken deletes its parts. With the job ``token``, the state
    is sealed with it (:mod:`.sealed_state`)."""
    if token is not None:
        payload = seal_state(token, seq, payload)
    offer = secrets.token_hex(8)
    base = f"{_state_key(seq)}/{offer}"
    parts = range(0, len(payload), STATE_PART_BYTES)
    for i, lo in enumerate(parts):
        store.set(f"{base}/{i}", payload[lo:lo + STATE_PART_BYTES])
    header = f"{offer}:{len(parts)}:{len(payload)}"
    taken = store.compare_set(_state_key(seq), "", header).decode() == header
    if not taken:
        for i in range(len(parts)):
            store.delete_key(f"{base}/{i}")
    return taken


def await_state(store: dist.Store, seq: int, timeout_s: float, where: str = "",
                token: bytes | None = None, check: Callable[[], None] | None = None) -> bytes:
    """The state offered to join ``seq`` (the wait says every few seconds what it waits for,
    naming the rendezvous ``where``); with the job ``token``, opened with it. ``check`` is
    called before each of those lines: what it raises ends the wait (no member left to
    offer: :meth:`~qcomm.rendezvous.departures.RunningMembers.check`).

    Raises:
        TimeoutError: no running member offered it within ``timeout_s``;
        ValueError: its parts do not add up to the size its offer named, or (with a token) it
            was not sealed with the token.
    """
    key = _state_key(seq)
    try:
        wait_keys(store, {key: f"a running node to hand it its state (join {seq})"}, timeout_s,
                  where or "of this job", who="this joining node", check=check)
    except TimeoutError as e:
        raise TimeoutError(f"no running member handed this joiner its state within "
                           f"{timeout_s:g} s (join {seq})") from e
    offer, parts, nbytes = store.get(key).decode().split(":")
    base = f"{key}/{offer}"
    payload = b"".join(store.get(f"{base}/{i}") for i in range(int(parts)))
    if len(payload) != int(nbytes):
        raise ValueError(f"the state offered to join {seq} is {len(payload)} bytes, its offer "
                           f"said {nbytes}")
    for i in range(int(parts)):   # the rendezvous keeps nothing it no longer needs
        store.delete_key(f"{base}/{i}")
    return payload if token is None else open_state(token, seq, payload)


class JoinWatcher:
    """Polls the rendezvous for joins, every ``poll_s`` seconds, from a thread of its own.

    Args:
        host, port: the rendezvous.
        poll_s: seconds between polls.
        seen: joins already known (a joiner passes its own join's number).
        prefix: where in the store these joins live (one gossip's of several: a rail's).
    """

    def __init__(self, host: str, port: int, *, poll_s: float = 0.2, seen: int = 0,
                 prefix: str = "") -> None:
        self.host, self.port, self.poll_s, self.prefix = host, port, poll_s, prefix
        self._seen = seen
        self._found: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()
        self._polling = threading.Lock()   # the thread's polls and poll_now()'s, one at a time
        self._stop = threading.Event()
        self._store: dist.Store | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="qcomm-joins")
        self._thread.start()

    def new(self) -> list[tuple[int, int, int]]:
        """The joins seen since the last call: (number, member, incarnation), in order."""
        with self._lock:
            out, self._found = self._found, []
        return out

    def poll_now(self) -> None:
        """Poll once in the caller's thread (a rendezvous that does not answer is left to the
        watcher's thread to report)."""
        with self._polling:
            try:
                self._poll()
            except (RuntimeError, OSError, dist.DistStoreError):
                self._store = None

    def close(self) -> None:
        """Stop polling; returns once the thread has left. A poll in flight ends within its
        store calls' 5 s each (a rendezvous that is down: one connect attempt); the thread must
        not outlive this call, or interpreter exit meets it inside torch's store (seen under
        load: a 5 s join returned first, and the process aborted at exit)."""
        self._stop.set()
        self._thread.join(timeout=60.0)
        if self._thread.is_alive():
            log.warning("qcomm: the join watcher of %s:%d did not stop within 60 s", self.host,
                        self.port)

    def _poll(self) -> None:
        if self._store is None:
            store = store_client(self.host, self.port, datetime.timedelta(seconds=5))
            self._store = dist.PrefixStore(self.prefix, store) if self.prefix else store
        joins = int(self._store.add(JOINS_KEY, 0))
        for seq in range(self._seen + 1, joins + 1):
            if self._stop.is_set():
                return
            self._store.wait([_join_key(seq)], datetime.timedelta(seconds=5))
            member, incarnation = (int(v) for v in
                                   self._store.get(_join_key(seq)).decode().split(":"))
            with self._lock:
                self._found.append((seq, member, incarnation))
            self._seen = seq

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._polling:
                    self._poll()
                if self._warned:
                    log.warning("qcomm: the rendezvous at %s:%d answers again", self.host,
                                self.port)
                    self._warned = False
            except (RuntimeError, OSError, dist.DistStoreError) as e:
                self._store = None
                if not self._warned:
                    log.warning("qcomm: the rendezvous at %s:%d does not answer (%s); the "
                                "running nodes keep their members, joins wait until it is "
                                "back", self.host, self.port, e)
                    self._warned = True
            self._stop.wait(self.poll_s)
