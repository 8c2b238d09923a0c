"""Gossip states saved by earlier versions: what they lack, and how to read them.

qcomm 0.1.0 saved rounds in flight without their seals, and without the wire format's version
(format 1: it differs from today's only in the 2-bit code).
"""

from __future__ import annotations

import torch

from qcomm.compress import WIRE_FORMAT_VERSION

from .integrity import SEAL_NBYTES, seal_

__all__ = ["check_saved_wire_format", "seal_saved_round"]


def check_saved_wire_format(state: dict, bits: int) -> None:
    """Refuse a state whose rounds in flight this version would decode differently.

    Raises:
        ValueError: the state holds ``bits``-bit messages of another wire format.
    """
    saved = int(state.get("wire_format", 1))
    if saved != WIRE_FORMAT_VERSION and (saved > WIRE_FORMAT_VERSION or bits == 2) \
            and state["in_flight"]:
        raise ValueError(f"state holds {bits}-bit messages in wire format {saved}, which this "
                         f"version (format {WIRE_FORMAT_VERSION}) decodes differently; restart "
                         "the gossip state (world-size change mode 'reinit') or resume with the "
                         "version that saved it")


def seal_saved_round(payloads: torch.Tensor, round: int, senders: list[int],
                     message_nbytes: int) -> torch.Tensor:
    """A saved round's messages (uint8 ``[K, nbytes]`` or already ``[K, nbytes + 8]``), sealed
    as received: row k from ``senders[k]``."""
    if payloads.shape[-1] == message_nbytes:
        return payloads
    out = torch.zeros(payloads.shape[0], message_nbytes, dtype=torch.uint8,
                      device=payloads.device)
    out[:, :message_nbytes - SEAL_NBYTES] = payloads
    for k, sender in enumerate(senders):
        seal_(out[k], round, sender)
    return out
