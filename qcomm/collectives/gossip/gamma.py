"""The default consensus step size of the gossip, by code width and staleness.

About half the largest gamma that converged when measured with the in-process simulator
(:mod:`qcomm.collectives.memory.simulate`, the same code path as over Gloo) on a ring of 4, an
exponential graph of 8 and a ring of 8, so that a graph or data a little harsher than those
still converges. It shrinks with staleness (a stale correction overshoots sooner) and is
smallest at 1 bit, where the sign code, not the step, limits the rate. The table and how to
re-measure it (``bench/tune_gamma.py``): docs/gossip_tuning.md.
"""

from __future__ import annotations

from qcomm.kernels.wire_format import SUPPORTED_BITS
from qcomm.validation import check_choice

from .options import check_staleness

__all__ = ["default_gamma"]

# (bits, staleness) -> default gamma (docs/gossip_tuning.md); staleness > 2 uses the staleness-2
# entry scaled down.
_DEFAULT_GAMMA: dict[tuple[int, int], float] = {
    (8, 0): 0.5, (8, 1): 0.3, (8, 2): 0.2,
    (4, 0): 0.4, (4, 1): 0.3, (4, 2): 0.2,
    (2, 0): 0.3, (2, 1): 0.3, (2, 2): 0.2,
    (1, 0): 0.1, (1, 1): 0.05, (1, 2): 0.05,
}


def default_gamma(bits: int, staleness: int) -> float:
    """The default consensus step size for ``bits``-bit messages applied ``staleness`` rounds
    late: about half the largest gamma that converged in the measurement of
    docs/gossip_tuning.md, so that a graph or data set a little harsher than the measured ones
    still converges."""
    check_choice("bits", bits, SUPPORTED_BITS)
    check_staleness(staleness)
    if staleness <= 2:
        return _DEFAULT_GAMMA[(bits, staleness)]
    # Beyond the measured range: shrink like 1 / staleness (the delay-stability rule of thumb).
    return _DEFAULT_GAMMA[(bits, 2)] * 2.0 / staleness
