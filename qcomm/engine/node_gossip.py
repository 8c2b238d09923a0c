"""One rank's part of the gossip between nodes: the flat parameters, its shard, the node's share.

The communicated parameters live in one flat buffer (:class:`~qcomm.engine.flat.FlatParams`)
split into one shard per local rank; local rank l gossips shard l with the ranks of its rail
(rank l of every other node), through the member
:func:`~qcomm.collectives.gossip.factory.build_gossip` makes for the mode (a
:class:`~qcomm.collectives.gossip.CompressedGossip` or a
:class:`~qcomm.collectives.gossip.WaitFreeGossip`: asked, never told apart). The gossip owns the
schedule (its clock counts the steps, a round every ``sync_every / fragments`` of them, each
carrying one fragment); this class adds what a node's ranks do around it: bring the fragments
a round reads up to date (nothing to do when the parameters live in the flat buffer), run the
round, all-gather what it changed over the node (only the changed fragment crosses the
intra-node links), and leave parameters that had no gradient this step as they were.

With parameters FSDP2 shards over the node's ranks (``sharded``), the flat buffer holds this
rank's local parts only (:class:`~qcomm.engine.sharded.LocalShards`), gossiped whole, and
nothing is all-gathered: the node's ranks hold different parts and need none of each other's.
"""

from __future__ import annotations

from typing import Any

import torch

from qcomm.collectives.errors import PeerError
from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.factory import build_gossip
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.compress import NonFiniteError
from qcomm.engine.flat import FlatParams
from qcomm.engine.options import CommOptions
from qcomm.engine.sharded import LocalShards
from qcomm.seeds import rail_seed

__all__ = ["NodeGossip"]


