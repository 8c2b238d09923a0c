"""The methods the cluster benchmark compares: one builder per method, plus their wire bytes.

A builder takes the (unwrapped, identically seeded) model and a ``Config`` and returns a
``Built`` (both in training.py, with the cluster's ``Layout``): the module to call in the
training loop (maybe DDP-wrapped), the optimizer, and the few hooks the workload needs around
the timed window (complete in-flight traffic, make the final model, read qcomm's byte
counters). The qcomm methods go through :func:`_qcomm_adapter`, the one place that knows
qcomm's training APIs; when those are missing the methods report "unavailable". torchft's
DiLoCo lives in ``torchft_methods.py`` (imported only when such a method runs; it imports
training.py, not this module).

Every method trains with the workload's optimizer (training.py's ``inner_optimizer``: SGD +
momentum on MNIST-1D, AdamW on the transformer); a method that only exists for SGD (qcomm's
ASSGD) says "n/a" on the other workloads (:func:`applicability`).

The registry (:data:`METHODS`) and the byte formulas (:func:`expected_inter_bytes`) are pure
Python, importable without torch.distributed, and unit-tested.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path (it says it is a library): the repository root first on sys.path, so that
    # `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import sharding as S
from bench.cluster.training import Built, Config, Layout, average_all, inner_optimizer

FP32 = 4
# The workloads that train with SGD + momentum (where ASSGD, SGD on qcomm, applies).
SGD_WORKLOADS = ("mnist1d", "mnist1d-bn")


@dataclass(frozen=True)
class MethodInfo:
    """One entry of the registry.

    Attributes:
        name: the command-line name.
        description: one line for the table.
        family: ``"torch"`` (PyTorch's own DDP / hooks / averagers), ``"torchft"`` (the
            ``torchft`` package) or ``"qcomm"``.
        bits: code width on the inter-node wire (32 for fp32, 16 for fp16), None when it varies.
        needs: what must be importable for the method to run: ``"module"`` or
            ``"module:attribute"`` (None for torch methods).
        workloads: the workloads it applies to (None: all).
    """

    name: str
    family: str
    description: str
    bits: int | None
    needs: str | None = None
    workloads: tuple[str, ...] | None = None


# qcomm variants by name: <kind>-<bits>[-h<H>[f<F>]][-s<staleness>][-g<gamma x 100>]
# [-m<outer momentum x 10>][-o<outer lr x 10>][-ring|-exp|-complete][-n][-ddp][-wf][-cont] (-n:
# nearest rounding, -wf: wait-free gossip, -cont: wait-free gossip that continues without a
# lost node, on_peer_loss="continue"; -cont implies -wf, so -wf-cont and -cont are the same),
# kind "assgd" (SGD, MNIST-1D only) or "qcomm-hier" (the workload's own optimizer, e.g. AdamW).
# E.g. assgd-4-h8f4 (gossip every 8 steps in 4 fragments) or qcomm-hier-2-h8f4-m5-ddp (outer
# momentum 0.5, node gradient mean by DDP).
_VARIANT = re.compile(r"(?P<kind>assgd|qcomm-hier)-(?P<bits>[1248])"
                      r"(?:-h(?P<h>\d+)(?:f(?P<f>\d+))?)?"
                      r"(?:-s(?P<s>\d+))?(?:-g(?P<g>\d+))?(?:-m(?P<m>\d))?(?:-o(?P<o>\d+))?"
                      r"(?:-(?P<graph>ring|exp|complete))?(?P<near>-n)?(?P<ddp>-ddp)?"
                      r"(?P<wf>-wf)?(?P<cont>-cont)?")


# The settings the README recommends, by their names in qcomm.sgd: the bench reads them from the
# library when such a method runs, so a table of them measures what users are told to use:
# with the node's gradient mean by DDP (``opt.data_parallel(model)``) and the run's length
# (``total_steps=``), as the README writes them.
NAMED_SETTINGS = {"slow-link": ("assgd", "SLOW_LINK"),
                  "adamw-slow-link": ("qcomm-hier", "ADAMW_SLOW_LINK")}


def named_setting(name: str) -> dict[str, Any] | None:
    """The options of one of the README's settings (:data:`NAMED_SETTINGS`), as
    :func:`qcomm_variant` gives them, read from ``qcomm.sgd`` (which imports torch); None for
    another name."""
    if name not in NAMED_SETTINGS:
        return None
    kind, attr = NAMED_SETTINGS[name]
    import qcomm.sgd

    opts = dict(getattr(qcomm.sgd, attr))
    return {"kind": kind, "bits": opts.pop("bits"), "ddp": True, "named": True, **opts}


def qcomm_variant(name: str) -> dict[str, Any] | None:
    """The ASSGD options a variant name (or a named setting) asks for, or None when ``name``
    is not one."""
    if name in NAMED_SETTINGS:
        return named_setting(name)
    m = _VARIANT.fullmatch(name)
    if m is None:
        return None
    out: dict[str, Any] = {"kind": m["kind"], "bits": int(m["bits"]), "ddp": bool(m["ddp"])}
    if m["h"]:
        out["sync_every"] = int(m["h"])
        out["fragments"] = int(m["f"] or 1)
    if m["s"]:
        out["staleness"] = int(m["s"])
    if m["g"]:
        out["gamma"] = int(m["g"]) / 100
    if m["m"]:
        out["outer_momentum"] = int(m["m"]) / 10
    if m["o"]:
        out["outer_lr"] = int(m["o"]) / 10
    if m["graph"]:
        out["graph"] = {"exp": "exponential"}.get(m["graph"], m["graph"])
    if m["near"]:
        out["rounding"] = "nearest"
    if m["wf"] or m["cont"]:
        out["wait_free"] = True
    if m["cont"]:
        out["on_peer_loss"] = "continue"
    return out


# The peers' own knobs in their names, as qcomm's: localsgd-p<period>,
# torchft-[streaming-]diloco[-h<sync_every>][-o<outer lr x 10>][-m<outer momentum x 10>],
# ddp-powersgd-r<rank>; and qcomm's hook: qcomm-hook[-b<bits>][-ag|-rs][-n|-st][-c<MB>][-d<MB>]
# (the rail's all-gather or two-stage reduce-scatter, plain: "auto"; -n nearest, -st stochastic
# rounding, plain: the hook's default, nearest; -c the hook's bucket_mb, the pieces a DDP bucket
# is cut into and pipelined as; -d DDP's bucket_cap_mb). The plain names run Config's defaults.
_PEER = re.compile(r"(?P<base>localsgd)-p(?P<p>\d+)"
                   r"|(?P<dbase>torchft-diloco|torchft-streaming-diloco)"
                   r"(?:-h(?P<h>\d+))?(?:-o(?P<o>\d+))?(?:-m(?P<m>\d))?"
                   r"|(?P<pbase>ddp-powersgd)-r(?P<r>\d+)"
                   r"|(?P<hbase>qcomm-hook)(?:-b(?P<hb>[1248]))?(?:-(?P<hr>ag|rs))?"
                   r"(?:-(?P<hn>n|st))?(?:-c(?P<hc>\d+))?(?:-d(?P<hd>\d+))?")
_HOOK_RAILS = {"ag": "all_gather", "rs": "reduce_scatter"}


def peer_variant(name: str) -> tuple[str, dict[str, Any]] | None:
    """``(base method, Config fields it sets)`` for a peer name with settings, else None."""
    m = _PEER.fullmatch(name)
    if m is None:
        return None
    if m["base"]:
        return m["base"], {"localsgd_period": int(m["p"])}
    if m["pbase"]:
        return m["pbase"], {"powersgd_rank": int(m["r"])}
    out: dict[str, Any] = {}
    if m["hbase"]:
        if m["hb"]:
            out["hook_bits"] = int(m["hb"])
        if m["hr"]:
            out["hook_rail"] = _HOOK_RAILS[m["hr"]]
        if m["hn"]:
            out["hook_rounding"] = "nearest" if m["hn"] == "n" else "stochastic"
        if m["hc"]:
            out["hook_bucket_mb"] = float(m["hc"])
        if m["hd"]:
            out["hook_ddp_bucket_mb"] = float(m["hd"])
        return (m["hbase"], out) if out else None
    if m["h"]:
        out["diloco_sync_every"] = int(m["h"])
    if m["o"]:
        out["diloco_outer_lr"] = int(m["o"]) / 10
    if m["m"]:
        out["diloco_outer_momentum"] = int(m["m"]) / 10
    return (m["dbase"], out) if out else None


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """The method a name runs and the Config fields its name sets (none for plain names); a
    Lightning method's, its base method's (the same communication)."""
    if is_lightning(name):
        return resolve(lightning_base(name))
    return peer_variant(name) or (name, {})


# Lightning's Trainer around a method (bench/cluster/lightning_worker.py): "lightning-ddp"
# (strategy="ddp") and "lightning-<qcomm-hier method with the node mean by DDP>" (QcommStrategy).
LIGHTNING_PREFIX = "lightning-"


def lightning_base(name: str) -> str:
    """The method a Lightning method runs under the Trainer (``"lightning-ddp"`` -> ``"ddp"``)."""
    return name.removeprefix(LIGHTNING_PREFIX)


def is_lightning(name: str) -> bool:
    """Whether ``name`` is a Lightning method: ``lightning-ddp``, or ``lightning-`` before a
    qcomm-hier method whose node mean is DDP's (QcommStrategy runs DDP in the node)."""
    if not name.startswith(LIGHTNING_PREFIX):
        return False
    base = lightning_base(name)
    opts = qcomm_variant(base)
    return base == "ddp" or bool(opts and opts["kind"] == "qcomm-hier" and opts["ddp"])


