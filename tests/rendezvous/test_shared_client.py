"""One store connection shared by a process's links
(:class:`~qcomm.rendezvous.shared_client.SharedClient`): a call waiting for a key that is not
there never holds up another thread's calls, a wait past its bound fails naming the keys, a Gloo
group of two is made over it by two threads that share it (over the bare client the first
end's wait would hold the connection the second end must publish on), and a
:class:`~qcomm.collectives.gloo.pair_group.PairGroup` makes all its links over one connection."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import qcomm.rendezvous.tunnel as tunnel
from qcomm.collectives.gloo.pair_group import PairGroup
from qcomm.rendezvous.seat import claim_incarnation
from qcomm.rendezvous.shared_client import SharedClient
from qcomm.testing.multiprocess import free_port


@pytest.fixture
def server():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield port, master


def _client(port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def test_a_get_waiting_for_a_missing_key_holds_up_no_other_call(server) -> None:
    port, master = server
    shared = SharedClient(_client(port), timeout_s=20)
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(shared.get("late")), daemon=True)
    waiter.start()
    time.sleep(0.2)   # the waiter is in its get
    start = time.monotonic()
    for i in range(20):   # another link's calls, on the same connection
        shared.set(f"k{i}", str(i))
        assert shared.add("count", 1) == i + 1
        assert shared.check([f"k{i}"])
    assert shared.compare_set("cas", "", "v") == b"v"
    assert time.monotonic() - start < 5.0
    assert waiter.is_alive() and got == []
    master.set("late", "here")
    waiter.join(10)
    assert got == [b"here"]
    shared.wait(["k0", "late"], datetime.timedelta(seconds=1))   # all there: at once
    assert shared.delete_key("k0") and not shared.check(["k0"])
    assert shared.num_keys() >= 20


def test_a_wait_past_its_bound_fails_naming_the_keys(server) -> None:
    port, _ = server
    shared = SharedClient(_client(port), timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="never-set"):
        shared.get("never-set")
    with pytest.raises(dist.DistStoreError, match="also-never"):
        shared.wait(["also-never"], datetime.timedelta(seconds=0.2))
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize(("kwargs", "match"), [({"timeout_s": 0}, "timeout_s"),
                                               ({"timeout_s": 1, "poll_s": -1}, "poll_s")])
def test_bad_arguments_are_named(server, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SharedClient(_client(server[0]), **kwargs)


def test_two_ends_of_a_gloo_group_share_one_connection(server) -> None:
    """Both ends in threads of one process over one connection: Gloo's rendezvous has each end
    publish its address, then wait for the other's; a blocking get on the bare client would
    hold the connection until its timeout and the other end could not publish."""
    port, _ = server
    shared = SharedClient(_client(port), timeout_s=20)
    out: dict[int, torch.Tensor] = {}

    def end(rank: int) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=20)
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pair/", shared), rank, 2, opts)
        t = torch.full((4,), float(rank + 1))
        (pg.send([t], 1, 0) if rank == 0 else pg.recv([t], 0, 0)).wait()
        out[rank] = t

    ends = [threading.Thread(target=end, args=(r,), daemon=True) for r in (0, 1)]
    start = time.monotonic()
    for t in ends:
        t.start()
    for t in ends:
        t.join(30)
    assert torch.equal(out[1], torch.full((4,), 1.0)), out
    assert time.monotonic() - start < 15.0


def test_a_pair_group_makes_all_its_links_over_one_connection(server, monkeypatch) -> None:
    """Member 0 of three links to 1 and 2 (each other end a PairGroup of its own in a thread):
    member 0 connects to the rendezvous once, however many links it makes."""
    port, master = server
    for m in range(3):
        claim_incarnation(master, m)
    made: list[int] = []
    real = tunnel.store_client

    def counted(host, p, timeout):
        made.append(threading.get_ident())
        return real(host, p, timeout)

    monkeypatch.setattr(tunnel, "store_client", counted)
    groups = [PairGroup(f"127.0.0.1:{port}", m, 3, timeout_s=20) for m in range(3)]
    channels: dict[tuple[int, int], object] = {}

    def link(m: int, peer: int) -> None:
        channels[(m, peer)] = groups[m].connect(peer, peer)

    pairs = [(0, 1), (1, 0), (0, 2), (2, 0)]
    threads = [threading.Thread(target=link, args=p, daemon=True) for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(channels) == sorted(pairs)
    assert len(made) == 3   # one per group: member 0's two links shared its one
    t = torch.arange(4.0)
    got = torch.zeros(4)
    send = channels[(0, 2)].isend(t, 7)
    channels[(2, 0)].irecv(got, 7).wait()
    send.wait()
    assert torch.equal(got, t)
    for c in channels.values():
        c.close()
