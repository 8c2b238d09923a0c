"""The methods the cluster benchmark compares: one builder per method, plus their wire bytes.

A builder takes the (unwrapped, identically seeded) model and returns a :class:`Built`: the
module to call in the training loop (maybe DDP-wrapped), the optimizer, and the few hooks the
workload needs around the timed window (complete in-flight traffic, make the final model, read
qcomm's byte counters). The qcomm methods go through :func:`_qcomm_adapter`, the one place that
knows qcomm's training APIs; when those are missing the methods report "unavailable".

The registry (:data:`METHODS`) and the byte formulas (:func:`expected_inter_bytes`) are pure
Python, importable without torch.distributed, and unit-tested.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

FP32 = 4


@dataclass(frozen=True)
class MethodInfo:
    """One entry of the registry.

    Attributes:
        name: the command-line name.
        family: ``"torch"`` (PyTorch's own DDP / hooks / averagers) or ``"qcomm"``.
        description: one line for the table.
        bits: code width on the inter-node wire (32 for fp32, 16 for fp16), None when it varies.
        needs: module qcomm must provide for the method to run (None for torch methods).
    """

    name: str
    family: str
    description: str
    bits: int | None
    needs: str | None = None


# qcomm variants by name: assgd-<bits>[-h<H>[f<F>]][-s<staleness>][-g<gamma x 100>]
# [-m<outer momentum x 10>][-ddp], e.g. assgd-4-h8f4 (gossip every 8 steps in 4 fragments) or
# assgd-2-h8f4-m5-ddp (outer momentum 0.5, node gradient mean by DDP).
_VARIANT = re.compile(r"assgd-(?P<bits>[1248])(?:-h(?P<h>\d+)(?:f(?P<f>\d+))?)?"
                      r"(?:-s(?P<s>\d+))?(?:-g(?P<g>\d+))?(?:-m(?P<m>\d))?(?P<ddp>-ddp)?")


def qcomm_variant(name: str) -> dict[str, Any] | None:
    """The ASSGD options a variant name asks for, or None when ``name`` is not one."""
    m = _VARIANT.fullmatch(name)
    if m is None:
        return None
    out: dict[str, Any] = {"bits": int(m["bits"]), "ddp": bool(m["ddp"])}
    if m["h"]:
        out["sync_every"] = int(m["h"])
        out["fragments"] = int(m["f"] or 1)
    if m["s"]:
        out["staleness"] = int(m["s"])
    if m["g"]:
        out["gamma"] = int(m["g"]) / 100
    if m["m"]:
        out["outer_momentum"] = int(m["m"]) / 10
    return out


class _Registry(dict):
    """The fixed methods, plus every qcomm variant name (:func:`qcomm_variant`) on lookup."""

    def __missing__(self, name: str) -> MethodInfo:
        opts = qcomm_variant(name)
        if opts is None:
            raise KeyError(name)
        desc = ", ".join(f"{k}={v}" for k, v in opts.items() if k not in ("bits", "ddp"))
        return MethodInfo(name, "qcomm", f"qcomm ASSGD {opts['bits']}-bit gossip"
                          + (f" ({desc})" if desc else "")
                          + (", node mean by DDP" if opts["ddp"] else ""),
                          opts["bits"], "qcomm.sgd")

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str)
                                                 and qcomm_variant(name) is not None)


METHODS: dict[str, MethodInfo] = _Registry({
    m.name: m
    for m in (
        MethodInfo("ddp", "torch", "DDP, fp32 allreduce", 32),
        MethodInfo("ddp-fp16", "torch", "DDP + fp16_compress_hook", 16),
        MethodInfo("ddp-powersgd", "torch", "DDP + PowerSGD hook (rank r, error feedback)", None),
        MethodInfo("localsgd", "torch", "post-local SGD + HierarchicalModelAverager", 32),
        MethodInfo("qcomm-hook", "qcomm", "DDP + qcomm hierarchical quantized hook (4 bit)", 4,
                   "qcomm.hooks"),
        MethodInfo("assgd-8", "qcomm", "qcomm ASSGD, 8-bit gossip", 8, "qcomm.sgd"),
        MethodInfo("assgd-4", "qcomm", "qcomm ASSGD, 4-bit gossip", 4, "qcomm.sgd"),
        MethodInfo("assgd-2", "qcomm", "qcomm ASSGD, 2-bit gossip", 2, "qcomm.sgd"),
        MethodInfo("assgd-1", "qcomm", "qcomm ASSGD, 1-bit gossip", 1, "qcomm.sgd"),
        MethodInfo("assgd-4-ddp", "qcomm",
                   "qcomm ASSGD, 4-bit gossip, node gradient mean by DDP in backward", 4,
                   "qcomm.sgd"),
    )
})


def parse_methods(spec: str) -> list[str]:
    """``"all"``, ``"torch"``, ``"qcomm"`` or a comma list of names -> method names, in order.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    spec = spec.strip()
    if spec in ("all", ""):
        return list(METHODS)
    if spec in ("torch", "qcomm"):
        return [n for n, m in METHODS.items() if m.family == spec]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; known: {list(METHODS)}, or all/torch/qcomm")
    return names


def availability(name: str) -> tuple[bool, str]:
    """Whether ``name`` can run here, and why not. Checks qcomm's modules without importing
    torch.distributed machinery (the workload then imports them for real)."""
    info = METHODS[name]
    if info.needs is None:
        return True, ""
    try:
        found = importlib.util.find_spec(info.needs) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return False, f"unavailable: {info.needs} is not in this checkout"
    return True, ""


# ---------------------------------------------------------------------------------------------
# bytes on the inter-node wire, from the algorithms


@dataclass(frozen=True)
class Layout:
    """``nodes`` nodes with ``procs`` ranks each; ranks are node-major (torchrun's order)."""

    nodes: int
    procs: int

    @property
    def world(self) -> int:
        return self.nodes * self.procs


def ring_allreduce_inter_bytes(nbytes: int, layout: Layout) -> float:
    """Bytes one node sends to other nodes in a ring allreduce of ``nbytes`` per rank.

    Gloo's ring allreduce (reduce-scatter then all-gather around ranks 0 -> 1 -> ... -> W-1 -> 0)
    has every rank send ``2 (W-1)/W * nbytes``. With node-major ranks exactly one rank per node
    (its last) sends to the next node, so that is also what a node puts on its link.
    """
    w = layout.world
    if layout.nodes <= 1 or w <= 1:
        return 0.0
    return 2.0 * (w - 1) / w * nbytes


def powersgd_numel(shapes: Sequence[Sequence[int]], rank: int,
                   min_compression_rate: float = 2.0) -> tuple[int, int]:
    """(compressed numel, uncompressed numel) PowerSGD allreduces per step for ``shapes``.

    Mirrors torch's ``powerSGD_hook``: a tensor of ndim <= 1 is allreduced as is; a matrix
    (n, m) (higher ndim flattened to (shape[0], rest)) is sent as P (n x r) and Q (m x r) when
    ``n*m > (n+m)*r*min_compression_rate``, else as is; ``r = min(rank, n, m)``.
    """
    compressed = uncompressed = 0
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        if len(shape) <= 1:
            uncompressed += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(rank, n, m)
        if n * m > (n + m) * r * min_compression_rate:
            compressed += (n + m) * r
        else:
            uncompressed += numel
    return compressed, uncompressed


def localsgd_averages(first_step: int, steps: int, period: int) -> int:
    """How many of the optimizer steps ``first_step .. first_step + steps - 1`` (0-based, as
    torch's model averagers count them) average parameters: those with ``step % period == 0``
    (the averager's warm-up is over before ``first_step`` here)."""
    last = first_step + steps - 1
    return last // period - (first_step - 1) // period


def expected_inter_bytes(name: str, shapes: Sequence[Sequence[int]], layout: Layout, *,
                         powersgd_rank: int = 4, localsgd_period: int = 8,
                         window: tuple[int, int] | None = None) -> float | None:
    """Bytes per training step one node sends to other nodes, from the algorithm (payload only:
    no TCP/IP or Gloo framing), or None when the algorithm does not fix it (qcomm methods: their
    own stats count what they send).

    ``window = (first_step, steps)``: the optimizer steps measured (0-based); post-local SGD's
    averaging then counts the averaging steps inside it exactly, else one per period.
    """
    numel = sum(_prod(s) for s in shapes)
    if name == "ddp":
        return ring_allreduce_inter_bytes(numel * FP32, layout)
    if name == "ddp-fp16":
        return ring_allreduce_inter_bytes(numel * 2, layout)
    if name == "ddp-powersgd":
        c, u = powersgd_numel(shapes, powersgd_rank)
        return ring_allreduce_inter_bytes((c + u) * FP32, layout)
    if name == "localsgd":
        # Gradients are averaged inside the node every step (loopback); parameters are averaged
        # over everyone once every `localsgd_period` steps.
        per_average = ring_allreduce_inter_bytes(numel * FP32, layout)
        if window is None:
            return per_average / localsgd_period
        first, steps = window
        return per_average * localsgd_averages(first, steps, localsgd_period) / steps
    return None


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


# Per packet the interface counts Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes of
# headers. veth counts a GSO super-packet (up to 64 kB of payload) as one packet with one set
# of headers, so tx_bytes - HEADER_BYTES * tx_packets is the TCP payload (Gloo's messages and
# framing) exactly; pure ACKs are all header.
HEADER_BYTES = 14 + 20 + 32


def tcp_payload(tx_bytes: float, tx_packets: float) -> float:
    """TCP payload bytes in ``tx_bytes`` sent as ``tx_packets`` packets (see HEADER_BYTES)."""
    return tx_bytes - HEADER_BYTES * tx_packets


def agreement(counted: float, reference: float) -> float:
    """Relative difference ``|counted - reference| / reference`` (inf when reference is 0 and
    counted is not)."""
    if reference == 0:
        return 0.0 if counted == 0 else float("inf")
    return abs(counted - reference) / reference


# ---------------------------------------------------------------------------------------------
# builders (import torch lazily: the registry above must stay importable anywhere)


@dataclass
class Config:
    """What every method gets, identical across methods."""

    lr: float
    momentum: float
    layout: Layout
    seed: int = 0
    powersgd_rank: int = 4
    localsgd_period: int = 8
    localsgd_warmup: int = 0
    hook_bits: int = 4


@dataclass
class Built:
    """A method ready to train.

    Attributes:
        model: what the training loop calls (DDP-wrapped or the bare module).
        module: the bare module (evaluated, snapshotted).
        optimizer: stepped once per training step.
        flush: completes traffic in flight (before the byte counters are read).
        finalize: makes the final model (e.g. averages parameters over all ranks); collective.
        comm_stats: qcomm's ``{"intra": bytes, "inter": bytes}`` sent by this rank so far, or
            None for methods without qcomm stats.
        close: releases resources.
    """

    model: Any
    module: Any
    optimizer: Any
    flush: Callable[[], None] = lambda: None
    finalize: Callable[[], None] = lambda: None
    comm_stats: Callable[[], dict[str, int] | None] = lambda: None
    close: Callable[[], None] = lambda: None
    notes: dict[str, Any] = field(default_factory=dict)


def _sgd(params, cfg: Config):
    import torch

    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)


