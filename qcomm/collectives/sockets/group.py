"""A gossip group whose links are TCP connections on each node's one port
(:class:`SocketGroup`): as :class:`~qcomm.collectives.gloo.pair_group.PairGroup` (links made
through the rendezvous as they open, a restarted member a new peer), but a link is one TCP
connection that one end dials to the other's listening port, so a node needs one inbound port
(``listen=``, or ``QCOMM_LISTEN``) instead of the ports Gloo picks, and a node with none (behind
a NAT) still links by dialling every peer that has one.

Each end of a link publishes its listening address under the link's key in the store, then
the usual "here" key; once both are here, the higher ``(member, incarnation)`` dials when the
other listens (else the one that listens accepts); when neither listens, both dial the
rendezvous's relay (:mod:`.relayed`), which splices the two, and the higher still dials the
link's own handshake through it, end to end. With a job token (``token=``, or
``QCOMM_TOKEN``) every link is admitted by challenge and response (:mod:`.admission`) and,
unless ``encrypt=False`` (or ``QCOMM_ENCRYPT=0``), encrypted and authenticated with keys of its
own (:mod:`.aead`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import torch.distributed as dist

from qcomm.rendezvous.link_relay import RELAY_KEY
from qcomm.validation import env_flag
from qcomm.wire.admission import (
    HANDSHAKE_TIMEOUT_S,
    AdmissionError,
    Admitted,
    accept,
    cut,
    dial,
)
from qcomm.wire.aead import link_keys
from qcomm.wire.frames import FrameError, Opener, Sealer
from qcomm.wire.token import job_token

from ..gloo.pair_group import PairGroup
from .channel import SocketChannel
from .listener import connect_to, listener_at, parse_listen
from .relayed import dial_relay

__all__ = ["SocketGroup", "job_token"]

log = logging.getLogger(__name__)

class SocketGroup(PairGroup):
    """This member's handle on a gossip group whose links are TCP connections (module
    docstring). Arguments as :class:`~qcomm.collectives.gloo.pair_group.PairGroup`, and:

    Args:
        listen: ``"HOST:PORT"`` this process accepts its links on (PORT 0: the system picks);
            None reads ``QCOMM_LISTEN``; ``""`` (or neither) accepts nothing: this member
            dials all its links (its peers must listen, or the rendezvous relay the links
            to those that accept nothing either: ``--relay-port``).
        token: the job token (at least 16 characters); None reads ``QCOMM_TOKEN``.
        encrypt: encrypt and authenticate every frame (AES-256-GCM, keys from the token);
            None: on when there is a token, unless ``QCOMM_ENCRYPT=0``. Both ends of a link
            must agree.
        advertise: ``"HOST:PORT"`` the peers dial to reach this member's port, when it is not
            the one it listens on (a port forwarded by a NAT or a proxy); None reads
            ``QCOMM_ADVERTISE``, else the listening address.
    """

    def __init__(self, rendezvous: str, member: int, size: int, *, listen: str | None = None,
                 token: str | None = None, encrypt: bool | None = None,
                 advertise: str | None = None, **kwargs) -> None:
        super().__init__(rendezvous, member, size, **kwargs)
        self.token = job_token(token)
        if encrypt is None:
            encrypt = self.token is not None and env_flag("QCOMM_ENCRYPT", True)
        if encrypt and self.token is None:
            raise ValueError("encrypt=True needs a job token (token= or QCOMM_TOKEN): the "
                             "links' keys come from it")
        self.encrypt = bool(encrypt)
        advertise = advertise or os.environ.get("QCOMM_ADVERTISE") or None
        if advertise is not None:
            parse_listen(advertise, "advertise")
        self.advertise = advertise
        # "" (given): no port, whatever QCOMM_LISTEN says
        listen = (listen if listen is not None else os.environ.get("QCOMM_LISTEN")) or None
        if listen is not None:
            parse_listen(listen)   # named error before anything is bound
        self.listener = listener_at(listen, self.token) if listen is not None else None

    def _announce(self, store: dist.Store, prefix: str) -> None:
        address = "" if self.listener is None else self.advertise or self.listener.address
        store.set(f"{prefix}addr/{self.rank}", address)

    def _channel(self, store: dist.Store, prefix: str, me: tuple[int, int],
                 other: tuple[int, int]) -> SocketChannel:
        theirs = store.get(f"{prefix}addr/{other[0]}").decode()
        peer = f"rank {self.ranks[other[0]]}"
        timeout_s = self.timeout.total_seconds()
        if not theirs and self.listener is None:
            # Neither end accepts anything: both dial the rendezvous's relay, the higher
            # (member, incarnation) still the link's dialler (its handshake runs end to end).
            relay = store.get(RELAY_KEY).decode() if store.check([RELAY_KEY]) else ""
            if not relay:
                raise RuntimeError(f"neither this member nor {peer} listens (QCOMM_LISTEN) and "
                                   "the rendezvous relays no links (--relay-port): the link "
                                   "between them cannot be made")
            dialler = me > other
            sock = dial_relay(relay, prefix, "dial" if dialler else "accept", self.token,
                              timeout_s)
            how = f"relayed through {relay}"
            if dialler:
                admitted = self._hello(sock, prefix, me, f"rank {self.ranks[other[0]]} "
                                                         f"through the relay at {relay}")
            else:
                admitted = self._accept_relayed(sock, peer)
        else:
            dialler = bool(theirs) and (self.listener is None or me > other)
            if dialler:
                sock, admitted = self._dial(theirs, prefix, me, timeout_s)
                how = f"dialled {theirs}"
            else:
                sock, admitted = self.listener.claim(prefix, timeout_s)
                how = f"accepted on {self.listener.address}"
        if not dialler:
            hello = admitted.hello
            why = ("one end encrypts and the other does not (QCOMM_ENCRYPT must be the same "
                   "on every node)" if hello.get("encrypt") != self.encrypt else
                   f"the connection says it is member {hello.get('member')} (incarnation "
                   f"{hello.get('incarnation')})"
                   if [hello.get("member"), hello.get("incarnation")] != list(other) else
                   f"the connection is for link {hello.get('link')}"
                   if hello.get("link") != prefix else None)
            if why is not None:
                sock.close()
                raise RuntimeError(f"link to {peer}: {why}")
        # A send to a peer that reads nothing fails after the link's timeout.
        sock.settimeout(timeout_s)
        log.info("link to %s: TCP, %s%s%s", peer, how,
                 ", token checked" if self.token is not None else "",
                 ", encrypted" if self.encrypt else ", in clear")
        if self.encrypt:
            sealer, opener = link_keys(self.token, admitted, dialler)
            return SocketChannel(sock, peer, sealer, opener)
        return SocketChannel(sock, peer, Sealer(), Opener())

    def _dial(self, address: str, link: str, me: tuple[int, int], timeout_s: float
              ) -> tuple[socket.socket, Admitted]:
        sock = connect_to(address, "the peer's listening address", timeout_s)
        return sock, self._hello(sock, link, me, address)

    def _hello(self, sock: socket.socket, link: str, me: tuple[int, int], where: str
               ) -> Admitted:
        """The dialling end's handshake of ``link`` on ``sock`` (``where``: whom it reaches,
        for the error)."""
        try:
            return dial(sock, {"link": link, "member": me[0], "incarnation": me[1],
                               "encrypt": self.encrypt}, self.token)
        except (AdmissionError, FrameError, OSError) as e:
            sock.close()
            raise RuntimeError(f"link to {where}: {e}") from e

    def _accept_relayed(self, sock: socket.socket, peer: str) -> Admitted:
        """The accepting end's handshake on a connection the relay spliced (the dialler is
        the other member, not the relay)."""
        # A read waits through socket timeouts (frames.recv_exact): this timer bounds it.
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, cut, args=(sock,))
        deadline.start()
        try:
            return accept(sock, self.token)
        except (AdmissionError, FrameError, OSError) as e:
            sock.close()
            raise RuntimeError(f"link to {peer} through the relay: {e}") from e
        finally:
            deadline.cancel()

    def __repr__(self) -> str:
        where = self.listener.address if self.listener is not None else "no port"
        return f"SocketGroup(member={self.rank}, size={self.size}, name={self.name!r}, " \
               f"listen={where})"
