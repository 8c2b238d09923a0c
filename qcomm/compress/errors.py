"""The codec's exceptions: input that holds NaN or Inf, and sums that would overflow float32.

Both say what was refused and leave every buffer as it was: the codec raises them before
anything it protects is written.
"""

from __future__ import annotations

import torch

__all__ = ["AccumulateOverflowError", "NonFiniteError", "nonfinite_error"]


class NonFiniteError(FloatingPointError):
    """Input to the codec holds NaN or Inf. Nothing was produced and no state was changed.

    Attributes:
        argument: the name of the offending argument (``"x"``, ``"packed"`` or ``"payloads"``).
        blocks: indices of the offending blocks (for ``"payloads"``: flat over ``[K, nblocks]``).
    """

    def __init__(self, message: str, argument: str, blocks: list[int]):
        super().__init__(message)
        self.argument = argument
        self.blocks = blocks


class AccumulateOverflowError(NonFiniteError, OverflowError):
    """:func:`dequant_accumulate` would have written Inf or NaN into ``out`` although every
    scale and weight is finite: the decoded payloads times the weights (plus ``out``) exceed
    float32's range. Nothing was written.

    Attributes:
        argument: ``"payloads"``.
        blocks: indices of the blocks of ``out`` (``block_size`` elements each) that would have
            become non-finite.
    """


def nonfinite_error(scales: torch.Tensor, argument: str, what: str) -> NonFiniteError:
    """The NonFiniteError naming the blocks whose scale is NaN or Inf (host reads)."""
    blocks = (~torch.isfinite(scales)).flatten().nonzero().flatten().tolist()
    where = (f"in {len(blocks)} block(s), first block {blocks[0]}" if blocks else
             "(its blocks cannot be named: the payload was overwritten before the check was "
             "read)")
    return NonFiniteError(
        f"{argument} {what} non-finite values (NaN or Inf) {where}; nothing was produced and "
        f"no state was changed",
        argument,
        blocks,
    )
