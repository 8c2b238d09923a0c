"""Do processes that end a distributed run exit cleanly? Many short Gloo worlds, counted.

A process can finish its work, report success, and still die at exit: C++ destructors of
backend objects that outlive the Python ones (threads still joinable, sockets half closed)
abort with SIGABRT during interpreter shutdown. Only real exits show it, and one fresh world per
run costs seconds of ``import torch`` per process, so this module runs the worlds from one
launcher process that imports the body's module (and torch's lazily imported parts) once and
then forks each rank:

    statuses = fresh_world_exits(body, 2, runs=30)      # body(rank, world_size) -> None
    assert all(s == "exit 0" for run in statuses for s in run)

A forked rank joins its own process group, runs ``body``, calls ``destroy_process_group()`` and
then leaves through the interpreter's normal shutdown (``sys.exit``: atexit handlers, module
teardown, then the C library's exit with its static destructors), the same path a training
script takes; nothing is skipped with ``os._exit`` as multiprocessing's fork children do.
The launcher forks before anything in it starts a thread or a process group, so the children
inherit no thread pool (the reason :mod:`qcomm.testing.multiprocess` spawns instead).

Run as a script, it is the launcher: ``python -m qcomm.testing.exits MODULE:FUNCTION
--world-size 2 --runs 30`` prints one JSON line with every run's exit statuses.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from qcomm.testing.multiprocess import WorldError, join_group

__all__ = ["describe_status", "fresh_world_exits"]


def describe_status(status: int) -> str:
    """A ``waitpid`` status as words: "exit 0", "exit 3", "signal 6 (SIGABRT)"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown"
        return f"signal {sig} ({name})"
    return f"exit {os.WEXITSTATUS(status)}"


def fresh_world_exits(fn: Callable[[int, int], Any], world_size: int, *, runs: int,
                      parallel: int = 3, timeout_s: float = 120.0,
                      pg_timeout_s: float = 30.0) -> list[list[str]]:
    """Run ``fn(rank, world_size)`` in ``runs`` fresh Gloo worlds and report how each rank
    exited.

    Args:
        fn: a module-level function of (rank, world_size); its return value is ignored, an
            exception makes its rank exit with status 1 (traceback on stderr).
        world_size: processes per world.
        runs: how many worlds, one after another in groups of ``parallel``.
        parallel: worlds alive at the same time.
        timeout_s: wall-clock limit for all of them together; a world still running at
            ``timeout_s / ceil(runs / parallel)`` per group is killed and its ranks are
            reported as "timed out".
        pg_timeout_s: each process group's own timeout.

    Returns:
        One list per run, one status per rank in rank order: "exit N", "signal N (NAME)" or
        "timed out".

    Raises:
        WorldError: the launcher itself failed or ran past ``timeout_s`` (plus a margin).
    """
    target = f"{fn.__module__}:{fn.__qualname__}"
    cmd = [sys.executable, "-m", "qcomm.testing.exits", target, "--world-size", str(world_size),
           "--runs", str(runs), "--parallel", str(parallel), "--timeout", str(timeout_s),
           "--pg-timeout", str(pg_timeout_s)]
    # The launcher must import fn's module the way this process did.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 30,
                              env=env, check=False)
    except subprocess.TimeoutExpired as e:
        raise WorldError(f"the exit launcher ran past {timeout_s + 30:.0f} s") from e
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise WorldError(f"the exit launcher failed (status {done.returncode}):\n"
                         f"{done.stderr[-4000:]}")
    return json.loads(lines[-1])["statuses"]


def _rank(fn: Callable[[int, int], Any], rank: int, world_size: int, listener: socket.socket,
          pg_timeout_s: float) -> int:
    """One forked rank: join, run, leave the group; the exit code for ``sys.exit``. Rank 0
    serves the store on ``listener``, which the launcher bound and listens on since before the
    fork, so no other process can take the port in between; the other ranks connect to it."""
    import torch
    import torch.distributed as dist

    port = listener.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    try:
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                                  timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=listener.detach())  # the store's now
        else:
            listener.close()
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timeout)
        join_group(store, rank, world_size, timeout)
        fn(rank, world_size)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _warm_up_torch() -> None:
    """torch's lazy imports, once in the launcher instead of in every forked rank: the first
    optimizer a process builds imports ``torch._dynamo`` (about 1 s of a 2-core machine). It
    starts no thread, so forking after it stays safe. Then freeze what is loaded."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    # What was imported so far is the launcher's, not the run's: frozen, the collector leaves
    # it alone when a child shuts down (0.3 s instead of 1 s an exit here), while everything the
    # child itself creates (groups, works, the optimizer) is torn down as in any script.
    gc.freeze()


def _reap(pids: list[int], deadline: float) -> list[str]:
    """Wait for ``pids`` until ``deadline``; kill what is left. Statuses in ``pids`` order."""
    statuses: dict[int, str] = {}
    while len(statuses) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in statuses:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    statuses[pid] = describe_status(status)
        time.sleep(0.02)
    for pid in pids:
        if pid not in statuses:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            statuses[pid] = "timed out"
    return [statuses[pid] for pid in pids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a function in many fresh Gloo worlds forked from this process and "
                    "print how every rank exited, as one JSON line.")
    parser.add_argument("target", help="The function to run, as MODULE:FUNCTION; it takes "
                                       "(rank, world_size).")
    parser.add_argument("--world-size", type=int, default=2, help="Processes per world.")
    parser.add_argument("--runs", type=int, default=30, help="How many worlds.")
    parser.add_argument("--parallel", type=int, default=3, help="Worlds alive at once.")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="Seconds for all the worlds together.")
    parser.add_argument("--pg-timeout", type=float, default=30.0,
                        help="Each process group's timeout, in seconds.")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.runs < 1 or args.parallel < 1:
        parser.error("--world-size, --runs and --parallel must be at least 1")
    module, _, name = args.target.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    _warm_up_torch()

    groups = [range(i, min(i + args.parallel, args.runs))
              for i in range(0, args.runs, args.parallel)]
    per_group_s = args.timeout / len(groups)
    statuses: list[list[str]] = []
    for group in groups:
        pids: list[list[int]] = []
        for _ in group:
            listener = socket.create_server(("127.0.0.1", 0), backlog=64)
            pids.append([])
            for rank in range(args.world_size):
                pid = os.fork()
                if pid == 0:  # the child leaves main() and exits like any script
                    return _rank(fn, rank, args.world_size, listener, args.pg_timeout)
                pids[-1].append(pid)
            listener.close()  # rank 0 holds it now
        deadline = time.monotonic() + per_group_s
        statuses += [_reap(world, deadline) for world in pids]
    print(json.dumps({"statuses": statuses}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
