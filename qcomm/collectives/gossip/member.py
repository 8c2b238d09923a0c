"""What every gossip member has, whichever mode: its validated hyperparameters (a
:class:`~.config.GossipConfig`), the step clock that says when a round is due, the fragments a
round carries, the mixing of a fragment (the outer Nesterov step and the CHOCO correction), and
what its user asks of either mode alike (how it ends, what a checkpoint needs first, its
statistics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from qcomm.collectives.stats import CommStats
from qcomm.kernels.wire_format import check_spec
from qcomm.validation import check_instance, check_int

from .clock import StepClock
from .codec import GossipCodec
from .config import GossipConfig
from .gamma import default_gamma
from .options import (
    check_fragments,
    check_gamma,
    check_graph,
    check_max_backlog,
    check_mixing,
    check_on_peer_loss,
    check_outer_lr,
    check_outer_momentum,
    check_seed,
    check_staleness,
    check_timeout,
    check_total_steps,
)
from .outer_anneal import annealed_outer_lr
from .schedules import check_time_varying_graph

__all__ = ["GossipMember", "fragment_slice"]


def fragment_slice(index: int, fragment_numel: int) -> slice:
    """The elements of fragment ``index`` when every fragment holds ``fragment_numel``."""
    return slice(index * fragment_numel, (index + 1) * fragment_numel)


class GossipMember:
    """Base of :class:`~.choco.CompressedGossip` and :class:`~.wait_free.WaitFreeGossip`."""

    _closed = False
    _hat_own: torch.Tensor | None = None
    _momentum: torch.Tensor | None = None  # the outer step's, per element
    _anchor: torch.Tensor | None = None    # x right after each fragment's previous mix
    size: int
    member: int
    #: Whether every rail's member changes the same fragments in a round (the node's ranks
    #: then all-gather those without agreeing on them first).
    changes_agree_across_rails = True

    #: Whether a member waits for its neighbours' rounds (every member then takes the same
    #: steps, so a step skipped anywhere is skipped everywhere).
    lockstep: ClassVar[bool]

    #: Whether the member takes a time-varying graph (:mod:`.schedules`) instead of a static one.
    time_varying: ClassVar[bool] = False

    def _set_hyperparameters(self, numel: int, config: GossipConfig, *,
                             stats: CommStats | None, seed: int, first_step: int = 0,
                             clock: StepClock | None = None) -> None:
        """Check the settings with the functions of :mod:`.options` (``CommOptions`` checks the
        same options with the same functions), then fix them. ``clock``: the step clock to
        advance (shared with whoever built this member); None: a new one from
        ``first_step``."""
        self.config = config
        self.graph = (check_time_varying_graph if self.time_varying else check_graph)(config.graph)
        self.mixing = check_mixing(config.mixing)
        self.spec = spec = check_spec(config.spec)
        self.numel = check_int("numel", numel, low=1)
        self.staleness = check_staleness(config.staleness)
        gamma = check_gamma(config.gamma)
        self.gamma = default_gamma(spec.bits, self.staleness) if gamma is None else gamma
        self.timeout_s = check_timeout(config.timeout_s)
        self.seed = check_seed(seed)
        self.fragments = check_fragments(config.fragments, self.numel, "numel")
        self.fragment_numel = self.numel // self.fragments
        self._codec = GossipCodec(self.spec, self.fragment_numel)  # its checks, once
        self.outer_momentum = check_outer_momentum(config.outer_momentum)
        self.outer_lr = check_outer_lr(config.outer_lr)
        self._outer = self.outer_momentum != 0 or self.outer_lr != 1
        # The run's length: the outer lr anneals over its last 70% (outer_anneal.py).
        self.total_steps = check_total_steps(config.total_steps)
        self.round_period = check_int("round_period", config.round_period, low=1)
        check_instance("stats", stats, CommStats, allow_none=True)
        self.stats = stats if stats is not None else CommStats()
        # The clock: local steps ended (end_step calls), from ``first_step`` (a run resumed
        # into a fresh gossip state goes on counting where it was).
        check_instance("clock", clock, StepClock, allow_none=True)
        self.clock = clock if clock is not None else StepClock(first_step)
        self.max_backlog = check_max_backlog(config.max_backlog)
        self.on_peer_loss = check_on_peer_loss(config.on_peer_loss)

    @property
    def steps(self) -> int:
        """Local steps ended: the clock's count."""
        return self.clock.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.clock.steps = value

    def _config(self) -> dict:
        """The settings a saved state must have been saved with (the modes add theirs)."""
        return {"numel": self.numel, "size": self.size, "member": self.member,
                "graph": self.graph, "mixing": self.mixing, "staleness": self.staleness,
                "spec": (self.spec.bits, self.spec.block_size, self.spec.rounding)}

    def _mix_fragment(self, x: torch.Tensor, f: int, correction: Callable[[], torch.Tensor],
                      step: float) -> torch.Tensor:
        """Mix fragment f of ``x`` (float32 ``[numel]``, in place), both modes alike: the outer
        Nesterov step on the fragment's progress since its previous mix, as DiLoCo and SlowMo
        take on their averaged deltas (with ``d = x_f - a_f``: ``u = mu u + d; x_f = a_f +
        lr (d + mu u)``; none with ``outer_lr=1, outer_momentum=0``), then the CHOCO step
        ``x_f += step * correction()``; the result is the fragment's next anchor. Returns the
        correction (the mode's consensus term, computed after the outer step)."""
        frag = self.fragment(f)
        xf = x[frag]
        if self._outer:
            a, u = self._anchor[frag], self._momentum[frag]
            d = torch.sub(xf, a)
            u.mul_(self.outer_momentum).add_(d)
            d.add_(u, alpha=self.outer_momentum)
            lr = annealed_outer_lr(self.outer_lr, self.outer_momentum, self.progress(),
                                   self.total_steps)
            torch.add(a, d, alpha=lr, out=xf)
        c = correction()
        xf.add_(c, alpha=step)
        if self._outer:
            self._anchor[frag].copy_(xf)
        return c

    def progress(self) -> int:
        """The job's progress in local steps, as far as this member knows: what the outer
        step's anneal follows (:mod:`.outer_anneal`). In lockstep every member takes the same
        steps, so its own; the wait-free mode also counts the furthest neighbour it heard."""
        return self.steps

    def settle(self, x: torch.Tensor) -> None:
        """Add to ``x`` (float32 ``[numel]``, in place) what the mixing owes it and has not
        applied yet, so that the members' ``x`` alone hold their average (before an exact
        average). The bounded-staleness gossip owes nothing; the wait-free one adds its mirror
        terms."""

    def restart_clock(self, steps: int) -> None:
        """Count on from ``steps`` (a run resumed with a fresh gossip state: its rounds stay
        on the run's schedule)."""
        self.clock.restart(steps)

    # -----------------------------------------------------------------------------------------
    # what the user of either mode asks alike (each mode answers in its own way)

    def leave(self) -> None:
        """End this member's part at the end of a run: complete what the mode completes when
        the peers still answer, then :meth:`close`. Never raises a peer's failure."""
        self.close()

    def wait_linked(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every link this member opened is made or has failed
        (links made in threads, each within its own bounds); whether all were. What a job's
        starting members do before their first round, so that a link slow to make (a
        rendezvous busy with a whole job's connects) is not taken for a silent peer once its
        backlog fills. The lockstep mode's links are its process group's: made.

        Raises:
            ValueError: ``timeout_s`` not a finite number above 0."""
        timeout_s = check_timeout(timeout_s)
        streams = getattr(self, "_streams_now", None)
        return True if streams is None else streams().wait_made(timeout_s)

    def before_state_dict(self) -> None:
        """What must run on every member of the group at the same point before
        ``state_dict()`` (collective in the modes that need it; nothing by default)."""

    def mode_stats(self) -> dict[str, Any]:
        """The statistics only this mode keeps (keys as :meth:`idle_stats`)."""
        return {}

    @classmethod
    def idle_stats(cls) -> dict[str, Any]:
        """:meth:`mode_stats` before any member of this mode exists."""
        return {}

    @classmethod
    def mode_words(cls, config: GossipConfig) -> str:
        """The mode in words, for a log line (``config``: the settings)."""
        raise NotImplementedError

    def round_due(self) -> bool:
        """Whether the step in progress ends with a round: the last step of every
        ``round_period`` steps."""
        return (self.steps + 1) % self.round_period == 0

    def fragment(self, index: int) -> slice:
        """The elements of fragment ``index``."""
        return fragment_slice(index, self.fragment_numel)

    def _check_x(self, x: object) -> torch.Tensor:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"x must have dtype float32, got {x.dtype}")
        if x.numel() != self.numel:
            raise ValueError(f"x must have numel {self.numel}, got {x.numel()}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous (it is updated in place)")
        if self._hat_own is not None and x.device != self._hat_own.device:
            raise ValueError(f"x must be on {self._hat_own.device} (where the gossip state "
                             f"lives), got {x.device}")
        return x.view(-1)
