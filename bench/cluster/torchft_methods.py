"""torchft's DiLoCo and streaming DiLoCo as benchmark methods (the real ``torchft`` package).

Set up as torchft's documentation does, with one replica group per emulated node:

- one lighthouse (``torchft._torchft.LighthouseServer``, what the ``torchft_lighthouse``
  command runs), started by global rank 0 in node 0, ``min_replicas`` = the number of nodes;
- per node a TCPStore (local rank 0 owns it) and, on every rank of the node, a
  ``Manager(pg=ProcessGroupGloo(...), use_async_quorum=False, min_replica_size=nodes,
  replica_id="qcb_node<k>", rank=local_rank, world_size=procs, store_addr/port,
  lighthouse_addr)``;
- ``DiLoCo(manager, fragments, inner_opt, outer_opts, sync_every=H, ...)`` entered as a
  context manager around the training loop (workload.py enters ``Built.context``).

Inside a node the ranks average gradients every step with torch DDP over a node-local process
group (the replica group trains as one data-parallel replica). Between nodes torchft gives each
group rank its own process group: group rank r of every node forms one Gloo ring ("rail"). With
a replicated model inside the node (DDP), every rank therefore allreduces the *whole*
pseudo-gradient on its rail: a node with P ranks sends P identical copies. torchft's intended
multi-rank replica group is sharded (FSDP/HSDP, as in torchtitan), where each rank sends its
shard only: that is the ``--fsdp`` form (sharding.py: FSDP2 over the node's ranks instead of
DDP). The byte formula (methods.diloco_inter_bytes) counts what each setup sends.

Outer optimizer as in the DiLoCo papers: SGD lr 0.7, momentum 0.9, Nesterov (one per fragment).
The streaming form cuts the model into ``streaming_fragments`` contiguous fragments of about
equal size (:func:`split_fragments`); torchft syncs one of them every ``H / fragments`` steps,
its allreduce overlapping ``fragment_sync_delay`` inner steps. ``should_quantize=False``:
torchft's quantized allreduce needs CUDA (Triton kernels).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):
    # Run by path (it says it is a library): the repository root first on sys.path, so that
    # `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import sharding as S
from bench.cluster import training as T

OUTER_NESTEROV = True


def node_address() -> str:
    """The address this node reaches the master from (the kernel's source address for
    MASTER_ADDR; in the emulated cluster, the node's qceth0 address). A UDP connect sends no
    packet."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        return s.getsockname()[0]


def fragment_units(module: nn.Module) -> list[nn.Module]:
    """The model's layers in order, the smallest pieces a fragment is made of: children that
    hold parameters, with Sequential / ModuleList containers opened one level at a time."""
    units: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, nn.Sequential | nn.ModuleList):
            units += fragment_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def partition(sizes: list[int], count: int) -> list[int]:
    """Cut ``sizes`` into ``count`` non-empty contiguous groups with the smallest possible
    largest group (linear partition, dynamic programming); returns each group's length.

    Raises:
        ValueError: ``count`` < 1 or more than ``len(sizes)``.
    """
    n = len(sizes)
    if not 1 <= count <= n:
        raise ValueError(f"fragments must be in [1, {n}] (the model has {n} layers with "
                         f"parameters), got {count}")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest largest-group over the first i sizes cut into k groups
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    lengths, i = [], n
    for k in range(count, 0, -1):
        j = cut[k][i]
        lengths.append(i - j)
        i = j
    return lengths[::-1]


def split_fragments(module: nn.Module, count: int) -> list[nn.Module]:
    """``module`` as ``count`` contiguous fragments (ModuleLists of its layers) of about equal
    parameter count, together holding every parameter exactly once.

    Raises:
        ValueError: ``count`` out of range, or parameters outside the layers found.
    """
    units = fragment_units(module)
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    total = sum(p.numel() for p in module.parameters())
    if sum(sizes) != total:
        raise ValueError(f"{type(module).__name__} holds {total} parameters, its layers "
                         f"{sum(sizes)}: some sit outside a layer or are shared")
    out, start = [], 0
    for length in partition(sizes, count):
        out.append(nn.ModuleList(units[start:start + length]))
        start += length
    return out


