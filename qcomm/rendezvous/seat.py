"""A node takes its seat in the job through the rendezvous, and its ranks join the job's world.

Each node runs its own torchrun (``--standalone``: its agent, its store, its restarts are the
node's alone), so a node that dies takes no other node's agent with it. Its ranks call
:func:`init_process_group`, which

1. finds the rendezvous (``rendezvous=`` or ``QCOMM_RENDEZVOUS``, ``HOST:PORT``);
2. seats the node: its local rank 0 claims ``node_id`` when given, else the lowest seat free in
   order of arrival, and tells its other ranks (keyed by the node's torchrun run);
3. waits for every seat of the job to be taken (``timeout_s``), every node's
   ``procs_per_node`` the same;
4. initializes torch.distributed's default group over the rendezvous's store: rank
   ``node * procs_per_node + local_rank`` of ``nodes * procs_per_node``, node-major as qcomm's
   :class:`~qcomm.collectives.topology.Topology` expects.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from qcomm.validation import check_host_port, check_int, check_timeout, env_int
from qcomm.wire.admission import HANDSHAKE_TIMEOUT_S, AdmissionError
from qcomm.wire.token import job_token

from .server import NODES_KEY
from .threads import fit_threads, register_host
from .tunnel import gated, open_tunnel, store_client
from .waiting import wait_keys

__all__ = ["ENV_VAR", "INCARNATION_KEY", "Seat", "claim_incarnation", "connect",
           "init_process_group", "init_torchrun_group", "parse_address"]

ENV_VAR = "QCOMM_RENDEZVOUS"
# How long a node without a token waits for the rendezvous to greet as a gate before it
# connects as torch's client (a plain store says nothing: this is what every start waits).
_PROBE_S = 0.5
INCARNATION_KEY = "qcomm/incarnation/{member}"


def init_torchrun_group(backend: str, timeout: datetime.timedelta) -> None:
    """``torch.distributed.init_process_group`` over the world of one torchrun agent (one node,
    ``--standalone``), fit for its restarts. torch's agent keeps the store it shares with its
    workers across ``--max-restarts``, and its workers' env:// groups take no prefix per
    attempt, so a restarted node of several ranks read its predecessors' Gloo addresses and
    failed to connect (``connectFullMesh ... Connection refused``): each attempt's group keys
    live under its restart count here. Elsewhere (no agent store, or the agents of several
    nodes, whose restart counts need not agree) torch's own env:// as it is."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if not agent_store or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"qcomm/attempt{attempt}/", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def claim_incarnation(store: dist.Store, member: int) -> int:
    """Take ``member``'s seat anew: its incarnation (1 at the first start, one more at each
    restart), which every link to it names."""
    return int(store.add(INCARNATION_KEY.format(member=member), 1))


@dataclass(frozen=True)
class Seat:
    """Where this process sits in the job: its node among ``nodes``, its rank among
    ``world_size`` (node-major), and its node's ``procs_per_node``."""

    node: int
    nodes: int
    rank: int
    world_size: int
    procs_per_node: int


def parse_address(address: object, name: str = "rendezvous") -> tuple[str, int]:
    """``"HOST:PORT"`` as (host, port).

    Raises:
        ValueError: not of that form, naming ``name``.
    """
    return check_host_port(name, address, "the address python -m qcomm.rendezvous listens on")