def continues_after_loss(name: str) -> bool:
    """Whether method ``name`` is meant to keep training when a node is lost (qcomm variants
    ending in ``-cont``: ``on_peer_loss="continue"``)."""
    opts = qcomm_variant(name)
    return bool(opts and opts.get("on_peer_loss") == "continue")


# The peers whose answer to a lost node that comes back is torchrun's elastic restart from a
# checkpoint (recovery.py runs them under --join-at): DDP and local SGD, with their settings.
ELASTIC_RESTART = ("ddp", "localsgd")


def restarts_elastically(name: str) -> bool:
    """Whether a lost node that comes back is, for method ``name``, torchrun's elastic restart
    of every worker from the last checkpoint (DDP and local SGD)."""
    return resolve(name)[0] in ELASTIC_RESTART


# The peers that heal a replica group that comes back from a live one (torchft's Manager):
# recovery.py runs them under --join-at, each node its own torchrun.
HEALS = ("torchft-diloco", "torchft-streaming-diloco")


def heals(name: str) -> bool:
    """Whether a lost node that comes back is, for method ``name``, torchft's heal: the group
    joins the next quorum and fetches its state from a live one ((streaming) DiLoCo)."""
    return resolve(name)[0] in HEALS


def recovers_by_itself(name: str) -> bool:
    """Whether recovery.py runs method ``name`` under --join-at (the peers' own recoveries:
    :func:`restarts_elastically` or :func:`heals`)."""
    return restarts_elastically(name) or heals(name)


