"""Two ends of a :class:`~qcomm.collectives.gloo.pair_group.PairGroup` link in one process,
the end that dials (Gloo's initiator: the higher port) late by ``--late-s``: the other end gives
up first ("Connect timeout", after five times the link's timeout) and its caller holds the
error for ``--hold-s`` (a thread descheduled on loaded cores) while the late end dials. For
``tests/collectives/test_pair_group.py``: the process must survive, both ends failing with
a RuntimeError (Gloo once called back into the pair it had freed: SIGSEGV or SIGABRT).

    python -m qcomm.testing.late_link --timeout-s 1 --late-s 7 --hold-s 6
"""

from __future__ import annotations

import argparse
import datetime
import threading
import time

import torch.distributed as dist

from qcomm.collectives.gloo.pair_group import PairGroup
from qcomm.rendezvous.seat import claim_incarnation
from qcomm.testing.multiprocess import free_port

# Gloo's serialized address of a rank (torch 2.x, TCP): its listening socket's sockaddr at
# byte 16 (the family at 18, the port at 20)
_FAMILY, _PORT = slice(18, 20), slice(20, 22)


def _port(address: bytes) -> int:
    """The port as Gloo compares two ends' (``sin_port``, in network order, read as a number
    of this little-endian host): the end with the larger one dials."""
    if int.from_bytes(address[_FAMILY], "little") != 2:   # AF_INET
        raise RuntimeError(f"unknown Gloo address layout: {address[:32].hex()}")
    return int.from_bytes(address[_PORT], "little")


class _LateStore(dist.Store):
    """The link's store as the end of Gloo rank ``rank`` sees it: when it dials, it reads the
    other end's address ``late_s`` late."""

    def __init__(self, inner: dist.Store, rank: int, late_s: float) -> None:
        super().__init__()
        self.inner, self.rank, self.late_s = inner, rank, late_s

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        head, _, rank = key.rpartition("/")
        # the other end's address (this end's is in already), and this end dials
        if (rank == str(1 - self.rank)
                and _port(self.inner.get(f"{head}/{self.rank}")) > _port(value)):
            time.sleep(self.late_s)
        return value

    def add(self, key: str, n: int) -> int:
        return self.inner.add(key, n)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)


class _LatePairGroup(PairGroup):
    def __init__(self, *args, late_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.late_s = late_s

    def _channel(self, store, prefix, me, other):
        rank = 0 if me == min(me, other) else 1   # as PairGroup numbers the two ends
        return super()._channel(_LateStore(store, rank, self.late_s), prefix, me, other)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--late-s", type=float, default=7.0)
    ap.add_argument("--hold-s", type=float, default=4.0)
    args = ap.parse_args()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    for member in (0, 1):
        claim_incarnation(store, member)
    outcome: dict[int, str] = {}

    def end(member: int) -> None:
        group = _LatePairGroup(f"127.0.0.1:{port}", member, 2, timeout_s=args.timeout_s,
                               late_s=args.late_s)
        try:
            group.connect(1 - member, 1 - member).close()
            outcome[member] = "connected"
        except RuntimeError as e:
            time.sleep(args.hold_s)   # the error held while the late end dials
            outcome[member] = f"failed: {str(e)[:160]}"

    threads = [threading.Thread(target=end, args=(m,), daemon=True) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for member in (0, 1):
        print(f"member {member}: {outcome.get(member, 'did not end')}", flush=True)


if __name__ == "__main__":
    main()
