"""DDP communication hooks: hierarchical quantized allreduce with error feedback.

For users who keep ``DistributedDataParallel``::

    from qcomm.hooks import HierarchicalQuantState, hierarchical_quantized_hook

    state = HierarchicalQuantState(procs_per_node=8, bits=4, start_iter=10)
    ddp_model.register_comm_hook(state, hierarchical_quantized_hook)
    ...                                   # train
    state.close()                         # before destroy_process_group()

Each gradient bucket is averaged with :class:`qcomm.collectives.hierarchical.
HierarchicalAllreduce`: full precision inside a node, ``bits``-bit payloads with error feedback
between nodes (from 3 nodes on a quantized reduce-scatter + all-gather, about two payloads per
node and bucket whatever the node count: :mod:`qcomm.collectives.rail`), all-gather inside the
node. As PowerSGD's hook, it takes a ``process_group`` (None: the default group) and a warm-up,
``start_iter`` (full-precision iterations, as ``start_powerSGD_iter``), and returns a future
that completes when the communication does, so the rest of the backward pass runs meanwhile.

One worker thread per state launches every collective of the state's groups, in bucket order,
and resolves each bucket's future from its handle: neither the hook nor a future callback
waits. The state follows PyTorch's ``PowerSGDState``: runtime objects are created lazily at
the first hook call, and pickling keeps the hyperparameters, the iteration count and the
error-feedback residuals, never a process group or a thread.

Why one worker thread, and the state's rules in full: docs/design.md, section "The DDP hook's
worker thread and state".
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at runtime
# (bucket must be dist.GradBucket, the return a torch.futures.Future), strings fail that check.
import logging
import queue
import threading
import zlib
from typing import Any

import torch
import torch.distributed as dist

from qcomm.compress import NonFiniteError, QuantSpec
from qcomm.validation import (
    check_bucket_mb,
    check_choice,
    check_instance,
    check_int,
    check_seed,
    check_timeout,
    fail,
)

__all__ = ["HierarchicalQuantState", "hierarchical_quantized_hook"]

log = logging.getLogger("qcomm")

# What a bucket holding NaN or Inf becomes (HierarchicalQuantState's on_nonfinite).
NONFINITE_BUCKETS = ("raise", "propagate")


class HierarchicalQuantState:
    """State of :func:`hierarchical_quantized_hook`.

    Args:
        procs_per_node: ranks per node; None reads ``LOCAL_WORLD_SIZE`` (see
            :class:`qcomm.collectives.topology.Topology`).
        process_group: the process group DDP averages over: None or the default group (the
            node groups and rails are built over the whole job, so DDP must run on all of it).
            The warm-up's full-precision allreduce runs on it.
        bits: inter-node code width, 1, 2, 4 or 8.
        block_size: elements per quantization scale, a power of two in [32, 4096].
        rounding: ``"nearest"`` (default) or ``"stochastic"``. Error feedback carries the
            rounding error into the next iteration either way; nearest makes it half as large
            (the transformer of the cluster benchmark, 4 nodes: final loss at DDP's with
            nearest, 0.5% above with stochastic in the reduce-scatter form).
        seed: base seed of stochastic rounding, an int in [0, 2**64).
        bucket_mb: the allreduce's internal bucket size (DDP buckets larger than this are cut).
        start_iter: iterations averaged in full precision (DDP's own allreduce) before the
            quantized hierarchy starts, an int >= 0 (PowerSGD's ``start_powerSGD_iter``).
        timeout_s: how long a bucket waits for the other ranks, a finite float > 0; None: the
            process group's own timeout.
        rail_collective: ``"auto"`` (default: the two-stage reduce-scatter from 3 nodes on, the
            all-gather below), ``"reduce_scatter"`` or ``"all_gather"`` (see
            :class:`~qcomm.collectives.hierarchical.HierarchicalAllreduce`).
        on_nonfinite: what a bucket holding NaN or Inf on some rank becomes once quantized
            averaging has started. ``"raise"`` (default): its future fails on every rank with
            :class:`~qcomm.compress.NonFiniteError` (DDP's backward raises it), the residuals
            unchanged; later buckets average as before. ``"propagate"``: the bucket comes back
            all NaN on every rank, the residuals unchanged, as DDP's own allreduce spreads a
            non-finite gradient: what torch's ``GradScaler`` needs to skip the step and lower
            its scale (mixed precision in float16 overflows now and then).
        comm: a :class:`~qcomm.engine.CommOptions` giving ``procs_per_node``, ``bits``,
            ``block_size``, ``rounding``, ``seed``, ``bucket_mb`` and ``timeout_s`` instead of
            the keywords above (the optimizers' options object; its gossip options must stay
            at their defaults here). None: the keywords.

    Attributes:
        iter: iterations completed (counted when DDP's last bucket of an iteration is hooked).
        stats: :class:`qcomm.collectives.stats.CommStats` of bytes sent per level, or None
            before the first quantized bucket (warm-up allreduces are DDP's bytes, not counted).

    Raises:
        ValueError: a bad node topology (``procs_per_node`` not dividing the world size, or
            torchrun's ``LOCAL_*`` variables at odds with the ranks), here when
            torch.distributed is initialized, else at the first hook call (before any
            warm-up iteration); TypeError/ValueError for a bad argument, named.
    """

    # Hyperparameters: the only fields that survive pickling, with the residuals and `iter`.
    _HPARAMS = ("procs_per_node", "bits", "block_size", "rounding", "seed", "bucket_mb",
                "start_iter", "timeout_s", "rail_collective", "on_nonfinite")

    # The options a CommOptions can give the hook (the rest are the gossip's).
    _FROM_COMM = ("procs_per_node", "bits", "block_size", "rounding", "seed", "bucket_mb",
                  "timeout_s")

    def __init__(self, procs_per_node: int | None = None, *,
                 process_group: Any = None, bits: int = 4, block_size: int = 128,
                 rounding: str = "nearest", seed: int = 0, bucket_mb: float = 25.0,
                 start_iter: int = 0, timeout_s: float | None = None,
                 rail_collective: str = "auto", on_nonfinite: str = "raise",
                 comm: Any = None) -> None:
        from qcomm.collectives.rail import check_rail_collective

        if comm is not None:
            procs_per_node, bits, block_size, rounding, seed, bucket_mb, timeout_s = \
                _from_comm(comm, dict(procs_per_node=procs_per_node, bits=bits,
                                      block_size=block_size, rounding=rounding, seed=seed,
                                      bucket_mb=bucket_mb, timeout_s=timeout_s))

        self.procs_per_node = check_int("procs_per_node", procs_per_node, low=1,
                                        allow_none=True)
        if process_group is not None and not (dist.is_available()
                                              and process_group is dist.group.WORLD):
            fail("process_group", "None or the default group (node groups and rails are built "
                 "over the whole job)", process_group)
        self.process_group = process_group
        self.spec = QuantSpec(bits, block_size, rounding)  # validates bits/block_size/rounding
        self.bits, self.block_size, self.rounding = bits, block_size, rounding
        self.seed = check_seed(seed)
        self.bucket_mb = check_bucket_mb(bucket_mb)
        self.start_iter = check_int("start_iter", start_iter, low=0)
        self.timeout_s = check_timeout(timeout_s, allow_none=True)
        self.rail_collective = check_rail_collective(rail_collective)
        self.on_nonfinite = check_choice("on_nonfinite", on_nonfinite, NONFINITE_BUCKETS)
        self.iter = 0
        self.stats = None
        self._allreduce: Any = None
        self._pending: dict | None = None
        self._worker: _Worker | None = None
        self._topology_checked = False
        self._check_topology()

    def _check_topology(self) -> None:
        """Check the node topology (``procs_per_node`` dividing the world size, torchrun's
        ``LOCAL_*`` variables) as soon as the job is known: here at construction under an
        initialized torch.distributed, else at the first hook call. The groups are still made
        at the first quantized bucket, but a bad topology must not wait for it: after a warm-up
        of ``start_iter`` iterations it would end a run that already spent them. Makes no
        collective and no group."""
        if self._topology_checked or not (dist.is_available() and dist.is_initialized()):
            return
        from qcomm.collectives.topology import Topology

        Topology(self.procs_per_node)  # raises ValueError naming the numbers
        self._topology_checked = True

    @property
    def warming_up(self) -> bool:
        """True while buckets are averaged in full precision (``iter < start_iter``)."""
        return self.iter < self.start_iter

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
                                           stats=self.stats, seed=self.seed,
                                           timeout_s=self.timeout_s,
                                           rail_collective=self.rail_collective)
            if self._pending is not None:
                engine.load_state_dict(self._pending)
                self._pending = None
            self._allreduce = engine
        return self._allreduce

    def _submit(self, tensor: torch.Tensor, key: str) -> torch.futures.Future:
        """Hand one bucket to the worker; its future completes with the averaged tensor."""
        if self._worker is None:
            self._worker = _Worker(self.allreduce(), self.timeout_s, self.on_nonfinite)
        return self._worker.submit(tensor, key)

    def _count(self, bucket: dist.GradBucket) -> None:
        # Bucket 0 is the last one DDP hands over in an iteration (as PowerSGD counts).
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_iter and self.start_iter:
                log.info("qcomm: hierarchical quantized averaging starts after %d "
                         "full-precision iterations", self.iter)

    def close(self) -> None:
        """Finish the buckets in flight and stop the worker thread (call it before
        ``destroy_process_group()``). The state stays usable: the next hook call restarts
        the worker. Idempotent."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def state_dict(self) -> dict:
        """What resumes the hook bit for bit: the hyperparameters, the iteration count, the
        byte counts and the allreduce's state (the error-feedback residuals of every bucket,
        both stages of the reduce-scatter form, and the call count that seeds stochastic
        rounding). Tensors are references (as in torch's state_dicts): save or copy it before
        the next iteration. Finish the buckets in flight first (``close()``)."""
        state = {k: getattr(self, k) for k in self._HPARAMS}
        state["allreduce_state"] = (self._allreduce.state_dict() if self._allreduce is not None
                                    else self._pending)
        state["stats"] = self.stats
        state["iter"] = self.iter
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (before the first hook call, on a state
        built for the same job). The residuals are loaded when the allreduce is created, on
        the first quantized bucket."""
        if not isinstance(state, dict) or "iter" not in state:
            fail("state", "a dict from HierarchicalQuantState.state_dict()", state)
        if self._allreduce is not None:
            raise RuntimeError("load_state_dict must come before the first hook call")
        # Everything validated on a new object first: a bad state leaves this one as it was.
        fresh = HierarchicalQuantState(**{k: state[k] for k in self._HPARAMS if k in state},
                                       process_group=self.process_group)
        fresh.iter = check_int("state['iter']", state["iter"], low=0)
        fresh._pending = state.get("allreduce_state")
        fresh.stats = state.get("stats")
        self.close()
        self.__dict__.update(fresh.__dict__)

    # Pickling: the state_dict (never a process group or a thread).
    def __getstate__(self) -> dict:
        return self.state_dict()

    def __setstate__(self, state: dict) -> None:
        self.process_group, self._allreduce, self._worker = None, None, None
        self.load_state_dict(state)


def _from_comm(comm: Any, given: dict[str, Any]) -> tuple:
    """The hook's options from a :class:`~qcomm.engine.CommOptions` (the one place options
    are defined and validated). Keywords besides it must keep their defaults, and the gossip's
    options must too: the hook averages every iteration exactly, they would change nothing."""
    from qcomm.engine.options import CommOptions

    check_instance("comm", comm, CommOptions, allow_none=True, what="a CommOptions")
    defaults = HierarchicalQuantState.__init__.__kwdefaults__
    both = [k for k, v in given.items()
            if (v is not None if k == "procs_per_node" else v != defaults[k])]
    if both:
        raise TypeError(f"pass {', '.join(both)} in comm= or as keywords, not both")
    plain = CommOptions()
    gossip = [f for f in CommOptions.__dataclass_fields__
              if f not in HierarchicalQuantState._FROM_COMM
              and getattr(comm, f) != getattr(plain, f)]
    if gossip:
        raise ValueError(f"comm sets {', '.join(gossip)}, which the DDP hook does not use (it "
                         "averages every iteration's gradients: there is no gossip); pass options "
                         f"among {', '.join(HierarchicalQuantState._FROM_COMM)}")
    return tuple(getattr(comm, k) for k in HierarchicalQuantState._FROM_COMM)


class _Worker:
    """One thread that averages buckets in the order they were submitted: it is the only
    issuer of collectives on the state's process groups (why: docs/design.md, "The DDP hook's
    worker thread and state")."""

    def __init__(self, allreduce: Any, timeout_s: float | None, on_nonfinite: str) -> None:
        self._allreduce = allreduce
        self._timeout_s = timeout_s
        self._on_nonfinite = on_nonfinite
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="qcomm-ddp-hook", daemon=True)
        self._thread.start()

    def submit(self, tensor: torch.Tensor, key: str) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((tensor, key, fut))
        return fut

    def _run(self) -> None:
        failed: BaseException | None = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, key, fut = item
            if failed is not None:  # the groups are in an unknown state: fail fast
                fut.set_exception(failed)
                continue
            try:
                handle = self._allreduce.mean_([tensor], async_op=True, key=key)
                handle.wait(self._timeout_s)
            except NonFiniteError as e:
                # Every rank met it after the bucket's last collective, no residual moved:
                # the groups are in step, later buckets go on.
                if self._on_nonfinite == "propagate":
                    fut.set_result(tensor.fill_(float("nan")))
                else:
                    fut.set_exception(type(e)(
                        f"{e} (with torch's GradScaler, make the state with "
                        f"on_nonfinite='propagate': the bucket then comes back NaN and the "
                        f"scaler skips the step)", e.argument, e.blocks))
            except BaseException as e:  # delivered to DDP through the future
                failed = e
                fut.set_exception(e)
            else:
                fut.set_result(tensor)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def _allreduce_fp(state: HierarchicalQuantState, tensor: torch.Tensor
                  ) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging (divide, then allreduce, asynchronous), for the warm-up."""
    from qcomm.collectives.primitives import all_reduce_mean_future
    from qcomm.collectives.torch_group import resolve_group

    group = state.process_group if state.process_group is not None else dist.group.WORLD
    return all_reduce_mean_future(tensor, resolve_group(group))


def _bucket_key(bucket: dist.GradBucket, tensor: torch.Tensor) -> str:
    """The residual key of a bucket: its index, size and the sizes of its parameters in order,
    so a residual is only ever added to the layout it was computed for (DDP's first iteration
    and its rebuilt buckets can hold the same number of elements in another order)."""
    sizes = ",".join(str(p.numel()) for p in bucket.parameters())
    return f"bucket{bucket.index()}:{tensor.numel()}:{zlib.crc32(sizes.encode()):08x}"


def hierarchical_quantized_hook(state: HierarchicalQuantState,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over all ranks, quantized between nodes.

    Args:
        state: a :class:`HierarchicalQuantState`.
        bucket: DDP's gradient bucket; its flat buffer (float32/float16/bfloat16) is averaged
            in place.

    Returns:
        A future that completes with the averaged flat buffer once its communication has
        finished (the hook itself returns at once, so backward goes on meanwhile); it carries
        the exception (e.g. :class:`~qcomm.collectives.errors.PeerTimeoutError`) if the
        communication failed. During the warm-up (``state.start_iter``) it is DDP's own
        full-precision allreduce.

    Error feedback keeps one residual per DDP bucket layout (keyed by the bucket's index, size
    and parameter sizes in order: DDP rebuilds its buckets after the first iteration, and the
    residuals of that first layout are then left unused; a warm-up of one iteration or more
    avoids creating them). A process that resumes from :meth:`HierarchicalQuantState.
    state_dict` starts, as DDP does, on the initial layout for one iteration: that iteration
    uses the residuals saved for the initial layout, the next ones those of the rebuilt layout.
    """
    check_instance("state", state, HierarchicalQuantState,
                   what="a qcomm.hooks.HierarchicalQuantState")
    state._check_topology()  # a state made before init_process_group: at its first bucket
    tensor = bucket.buffer()
    if state.warming_up:
        fut = _allreduce_fp(state, tensor)
    else:
        fut = state._submit(tensor, key=_bucket_key(bucket, tensor))
    state._count(bucket)
    return fut