def per_node_budget(name: str) -> bool:
    """Whether method ``name`` lets nodes take different numbers of steps (wait-free gossip):
    then each node trains for its own time budget; every other method takes the same steps on
    every rank."""
    opts = qcomm_variant(name)
    return bool(opts and opts.get("wait_free"))


class _Registry(dict):
    """The fixed methods, plus every qcomm variant name (:func:`qcomm_variant`) on lookup."""

    def __missing__(self, name: str) -> MethodInfo:
        if is_lightning(name):
            base = self[lightning_base(name)]
            strategy = "strategy=\"ddp\"" if base.name == "ddp" else "QcommStrategy"
            return MethodInfo(name, "lightning", f"Lightning Trainer, {strategy}: "
                              f"{base.description}", base.bits, "lightning", base.workloads)
        peer = peer_variant(name)
        if peer is not None:
            base = dict.__getitem__(self, peer[0])
            desc = ", ".join(f"{k}={v}" for k, v in peer[1].items())
            return MethodInfo(name, base.family, f"{base.description} ({desc})", base.bits,
                              base.needs, base.workloads)
        opts = qcomm_variant(name)
        if opts is None:
            raise KeyError(name)
        desc = ", ".join(f"{k}={v}" for k, v in opts.items()
                         if k not in ("kind", "bits", "ddp", "named"))
        sgd = opts["kind"] == "assgd"
        what = "ASSGD" if sgd else "HierarchicalOptimizer"
        return MethodInfo(name, "qcomm", f"qcomm {what} {opts['bits']}-bit gossip"
                          + (f" ({desc})" if desc else "")
                          + (", node mean by DDP" if opts["ddp"] else ""),
                          opts["bits"], "qcomm.sgd" if sgd else "qcomm.sgd:HierarchicalOptimizer",
                          SGD_WORKLOADS if sgd else None)

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or (
            isinstance(name, str)
            and (qcomm_variant(name) is not None or peer_variant(name) is not None
                 or is_lightning(name)))


