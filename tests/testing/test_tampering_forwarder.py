"""The port forward that turns into a man in the middle (qcomm.testing.tampering_forwarder):
bytes pass unchanged both ways until the flip file exists, then one bit toward the forward's
target is flipped, once, past the bytes it must leave alone, and it says so."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from qcomm.testing.multiprocess import free_ports


def _echo(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _exchange(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        got += sock.recv(65536)
    return got


def test_bytes_pass_until_the_flip_file_then_one_bit_flips_once(tmp_path) -> None:
    target, forward = free_ports(2)
    server = socket.create_server(("127.0.0.1", target))
    threading.Thread(target=_echo, args=(server,), daemon=True).start()
    flip = tmp_path / "flip"
    proc = subprocess.Popen([sys.executable, "-m", "qcomm.testing.tampering_forwarder",
                             "--listen", f"127.0.0.1:{forward}", "--to", f"127.0.0.1:{target}",
                             "--flip-file", str(flip), "--past", "100"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("forwarding")
        sock = socket.create_connection(("127.0.0.1", forward), timeout=10)
        first = bytes(range(200))
        assert _exchange(sock, first) == first   # the flip file is not there: unchanged
        flip.touch()
        changed = _exchange(sock, b"\x00" * 50)
        assert changed == b"\x00" * 49 + b"\x01"   # one bit of the chunk's last byte
        assert _exchange(sock, b"\x00" * 50) == b"\x00" * 50   # once
        assert proc.stdout.readline().startswith(
            "flipped a bit of the connection from 127.0.0.1:")
        sock.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        server.close()
