"""Sealing and verifying gossip messages: nothing is applied from a message that fails.

A message is the codec payload, maybe a header (the wait-free gossip's acks), and an 8-byte
seal over both::

    message = payload (uint8 [nbytes], nbytes % 4 == 0) | header | seal (int64, little-endian)
    seal    = (sum_i int32(w_i * u_i))  XOR  key(round, sender)

where ``u_i`` are the 32-bit words of payload and header, ``w_i = 2 i + 1``, each product is taken
modulo 2**32 as a signed int32 (the wrap of int32 multiplication, identical on CPU and GPU) and the
sum is exact in int64. Every weight is odd, so changing any single word (any bit flip, a scale set
to 1e30) changes its product modulo 2**32 and with it the sum; several changed words cancel with
probability about 2**-32. The key ties a message to its round and sender, so a stale buffer (a
truncated or lost message leaves last round's bytes behind) or a message delivered to the wrong
round fails too. It detects corruption, not a malicious sender (who can reseal).

Verification of a received message also requires finite scales of plausible size, at most
:data:`MAX_SCALE` = 2**64 (1.8e19): no trained model's parameter differences approach it, and
it keeps every sum the decode forms far below float32's overflow at 2**128.

Cost: one multiply and one sum over the payload's words (``bench/checksum.py`` measures it
against a gossip round of the same size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.compress import QuantSpec
from qcomm.compress.verdict import largest_magnitude
from qcomm.kernels.accumulate_guard import FLOAT32_MAX
from qcomm.kernels.wire_format import packed_nbytes, payload_scales
from qcomm.seeds import seal_key

__all__ = ["MAX_SCALE", "SEAL_NBYTES", "bad_messages", "judge", "message_facts", "seal_",
           "sealed"]

SEAL_NBYTES = 8
MAX_SCALE = 2.0 ** 64  # far above any parameter difference, far below float32's 2**128

_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _word_weights(nwords: int, device: torch.device) -> torch.Tensor:
    w = _weights.get((nwords, device))
    if w is None:
        # int32 [nwords]: 1, 3, 5, ... (wrapped modulo 2**32 past 2**31: still odd).
        w = torch.arange(1, 2 * nwords, 2, dtype=torch.int64, device=device).to(torch.int32)
        _weights[(nwords, device)] = w
    return w


def _sums(payloads: torch.Tensor) -> torch.Tensor:
    """int64 ``[K]``: the weighted word sum of each row of ``payloads`` (uint8 ``[K, nbytes]``,
    rows 4-byte aligned)."""
    nbytes = payloads.shape[1]
    if nbytes % 4:
        raise ValueError(f"payload length must be a multiple of 4, got {nbytes}")
    products = payloads.view(torch.int32) * _word_weights(nbytes // 4, payloads.device)
    return products.sum(dim=1)  # integer sums accumulate and return in int64


def seal_(message: torch.Tensor, round: int, sender: int) -> None:
    """Write the seal of ``message[:-8]`` into ``message[-8:]`` (uint8 ``[nbytes + 8]``)."""
    body = message[:-SEAL_NBYTES].view(1, -1)
    value = _sums(body) ^ seal_key(round, sender)
    # Bytes, not an int64 view: the seal sits at a 4-byte, not 8-byte, aligned offset.
    message[-SEAL_NBYTES:].copy_(value.view(torch.uint8))


def sealed(message: torch.Tensor, round: int, sender: int) -> bool:
    """Whether ``message`` (uint8 ``[nbytes + 8]``) carries the seal of ``round`` and
    ``sender`` over its body (the checksum alone: for control messages, not codec payloads)."""
    stored = message[-SEAL_NBYTES:].clone(memory_format=torch.contiguous_format)
    want = _sums(message[:-SEAL_NBYTES].view(1, -1)) ^ seal_key(round, sender)
    return bool((stored.view(torch.int64) == want).all())


def message_facts(messages: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """What verifying messages (uint8 ``[K, nbytes + 8]``) needs to know of them, computed where
    they are and read by nobody yet: int64 ``[4, K]``, rows (weighted word sum of the payload,
    stored seal, all scales finite, all scales at most :data:`MAX_SCALE`). :func:`judge` turns
    its values into verdicts; reading them is the one host read of a verification."""
    body = messages[:, :-SEAL_NBYTES]
    # A fresh copy: the seals sit at 4-byte aligned offsets, an int64 view needs 8.
    stored = messages[:, -SEAL_NBYTES:].clone(memory_format=torch.contiguous_format)
    stored = stored.view(torch.int64).reshape(-1)
    scales = payload_scales(body[:, :packed_nbytes(numel, spec)], numel, spec)
    # One reduction: each message's largest |scale|, NaN or Inf when one scale is.
    largest = largest_magnitude(scales, dim=1)
    finite, small = largest <= FLOAT32_MAX, largest <= MAX_SCALE  # NaN compares False
    return torch.stack([_sums(body), stored, finite.to(torch.int64), small.to(torch.int64)])


def judge(facts: list[list[int]], rounds: Sequence[int],
          senders: Sequence[int]) -> list[tuple[int, str]]:
    """Verdicts on messages from their :func:`message_facts` (as Python ints: ``.tolist()``),
    message k expected to be round ``rounds[k]`` of ``senders[k]``: ``(k, reason)`` for each
    that fails (reasons as in :func:`bad_messages`)."""
    sums, stored, finite, small = facts
    out = []
    for k in range(len(sums)):
        # Python's ^ on ints in int64's range is int64's XOR (two's complement), as on device.
        if sums[k] ^ seal_key(rounds[k], senders[k]) != stored[k]:
            out.append((k, "checksum"))
        elif not finite[k]:
            out.append((k, "non-finite scale"))
        elif not small[k]:
            out.append((k, "scale above 2**64"))
    return out


def bad_messages(messages: torch.Tensor, round: int, senders: list[int], numel: int,
                 spec: QuantSpec) -> list[tuple[int, str]]:
    """Verify received messages (uint8 ``[K, nbytes + 8]``, row k from ``senders[k]``), all of
    round ``round``, with one host read (on an accelerator, one host sync) whatever K.

    Returns:
        ``(row, reason)`` for every message that fails: ``"checksum"`` (corrupted, truncated,
        stale or misrouted), ``"non-finite scale"`` or ``"scale above 2**64"``. Empty when
        all pass.
    """
    if messages.shape[0] == 0:
        return []
    facts = message_facts(messages, numel, spec).tolist()
    return judge(facts, [round] * len(senders), senders)
