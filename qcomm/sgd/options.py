"""ASSGD's hyperparameters: validation (ValueError/TypeError naming the argument) and the
communication options that are global to the optimizer (not per param group)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from qcomm.compress import QuantSpec

NONFINITE_MODES = ("raise", "skip")
GRAPHS = ("ring", "exponential", "complete")
MIXINGS = ("uniform", "metropolis")
SUPPORTED_BITS = (1, 2, 4, 8)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_nonneg(name: str, value: object) -> None:
    """A finite real >= 0 (or, for lr, a 1-element tensor holding one)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float >= 0 or a 1-element tensor, "
                             f"got a tensor of {value.numel()} elements")
        value = float(value.item())
    if not _is_real(value):
        raise TypeError(f"{name} must be a float >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


def check_sgd_group(group: dict) -> None:
    """Validate the torch.optim.SGD hyperparameters of one param group."""
    for name in ("lr", "momentum", "weight_decay"):
        check_nonneg(name, group[name])
    dampening = group["dampening"]
    if not _is_real(dampening) or not 0 <= dampening <= 1:
        raise ValueError(f"dampening must be a float in [0, 1], got {dampening!r}")
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
    if group["nesterov"] and (group["momentum"] <= 0 or dampening != 0):
        raise ValueError(
            "nesterov=True requires momentum > 0 and dampening = 0, got "
            f"momentum={group['momentum']!r}, dampening={dampening!r}"
        )
    if not isinstance(group["maximize"], bool):
        raise TypeError(f"maximize must be a bool, got {group['maximize']!r}")
    if group["foreach"] not in (None, True, False):
        raise TypeError(f"foreach must be None or a bool, got {group['foreach']!r}")


def _check_int(name: str, value: object, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or None" if allow_none else ""
        raise TypeError(f"{name} must be an int >= {low}{none}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")


@dataclass(frozen=True)
class CommOptions:
    """How ASSGD communicates (one set per optimizer; see :class:`qcomm.sgd.ASSGD`)."""

    bits: int = 4
    block_size: int = 128
    rounding: str = "stochastic"
    topology: str = "ring"
    mixing: str = "uniform"
    staleness: int = 1
    gossip_step: float | None = None
    intra_bits: int | None = None
    procs_per_node: int | None = None
    bucket_mb: float = 25.0
    on_nonfinite: str = "raise"
    timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS or isinstance(self.bits, bool):
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits!r}")
        self.gossip_spec  # noqa: B018 -- QuantSpec checks block_size and rounding by name
        if self.topology not in GRAPHS:
            raise ValueError(f"topology must be one of {GRAPHS}, got {self.topology!r}")
        if self.mixing not in MIXINGS:
            raise ValueError(f"mixing must be one of {MIXINGS}, got {self.mixing!r}")
        _check_int("staleness", self.staleness, 0)
        if self.gossip_step is not None and (
            not _is_real(self.gossip_step) or not 0 < self.gossip_step <= 1
        ):
            raise ValueError(f"gossip_step must be None (a default for bits and staleness) or a "
                             f"float in (0, 1], got {self.gossip_step!r}")
        if self.intra_bits is not None and (
            self.intra_bits not in SUPPORTED_BITS or isinstance(self.intra_bits, bool)
        ):
            raise ValueError(f"intra_bits must be None (full precision) or one of "
                             f"{SUPPORTED_BITS}, got {self.intra_bits!r}")
        _check_int("procs_per_node", self.procs_per_node, 1, allow_none=True)
        if not _is_real(self.bucket_mb) or not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a float > 0, got {self.bucket_mb!r}")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, "
                             f"got {self.on_nonfinite!r}")
        if not _is_real(self.timeout_s) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a float > 0, got {self.timeout_s!r}")
        _check_int("seed", self.seed, 0)

    @property
    def gossip_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.block_size, self.rounding)  # type: ignore[arg-type]

    @property
    def intra_spec(self) -> QuantSpec | None:
        if self.intra_bits is None:
            return None
        return QuantSpec(self.intra_bits, self.block_size, self.rounding)  # type: ignore[arg-type]
