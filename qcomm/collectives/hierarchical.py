"""Hierarchical quantized allreduce: full precision inside nodes, the codec between them.

Per flat bucket of ``n`` elements, with ``L`` ranks per node and ``N`` nodes:

1. intra-node reduce-scatter: the bucket, zero-padded to ``L * s`` elements, is cut into ``L``
   shards of ``s``; local rank i gets the node's mean of shard i (summed in float32, in
   local-rank order, divided by L);
2. rail allreduce of that shard, across the N nodes (the ranks with local rank i): with a spec,
   through the codec with error feedback (:mod:`.rail`: an all-gather of the N payloads below 3
   nodes, a quantized reduce-scatter + all-gather from 3 nodes on; ``rail_collective``
   chooses); without a spec, reduce-scatter + all-gather at full precision;
3. intra-node all-gather of the L shards, and the bucket is copied back into the tensors.

Shards are equal, and with a spec block-aligned, so every payload has the same length. Every
rank ends with bit-identical values (each element is reduced once, by fixed owners, in a fixed
order, then copied). Each node's ``L`` NICs (one per rail) carry ``1/L`` of the inter-node
traffic each. Bytes are counted per level as in :mod:`qcomm.collectives.intra`.

Accuracy: without a spec, the exact mean up to float32 rounding of the sums; with a spec, error
feedback carries each call's rounding into the next, so the running sum of results tracks the
running sum of exact means within ``(1/N) sum_k |residual_k|`` (plus the owners' residuals in
the reduce-scatter form).

In full (the shard sizes, the bytes per level, the accuracy bound): docs/design.md, sections
"Stages, shards and bytes" and "Accuracy".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.collectives.buckets import Bucket, pack, unpack
from qcomm.collectives.group import CommGroup
from qcomm.collectives.handles import Handle, Last
from qcomm.collectives.intra import BucketedMean
from qcomm.collectives.primitives import acc_dtype, start_all_gather, start_reduce_scatter
from qcomm.collectives.rail import check_rail_collective, rail_form, rail_mean
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.compress import NonFiniteError, QuantSpec
from qcomm.seeds import derive

__all__ = ["HierarchicalAllreduce", "shard_numel"]


def shard_numel(numel: int, procs_per_node: int, num_nodes: int,
                spec: QuantSpec | None, rail: str = "all_gather") -> int:
    """Elements per local rank's shard of a bucket of ``numel`` elements: the bucket is padded
    to ``procs_per_node * shard_numel`` with shards a multiple of the codec's block size (with a
    spec and several nodes; of ``num_nodes`` block sizes when ``rail`` is
    ``"reduce_scatter"``: the shard is cut into one chunk of whole blocks per node) or of
    ``num_nodes`` (without a spec)."""
    if num_nodes == 1:
        align = 1  # no rail step: shards need only be equal
    elif spec is not None:
        align = spec.block_size * (num_nodes if rail == "reduce_scatter" else 1)
    else:
        align = num_nodes
    unit = procs_per_node * align
    return -(-numel // unit) * align


class HierarchicalAllreduce(BucketedMean):
    """Average tensors over all ranks: intra-node reduce-scatter, rail allreduce of each shard
    through the codec, intra-node all-gather. The synchronous baseline, and the engine of the
    DDP comm hook.

    Args:
        topology: the job's :class:`Topology` (intra groups and rails).
        spec: a QuantSpec for the inter-node step, or None for full precision everywhere.
            With a single node nothing crosses a slow link and the spec is not applied.
        bucket_mb: bucket size in MiB (2**20 bytes) of the input dtype; > 0.
        stats: where bytes sent are counted (``"intra"`` and ``"inter"``); new if None.
        seed: base seed of stochastic rounding (mixed with rank, call count and bucket).
        timeout_s: how long a blocking call waits for the other ranks (None: the process
            group's own timeout).
        rail_collective: the codec's form between nodes: ``"all_gather"`` (every node decodes
            every node's payload), ``"reduce_scatter"`` (a quantized reduce-scatter then an
            all-gather, two residuals) or ``"auto"`` (the default: the reduce-scatter from 3
            nodes on, where it sends fewer bytes). Without a spec or with one node there is no
            codec between nodes and the choice changes nothing.

    Attributes:
        rail_form: the form the rails run (``"auto"`` resolved for this topology).

    Nothing is communicated in the constructor; groups and buffers are created on first use.
    """

    def __init__(self, topology: Topology, *, bucket_mb: float = 25.0,
                 spec: QuantSpec | None = None, stats: CommStats | None = None,
                 seed: int = 0, timeout_s: float | None = None,
                 rail_collective: str = "auto") -> None:
        super().__init__(topology, bucket_mb=bucket_mb, spec=spec, stats=stats, seed=seed,
                         timeout_s=timeout_s)
        self.rail_collective = check_rail_collective(rail_collective)
        self.rail_form = rail_form(self.rail_collective, topology.num_nodes)

    def state_dict(self) -> dict:
        """The residuals and call count (:meth:`BucketedMean.state_dict`) and the rail form
        they belong to (the two forms pad shards differently and keep different residuals)."""
        return {**super().state_dict(), "rail_form": self.rail_form}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` returned; ValueError if it was saved with the other
        rail form."""
        if isinstance(state, dict) and state.get("rail_form") != self.rail_form:
            raise ValueError(f"state['rail_form'] is {state.get('rail_form')!r}; this allreduce "
                             f"runs {self.rail_form!r} (rail_collective="
                             f"{self.rail_collective!r} on {self.topology.num_nodes} nodes): "
                             "build it with the rail_collective the state was saved with")
        super().load_state_dict(state)

    def mean_(self, tensors: Sequence[torch.Tensor], *, async_op: bool = False,
              key: str | int | None = None) -> Handle:
        """Replace every tensor by its mean over all ranks.

        Args:
            tensors: float32/float16/bfloat16 (float64 too without a spec), any shapes incl.
                empty, contiguous, all on one device; the same shapes and dtypes, in the same
                order, on every rank. Sums are accumulated in float32; the wire carries the
                input dtype at full precision and payloads with a spec.
            async_op: False blocks; True returns a Handle at once. The first stage is launched
                here, later stages and the decode run in ``Handle.wait()``, which writes the
                tensors last: they must not be modified or read as results until then.
            key: names the error-feedback state of these tensors; None derives it from the
                shapes, dtypes and bucket size. Distinct tensor lists of the same layout (e.g.
                DDP buckets) need distinct keys.

        Returns:
            A Handle (already completed when ``async_op`` is False).
        """
        tensors = self._checked(tensors, key)
        topo = self.topology
        if topo.world_size == 1:
            return Handle.completed("hierarchical allreduce")
        # resolved once for every bucket's steps
        intra, rail = topo.intra, topo.rail
        plan, call, key = self._next_call(tensors, key)
        pipelines = [
            self._pipeline(b, tensors, intra, rail, f"{key}/{i}",
                           derive(self.seed, topo.rank, call, i))
            for i, b in enumerate(plan)
        ]
        handle = Handle(pipelines, "hierarchical allreduce",
                        [r for r in range(topo.world_size) if r != topo.rank])
        if not async_op:
            handle.wait(self.timeout_s)
        return handle

    def _pipeline(self, bucket: Bucket, tensors: list[torch.Tensor], intra: CommGroup,
                  rail: CommGroup, key: str, seed: int):
        L, N = self.topology.procs_per_node, self.topology.num_nodes
        spec = self.spec
        device, dtype = tensors[0].device, bucket.dtype
        acc = acc_dtype(dtype)
        s = shard_numel(bucket.numel, L, N, spec, self.rail_form)
        buf = torch.zeros(L * s, dtype=dtype, device=device)
        pack(bucket, tensors, buf)

        # 1. intra-node reduce-scatter: my shard of the node's mean, in acc dtype.
        if L > 1:
            work, shard_sum = start_reduce_scatter(buf, intra, L, self.stats, "intra")
            yield work
            shard = shard_sum().div_(L)
        else:
            shard = buf.to(acc)

        # 2. rail: average my shard over the nodes.
        error, commit = None, []
        if N > 1 and spec is not None:
            shard, error, commit = yield from rail_mean(
                self.rail_form, shard, self.error_feedback, key, spec, seed, rail, N,
                self.stats, last=L == 1)
        elif N > 1:
            # Full precision: reduce-scatter + all-gather over the rail in the input dtype (the
            # node means are rounded to it once: the slow link carries what the user gave).
            work, sub_sum = start_reduce_scatter(shard.to(dtype), rail, N, self.stats, "inter")
            yield work
            sub = sub_sum().div_(N).to(dtype)
            shard = torch.empty(s, dtype=dtype, device=device)
            work = start_all_gather(shard, sub, rail, N, self.stats, "inter")
            yield work if L > 1 else Last(work)

        # 3. intra-node all-gather of the shards.
        if L > 1:
            out = torch.empty_like(buf)
            yield Last(start_all_gather(out, shard.to(dtype), intra, L, self.stats, "intra"))
        else:
            out = shard
        if commit and error is None and L > 1 and not bool(torch.isfinite(out).all()):
            # Another rail of this node failed to decode (its shard came back NaN): every rank
            # of the job fails the call alike and no residual changes.
            error = NonFiniteError("a shard of this bucket could not be decoded on another "
                                   "rail (non-finite input on some rank)", "tensors", [])
        unpack(bucket, out, tensors)
        if error is not None:
            raise error
        for k in commit:
            self.error_feedback.commit(k)
