"""Parameters that FSDP2 shards inside a node: which are accepted, and this rank's flat buffer.

``fully_shard(model, mesh=mesh["shard"])`` over a ``(nodes, procs_per_node)`` device mesh makes
every parameter a DTensor with one ``Shard(dim)`` placement on a 1-D mesh of the node's ranks,
in local-rank order: local rank l holds part l of every parameter, and after backward FSDP2's
reduce-scatter has left it the node's mean gradient of that part. Every node shards alike, so
local rank l of every node holds the same part: its rail is exactly that part's peers on the
other nodes. qcomm then averages nothing inside the node, each rank gossips its own local
parts, flattened (:class:`LocalShards`), with its rail, and the node's ranks never need each
other's parts.

Anything else is refused with :class:`ShardedParamsError`, naming what is allowed: a DTensor
over ranks of several nodes (its part has no copy on another node to be averaged with), over
another set or order of ranks, with another placement (Replicate, Partial, a strided shard) or
on a mesh of several dimensions (HSDP, tensor parallelism); DTensors mixed with plain tensors;
groups that are not torch.distributed's; and ``intra_bits`` (qcomm makes no gradient mean
inside the node to quantize). docs/engine.md, "Sharded models (FSDP2 inside a node)".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import TorchWorld
from qcomm.engine.flat import FlatParams
from qcomm.engine.options import CommOptions

__all__ = ["LocalShards", "ShardedParamsError", "check_sharding", "is_dtensor", "local_tensor"]

_ALLOWED = ("qcomm accepts DTensor parameters sharded over exactly the ranks of one node, in "
            "local-rank order, with one Shard(dim) placement: fully_shard(model, "
            "mesh=mesh['shard']) with mesh = init_device_mesh(device, (nodes, procs_per_node), "
            "mesh_dim_names=('replicate', 'shard'))")


class ShardedParamsError(ValueError):
    """DTensor parameters qcomm cannot communicate, or an option they cannot be combined with.

    Raised when the optimizer is built (and again at the first distributed step, which sees
    param groups added since), before anything communicates.
    """


def _dtensor_module() -> Any:
    """``torch.distributed.tensor`` when something imported it, else None: no DTensor can
    exist before it is, and importing it costs every job that uses none (about a second)."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (a ``torch.distributed.tensor.DTensor``)."""
    module = _dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` as a plain tensor sharing its storage (a view: writing it
    writes ``t``), detached; ``t`` itself when it is not a DTensor. Same dtype and device;
    shape: the local shard's (e.g. ``[ceil(rows / L), cols]`` or less for ``Shard(0)``)."""
    return t.to_local().detach() if is_dtensor(t) else t


def _tensors(groups: Iterable[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """``("group g, index i", tensor)`` for every tensor of ``groups``, each once. A group whose
    ``params`` is neither a tensor nor a list or tuple (a generator an ``add_param_group`` is
    about to consume) is skipped: the first distributed step checks it."""
    out, seen = [], set()
    for gi, group in enumerate(groups):
        params = group.get("params", ())
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, (list, tuple)):
            continue
        for pi, p in enumerate(params):
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                out.append((f"group {gi}, index {pi}", p))
    return out


def _check_placement(where: str, p: Any, node_ranks: list[int]) -> None:
    """ShardedParamsError unless DTensor ``p`` is one Shard over exactly ``node_ranks``."""
    mesh = p.device_mesh
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim != 1 or len(p.placements) != 1:
        raise ShardedParamsError(
            f"parameter ({where}) is a DTensor on a {mesh.ndim}-D mesh with placements "
            f"{tuple(p.placements)} (HSDP or tensor parallelism); {_ALLOWED}")
    if ranks != node_ranks:
        across = len({r // len(node_ranks) for r in ranks}) > 1
        why = ("it is sharded across nodes, so no other node holds a copy of this rank's part "
               "to average with" if across else "they are not all of the node's ranks in "
               "local-rank order, so local rank l of each node would not hold part l")
        raise ShardedParamsError(
            f"parameter ({where}) is a DTensor over ranks {ranks}, this node's ranks are "
            f"{node_ranks} (procs_per_node={len(node_ranks)}, from the option or "
            f"LOCAL_WORLD_SIZE): {why}; {_ALLOWED}")
    placement = p.placements[0]
    if type(placement) is not _dtensor_module().Shard:
        raise ShardedParamsError(
            f"parameter ({where}) is a DTensor with placement {placement!r} (only a plain "
            f"Shard(dim) gives each rank its own part, the one its rail averages); {_ALLOWED}")


def check_sharding(groups: Iterable[dict[str, Any]], options: CommOptions,
                   topology: Callable[[], Topology]) -> bool:
    """Whether the parameters of ``groups`` are FSDP2 shards of this node (no communication).

    Args:
        groups: param groups (dicts whose ``params`` hold tensors; other entries are ignored).
        options: the communication options (those that cannot work sharded are refused).
        topology: returns the job's layout; called only when a DTensor is present.

    Returns:
        True when every tensor is a DTensor sharded over exactly this node's ranks, False when
        none is a DTensor.

    Raises:
        ShardedParamsError: any other DTensor, a mix of DTensors and plain tensors, groups that
            are not torch.distributed's, or ``intra_bits`` with DTensors.
    """
    tensors = _tensors(groups)
    sharded = [(w, p) for w, p in tensors if is_dtensor(p)]
    if not sharded:
        return False
    plain = [w for w, p in tensors if not is_dtensor(p)]
    if plain:
        raise ShardedParamsError(
            f"parameters ({sharded[0][0]}) and ({plain[0]}): DTensors mixed with plain tensors; "
            "shard the whole model (fully_shard on the root module too) or none of it")
    topo = topology()
    if not isinstance(topo.world, TorchWorld):
        raise ShardedParamsError(f"DTensor parameters need torch.distributed's process groups, "
                                 f"not the groups of {topo.world!r}")
    for where, p in sharded:
        _check_placement(where, p, topo.node_ranks)
    if options.intra_bits is not None:
        raise ShardedParamsError(
            f"intra_bits={options.intra_bits} with sharded parameters: FSDP2 averages the "
            "gradients inside the node (its reduce-scatter, in full precision or its "
            "MixedPrecisionPolicy's reduce_dtype), so qcomm has no gradient mean to quantize; "
            "set intra_bits=None")
    return True


class LocalShards(FlatParams):
    """The flat float32 buffer of this rank's local parts of DTensor parameters: one shard,
    the whole buffer (``[shard_numel]``, zero-padded to a multiple of ``align``), gossiped
    whole with the rail.

    Always a copy: FSDP2 all-gathers each parameter from its own (padded) storage, of which
    the local part is a view; making the parameter a view of this buffer instead would leave
    FSDP2 all-gathering the old values. A round copies the local parts in and its result back
    into them, in place.

    Args:
        params: the DTensor parameters (each once, in order), accepted by
            :func:`check_sharding`.
        align: shard length granularity (the codec block size times the fragments).
    """

    def __init__(self, params: Sequence[torch.Tensor], align: int) -> None:
        self.sharded_params = list(params)
        super().__init__([local_tensor(p) for p in self.sharded_params], 1, align, alias=False)

    def check_aliased(self) -> None:
        """Take each parameter's local part again (before every round and average): FSDP2 may
        have replaced it since (``load_state_dict(assign=True)`` re-registers the parameters),
        and writes must reach the storage it all-gathers from.

        Raises:
            RuntimeError: a local part changed shape or dtype (the flat layout is fixed).
        """
        fresh = [local_tensor(p) for p in self.sharded_params]
        for old, new in zip(self.params, fresh, strict=True):
            if old.shape != new.shape or old.dtype != new.dtype:
                raise RuntimeError(
                    f"a sharded parameter's local part changed from {tuple(old.shape)} "
                    f"{old.dtype} to {tuple(new.shape)} {new.dtype} after the first "
                    "distributed step; the communicated layout is fixed then")
        self.params = fresh
