"""qcomm.collectives.errors: a backend's failure as the PeerError that names it, whole."""

from __future__ import annotations

from qcomm.collectives.errors import PeerLostError, PeerTimeoutError
from qcomm.collectives.primitives import as_peer_error


def test_a_backend_error_becomes_a_whole_peer_error_message():
    """The backend's first line is kept whole (it was cut at 200 characters, mid-word), the
    exception chained; an empty message gives its type's name."""
    line = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
            "[10.77.0.3]:48412 " + "while receiving the remote rank's message " * 6).strip()
    lost = as_peer_error(RuntimeError(line + "\nsecond line"), "gossip round 3", None, [2],
                         "inter")
    assert isinstance(lost, PeerLostError) and line in str(lost)
    assert "second line" not in str(lost) and str(lost).endswith(f"({line})")
    late = as_peer_error(RuntimeError("Timed out waiting 5000ms"), "x", 5.0, [1], None)
    assert isinstance(late, PeerTimeoutError)
    assert "RuntimeError" in str(as_peer_error(RuntimeError("  "), "y", None, [1], None))
