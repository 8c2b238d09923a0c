"""Encryption and integrity of a socket link keyed from the job token: AES-256-GCM on every
frame's body (:class:`AeadSealer`, :class:`AeadOpener`), what runs on a link whose nodes hold
a token unless it is turned off.

Each link has two keys of its own, one per direction, derived by HKDF-SHA256 from the token,
with both handshake nonces as the salt and the hello as the context (:func:`link_keys`): a
fresh pair per connection, never reused by another link or a later one. A frame's nonce is its
position in its direction (a 96-bit counter from 0), never sent: a frame dropped, repeated,
reordered or altered on the way fails to open, and the link ends (the peer counts as lost,
named), so a changed byte never becomes a changed parameter. This is beside the gossip's own
check of its messages (:mod:`qcomm.collectives.gossip.integrity`), which catches corruption
but not a sender who reseals.
"""

from __future__ import annotations

from .admission import Admitted
from .frames import FrameError, Opener, Sealer

__all__ = ["AeadOpener", "AeadSealer", "link_keys"]

_KEY = 32
_NONCE = 12
_INFO = b"qcomm link keys v1\0"


def _aead(key: bytes):
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as e:   # a core dependency; said plainly if it is missing
        raise ImportError("encrypted links need the 'cryptography' package (pip install "
                          "cryptography), or encrypt=False") from e
    return AESGCM(key)


class AeadSealer(Sealer):
    """Encrypts and authenticates each body sent, under ``key`` (32 bytes), the nonce the
    count of frames sealed before."""

    overhead = 16   # the GCM tag

    def __init__(self, key: bytes) -> None:
        self.aead = _aead(key)
        self.count = 0

    def seal(self, body: bytes) -> bytes:
        nonce = self.count.to_bytes(_NONCE, "big")
        self.count += 1
        return self.aead.encrypt(nonce, body, None)


class AeadOpener(Opener):
    """Checks and decrypts each body received, under ``key``, in order.

    Raises (from :meth:`open`):
        FrameError: the body was altered, dropped, repeated or reordered on the way.
    """

    def __init__(self, key: bytes) -> None:
        self.aead = _aead(key)
        self.count = 0

    def open(self, body: bytearray) -> bytes:
        from cryptography.exceptions import InvalidTag

        nonce = self.count.to_bytes(_NONCE, "big")
        try:
            plain = self.aead.decrypt(nonce, body, None)
        except InvalidTag:
            raise FrameError(f"frame {self.count} failed its authentication: altered, "
                             "dropped or replayed on the way") from None
        self.count += 1
        return plain


def link_keys(token: bytes, admitted: Admitted, dialler: bool) -> tuple[AeadSealer, AeadOpener]:
    """This end's sealer and opener for the link ``admitted`` names (HKDF-SHA256 of ``token``
    over both nonces and the hello: the dialler's key first, then the acceptor's)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    keys = HKDF(algorithm=hashes.SHA256(), length=2 * _KEY, salt=admitted.nonces,
                info=_INFO + admitted.body).derive(token)
    out_key, in_key = (keys[:_KEY], keys[_KEY:]) if dialler else (keys[_KEY:], keys[:_KEY])
    return AeadSealer(out_key), AeadOpener(in_key)
