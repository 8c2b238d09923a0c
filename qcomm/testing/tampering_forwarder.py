"""A port forward that turns into a man in the middle, for the emulated cluster's test of the
guide's two-site recipe (``tests/bench/test_cluster_sites.py``): it accepts connections on
``--listen`` and forwards each to ``--to``, both ways, byte for byte, as a site's port forward
would (the node behind it advertises the forward's address with ``QCOMM_ADVERTISE``). Once the
file ``--flip-file`` exists, it flips one bit of the last byte of the next chunk it forwards
toward ``--to`` on a connection that has carried more than ``--past`` bytes that way (past the
link's handshake, inside an encrypted frame), once, and says so on stdout; it forwards
everything else as it came.

    python -m qcomm.testing.tampering_forwarder --listen 10.77.0.2:29500 \\
        --to 127.0.0.1:29501 --flip-file /tmp/flip
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import threading

# One flip per process: the first connection that qualifies takes it.
_FLIP_LOCK = threading.Lock()
_FLIPPED = threading.Event()


def _address(value: str, name: str) -> tuple[str, int]:
    """``"HOST:PORT"`` as (host, port). No qcomm import: the forward starts in a moment.

    Raises:
        SystemExit: not of that form, naming the flag ``name``.
    """
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"tampering_forwarder: {name} must be HOST:PORT, got {value!r}")
    return host, int(port)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


def _pump(src: socket.socket, dst: socket.socket, flip: argparse.Namespace | None,
          peer: str) -> None:
    """Copy ``src`` to ``dst`` until either ends; ``flip`` (the toward-``--to`` direction
    only): the arguments that say when to flip a bit."""
    seen = 0
    try:
        while data := src.recv(65536):
            if flip is not None and seen > flip.past and not _FLIPPED.is_set() \
                    and os.path.exists(flip.flip_file):
                with _FLIP_LOCK:
                    if not _FLIPPED.is_set():
                        # The chunk's last byte: a frame's body or tag, which its
                        # authentication covers (its first byte may be a frame's length,
                        # whose change stalls the stream instead of failing a frame).
                        data = data[:-1] + bytes([data[-1] ^ 0x01])
                        _FLIPPED.set()
                        print(f"flipped a bit of the connection from {peer} after {seen} "
                              f"bytes", flush=True)
            seen += len(data)
            dst.sendall(data)
    except OSError:
        pass   # the other side closed first: close this one too
    finally:
        _close(src, dst)


def _serve(conn: socket.socket, addr: tuple[str, int], args: argparse.Namespace) -> None:
    try:
        out = socket.create_connection(_address(args.to, "--to"), timeout=10)
    except OSError:
        _close(conn)
        return
    out.settimeout(None)
    peer = f"{addr[0]}:{addr[1]}"
    threading.Thread(target=_pump, args=(conn, out, args, peer), daemon=True).start()
    threading.Thread(target=_pump, args=(out, conn, None, peer), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT this forward accepts on")
    ap.add_argument("--to", required=True, help="HOST:PORT each connection is forwarded to")
    ap.add_argument("--flip-file", required=True,
                    help="once this file exists, one bit toward --to is flipped")
    ap.add_argument("--past", type=int, default=4096,
                    help="flip only on a connection that carried more bytes than this")
    args = ap.parse_args(argv)
    host, port = _address(args.listen, "--listen")
    _address(args.to, "--to")
    server = socket.create_server((host, port), reuse_port=False)
    print(f"forwarding {args.listen} to {args.to}", flush=True)
    while True:
        conn, addr = server.accept()
        _serve(conn, addr, args)


if __name__ == "__main__":
    main()
