"""Checkpoints of a model sharded by FSDP2 inside each node, through torch.distributed.checkpoint
(DCP): the format people with sharded models already use.

One DCP checkpoint (a directory every rank reaches) holds, per node, the model's and the wrapped
optimizer's sharded state dicts (torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``
under ``nodeNNNNN``: DTensor shards over the node's ranks) and, per rank, qcomm's own state under
``qcomm_rankNNNNN``: the engine's state (its gossip buffers hold this rank's shard), torch's RNG
state and ``extra``, as tensors only (:mod:`.tensor_tree`). Per node, because the gossip leaves
every node with parameters of its own: under one name DCP would take the nodes' shards for
copies of one another and keep one. A resume from it continues bit for bit, with the same
nodes and ranks per node.

Loading runs no code from the files: DCP unpickles what is not a tensor with
``weights_only=False``; here every such item goes through torch's weights-only unpickler (the
optimizer's param groups and numbers load, an object that would run code is refused with
:class:`~qcomm.checkpoint.checkpoint_file.UnsafeCheckpointError`), and qcomm's state is tensors
alone. The replicated modes keep their per-rank files (:mod:`qcomm.checkpoint.checkpoint`).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from qcomm.checkpoint.checkpoint_file import CheckpointError
from qcomm.checkpoint.optimizer import CheckpointableOptimizer
from qcomm.checkpoint.tensor_tree import from_tensors, to_tensors
from qcomm.validation import check_instance

__all__ = ["load_sharded_checkpoint", "save_sharded_checkpoint"]

# How a wrong optimizer is told what was expected (the one checkpointable class there is).
_OPTIMIZER = "a qcomm.sgd.hierarchical_optimizer.HierarchicalOptimizer"


def _dcp() -> ModuleType:
    """``torch.distributed.checkpoint``, with its ``state_dict`` functions, imported at the
    first sharded save or load: it imports DTensor and its op tables, a third of the time of
    ``import qcomm.sgd``, which a job with per-rank files never needs."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp.state_dict below)

    return dcp


def _keys(optimizer: CheckpointableOptimizer) -> tuple[str, str, int]:
    """This rank's node key, its own key and its rank (the engine's geometry)."""
    _, ppn, rank = optimizer.engine.geometry()
    return f"node{rank // ppn:05d}", f"qcomm_rank{rank:05d}", rank


def save_sharded_checkpoint(directory: str | os.PathLike, optimizer: CheckpointableOptimizer,
                            model: torch.nn.Module, *, extra: Any = None) -> Path:
    """Save the model, the optimizer and qcomm's state of every rank as one DCP checkpoint.
    Collective: every rank calls it at the same step (with ``wait_free`` it drains the gossip,
    as :func:`~qcomm.sgd.save_checkpoint` does).

    Args:
        directory: the checkpoint directory, reached by every rank (created if missing).
        optimizer: the :class:`~qcomm.sgd.HierarchicalOptimizer` (ASSGD included).
        model: the model its parameters belong to (FSDP2's ``fully_shard`` applied or not).
        extra: plain data (None, bool, int, float, str, tuples, lists, dicts, tensors) returned
            by :func:`load_sharded_checkpoint`, e.g. the step.

    Returns:
        the directory.

    Raises:
        TypeError: ``optimizer`` or ``model`` of the wrong type, or ``extra`` holding another
            type (named); nothing is written then.
    """
    check_instance("optimizer", optimizer, CheckpointableOptimizer, what=_OPTIMIZER)
    check_instance("model", model, torch.nn.Module)
    mine = to_tensors({"engine": optimizer.engine.state_dict(), "rng": torch.get_rng_state(),
                       "extra": extra})
    node_key, own_key, _ = _keys(optimizer)
    dcp = _dcp()
    state = {node_key: {"model": dcp.state_dict.get_model_state_dict(model),
                        "optim": dcp.state_dict.get_optimizer_state_dict(
                            model, optimizer.optimizer)},
             own_key: mine}
    dcp.save(state, checkpoint_id=str(directory))
    return Path(directory)