@dataclass
class Replicas:
    """torchft's side of a run: the node's manager (one replica group per node), what keeps its
    servers alive (the lighthouse on rank 0, the node's store on its local rank 0), and the
    node's own process group (for DDP inside the node)."""

    manager: Any
    lighthouse: Any
    store: Any
    subgroup: Any

    def close(self) -> None:
        # Also what keeps the node's TCPStore alive until the end: a store dropped when build()
        # returns takes the server down while the node's other ranks still use it.
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.store = None


def replica_groups(cfg: T.Config) -> Replicas:
    """One lighthouse, one store per node and a Manager on every rank, as torchft's
    documentation sets them up (collective: every rank)."""
    from torchft._torchft import LighthouseServer

    layout = cfg.layout
    rank = dist.get_rank()
    node, local = divmod(rank, layout.procs)
    timeout = timedelta(seconds=cfg.pg_timeout)

    # Intra-node group for DDP (collective: every rank creates every node's group).
    subgroup, _ = dist.new_subgroups(group_size=layout.procs)
    addr = node_address()

    lighthouse = None
    box: list[Any] = [None]
    if rank == 0:
        # join_timeout only matters while not every heartbeating replica has joined a quorum;
        # all nodes start together, so it never delays a round here.
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=layout.nodes,
                                      join_timeout_ms=60_000, quorum_tick_ms=100)
        box = [f"http://{addr}:{lighthouse.address().rsplit(':', 1)[1]}"]
    dist.broadcast_object_list(box, src=0)
    manager, store = _node_manager(layout, node, local, addr, box[0], timeout,
                                   min_replicas=layout.nodes, quorum_timeout=timeout,
                                   src=node * layout.procs, group=subgroup)
    return Replicas(manager, lighthouse, store, subgroup)


