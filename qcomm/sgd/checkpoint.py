"""One checkpoint file per rank: the model, the optimizer's state (its own plus the gossip
buffers and rounds in flight) and torch's RNG state, so that a run resumed at step k continues
bit for bit.

Layout: ``directory/rank00000.pt``, ``directory/rank00001.pt``, ... Each rank writes and reads
only its own file (no collective); files are written atomically (temp file, then rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qcomm.engine.state import WORLD_CHANGE_MODES
from qcomm.sgd.hierarchical_optimizer import STATE_KEY, HierarchicalOptimizer


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_path(directory: str | os.PathLike, rank: int) -> Path:
    """The file of ``rank`` under ``directory``."""
    return Path(directory) / f"rank{rank:05d}.pt"


def save_checkpoint(directory: str | os.PathLike, optimizer: HierarchicalOptimizer,
                    model: torch.nn.Module | None = None, *, extra: Any = None) -> Path:
    """Write this rank's checkpoint file and return its path.

    Args:
        directory: created if missing; shared by all ranks.
        optimizer: a :class:`~qcomm.sgd.HierarchicalOptimizer` (ASSGD included); its
            ``state_dict()`` is saved.
        model: saved with ``state_dict()`` when given (asynchronous gossip leaves every node
            with its own parameters, so each rank saves its own copy).
        extra: any picklable object (epoch, data-loader position, ...), returned by
            :func:`load_checkpoint`.
    """
    if not isinstance(optimizer, HierarchicalOptimizer):
        raise TypeError(f"optimizer must be a qcomm.sgd.HierarchicalOptimizer (or ASSGD), "
                        f"got {type(optimizer).__name__}")
    rank, _ = _rank_world()
    path = checkpoint_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "optimizer": optimizer.state_dict(),
        "model": model.state_dict() if model is not None else None,
        "rng": torch.get_rng_state(),
        "extra": extra,
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | os.PathLike, optimizer: HierarchicalOptimizer,
                    model: torch.nn.Module | None = None, *,
                    on_world_size_change: str = "error", restore_rng: bool = True) -> Any:
    """Load this rank's checkpoint file into ``optimizer`` (and ``model``); return ``extra``.

    With a changed world size and ``on_world_size_change="reinit"``, rank r reads the file of
    saved rank ``r % saved_world_size`` and the gossip state starts afresh (see
    :meth:`HierarchicalOptimizer.load_state_dict`). With ``"error"`` (default) a ValueError
    names both sizes. With ``"reinit"``, a rank whose file is not in ``directory`` (a node
    that was lost before the survivors saved, and came back) reads the lowest rank's file
    present: after ``average_parameters()`` every survivor holds the
    same parameters.
    With ``"error"`` and a directory holding exactly this run's number of files, rank r
    reads the r-th file in rank order: the survivors of a run that lost nodes (with
    ``on_peer_loss="continue"``), restarted without them, go on exactly.
    Nothing is loaded when an error is raised.
    """
    if on_world_size_change not in WORLD_CHANGE_MODES:
        raise ValueError(f"on_world_size_change must be one of {WORLD_CHANGE_MODES}, "
                         f"got {on_world_size_change!r}")
    rank, world = _rank_world()
    path = checkpoint_path(directory, rank)
    saved_world = _saved_world_size(directory, path)
    if on_world_size_change == "reinit":
        if saved_world != world:
            path = checkpoint_path(directory, rank % saved_world)
        if not path.exists():  # lost before the save
            path = _files(directory)[0]
    elif saved_world != world and len(files := _files(directory)) == world:
        path = files[rank]  # the survivors of a run that lost nodes, in rank order
    elif not path.exists() and saved_world == world:
        raise FileNotFoundError(
            f"no file {path.name} in {directory}: this rank's checkpoint is missing although "
            f"the directory was saved by a world of {world}, as this run is (with a directory "
            "per machine, each machine must resume with the ranks it saved; or use a "
            "directory every machine shares)")
    elif not path.exists():
        raise ValueError(
            f"checkpoint was saved with world size {saved_world} but this run has world size "
            f"{world}: no file {path.name} in {directory} (pass on_world_size_change='reinit')"
        )
    payload = torch.load(path, map_location="cpu", weights_only=False)
    # Loaded on the CPU (the random-number state must stay there). qcomm's own state lives on
    # the parameters' device: moved there. The wrapped torch optimizer's state is left to its
    # load_state_dict, which casts it by its own rules (Adam keeps "step" on the CPU).
    if payload["optimizer"].get(STATE_KEY) is not None:
        payload["optimizer"][STATE_KEY] = _to_device(payload["optimizer"][STATE_KEY],
                                                     _params_device(optimizer))
    # The optimizer checks the geometry first and raises before anything is changed.
    optimizer.load_state_dict(payload["optimizer"], on_world_size_change=on_world_size_change)
    if model is not None:
        if payload["model"] is None:
            raise ValueError(f"{path} holds no model state (it was saved with model=None)")
        model.load_state_dict(payload["model"])
    if restore_rng:
        torch.set_rng_state(payload["rng"])
    return payload["extra"]


def _params_device(optimizer: HierarchicalOptimizer) -> torch.device:
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


def _files(directory: str | os.PathLike) -> list[Path]:
    """The checkpoint files in ``directory``, in rank order."""
    return sorted(Path(directory).glob("rank*.pt"))


def _saved_world_size(directory: str | os.PathLike, path: Path) -> int:
    """The world size a checkpoint directory was saved with (from this rank's file, else the
    lowest rank's file present)."""
    candidates = [path] if path.exists() else _files(directory)
    if not candidates:
        raise FileNotFoundError(f"no checkpoint files rank*.pt in {directory}")
    state = torch.load(candidates[0], map_location="cpu", weights_only=False)["optimizer"]
    q = state.get(STATE_KEY)
    return int(q["world_size"]) if q is not None else 1