def _own_template(directory: Path, own_key: str, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors of the shapes and dtypes this rank's qcomm state was saved with.

    Raises:
        CheckpointError: the checkpoint holds no qcomm state of this rank, or one that is not
            tensors.
    """
    dcp = _dcp()
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{directory} is not a DCP checkpoint: {e}", directory) from e
    prefix = own_key + "."
    own = {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items()
           if k.startswith(prefix)}
    if not own:
        raise CheckpointError(f"{directory} holds no qcomm state of rank {rank} (saved by a "
                              "job of other ranks, or not by save_sharded_checkpoint)",
                              directory)
    if not all(isinstance(md, dcp.TensorStorageMetadata) for md in own.values()):
        raise CheckpointError(f"{directory}: qcomm's state of rank {rank} holds items that "
                              "are not tensors; it was not written by qcomm", directory)
    return {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in own.items()}


def _read(directory: Path, state: dict[str, Any]) -> None:
    """DCP's load of ``state`` from ``directory``, items that are not tensors through the
    weights-only unpickler; a refusal raised as itself, not wrapped in DCP's exception."""
    from qcomm.checkpoint.weights_only_planner import WeightsOnlyPlanner

    dcp = _dcp()
    try:
        dcp.load(state, checkpoint_id=str(directory), planner=WeightsOnlyPlanner(directory))
    except dcp.CheckpointException as e:
        for failure in e.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, CheckpointError):
                raise exc from e
        raise


def _copied(tree: Any) -> Any:
    """``tree`` with every tensor (DTensors included) replaced by a copy."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copied(v) for v in tree)
    return tree


def load_sharded_checkpoint(directory: str | os.PathLike, optimizer: CheckpointableOptimizer,
                            model: torch.nn.Module) -> Any:
    """Load a checkpoint of :func:`save_sharded_checkpoint` into ``model`` and ``optimizer``
    (built as when it was saved, before their first step) and restore this rank's RNG state.
    Collective: every rank calls it. Returns the ``extra`` saved.

    Raises:
        CheckpointError: not such a checkpoint, or of another job's ranks;
            UnsafeCheckpointError: an item whose unpickling would run code; ValueError: a
            qcomm state that does not match this optimizer (``HierarchicalOptimizer``'s
            checks). The model, the optimizer and the RNG are unchanged then: DCP reads into
            copies, which are loaded once everything is read and checked.
    """
    check_instance("optimizer", optimizer, CheckpointableOptimizer, what=_OPTIMIZER)
    check_instance("model", model, torch.nn.Module)
    directory = Path(directory)
    node_key, own_key, rank = _keys(optimizer)
    own = _own_template(directory, own_key, rank)
    # Read into copies (DCP writes into the tensors it is given): a refusal half-way changes
    # nothing of the model or the optimizer. torch's get_optimizer_state_dict creates the
    # state of an optimizer that has none (a step at lr 0): taken back on a refusal.
    fresh = not optimizer.optimizer.state
    state_dicts = _dcp().state_dict
    try:
        node = {"model": _copied(state_dicts.get_model_state_dict(model)),
                "optim": _copied(state_dicts.get_optimizer_state_dict(model,
                                                                      optimizer.optimizer))}
        _read(directory, {node_key: node, own_key: own})
        mine = from_tensors(own)
        optimizer.engine.check_state(mine["engine"])
    except BaseException:
        if fresh:
            optimizer.optimizer.state.clear()
        raise
    state_dicts.set_model_state_dict(model, node["model"])
    state_dicts.set_optimizer_state_dict(model, optimizer.optimizer, node["optim"])
    optimizer.engine.load_state_dict(mine["engine"])
    torch.set_rng_state(mine["rng"])
    return mine["extra"]
