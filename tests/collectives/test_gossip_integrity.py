"""qcomm.collectives.gossip.integrity: one verification names every failing message of a batch
by its first reason, the scales' two limits from one reduction per message."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip.integrity import MAX_SCALE, SEAL_NBYTES, bad_messages, seal_
from qcomm.compress import QuantSpec, quantize
from qcomm.kernels.wire_format import packed_nbytes, payload_scales

SPEC = QuantSpec(4, 32)
N = 100  # four blocks, the last one partial


def _messages(scales: list[float | None], round: int = 3) -> torch.Tensor:
    """One sealed message per entry (row k from sender k): a healthy payload whose block 2
    scale is set to the entry (None: left as it is), sealed after."""
    nbytes = packed_nbytes(N, SPEC)
    out = torch.zeros(len(scales), nbytes + SEAL_NBYTES, dtype=torch.uint8)
    for k, scale in enumerate(scales):
        out[k, :nbytes] = quantize(torch.randn(N, generator=torch.Generator().manual_seed(k)),
                                   SPEC).payload
        if scale is not None:
            payload_scales(out[k, :nbytes], N, SPEC)[2] = scale
        seal_(out[k], round, k)
    return out


@pytest.mark.parametrize(("scale", "reason"), [
    (None, None), (float("nan"), "non-finite scale"), (float("inf"), "non-finite scale"),
    (-float("inf"), "non-finite scale"), (MAX_SCALE, None), (-MAX_SCALE, None),
    (MAX_SCALE * 2, "scale above 2**64"), (-3e38, "scale above 2**64"),
])
def test_each_scale_is_judged_by_its_magnitude(scale: float | None, reason: str | None) -> None:
    messages = _messages([None, scale, None])
    want = [] if reason is None else [(1, reason)]
    assert bad_messages(messages, 3, [0, 1, 2], N, SPEC) == want


def test_a_batch_names_each_failure_once_by_its_first_reason() -> None:
    messages = _messages([None, float("nan"), MAX_SCALE * 4, None, -float("inf")])
    messages[3, 5] ^= 1  # a flipped bit: the checksum, whatever its scales say
    messages[4, 0] ^= 1  # a flipped bit and a non-finite scale: the checksum comes first
    got = bad_messages(messages, 3, [0, 1, 2, 3, 4], N, SPEC)
    assert got == [(1, "non-finite scale"), (2, "scale above 2**64"), (3, "checksum"),
                   (4, "checksum")]
    assert bad_messages(messages[:1], 4, [0], N, SPEC) == [(0, "checksum")]  # another round