def _node_manager(layout: T.Layout, node: int, local: int, addr: str, lighthouse_addr: str,
                  timeout: timedelta, *, min_replicas: int, quorum_timeout: timedelta, src: int,
                  group: Any, **extra: Any) -> tuple[Any, Any]:
    """The node's replica group: its store (local rank 0 serves it on ``addr``; its port is
    broadcast from global rank ``src`` over the node's ``group``) and this rank's Manager
    (``extra``: more of the Manager's arguments). Returns (manager, store or None)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    # The replica group's store: torchft's Manager keeps its own keys there, and the quorum
    # hands the primary's store address to every group for the cross-node process groups, so
    # it must listen on the node's routable address.
    store, box = None, [None]
    if local == 0:
        store = TCPStore(host_name=addr, port=0, is_master=True, wait_for_workers=False)
        box = [store.port]
    dist.broadcast_object_list(box, src=src, group=group)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
        min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
        quorum_timeout=quorum_timeout, connect_timeout=timeout, rank=local,
        world_size=layout.procs, store_addr=addr, store_port=box[0],
        lighthouse_addr=lighthouse_addr, replica_id=f"qcb_node{node}", hostname=addr,
        # Every rank starts from the same seeded weights: no checkpoint transfer at step 0 (a
        # group that comes back later heals, where the manager allows it).
        init_sync=False, **extra)
    return manager, store


def _wait_until(done: Any, timeout_s: float, what: str) -> None:
    """Poll ``done()`` every 50 ms until it holds.

    Raises:
        TimeoutError: ``what`` (a sentence) did not happen within ``timeout_s``.
    """
    import time

    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(0.05)


# How fast a healing job notices a lost replica group and how long one of its collectives may
# wait, seconds: an operator who expects machines to come and go tunes these down from the
# defaults (the elastic peers' rendezvous drops a dead agent after 3 s, too).
HEAL_HEARTBEAT_TIMEOUT_S = 2.0
HEAL_TIMEOUT_S = 10.0
# A quorum waits longer than a collective: the groups left after a loss may still be inside the
# collective the lost group broke (up to HEAL_TIMEOUT_S), and a group that asked for the next
# quorum first must not time out meanwhile (torchft raises then, and the group's process ends).
HEAL_QUORUM_TIMEOUT_S = 3 * HEAL_TIMEOUT_S


def healing_replicas(cfg: T.Config, node: int, lighthouse_file: Path,
                     ready: Path | None = None) -> Replicas:
    """torchft set up to heal a replica group that comes back, for nodes that each run their
    own torchrun (the default group is the node): the lighthouse on node 0's local rank 0,
    published in ``lighthouse_file`` (the nodes share a file system), a quorum of at least
    ``nodes - 1`` groups (one may be lost), and a Manager whose state (registered by
    :func:`build_diloco`) a returning group fetches from a live one at its first quorum.
    ``ready`` (the job's start): a folder where each node says its Manager is up, waited for
    until every node has: the first quorum then has every group (a quorum of ``nodes - 1``
    would otherwise form without a group still starting, which then trains out of step).

    Raises:
        TimeoutError: no lighthouse was published within ``cfg.pg_timeout``.
    """
    import json

    from torchft._torchft import LighthouseServer

    layout = cfg.layout
    local = dist.get_rank()
    timeout = timedelta(seconds=min(cfg.pg_timeout, HEAL_TIMEOUT_S))
    # The node's routable address: the source address towards the job's rendezvous host.
    host = os.environ["QCOMM_RENDEZVOUS"].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        addr = sock.getsockname()[0]
    lighthouse = None
    if node == 0 and local == 0:
        lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=max(1, layout.nodes - 1), join_timeout_ms=60_000,
            quorum_tick_ms=100, heartbeat_timeout_ms=int(HEAL_HEARTBEAT_TIMEOUT_S * 1000))
        tmp = lighthouse_file.with_name(f"{lighthouse_file.name}.tmp")
        tmp.write_text(json.dumps(
            {"addr": f"http://{addr}:{lighthouse.address().rsplit(':', 1)[1]}"}))
        tmp.replace(lighthouse_file)
    _wait_until(lighthouse_file.exists, cfg.pg_timeout,
                f"no lighthouse published in {lighthouse_file}")
    manager, store = _node_manager(
        layout, node, local, addr, json.loads(lighthouse_file.read_text())["addr"], timeout,
        min_replicas=max(1, layout.nodes - 1),
        quorum_timeout=timedelta(seconds=max(timeout.total_seconds(), HEAL_QUORUM_TIMEOUT_S)),
        src=0, group=dist.group.WORLD,
        checkpoint_transport=_routable_http_transport(addr, timeout))
    if ready is not None:
        if local == 0:
            ready.mkdir(parents=True, exist_ok=True)
            (ready / f"n{node}").touch()
        _wait_until(lambda: len(list(ready.glob("n*"))) >= layout.nodes, cfg.pg_timeout,
                    f"not every node's Manager was up ({ready})")
    return Replicas(manager, lighthouse, store, dist.group.WORLD)


def _routable_http_transport(addr: str, timeout: timedelta) -> Any:
    """torchft's default checkpoint transport (HTTP), naming the node by ``addr``: it names the
    host by ``socket.gethostname()``, which in the emulated nodes' namespaces resolves to
    loopback, so a group that comes back could not fetch its state from another node."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class RoutableHTTPTransport(HTTPTransport):
        def address(self) -> str:
            return super().address().replace(f"//{socket.gethostname()}:", f"//{addr}:", 1)

    return RoutableHTTPTransport(timeout=timeout, num_chunks=0)


def build(name: str, module: nn.Module, cfg: T.Config) -> T.Built:
    """torchft-diloco, torchft-streaming-diloco or torchft-hsdp around ``module`` (collective:
    every rank)."""
    if name == "torchft-hsdp":
        return build_hsdp(module, cfg)
    return build_diloco(name, module, cfg)


def build_hsdp(module: nn.Module, cfg: T.Config) -> T.Built:
    """torchft's fault-tolerant HSDP (``--fsdp`` only), as torchtitan wires it: FSDP2 over the
    node's ranks, each FSDP module's all-reduce hook averaging its reduce-scattered gradient
    shard over the nodes through the manager (every step, fp32), and torchft's
    ``OptimizerWrapper`` (a quorum at ``zero_grad``, the step taken only if the manager
    commits)."""
    from torch.distributed.fsdp import FSDPModule
    from torchft.optim import OptimizerWrapper

    if not cfg.fsdp:
        raise ValueError("torchft-hsdp shards the model: run it with --fsdp")
    groups = replica_groups(cfg)
    S.shard(module, cfg.layout, "shard")

    def all_reduce(shard: torch.Tensor) -> None:
        groups.manager.allreduce(shard).wait()

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce)
    opt = OptimizerWrapper(groups.manager, T.inner_optimizer(module.parameters(), cfg))
    groups.manager.start_quorum()   # the cross-node groups' connections, in the set-up
    return T.Built(module, module, opt, close=groups.close, sharded=True,
                   notes={"fsdp": "FSDP2 over the node, gradient shards allreduced between "
                                  "nodes by torchft's manager", "torchft": torchft_version()})


