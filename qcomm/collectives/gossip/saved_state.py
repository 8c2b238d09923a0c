"""Checks of a saved wait-free gossip state, all made before anything of it is loaded (a bad
one is refused naming the field, and the gossip is left as it was)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qcomm.validation import check_int

from .codec import check_state_buffers
from .wait_free_message import MessageLayout

__all__ = ["SavedState", "check_saved_state", "saved_buffers", "saved_counts", "saved_message"]


@dataclass
class SavedState:
    """The parts of a saved state that are checked and copied before any is loaded."""

    layout: MessageLayout                         # the saved run's message layout
    own_sent: list[tuple[int, torch.Tensor]]      # (round, message)
    recent: list[list[tuple[int, torch.Tensor]]]  # per link: (round, codec bytes)
    termed: list[list[int]]
    terms_on_copy: list[list[int]]
    buffers: dict[str, torch.Tensor | None]       # hat_own, owed, copies, momentum, anchor
    furthest: int                                 # the most rounds a neighbour was known at


def check_saved_state(state: dict, numel: int, nbytes: int, fragments: int) -> SavedState:
    """Check a saved wait-free state of a member gossiping ``numel`` floats in ``fragments``
    fragments of ``nbytes`` codec bytes each.

    Raises:
        TypeError, ValueError: naming the first field that is not what the gossip needs.
    """
    buffers = saved_buffers(state, numel)
    cfg = state["config"]
    layout = MessageLayout(nbytes, int(cfg["size"]), int(cfg["member"]))
    own_sent = [(int(r), saved_message(m, layout.message_nbytes))
                for r, m in state.get("own_sent", [])]
    recent = [[(int(r), saved_message(b, nbytes)) for r, b in h]
              for h in state.get("recent", [[] for _ in state["peers"]])]
    # (a state saved before the job's progress was kept has none: its links' rounds then)
    furthest = check_int("state['furthest_rounds']", state.get("furthest_rounds", 0), low=0)
    return SavedState(layout, own_sent, recent, saved_counts(state, "termed", fragments),
                      saved_counts(state, "terms_on_copy", fragments), buffers, furthest)


def saved_message(m: object, nbytes: int) -> torch.Tensor:
    """A saved message (uint8 ``[nbytes]``), checked (rounds decode from it) and copied."""
    if not isinstance(m, torch.Tensor) or m.dtype != torch.uint8 or tuple(m.shape) != (nbytes,):
        raise ValueError(f"a saved message must be a uint8 tensor of shape [{nbytes}], got "
                         f"{getattr(m, 'dtype', type(m).__name__)} "
                         f"{list(getattr(m, 'shape', []))}")
    return m.detach().clone()


def saved_counts(state: dict, key: str, fragments: int) -> list[list[int]]:
    """A saved per-neighbour, per-fragment count (``termed``, ``terms_on_copy``), checked: one
    row of ``fragments`` ints >= 0 per saved neighbour (a state saved before terms were counted
    has none: every copy counts as not mixed with yet)."""
    n = len(state["peers"])
    rows = state.get(key, [[0] * fragments for _ in range(n)])
    ok = isinstance(rows, list) and len(rows) == n and all(
        isinstance(row, list) and len(row) == fragments
        and all(isinstance(c, int) and c >= 0 for c in row) for row in rows)
    if not ok:
        raise ValueError(f"state[{key!r}] must be {n} lists of {fragments} ints >= 0 (one per "
                         f"neighbour and fragment), got {rows!r}")
    return [list(row) for row in rows]


def saved_buffers(state: dict, numel: int) -> dict[str, torch.Tensor | None]:
    """The saved buffers, checked (dtype, shape, device): rounds decode into and from them
    without checking them again. A state without ``owed`` (saved before the mixing was paired)
    owes nothing."""
    return check_state_buffers(
        state, {"hat_own": numel, "owed": numel, "copies": (len(state["peers"]), numel),
                "momentum": numel, "anchor": numel},
        together=[("hat_own", "copies"), ("momentum", "anchor")])
