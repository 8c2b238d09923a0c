"""Synchronous averaging inside a node (fast links), full precision or through the codec.

Full precision, per flat bucket of ``n`` elements over the node's ``L`` ranks: pad to ``L * s``
elements, reduce-scatter (rank ``i`` sums chunk ``i`` of every rank, in float32, divides by L),
all-gather the ``L`` averaged chunks. Every rank ends with bit-identical values: each chunk is
summed once, by its owner, in local-rank order, and the all-gather copies it.

With a codec ``spec``: every rank quantizes its whole bucket with error feedback (one residual
per bucket), the ``L`` payloads (uint8, equal length: a pure function of ``(n, spec)``) are
all-gathered, and every rank decodes the same payloads in the same order with
``dequant_accumulate(weights = 1/L)``: again bit-identical on every rank.

Which collectives (and why): Gloo's reduce-scatter (torch >= 2.3, ``reduce_scatter_tensor``) is
an all-reduce of the whole buffer followed by a copy of one chunk, so it moves twice the bytes of
a real reduce-scatter. On Gloo we therefore reduce-scatter with ``all_to_all_single`` (rank i
sends chunk j to rank j; (L-1) chunks out per rank) and sum the received chunks locally; on
NCCL (CUDA tensors under a ``cuda:nccl`` backend) we use NCCL's native ``reduce_scatter_tensor``.
The all-gather is ``all_gather_into_tensor`` (``all_gather_single`` in torch >= 2.13).

Bytes counted (:class:`~qcomm.collectives.stats.CommStats`, level ``"intra"``), per rank, as
the ring/pairwise algorithms of Gloo and NCCL move them: a reduce-scatter of ``P`` chunks of
``c`` bytes sends ``(P - 1) * c`` (Gloo all-to-all: one chunk to each peer; NCCL ring: P - 1
steps of one chunk); an all-gather of ``c`` bytes per rank sends ``(P - 1) * c`` (Gloo and NCCL
ring: each rank forwards P - 1 chunks). Padding elements count (they cross the wire). One
message per peer step: ``P - 1`` messages per collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.collectives.buckets import (
    MIB,
    Bucket,
    check_tensors,
    layout_key,
    pack,
    plan_buckets,
    unpack,
)
from qcomm.collectives.group import CommGroup
from qcomm.collectives.handles import Handle, Last
from qcomm.collectives.primitives import (
    decode_mean,
    quantize_or_poison,
    start_all_gather,
    start_reduce_scatter,
    wait_works,
)
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.compress import (
    ErrorFeedback,
    QuantSpec,
    packed_nbytes,
)
from qcomm.kernels.wire_format import check_spec
from qcomm.seeds import derive
from qcomm.validation import (
    check_bucket_mb,
    check_instance,
    check_int,
    check_seed,
    check_timeout,
    fail,
)

__all__ = ["BucketedMean", "IntraNodeAllreduce"]

CODEC_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Full precision also averages float64 (Gloo and NCCL sum it natively; the codec does not).
FULL_DTYPES = (*CODEC_DTYPES, torch.float64)

# ---------------------------------------------------------------------------------------------
# argument checks (BucketedMean's, so hierarchical.py's too)


def check_common_args(topology: object, bucket_mb: object, spec: object, stats: object,
                      seed: object) -> tuple[int, CommStats]:
    """Validate constructor arguments; returns (bucket capacity in bytes, stats)."""
    check_instance("topology", topology, Topology)
    bucket_mb = check_bucket_mb(bucket_mb)
    check_spec(spec, allow_none=True)
    check_instance("stats", stats, CommStats, allow_none=True)
    check_seed(seed)
    return max(1, int(bucket_mb * MIB)), (stats if stats is not None else CommStats())


def check_key(key: object) -> None:
    if key is not None and (isinstance(key, bool) or not isinstance(key, (str, int))):
        fail("key", "a str, an int or None", key, TypeError)


# ---------------------------------------------------------------------------------------------


class BucketedMean:
    """What the bucketed averaging collectives share: validated settings, error-feedback
    residuals (one per bucket and key, with a spec) and the call count that seeds stochastic
    rounding. Subclasses implement ``mean_``."""

    def __init__(self, topology: Topology, *, bucket_mb: float = 25.0,
                 spec: QuantSpec | None = None, stats: CommStats | None = None,
                 seed: int = 0, timeout_s: float | None = None) -> None:
        self._bucket_bytes, self.stats = check_common_args(topology, bucket_mb, spec, stats, seed)
        check_timeout(timeout_s, allow_none=True)
        # Blocking calls wait at most this long for the other ranks (None: the process
        # group's own timeout); async handles take theirs in wait().
        self.timeout_s = timeout_s
        self.topology = topology
        self.bucket_mb = bucket_mb
        self.spec = spec
        self.seed = seed
        self.error_feedback = ErrorFeedback()
        self._calls = 0

    def _checked(self, tensors: Sequence[torch.Tensor], key: object) -> list[torch.Tensor]:
        """Validate ``mean_``'s arguments and that the topology matches the job."""
        tensors = check_tensors(tensors, CODEC_DTYPES if self.spec is not None else FULL_DTYPES)
        check_key(key)
        self.topology.check_world()
        return tensors

    def _next_call(self, tensors: list[torch.Tensor], key: str | int | None
                   ) -> tuple[list[Bucket], int, str | int]:
        """The bucket plan, this call's number (it seeds stochastic rounding) and the
        error-feedback key (derived from the layout when None)."""
        call = self._calls
        self._calls += 1
        if key is None:
            key = layout_key(tensors, self._bucket_bytes)
        return plan_buckets(tensors, self._bucket_bytes), call, key

    def state_dict(self) -> dict:
        """``{"error_feedback": {"residuals": {key: float32 tensor}}, "calls": int}``: this
        rank's residuals (references) and the call count that seeds stochastic rounding."""
        return {"error_feedback": self.error_feedback.state_dict(), "calls": self._calls}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` returned (residuals copied)."""
        if not isinstance(state, dict) or "error_feedback" not in state or "calls" not in state:
            raise ValueError("state must be a dict from state_dict() with keys "
                             "'error_feedback' and 'calls'")
        calls = check_int("state['calls']", state["calls"], low=0)
        self.error_feedback.load_state_dict(state["error_feedback"])
        self._calls = calls


class IntraNodeAllreduce(BucketedMean):
    """Average a list of tensors over the ranks of this node, in place, through flat buckets.

    Args:
        topology: the job's :class:`Topology` (its intra-node group is used).
        bucket_mb: bucket size in MiB (2**20 bytes) of the input dtype; > 0.
        spec: None for full precision, or a QuantSpec to exchange quantized payloads with error
            feedback (one residual per bucket and key).
        stats: where bytes sent are counted (level ``"intra"``); a new CommStats if None.
        seed: base seed of stochastic rounding (mixed with rank, call count and bucket).

    Nothing is communicated in the constructor; buffers and process groups are created on the
    first call, which every rank of the job must make (group creation is collective).
    """

    def mean_(self, tensors: Sequence[torch.Tensor], *, async_op: bool = False,
              key: str | int | None = None) -> Handle:
        """Replace every tensor by its mean over the node's ranks.

        Args:
            tensors: float32/float16/bfloat16 (float64 too without a spec), any shapes incl.
                empty, contiguous, all on one device; the same shapes and dtypes, in the same
                order, on every rank of the node. Sums are accumulated in float32.
            async_op: False blocks until done; True returns at once with a Handle whose
                ``wait()`` finishes the operation and only then writes the tensors. Until
                then the tensors must not be modified or read as results.
            key: names the error-feedback state of these tensors (with a spec); None derives
                it from the shapes, dtypes and bucket size. Give distinct keys to distinct
                tensor lists of the same layout (e.g. DDP buckets).

        Returns:
            A Handle (already completed when ``async_op`` is False).
        """
        tensors = self._checked(tensors, key)
        topo = self.topology
        L = topo.procs_per_node
        if L == 1:
            # Alone on the node: the mean is the tensor itself (no codec: nothing is sent).
            return Handle.completed("intra-node allreduce")
        group = topo.intra   # resolved once, by the topology
        plan, call, key = self._next_call(tensors, key)
        pipelines = [
            self._full_pipeline(b, tensors, group, L) if self.spec is None
            else self._codec_pipeline(b, tensors, group, L, f"{key}/{i}",
                                      derive(self.seed, topo.rank, call, i))
            for i, b in enumerate(plan)
        ]
        handle = Handle(pipelines, "intra-node allreduce",
                        [r for r in topo.node_ranks if r != topo.rank], link="intra")
        if not async_op:
            handle.wait(self.timeout_s)
        return handle

    def _full_pipeline(self, bucket: Bucket, tensors: list[torch.Tensor], group: CommGroup,
                       L: int):
        c = -(-bucket.numel // L)
        buf = torch.zeros(L * c, dtype=bucket.dtype, device=tensors[0].device)
        pack(bucket, tensors, buf)
        work, chunk_sum = start_reduce_scatter(buf, group, L, self.stats, "intra")
        yield work
        mine = chunk_sum().div_(L).to(bucket.dtype)
        out = torch.empty_like(buf)
        yield Last(start_all_gather(out, mine, group, L, self.stats, "intra"))
        unpack(bucket, out, tensors)

    def _codec_pipeline(self, bucket: Bucket, tensors: list[torch.Tensor], group: CommGroup,
                        L: int, key: str, seed: int):
        device = tensors[0].device
        x = pack(bucket, tensors, torch.empty(bucket.numel, dtype=bucket.dtype, device=device))
        nbytes = packed_nbytes(bucket.numel, self.spec)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # The residual is committed only if every payload decodes (every rank of the node
        # decodes the same ones, so all commit or none does): a failed mean loses nothing.
        quantize_or_poison(self.error_feedback, key, x, self.spec, seed, payload)
        gathered = torch.empty(L, nbytes, dtype=torch.uint8, device=device)
        yield Last(start_all_gather(gathered.view(-1), payload, group, L, self.stats, "intra"))
        mean = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
        error = decode_mean(gathered, mean, self.spec)
        unpack(bucket, mean, tensors)
        if error is not None:
            raise error
        self.error_feedback.commit(key)

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out = cat(shard of local rank 0, shard of local rank 1, ...)``, blocking.

        Args:
            out: flat ``[procs_per_node * shard.numel()]``, shard's dtype and device, contiguous.
            shard: any shape (flattened), the same numel and dtype on every rank of the node,
                contiguous.
        """
        if not isinstance(shard, torch.Tensor) or not isinstance(out, torch.Tensor):
            raise TypeError("out and shard must be torch.Tensor")
        L = self.topology.procs_per_node
        if out.dim() != 1 or out.numel() != L * shard.numel():
            raise ValueError(f"out must be 1-D with procs_per_node * shard.numel() = "
                             f"{L * shard.numel()} elements, got shape {tuple(out.shape)}")
        if out.dtype != shard.dtype or out.device != shard.device:
            raise ValueError(f"out must have shard's dtype and device ({shard.dtype} on "
                             f"{shard.device}), got {out.dtype} on {out.device}")
        if not out.is_contiguous() or not shard.is_contiguous():
            raise ValueError("out and shard must be contiguous")
        self.topology.check_world()
        if L == 1:
            out.copy_(shard.view(-1))
            return
        group = self.topology.intra
        work = start_all_gather(out, shard.view(-1), group, L, self.stats, "intra")
        wait_works([work], self.timeout_s, "intra-node all-gather", group, "intra")
