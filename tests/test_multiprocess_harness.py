import atexit
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.testing import multiprocess
from qcomm.testing.multiprocess import (
    CHECKED_LEAVE_S,
    WorldError,
    WorldPool,
    free_ports,
    run_world,
)


def _sum_ranks(rank: int, world_size: int, n: int) -> float:
    t = torch.full((n,), float(rank))
    dist.all_reduce(t)
    return float(t[0])


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on purpose")


def _rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def _rank1_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)


def test_run_world_returns_per_rank_values():
    assert run_world(_sum_ranks, 3, args=(4,), timeout_s=60) == [3.0, 3.0, 3.0]


def test_run_world_reports_a_rank_exception():
    with pytest.raises(WorldError, match="boom on purpose"):
        run_world(_rank1_raises, 2, timeout_s=60)


def test_run_world_reports_a_dead_rank():
    with pytest.raises(WorldError, match="rank 1 died with exit code 3"):
        run_world(_rank1_exits, 2, timeout_s=60)


def _rank1_stops(rank: int, world_size: int) -> float | None:
    """Rank 0 returns when it is done (``time.monotonic()``: one clock for every process of
    the machine); rank 1 stops itself instead."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive and silent: never reports, never leaves
    return time.monotonic()


def test_a_silent_rank_allowed_to_die_is_killed_not_waited_for():
    values = run_world(_rank1_stops, 2, timeout_s=60, allow_exit={1}, check_exit=True)
    assert values[1] is None
    # From rank 0's result to the return. Waited for, the stopped rank would hold close() for
    # CHECKED_LEAVE_S (30 s) and then be killed; killed at once, what is left is rank 0's own
    # exit (destroy_process_group beside a killed peer, interpreter shutdown): 0.36-0.65 s in
    # six runs on an idle machine, 6.0 s once in CI with two test workers. Timed from the
    # body's end, not from the call: the world's start-up (spawning, importing torch) took up
    # to 5.4 s at a load of 24.
    assert time.monotonic() - values[0] < CHECKED_LEAVE_S / 2


def test_run_world_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(WorldError, match="did not finish within 5 s"):
        run_world(_rank0_hangs, 2, timeout_s=5)
    assert time.monotonic() - start < 30


def _returns_tensor(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def test_run_world_returns_tensors_by_value():
    """Tensors come back by value even though the children have exited."""
    out = run_world(_returns_tensor, 2, timeout_s=60)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3]


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def test_pool_runs_many_calls_in_one_world():
    with WorldPool(2) as pool:
        first = pool.run(_pid)
        assert pool.run(_sum_ranks, args=(2,)) == [1.0, 1.0]
        assert pool.run(_pid) == first and pool.starts == 1


def test_pool_restarts_after_a_failure():
    with WorldPool(2) as pool:
        first = pool.run(_pid)
        with pytest.raises(WorldError, match="boom on purpose"):
            pool.run(_rank1_raises)
        second = pool.run(_pid)
        assert pool.starts == 2 and set(first).isdisjoint(second)
        assert pool.run(_sum_ranks, args=(3,)) == [1.0, 1.0]


def _rank1_aborts_at_exit(rank: int, world_size: int) -> int:
    if rank == 1:
        atexit.register(os.abort)  # after its result is in: only its exit status shows it
    else:
        time.sleep(1)  # rank 1 has left (aborted) before the world's last result is in
    return rank


def test_a_rank_that_aborts_after_reporting_fails_the_world() -> None:
    with pytest.raises(WorldError, match="rank 1 reported, then exited with code -6"):
        run_world(_rank1_aborts_at_exit, 2, timeout_s=60, check_exit=True)
    assert run_world(_rank1_aborts_at_exit, 2, timeout_s=60, check_exit=False) == [0, 1]


def test_a_world_starts_when_every_port_drawn_free_is_taken(monkeypatch) -> None:
    """Rank 0's store binds a port of the kernel's choosing: a port drawn free beforehand
    and taken by another process before the store binds it (another world's connection, a
    test running beside) cannot stop the world."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        monkeypatch.setattr(multiprocess, "free_port", lambda: port)
        monkeypatch.setattr(multiprocess, "free_ports", lambda count: [port] * count)
        assert run_world(_sum_ranks, 2, args=(2,), timeout_s=60) == [1.0, 1.0]
        with WorldPool(2) as pool:
            assert pool.run(_sum_ranks, args=(2,)) == [1.0, 1.0]


def test_free_ports_drawn_together_are_distinct_and_bindable() -> None:
    # Worlds started together each need their own store port: drawn one at a time and released
    # at once, the kernel may hand the same port out twice.
    # And below the kernel's ephemeral range, where no bind to port 0 (a Gloo device) and no
    # outgoing connection of another test can take one before it is used.
    ephemeral = multiprocess._first_ephemeral_port()
    for _ in range(20):
        ports = free_ports(6)
        assert len(set(ports)) == 6, ports
        assert all(1024 <= p < ephemeral for p in ports), (ports, ephemeral)
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))


def _env_and_cwd(rank: int, world_size: int) -> tuple[str | None, str | None, str]:
    return os.environ.get("QCOMM_TEST_SET"), os.environ.get("QCOMM_TEST_GONE"), os.getcwd()


def test_a_rank_takes_the_environment_and_directory_of_its_worlds_start(monkeypatch,
                                                                         tmp_path) -> None:
    """Ranks fork from a server started once (with the environment of that moment): a
    variable set or removed afterwards, and the working directory, are as the parent holds
    them when the world starts, as for a spawned rank."""
    monkeypatch.setenv("QCOMM_TEST_GONE", "before")
    assert run_world(_env_and_cwd, 2, timeout_s=60)[0][1] == "before"   # the server runs
    monkeypatch.delenv("QCOMM_TEST_GONE")
    monkeypatch.setenv("QCOMM_TEST_SET", "after")
    monkeypatch.chdir(tmp_path)
    assert run_world(_env_and_cwd, 2, timeout_s=60) == [("after", None, str(tmp_path))] * 2


def _rank1_leaves_a_thread_that_aborts(rank: int, world_size: int) -> int:
    if rank == 1:   # not a daemon: an interpreter's exit waits for it, and so does a rank's
        import threading

        threading.Thread(target=lambda: (time.sleep(0.5), os.abort())).start()
    return rank


def test_a_ranks_exit_waits_for_its_threads_that_are_not_daemons() -> None:
    with pytest.raises(WorldError, match="rank 1 reported, then exited with code -6"):
        run_world(_rank1_leaves_a_thread_that_aborts, 2, timeout_s=60, check_exit=True)
