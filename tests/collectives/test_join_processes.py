"""A member killed and started again as a new process joins the running wait-free gossip, over
links that are process groups of two made through the rendezvous (:mod:`qcomm.collectives.
pair_group`, :mod:`qcomm.rendezvous.joins`): three processes and a rendezvous on localhost."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qcomm.testing.join_world import member_command, wait_progress
from tests.rendezvous_thread import rendezvous_in_thread

REPO = Path(__file__).resolve().parents[2]


def _worker(member: int, port: int, steps: int, out: Path, *extra: str, size: int = 3,
            transport: str = "pairs", env: dict[str, str] | None = None,
            graph: str = "ring") -> subprocess.Popen:
    cmd = member_command(member, size, port, steps, out, "--transport", transport,
                         "--graph", graph)
    return subprocess.Popen([*cmd, *extra], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def rendezvous() -> Iterator[tuple[int, dist.Store]]:
    """A rendezvous on localhost (in a thread of this process): its port and a client."""
    with rendezvous_in_thread(client_timeout_s=10) as served:
        yield served


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    try:
        return [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize(("transport", "token"), [("pairs", None), ("sockets", None),
                                                  ("sockets", "the-job-token-0123456789")],
                         ids=["pairs", "sockets", "sockets-token"])
def test_a_killed_member_restarted_as_a_new_process_rejoins(
        tmp_path: Path, rendezvous: tuple[int, dist.Store], transport: str,
        token: str | None) -> None:
    """Over Gloo's pairs, and over TCP links on one port per process
    (:mod:`qcomm.collectives.sockets`), also with a job token (links encrypted, the joiner's
    state sealed): the same gossip, the same checks."""
    port, store = rendezvous
    # Enough steps that the joiner (a new process: torch imported, under load several
    # seconds) announces itself before its neighbours finish (seen over TCP links: 600 were
    # done before a joiner came).
    steps = 1000
    outs = [tmp_path / f"m{i}.pt" for i in range(3)]
    env = {"QCOMM_TOKEN": token} if token else None
    procs = [_worker(i, port, steps, outs[i], transport=transport, env=env) for i in range(3)]
    try:
        wait_progress(store, "progress/1/1", 100, 60)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        wait_progress(store, "progress/0/1", 200, 60)   # its neighbours went on without it
        procs[1] = _worker(1, port, steps, outs[1], "--join", transport=transport, env=env)
    finally:
        logs = _finish(procs, 120)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(map(str, logs))
    res = [torch.load(o, weights_only=True) for o in outs]
    assert res[1]["incarnation"] == 2
    for i, r in enumerate(res):
        assert r["live"] == 3 and r["lost"] == [], (i, r["lost"])
        assert r["peers"] == sorted({0, 1, 2} - {i}), (i, r["peers"])   # the ring is whole
    assert [r["losses"] for r in res] == [1, 0, 1]   # 0 and 2 saw 1 die; the joiner nothing
    # the ring sum is the same bits on every member, and the members agree
    assert all(torch.equal(r["sum"], res[0]["sum"]) for r in res)
    start = torch.stack([torch.randn(4096, generator=torch.Generator().manual_seed(i))
                         for i in range(3)])
    end = torch.stack([r["x"] for r in res])
    spread = lambda v: float((v - v.mean(0)).norm())
    assert spread(end) < 1e-2 * spread(start), (spread(end), spread(start))


@pytest.mark.parametrize("transport", ["pairs", "sockets"])
def test_twenty_visits_leave_no_thread_or_descriptor_behind(
        tmp_path: Path, rendezvous: tuple[int, dist.Store], transport: str) -> None:
    """Member 1 comes (a new incarnation that joins from member 0's state) and goes
    (``close()``: its goodbye closes member 0's link, no loss) 20 times while member 0 runs:
    member 0's OS threads and open file descriptors are the same after every visit as after
    the first (each link's group of two is aborted with the link). The worker starts torch's
    intra-op threads first: torch starts them lazily, and one appeared at the tenth visit
    otherwise (the count stayed at 3 through all 20 visits with one intra-op thread)."""
    port, _ = rendezvous
    host, visitor = tmp_path / "host.pt", tmp_path / "visitor.pt"
    procs = [_worker(0, port, 20, host, "--mode", "host", "--cycles", "20", size=2,
                     transport=transport),
             _worker(1, port, 20, visitor, "--mode", "visitor", "--cycles", "20", size=2,
                     transport=transport)]
    logs = _finish(procs, 300)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    res = torch.load(host, weights_only=True)
    # (threads, descriptors) after each visit left: the same after the 20th as after the first
    assert sorted(res["counts"]) == list(range(1, 21))
    assert set(res["counts"].values()) == {res["counts"][1]}, res["counts"]
    assert res["losses"] == 0   # every visit left with a goodbye: none was a loss
    assert logs[0].count("which joins") == 19   # visits 2-20 joined


@pytest.mark.parametrize("size", [4])
def test_a_retired_link_that_breaks_before_its_retire_exchange_ends_is_no_loss(
        tmp_path: Path, rendezvous: tuple[int, dist.Store], size: int) -> None:
    """Member 2 is killed and restarted; it joins between 1 and 3, which retire their link,
    and that link's connection breaks after 3 retired it and before 1 does (member 1 aborts
    its group of two, then admits the joiner: its retire never leaves, 3's may be lost): each
    end closes it as the retire exchange would have, no loss, and every live member ends on
    the whole ring with one model. Enough steps that no member ends before the join."""
    port, store = rendezvous
    steps = 1500
    outs = [tmp_path / f"m{i}.pt" for i in range(size)]
    # 3 admits only once 1 has seen the join, and 1 steps no more until its cut: however
    # loaded the machine, 3's retire is still unread on 1's side when the link breaks
    extra = {1: ("--cut-after-admit", "3"), 3: ("--admit-after", "1")}
    procs = [_worker(i, port, steps, outs[i], *extra.get(i, ()), size=size)
             for i in range(size)]
    try:
        wait_progress(store, "progress/2/1", 100, 60)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(10)
        wait_progress(store, "progress/1/1", 200, 60)   # its neighbours went on without it
        procs[2] = _worker(2, port, steps, outs[2], "--join", size=size)
    finally:
        logs = _finish(procs, 180)
    assert [p.returncode for p in procs] == [0] * size, "\n".join(map(str, logs))
    assert "closed its retired link to rank 1" in logs[3], logs[3]   # 1's retire never left
    res = [torch.load(o, weights_only=True) for o in outs]
    for i, r in enumerate(res):
        assert r["live"] == size and r["lost"] == [], (i, r["lost"])
        ring = {(i - 1) % size, (i + 1) % size}
        assert r["peers"] == sorted(ring), (i, r["peers"])
    # the only losses: 2's death, on 1 and 3 (the joiner and the others saw none)
    assert [r["losses"] for r in res] == [0, 1, 0, 1] + [0] * (size - 4)
    assert all(torch.equal(r["sum"], res[0]["sum"]) for r in res)
    start = torch.stack([torch.randn(4096, generator=torch.Generator().manual_seed(i))
                         for i in range(size)])
    end = torch.stack([r["x"] for r in res])
    spread = lambda v: float((v - v.mean(0)).norm())
    assert spread(end) < 1e-2 * spread(start), (spread(end), spread(start))


def test_on_the_one_peer_graph_a_killed_member_restarted_rejoins_on_new_links(
        tmp_path: Path, rendezvous: tuple[int, dist.Store]) -> None:
    """Four processes wait-free on the one-peer graph (OnePeerWaitFree over Gloo's pairs):
    member 1 is killed, its peers (0 and 3) drop it and sit out its rounds, it starts again
    as a new process and joins from a peer's state on new links; every member ends on all its
    links with one model, and the survivors' sum is the same bits on each."""
    port, store = rendezvous
    size, steps = 4, 1000   # the joiner (a new process) joins before the others end
    outs = [tmp_path / f"m{i}.pt" for i in range(size)]
    procs = [_worker(i, port, steps, outs[i], size=size, graph="one-peer-exp")
             for i in range(size)]
    try:
        wait_progress(store, "progress/1/1", 100, 60)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        wait_progress(store, "progress/0/1", 200, 60)   # its peers went on without it
        procs[1] = _worker(1, port, steps, outs[1], "--join", size=size, graph="one-peer-exp")
    finally:
        logs = _finish(procs, 150)
    assert [p.returncode for p in procs] == [0] * size, "\n".join(map(str, logs))
    res = [torch.load(o, weights_only=True) for o in outs]
    assert res[1]["incarnation"] == 2
    # every member took messages on every link of its schedule (1's peers are 0 and 3:
    # 1 XOR 1, 1 XOR 2), 0 and 3 on their new links to the joiner
    assert [sorted(r["peers"]) for r in res] == [[1, 2], [0, 3], [0, 3], [1, 2]]
    assert all(n > 0 for r in res for n in r["peers"].values()), [r["peers"] for r in res]
    assert res[0]["peers"][1] < res[0]["peers"][2] and res[3]["peers"][1] < res[3]["peers"][2]
    assert [r["losses"] for r in res] == [1, 0, 0, 1]   # 1's peers saw it die
    # the survivors' sum (flooding the links) counts the 4 and is the same bits on each
    assert [r["live"] for r in res] == [size] * size
    assert all(torch.equal(r["sum"], res[0]["sum"]) for r in res)
    start = torch.stack([torch.randn(4096, generator=torch.Generator().manual_seed(i))
                         for i in range(size)])
    end = torch.stack([r["x"] for r in res])
    spread = lambda v: float((v - v.mean(0)).norm())
    assert spread(end) < 1e-2 * spread(start), (spread(end), spread(start))
