"""Ranks agree before they exchange: one small collective at the first distributed step.

Everything that shapes the wire or the mixing must be the same on every rank: codec spec,
graph and mixing, staleness and gamma, the gossip schedule, the intra-node options, and the
communicated parameters (count, shapes, dtypes). A difference would otherwise show up as a
process killed inside the backend ("Received data size doesn't match"), a hang, or, worst,
silently averaged unrelated parameters. Each rank encodes its values as int64s (choices by their
index, floats by their bits, shapes by a hash), one all-gather brings every rank's row to every
rank, and every rank raises the same ValueError naming the first field that differs and which
ranks hold which value.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qcomm.collectives.gossip.schedules import ALL_GRAPHS
from qcomm.collectives.group import CommGroup
from qcomm.collectives.primitives import all_gather_flat, wait_works
from qcomm.engine.options import (
    JOIN_OPTIMIZER_STATES,
    MIXINGS,
    NONFINITE_MODES,
    PEER_LOSS_MODES,
    CommOptions,
)
from qcomm.kernels.wire_format import ROUNDING_MODES

__all__ = ["check_agreement", "fingerprint"]

_NONE = -(2**63)  # encodes None


def _choice(values: tuple[str, ...]) -> tuple[Callable[[Any], int], Callable[[int], Any]]:
    return (lambda v: values.index(v)), (lambda i: values[i] if 0 <= i < len(values) else i)


def _optional_int() -> tuple[Callable[[Any], int], Callable[[int], Any]]:
    return (lambda v: _NONE if v is None else int(v)), (lambda i: None if i == _NONE else i)


def _optional_float() -> tuple[Callable[[Any], int], Callable[[int], Any]]:
    def enc(v: Any) -> int:
        return _NONE if v is None else struct.unpack("<q", struct.pack("<d", float(v)))[0]

    def dec(i: int) -> Any:
        return None if i == _NONE else struct.unpack("<d", struct.pack("<q", i))[0]

    return enc, dec


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


# Option fields that must agree, with how they travel.
_OPTION_CODECS: dict[str, tuple[Callable[[Any], int], Callable[[int], Any]]] = {
    "bits": _optional_int(),
    "block_size": _optional_int(),
    "rounding": _choice(ROUNDING_MODES),
    "graph": _choice((None, *ALL_GRAPHS)),   # None: chosen by the node count, alike
    "mixing": _choice(MIXINGS),
    "staleness": _optional_int(),
    "gamma": _optional_float(),
    "sync_every": _optional_int(),
    "fragments": _optional_int(),
    "outer_momentum": _optional_float(),
    "outer_lr": _optional_float(),
    "total_steps": _optional_int(),
    "intra_bits": _optional_int(),
    "bucket_mb": _optional_float(),
    "on_nonfinite": _choice(NONFINITE_MODES),
    "wait_free": _choice((False, True)),
    "on_peer_loss": _choice(PEER_LOSS_MODES),
    "join_optimizer_state": _choice(JOIN_OPTIMIZER_STATES),
}
_LAYOUT_FIELDS = ("communicated parameters", "communicated elements",
                  "parameter shapes and dtypes", "node gradient mean by DDP",
                  "parameters sharded inside the node (FSDP2)",
                  "attached model's buffers", "buffer names, shapes and dtypes")
_HASHED = ("parameter shapes and dtypes", "buffer names, shapes and dtypes")


def _shape(p: torch.Tensor) -> str:
    """``p``'s shape and dtype as text; a DTensor's global shape and its placements (the same
    on every rank when every node shards alike, so the rails' parts have one length)."""
    placements = getattr(p, "placements", None)
    return f"{tuple(p.shape)}:{p.dtype}" + (f":{tuple(placements)}" if placements else "")


def fingerprint(options: CommOptions, communicated: Sequence[torch.Tensor],
                ddp: bool, buffers: Sequence[tuple[str, tuple[int, ...], torch.dtype]] = (),
                sharded: bool = False) -> list[int]:
    """This rank's row: one int64 per field (options, then the communicated layout, then the
    attached model's buffers as ``(name, shape, dtype)``)."""
    row = [enc(getattr(options, name)) for name, (enc, _) in _OPTION_CODECS.items()]
    shapes = ";".join(_shape(p) for p in communicated)
    row += [len(communicated), sum(p.numel() for p in communicated), _digest(shapes), int(ddp),
            int(sharded)]
    row += [len(buffers), _digest(";".join(f"{n}:{s}:{d}" for n, s, d in buffers))]
    return row


def _describe(field: int, value: int) -> str:
    names = list(_OPTION_CODECS)
    if field < len(names):
        return repr(_OPTION_CODECS[names[field]][1](value))
    if _LAYOUT_FIELDS[field - len(names)] in _HASHED:
        return f"hash {value & 0xFFFFFFFF:08x}"
    return repr(value)


def check_agreement(row: list[int], group: CommGroup | None, world_size: int,
                    device: torch.device, timeout_s: float | None = None) -> None:
    """All-gather every rank's :func:`fingerprint` over ``group`` (the whole job, or a linked
    node's ranks) and raise the same ValueError on every rank when any field differs. None:
    the rank is alone (``world_size`` 1), and one row agrees with itself.

    Raises:
        ValueError: naming the first field that differs and the ranks holding each value.
    """
    if group is None:
        if world_size != 1:
            raise ValueError(f"check_agreement without a group holds one rank, not "
                             f"world_size={world_size}")
        return
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = torch.empty(world_size * len(row), dtype=torch.int64, device=device)
    work = all_gather_flat(table, mine, group, async_op=True, operation="agreement check")
    wait_works([work], timeout_s, "agreement check", group, None)
    rows = table.view(world_size, len(row)).tolist()
    names = list(_OPTION_CODECS) + list(_LAYOUT_FIELDS)
    for f, name in enumerate(names):
        values = [r[f] for r in rows]
        if len(set(values)) == 1:
            continue
        by_value: dict[int, list[int]] = {}
        for rank, v in enumerate(values):
            by_value.setdefault(v, []).append(rank)
        held = "; ".join(f"ranks {ranks}: {_describe(f, v)}" for v, ranks in by_value.items())
        raise ValueError(f"ranks disagree on {name} ({held}); every rank must pass the same "
                         "communication options and the same model to the optimizer")


def check_job_agreement(row: list[int], store: Any, key: str) -> None:
    """Compare this rank's :func:`fingerprint` with the job's, kept in the rendezvous's
    ``store`` under ``key`` (the first rank to come sets it): for nodes linked through the
    rendezvous, which share no group over the job and come and go while it runs. A node that
    differs is refused alone; the running ones are not touched.

    Raises:
        ValueError: naming the first field that differs, this node's value and the job's.
    """
    mine = ",".join(map(str, row))
    theirs = store.compare_set(key, "", mine).decode()
    if theirs == mine:
        return
    names = list(_OPTION_CODECS) + list(_LAYOUT_FIELDS)
    job = [int(v) for v in theirs.split(",")]
    for f, name in enumerate(names):
        if f >= len(job) or job[f] != row[f]:
            got = _describe(f, job[f]) if f < len(job) else "nothing"
            raise ValueError(f"this node's {name} is {_describe(f, row[f])} but the running "
                             f"job's is {got}: a node joins with the job's communication "
                             "options and model")
