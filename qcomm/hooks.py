"""DDP communication hooks: hierarchical quantized allreduce with error feedback.

For users who keep ``DistributedDataParallel``::

    from qcomm.hooks import HierarchicalQuantState, hierarchical_quantized_hook

    state = HierarchicalQuantState(procs_per_node=8, bits=4)
    ddp_model.register_comm_hook(state, hierarchical_quantized_hook)

Each gradient bucket is averaged with :class:`qcomm.collectives.hierarchical.
HierarchicalAllreduce`: full precision inside a node, ``bits``-bit payloads with error feedback
between nodes (each local rank carries one shard on its rail), all-gather inside the node.

The state object follows PyTorch's ``PowerSGDState``: hyperparameters apart from runtime objects,
runtime objects created lazily on the first hook call (every rank calls the hook for bucket 0
at the same point of the first backward, so creating the process groups there is safe), and
pickling keeps the hyperparameters and the error-feedback residuals but never a process group.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at runtime
# (bucket must be dist.GradBucket, the return a torch.futures.Future), strings fail that check.
from typing import Any

import torch
import torch.distributed as dist

from qcomm.compress import QuantSpec

__all__ = ["HierarchicalQuantState", "hierarchical_quantized_hook"]


class HierarchicalQuantState:
    """State of :func:`hierarchical_quantized_hook`.

    Args:
        procs_per_node: ranks per node; None reads ``LOCAL_WORLD_SIZE`` (see
            :class:`qcomm.collectives.topology.Topology`).
        bits: inter-node code width, 1, 2, 4 or 8.
        block_size: elements per quantization scale, a power of two in [32, 4096].
        rounding: ``"stochastic"`` (default) or ``"nearest"``.
        seed: base seed of stochastic rounding.
        bucket_mb: the allreduce's internal bucket size (DDP buckets larger than this are cut).

    Attributes:
        stats: :class:`qcomm.collectives.stats.CommStats` of bytes sent per level, or None
            before the first hook call.
    """

    # Hyperparameters: the only fields that survive pickling, with the residuals.
    _HPARAMS = ("procs_per_node", "bits", "block_size", "rounding", "seed", "bucket_mb")

    def __init__(self, procs_per_node: int | None = None, *, bits: int = 4,
                 block_size: int = 128, rounding: str = "stochastic", seed: int = 0,
                 bucket_mb: float = 25.0) -> None:
        if procs_per_node is not None and (
                isinstance(procs_per_node, bool) or not isinstance(procs_per_node, int)
                or procs_per_node < 1):
            raise ValueError(f"procs_per_node must be None or an int >= 1, got {procs_per_node!r}")
        self.spec = QuantSpec(bits, block_size, rounding)  # validates bits/block_size/rounding
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not (
                bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        self.procs_per_node = procs_per_node
        self.bits, self.block_size, self.rounding = bits, block_size, rounding
        self.seed = seed
        self.bucket_mb = bucket_mb
        self._allreduce: Any = None
        self._pending: dict | None = None
        self.stats = None

    def allreduce(self) -> Any:  # HierarchicalAllreduce (imported lazily)
        """The :class:`HierarchicalAllreduce` (created on first use; collective then)."""
        if self._allreduce is None:
            from qcomm.collectives.hierarchical import HierarchicalAllreduce
            from qcomm.collectives.stats import CommStats
            from qcomm.collectives.topology import Topology

            topo = Topology(self.procs_per_node)
            _ = topo.intra_group  # creates every group, on every rank, here
            self.stats = self.stats if self.stats is not None else CommStats()
            engine = HierarchicalAllreduce(topo, spec=self.spec, bucket_mb=self.bucket_mb,
                                           stats=self.stats, seed=self.seed)
            if self._pending is not None:
                engine.load_state_dict(self._pending)
                self._pending = None
            self._allreduce = engine
        return self._allreduce

    def __getstate__(self) -> dict:
        state = {k: getattr(self, k) for k in self._HPARAMS}
        engine_state = (self._allreduce.state_dict() if self._allreduce is not None
                        else self._pending)
        state["allreduce_state"] = engine_state
        state["stats"] = self.stats
        return state

    def __setstate__(self, state: dict) -> None:
        self.__init__(**{k: state[k] for k in self._HPARAMS})
        self._pending = state.get("allreduce_state")
        self.stats = state.get("stats")


def hierarchical_quantized_hook(state: HierarchicalQuantState,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over all ranks, quantized between nodes.

    Args:
        state: a :class:`HierarchicalQuantState`.
        bucket: DDP's gradient bucket; its flat buffer (float32/float16/bfloat16) is averaged
            in place.

    Returns:
        A completed future holding the averaged flat buffer. The allreduce runs inside the
        hook (its later stages are driven by the caller's thread, see
        :mod:`qcomm.collectives.handles`), so it does not overlap the rest of the backward pass.

    Error feedback keeps one residual per DDP bucket (keyed by bucket index and size: DDP
    rebuilds its buckets after the first iteration, and the few residuals of that first layout
    are then left unused).
    """
    if not isinstance(state, HierarchicalQuantState):
        raise TypeError(f"state must be a HierarchicalQuantState, got {type(state).__name__}")
    tensor = bucket.buffer()
    state.allreduce().mean_([tensor], key=f"bucket{bucket.index()}:{tensor.numel()}")
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
