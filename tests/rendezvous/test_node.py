"""A node linked through the rendezvous (:mod:`qcomm.rendezvous.node`): its seat (given, taken
back by its torchrun run, or in order of arrival), its incarnation, its world, and bad input
named before anything changes. Seats on a store in this process; the node groups in processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

from qcomm.collectives.gloo.pair_group import PairGroup
from qcomm.collectives.linked_world import LinkedWorld
from qcomm.rendezvous import init_node, linked_seat
from qcomm.rendezvous.node import LinkedSeat, _take
from qcomm.testing.multiprocess import free_port
from tests.rendezvous.test_launch import ENV

SEAT = ("import sys; from qcomm.rendezvous import init_node, linked_seat; "
        "node = None if sys.argv[1] == '-' else int(sys.argv[1]); "
        "s = init_node(node_id=node, timeout_s=20); "
        "assert linked_seat() is s; import torch.distributed as dist; "
        "print('seat', s.node, s.rank, s.world_size, s.incarnation, dist.get_world_size(), "
        "s.joining, flush=True)")


def _node(address: str, node_id: int | None, **env: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-c", SEAT, "-" if node_id is None else str(node_id)],
                       env=dict(ENV, QCOMM_RENDEZVOUS=address, **env), capture_output=True,
                       text=True, timeout=60)
    return p.returncode, p.stdout if p.returncode == 0 else p.stdout + p.stderr


def test_seats_in_order_of_arrival_then_by_node_id_with_a_new_incarnation(rendezvous) -> None:
    address = rendezvous(2)
    # a node need not wait for the others: its links wait for them when they open
    assert _node(address, None) == (0, "seat 0 0 2 1 1 False\n")
    assert _node(address, None) == (0, "seat 1 1 2 1 1 False\n")
    code, out = _node(address, None)
    assert code != 0 and "every seat of this job's 2 nodes has been taken" in out, out
    assert "node_id=" in out   # it says how to come back
    assert _node(address, 1) == (0, "seat 1 1 2 2 1 True\n")   # comes back: incarnation 2
    assert _node(address, 1) == (0, "seat 1 1 2 3 1 True\n")


def test_a_job_that_may_grow_seats_later_nodes_beyond_its_start(rendezvous) -> None:
    address = rendezvous(1, max_nodes=2)
    assert _node(address, None) == (0, "seat 0 0 2 1 1 False\n")   # ring of 2 seats
    assert _node(address, None) == (0, "seat 1 1 2 1 1 True\n")    # beyond the start: joins
    code, out = _node(address, None)
    assert code != 0 and "every seat of this job's 2 nodes has been taken" in out, out


def test_a_torchrun_restart_takes_back_the_seat_its_run_held(monkeypatch) -> None:
    store = dist.HashStore()
    for var, value in (("TORCHELASTIC_RUN_ID", "run-a"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    assert _take(store, 3, "a/0", None) == 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    assert _take(store, 3, "b/0", None) == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")   # run a's workers, restarted
    assert _take(store, 3, "a/1", None) == 0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")            # a lone process: the next free one
    assert _take(store, 3, "lone", None) == 2


@pytest.mark.parametrize("node_id", [-1, 2, "0"])
def test_a_bad_node_id_is_named(rendezvous, node_id: object) -> None:
    address = rendezvous(2)
    code = ("from qcomm.rendezvous import init_node; import torch.distributed as dist; "
            f"init_node(node_id={node_id!r}, timeout_s=10)")
    p = subprocess.run([sys.executable, "-c", code], env=dict(ENV, QCOMM_RENDEZVOUS=address),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "node_id must be" in p.stderr, p.stderr


def test_no_address_and_no_rendezvous_are_named(monkeypatch) -> None:
    monkeypatch.delenv("QCOMM_RENDEZVOUS", raising=False)
    with pytest.raises(ValueError, match="QCOMM_RENDEZVOUS is not set"):
        init_node()
    port = free_port()
    with pytest.raises(TimeoutError, match=rf"no rendezvous at 127.0.0.1:{port}"):
        init_node(f"127.0.0.1:{port}", timeout_s=1)
    assert linked_seat() is None


def _seat(node: int = 1, nodes: int = 3, ppn: int = 2, local: int = 1) -> LinkedSeat:
    return LinkedSeat(node, nodes, node * ppn + local, nodes * ppn, ppn, 1, "127.0.0.1:1", 5.0,
                      nodes)


def test_the_world_of_linked_nodes_has_rails_of_pairs_and_no_group_over_the_job() -> None:
    world = LinkedWorld(_seat())
    assert world.job(None, None) == (3, 6)
    rails = world.new_groups([[2, 3], [1, 3, 5], [0, 2, 4]], 3)
    assert rails[0] is dist.group.WORLD and rails[2] is None
    rail = rails[1]
    assert isinstance(rail, PairGroup)
    assert (rail.rank, rail.size, rail.ranks, rail.name) == (1, 3, [1, 3, 5], "rail1")
    with pytest.raises(RuntimeError, match="no process group spans a job of linked nodes"):
        world.whole(3)
    with pytest.raises(RuntimeError, match="this Topology is rank 2 of 6, but the node's seat "
                                           "is rank 3 of 6"):
        world.check(2, 6)


def test_a_seat_that_listens_or_has_a_token_links_over_sockets_and_hides_the_token() -> None:
    from dataclasses import replace

    from qcomm.collectives.sockets import SocketGroup
    from qcomm.rendezvous.node import listen_of

    secret = "a-job-token-of-some-length"
    for seat in (replace(_seat(), listen="127.0.0.1:0"), replace(_seat(), token=secret)):
        rail = LinkedWorld(seat).new_groups([[1, 3, 5]], 3)[0]
        assert isinstance(rail, SocketGroup) and rail.ranks == [1, 3, 5]
        assert secret not in repr(seat)
    assert (rail.listener, rail.token) == (None, secret.encode())   # a token alone: dials out
    assert listen_of("0.0.0.0:29600", 2) == "0.0.0.0:29602"   # one port per local rank
    assert listen_of("127.0.0.1:0", 1) == "127.0.0.1:0"
    with pytest.raises(ValueError, match="listen must be 'HOST:PORT'"):
        listen_of("29600", 0)


def test_a_pair_group_names_ranks_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"ranks must list one global rank per member \(3\)"):
        PairGroup("127.0.0.1:1", 0, 3, ranks=[0, 2])