METHODS: dict[str, MethodInfo] = _Registry({
    m.name: m
    for m in (
        MethodInfo("ddp", "torch", "DDP, fp32 allreduce", 32),
        MethodInfo("ddp-fp16", "torch", "DDP + fp16_compress_hook", 16),
        MethodInfo("ddp-powersgd", "torch", "DDP + PowerSGD hook (rank r, error feedback)", None),
        MethodInfo("hsdp", "torch", "HSDP: FSDP2 over the 2-D mesh, shards allreduced in fp32 "
                   "between nodes (--fsdp runs only)", 32),
        MethodInfo("localsgd", "torch", "post-local SGD + HierarchicalModelAverager", 32),
        MethodInfo("torchft-diloco", "torchft",
                   "torchft DiLoCo: H inner steps, outer Nesterov on the averaged delta", 32,
                   "torchft"),
        MethodInfo("torchft-streaming-diloco", "torchft",
                   "torchft streaming DiLoCo: fragments synced in turn, overlapped", 32,
                   "torchft"),
        MethodInfo("torchft-hsdp", "torchft",
                   "torchft fault-tolerant HSDP: FSDP2 in the node, gradient shards allreduced "
                   "between nodes by torchft's manager (--fsdp runs only)", 32, "torchft"),
        MethodInfo("qcomm-hook", "qcomm", "DDP + qcomm hierarchical quantized hook (4 bit)", 4,
                   "qcomm.hooks"),
        MethodInfo("qcomm-hier-4", "qcomm",
                   "qcomm HierarchicalOptimizer around the workload's optimizer, 4-bit", 4,
                   "qcomm.sgd:HierarchicalOptimizer"),
        MethodInfo("assgd-8", "qcomm", "qcomm ASSGD, 8-bit gossip", 8, "qcomm.sgd", SGD_WORKLOADS),
        MethodInfo("assgd-4", "qcomm", "qcomm ASSGD, 4-bit gossip", 4, "qcomm.sgd", SGD_WORKLOADS),
        MethodInfo("assgd-2", "qcomm", "qcomm ASSGD, 2-bit gossip", 2, "qcomm.sgd", SGD_WORKLOADS),
        MethodInfo("assgd-1", "qcomm", "qcomm ASSGD, 1-bit gossip", 1, "qcomm.sgd", SGD_WORKLOADS),
        MethodInfo("assgd-4-ddp", "qcomm",
                   "qcomm ASSGD, 4-bit gossip, node gradient mean by DDP in backward", 4,
                   "qcomm.sgd", SGD_WORKLOADS),
    )
})

FAMILIES = ("torch", "torchft", "qcomm")