def _average_all(module) -> None:
    """Every rank's parameters <- the mean over all ranks (one allreduce per tensor)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        w = dist.get_world_size()
        for p in module.parameters():
            dist.all_reduce(p.data)
            p.data.div_(w)


def build_ddp(module, cfg: Config) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module)
    return Built(model, module, _sgd(model.parameters(), cfg))


def build_ddp_fp16(module, cfg: Config) -> Built:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module)
    model.register_comm_hook(None, fp16_compress_hook)
    return Built(model, module, _sgd(model.parameters(), cfg))


def build_ddp_powersgd(module, cfg: Config) -> Built:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    # One bucket: on Gloo, PowerSGD's chained allreduces (P, then Q from P's callback) of two
    # buckets can start in different orders on different ranks (Gloo runs them on a thread
    # pool), and the ranks then abort with "Received data size doesn't match expected size".
    # An explicit bucket_cap_mb also sizes DDP's first bucket, so the model fits in one.
    model = DDP(module, bucket_cap_mb=256)
    # start_powerSGD_iter=2: compress from the second step on (torch requires > 1 with error
    # feedback); the workload's untimed warm-up steps cover the uncompressed first one. The
    # default (1000) would make the whole benchmark plain allreduce.
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
        start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
        random_seed=cfg.seed,
    )
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    return Built(model, module, _sgd(model.parameters(), cfg),
                 notes={"powersgd_rank": cfg.powersgd_rank})


def build_localsgd(module, cfg: Config) -> Built:
    """torch's post-local SGD: gradients averaged inside the node every step (the hook's
    subgroup), parameters averaged over all ranks every ``localsgd_period`` steps by the
    hierarchical model averager."""
    from collections import OrderedDict

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    procs = cfg.layout.procs
    # new_subgroups is collective: every rank calls it, groups are consecutive ranks = nodes.
    subgroup, _ = dist.new_subgroups(group_size=procs)
    model = DDP(module)
    state = post_local.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                         start_localSGD_iter=cfg.localsgd_warmup)
    model.register_comm_hook(state, post_local.post_localSGD_hook)
    averager = HierarchicalModelAverager(
        period_group_size_dict=OrderedDict([(cfg.localsgd_period, cfg.layout.world)]),
        warmup_steps=cfg.localsgd_warmup,
    )
    opt = PostLocalSGDOptimizer(optim=_sgd(model.parameters(), cfg), averager=averager)
    return Built(model, module, opt, finalize=lambda: _average_all(module),
                 notes={"localsgd_period": cfg.localsgd_period})


def _qcomm_adapter(name: str, module, cfg: Config) -> Built:
    """The one place that knows qcomm's training APIs (qcomm.sgd.ASSGD, qcomm.hooks)."""
    opts = qcomm_variant(name)
    if opts is not None:
        from qcomm.sgd import ASSGD

        bits, ddp = opts.pop("bits"), opts.pop("ddp")
        comm = {"graph": "ring", "staleness": 1, **opts}
        opt = ASSGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum, bits=bits,
                    procs_per_node=cfg.layout.procs, seed=cfg.seed, **comm)
        # "-ddp": the node's gradient mean by DDP over the node's ranks, during backward.
        model = opt.data_parallel(module) if ddp else module

        def flush() -> None:
            # Completes the gossip rounds in flight, so what stats() counted is on the wire
            # before the interface counters are read.
            opt.flush()

        def stats() -> dict[str, int]:
            return dict(opt.stats()["bytes_sent"])

        def close() -> None:
            opt.close()

        def finalize() -> None:
            opt.average_parameters()

        return Built(model, module, opt, flush=flush, finalize=finalize, comm_stats=stats,
                     close=close, notes={"bits": bits, **comm})
    if name == "qcomm-hook":
        return _qcomm_hook(module, cfg)
    raise ValueError(f"not a qcomm method: {name!r}")


