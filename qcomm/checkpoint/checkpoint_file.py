"""One rank's checkpoint on disk: the rank file, its metadata record, and reading both safely.

``directory/rank00003.pt`` holds the payload (``torch.save`` of a dict: ``optimizer``, ``model``,
``rng``, ``extra``, ``meta``); ``directory/rank00003.json`` beside it holds the metadata record,
a small JSON object::

    {"qcomm_checkpoint": 1, "rank": 3, "world_size": 4, "procs_per_node": 2,
     "state_format": 2, "steps": 7, "save_id": "9f2c...", "bytes": 1048917}

so that a resume learns the saved geometry without unpickling anything, and reads each rank
file once. The payload repeats the record (less ``bytes``) under ``"meta"``: a record that
does not match its file (a copy from another save, another rank, a truncated file) is refused
by name. Both are written atomically (a temporary file, then a rename), the rank file first.

Every payload is read with torch's weights-only unpickler, which builds tensors and plain
Python data (numbers, strings, lists, tuples, dicts) and refuses any other global: a file
cannot run code in the process that loads it. What qcomm itself saves is plain data; a user's
``extra=`` holding other objects needs ``trusted=True`` (the ordinary unpickler, which runs
whatever the file says) or ``torch.serialization.add_safe_globals`` for its types.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from qcomm.engine.options import user_stacklevel
from qcomm.validation import check_int

__all__ = ["META_FORMAT", "CheckpointError", "RankFile", "UnsafeCheckpointError",
           "checkpoint_path", "rank_files"]

META_FORMAT = 1
# The record's fields that the payload repeats under "meta" (all but the file's size).
_MATCHED = ("qcomm_checkpoint", "rank", "world_size", "procs_per_node", "state_format",
            "steps", "save_id")
_PAYLOAD_KEYS = ("optimizer", "model", "rng", "extra")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded as it is (not a checkpoint, truncated, another
    rank's, a metadata record that disagrees with it). Raised before anything was changed.

    Attributes:
        path: the file at fault.
    """

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The file holds objects that torch's weights-only unpickler refuses: unpickling them
    could run code from the file. Nothing was changed.

    Attributes:
        path: the file.
        types: the refused globals, ``"module.Name"`` each.
    """

    def __init__(self, message: str, path: Path, types: list[str]) -> None:
        super().__init__(message, path)
        self.types = types


def checkpoint_path(directory: str | os.PathLike, rank: int) -> Path:
    """The rank file of ``rank`` (an int >= 0) under ``directory``."""
    return Path(directory) / f"rank{check_int('rank', rank, low=0):05d}.pt"


def rank_files(directory: str | os.PathLike) -> list[Path]:
    """The rank files in ``directory``, in rank order."""
    return sorted(Path(directory).glob("rank[0-9]*.pt"))


def _rank_of(path: Path) -> int:
    return int(path.stem.removeprefix("rank"))


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class RankFile:
    """One rank's files: ``path`` (the payload) and its metadata record beside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta_path = path.with_suffix(".json")

    # ---------------------------------------------------------------------------------------
    # writing

    @staticmethod
    def record(*, rank: int, world_size: int, procs_per_node: int, state_format: int,
               steps: int) -> dict[str, Any]:
        """A new metadata record (less the file's size), with a fresh ``save_id``."""
        return {"qcomm_checkpoint": META_FORMAT, "rank": rank, "world_size": world_size,
                "procs_per_node": procs_per_node, "state_format": state_format,
                "steps": steps, "save_id": uuid.uuid4().hex}

    def write(self, payload: dict[str, Any], record: dict[str, Any]) -> None:
        """Write the payload (with ``record`` under ``"meta"``), then the record with the
        payload's size; both atomically. Warns when the payload holds objects the safe loader
        will refuse (loading it will need ``trusted=True``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        full = {**payload, "meta": record}

        def save(tmp: Path) -> None:
            torch.save(full, tmp)
            _warn_unsafe(tmp, self.path)

        _atomic_write(self.path, save)
        on_disk = {**record, "bytes": self.path.stat().st_size}
        _atomic_write(self.meta_path,
                      lambda tmp: tmp.write_text(json.dumps(on_disk, indent=1) + "\n"))

    # ---------------------------------------------------------------------------------------
    # reading

    def meta(self) -> dict[str, Any] | None:
        """The metadata record, checked for shape; None when there is none (a file written
        before qcomm wrote records, or a record without its rank file is an error)."""
        if not self.meta_path.exists():
            return None
        try:
            meta = json.loads(self.meta_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.meta_path} is not a qcomm checkpoint record: {exc}",
                                  self.meta_path) from None
        fields = (*_MATCHED, "bytes")
        if (not isinstance(meta, dict) or meta.get("qcomm_checkpoint") != META_FORMAT
                or any(not isinstance(meta.get(k), int) for k in fields if k != "save_id")
                or not isinstance(meta.get("save_id"), str)):
            raise CheckpointError(
                f"{self.meta_path} is not a qcomm checkpoint record of format {META_FORMAT} "
                f"(expected the fields {list(fields)})", self.meta_path)
        if meta["rank"] != _rank_of(self.path):
            raise CheckpointError(
                f"{self.meta_path} says it belongs to rank {meta['rank']}, but it is the record "
                f"of {self.path.name}: a file copied from another rank's", self.meta_path)
        if not self.path.exists():
            raise CheckpointError(f"{self.meta_path} has no rank file {self.path.name} beside "
                                  "it", self.meta_path)
        return meta

    def world_size(self, *, trusted: bool) -> tuple[int, dict[str, Any] | None]:
        """The world size the file was saved in, from its record (nothing unpickled); a file
        without one is read whole (as :meth:`load` with ``trusted``), and its payload returned
        as the second element so that it is not read twice."""
        meta = self.meta()
        if meta is not None:
            return meta["world_size"], None
        payload = self.load(trusted=trusted, legacy=True)
        return _saved_world(payload, self.path), payload

    def load(self, *, trusted: bool, legacy: bool | None = None) -> dict[str, Any]:
        """The payload, read once and checked against the record. ``trusted`` unpickles with
        the ordinary unpickler (runs whatever the file holds); otherwise torch's weights-only
        one. ``legacy`` (None: look) says whether the file has no record.

        Raises:
            UnsafeCheckpointError: a global the safe loader refuses (named).
            CheckpointError: not a checkpoint, truncated, or not the file its record describes.
        """
        meta = self.meta() if legacy in (None, False) else None
        if meta is not None and (size := self.path.stat().st_size) != meta["bytes"]:
            raise CheckpointError(
                f"{self.path} has {size} bytes but its record {self.meta_path.name} says "
                f"{meta['bytes']}: the file was truncated or replaced after it was saved",
                self.path)
        payload = _read(self.path, trusted=trusted, legacy=meta is None)
        if not isinstance(payload, dict) or any(k not in payload for k in _PAYLOAD_KEYS):
            raise CheckpointError(f"{self.path} is not a qcomm checkpoint (expected a dict with "
                                  f"the keys {list(_PAYLOAD_KEYS)})", self.path)
        if meta is not None:
            inside = payload.get("meta")
            if not isinstance(inside, dict):
                raise CheckpointError(f"{self.path} holds no record of its own, but "
                                      f"{self.meta_path.name} is beside it", self.path)
            wrong = [k for k in _MATCHED if inside.get(k) != meta[k]]
            if wrong:
                raise CheckpointError(
                    f"{self.meta_path.name} disagrees with {self.path.name} on "
                    + ", ".join(f"{k} ({meta[k]!r} against {inside.get(k)!r})" for k in wrong)
                    + ": they are not from the same save", self.path)
        _check_rng(payload["rng"], self.path)
        return payload


def _saved_world(payload: dict[str, Any], path: Path) -> int:
    """The world size in a payload's optimizer state (files without a record)."""
    opt = payload["optimizer"]
    state = opt.get("qcomm") if isinstance(opt, dict) else None
    if state is None:
        return 1
    if not isinstance(state, dict) or not isinstance(state.get("world_size"), int):
        raise CheckpointError(f"{path}: its optimizer state has no world size", path)
    return state["world_size"]


