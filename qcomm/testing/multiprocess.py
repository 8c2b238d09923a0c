"""Run functions on N local processes joined by a Gloo process group, with a hard timeout.

For tests of collectives (ours and users' own): a bug fails within the timeout, never hangs.

    def body(rank: int, world_size: int, n: int) -> float:
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t[0].item()

    assert run_world(body, 4, args=(8,)) == [6.0] * 4        # a fresh world for one call

    with WorldPool(4) as pool:                                # one world for many calls
        assert pool.run(body, args=(8,)) == [6.0] * 4
        assert pool.run(body, args=(2,)) == [6.0] * 4

Starting a world still costs time (each process joins the group), so a test
suite with many small multi-process tests keeps one :class:`WorldPool` per world size for the
whole session and runs each test's body in it (PyTorch's ``MultiProcContinousTest`` pattern;
``tests/conftest.py`` has the fixture). A body that fails, dies or runs past its timeout breaks
the pool: its processes are killed and the next :meth:`WorldPool.run` starts a fresh world, so
one failure cannot leave a half-finished collective in the way of the next test. Bodies that
break the world on purpose (a killed or silent peer) belong in :func:`run_world`.

``fn`` must be importable by the child processes (defined at module level). Each rank is
forked from one server process that imported torch once (multiprocessing's "forkserver"; "spawn"
where a platform has none): a fresh process all the same, started in a fraction of the seconds an
interpreter takes to import torch. The server runs no torch op, so no thread pool is copied into
a fork (a fork of a process that ran them can deadlock), and a rank takes the parent's
environment and working directory as they are when its world starts, as a spawned one would.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import pickle
import queue
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["CHECKED_LEAVE_S", "WorldError", "WorldPool", "WorldPools", "descendants",
           "free_port", "free_ports", "kill_sessions", "run_world"]


# What the server imports once for every rank forked from it: torch, its process groups, and
# the compiler stack torch.optim.Optimizer imports at its first construction (about as long as
# torch's own import). A module missing here is skipped by multiprocessing, not an error.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _start_context() -> Any:
    """The multiprocessing context ranks start from (module docstring)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)   # read when the server first starts
    return ctx


