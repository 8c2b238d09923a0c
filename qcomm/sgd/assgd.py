"""ASSGD: hierarchical asynchronous SGD (intra-node synchronous, inter-node compressed gossip).

One step on every rank (``L`` ranks per node, ``n`` nodes):

1. gradients -> synchronous mean over the node's ranks (full precision by default);
2. the local update, exactly ``torch.optim.SGD``'s (momentum, dampening, nesterov, weight decay,
   maximize), so all ranks of a node hold the same parameters afterwards;
3. with ``n > 1``: the parameters are flattened to float32 and split into ``L`` shards; local rank
   ``l`` runs one round of asynchronous CHOCO gossip on shard ``l`` with the ranks of local rank
   ``l`` on the other nodes (its *rail*, so every NIC of a node carries 1/L of the traffic), then
   the node all-gathers the shards.

Without torch.distributed (or with world size 1) step 1 and 3 vanish and ASSGD is bit-identical
to ``torch.optim.SGD``; with one node step 3 vanishes and it is synchronous data-parallel SGD.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from qcomm.collectives.stats import CommStats
from qcomm.sgd.flat import FlatParams
from qcomm.sgd.local_update import all_finite, group_tensors, sgd_update_
from qcomm.sgd.options import CommOptions, check_sgd_group

STATE_KEY = "qcomm"
STATE_FORMAT = 1
WORLD_CHANGE_MODES = ("error", "reinit")


class NonFiniteGradientError(FloatingPointError):
    """A (node-averaged) gradient holds NaN or Inf; the step changed nothing.

    Attributes:
        params: ``(group index, parameter index in the group)`` of each offending parameter
            (empty when another node reported it).
    """

    def __init__(self, message: str, params: list[tuple[int, int]]):
        super().__init__(message)
        self.params = params


class ASSGD(Optimizer):
    """Hierarchical asynchronous SGD with compressed gossip between nodes (a torch Optimizer).

    Args:
        params: iterable of parameters or param-group dicts (each group may set its own lr,
            momentum, dampening, weight_decay, nesterov, maximize, foreach).
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach: exactly as in
            ``torch.optim.SGD`` (``dampening`` must lie in [0, 1]).
        bits: gossip code width, 1, 2, 4 or 8.
        block_size: elements per quantization scale, a power of two in [32, 4096].
        rounding: ``"stochastic"`` (default; unbiased) or ``"nearest"``.
        topology: gossip graph between nodes: ``"ring"``, ``"exponential"`` or ``"complete"``.
        mixing: ``"uniform"`` or ``"metropolis"`` mixing weights.
        staleness: a gossip round started at step t is applied at step t + staleness (>= 0).
        gossip_step: CHOCO's consensus step gamma in (0, 1]; None picks the gossip default for
            ``bits`` and ``staleness``.
        intra_bits: None averages gradients inside a node in full precision; 1/2/4/8 quantizes
            them (with error feedback).
        procs_per_node: ranks per node; None takes ``LOCAL_WORLD_SIZE`` (see
            :class:`qcomm.collectives.topology.Topology`).
        bucket_mb: intra-node allreduce bucket size.
        on_nonfinite: ``"raise"`` (default): a NaN/Inf gradient raises
            :class:`NonFiniteGradientError`; ``"skip"``: the step is skipped. Either way
            parameters, momentum, error-feedback and gossip state are unchanged (the gradients
            themselves hold the node average). With several nodes, ``"skip"`` agrees on the
            decision over the rail (one 1-element allreduce per step, blocking) so no node
            skips a gossip round its peers run; ``"raise"`` raises on the nodes that saw the
            bad gradient and its peers stop with PeerTimeoutError after ``timeout_s``.
        timeout_s: how long gossip waits for a peer's round.
        seed: seed of stochastic rounding (each rail derives its own stream from it).

    Every rank must start from the same parameters (seed the model identically) and, in a
    distributed run, call :meth:`step` the same number of times with gradients for the same
    parameters. The first distributed :meth:`step` creates the process groups (collective).
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 bits: int = 4, block_size: int = 128, rounding: str = "stochastic",
                 topology: str = "ring", mixing: str = "uniform", staleness: int = 1,
                 gossip_step: float | None = None, intra_bits: int | None = None,
                 procs_per_node: int | None = None, bucket_mb: float = 25.0,
                 on_nonfinite: str = "raise", timeout_s: float = 300.0, seed: int = 0) -> None:
        self.comm = CommOptions(
            bits=bits, block_size=block_size, rounding=rounding, topology=topology,
            mixing=mixing, staleness=staleness, gossip_step=gossip_step, intra_bits=intra_bits,
            procs_per_node=procs_per_node, bucket_mb=bucket_mb, on_nonfinite=on_nonfinite,
            timeout_s=timeout_s, seed=seed,
        )
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        foreach=foreach)
        check_sgd_group(defaults)
        self._comm_stats = CommStats()
        self._steps = 0
        self._skipped = 0
        self._ready = False          # distributed machinery built (first distributed step)
        self._topology = None
        self._intra = None
        self._gossip = None
        self._flat: FlatParams | None = None
        self._pending_gossip_state: dict | None = None
        self._pending_intra_state: dict | None = None
        super().__init__(params, defaults)

    # -----------------------------------------------------------------------------------------
    # torch.optim.Optimizer interface

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``, validating the group's hyperparameters.
        Not allowed after the first distributed step (the gossip buffer layout is fixed)."""
        if getattr(self, "_ready", False) and self._flat is not None:
            raise RuntimeError("add_param_group after the first distributed step is not "
                               "supported: the gossip shards of the parameters are fixed")
        merged = {**self.defaults, **param_group}
        check_sgd_group(merged)
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        # Pickling (e.g. deepcopy) keeps options and counters, never process groups or the
        # gossip transport: a copy rebuilds them at its first distributed step, like a fresh
        # optimizer (use state_dict() to carry the communication state).
        state = super().__getstate__()
        state.update(comm=self.comm, _comm_stats=self._comm_stats, _steps=self._steps,
                     _skipped=self._skipped)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("comm", CommOptions())
        self.__dict__.setdefault("_comm_stats", CommStats())
        self.__dict__.setdefault("_steps", 0)
        self.__dict__.setdefault("_skipped", 0)
        self._ready = False
        self._topology = self._intra = self._gossip = self._flat = None
        self._pending_gossip_state = self._pending_intra_state = None
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One ASSGD step (see the module docstring). Returns the closure's loss, if any.

        Raises:
            NonFiniteGradientError: a gradient holds NaN/Inf and ``on_nonfinite="raise"``;
                nothing was changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not _distributed():
            self._local_step()
            return loss
        self._ensure_ready()
        grads = [g for group in self.param_groups for g in group_tensors(group, self.state)[1]]
        if not self._average_gradients(grads):
            return loss
        for group in self.param_groups:
            sgd_update_(group, self.state)
        if self._gossip is not None:
            self._gossip_round()
        self._steps += 1
        return loss

    # -----------------------------------------------------------------------------------------
    # the three phases

    def _local_step(self) -> None:
        grads = [g for group in self.param_groups for g in group_tensors(group, self.state)[1]]
        if not all_finite(grads) and self._nonfinite(local=True):
            return  # skipped ("raise" raised inside)
        for group in self.param_groups:
            sgd_update_(group, self.state)
        self._steps += 1

    def _average_gradients(self, grads: list[torch.Tensor]) -> bool:
        """Node-average ``grads`` in place; False when the step must be skipped (non-finite)."""
        topo = self._topology
        spec = self.comm.intra_spec
        if self._intra is not None and spec is None:
            # Full precision: a NaN/Inf on any rank propagates into the mean, and every rank
            # receives the same bytes, so the finiteness check below agrees across the node.
            self._intra.mean_(grads)
            finite = all_finite(grads)
        else:
            finite = all_finite(grads)
            if self._intra is not None:
                # The codec would refuse non-finite input on one rank only: agree first.
                flag = _flag(finite, grads)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topo.intra_group)
                finite = flag.item() == 0.0
                if finite:
                    self._intra.mean_(grads)
        if self.comm.on_nonfinite == "skip" and topo.num_nodes > 1:
            # Every node must skip the same steps, or a node would wait for a gossip round its
            # peer never starts. Ranks of a node agree already; one rail allreduce suffices.
            flag = _flag(finite, grads)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topo.rail_group)
            if flag.item() != 0.0 and finite:
                return not self._nonfinite(local=False)
        if finite:
            return True
        return not self._nonfinite(local=True)

    def _nonfinite(self, *, local: bool) -> bool:
        """Handle a non-finite gradient: raise, or count the skip and return True."""
        if self.comm.on_nonfinite == "skip":
            self._skipped += 1
            return True
        bad = []
        if local:
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                        bad.append((gi, pi))
        where = f"parameters (group, index) {bad[:8]}" if bad else "another node's gradients"
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) in {where}; parameters, momentum and "
            "communication state are unchanged (pass on_nonfinite='skip' to skip such steps)",
            bad,
        )

    def _gossip_round(self) -> None:
        flat, topo = self._flat, self._topology
        flat.load_from_params()
        # A separate buffer: the gossip owns its input only during step(), and the all-gather
        # below must not read from the tensor it writes.
        shard = self._shard
        shard.copy_(flat.shard(topo.local_rank))
        self._gossip.step(shard)
        if self._intra is not None:
            self._intra.all_gather_into(flat.flat, shard)
        else:
            flat.flat.copy_(shard)
        flat.store_to_params()

    # -----------------------------------------------------------------------------------------
    # distributed set-up (lazy: constructors must not run collectives)

    def _params(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        from qcomm.collectives.intra import IntraNodeAllreduce
        from qcomm.collectives.topology import Topology

        topo = Topology(self.comm.procs_per_node)
        # Group creation is collective: every rank touches both properties here, in this order.
        _ = topo.intra_group
        _ = topo.rail_group
        intra = None
        if topo.procs_per_node > 1:
            intra = IntraNodeAllreduce(topo, bucket_mb=self.comm.bucket_mb,
                                       spec=self.comm.intra_spec, stats=self._comm_stats,
                                       seed=self.comm.seed)
            if self._pending_intra_state is not None:
                intra.load_state_dict(self._pending_intra_state)
        flat = gossip = None
        if topo.num_nodes > 1:
            from qcomm.collectives.gossip import CompressedGossip

            flat = FlatParams(self._params(), topo.procs_per_node, self.comm.block_size)
            gossip = CompressedGossip(
                topo.rail_ranks, topo.rail_group, flat.shard_numel,
                graph=self.comm.topology, mixing=self.comm.mixing, spec=self.comm.gossip_spec,
                gamma=self.comm.gossip_step, staleness=self.comm.staleness,
                timeout_s=self.comm.timeout_s, stats=self._comm_stats,
                # One random stream per rail (rails quantize different shards).
                seed=(self.comm.seed * 1_000_003 + topo.local_rank) % 2**63,
            )
            if self._pending_gossip_state is not None:
                gossip.load_state_dict(self._pending_gossip_state)
            self._shard = torch.empty(flat.shard_numel, dtype=torch.float32,
                                      device=flat.flat.device)
        self._pending_gossip_state = self._pending_intra_state = None
        self._topology, self._intra, self._flat, self._gossip = topo, intra, flat, gossip
        self._ready = True

    # -----------------------------------------------------------------------------------------
    # evaluation, statistics, shutdown

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Set every rank's parameters to the exact global mean of the parameters (collective:
        call it on every rank at the same point). Completes the gossip rounds in flight first.
        All ranks end with the same bytes; for evaluation and the final checkpoint.
        No-op without torch.distributed."""
        if not _distributed():
            return
        self._ensure_ready()
        topo = self._topology
        if topo.num_nodes == 1:
            return  # synchronous data parallel: the ranks hold the same parameters already
        self._gossip.flush()
        flat = self._flat
        flat.load_from_params()
        shard = self._shard
        shard.copy_(flat.shard(topo.local_rank))
        # Ranks of a node hold the same parameters, so averaging shard l over rail l gives the
        # global mean of shard l; one rail member computes each sum and all receive its bytes.
        dist.all_reduce(shard, group=topo.rail_group)
        shard.div_(topo.num_nodes)
        if self._intra is not None:
            self._intra.all_gather_into(flat.flat, shard)
        else:
            flat.flat.copy_(shard)
        flat.store_to_params()

    def stats(self, *, consensus: bool = False) -> dict[str, Any]:
        """What this rank sent and how the gossip is doing.

        Args:
            consensus: also compute the consensus distance (a collective over the rail: every
                rank must call ``stats(consensus=True)`` at the same point).

        Returns:
            dict with ``steps`` (applied), ``skipped_steps``, ``bytes_sent`` and
            ``messages_sent`` (``{"intra": int, "inter": int}``), ``staleness`` (rounds a gossip
            round stays in flight), ``gossip_rounds``, ``gossip_step`` (gamma) and
            ``consensus_distance`` (``sqrt(mean_i ||x_i - mean x||^2)`` over nodes, float, or
            None when not asked for or with one node).
        """
        snap = self._comm_stats.snapshot()
        g = self._gossip
        out: dict[str, Any] = {
            "steps": self._steps,
            "skipped_steps": self._skipped,
            "bytes_sent": snap["bytes_sent"],
            "messages_sent": snap["messages_sent"],
            "staleness": g.staleness if g is not None else 0,
            "gossip_rounds": g.rounds_started if g is not None else 0,
            "gossip_step": g.gamma if g is not None else None,
            "consensus_distance": None,
        }
        if consensus and g is not None:
            from qcomm.collectives.gossip import consensus_distance

            x = self._flat.load_from_params()
            out["consensus_distance"] = float(consensus_distance(x, self._topology.rail_group))
        return out

    def close(self) -> None:
        """Complete the gossip rounds in flight and release the transport."""
        if self._gossip is not None:
            self._gossip.flush()
            self._gossip.close()

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()`` (momentum buffers, param groups) plus
        ``"qcomm"``: this rank's world geometry, step counters and gossip state (own and public
        compressed copies, rounds in flight). One rank's state: save one file per rank
        (:func:`qcomm.sgd.save_checkpoint`)."""
        sd = super().state_dict()
        world, ppn, rank = _geometry(self.comm.procs_per_node)
        gossip = self._gossip.state_dict() if self._gossip is not None else (
            self._pending_gossip_state)
        # Error-feedback residuals of quantized intra-node averaging (intra_bits), if any.
        intra = self._intra.state_dict() if self._intra is not None else (
            self._pending_intra_state)
        sd[STATE_KEY] = {
            "format": STATE_FORMAT,
            "world_size": world,
            "procs_per_node": ppn,
            "rank": rank,
            "steps": self._steps,
            "skipped_steps": self._skipped,
            "comm": dataclasses.asdict(self.comm),
            "gossip": gossip,
            "intra": intra,
            "comm_stats": self._comm_stats.snapshot(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], *,
                        on_world_size_change: str = "error") -> None:
        """Load a state saved by :meth:`state_dict` on the same rank.

        Args:
            state_dict: from :meth:`state_dict` (a plain torch.optim.SGD state dict is accepted
                too: the communication state then starts fresh).
            on_world_size_change: ``"error"`` (default) raises ValueError naming both world
                sizes when the checkpoint's world size or ranks per node differ from this run's;
                ``"reinit"`` keeps the momentum buffers and starts the gossip state afresh.
                That drops nothing: CHOCO's not-yet-communicated residual ``x - x_hat`` is part
                of the parameters themselves, and the mixing corrections of rounds in flight
                sum to zero over the nodes, so the global mean of the parameters is preserved.
                It is reported with a warning.

        Nothing is changed when an error is raised.
        """
        if on_world_size_change not in WORLD_CHANGE_MODES:
            raise ValueError(f"on_world_size_change must be one of {WORLD_CHANGE_MODES}, "
                             f"got {on_world_size_change!r}")
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        sd = dict(state_dict)
        q = sd.pop(STATE_KEY, None)
        gossip_state = intra_state = None
        # Validate everything first: nothing changes unless all of it loads.
        for group in sd.get("param_groups", []):
            check_sgd_group({**self.defaults, **group})
        if q is not None:
            if not isinstance(q, dict) or q.get("format") != STATE_FORMAT:
                raise ValueError(f"state_dict[{STATE_KEY!r}] is not an ASSGD state of format "
                                 f"{STATE_FORMAT}")
            world, ppn, rank = _geometry(self.comm.procs_per_node)
            same = q["world_size"] == world and q["procs_per_node"] == ppn
            if not same and on_world_size_change == "error":
                raise ValueError(
                    f"checkpoint was saved with world size {q['world_size']} "
                    f"({q['procs_per_node']} ranks per node) but this run has world size "
                    f"{world} ({ppn} ranks per node); pass on_world_size_change='reinit' to "
                    "keep the momentum and restart the gossip state"
                )
            if same:
                if q["rank"] != rank:
                    raise ValueError(f"checkpoint belongs to rank {q['rank']}, "
                                     f"this is rank {rank}")
                saved = {k: q["comm"][k] for k in _WIRE_FIELDS}
                mine = {k: getattr(self.comm, k) for k in _WIRE_FIELDS}
                if saved != mine:
                    raise ValueError(f"checkpoint was saved with communication options {saved}, "
                                     f"this optimizer has {mine}")
                gossip_state, intra_state = q["gossip"], q["intra"]
            else:
                if q["intra"] is not None and any(
                        t.abs().max() > 0 for t in
                        q["intra"]["error_feedback"]["residuals"].values() if t.numel()):
                    raise ValueError(
                        f"checkpoint was saved with world size {q['world_size']}, this run has "
                        f"world size {world}: the intra_bits error-feedback residuals are laid "
                        "out for the old node and cannot be carried over"
                    )
                if q["gossip"] is not None:
                    warnings.warn(
                        f"world size changed from {q['world_size']} to {world}: the gossip state "
                        "is re-initialized (CHOCO's residual x - x_hat lives in the parameters, "
                        "and dropped mixing corrections sum to zero over nodes, so the global "
                        "mean of the parameters is preserved)", stacklevel=2,
                    )
        super().load_state_dict(sd)
        if q is not None:
            self._steps = int(q["steps"])
            self._skipped = int(q["skipped_steps"])
        if self._gossip is not None and gossip_state is not None:
            self._gossip.load_state_dict(gossip_state)
        else:
            self._pending_gossip_state = gossip_state
        if self._intra is not None and intra_state is not None:
            self._intra.load_state_dict(intra_state)
        else:
            self._pending_intra_state = intra_state


# Options that shape the communication state: a checkpoint only loads into the same ones.
_WIRE_FIELDS = ("bits", "block_size", "rounding", "topology", "mixing", "staleness",
                "intra_bits")


def _flag(finite: bool, grads: list[torch.Tensor]) -> torch.Tensor:
    """float32 [1]: 1.0 when this rank saw a non-finite gradient; on the gradients' device (a
    NCCL-only group cannot reduce CPU tensors)."""
    device = grads[0].device if grads else torch.device("cpu")
    return torch.tensor([0.0 if finite else 1.0], device=device)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _geometry(procs_per_node: int | None) -> tuple[int, int, int]:
    """(world size, ranks per node, rank) of this run, without any collective."""
    if not _distributed():
        return 1, 1, 0
    from qcomm.collectives.topology import Topology

    topo = Topology(procs_per_node)
    return topo.world_size, topo.procs_per_node, topo.rank
