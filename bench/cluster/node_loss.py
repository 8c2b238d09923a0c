"""A lost node (``--kill-node K --kill-at F``): when it dies, how it dies (every process of the
node SIGKILLed at once, as when a machine is lost), and what a survivor whose communication
failed records and does (its connections cut, so that no peer waits on it).

Imported by workload.py and recovery.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import training as T
from bench.cluster.run_record import write_json


def kill_plan(args: argparse.Namespace, layout: T.Layout,
              budget: float | None) -> dict[str, Any] | None:
    """A lost node: which, and when (after a step of its own, or a time into the window);
    None without ``--kill-node``.

    Raises:
        ValueError: the layout has no such node.
    """
    if args.kill_node is None:
        return None
    if args.kill_node >= layout.nodes:
        raise ValueError(f"--kill-node {args.kill_node}: the layout has nodes 0.."
                         f"{layout.nodes - 1}")
    return {"node": args.kill_node, "at": args.kill_at,
            "step": None if budget is not None else round(args.kill_at * args.steps),
            "time_s": None if budget is None else args.kill_at * budget}


def node_processes() -> list[int]:
    """Every process of this rank's node but itself: its torchrun agent (the parent) first,
    then every descendant of the agent (the node's other ranks). Empty when the parent is not
    torchrun (never a process outside the node's launch)."""
    me, agent = os.getpid(), os.getppid()
    try:
        cmd = Path(f"/proc/{agent}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return []
    if "torchrun" not in cmd and "torch.distributed.run" not in cmd:
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [agent], [agent]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return [pid for pid in out if pid != me]


def kill_this_node(marker: Path, what: dict[str, Any], *, agent: bool = True) -> NoReturn:
    """The node is lost: write ``what`` (when, by whom) to ``marker`` for the survivors' record,
    then SIGKILL the node's torchrun agent (unless ``agent`` is False: it then starts the ranks
    again, ``--join-at``), its other ranks and this process. No cleanup of any kind: the kernel
    closes the sockets, as when a machine dies."""
    write_json(marker, what)
    pids = node_processes()
    for pid in pids if agent else pids[1:]:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # not reached: SIGKILL cannot be caught


def cut_connections() -> int:
    """Shut every connected socket of this process down (each peer gets end-of-stream; the
    descriptors stay open, so Gloo's bookkeeping stays valid) and return how many. A rank that
    stopped calls it: a survivor blocked on a receive from this rank fails at once instead of
    at the process group's timeout (Gloo does not fail an operation waiting on one peer when
    another peer's connection breaks, and ``abort()`` of a Gloo group closes nothing).
    Listening sockets are left alone: Gloo's listener aborts the process when its socket is
    shut down."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass  # not connected, or not a TCP socket
        finally:
            sock.detach()  # the descriptor stays its owner's
    return n


def stop_record(exc: BaseException, where: str, step: int) -> dict[str, Any]:
    """What a stopped rank records: where (``step``, ``flush``, ``finalize``, ...) and at
    which step it stopped, the exception's class name and its message's first line."""
    lines = str(exc).strip().splitlines()
    return {"type": type(exc).__name__, "message": lines[0] if lines else "", "where": where,
            "step": step}


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/node_loss.py is a library of the cluster benchmark "
        "(a lost node: when and how it dies), imported by workload.py and recovery.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