def parse_methods(spec: str) -> list[str]:
    """``"all"``, a family (``"torch"``, ``"torchft"``, ``"qcomm"``) or a comma list of names
    -> method names, in order.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    spec = spec.strip()
    if spec in ("all", ""):
        return list(METHODS)
    if spec in FAMILIES:
        return [n for n, m in METHODS.items() if m.family == spec]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; known: {list(METHODS)}, or all or a "
                         f"family {list(FAMILIES)}{near_miss(unknown[0])}")
    return names


def near_miss(name: str) -> str:
    """``"; did you mean 'assgd-4'?"`` for a misspelled method, family or ``all``, else ``""``.

    Args:
        name (str): the name that is no method.

    Returns:
        str: the tail of the message refusing ``name``.
    """
    # qcomm.validation words every "did you mean" alike; it imports torch, which the registry
    # does not need until a name is refused.
    from qcomm.validation import did_you_mean

    return did_you_mean(name, [*METHODS, *FAMILIES, "all"])


def availability(name: str) -> tuple[bool, str]:
    """Whether ``name`` can run here, and why not. A plain module is looked up without being
    imported; a ``module:attribute`` need imports the module (the attribute may be missing from
    a module that exists, e.g. a class not yet in this checkout)."""
    info = METHODS[name]
    if info.needs is None:
        return True, ""
    module, _, attr = info.needs.partition(":")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        where = "installed" if info.family == "torchft" else "in this checkout"
        return False, f"unavailable: {module} is not {where}"
    if attr:
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            return False, (f"unavailable: {module}.{attr} cannot be imported "
                           f"({type(exc).__name__}: {exc})")
    return True, ""


def applicability(name: str, workload: str, fsdp: bool = False) -> tuple[bool, str]:
    """Whether method ``name`` applies to ``workload`` (with the model sharded by FSDP2 inside
    the node when ``fsdp``), and why not."""
    info = METHODS[name]
    if info.workloads is not None and workload not in info.workloads:
        return False, (f"n/a on {workload}: {name} is an SGD optimizer, run on "
                       f"{', '.join(info.workloads)} only")
    problem = _sharding_problem(name, fsdp)
    return (False, problem) if problem else (True, "")


def _sharding_problem(name: str, fsdp: bool) -> str | None:
    """Why method ``name`` cannot run with (or, HSDP, without) ``--fsdp``, or None."""
    if fsdp and sharded_form(name) is None:
        return f"n/a with --fsdp: {_unsharded_why(name)}"
    if not fsdp and resolve(name)[0] in S.SHARDED_ONLY:
        return f"n/a without --fsdp: {name} is hybrid sharding (FSDP2 inside the node)"
    return None


def sharded_form(name: str) -> str | None:
    """How method ``name`` runs with the model sharded inside the node (sharding.SHARDED_FORMS:
    ``"mesh"`` FSDP2's hybrid sharding, ``"shard"`` FSDP2 over the node's ranks and the method
    between nodes), or None where it has no sharded form."""
    opts = qcomm_variant(name)
    if opts is not None:
        lockstep = not (opts["ddp"] or opts.get("wait_free"))
        return S.SHARDED_FORMS.get(opts["kind"]) if lockstep else None
    return S.SHARDED_FORMS.get(resolve(name)[0])


def _unsharded_why(name: str) -> str:
    """Why method ``name`` has no sharded form (:func:`sharded_form` is None)."""
    opts = qcomm_variant(name)
    if opts is not None and opts["ddp"]:
        return f"{name} averages the node's gradients by DDP, which FSDP2 replaces"
    if opts is not None and opts.get("wait_free"):
        return (f"{name} trains each node for its own time, and a sharded model's snapshots "
                "are gathered at steps every rank of a node takes")
    sharded = [m for m in S.SHARDED_FORMS if m != "qcomm-hier"]
    return (f"{name} keeps a whole model per rank; the sharded methods are "
            f"{', '.join(sharded)} and qcomm-hier variants in lockstep (no -ddp, -wf, -cont)")


# ---------------------------------------------------------------------------------------------
# bytes on the inter-node wire, from the algorithms


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


def rail_allreduce_inter_bytes(nbytes: int, layout: Layout) -> float:
    """Bytes one node sends to other nodes when each of its ranks allreduces ``nbytes`` with the
    ranks of the same local rank on the other nodes (torchft: group rank r of every replica
    group forms one process group, and a replica group is a node here).

    Each rail is a Gloo ring of ``nodes`` ranks, one per node, so all of a rank's
    ``2 (N-1)/N * nbytes`` cross nodes, and a node's ``procs`` ranks each send that much.
    """
    n = layout.nodes
    if n <= 1:
        return 0.0
    return layout.procs * 2.0 * (n - 1) / n * nbytes


def diloco_syncs(first_step: int, steps: int, period: int, delay: int = 0) -> list[int]:
    """Which fragment syncs of torchft's DiLoCo start inside the optimizer steps
    ``first_step .. first_step + steps - 1`` (0-based, counted from the DiLoCo's creation).

    torchft syncs one fragment every ``period = sync_every / fragments`` inner steps; sync ``j``
    (0-based) starts its allreduce ``delay`` steps before it is applied, i.e. right after step
    ``j * period + period - delay - 1``, and is of fragment ``j % fragments`` (every sync
    commits here, so torchft's step counter equals ``j``).
    """
    if period < 1 or not 0 <= delay < period:
        raise ValueError(f"need period >= 1 and 0 <= delay < period, got {period}, {delay}")
    last = first_step + steps - 1
    out, j = [], 0
    while (at := j * period + period - delay - 1) <= last:
        if at >= first_step:
            out.append(j)
        j += 1
    return out


def diloco_inter_bytes(fragment_numel: Sequence[int], layout: Layout, sync_every: int,
                       delay: int = 0, window: tuple[int, int] | None = None) -> float:
    """Bytes per training step one node sends for torchft's (streaming) DiLoCo: every fragment's
    fp32 pseudo-gradient is allreduced once per ``sync_every`` steps on every rail
    (:func:`rail_allreduce_inter_bytes`). With ``window = (first_step, steps)`` the syncs that
    start inside it are counted exactly (:func:`diloco_syncs`), else one round per period."""
    frags = len(fragment_numel)
    if frags < 1 or sync_every % frags:
        raise ValueError(f"sync_every ({sync_every}) must be a multiple of the number of "
                         f"fragments ({frags})")
    if window is None:
        return rail_allreduce_inter_bytes(sum(fragment_numel) * FP32, layout) / sync_every
    first, steps = window
    syncs = diloco_syncs(first, steps, sync_every // frags, delay)
    sent = sum(fragment_numel[j % frags] for j in syncs)
    return rail_allreduce_inter_bytes(sent * FP32, layout) / steps


def expected_inter_bytes(name: str, shapes: Sequence[Sequence[int]], layout: Layout, *,
                         powersgd_rank: int = 4, localsgd_period: int = 8,
                         window: tuple[int, int] | None = None,
                         diloco_sync_every: int = 16, fragment_numel: Sequence[int] | None = None,
                         fragment_delay: int = 0, sharded: bool = False) -> float | None:
    """Bytes per training step one node sends to other nodes, from the algorithm (payload only:
    no TCP/IP or Gloo framing), or None when the algorithm does not fix it (qcomm methods: their
    own stats count what they send).

    ``window = (first_step, steps)``: the optimizer steps measured (0-based); post-local SGD's
    averaging and DiLoCo's syncs then count the rounds inside it exactly, else one per period.
    DiLoCo: ``fragment_numel`` is the parameters of each fragment (one fragment: the whole
    model, the default), ``fragment_delay`` torchft's ``fragment_sync_delay``. ``sharded``: the
    model is sharded by FSDP2 over each node's ranks (``--fsdp``), so each rail carries one
    rank's shard, ``1 / procs`` of the model (FSDP2's padding of uneven shards not counted).
    """
    numel = sum(_prod(s) for s in shapes)
    name, settings = resolve(name)
    if name in S.SHARDED_ONLY:
        # Each rank allreduces its shard of the fp32 gradient with the same rank of every node.
        return rail_allreduce_inter_bytes(numel * FP32 / layout.procs, layout)
    powersgd_rank = settings.get("powersgd_rank", powersgd_rank)
    localsgd_period = settings.get("localsgd_period", localsgd_period)
    diloco_sync_every = settings.get("diloco_sync_every", diloco_sync_every)
    if name in ("torchft-diloco", "torchft-streaming-diloco"):
        frags = list(fragment_numel) if fragment_numel else [numel]
        if sum(frags) != numel:
            raise ValueError(f"fragments hold {sum(frags)} parameters, the model {numel}")
        # Sharded, each rank sends its shard only: a node sends the model once, not procs times.
        copies = layout.procs if sharded else 1
        return diloco_inter_bytes(frags, layout, diloco_sync_every, fragment_delay,
                                  window) / copies
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


def build_ddp(module, cfg: Config) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module)
    return Built(model, module, inner_optimizer(model.parameters(), cfg))


def build_ddp_fp16(module, cfg: Config) -> Built:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module)
    model.register_comm_hook(None, fp16_compress_hook)
    return Built(model, module, inner_optimizer(model.parameters(), cfg))


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
    return Built(model, module, inner_optimizer(model.parameters(), cfg),
                 notes={"powersgd_rank": cfg.powersgd_rank})


def build_hsdp(module, cfg: Config) -> Built:
    """torch's hybrid sharding: FSDP2 over the whole ``(nodes, procs)`` mesh (sharding.py), each
    rank's shard of the gradient allreduced in fp32 with the same rank of every node, every
    step; the nodes' replicas stay identical."""
    S.shard(module, cfg.layout, "mesh")
    return Built(module, module, inner_optimizer(module.parameters(), cfg), sharded=True,
                 notes={"fsdp": "hybrid sharding over the (replicate, shard) mesh"})


def build_localsgd(module, cfg: Config) -> Built:
    """torch's post-local SGD: gradients averaged inside the node every step (the hook's
    subgroup), parameters averaged over all ranks every ``localsgd_period`` steps by the
    hierarchical model averager. With AdamW it is "local AdamW": the same averaging around the
    workload's optimizer (the averager does not care which optimizer stepped)."""
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
    opt = PostLocalSGDOptimizer(optim=inner_optimizer(model.parameters(), cfg), averager=averager)
    return Built(model, module, opt, finalize=lambda: average_all(module),
                 notes={"localsgd_period": cfg.localsgd_period})


def _qcomm_adapter(name: str, module, cfg: Config) -> Built:
    """The one place that knows qcomm's training APIs (qcomm.sgd.ASSGD,
    qcomm.sgd.HierarchicalOptimizer, qcomm.hooks)."""
    opts = qcomm_variant(name)
    if opts is not None and opts.pop("named", False):
        opts["total_steps"] = cfg.total_steps   # the run's length, as users give it
    if opts is not None and opts.pop("kind") == "qcomm-hier":
        bits, ddp = opts.pop("bits"), opts.pop("ddp")
        return _qcomm_hierarchical(module, cfg, bits=bits, ddp=ddp, **opts)
    if opts is not None:
        from qcomm.sgd import ASSGD

        bits, ddp = opts.pop("bits"), opts.pop("ddp")
        comm = {"graph": "ring", "staleness": 1, **opts}
        opt = ASSGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum, bits=bits,
                    procs_per_node=cfg.layout.procs, seed=cfg.seed, **comm)
        # "-ddp": the node's gradient mean by DDP over the node's ranks, during backward;
        # either way the model is attached, so its buffers agree as its parameters do.
        model = opt.data_parallel(module) if ddp else _attached(opt, module)

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
                     close=close, notes={"bits": bits, **comm},
                     node_any=opt.node_any if comm.get("wait_free") else None,
                     live_nodes=lambda: _live_nodes(opt),
                     pace=lambda: _pace(opt))
    if name == "qcomm-hook":
        return _qcomm_hook(module, cfg)
    raise ValueError(f"not a qcomm method: {name!r}")