def _qcomm_hook(module, cfg: Config) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qcomm.hooks as hooks

    model = DDP(module)
    state = hooks.HierarchicalQuantState(procs_per_node=cfg.layout.procs, bits=cfg.hook_bits,
                                         seed=cfg.seed)
    model.register_comm_hook(state, hooks.hierarchical_quantized_hook)

    def stats() -> dict[str, int]:
        # state.stats exists from the first hook call on (the warm-up steps make it).
        if state.stats is None:
            return {"intra": 0, "inter": 0}
        return dict(state.stats.snapshot()["bytes_sent"])

    return Built(model, module, _sgd(model.parameters(), cfg), comm_stats=stats,
                 notes={"bits": cfg.hook_bits})


BUILDERS: dict[str, Callable[[Any, Config], Built]] = {
    "ddp": build_ddp,
    "ddp-fp16": build_ddp_fp16,
    "ddp-powersgd": build_ddp_powersgd,
    "localsgd": build_localsgd,
}


def build(name: str, module, cfg: Config) -> Built:
    """Build method ``name`` around ``module`` (collective: call on every rank)."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {name!r}")
    ok, why = availability(name)
    if not ok:
        raise RuntimeError(f"method {name}: {why}")
    if name in BUILDERS:
        return BUILDERS[name](module, cfg)
    return _qcomm_adapter(name, module, cfg)
