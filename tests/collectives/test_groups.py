"""One group interface, two implementations: the torch.distributed adapter (over Gloo, one
process per rank) and the in-memory world (one thread per rank) give every primitive the same
bits and count the same bytes, on the whole world, a node's group and a rail; both name the
same members. Then what only the in-memory world can show cheaply: a member that never arrives
times out, and abort breaks a wait at once.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from qcomm.collectives.errors import PeerTimeoutError
from qcomm.collectives.group import CommGroup
from qcomm.collectives.memory import MemoryGroup, MemoryWorld
from qcomm.collectives.primitives import (
    all_gather_flat,
    all_reduce,
    all_reduce_mean_future,
    all_to_all_single,
    start_all_gather,
    start_reduce_scatter,
    wait_works,
)
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import TorchGroup, resolve_group

CHUNK = 6  # elements per member in every collective
TIMEOUT_S = 30.0


def _values(rank: int, size: int, salt: int) -> torch.Tensor:
    """float32 ``[size * CHUNK]``, different per rank and call: multiples of 2**-10 below 1,
    so that any summation order gives the same bits (the all-reduce's order is the backend's
    own)."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-1024, 1024, (size * CHUNK,), generator=g).to(torch.float32) / 1024


def _primitives(rank: int, group: object, salt: int) -> dict:
    """Every primitive once on ``group`` (resolved once, as its callers do); what each
    produced, and the bytes counted."""
    g = resolve_group(group)
    n, out = g.size, {}
    out["members"] = (g.ranks, g.rank, g.other_ranks())
    for op in ("sum", "max", "min"):
        t = _values(rank, n, salt)
        all_reduce(t, g, op, timeout_s=TIMEOUT_S, link="intra")
        out[op] = t
    x = _values(rank, n, salt + 1)
    gathered = torch.empty(n * x.numel())
    all_gather_flat(gathered, x, g)
    out["all_gather"] = gathered
    swapped = torch.empty_like(x)
    all_to_all_single(swapped, x, g)
    out["all_to_all"] = swapped
    stats = CommStats()
    work, chunk_sum = start_reduce_scatter(x.clone(), g, n, stats, "intra")
    wait_works([work], TIMEOUT_S, "reduce-scatter", g, "intra")
    out["reduce_scatter"] = chunk_sum()
    whole = torch.empty(n * CHUNK)
    work = start_all_gather(whole, out["reduce_scatter"], g, n, stats, "intra")
    wait_works([work], TIMEOUT_S, "all-gather", g, "intra")
    out["all_gather_pipeline"] = whole
    out["bytes"] = stats.snapshot()
    out["mean_future"] = all_reduce_mean_future(_values(rank, n, salt + 2), g).wait()
    g.barrier()
    return out


def _every_group(rank: int, topo: Topology) -> dict:
    """The primitives on the world's group, my node's group and my rail (2 nodes x 2), as the
    topology holds them resolved (the same group as its handle, made a CommGroup once)."""
    assert topo.intra is topo.intra and topo.rail is topo.rail  # resolved once, then kept
    assert topo.intra.ranks == topo.node_ranks and topo.rail.ranks == topo.rail_ranks
    return {"world": _primitives(rank, topo.whole, 1),
            "intra": _primitives(rank, topo.intra, 2),
            "rail": _primitives(rank, topo.rail, 3)}


def _gloo_body(rank: int, world_size: int) -> dict:
    topo = Topology(2)
    assert isinstance(resolve_group(topo.rail_group), TorchGroup)
    return _every_group(rank, topo)


def _same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                           b.view(torch.uint8) if b.dtype != torch.bool else b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


