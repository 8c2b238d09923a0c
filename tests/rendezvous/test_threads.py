"""torch's threads when nodes of one job share a machine (:mod:`qcomm.rendezvous.threads`): each
process takes its share of the cores when ``OMP_NUM_THREADS`` is unset, and leaves the user's
setting alone. The arithmetic and the hosts at the rendezvous here; two nodes on this machine,
each a process seated by ``init_node``, in processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from qcomm.rendezvous.threads import host_share, register_host, threads_for
from tests.rendezvous.test_launch import ENV


@pytest.mark.parametrize(("cores", "processes", "env", "threads"), [
    (16, 3, {}, 5),
    (16, 1, {}, None),                          # alone on its machine: torch's own choice
    (2, 3, {}, 1),                              # never below one
    (16, 3, {"OMP_NUM_THREADS": "4"}, None),    # the user's setting stands
    (16, 3, {"OMP_NUM_THREADS": ""}, 5),
])
def test_a_process_takes_its_share_of_the_cores_unless_the_user_chose(
        cores: int, processes: int, env: dict[str, str], threads: int | None) -> None:
    assert threads_for(cores, processes, env) == threads


@pytest.mark.parametrize(("name", "args"), [("cores", (0, 2)), ("processes", (4, 0)),
                                            ("cores", ("4", 2))])
def test_bad_counts_are_named(name: str, args: tuple) -> None:
    with pytest.raises((ValueError, TypeError), match=rf"{name} must be"):
        threads_for(*args, {})


def test_the_rendezvous_counts_the_processes_of_the_nodes_on_a_host() -> None:
    store = dist.HashStore()
    register_host(store, 0, 1, "a")
    register_host(store, 1, 1, "b")
    register_host(store, 3, 2, "a")             # seat 2 not taken yet
    assert host_share(store, 4, "a") == (3, [0, 3])
    assert host_share(store, 4, "b") == (1, [1])
    register_host(store, 0, 1, "b")             # node 0 came back on machine b
    assert host_share(store, 4, "a") == (2, [3])
    assert host_share(store, 4, "c") == (0, [])


SEATED = ("import os, torch; from qcomm.rendezvous import init_node; "
          "before = torch.get_num_threads(); init_node(timeout_s=20); "
          "print('threads', before, torch.get_num_threads(), len(os.sched_getaffinity(0)), "
          "flush=True)")


def _seated(address: str, **env: str) -> tuple[list[int], str]:
    base = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.run([sys.executable, "-c", SEATED], env=dict(base, QCOMM_RENDEZVOUS=address,
                       **env), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return [int(v) for v in p.stdout.split()[1:]], p.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_the_second_node_on_a_machine_shares_its_cores_and_says_how_to_choose(
        rendezvous) -> None:
    address = rendezvous(3)
    (before, after, cores), said = _seated(address)
    assert after == before and "share this machine" not in said   # alone so far
    (before, after, cores), said = _seated(address)
    share = max(1, cores // 2)
    assert after == min(before, share), said
    if share < before:
        assert "nodes [0, 1] of this job share this machine" in said, said
        assert f"OMP_NUM_THREADS={share}" in said and "nodes [0], seated before" in said, said
    (before, after, cores), said = _seated(address, OMP_NUM_THREADS="2")
    assert after == before == 2 and "share this machine" not in said, said
