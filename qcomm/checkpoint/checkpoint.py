"""One checkpoint file per rank: the model, the optimizer's state (its own plus the gossip
buffers and rounds in flight) and torch's RNG state, so that a run resumed at step k continues
bit for bit.

Layout: ``directory/rank00000.pt`` and its metadata record ``rank00000.json``, one pair per
rank. Each rank writes and reads only its own files (no collective); files are written
atomically. Loading never runs code from a file unless the caller says it trusts it: see
:mod:`qcomm.checkpoint.checkpoint_file` for the format and the safety rules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qcomm.checkpoint.checkpoint_file import (
    CheckpointError,
    RankFile,
    checkpoint_path,
    rank_files,
)
from qcomm.checkpoint.optimizer import STATE_KEY, CheckpointableOptimizer
from qcomm.engine.state import WORLD_CHANGE_MODES
from qcomm.validation import check_instance

__all__ = ["checkpoint_path", "load_checkpoint", "save_checkpoint"]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_checkpoint(directory: str | os.PathLike, optimizer: CheckpointableOptimizer,
                    model: torch.nn.Module | None = None, *, extra: Any = None) -> Path:
    """Write this rank's checkpoint file and its metadata record; return the file's path.

    Args:
        directory: created if missing; shared by all ranks.
        optimizer: a :class:`~qcomm.sgd.HierarchicalOptimizer` (ASSGD included); its
            ``state_dict()`` is saved.
        model: saved with ``state_dict()`` when given (asynchronous gossip leaves every node
            with its own parameters, so each rank saves its own copy).
        extra: saved as given (epoch, data-loader position, ...), returned by
            :func:`load_checkpoint`. Plain data (tensors, numbers, strings, bools, None, lists,
            tuples, dicts) loads with torch's safe loader; other objects are saved too, with a
            warning: loading them needs ``trusted=True``.
    """
    _check_subjects(optimizer, model)
    rank, _ = _rank_world()
    state = optimizer.state_dict()
    geometry = state[STATE_KEY]
    record = RankFile.record(rank=rank, world_size=geometry["world_size"],
                             procs_per_node=geometry["procs_per_node"],
                             state_format=geometry["format"], steps=geometry["steps"])
    payload = {
        "optimizer": state,
        "model": model.state_dict() if model is not None else None,
        "rng": torch.get_rng_state(),
        "extra": extra,
    }
    file = RankFile(checkpoint_path(directory, rank))
    file.write(payload, record)
    return file.path


def load_checkpoint(directory: str | os.PathLike, optimizer: CheckpointableOptimizer,
                    model: torch.nn.Module | None = None, *,
                    on_world_size_change: str = "error", restore_rng: bool = True,
                    trusted: bool = False) -> Any:
    """Load this rank's checkpoint file into ``optimizer`` (and ``model``); return ``extra``.

    The file is read with torch's weights-only unpickler: it builds tensors and plain data and
    cannot run code. ``trusted=True`` reads it with the ordinary unpickler instead (needed for
    an ``extra`` that holds other objects): only for files whose origin you trust.

    With a changed world size and ``on_world_size_change="reinit"``, rank r reads the file of
    saved rank ``r % saved_world_size`` and the gossip state starts afresh (see
    :meth:`HierarchicalOptimizer.load_state_dict`). With ``"error"`` (default) a ValueError
    names both sizes. With ``"reinit"``, a rank whose file is not in ``directory`` (a node
    that was lost before the survivors saved, and came back) reads the lowest rank's file
    present: after ``average_parameters()`` every survivor holds the same parameters.
    With ``"error"`` and a directory holding exactly this run's number of files, rank r
    reads the r-th file in rank order: the survivors of a run that lost nodes (with
    ``on_peer_loss="continue"``), restarted without them, go on exactly.

    Raises:
        UnsafeCheckpointError: the file holds objects the safe loader refuses (their types
            named); pass ``trusted=True`` only if you trust the file.
        CheckpointError: not a checkpoint, truncated, another rank's file, or a metadata record
            that disagrees with its file; a model state that does not fit ``model``.
        ValueError: a checkpoint of another geometry or other communication options.
        FileNotFoundError: no checkpoint in ``directory``, or this rank's file missing.

    Nothing is changed when an error is raised: not the model, the optimizer or the RNG.
    """
    _check_subjects(optimizer, model)
    if on_world_size_change not in WORLD_CHANGE_MODES:
        raise ValueError(f"on_world_size_change must be one of {WORLD_CHANGE_MODES}, "
                         f"got {on_world_size_change!r}")
    check_instance("trusted", trusted, bool, what="True or False")
    rank, world = _rank_world()
    file, payload = _choose_file(directory, rank, world, on_world_size_change, trusted)
    if payload is None:
        payload = file.load(trusted=trusted)
    if model is not None:
        _check_model_state(model, payload["model"], file.path)
    optimizer_state = payload["optimizer"]
    if not isinstance(optimizer_state, dict):
        raise CheckpointError(f"{file.path}: its optimizer state is not a dict", file.path)
    # Loaded on the CPU (the random-number state must stay there). qcomm's own state lives on
    # the parameters' device: moved there. The wrapped torch optimizer's state is left to its
    # load_state_dict, which casts it by its own rules (Adam keeps "step" on the CPU).
    if optimizer_state.get(STATE_KEY) is not None:
        optimizer_state[STATE_KEY] = _to_device(optimizer_state[STATE_KEY],
                                                _params_device(optimizer))
    # The optimizer checks the geometry first and raises before anything is changed; the model
    # state was checked against the model above, so nothing after this load can fail.
    optimizer.load_state_dict(optimizer_state, on_world_size_change=on_world_size_change)
    if model is not None:
        model.load_state_dict(payload["model"])
    if restore_rng:
        torch.set_rng_state(payload["rng"])
    return payload["extra"]


def _check_subjects(optimizer: object, model: object) -> None:
    """TypeError unless ``optimizer`` is a HierarchicalOptimizer and ``model`` a module (or
    None), before any file is touched (a class for either is named as such)."""
    check_instance("optimizer", optimizer, CheckpointableOptimizer,
                   what="a qcomm.sgd.HierarchicalOptimizer")  # the one there is (ASSGD is one)
    check_instance("model", model, torch.nn.Module, allow_none=True, what="a torch.nn.Module")


def _choose_file(directory: str | os.PathLike, rank: int, world: int,
                 on_world_size_change: str, trusted: bool
                 ) -> tuple[RankFile, dict[str, Any] | None]:
    """The rank file this rank loads, and its payload when reading the saved world size
    already read it (a file without a metadata record)."""
    own = RankFile(checkpoint_path(directory, rank))
    files = rank_files(directory)
    probe = own if own.path.exists() else (RankFile(files[0]) if files else None)
    if probe is None:
        raise FileNotFoundError(f"no checkpoint files rank*.pt in {directory}")
    saved_world, payload = probe.world_size(trusted=trusted)
    chosen = own
    if on_world_size_change == "reinit":
        if saved_world != world:
            chosen = RankFile(checkpoint_path(directory, rank % saved_world))
        if not chosen.path.exists():  # lost before the save
            chosen = RankFile(files[0])
    elif saved_world != world and len(files) == world:
        chosen = RankFile(files[rank])  # the survivors of a run that lost nodes, in rank order
    elif not own.path.exists() and saved_world == world:
        raise FileNotFoundError(
            f"no file {own.path.name} in {directory}: this rank's checkpoint is missing "
            f"although the directory was saved by a world of {world}, as this run is (with a "
            "directory per machine, each machine must resume with the ranks it saved; or use "
            "a directory every machine shares)")
    elif not own.path.exists():
        raise ValueError(
            f"checkpoint was saved with world size {saved_world} but this run has world size "
            f"{world}: no file {own.path.name} in {directory} (pass "
            "on_world_size_change='reinit')")
    return chosen, payload if chosen.path == probe.path else None


def _check_model_state(model: torch.nn.Module, state: Any, path: Path) -> None:
    """Raise CheckpointError unless ``model.load_state_dict(state)`` will succeed (the same
    keys, and tensors of the same shapes), so that nothing is loaded when it would not."""
    check_instance("model", model, torch.nn.Module, what="a torch.nn.Module")
    if state is None:
        raise CheckpointError(f"{path} holds no model state (it was saved with model=None)",
                              path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: its model state is not a dict", path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not hold this model's state: missing keys {missing[:8]}, unexpected "
            f"keys {unexpected[:8]}", path)
    for key, mine in own.items():
        theirs = state[key]
        if isinstance(mine, torch.Tensor) and (
                not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape):
            shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs)
            raise CheckpointError(
                f"{path}: the model's {key!r} has shape {tuple(mine.shape)} but the checkpoint "
                f"holds {shape}", path)


def _params_device(optimizer: CheckpointableOptimizer) -> torch.device:
    """The device of the optimizer's first parameter (the engine's flat buffers live there)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (nested in dicts, lists, tuples) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [_to_device(v, device) for v in obj]
        return type(obj)(moved) if type(obj) in (list, tuple) else obj
    return obj
