"""Topology: the layout arithmetic (pure), the env rules, and the groups it creates (Gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.primitives import all_gather_flat
from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import resolve_group

# (world_size, procs_per_node): 2 nodes x 2, 3 x 1, 4 x 1, 1 node x 2, and bigger pure shapes.
SHAPES = [(4, 2), (3, 1), (4, 1), (2, 2), (1, 1), (6, 3), (6, 2), (8, 4), (12, 3)]
# Over Gloo (session-wide worlds of the `gloo` fixture): every multi-process shape of the suite.
WORLD_SHAPES = [(4, 2), (3, 1), (4, 1), (2, 2)]


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("world", "ppn"), SHAPES)
def test_each_rank_sits_node_major_and_meets_its_rail_in_itself(clean_env, world, ppn):
    nodes = world // ppn
    for r in range(world):
        t = Topology(ppn, rank=r, world_size=world)
        assert (t.rank, t.world_size, t.procs_per_node, t.num_nodes) == (r, world, ppn, nodes)
        assert (t.node, t.local_rank) == (r // ppn, r % ppn)
        assert t.node_ranks == [t.node * ppn + i for i in range(ppn)]
        assert t.rail_ranks == [n * ppn + t.local_rank for n in range(nodes)]
        assert [t.rail_rank(n) for n in range(nodes)] == t.rail_ranks
        assert set(t.node_ranks) & set(t.rail_ranks) == {r}


@pytest.mark.parametrize(("world", "ppn"), SHAPES)
def test_nodes_and_rails_partition_the_ranks_alike_on_every_rank(clean_env, world, ppn):
    topos = [Topology(ppn, rank=r, world_size=world) for r in range(world)]
    node_sets = {tuple(t.node_ranks) for t in topos}
    rail_sets = {tuple(t.rail_ranks) for t in topos}
    assert sorted(r for s in node_sets for r in s) == list(range(world))
    assert sorted(r for s in rail_sets for r in s) == list(range(world))
    assert len(node_sets) == world // ppn and len(rail_sets) == ppn
    for t in topos:
        assert [tuple(t.ranks_of_node(n)) for n in range(world // ppn)] == sorted(node_sets)
        assert [tuple(t.ranks_of_rail(i)) for i in range(ppn)] == sorted(rail_sets)


def test_single_process_needs_no_process_group(clean_env):
    t = Topology(1, rank=0, world_size=1)
    assert t.intra_group is None and t.rail_group is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"procs_per_node": 3, "world_size": 4, "rank": 0}, ValueError,
         r"world_size=4 is not divisible by procs_per_node=3"),
        ({"procs_per_node": 0, "world_size": 4, "rank": 0}, ValueError, "procs_per_node"),
        ({"procs_per_node": -2, "world_size": 4, "rank": 0}, ValueError, "procs_per_node"),
        ({"procs_per_node": 2.0, "world_size": 4, "rank": 0}, TypeError, "procs_per_node"),
        ({"procs_per_node": True, "world_size": 4, "rank": 0}, TypeError, "procs_per_node"),
        ({"procs_per_node": 2, "world_size": 4, "rank": 4}, ValueError, "rank"),
        ({"procs_per_node": 2, "world_size": 4, "rank": -1}, ValueError, "rank"),
        ({"procs_per_node": 1, "world_size": 0, "rank": 0}, ValueError, "world_size"),
        ({"procs_per_node": 1}, ValueError, "world_size is unknown"),
        ({"procs_per_node": 1, "world_size": 2}, ValueError, "rank is unknown"),
    ],
)
def test_bad_shapes_raise(clean_env, kwargs, error, match):
    with pytest.raises(error, match=match):
        Topology(**kwargs)


def test_bad_layout_queries_raise(clean_env):
    t = Topology(2, rank=1, world_size=4)
    with pytest.raises(ValueError, match="node"):
        t.rail_rank(2)
    with pytest.raises(ValueError, match="local_rank"):
        t.ranks_of_rail(2)


def test_torchrun_environment(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    t = Topology()
    assert (t.rank, t.world_size, t.procs_per_node, t.node, t.local_rank) == (5, 8, 4, 1, 1)
    # Explicit procs_per_node wins over the environment (emulating nodes on one machine).
    t = Topology(2)
    assert (t.procs_per_node, t.num_nodes, t.node, t.local_rank) == (2, 4, 2, 1)


def test_without_local_world_size_every_process_is_a_node(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "3")
    t = Topology()
    assert (t.procs_per_node, t.num_nodes, t.node, t.local_rank) == (1, 3, 2, 0)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LOCAL_WORLD_SIZE": "3"}, r"world_size=8 is not divisible by procs_per_node=3"),
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2"}, "not rank % LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "4"}, "LOCAL_RANK=4 must be < LOCAL_WORLD"),
        ({"LOCAL_WORLD_SIZE": "zero"}, "LOCAL_WORLD_SIZE must be an int"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE must be an int >= 1"),
    ],
)
def test_inconsistent_environment_raises(clean_env, env, match):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        Topology()


# ---------------------------------------------------------------------------------------------
# multi-process: the groups


def _members(group, rank: int) -> list[int]:
    """Global ranks of ``group`` in group-rank order, found by an all-gather over it."""
    size = dist.get_world_size(group)
    out = torch.empty(size, dtype=torch.int64)
    all_gather_flat(out, torch.tensor([rank]), resolve_group(group))
    return out.tolist()


def _groups_body(rank: int, world_size: int, ppn: int) -> dict:
    topo = Topology(ppn)
    # The constructor talked to nobody: no group yet.
    assert topo._groups is None
    intra, rail = topo.intra_group, topo.rail_group
    result = {"intra": None if intra is None else _members(intra, rank),
              "rail": None if rail is None else _members(rail, rank),
              "node_ranks": topo.node_ranks, "rail_ranks": topo.rail_ranks}
    # Same objects on later access (created once).
    assert topo.intra_group is intra and topo.rail_group is rail
    # A topology of another world fails clearly before any collective.
    wrong = Topology(1, rank=0, world_size=world_size + 1)
    try:
        _ = wrong.intra_group
    except RuntimeError as e:
        result["wrong_world"] = str(e)
    # Ranks that disagree on procs_per_node: every rank gets the same clear error (the check
    # is one all-gather at group creation), nobody hangs in mismatched groups.
    if world_size == 4:
        odd = Topology(2 if rank < 2 else 4)
        try:
            _ = odd.rail_group
        except ValueError as e:
            result["disagree"] = str(e)
    return result


@pytest.mark.parametrize(("world", "ppn"), WORLD_SHAPES)
def test_groups_and_rails_over_gloo(gloo, world, ppn):
    results = gloo.run(_groups_body, world, args=(ppn,))
    nodes = world // ppn
    for rank, res in enumerate(results):
        node, local = rank // ppn, rank % ppn
        expect_node = [node * ppn + i for i in range(ppn)]
        expect_rail = [n * ppn + local for n in range(nodes)]
        assert res["node_ranks"] == expect_node and res["rail_ranks"] == expect_rail
        assert res["intra"] == (expect_node if ppn > 1 else None)
        assert res["rail"] == (expect_rail if nodes > 1 else None)
        assert f"world_size {world + 1}" in res["wrong_world"]
        assert f"world_size {world}" in res["wrong_world"]
        if world == 4:
            assert "procs_per_node by rank = [2, 2, 4, 4]" in res["disagree"]