def _check_rng(rng: object, path: Path) -> None:
    expected = torch.get_rng_state()
    if not (isinstance(rng, torch.Tensor) and rng.dtype == expected.dtype
            and rng.shape == expected.shape):
        raise CheckpointError(f"{path}: its random-number state is not torch's CPU generator "
                              f"state (a uint8 tensor of {expected.numel()} bytes)", path)


def _read(path: Path, *, trusted: bool, legacy: bool) -> Any:
    """``torch.load`` of ``path`` on the CPU, its failures turned into named errors."""
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        if trusted:
            raise CheckpointError(f"{path} is not a readable checkpoint: {exc}", path) from None
        types = _unsafe_globals(path, exc)
        if types is None:
            raise CheckpointError(f"{path} is not a torch checkpoint (garbage or corrupted "
                                  "bytes)", path) from None
        if not types:
            raise CheckpointError(f"{path} is not a readable checkpoint: {exc}", path) from None
        older = (" It was written by a qcomm that saved no metadata record; it loads with "
                 "trusted=True too." if legacy else "")
        raise UnsafeCheckpointError(
            f"{path} holds objects of types {', '.join(types)}, which torch's safe "
            "(weights-only) loader refuses: unpickling them could run code from the file. If "
            "you trust the file, pass load_checkpoint(..., trusted=True), or allow the types "
            "with torch.serialization.add_safe_globals." + older, path, types) from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError, KeyError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if not _torch_file_header(path):
            # Bytes that are no torch file at all fail wherever the unpickler stops on them
            # (an IndexError as often as an UnpicklingError): name them by what they are.
            raise CheckpointError(f"{path} is not a torch checkpoint (garbage or corrupted "
                                  "bytes)", path) from None
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupted): "
                              f"{type(exc).__name__}: {exc}", path) from None


# How torch files begin: a zip archive (torch.save's format), or the legacy format's pickled
# magic number (in any pickle protocol torch.save takes). Read as bytes: nothing is unpickled.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_HEADS = tuple(pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=p)[:-1]
                      for p in range(2, pickle.HIGHEST_PROTOCOL + 1))


def _torch_file_header(path: Path) -> bool:
    """Whether ``path`` begins as a torch file does (its rest may still be damaged)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.startswith(_ZIP_MAGIC) or any(head.startswith(h) for h in _LEGACY_HEADS)


def _unsafe_globals(path: Path, exc: Exception) -> list[str] | None:
    """The globals the safe loader refuses in ``path`` (read without unpickling them); None
    when the file is not a torch checkpoint at all."""
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if find is None:   # torch before 2.6: the refused name is in the message
        match = re.search(r"GLOBAL (\S+)", str(exc))
        return [match.group(1)] if match else None
    try:
        return list(find(path))
    except Exception:  # any failure to parse it means "not a checkpoint"
        return None


def _warn_unsafe(written: Path, path: Path) -> None:
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if find is None:
        return
    types = list(find(written))
    if types:
        warnings.warn(
            f"{path.name} holds objects of types {', '.join(types)}, which torch's safe "
            "loader refuses: load_checkpoint will need trusted=True (or "
            "torch.serialization.add_safe_globals for those types). Save plain data (tensors, "
            "numbers, strings, lists, tuples, dicts) in extra= to avoid it.", UserWarning,
            stacklevel=user_stacklevel())