def _qcomm_hierarchical(module, cfg: Config, bits: int, ddp: bool = False,
                        **comm: Any) -> Built:
    """``HierarchicalOptimizer(<the workload's torch optimizer>, bits=..., ...)``: qcomm's
    communication (intra-node mean, inter-node quantized gossip) around any torch optimizer,
    with ASSGD's settings (ring, staleness 1). Imported here, when the method runs:
    :func:`availability` reports the method as unavailable while qcomm.sgd has no such class."""
    from qcomm.sgd import HierarchicalOptimizer

    comm = {"graph": "ring", "staleness": 1, **comm}
    if cfg.fsdp:
        # FSDP2 over the node's ranks (its reduce-scatter is the node's gradient mean); the
        # optimizer gossips each rank's shards with the same local rank of the other nodes.
        S.shard(module, cfg.layout, "shard")
    opt = HierarchicalOptimizer(inner_optimizer(module.parameters(), cfg), bits=bits,
                                procs_per_node=cfg.layout.procs, seed=cfg.seed, **comm)
    # "-ddp": the node's gradient mean by DDP over the node's ranks, during backward.
    model = opt.data_parallel(module) if ddp else _attached(opt, module)

    def stats() -> dict[str, int]:
        return dict(opt.stats()["bytes_sent"])

    # flush: completes the gossip rounds in flight (collective; the workload calls it on every
    # rank at the same step), so what stats() counted is on the wire when counters are read.
    return Built(model, module, opt, flush=opt.flush, finalize=opt.average_parameters,
                 comm_stats=stats, close=opt.close, notes={"bits": bits, **comm},
                 node_any=opt.node_any if comm.get("wait_free") else None,
                 live_nodes=lambda: _live_nodes(opt),
                 pace=lambda: _pace(opt), sharded=cfg.fsdp)


