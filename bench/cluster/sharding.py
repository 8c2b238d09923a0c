"""FSDP2 inside the node for the cluster benchmark's ``--fsdp`` runs: the mesh, the sharding, the
whole model back from its shards, and the mean of the shards between nodes.

A ``--fsdp`` run shards the (identically seeded) model over each node's ranks the way
torchtitan does: every repeated layer, then the root, ``fully_shard`` over a mesh of the
cluster's ``(nodes, procs)`` ranks named ``("replicate", "shard")``. What lies between the nodes
is the method's:

- ``hsdp`` (torch's own): ``fully_shard`` over the whole 2-D mesh, FSDP2's hybrid sharding:
  gradients reduce-scattered inside the node, then each rank's shard allreduced in fp32 with the
  same rank of every other node, every step;
- qcomm (``qcomm-hier-*``): ``fully_shard`` over the "shard" dimension only; the optimizer
  gossips each rank's local shards with the same local rank of the other nodes;
- torchft's DiLoCo: ``fully_shard`` over the "shard" dimension; torchft's manager allreduces each
  rank's local shards of the pseudo-gradient on its rail (torchft handles DTensor parameters);
- ``torchft-hsdp`` (torchft's fault-tolerant HSDP, as torchtitan wires it): ``fully_shard`` over
  the "shard" dimension, each reduce-scattered gradient shard allreduced between nodes by
  torchft's manager from FSDP2's all-reduce hook, every step.

Snapshots and the final model are whole: :func:`full_state` all-gathers the shards inside the
node (a collective of the node's ranks, taken at steps every rank takes).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path (it says it is a library): the repository root first on sys.path, so that
    # `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.training import Layout

# What --fsdp gives each method: where its mesh shards (None: the method has no sharded form).
# "mesh": FSDP2's hybrid sharding over the whole (replicate, shard) mesh; "shard": FSDP2 over
# the node's ranks, the method between nodes.
SHARDED_FORMS = {"hsdp": "mesh", "torchft-hsdp": "shard", "torchft-diloco": "shard",
                 "torchft-streaming-diloco": "shard", "qcomm-hier": "shard"}
# The methods that only exist sharded (HSDP, torch's and torchft's).
SHARDED_ONLY = ("hsdp", "torchft-hsdp")


def repeated_layers(module: Any) -> list[Any]:
    """The layers FSDP2 shards one by one before the root: the parameter-holding children of
    ``module``'s ``Sequential`` / ``ModuleList`` containers (a transformer's blocks, an MLP's
    linear layers), in order."""
    from torch import nn

    containers = nn.Sequential | nn.ModuleList
    # A model that is itself a container (an MLP) is its own list of layers.
    lists = [module] if isinstance(module, containers) else \
        [c for c in module.children() if isinstance(c, containers)]
    return [m for lst in lists for m in lst.children() if any(True for _ in m.parameters())]


def node_mesh(layout: Layout) -> Any:
    """The cluster's ranks as a ``(nodes, procs)`` device mesh named ``("replicate",
    "shard")``: node-major, so a node's ranks are one row (collective: every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (layout.nodes, layout.procs),
                            mesh_dim_names=("replicate", "shard"))


def shard(module: Any, layout: Layout, form: str) -> Any:
    """``module`` sharded in place by FSDP2: each of :func:`repeated_layers`, then the root,
    over the whole mesh (``form="mesh"``: hybrid sharding) or its "shard" dimension
    (``form="shard"``: inside the node only). Returns ``module``.

    Raises:
        ValueError: ``form`` is neither.
    """
    from torch.distributed.fsdp import fully_shard

    if form not in ("mesh", "shard"):
        raise ValueError(f"form must be 'mesh' or 'shard', got {form!r}")
    mesh = node_mesh(layout)
    over = mesh if form == "mesh" else mesh["shard"]
    for layer in repeated_layers(module):
        fully_shard(layer, mesh=over)
    fully_shard(module, mesh=over)
    return module


def is_sharded(module: Any) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP2 sharded it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state(module: Any) -> dict[str, Any]:
    """``module``'s state dict with every DTensor gathered whole (a detached CPU copy of each
    entry). Collective over the ranks each DTensor spans: every one of them calls it at the same
    step."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in module.state_dict().items():
        # full_tensor() returns a new tensor already; a plain entry (a buffer) is copied.
        out[key] = value.full_tensor().detach() if isinstance(value, DTensor) \
            else value.detach().clone()
    return out


def average_rails(module: Any, layout: Layout, rails: list[Any] | None = None) -> None:
    """Every rank's local shards <- their mean over the nodes (the same local rank of every
    node holds the same shard): the whole model's average, in its sharded form. ``rails``: the
    rails' process groups (:func:`rail_groups`), made here when None (collective: every rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rails = rail_groups(layout) if rails is None else rails
    mine = rails[dist.get_rank() % layout.procs]
    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p.data
            dist.all_reduce(local, group=mine)
            local.div_(layout.nodes)


def rail_groups(layout: Layout) -> list[Any]:
    """One process group per local rank, holding that local rank of every node (collective:
    every rank creates every group, in the same order)."""
    import torch.distributed as dist

    return [dist.new_group([n * layout.procs + r for n in range(layout.nodes)])
            for r in range(layout.procs)]


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/sharding.py is a library of the cluster benchmark (FSDP2 inside the node "
        "for --fsdp runs), imported by methods.py, torchft_methods.py and workload.py; it runs "
        "nothing. See bench/cluster/README.md."
    )
