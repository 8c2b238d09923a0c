"""The codec calls of a gossip member's rounds, with their arguments checked once.

Every message of a member has one spec and one length (a fragment), and every buffer a round
encodes from or decodes into is the member's own: made at its first round, or checked when
loaded from a state_dict (:func:`check_state_buffer`). The public codec's per-call checks
(spec, dtypes, shapes, devices, payload lengths) would re-prove the same facts every round, so
a round calls the codec's unchecked entry points instead.

What stays per round is the finiteness of what is decoded, in one host read per step phase
(one host sync on an accelerator):

* an own message: :meth:`GossipCodec.encode` reads one number, its largest ``|scale|`` (one
  reduction), and compares it with :data:`~.integrity.MAX_SCALE`. NaN and Inf fail that
  comparison too, so it says at once whether the input was finite (a block holding NaN or Inf
  gets a NaN scale inside the kernel) and whether the message decodes without the overflow
  check: scales at most 2**64, times at most 128 (the largest code) and weights at most 1, sum
  far below float32's 2**128 for any number of messages. A non-finite input raises
  :class:`~qcomm.compress.NonFiniteError` before anything is sent or changed, as
  :func:`~qcomm.compress.quantize` does; a finite message with a larger scale (which the
  neighbours will refuse, "scale above 2**64") is decoded by the public, checking
  :func:`~qcomm.compress.dequant_accumulate`;
* received messages: their verification (:func:`~.integrity.bad_messages`, one host read for
  all of them) requires finite scales at most 2**64 before anything of them is applied, so
  their decode needs no check either.

Decoding (:meth:`GossipCodec.accumulate`) reads nothing: with the scales so bounded the public
function would take the same kernel call with the same arguments, so the result is the same,
bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qcomm.compress import QuantSpec, dequant_accumulate
from qcomm.compress.errors import nonfinite_error
from qcomm.compress.unchecked import dequant_accumulate_into, quantize_into
from qcomm.compress.verdict import largest_magnitude
from qcomm.kernels.accumulate_guard import FLOAT32_MAX
from qcomm.kernels.wire_format import check_spec, packed_nbytes, payload_scales
from qcomm.validation import check_int

from .integrity import MAX_SCALE

__all__ = ["GossipCodec", "check_state_buffer", "check_state_buffers"]


class GossipCodec:
    """Encode and decode one member's messages of ``numel`` floats under ``spec``.

    Args:
        spec: the QuantSpec of every message (checked here, once).
        numel: floats per message (a fragment), >= 1.
    """

    def __init__(self, spec: QuantSpec, numel: int) -> None:
        self.spec = check_spec(spec)
        self.numel = check_int("numel", numel, low=1)
        self.nbytes = packed_nbytes(self.numel, self.spec)

    def scales(self, payload: torch.Tensor) -> torch.Tensor:
        """float32 ``[nblocks]`` view of a payload's scales (uint8 ``[nbytes]``)."""
        return payload_scales(payload, self.numel, self.spec)

    def encode(self, diff: torch.Tensor, out: torch.Tensor, seed: int) -> bool:
        """``out <- Q(diff)``.

        Args:
            diff: float32 ``[numel]``, contiguous (the member's scratch buffer).
            out: uint8 ``[nbytes]``, contiguous, on diff's device (a row of a message).
            seed: stochastic-rounding seed in [0, 2**64).

        Returns:
            True when every scale is at most MAX_SCALE: the message decodes unchecked
            (:meth:`accumulate` with ``checked=False``); False for a finite message with a
            larger scale (decode it with ``checked=True``).

        Raises:
            NonFiniteError: ``diff`` holds NaN or Inf (argument ``"x"``, as
                :func:`~qcomm.compress.quantize` names it); ``out`` then holds NaN scales and
                must not be sent.
        """
        quantize_into(diff, self.spec, out, seed)
        largest = self.largest_scale(out)  # the one host read of the round's own message
        if largest <= MAX_SCALE:
            return True
        if largest <= FLOAT32_MAX:
            return False
        raise nonfinite_error(self.scales(out), "x", "(plus error) has")

    def largest_scale(self, payload: torch.Tensor) -> float:
        """The largest ``|scale|`` of ``payload`` (uint8 ``[nbytes]``), NaN or Inf when one is:
        one reduction on the device and one host read."""
        return float(largest_magnitude(self.scales(payload)))

    def bounded(self, payload: torch.Tensor) -> bool:
        """Whether every scale of ``payload`` (uint8 ``[nbytes]``) is finite and at most
        MAX_SCALE, i.e. it decodes unchecked; one host read (NaN <= c is False)."""
        return self.largest_scale(payload) <= MAX_SCALE

    def accumulate(self, payloads: torch.Tensor, out: torch.Tensor,
                   weights: torch.Tensor | None = None, *, checked: bool = False) -> None:
        """``out += sum_k weights[k] * D(payloads[k])``.

        Args:
            payloads: uint8 ``[K, nbytes]`` or ``[nbytes]``, contiguous, on out's device.
            out: float32 ``[numel]``, contiguous (a fragment of the member's buffers).
            weights: float32 ``[K]`` on out's device (finite, at most 1 in magnitude: mixing
                weights), or None for all ones.
            checked: False (the round's fast path) only for payloads whose scales are known
                finite and at most MAX_SCALE (module docstring); True goes through
                :func:`~qcomm.compress.dequant_accumulate` and its checks (a host read).

        Raises:
            NonFiniteError, AccumulateOverflowError: with ``checked=True`` only, as
                :func:`~qcomm.compress.dequant_accumulate`; ``out`` is then unchanged.
        """
        if checked:
            dequant_accumulate(payloads, out, self.spec, weights)
            return
        if payloads.dim() == 1:
            payloads = payloads.unsqueeze(0)
        dequant_accumulate_into(payloads, out, self.spec, weights)


def check_state_buffer(name: str, t: object, numel: int | tuple[int, ...],
                       device: torch.device | None = None) -> torch.Tensor:
    """A float32 buffer from a saved state: a tensor of shape ``numel`` (an int: ``[numel]``),
    on ``device`` when given. Rounds decode into it without checking it again, so it is
    checked here, naming ``name``.

    Raises:
        TypeError: not a tensor, or not float32.
        ValueError: another shape, or another device.
    """
    shape = (numel,) if isinstance(numel, int) else tuple(numel)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"state[{name!r}] must have dtype float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"state[{name!r}] must have shape {list(shape)} (this gossip's), got "
                         f"{list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"state[{name!r}] must be on {device} (like the other buffers), got "
                         f"{t.device}")
    return t


def check_state_buffers(state: Mapping, shapes: Mapping[str, int | tuple[int, ...]],
                        together: Sequence[Sequence[str]]) -> dict[str, torch.Tensor | None]:
    """The float32 buffers ``shapes`` names, from a saved state (a missing key or None: not
    created yet), each checked by :func:`check_state_buffer` and all on the first one's
    device; the names of each group in ``together`` are all None or all tensors.

    Raises:
        TypeError, ValueError: naming the first buffer that is not what this gossip needs.
    """
    saved = {name: state.get(name) for name in shapes}
    for group in together:
        present = [n for n in group if saved[n] is not None]
        if present and len(present) != len(group):
            missing = next(n for n in group if saved[n] is None)
            raise ValueError(f"state[{missing!r}] is None while state[{present[0]!r}] is not "
                             f"({', '.join(group)} are created together)")
    device = None
    for name, numel in shapes.items():
        if saved[name] is not None:
            check_state_buffer(name, saved[name], numel, device)
            device = saved[name].device
    return saved
