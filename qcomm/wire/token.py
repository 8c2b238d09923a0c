"""The job token: what every link and the rendezvous of a job with one check by challenge and
response (:mod:`.admission`), and what their keys come from (:mod:`.aead`)."""

from __future__ import annotations

import os

__all__ = ["MIN_TOKEN_CHARS", "check_token", "job_token"]

# Shortest token accepted: a recorded handshake lets an eavesdropper try tokens offline.
MIN_TOKEN_CHARS = 16


def job_token(token: str | None) -> bytes | None:
    """The job token as bytes: ``token`` when given, else ``QCOMM_TOKEN`` (unset or empty:
    None, links admit anyone).

    Raises:
        ValueError: shorter than 16 characters (naming where it came from, not its value).
    """
    where = "token"
    if token is None:
        token, where = os.environ.get("QCOMM_TOKEN") or None, "QCOMM_TOKEN"
    if token is None:
        return None
    return check_token(where, token).encode()


def check_token(name: str, token: object) -> str:
    """``token`` when it is a string of at least :data:`MIN_TOKEN_CHARS` characters.

    Raises:
        ValueError: it is not, naming ``name`` and never showing the value.
    """
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{name} must be a string of at least {MIN_TOKEN_CHARS} characters "
                         "(e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return token