def run_base() -> str | None:
    """What a torchrun run keeps across its restarts (its id, host and agent store); None
    without torchrun."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    return "/".join([socket.gethostname(), run, os.environ.get("MASTER_ADDR", ""),
                     os.environ.get("MASTER_PORT", "")])


def _node_token(procs_per_node: int) -> str:
    """What the ranks of one node share and no other node has: its torchrun run (id, agent
    store, host, restart). A lone process without torchrun is a node of its own."""
    base = run_base()
    if base is None:
        if procs_per_node > 1:
            raise RuntimeError(f"LOCAL_WORLD_SIZE is {procs_per_node} but this process was not "
                               "started by torchrun: start each node with its own torchrun")
        return f"lone/{uuid.uuid4()}"
    return f"{base}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _claim(store: dist.Store, nodes: int, token: str, node_id: int | None) -> int:
    """Seat this node: ``node_id``, or the lowest free seat. Raises ValueError when that seat
    is taken or none is free."""
    wanted = [node_id] if node_id is not None else range(nodes)
    for seat in wanted:
        if store.compare_set(f"qcomm/seat/{seat}", "", token).decode() == token:
            return seat
    if node_id is not None:
        raise ValueError(f"node_id {node_id} is taken by another node of this job")
    raise ValueError(f"every seat of this job's {nodes} nodes is taken (the rendezvous was "
                     f"started with --nodes {nodes}); a node cannot join a running job")



def connect(rendezvous: str | None, timeout_s: float, caller: str, token: bytes | None = None
            ) -> tuple[str, dist.Store, int, int]:
    """What every way of starting a node does first: the rendezvous's address (``rendezvous``,
    else ``QCOMM_RENDEZVOUS``) checked, torch.distributed not initialized yet, the node's size
    and this rank's place in it (torchrun's ``LOCAL_*``), a connection to the rendezvous:
    with the job ``token``, through this process's tunnel to it (:mod:`.tunnel`; every later
    store connection to it goes through the same).

    Returns:
        (its ``"HOST:PORT"``, store, procs_per_node, local_rank).

    Raises:
        ValueError: a bad address, argument or environment variable (named); TimeoutError:
            no rendezvous within ``timeout_s``; RuntimeError: torch.distributed initialized
            already (``caller``, the function to call in its place, is named);
        AdmissionError: the rendezvous refused ``token``, or admits only a token's holders
            and this process has none (or the other way round).
    """
    address = rendezvous if rendezvous is not None else os.environ.get(ENV_VAR)
    if address is None:
        raise ValueError(f"rendezvous is not given and {ENV_VAR} is not set: name the "
                         "rendezvous (python -m qcomm.rendezvous) as 'HOST:PORT'")
    host, port = parse_address(address, "rendezvous" if rendezvous is not None else ENV_VAR)
    timeout_s = check_timeout(timeout_s)
    if dist.is_initialized():
        raise RuntimeError(f"torch.distributed is initialized already: call "
                           f"qcomm.rendezvous.{caller} instead of "
                           "torch.distributed.init_process_group, not after it")
    ppn = env_int("LOCAL_WORLD_SIZE", 1) or 1
    local_rank = env_int("LOCAL_RANK", 0) or 0
    if local_rank >= ppn:
        raise ValueError(f"LOCAL_RANK {local_rank} must be below LOCAL_WORLD_SIZE {ppn}")
    gate = AdmissionError(f"the rendezvous at {host}:{port} admits only the holders of the job "
                          "token: set QCOMM_TOKEN (the same as the rendezvous's)")
    try:
        if token is not None:
            open_tunnel(host, port, token, timeout_s)
        elif gated(host, port, _PROBE_S):
            raise gate
        store = store_client(host, port, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        if isinstance(e, AdmissionError):
            raise
        if token is None and gated(host, port, HANDSHAKE_TIMEOUT_S):   # a slow gate
            raise gate from None
        raise TimeoutError(f"no rendezvous at {host}:{port} within {timeout_s:g} s ({e}); "
                           "start it first: python -m qcomm.rendezvous") from e
    return f"{host}:{port}", store, ppn, local_rank

def init_process_group(rendezvous: str | None = None, *, backend: str = "gloo",
                       node_id: int | None = None, timeout_s: float = 300.0) -> Seat:
    """Seat this node through the rendezvous and initialize torch.distributed's default group
    over the whole job (module docstring). Call it on every rank of every node, instead of
    ``torch.distributed.init_process_group``.

    Args:
        rendezvous: ``"HOST:PORT"`` of ``python -m qcomm.rendezvous``; None reads
            ``QCOMM_RENDEZVOUS``.
        backend: torch.distributed's backend (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...).
        node_id: this node's seat, 0 <= node_id < nodes; None: the lowest free one, in order of
            arrival. Every rank of a node passes the same.
        timeout_s: the longest wait, for the rendezvous and for the other nodes; also the
            default group's timeout.

    Returns:
        this process's :class:`Seat`.

    Raises:
        ValueError: a bad argument or environment variable (named), a seat taken, nodes whose
            ``procs_per_node`` differ; TimeoutError: the rendezvous or a node did not come
            within ``timeout_s``; RuntimeError: torch.distributed already initialized.
    """
    address, store, ppn, local_rank = connect(rendezvous, timeout_s, "init_process_group",
                                              job_token(None))
    timeout = datetime.timedelta(seconds=timeout_s)
    nodes = int(store.get(NODES_KEY))
    if node_id is not None:
        node_id = check_int("node_id", node_id, low=0, high=nodes, high_open=True)
    token = _node_token(ppn)
    if local_rank == 0:
        node = _claim(store, nodes, token, node_id)
        register_host(store, node, ppn)
        store.set(f"qcomm/node_of/{token}", str(node))
        store.set(f"qcomm/ppn/{node}", str(ppn))
    else:
        node = int(_wait_get(store, f"qcomm/node_of/{token}", timeout, "local rank 0 of "
                             "this node to take its seat", address))
    # every node's seat: the wait says every few seconds which are still missing
    seats = {f"qcomm/ppn/{n}": f"node {n} of {nodes} to take its seat" for n in range(nodes)}
    wait_keys(store, seats, timeout_s, address, who=f"node {node}")
    others = {n: int(store.get(f"qcomm/ppn/{n}")) for n in range(nodes)}
    if len(set(others.values())) != 1:
        raise ValueError(f"every node must run the same number of processes, but "
                         f"procs_per_node by node = {others}")
    fit_threads(store, nodes, node)   # every node has arrived: all those on this machine
    rank = node * ppn + local_rank
    dist.init_process_group(backend, store=dist.PrefixStore("qcomm/world/", store), rank=rank,
                            world_size=nodes * ppn, timeout=timeout)
    return Seat(node, nodes, rank, nodes * ppn, ppn)


def _wait_get(store: dist.Store, key: str, timeout: datetime.timedelta, what: str,
              address: str) -> bytes:
    """``key``'s value once set (what it stands for, ``what``, is logged while it is not)."""
    wait_keys(store, {key: what}, timeout.total_seconds(), address)
    return store.get(key)
