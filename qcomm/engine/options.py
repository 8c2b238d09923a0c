"""The communication options of one model: what the engine sends, to whom, and how often.

:class:`CommOptions` is validated at construction (ValueError/TypeError naming the argument and
the allowed values) and frozen afterwards; the optimizers pass their keyword arguments straight
through to it, so every optimizer accepts the same names with the same limits.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from qcomm.collectives.gossip.config import GossipConfig
from qcomm.collectives.gossip.graph_choice import check_option_graph, choose_graph
from qcomm.collectives.gossip.options import GRAPHS, MIXINGS, OPTION_CHECKS, check_fragments
from qcomm.collectives.gossip.options import ON_PEER_LOSS as PEER_LOSS_MODES
from qcomm.compress import QuantSpec
from qcomm.kernels.wire_format import SUPPORTED_BITS
from qcomm.validation import (
    check_bucket_mb,
    check_choice,
    check_host_port,
    check_instance,
    check_int,
    did_you_mean,
)
from qcomm.wire.token import check_token

__all__ = ["GRAPHS", "JOIN_OPTIMIZER_STATES", "MIXINGS", "NONFINITE_MODES", "PEER_LOSS_MODES",
           "WIRE_FIELDS", "CommOptions"]

NONFINITE_MODES = ("raise", "skip")
JOIN_OPTIMIZER_STATES = ("copy", "fresh")


# The gossip's settings (GossipConfig's fields) that CommOptions holds under another name; every
# other field is the option of the same name.
_GOSSIP_OPTION_OF = {"spec": "gossip_spec"}

# Options that shape the wire format and the mixing: a checkpoint loads only into the same ones.
WIRE_FIELDS = ("bits", "block_size", "rounding", "graph", "mixing", "staleness", "intra_bits",
               "sync_every", "fragments", "outer_momentum", "outer_lr", "wait_free",
               "on_peer_loss")


def user_stacklevel() -> int:
    """The ``stacklevel`` (seen from the caller's ``warnings.warn``) of the innermost frame
    outside this package: the user's line, however many of our frames lie between (optimizer
    constructors and their subclasses', ``from_kwargs``, the dataclass's generated
    ``__init__``, named ``<string>``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def ours(filename: str) -> bool:
        return filename == "<string>" or os.path.abspath(filename).startswith(package)

    frame, level = sys._getframe(1), 1
    while frame is not None and ours(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


@dataclass(frozen=True)
class CommOptions:
    """How one model communicates (one set per optimizer; shared by every param group).

    Attributes:
        bits: gossip code width between nodes, one of 1, 2, 4, 8.
        block_size: elements per quantization scale, a power of two in [32, 4096].
        rounding: ``"stochastic"`` (unbiased) or ``"nearest"``.
        graph: gossip graph between nodes: ``"ring"``, ``"exponential"``, ``"complete"``, or
            ``"one-peer-exp"`` (one peer per round, changing with the round; in both modes);
            None (default): chosen by the node count when the run starts
            (:func:`~qcomm.collectives.gossip.graph_choice.choose_graph`: the ring below 7
            nodes and the one-peer graph from 7, in both modes), and said in the layout log
            line.
        mixing: ``"uniform"`` or ``"metropolis"`` mixing weights.
        staleness: gossip rounds in flight: a round is applied when the round ``staleness``
            rounds later starts (>= 0; 0 is synchronous).
        gamma: CHOCO's consensus step in (0, 1]; None picks the default for bits and staleness.
        sync_every: H >= 1: every part of the parameters is gossiped once every H steps.
        fragments: F >= 1 dividing H: each rail's shard is split into F fragments and one
            fragment's round starts every H / F steps, so the link carries an even load.
        outer_momentum, outer_lr: an outer Nesterov step (momentum in [0, 1), learning rate in
            (0, 2]) on each fragment's own progress between its rounds, as DiLoCo takes on its
            averaged delta; 0 and 1 (default) are plain CHOCO.
        total_steps: the run's length in local steps (each rank's optimizer steps), as
            torch's schedulers take it (``CosineAnnealingLR``'s ``T_max``, ``OneCycleLR``'s
            ``total_steps``), or None (default). With an outer step, its learning rate is held
            for the first 30% of the run, then anneals (cosine) to ``1 - outer_momentum``,
            where it no longer amplifies the inner steps' progress: a run at a constant
            learning rate then ends at its best instead of declining (docs/guide.md, "At the
            end of a run"). It follows the job's progress: in the wait-free mode a node counts
            its own steps or the furthest a neighbour is known to have taken, whichever is
            more, so a slow node anneals with the fast ones (give the fastest node's count).
            Without an outer step it changes nothing.
        intra_bits: None averages gradients inside a node in full precision; 1/2/4/8 quantizes
            them with error feedback.
        procs_per_node: ranks per node; None takes ``LOCAL_WORLD_SIZE`` (torchrun), else 1.
        bucket_mb: intra-node allreduce bucket size in MiB, > 0.
        on_nonfinite: ``"raise"`` or ``"skip"`` a step whose gradients hold NaN/Inf.
        timeout_s: how long the gossip waits for a peer's round, > 0; with ``wait_free``, the
            longest silence of a neighbour before it counts as failed.
        seed: seed of stochastic rounding, an int in [0, 2**64).
        wait_free: False (default): bounded staleness, the round started ``staleness`` rounds
            earlier is applied at each round and waited for, so every node runs at its slowest
            neighbour's pace (deterministic: the same bits on every run). True: no node waits
            for a neighbour's round; each takes what its neighbours sent whenever a round of
            its own is due, and nodes may take different numbers of steps (see
            :mod:`qcomm.collectives.gossip.wait_free`).
        max_backlog: with ``wait_free``, messages per neighbour sent and not yet taken, >= 1:
            the memory bound of a stream (a sender that reaches it waits for the neighbour,
            at most ``timeout_s / 2``, so that its other neighbours never hear it silent for
            ``timeout_s``; then that neighbour counts as failed).
        on_peer_loss: what a node does when a neighbouring node dies or stays silent past
            ``timeout_s``: ``"raise"`` (default) the named
            :class:`~qcomm.collectives.errors.PeerError` on every survivor, or ``"continue"``
            without it: the neighbour is dropped, the ring closes over the gap and the
            survivors train on; :meth:`average_parameters` averages the survivors. Needs
            ``wait_free=True``. A failure inside a node still ends that node.
        join_optimizer_state: what the wrapped optimizer's state (momentum, Adam's moments and
            step counts) of a node that joins a running job starts from (nodes linked through
            :func:`qcomm.rendezvous.init_node`): ``"copy"`` (default) the running neighbour's
            that hands it its parameters, ``"fresh"`` empty, as a new optimizer's (the join
            then moves only the parameters and the gossip's state: Adam's state is twice the
            parameters' bytes). Parameters FSDP2 shards start fresh either way.
        listen: ``"HOST:PORT"`` this node accepts its links to the other nodes on (nodes
            linked through :func:`qcomm.rendezvous.init_node`; local rank r takes PORT + r;
            PORT 0: the system picks), instead of ``init_node(listen=)`` / ``QCOMM_LISTEN``;
            None (default): theirs.
        token: the job token (a string of at least 16 characters) every link between nodes
            proves it holds, instead of ``init_node(token=)`` / ``QCOMM_TOKEN`` (the
            rendezvous is reached with init_node's, so the two must be the same where both
            are set); None (default): theirs. Never shown in the options' repr, never saved
            in a checkpoint or a pickle.
    """

    bits: int = 4
    block_size: int = 128
    rounding: str = "stochastic"
    graph: str | None = None
    mixing: str = "uniform"
    staleness: int = 1
    gamma: float | None = None
    sync_every: int = 1
    fragments: int = 1
    outer_momentum: float = 0.0
    outer_lr: float = 1.0
    total_steps: int | None = None
    intra_bits: int | None = None
    procs_per_node: int | None = None
    bucket_mb: float = 25.0
    on_nonfinite: str = "raise"
    timeout_s: float = 300.0
    seed: int = 0
    wait_free: bool = False
    max_backlog: int = 64
    on_peer_loss: str = "raise"
    join_optimizer_state: str = "copy"
    listen: str | None = None
    token: str | None = field(default=None, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> CommOptions:
        # Before the generated __init__, whose TypeError for an unknown keyword names no
        # option near it: CommOptions(stalenes=2), dataclasses.replace and from_kwargs all
        # come through here.
        cls._refuse_unknown(kwargs)
        return super().__new__(cls)

    @classmethod
    def _refuse_unknown(cls, names: Iterable[str]) -> None:
        """Raise TypeError for the first name that is no option, listing the options and the
        nearest one (:func:`~qcomm.validation.did_you_mean`).

        Args:
            names (Iterable[str]): keyword names given for options.
        """
        fields = sorted(cls.__dataclass_fields__)
        unknown = sorted(set(names) - set(fields))
        if unknown:
            raise TypeError(f"unknown communication option {unknown[0]!r}; accepted: "
                            f"{', '.join(fields)}{did_you_mean(unknown[0], fields)}")

    def __post_init__(self) -> None:
        # Every option is checked by the one function that checks it wherever it is taken:
        # QuantSpec's for bits, block_size and rounding, the gossip's (OPTION_CHECKS) for those
        # the gossip members take too, so a bad value reads the same whichever class got it.
        self.gossip_spec  # noqa: B018 -- QuantSpec checks bits, block_size and rounding
        for name, check in OPTION_CHECKS.items():
            check(getattr(self, name))
        check_instance("wait_free", self.wait_free, bool, what="True or False")
        # Before the graph: which graphs a run takes depends on its mode.
        check_option_graph(self.graph)
        check_int("sync_every", self.sync_every, low=1)
        check_fragments(self.fragments, self.sync_every, "sync_every")
        check_choice("intra_bits", self.intra_bits, SUPPORTED_BITS, allow_none=True)
        check_int("procs_per_node", self.procs_per_node, low=1, allow_none=True)
        check_bucket_mb(self.bucket_mb)
        check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_MODES)
        check_choice("join_optimizer_state", self.join_optimizer_state, JOIN_OPTIMIZER_STATES)
        if self.listen is not None:
            check_host_port("listen", self.listen, "the address this node accepts its links "
                            "on (or None)", low_port=0)
        if self.token is not None:
            check_token("token", self.token)
        if self.on_peer_loss == "continue" and not self.wait_free:
            raise ValueError("on_peer_loss='continue' needs wait_free=True: a node that waits "
                             "for its neighbours' rounds cannot go on without one")
        self._warn_if_delayed_full_step()

    def _warn_if_delayed_full_step(self) -> None:
        """A consensus step above 0.5 is only stable when each fragment's correction lands
        before that fragment is sent again, i.e. when ``fragments > staleness``.

        With ``staleness >= fragments`` a fragment's next round quantizes it before the previous
        round's correction was applied, so a disagreement e follows ``e' = e - gamma * L e_old``
        (L: the graph's Laplacian-like ``I - W``): at gamma = 1 it oscillates on the complete
        graph and grows on the ring (its largest eigenvalue of ``I - W`` is 4/3). Not an error:
        a gamma a little above 0.5 still converges, slowly."""
        if (self.gamma is not None and self.gamma > 0.5 and self.staleness > 0
                and self.staleness >= self.fragments):
            warnings.warn(
                f"gamma={self.gamma} with staleness={self.staleness} >= fragments="
                f"{self.fragments}: each fragment is sent again before its previous round's "
                "correction is applied, and a consensus step above 0.5 then oscillates or "
                "diverges; use fragments > staleness (e.g. sync_every=2, fragments=2) or "
                "gamma <= 0.5", UserWarning, stacklevel=user_stacklevel())

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], base: CommOptions | None = None
                    ) -> CommOptions:
        """Build from an optimizer's keyword arguments, over ``base`` (a CommOptions whose
        fields the keywords replace; None: the defaults): an unknown name raises TypeError
        naming the nearest accepted one when it looks misspelled, and listing them all.
        Everything is validated again.

        Args:
            kwargs (dict[str, Any]): option names and values.
            base (CommOptions | None): the options the keywords replace fields of.

        Returns:
            CommOptions: the options, checked.
        """
        if base is not None and not isinstance(base, CommOptions):
            raise TypeError(f"comm must be a CommOptions (or None), got {type(base).__name__}")
        out = {} if base is None else {f: getattr(base, f) for f in cls.__dataclass_fields__}
        return cls(**{**out, **kwargs})  # an unknown name is refused in __new__

    @property
    def round_period(self) -> int:
        """Steps between two gossip rounds: ``sync_every / fragments``."""
        return self.sync_every // self.fragments

    def as_dict(self) -> dict[str, Any]:
        """The options by name, as a checkpoint keeps them: the token left out (it never
        goes where a checkpoint goes)."""
        out = asdict(self)
        del out["token"]
        return out

    def __getstate__(self) -> dict[str, Any]:
        # A pickled optimizer or engine travels and is stored: without the token, which an
        # unpickled one takes from its own process again (init_node's, QCOMM_TOKEN).
        return {k: v for k, v in self.__dict__.items() if k != "token"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)   # token: the class's default, None

    def chosen_graph(self, num_nodes: int) -> tuple[str, str]:
        """The graph a run of ``num_nodes`` (int >= 1) nodes gossips over and why, in words:
        :attr:`graph`, or the one chosen by the node count when it is None
        (:func:`~qcomm.collectives.gossip.graph_choice.choose_graph`)."""
        return choose_graph(self.graph, num_nodes)

    def gossip_config(self, num_nodes: int | None = None) -> GossipConfig:
        """The gossip's settings, built from these options: the one mapping from the options
        to :class:`~qcomm.collectives.gossip.config.GossipConfig` (each of its fields is the
        option of its name, ``spec`` is :attr:`gossip_spec`, ``round_period`` is
        :attr:`round_period`, ``graph`` is :meth:`chosen_graph` for ``num_nodes``).

        Raises:
            ValueError: ``num_nodes`` is None and :attr:`graph` is None (the graph is then
                chosen by the node count).
        """
        if num_nodes is None and self.graph is None:
            raise ValueError("num_nodes must be given when graph is None (the graph is then "
                             "chosen by the node count), got None")
        graph = self.graph if num_nodes is None else self.chosen_graph(num_nodes)[0]
        values = {f.name: getattr(self, _GOSSIP_OPTION_OF.get(f.name, f.name))
                  for f in fields(GossipConfig) if f.name != "graph"}
        return GossipConfig(graph=graph, **values)

    @property
    def gossip_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.block_size, self.rounding)  # type: ignore[arg-type]

    @property
    def intra_spec(self) -> QuantSpec | None:
        if self.intra_bits is None:
            return None
        return QuantSpec(self.intra_bits, self.block_size, self.rounding)  # type: ignore[arg-type]
