"""One link's tagged point-to-point over one TCP connection: the channel the streams of
:class:`~qcomm.collectives.gloo.streams.GlooStreams` move a link's messages on, here without
Gloo (:class:`SocketChannel`).

``isend`` queues a message for the link's writer thread and ``irecv`` posts a buffer; both
return a work whose ``wait(timeout)`` raises RuntimeError when the link failed or the time
passed, as a Gloo work does. The reader thread reads frames in order and hands each to the
receive posted with its tag, or keeps it until one is (TCP keeps a link's order, so a stream's
messages and its vectors, told apart by their tags, each arrive in the order they were sent).
A wait that times out closes the connection, as Gloo's does: the peer sees the link end at
once instead of after its own timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
from collections import deque

import torch

from qcomm.wire.frames import FrameError, Opener, Sealer, recv_frame, send_frame

__all__ = ["SocketChannel"]


class _Work:
    """A send or receive in flight: done when its bytes left (a send) or arrived (a receive),
    failed when the link failed first."""

    def __init__(self, channel: SocketChannel, tensor: torch.Tensor) -> None:
        self.channel = channel
        self.tensor = tensor
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done, up to ``timeout`` (None: without end).

        Raises:
            RuntimeError: the link failed (its reason), or the time passed (the connection is
                then closed).
        """
        c = self.channel
        with c.cond:
            ok = c.cond.wait_for(lambda: self.done or c.error is not None,
                                 None if timeout is None else timeout.total_seconds())
            if self.done:
                return True
            error = c.error
        if not ok:
            c.fail(f"timed out after {timeout.total_seconds():g} s waiting for {c.peer}")
            raise RuntimeError(f"timed out waiting for {c.peer}")
        raise RuntimeError(error)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class SocketChannel:
    """Tagged sends and receives with one peer over a connected socket, sealed and opened by
    ``sealer`` and ``opener`` (the link's keys, or plain). Starts its reader and writer
    threads.

    Args:
        sock: the link's connected socket (its timeout bounds a send to a peer that reads
            nothing).
        peer: who is at the other end, for messages (``"rank 2"``).
        sealer: seals what this end sends.
        opener: opens what it receives.
    """

    def __init__(self, sock: socket.socket, peer: str, sealer: Sealer, opener: Opener) -> None:
        self.sock = sock
        self.peer = peer
        self.sealer, self.opener = sealer, opener
        self.cond = threading.Condition()
        self.error: str | None = None
        self.bytes_sent = 0
        self._outbox: deque[tuple[int, _Work]] = deque()
        self._posted: dict[int, deque[_Work]] = {}    # tag: receives waiting for it
        self._arrived: dict[int, deque[memoryview]] = {}   # tag: payloads no receive took yet
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"qcomm-sock-read-{peer}")
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name=f"qcomm-sock-write-{peer}")
        self._reader.start()
        self._writer.start()

    def isend(self, t: torch.Tensor, tag: int) -> _Work:
        """Queue ``t`` (contiguous, on the CPU, any dtype; not modified until done) as the
        message tagged ``tag``."""
        work = _Work(self, t)
        with self.cond:
            self._outbox.append((tag, work))
            self.cond.notify_all()
        return work

    def irecv(self, t: torch.Tensor, tag: int) -> _Work:
        """Post ``t`` (contiguous, on the CPU) for the message tagged ``tag``; its byte
        length must match (else the link fails: the peers disagree on what they send)."""
        work = _Work(self, t)
        with self.cond:
            early = self._arrived.get(tag)
            if early:
                self._fill(work, early.popleft())
            else:
                self._posted.setdefault(tag, deque()).append(work)
        return work

    def _fill(self, work: _Work, payload: memoryview) -> None:
        out = _as_bytes(work.tensor)
        if len(out) != len(payload):
            self._fail_locked(f"a message of {len(payload)} bytes from {self.peer} where "
                              f"{len(out)} were expected")
            return
        out[:] = payload
        work.done = True
        self.cond.notify_all()

    def _read_loop(self) -> None:
        try:
            while True:
                tag, payload = recv_frame(self.sock, self.opener)
                with self.cond:
                    if self.error is not None:
                        return
                    waiting = self._posted.get(tag)
                    if waiting:
                        self._fill(waiting.popleft(), payload)
                    else:
                        self._arrived.setdefault(tag, deque()).append(payload)
        except FrameError as e:
            self.fail(str(e))

    def _write_loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._outbox or self.error is not None)
                if self.error is not None:
                    return
                tag, work = self._outbox.popleft()
            try:
                n = send_frame(self.sock, tag, _as_bytes(work.tensor), self.sealer)
            except OSError as e:
                self.fail(f"sending to {self.peer}: {e}")
                return
            with self.cond:
                self.bytes_sent += n
                work.done = True
                self.cond.notify_all()

    def fail(self, why: str) -> None:
        """End the link with ``why`` (the first reason stays): pending and later works fail
        with it, the connection closes (the peer's reads end)."""
        with self.cond:
            self._fail_locked(why)

    def _fail_locked(self, why: str) -> None:
        if self.error is None:
            self.error = why
            # Shut down, not closed: the reader may be blocked in a read of this descriptor
            # (a shutdown ends it; a close would let the number be reused under it).
            with contextlib.suppress(OSError):   # already closed by the peer
                self.sock.shutdown(socket.SHUT_RDWR)
        self.cond.notify_all()

    def close(self) -> None:
        """End the link: pending works fail, the threads leave, the socket closes."""
        self.fail("the link was closed")
        for thread in (self._reader, self._writer):
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)
        self.sock.close()
