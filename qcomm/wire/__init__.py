"""The bytes between processes of a job that crosses sites, below every layer that opens a
connection: the node-to-node links (:mod:`qcomm.collectives.sockets`) and the rendezvous's front
and tunnel (:mod:`qcomm.rendezvous`) frame, admit and encrypt with the same pieces. Standard
library and ``cryptography`` only; nothing of qcomm but this package.

- :mod:`.frames`: length-prefixed frames on one connection.
- :mod:`.admission`: a connection's opening handshake, the job token's challenge and response.
- :mod:`.aead`: AES-256-GCM frames keyed from the token (HKDF), counter nonces.
- :mod:`.token`: the job token, checked.
"""

from qcomm.wire.admission import AdmissionError
from qcomm.wire.token import job_token

__all__ = ["AdmissionError", "job_token"]
