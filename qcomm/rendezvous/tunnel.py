"""A node's way to a rendezvous that has a job token: a local forwarder (:class:`Tunnel`) that
torch's ``TCPStore`` client connects to on localhost, each of its connections carried to the
rendezvous's front (:mod:`.gate`) over an admitted, encrypted one.

One tunnel per rendezvous per process (:func:`open_tunnel`); every store connection the process
makes to that rendezvous afterwards goes through it (:func:`store_client`: the seat's, each
link's, a join's). Opening one proves the token at once, so a node with a wrong token fails
there, naming why, before it takes a seat.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading

import torch.distributed as dist

from qcomm.wire.admission import (
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    AdmissionError,
    cut,
    dial,
)
from qcomm.wire.aead import AeadOpener, AeadSealer, link_keys
from qcomm.wire.frames import FrameError

from .gate import HELLO
from .relay import relay

__all__ = ["Tunnel", "gated", "open_tunnel", "route", "store_client"]


class Tunnel:
    """Forwards ``127.0.0.1:port`` (:attr:`port`, picked by the system) to the gate at
    ``host:port`` with the job ``token`` (bytes).

    Raises (from the constructor):
        AdmissionError: the rendezvous refused the token, or does not ask for one.
        ConnectionError: nothing answers at ``host:port``.
    """

    def __init__(self, host: str, port: int, token: bytes, timeout_s: float) -> None:
        self.remote, self.token, self.timeout_s = (host, port), token, timeout_s
        self.dial()[0].close()   # the token is proven (or refused) before anything else
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.last_error: str | None = None   # why the last relay ended, if it was cut
        threading.Thread(target=self._accept_loop, daemon=True, name="qcomm-tunnel").start()

    def dial(self) -> tuple[socket.socket, tuple[AeadSealer, AeadOpener]]:
        """A new admitted connection to the gate, and its sealer and opener."""
        where = f"{self.remote[0]}:{self.remote[1]}"
        try:
            sock = socket.create_connection(self.remote, timeout=min(self.timeout_s,
                                                                     HANDSHAKE_TIMEOUT_S))
        except OSError as e:
            raise ConnectionError(f"no rendezvous at {where}: {e}") from e
        # A read waits through socket timeouts (frames.recv_exact): a rendezvous that greets
        # nobody (one without a token: torch's store speaks when spoken to) is cut by this.
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, cut, args=(sock,))
        deadline.start()
        try:
            admitted = dial(sock, HELLO, self.token)
        except AdmissionError as e:
            sock.close()
            raise AdmissionError(f"the rendezvous at {where}: {e}") from None
        except (FrameError, OSError) as e:
            sock.close()
            raise AdmissionError(f"the rendezvous at {where} does not ask for the job token "
                                 f"({e}): start it with QCOMM_TOKEN in its environment, the "
                                 "same as the nodes'") from None
        finally:
            deadline.cancel()
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, link_keys(self.token, admitted, dialler=True)

    def _accept_loop(self) -> None:
        while True:
            try:
                local, _ = self.sock.accept()
            except OSError:
                return   # closed
            threading.Thread(target=self._carry, args=(local,), daemon=True,
                             name="qcomm-tunnel-dial").start()

    def _carry(self, local: socket.socket) -> None:
        try:
            remote, (sealer, opener) = self.dial()
        except (AdmissionError, ConnectionError) as e:
            self.last_error = str(e)
            local.close()   # torch's client sees its connection closed
            return
        local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        relay(local, remote, sealer, opener, self._ended)

    def _ended(self, why: str | None) -> None:
        if why is not None:
            self.last_error = f"the connection to the rendezvous ended: {why}"
            print(f"qcomm: {self.last_error}", flush=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


_tunnels: dict[tuple[str, int], Tunnel] = {}
_lock = threading.Lock()


def open_tunnel(host: str, port: int, token: bytes, timeout_s: float) -> Tunnel:
    """This process's tunnel to the rendezvous at ``host:port``, opened at the first call
    (module docstring); a later call with another token raises ValueError."""
    with _lock:
        tunnel = _tunnels.get((host, port))
        if tunnel is None:
            tunnel = _tunnels[(host, port)] = Tunnel(host, port, token, timeout_s)
        elif tunnel.token != token:
            raise ValueError(f"this process reaches the rendezvous at {host}:{port} already, "
                             "with another job token")
    return tunnel


def route(host: str, port: int) -> tuple[str, int]:
    """Where this process's store connections to ``host:port`` go: its tunnel's local port
    when it opened one, else ``host:port`` itself."""
    tunnel = _tunnels.get((host, port))
    return (host, port) if tunnel is None else ("127.0.0.1", tunnel.port)


def store_client(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A new ``TCPStore`` client of the rendezvous at ``host:port``, through this process's
    tunnel to it when there is one (:func:`route`)."""
    h, p = route(host, port)
    return dist.TCPStore(h, p, is_master=False, timeout=timeout)


def gated(host: str, port: int, wait_s: float) -> bool:
    """Whether ``host:port`` greets as a gate does (a rendezvous with a job token) within
    ``wait_s``: a process without the token asks before its store connects, since torch's
    client would retry against a gate until its timeout (a store greets nobody: the wait
    passes)."""
    try:
        with socket.create_connection((host, port), timeout=wait_s) as sock:
            return sock.recv(len(MAGIC)) == MAGIC
    except OSError:
        return False
