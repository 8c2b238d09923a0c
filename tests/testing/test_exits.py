"""The exit launcher reports how every forked rank really exited, through the interpreter's
normal shutdown (atexit handlers run), so an abort at exit cannot hide."""

from __future__ import annotations

import atexit
import os
import time

import torch
import torch.distributed as dist

from qcomm.testing.exits import describe_status, fresh_world_exits


def _sums(rank: int, world: int) -> None:
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [world * (world - 1) / 2] * 3


def _aborts_at_exit_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        atexit.register(os.abort)  # runs only if the child leaves through normal shutdown


def _raises_on_rank_0(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("from the body")


def _hangs_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(60)


def test_clean_worlds_exit_zero() -> None:
    assert fresh_world_exits(_sums, 3, runs=2, parallel=2, timeout_s=60) == [["exit 0"] * 3] * 2


def test_abort_during_shutdown_is_reported() -> None:
    statuses = fresh_world_exits(_aborts_at_exit_on_rank_1, 2, runs=2, timeout_s=60)
    assert statuses == [["exit 0", "signal 6 (SIGABRT)"]] * 2


def test_exception_in_body_is_exit_1() -> None:
    statuses = fresh_world_exits(_raises_on_rank_0, 2, runs=1, timeout_s=60, pg_timeout_s=5)
    assert statuses[0][0] == "exit 1"


def test_a_hung_rank_is_killed_and_reported() -> None:
    t0 = time.monotonic()
    statuses = fresh_world_exits(_hangs_on_rank_1, 2, runs=1, timeout_s=2, pg_timeout_s=2)
    assert statuses[0][1] == "timed out"
    assert time.monotonic() - t0 < 30


def test_describe_status() -> None:
    assert describe_status(0) == "exit 0"
    assert describe_status(3 << 8) == "exit 3"
    assert describe_status(9) == "signal 9 (SIGKILL)"