def _pace(opt) -> dict[str, Any] | None:
    """The wait-free gossip's ``terms_paired`` and ``mix_lag_rounds`` (None in lockstep)."""
    stats = opt.stats()
    if "terms_paired" not in stats:
        return None
    return {"terms_paired": stats["terms_paired"], "mix_lag_rounds": stats["mix_lag_rounds"]}


def _attached(opt, module):
    """``module``, attached to ``opt`` where the optimizer can attach (its buffers then agree
    as its parameters do); a checkout without ``attach`` trains it as it is."""
    attach = getattr(opt, "attach", None)
    return attach(module) if attach is not None else module


def _live_nodes(opt) -> int | None:
    """The nodes a qcomm optimizer still gossips with (``stats()["live_nodes"]``, reported with
    ``on_peer_loss="continue"``), or None where its stats have no such entry."""
    value = opt.stats().get("live_nodes")
    return None if value is None else int(value)


def _qcomm_hook(module, cfg: Config) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qcomm.hooks as hooks

    ddp_kw = {} if cfg.hook_ddp_bucket_mb is None else {"bucket_cap_mb": cfg.hook_ddp_bucket_mb}
    model = DDP(module, **ddp_kw)
    given = {"rounding": cfg.hook_rounding, "bucket_mb": cfg.hook_bucket_mb}
    state = hooks.HierarchicalQuantState(procs_per_node=cfg.layout.procs, bits=cfg.hook_bits,
                                         seed=cfg.seed, rail_collective=cfg.hook_rail,
                                         **{k: v for k, v in given.items() if v is not None})
    model.register_comm_hook(state, hooks.hierarchical_quantized_hook)

    def stats() -> dict[str, int]:
        # state.stats exists from the first hook call on (the warm-up steps make it).
        if state.stats is None:
            return {"intra": 0, "inter": 0}
        return dict(state.stats.snapshot()["bytes_sent"])

    return Built(model, module, inner_optimizer(model.parameters(), cfg), comm_stats=stats,
                 notes={"bits": cfg.hook_bits, "rail": state.rail_collective,
                        "rounding": state.rounding, "bucket_mb": state.bucket_mb,
                        "ddp_bucket_cap_mb": cfg.hook_ddp_bucket_mb})