def build_diloco(name: str, module: nn.Module, cfg: T.Config,
                 groups: Replicas | None = None, quorum_now: bool = True) -> T.Built:
    """torchft-diloco or torchft-streaming-diloco around ``module`` (collective: every rank).
    ``groups``: torchft's side made already (:func:`healing_replicas`: the model and the inner
    optimizer's state are then registered with the manager, which a group that comes back
    fetches); else :func:`replica_groups`. ``quorum_now``: take the first quorum in the set-up
    (a group that comes back takes it where DiLoCo does, at its first sync: the running groups
    ask for theirs at their syncs, and a quorum taken earlier would put it one sync off)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchft.local_sgd import DiLoCo

    layout = cfg.layout
    streaming = name == "torchft-streaming-diloco"
    heals = groups is not None
    groups = groups or replica_groups(cfg)
    manager = groups.manager
    rails = None
    if cfg.fsdp:
        # FSDP2 over the node's ranks (torchtitan's layout): each rank's manager allreduces its
        # local shards of the pseudo-gradient on its rail. Its finalize averages shards on the
        # rails' own groups, made now (collective) rather than in the teardown.
        model = S.shard(module, layout, "shard")
        rails = S.rail_groups(layout)
    else:
        model = DDP(module, process_group=groups.subgroup) if layout.procs > 1 else module
    inner = T.inner_optimizer(module.parameters(), cfg)
    if heals:
        manager.register_state_dict_fn(
            "default",
            lambda st: (module.load_state_dict(st["model"]), inner.load_state_dict(st["optim"])),
            lambda: {"model": module.state_dict(), "optim": inner.state_dict()})
    frags = split_fragments(module, cfg.streaming_fragments) if streaming else [module]
    # Nesterov needs momentum: with outer momentum 0 the outer step is plain SGD (lr 1.0 and
    # momentum 0 is local SGD's averaging).
    outer = [torch.optim.SGD(f.parameters(), lr=cfg.diloco_outer_lr,
                             momentum=cfg.diloco_outer_momentum,
                             nesterov=OUTER_NESTEROV and cfg.diloco_outer_momentum > 0)
             for f in frags]
    delay = cfg.streaming_delay if streaming else 0
    diloco = DiLoCo(manager, frags, inner, outer, sync_every=cfg.diloco_sync_every,
                    backup_device=torch.device("cpu"), pin_memory=False,
                    should_quantize=False, fragment_sync_delay=delay)
    # The first quorum configures the cross-node process groups (TCP connections); do it now,
    # in the untimed set-up, as the other methods' first collective happens in the warm-up.
    if quorum_now:
        manager.start_quorum()

    def flush() -> None:
        # Complete a fragment allreduce in flight (started `delay` steps before it is applied)
        # so that its bytes are on the wire before the interface counters are read. Only waits
        # for the transfer; DiLoCo applies it at its usual step. torchft has no public call for
        # this, hence the private attributes.
        for frag in getattr(diloco, "_fragments", []):
            for work in list(getattr(frag, "_allreduce_work", [])):
                work.wait()

    def finalize() -> None:
        if rails is not None:
            S.average_rails(module, layout, rails)
        else:
            T.average_all(module)

    numel = [sum(p.numel() for p in f.parameters()) for f in frags]
    intra = "FSDP2" if cfg.fsdp else ("DDP" if layout.procs > 1 else "none (1 rank)")
    return T.Built(model, module, inner, flush=flush, finalize=finalize,
                   close=groups.close, context=diloco, sharded=cfg.fsdp,
                   notes={"sync_every": cfg.diloco_sync_every, "fragments": len(frags),
                          "fragment_numel": numel, "fragment_sync_delay": delay,
                          "outer": f"SGD lr {cfg.diloco_outer_lr} momentum "
                                   f"{cfg.diloco_outer_momentum} nesterov",
                          "should_quantize": False, "torchft": torchft_version(),
                          "intra_node": intra})


def torchft_version() -> str:
    from importlib.metadata import version

    return version("torchft")


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/torchft_methods.py is a library of the cluster benchmark (torchft's DiLoCo "
        "methods), imported by methods.py when such a method runs; it runs nothing. See "
        "bench/cluster/README.md."
    )
