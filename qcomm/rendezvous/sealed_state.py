"""A joiner's state sealed with the job token on its way through the rendezvous: the rendezvous
(torch's ``TCPStore``) admits anyone who reaches its port, so in a job with a token the state
a running node hands a joiner is encrypted and authenticated (AES-256-GCM under a key derived
by HKDF-SHA256 from the token and the join's number, a random nonce per offer): a process
without the token can neither read it nor hand a joiner parameters of its own (the joiner's
check fails, its join ends with an error, it takes nothing).
"""

from __future__ import annotations

import os

__all__ = ["open_state", "seal_state"]

_NONCE = 12
_INFO = b"qcomm join state v1\0"


def _aead(token: bytes, seq: int):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=_INFO + str(seq).encode()).derive(token)
    return AESGCM(key)


def seal_state(token: bytes, seq: int, payload: bytes) -> bytes:
    """``payload`` (a state, any bytes) for join ``seq``, sealed: nonce (12 bytes), then the
    ciphertext and its 16-byte tag."""
    nonce = os.urandom(_NONCE)
    return nonce + _aead(token, seq).encrypt(nonce, payload, None)


def open_state(token: bytes, seq: int, sealed: bytes) -> bytes:
    """The state :func:`seal_state` sealed for join ``seq``.

    Raises:
        ValueError: it was not sealed with this job's token for this join (a stray process
            offered it, or it was altered).
    """
    from cryptography.exceptions import InvalidTag

    try:
        return _aead(token, seq).decrypt(sealed[:_NONCE], sealed[_NONCE:], None)
    except (InvalidTag, ValueError):
        raise ValueError(f"the state offered to join {seq} is not sealed with this job's "
                         "token: not taken (a process outside the job offered it, or it was "
                         "altered)") from None