class NodeGossip:
    """The gossip of ``params``' shard of this rank, on its rail (module docstring).

    Args:
        params: the communicated parameters (each once, in order; they may become views of
            the flat buffer, see :class:`~qcomm.engine.flat.FlatParams`).
        topology: the job's layout, groups created.
        intra: the node's allreduce (its all-gather), None when alone on the node.
        options: the communication options.
        stats: where the gossip counts its bytes.
        clock: the run's step clock, which the gossip advances.
        sharded: ``params`` are DTensors FSDP2 shards over the node's ranks, accepted by
            :func:`~qcomm.engine.sharded.check_sharding` (see the module docstring).
    """

    def __init__(self, params: list[torch.Tensor], topology: Topology,
                 intra: IntraNodeAllreduce | None, options: CommOptions,
                 stats: CommStats, clock: StepClock, *, sharded: bool = False) -> None:
        self.topology = topology
        self.intra = intra
        self.options = options
        self.params = list(params)
        self.sharded = sharded
        # Shards of whole fragments of whole codec blocks: every message has one length.
        align = options.block_size * options.fragments
        if sharded:
            # This rank's parts are its whole buffer; its node-mates hold other parts.
            self.flat: FlatParams = LocalShards(self.params, align)
            self._index, self._node_share = 0, None
        else:
            # Every rank holds the whole model: it gossips shard l and the node shares them.
            self.flat = FlatParams(self.params, topology.procs_per_node, align)
            self._index, self._node_share = topology.local_rank, intra
        self.gossip = build_gossip(
            options.gossip_config(topology.num_nodes), topology.rail_ranks, topology.rail,
            self.flat.shard_numel, stats=stats, clock=clock,
            # One random stream per rail (rails quantize different shards).
            seed=rail_seed(options.seed, topology.local_rank))
        # With copies (parameters not aliased), the gossip's own buffer: it owns its input only
        # during a round, and the node's all-gather must not read from what it writes.
        self._shard = None if self.flat.aliased else torch.empty(
            self.flat.shard_numel, dtype=torch.float32, device=self.flat.flat.device)

    # -----------------------------------------------------------------------------------------
    # the two calls around the local update

    def round_due(self) -> bool:
        """Whether the step in progress ends with a gossip round."""
        return self.gossip.round_due()

    def prepare(self) -> PeerError | None:
        """Before the local update of a step that ends with a round: receive and verify what
        the round applies. Returns the failure instead of raising it: the caller raises it once
        the node agreed, so that no rank of the node updates alone."""
        try:
            self.gossip.prepare()
        except PeerError as e:
            return e
        return None

    def node_mate_failed(self, mask: int) -> PeerError:
        """The error of a rank whose node-mate(s) in ``mask`` (bits by local rank) could not
        use the round: the node raises together, nothing of the step applied."""
        topo = self.topology
        ranks = [topo.node_ranks[i] for i in range(topo.procs_per_node) if mask >> i & 1]
        round_ = self.gossip.rounds_started - self.gossip.staleness
        return PeerError(
            f"gossip round {round_}: ranks {ranks} of this node could not receive or verify "
            "their rails' messages; nothing of this step was applied",
            f"gossip round {round_}", ranks, "intra")

    def end_step(self, keep: list[bool]) -> None:
        """After the local update: advance the gossip's clock and, when a round is due, run it
        and bring the node's ranks up to date. ``keep[i]``: parameter i had no gradient this
        step, so the round leaves it as it was."""
        if not self.gossip.round_due():
            self.gossip.end_step(None)
            return
        flat, gossip = self.flat, self.gossip
        flat.check_aliased()
        saved = flat.snapshot(keep)
        shard, by_range = self._load_shard()
        try:
            changed = gossip.end_step(shard)
        except NonFiniteError as e:
            # The codec names its argument ("x"); when what it refused is the parameters
            # themselves, say so (not for a neighbour's payloads, nor x minus its estimate
            # overflowing from finite parameters).
            if e.argument != "x" or bool(torch.isfinite(shard).all()):
                raise
            raise type(e)(
                "the communicated parameters hold NaN or Inf after this step's local update "
                "(the wrapped optimizer's step made them so from finite gradients): the gossip "
                f"round sent nothing; codec: {e}", e.argument, e.blocks) from e
        if self._node_share is not None and not gossip.changes_agree_across_rails:
            changed = self._node_changes(shard, changed, by_range)
        if changed:
            self._share(shard, changed, keep, by_range)
        flat.restore(saved)

    def _node_changes(self, shard: torch.Tensor, changed: list[int],
                      by_range: bool) -> list[int]:
        """The fragments any rank of the node changed this round (every rank all-gathers the
        same ones, in one order), ``shard`` made current in those this rank did not change.

        A wait-free round changes, beside the fragment it mixes, the fragments its rail's
        neighbours owed it something in, and those differ between rails: one tiny all-reduce
        over the node agrees on them, or the ranks would call different all-gathers."""
        F = self.options.fragments
        mask = torch.zeros(F, dtype=torch.int64, device=self.topology.control_device())
        mask[list(changed)] = 1
        all_reduce(mask, self.topology.intra, "max", timeout_s=self.options.timeout_s,
                   link="intra", operation="the round's changed fragments")
        union = mask.nonzero().flatten().tolist()   # one host read, whatever F
        if by_range:   # only the fragments the round read were copied in: load the others
            for f in set(union) - set(changed):
                self._load_fragment(shard, f)
        return union

    def _load_fragment(self, shard: torch.Tensor, f: int) -> None:
        """Fragment f of this rank's shard, from the parameters into ``flat`` and ``shard``."""
        flat, frag = self.flat, self.gossip.fragment(f)
        base = self._index * flat.shard_numel
        flat.load_range(base + frag.start, base + frag.stop)
        shard[frag].copy_(flat.flat[base + frag.start: base + frag.stop])

    def _load_shard(self) -> tuple[torch.Tensor, bool]:
        """This rank's shard, current in the fragments the round reads, and whether only those
        were copied in (then only the changed ones are copied out)."""
        flat, gossip = self.flat, self.gossip
        rank = self._index
        if flat.aliased:
            return flat.shard(rank), False
        shard = self._shard
        reads = gossip.fragments_read_next() if self.options.fragments > 1 else None
        if reads is not None and flat.ranges_ok:
            # Only the fragments the round sends and mixes are copied in.
            for f in reads:
                self._load_fragment(shard, f)
            return shard, True
        flat.load_from_params()
        shard.copy_(flat.shard(rank))
        return shard, False

    def _share(self, shard: torch.Tensor, changed: list[int], keep: list[bool],
               by_range: bool) -> None:
        """Every local rank's changed fragments into ``flat`` (and the parameters); sharded,
        only this rank's."""
        flat, L, share = self.flat, self.flat.num_shards, self._node_share
        if self.options.fragments == 1:
            if share is not None:
                share.all_gather_into(flat.flat, shard.clone() if flat.aliased else shard)
            elif not flat.aliased:
                flat.flat.copy_(shard)
            flat.store_to_params(keep)
            return
        for f in changed:
            frag = self.gossip.fragment(f)
            if share is not None:
                part = shard[frag].contiguous()
                gathered = torch.empty(L * part.numel(), dtype=part.dtype, device=part.device)
                share.all_gather_into(gathered, part)
                for rank, piece in enumerate(gathered.view(L, -1)):
                    flat.shard(rank)[frag].copy_(piece)
            elif not flat.aliased:
                flat.shard(0)[frag].copy_(shard[frag])
            if by_range:
                for rank in range(L):
                    at = rank * flat.shard_numel
                    flat.store_range(at + frag.start, at + frag.stop, keep)
        if not flat.aliased and not by_range:
            flat.store_to_params(keep)

    # -----------------------------------------------------------------------------------------
    # collective points

    @property
    def survivable(self) -> bool:
        """Whether the gossip goes on without a lost node (then every sum over the nodes runs
        along the gossip's closed ring, not over the rail's process group)."""
        return self.options.on_peer_loss == "continue"

    @torch.no_grad()
    def average(self) -> None:
        """Every rank's parameters <- their exact mean over the live nodes (collective), after
        the gossip drained what is in flight."""
        self.gossip.flush()
        flat = self.flat
        flat.check_aliased()
        flat.load_from_params()
        # Ranks of a node hold the same parameters (or, sharded, local rank l of every node
        # holds part l), so averaging shard l over rail l gives the global mean of shard l;
        # one rail member computes each sum and all receive its bytes.
        shard = flat.shard(self._index).clone()
        self.gossip.settle(shard)   # what the mixing owes this shard, in it before the sum
        shard, live = self._over_rail(shard, "sum")
        shard.div_(live)
        self._gather(flat.flat, shard, self._node_share)
        flat.store_to_params()

    @torch.no_grad()
    def share_own_shard(self) -> None:
        """Every rank's parameters <- shard l of local rank l's (collective over the node): the
        node's ranks hold one model after each started its shard from elsewhere (a join).
        Nothing to do alone on the node or sharded (each rank holds its own parts only)."""
        if self._node_share is None:
            return
        flat = self.flat
        flat.check_aliased()
        flat.load_from_params()
        self._gather(flat.flat, flat.shard(self._index).clone(), self._node_share)
        flat.store_to_params()

    def reduce_over_nodes(self, full: torch.Tensor, op: str) -> tuple[torch.Tensor, int]:
        """``full`` (1-D, the same on every rank of the node) summed (``op="sum"``) or maxed
        (``"max"``) over the live nodes, and their count; the same bits on every rank
        (collective over the job). As the parameters' average: local rank l reduces slice l
        over its rail, the node all-gathers the slices."""
        L, n = self.topology.procs_per_node, full.numel()
        per = -(-n // L)
        padded = torch.zeros(per * L, dtype=full.dtype, device=full.device)
        padded[:n] = full
        shard = padded[self.topology.local_rank * per:][:per].clone()
        shard, live = self._over_rail(shard, op)
        self._gather(padded, shard, self.intra)
        return padded[:n], live

    def _over_rail(self, shard: torch.Tensor, op: str) -> tuple[torch.Tensor, int]:
        """``shard`` reduced over this rank's rail (the live members only, when the gossip goes
        on without lost nodes), and how many members were reduced."""
        if self.survivable:
            return self.gossip.survivors_sum(shard, op)
        all_reduce(shard, self.topology.rail, op, timeout_s=self.options.timeout_s,
                   link="inter", operation="average_parameters")
        return shard, self.topology.num_nodes

    @staticmethod
    def _gather(out: torch.Tensor, shard: torch.Tensor,
                over: IntraNodeAllreduce | None) -> None:
        """``out`` <- every local rank's ``shard``, by local rank (``over``: the node's
        all-gather; None: ``shard`` is all of ``out``)."""
        if over is not None:
            over.all_gather_into(out, shard)
        else:
            out.copy_(shard)

    def consensus_distance(self) -> float:
        """``sqrt(mean_i ||x_i - mean x||^2)`` over the nodes (collective over the rail; over
        the job when sharded)."""
        from qcomm.collectives.gossip import consensus_distance
        from qcomm.collectives.gossip.choco import distance_from_sums

        self.flat.check_aliased()
        x = self.flat.load_from_params()
        if self.survivable:
            self.gossip.drain()  # a new neighbour's hello is taken before the sums
            d = distance_from_sums(x, self.gossip.survivors_sum)
        else:
            d = float(consensus_distance(x, self.topology.rail,
                                         timeout_s=self.options.timeout_s))
        if not self.sharded or self.intra is None:
            return d
        # Each rank measured its own parts: squared distances add up over the node's parts.
        sq = torch.tensor([d * d], dtype=torch.float64, device=self.topology.control_device())
        all_reduce(sq, self.topology.intra, "sum", timeout_s=self.options.timeout_s,
                   link="intra", operation="consensus distance")
        return float(sq.item()) ** 0.5

    def state(self) -> dict[str, Any]:
        """The gossip's state (what the mode needs first, a drain for the wait-free one, runs
        first: every rank of the rail must call it at the same point)."""
        self.gossip.before_state_dict()
        if self.survivable:
            # every rank of the rail learns every loss (a restart maps the survivors by it)
            self.gossip.survivors_sum(torch.zeros(1))
        return self.gossip.state_dict()
