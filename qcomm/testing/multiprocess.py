"""Run a function on N local processes joined by a Gloo process group, with a hard timeout.

For tests of collectives (ours and users' own): a bug fails within the timeout, never hangs.

    def body(rank: int, world_size: int, n: int) -> float:
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t[0].item()

    assert run_world(body, 4, args=(8,)) == [6.0] * 4

``fn`` must be importable by the child processes (defined at module level), since they are
started with the "spawn" method (fork after torch initialized its thread pools can deadlock).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class WorldError(RuntimeError):
    """One or more ranks failed or did not finish in time; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
           env: dict[str, str], pg_timeout_s: float, results: Any) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes on few cores: oversubscription makes tests crawl
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        # Plain pickle, not the queue's: torch.multiprocessing would send tensors as
        # shared-memory handles the parent fetches from this process, which may have exited.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit from a test helper
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *, args: tuple = (),
              timeout_s: float = 120.0, pg_timeout_s: float = 60.0,
              env: dict[str, str] | None = None, allow_exit: set[int] | None = None,
              check_exit: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes over Gloo.

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
        check_exit: also fail when a rank that reported its result then exited abnormally
            (e.g. aborted in ``destroy_process_group``); ranks in ``allow_exit`` excepted.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        WorldError: a rank raised, died, or the world ran past ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, env or {}, pg_timeout_s,
                                         results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    allow_exit = allow_exit or set()
    values: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    expected = set(range(world_size)) - allow_exit
    while expected - set(values) and not failures:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r in expected - set(values)
                    if procs[r].exitcode is not None and procs[r].exitcode != 0]
            if dead:
                # Drain what reached the queue before deciding they died silently.
                try:
                    while True:
                        rank, ok, value = results.get(timeout=0.5)
                        if ok:
                            values[rank] = pickle.loads(value)
                        else:
                            failures.append(f"rank {rank}:\n{value}")
                except queue.Empty:
                    pass
                dead = [r for r in dead if r not in values]
                failures += [f"rank {r} died with exit code {procs[r].exitcode}" for r in dead]
            elif time.monotonic() > deadline:
                missing = sorted(expected - set(values))
                failures.append(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            continue
        if ok:
            values[rank] = pickle.loads(value)
        else:
            failures.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=5 if not failures else 0.5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if check_exit:
        failures += [f"rank {r} reported, then exited with code {p.exitcode}"
                     for r, p in enumerate(procs) if r not in allow_exit and p.exitcode != 0]
    if failures:
        raise WorldError("\n".join(failures))
    return [values.get(r) for r in range(world_size)]
