"""The communication options of one model: what the engine sends, to whom, and how often.

:class:`CommOptions` is validated at construction (ValueError/TypeError naming the argument and
the allowed values) and frozen afterwards; the optimizers pass their keyword arguments straight
through to it, so every optimizer accepts the same names with the same limits.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from qcomm.compress import QuantSpec
from qcomm.kernels.counter_hash import check_seed

NONFINITE_MODES = ("raise", "skip")
GRAPHS = ("ring", "exponential", "complete")
MIXINGS = ("uniform", "metropolis")
SUPPORTED_BITS = (1, 2, 4, 8)

# Old argument names still accepted (with a DeprecationWarning) -> today's names.
DEPRECATED_NAMES = {"topology": "graph", "gossip_step": "gamma"}

# Options that shape the wire format and the mixing: a checkpoint loads only into the same ones.
WIRE_FIELDS = ("bits", "block_size", "rounding", "graph", "mixing", "staleness", "intra_bits",
               "sync_every", "fragments", "outer_momentum")


def is_real(x: object) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_int(name: str, value: object, low: int, allow_none: bool = False) -> None:
    """``value`` is an int >= ``low`` (or None when allowed); else TypeError/ValueError naming
    ``name``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or None" if allow_none else ""
        raise TypeError(f"{name} must be an int >= {low}{none}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")


@dataclass(frozen=True)
class CommOptions:
    """How one model communicates (one set per optimizer; shared by every param group).

    Attributes:
        bits: gossip code width between nodes, one of 1, 2, 4, 8.
        block_size: elements per quantization scale, a power of two in [32, 4096].
        rounding: ``"stochastic"`` (unbiased) or ``"nearest"``.
        graph: gossip graph between nodes: ``"ring"``, ``"exponential"`` or ``"complete"``.
        mixing: ``"uniform"`` or ``"metropolis"`` mixing weights.
        staleness: gossip rounds in flight: a round is applied when the round ``staleness``
            rounds later starts (>= 0; 0 is synchronous).
        gamma: CHOCO's consensus step in (0, 1]; None picks the default for bits and staleness.
        sync_every: H >= 1: every part of the parameters is gossiped once every H steps.
        fragments: F >= 1 dividing H: each rail's shard is split into F fragments and one
            fragment's round starts every H / F steps, so the link carries an even load.
        outer_momentum: Nesterov momentum in [0, 1) on the gossip's mixing correction; 0 is
            plain CHOCO.
        intra_bits: None averages gradients inside a node in full precision; 1/2/4/8 quantizes
            them with error feedback.
        procs_per_node: ranks per node; None takes ``LOCAL_WORLD_SIZE`` (torchrun), else 1.
        bucket_mb: intra-node allreduce bucket size in MiB, > 0.
        on_nonfinite: ``"raise"`` or ``"skip"`` a step whose gradients hold NaN/Inf.
        timeout_s: how long the gossip waits for a peer's round, > 0.
        seed: seed of stochastic rounding, an int in [0, 2**64).
    """

    bits: int = 4
    block_size: int = 128
    rounding: str = "stochastic"
    graph: str = "ring"
    mixing: str = "uniform"
    staleness: int = 1
    gamma: float | None = None
    sync_every: int = 1
    fragments: int = 1
    outer_momentum: float = 0.0
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
        if self.graph not in GRAPHS:
            raise ValueError(f"graph must be one of {GRAPHS}, got {self.graph!r}")
        if self.mixing not in MIXINGS:
            raise ValueError(f"mixing must be one of {MIXINGS}, got {self.mixing!r}")
        check_int("staleness", self.staleness, 0)
        if self.gamma is not None and (not is_real(self.gamma) or not 0 < self.gamma <= 1):
            raise ValueError(f"gamma must be None (a default for bits and staleness) or a "
                             f"float in (0, 1], got {self.gamma!r}")
        check_int("sync_every", self.sync_every, 1)
        check_int("fragments", self.fragments, 1)
        if self.sync_every % self.fragments:
            raise ValueError(f"fragments must divide sync_every: got fragments={self.fragments}, "
                             f"sync_every={self.sync_every}")
        if not is_real(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be a float in [0, 1), "
                             f"got {self.outer_momentum!r}")
        if self.intra_bits is not None and (
            self.intra_bits not in SUPPORTED_BITS or isinstance(self.intra_bits, bool)
        ):
            raise ValueError(f"intra_bits must be None (full precision) or one of "
                             f"{SUPPORTED_BITS}, got {self.intra_bits!r}")
        check_int("procs_per_node", self.procs_per_node, 1, allow_none=True)
        if not is_real(self.bucket_mb) or not (math.isfinite(self.bucket_mb)
                                               and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a finite float > 0, got {self.bucket_mb!r}")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, "
                             f"got {self.on_nonfinite!r}")
        if not is_real(self.timeout_s) or not (math.isfinite(self.timeout_s)
                                               and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite float > 0, got {self.timeout_s!r}")
        check_seed(self.seed)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], *, stacklevel: int = 3) -> CommOptions:
        """Build from an optimizer's keyword arguments: unknown names raise TypeError listing
        the accepted ones; deprecated names (``topology``, ``gossip_step``) are mapped to
        today's with a DeprecationWarning."""
        fields = set(cls.__dataclass_fields__)
        out: dict[str, Any] = {}
        aliases: dict[str, str] = {}
        for name, value in kwargs.items():
            if name in DEPRECATED_NAMES:
                new = DEPRECATED_NAMES[name]
                if new in kwargs:
                    raise TypeError(f"pass either {name}= (deprecated) or {new}=, not both")
                warnings.warn(f"{name}= is deprecated, use {new}=", DeprecationWarning,
                              stacklevel=stacklevel)
                aliases[new] = name
                name = new
            elif name not in fields:
                raise TypeError(f"unknown communication option {name!r}; accepted: "
                                f"{', '.join(sorted(fields))}")
            out[name] = value
        try:
            return cls(**out)
        except (TypeError, ValueError) as e:
            # Name the argument as the caller spelled it.
            for new, old in aliases.items():
                if str(e).startswith(new + " "):
                    raise type(e)(f"{old} (deprecated name of {new}): {e}") from None
            raise

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's options dict with today's names (older checkpoints used ``topology``
        and ``gossip_step``) and today's defaults for options they predate."""
        out = {f.name: f.default for f in cls.__dataclass_fields__.values()}
        out.update({DEPRECATED_NAMES.get(k, k): v for k, v in saved.items()})
        return out

    @property
    def round_period(self) -> int:
        """Steps between two gossip rounds: ``sync_every / fragments``."""
        return self.sync_every // self.fragments

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def gossip_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.block_size, self.rounding)  # type: ignore[arg-type]

    @property
    def intra_spec(self) -> QuantSpec | None:
        if self.intra_bits is None:
            return None
        return QuantSpec(self.intra_bits, self.block_size, self.rounding)  # type: ignore[arg-type]