def test_the_adapter_and_the_in_memory_group_give_the_same_bits_and_bytes(gloo) -> None:
    over_gloo = gloo.run(_gloo_body, 4)
    world = MemoryWorld(4, timeout_s=TIMEOUT_S)
    threads = torch.get_num_threads()
    try:
        in_memory = world.run(
            lambda r: _every_group(r, Topology(2, rank=r, world_size=4, world=world)))
    finally:
        torch.set_num_threads(threads)
    for rank, (a, b) in enumerate(zip(over_gloo, in_memory, strict=True)):
        _same(a, b, f"rank {rank}")
    # And the results are the collectives', not merely equal: rank 1's rail is [1, 3].
    rail = in_memory[1]["rail"]
    assert rail["members"] == ([1, 3], 0, [3])
    assert torch.equal(rail["sum"], _values(1, 2, 3) + _values(3, 2, 3))
    # reduce-scatter and all-gather each send (n - 1) * CHUNK float32s
    assert rail["bytes"]["bytes_sent"]["intra"] == 2 * (2 - 1) * CHUNK * 4


# ---------------------------------------------------------------------------------------------
# the in-memory world's failure semantics


def test_in_memory_groups_are_comm_groups_with_their_members() -> None:
    world = MemoryWorld(4, timeout_s=TIMEOUT_S)
    group = world.group([3, 1], 1)
    assert isinstance(group, CommGroup) and resolve_group(group) is group
    assert (group.ranks, group.rank, group.size, group.other_ranks()) == ([3, 1], 1, 2, [3])
    assert world.group([3, 1], 3).rank == 0
    with pytest.raises(ValueError, match="not a member"):
        world.group([3, 1], 0)


def test_a_member_that_does_not_arrive_times_out_naming_it() -> None:
    world = MemoryWorld(2, timeout_s=0.5)
    t = torch.ones(3)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        all_reduce(t, world.group([0, 1], 0), link="inter")
    assert 0.4 < time.monotonic() - start < 10
    assert info.value.peers == [1]


def test_abort_breaks_a_waiting_member_at_once() -> None:
    world = MemoryWorld(2, timeout_s=60)
    group: MemoryGroup = world.group([0, 1], 0)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            group.barrier()
        except BaseException as e:
            caught.append(e)

    thread = threading.Thread(target=wait, daemon=True)
    start = time.monotonic()
    thread.start()
    time.sleep(0.2)
    world.abort()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 10
    assert len(caught) == 1 and isinstance(caught[0], PeerTimeoutError)


@pytest.mark.parametrize("handle", [None, "group", 3])
def test_a_primitive_refuses_a_handle_it_would_resolve_again(handle: object) -> None:
    # The owner resolves a handle once (Topology.intra / .rail / .whole); a bare one here is a
    # caller that would pay the resolution on every step: named, before anything is posted.
    t = torch.ones(2)
    for call in (lambda: all_reduce(t, handle),
                 lambda: all_gather_flat(torch.empty(2), t, handle),
                 lambda: wait_works([], 1.0, "op", handle, None)):
        with pytest.raises(TypeError, match=r"group must be a qcomm.collectives.group.CommGroup "
                                            r"\(resolve a torch.distributed process group once"):
            call()
    assert torch.equal(t, torch.ones(2))


def test_a_primitive_names_a_group_class_passed_for_an_instance() -> None:
    with pytest.raises(TypeError, match=r"did you mean MemoryGroup\(\.\.\.\)\?"):
        all_reduce(torch.ones(2), MemoryGroup)


def test_a_topology_without_a_node_group_or_rail_holds_none() -> None:
    alone = Topology(1, rank=0, world_size=1, world=MemoryWorld(1))
    assert alone.intra is None and alone.rail is None  # "no group", never torch's default


def test_a_stepped_world_refuses_collectives_at_once() -> None:
    world = MemoryWorld(2, clock=lambda: 0.0)
    with pytest.raises(RuntimeError, match="stepped world has no collectives"):
        all_reduce(torch.ones(2), world.group([0, 1], 0))
    with pytest.raises(ValueError, match="delay needs a clock"):
        MemoryWorld(2, delay=lambda i, j: 1.0)