BUILDERS: dict[str, Callable[[Any, Config], Built]] = {
    "ddp": build_ddp,
    "ddp-fp16": build_ddp_fp16,
    "ddp-powersgd": build_ddp_powersgd,
    "localsgd": build_localsgd,
    "hsdp": build_hsdp,
}


def build(name: str, module, cfg: Config) -> Built:
    """Build method ``name`` around ``module`` (collective: call on every rank)."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {name!r}"
                         f"{near_miss(name)}")
    ok, why = availability(name)
    if not ok:
        raise RuntimeError(f"method {name}: {why}")
    problem = _sharding_problem(name, cfg.fsdp)
    if problem:
        raise ValueError(f"method {name}: {problem}")
    if is_lightning(name):   # resolve() would quietly build the plain loop's method instead
        raise ValueError(f"method {name}: Lightning's Trainer trains it, in "
                         "bench/cluster/lightning_worker.py (compare.py launches that)")
    base, settings = resolve(name)
    if settings:
        cfg = replace(cfg, **settings)
    name = base
    if name in BUILDERS:
        return BUILDERS[name](module, cfg)
    if METHODS[name].family == "torchft":
        from bench.cluster import torchft_methods  # only now: it needs torch and torchft

        return torchft_methods.build(name, module, cfg)
    return _qcomm_adapter(name, module, cfg)


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/methods.py is a library of the cluster benchmark (the compared methods and "
        "their byte formulas), imported by compare.py and workload.py; it runs nothing. See "
        "bench/cluster/README.md."
    )
