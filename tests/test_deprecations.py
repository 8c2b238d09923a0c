"""Names that moved or were renamed keep working for one release, each with a
DeprecationWarning naming its replacement."""

from __future__ import annotations

import pickle

import pytest
import torch

from qcomm import seeds
from qcomm.collectives.gossip import CompressedGossip, GossipSimulator
from qcomm.collectives.gossip.transport import MemoryHub, MemoryTransport
from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.sgd import HierarchicalOptimizer
from qcomm.validation import check_seed


@pytest.mark.parametrize(("module", "name", "replacement"), [
    ("qcomm.collectives.primitives", "derive_seed", seeds.derive),
    ("qcomm.collectives.gossip.choco", "round_seed", seeds.gossip_message_seed),
    ("qcomm.kernels.counter_hash", "check_seed", check_seed),
    ("qcomm.kernels.counter_hash", "mix32_int", seeds.mix32),
])
def test_moved_functions_warn_and_still_work(module: str, name: str, replacement) -> None:
    import importlib

    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} is deprecated.*use qcomm"):
        old = getattr(mod, name)
    assert old is replacement
    with pytest.raises(AttributeError):
        _ = mod.no_such_name


def test_gossip_transport_keyword_is_deprecated() -> None:
    with pytest.warns(DeprecationWarning, match=r"transport=.*GossipSimulator"):
        g = CompressedGossip([0, 1], None, 256, transport=MemoryTransport(MemoryHub(2), 0, [1]))
    assert g.member == 0 and g.peers == [1]
    assert GossipSimulator(2, 256).members[1].member == 1  # the simulator: no warning


def _stats(rank: int, world: MemoryWorld) -> dict:
    model = torch.nn.Linear(4, 1)
    opt = HierarchicalOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), staleness=1,
                                layout=Topology(1, rank=rank, world_size=2, world=world))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt.stats()


def test_stats_gamma_and_its_deprecated_alias_gossip_step() -> None:
    world = MemoryWorld(2, timeout_s=30)
    for st in world.run(_stats, world):
        assert st["gamma"] == 0.3  # the default for 4 bits, staleness 1
        with pytest.warns(DeprecationWarning, match="'gossip_step' is deprecated.*'gamma'"):
            assert st["gossip_step"] == st["gamma"]
        with pytest.warns(DeprecationWarning):
            assert st.get("gossip_step") == 0.3
        assert type(pickle.loads(pickle.dumps(st))) is dict