class WorldError(RuntimeError):
    """One or more ranks failed or did not finish in time; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    return free_ports(1)[0]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so
    killing the agent's process group would leave them behind)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


def kill_sessions(procs: list) -> None:
    """SIGKILL every process of ``procs`` (``subprocess.Popen``, each started in a session of
    its own: a torchrun agent, a rendezvous) still running, its process group and every process
    below it, then reap them."""
    pids = [d for p in procs if p.poll() is None for d in descendants(p.pid)]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=10)


def _first_ephemeral_port() -> int:
    """Where the range starts that the kernel draws ports from for a bind to port 0 and for
    every outgoing connection (``ip_local_port_range``; Linux's default where it cannot be
    read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on localhost that are free right now.

    Drawn at random below the kernel's ephemeral range: a port from it (a bind to port 0)
    could be handed to a Gloo device or to an outgoing connection of another test between
    this draw and its use. All sockets stay bound until every port is drawn, so the same port
    is not drawn twice: worlds started together (whose stores bind only later) get distinct
    ports."""
    high = _first_ephemeral_port()
    low = max(high - 12000, 1024)
    rng = random.Random()   # not the global generator: tests seed it
    sockets: list[socket.socket] = []
    try:
        for _ in range(100 * count):
            if len(sockets) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", rng.randrange(low, high)))
            except OSError:   # taken
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < count:
            raise RuntimeError(f"no {count} free ports between {low} and {high}")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _join(rank: int, world_size: int, store_ports: Any, pg_timeout_s: float) -> None:
    """Join the world's Gloo group through a store that rank 0 serves on a port the kernel
    picks as it binds, told to the other ranks through ``store_ports``.

    A port drawn free beforehand (:func:`free_port`) stays free only until something else
    binds it: the outgoing connections of other worlds (every Gloo pair takes a port of the same
    range) or another test process, during the seconds the ranks spend importing torch. Bound by
    the store itself, the port cannot be lost on the way."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if rank == 0:
        # No wait for the workers here: they connect only once they have the port.
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        for _ in range(world_size - 1):
            store_ports.put(store.port)
    else:
        try:
            port = store_ports.get(timeout=pg_timeout_s)
        except queue.Empty:
            raise TimeoutError(f"rank 0 served no store within {pg_timeout_s:.0f} s") from None
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # for bodies that read the job's address
    join_group(store, rank, world_size, timeout)


def join_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """The Gloo default group over ``store`` (a ``TCPStore``), as a test world's rank joins
    it (here and in :mod:`qcomm.testing.exits`)."""
    import torch.distributed as dist

    # The prefix env:// rendezvous puts on the default group's keys, so that bodies using the
    # job's store beside the group see the same keys as in a world started by torchrun.
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    # Gloo's init returns on a rank once its own side of each connection is made: a rank whose
    # body has nothing to do would leave at once and close a connection its peer is still
    # shaking hands on, and the peer's init fails ("Connection closed by peer", 1 run in 21 of
    # two-rank worlds with CPU-bound processes beside them).
    dist.barrier()


def _leave_as_an_interpreter_does() -> None:
    """What a forked rank's exit would skip: multiprocessing ends its fork children with
    ``os._exit``, past the interpreter's shutdown. Its Python part runs here, in its order:
    wait for the threads that are not daemons, then the ``atexit`` handlers, so that a rank
    that would hang or abort at exit still shows it in its exit status. (C++ static destructors
    run only at a real exit: :mod:`qcomm.testing.exits` checks those.)"""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def _child(rank: int, world_size: int, store_ports: Any, env: dict[str, str],
           pg_timeout_s: float, tasks: Any, results: Any, forked: bool) -> None:
    """One rank: join the Gloo group, then run ``(task id, fn, args)`` from ``tasks`` until
    None, putting ``(task id, rank, ok, pickled value or traceback)`` on ``results``; then,
    ``forked``, leave as :func:`_leave_as_an_interpreter_does` says."""
    # A forked rank holds the server's environment, from when it started: the parent's as it
    # is now replaces it, as a spawned rank would have inherited it.
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes on few cores: oversubscription makes tests crawl
    try:
        _join(rank, world_size, store_ports, pg_timeout_s)
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    # Every call starts from the state a fresh world would have: the default generator as
    # after start-up (a body may seed or restore it) and one thread.
    rng = torch.get_rng_state()
    try:
        while (task := tasks.get()) is not None:
            task_id, fn, args = task
            torch.set_rng_state(rng)
            torch.set_num_threads(1)
            try:
                value = fn(rank, world_size, *args)
                # Plain pickle, not the queue's: torch.multiprocessing would send tensors as
                # shared-memory handles the parent fetches from this process, which may have
                # exited by then.
                results.put((task_id, rank, True, pickle.dumps(value)))
            except BaseException:  # report everything, including SystemExit from a helper
                results.put((task_id, rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if forked:
        _leave_as_an_interpreter_does()


class WorldPool:
    """A Gloo world of ``world_size`` processes that runs one function after another.

    Args:
        world_size: number of processes.
        pg_timeout_s: the process group's own timeout for collectives.
        env: extra environment variables for the children.

    The processes start on the first :meth:`run` (and again after a failure broke the pool).
    """

    def __init__(self, world_size: int, *, pg_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store_ports: Any = None
        self._ids = itertools.count()
        self._stopping = False
        self.starts = 0  # how many times a world was started (tests of the pool read it)

    def _start(self) -> None:
        ctx = _start_context()
        forked = ctx.get_start_method() == "forkserver"
        self._store_ports = ctx.Queue()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_child, args=(r, self.world_size, self._store_ports,
                                              {**os.environ, **self.env},
                                              self.pg_timeout_s, self._tasks[r],
                                              self._results, forked), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._stopping = False
        self.starts += 1

    def run(self, fn: Callable[..., Any], *, args: tuple = (), timeout_s: float = 120.0,
            allow_exit: set[int] | None = None, last: bool = False) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the values by rank.

        Args:
            fn: module-level function; its return value must be picklable (tensors are fine:
                they are pickled by value).
            args: extra positional arguments (picklable).
            timeout_s: wall-clock limit for this call; past it the pool is broken.
            allow_exit: ranks allowed to die without reporting (their result is None); a
                death breaks the pool all the same.
            last: the processes leave as soon as they are done with this call (each shuts
                down while the others finish, as a one-shot world does; :func:`run_world`).

        Raises:
            WorldError: a rank raised, died, or the call ran past ``timeout_s``. The pool is
                then closed; the next call starts a fresh world.
        """
        if self._stopping:  # a previous call was the last one
            self.close()
        if not self._procs:
            self._start()
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, tuple(args)))
        if last:
            self.request_stop()
        expected = set(range(self.world_size)) - set(allow_exit or ())
        values, failures = self._collect(task_id, expected, timeout_s)
        # A death breaks the pool, but after the last call the ranks leave on purpose: their
        # exit codes are for close() to return (closed here, a rank that reported and then
        # aborted while leaving would go unseen).
        died = [] if last else [r for r, p in enumerate(self._procs) if p.exitcode is not None]
        if failures or died:
            self.close(kill=True)
        if failures:
            raise WorldError("\n".join(failures))
        return [values.get(r) for r in range(self.world_size)]

    def _collect(self, task_id: int, expected: set[int], timeout_s: float
                 ) -> tuple[dict[int, Any], list[str]]:
        """Values of ``task_id`` by rank, and what went wrong (stops at the first failure)."""
        values: dict[int, Any] = {}
        failures: list[str] = []
        deadline = time.monotonic() + timeout_s

        def take(item: tuple) -> None:
            tid, rank, ok, value = item
            if tid not in (task_id, None):
                return  # a late answer to a call that already failed (cannot happen: killed)
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures.append(f"rank {rank}:\n{value}")

        while expected - set(values) and not failures:
            try:
                take(self._results.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            dead = [r for r in expected - set(values)
                    if self._procs[r].exitcode is not None]
            if dead:
                # Drain what reached the queue before deciding they died silently.
                try:
                    while True:
                        take(self._results.get(timeout=0.5))
                except queue.Empty:
                    pass
                failures += [f"rank {r} died with exit code {self._procs[r].exitcode}"
                             for r in dead if r not in values]
            elif time.monotonic() > deadline:
                missing = sorted(expected - set(values))
                failures.append(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        return values, failures

    def request_stop(self) -> None:
        """Ask every process to leave after its current call (what :meth:`close` waits for;
        several pools stop in parallel when all are asked first)."""
        if not self._stopping:
            for q in self._tasks:
                q.put(None)
            self._stopping = True

    def kill_ranks(self, ranks: list[int]) -> None:
        """Kill these ranks' processes now (the rest are left to :meth:`close`)."""
        for r in ranks:
            if self._procs and self._procs[r].exitcode is None:
                self._procs[r].kill()
                self._procs[r].join(timeout=5)

    def close(self, *, kill: bool = False, leave_s: float = 5.0) -> list[int | None]:
        """Stop the processes (after their current call, unless ``kill``); returns their exit
        codes. A process still there ``leave_s`` seconds after it was asked to leave is killed
        (its code is then -9). The pool can be used again: the next :meth:`run` starts a fresh
        world."""
        if not kill:
            self.request_stop()
        deadline = time.monotonic() + leave_s
        for p in self._procs:
            if kill:
                p.kill()
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        codes = [p.exitcode for p in self._procs]
        # The queues are dropped only now: one dropped while its feeder thread still holds a
        # stop message would never deliver it.
        self._procs, self._tasks, self._results, self._store_ports = [], [], None, None
        return codes

    def __enter__(self) -> WorldPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorldPools:
    """One :class:`WorldPool` per world size, started on first use: what a test session keeps
    (``tests/conftest.py``'s ``gloo`` fixture) so that every multi-process test of a given size
    runs in the same processes."""

    def __init__(self, *, pg_timeout_s: float = 60.0) -> None:
        self.pg_timeout_s = pg_timeout_s
        self.pools: dict[int, WorldPool] = {}

    def run(self, fn: Callable[..., Any], world_size: int, *, args: tuple = (),
            timeout_s: float = 120.0) -> list[Any]:
        """:meth:`WorldPool.run` on the pool of ``world_size`` processes."""
        pool = self.pools.get(world_size)
        if pool is None:
            pool = self.pools[world_size] = WorldPool(world_size,
                                                      pg_timeout_s=self.pg_timeout_s)
        return pool.run(fn, args=args, timeout_s=timeout_s)

    def close(self) -> None:
        """Stop every pool. Their processes sit idle between calls, so they are killed rather
        than asked to shut down (which costs seconds per world in ``destroy_process_group`` and
        interpreter exit, for nothing: no call is in flight)."""
        for pool in self.pools.values():
            pool.close(kill=True)
        self.pools.clear()


# How long run_world(check_exit=True) lets a rank that reported take to leave before it is
# killed and counted as a failure (its interpreter exit, destroy_process_group included).
CHECKED_LEAVE_S = 30.0


def run_world(fn: Callable[..., Any], world_size: int, *, args: tuple = (),
              timeout_s: float = 120.0, pg_timeout_s: float = 60.0,
              env: dict[str, str] | None = None, allow_exit: set[int] | None = None,
              check_exit: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes over Gloo.

    Args:
        fn: module-level function; its return value must be picklable (tensors are fine: they
            are pickled by value).
        world_size: number of processes.
        args: extra positional arguments (picklable).
        timeout_s: wall-clock limit for the whole world; past it every process is killed.
        pg_timeout_s: the process group's own timeout for collectives.
        env: extra environment variables for the children.
        allow_exit: ranks allowed to die without reporting (tests that kill a peer on purpose);
            their result is None.
        check_exit: also fail (the default) when a rank that reported its result then exited
            abnormally (e.g. aborted in ``destroy_process_group``, or still there
            ``CHECKED_LEAVE_S`` after its result); ranks in ``allow_exit`` excepted. (A
            training script that aborts at exit fails its job under torchrun although its
            work was done.)

    Returns:
        The per-rank return values, in rank order.

    Raises:
        WorldError: a rank raised, died, or the world ran past ``timeout_s``.
    """
    pool = WorldPool(world_size, pg_timeout_s=pg_timeout_s, env=env)
    values = pool.run(fn, args=args, timeout_s=timeout_s, allow_exit=allow_exit, last=True)
    # A rank allowed to die that did not report may be hung (stopped, or stuck in a collective
    # with the dead): nothing will come from it, and waiting for it to leave only delays the
    # others' exit, which its open sockets can hold up.
    pool.kill_ranks([r for r in (allow_exit or ()) if values[r] is None])
    # nothing left to do when a death already closed it
    codes = pool.close(kill=False, leave_s=CHECKED_LEAVE_S if check_exit else 5.0)
    if check_exit and codes:
        bad = [f"rank {r} reported, then exited with code {c}" for r, c in enumerate(codes)
               if r not in (allow_exit or set()) and c != 0]
        if bad:
            raise WorldError("\n".join(bad))
    return values
