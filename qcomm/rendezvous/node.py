"""A node whose links to the other nodes are made through the rendezvous, so that it can leave and
come back while the job runs.

:func:`init_node` is the call for a job where each node runs its own torchrun and a node that
dies is restarted on its own (by its torchrun's ``--max-restarts``, or by hand) and rejoins the
running job. torch.distributed's default group is *the node*: its torchrun's world. Between
nodes nothing is a process group fixed at the start: each link of the wait-free gossip is a
group of two made when the link opens (:class:`~qcomm.collectives.gloo.pair_group.PairGroup`), so a
restarted node links to the running ones with new groups. The node's seat:

1. ``node_id`` when given;
2. else the seat this torchrun run held before (a torchrun restart takes its seat back);
3. else the lowest seat never taken, in order of arrival: the job starts with the rendezvous's
   ``--nodes`` and may grow to its ``--max-nodes``.

Taking a seat claims its next *incarnation*: 1 at its first start, more for a node that comes
back. A node that comes back, or takes a seat beyond ``--nodes``, joins the running job from a
neighbour's state (:mod:`qcomm.engine.joins`); until then the others link past its seat.
The optimizers see the seat (:func:`linked_seat`) and build their topology over it
(:class:`~qcomm.collectives.linked_world.LinkedWorld`): ranks ``node * procs_per_node +
local_rank`` of ``nodes * procs_per_node``, as under one torchrun for the whole job.
"""

from __future__ import annotations

import datetime
import hmac
import os
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from qcomm.validation import check_int, check_timeout, env_int
from qcomm.wire.token import job_token

from .heartbeat import start_heartbeat
from .refusals import RefusedError, refusal_of_this_run
from .seat import (
    _node_token,
    _wait_get,
    claim_incarnation,
    connect,
    init_torchrun_group,
    parse_address,
    run_base,
)
from .server import MAX_NODES_KEY, NODES_KEY
from .threads import fit_threads, register_host
from .tunnel import store_client

__all__ = ["LinkedSeat", "init_node", "linked_seat", "listen_of", "with_options"]

_PREFIX = "qcomm/linked/"
_seat: LinkedSeat | None = None   # this process's seat, once init_node() took it
_seat_group: object = None         # the default group init_node() made with it


@dataclass(frozen=True)
class LinkedSeat:
    """Where this process sits in a job of linked nodes: its node among the ``nodes`` seats
    (the job starts with the first ``starting``, the others are taken by nodes that start
    later), that node's ``incarnation`` (1 at its first start, more when it came back), its
    rank among ``world_size`` (node-major), its node's ``procs_per_node``, the rendezvous
    (``"HOST:PORT"``), the longest wait ``timeout_s`` and the start bound ``join_timeout_s``
    (how long a link waits for a peer that starts and beats); ``listen``, the ``"HOST:PORT"``
    this process accepts its links to other nodes on (None: the links are Gloo's, unless a
    ``token`` is set: then they dial out), and the job ``token`` (None: none; never shown in
    the seat's repr)."""

    node: int
    nodes: int
    rank: int
    world_size: int
    procs_per_node: int
    incarnation: int
    rendezvous: str
    timeout_s: float
    starting: int
    listen: str | None = None
    token: str | None = field(default=None, repr=False)
    join_timeout_s: float = 600.0

    @property
    def local_rank(self) -> int:
        return self.rank % self.procs_per_node

    @property
    def joining(self) -> bool:
        """Whether this node joins a running job (it starts from a neighbour's state): it came
        back, or its seat is beyond the nodes the job started with."""
        return self.incarnation > 1 or self.node >= self.starting

    def store(self) -> dist.Store:
        """A new connection to the rendezvous."""
        host, port = parse_address(self.rendezvous)
        return store_client(host, port, datetime.timedelta(seconds=self.timeout_s))


def linked_seat() -> LinkedSeat | None:
    """This process's seat when :func:`init_node` took one and the default group is still
    the one it made, else None."""
    if _seat is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return _seat if dist.group.WORLD is _seat_group else None


def _take(store: dist.Store, nodes: int, token: str, node_id: int | None) -> int:
    """The seat of this node (module docstring). Raises ValueError when none is free."""
    if node_id is not None:
        store.set(f"{_PREFIX}seat/{node_id}", token)
        return node_id
    base = run_base()
    if base is not None and store.check([f"{_PREFIX}run/{base}"]):
        seat = int(store.get(f"{_PREFIX}run/{base}"))
        store.set(f"{_PREFIX}seat/{seat}", token)
        return seat
    for seat in range(nodes):
        if store.compare_set(f"{_PREFIX}seat/{seat}", "", token).decode() == token:
            if base is not None:
                store.set(f"{_PREFIX}run/{base}", str(seat))
            return seat
    raise ValueError(f"every seat of this job's {nodes} nodes has been taken (the rendezvous's "
                     "--max-nodes): a node that comes "
                     "back after a loss names the seat it takes back with node_id= (or is "
                     "restarted by its own torchrun, which keeps its seat)")


def listen_of(listen: str | None, local_rank: int) -> str | None:
    """Where this process accepts its links: ``listen`` (else ``QCOMM_LISTEN``), its port
    moved up by the local rank (each process of a node has a port of its own: PORT to
    PORT + procs_per_node - 1; port 0 stays 0, the system picks); None when neither is set.

    Raises:
        ValueError: not ``"HOST:PORT"``, naming where it came from.
    """
    where = "listen"
    if listen is None:
        listen, where = os.environ.get("QCOMM_LISTEN") or None, "QCOMM_LISTEN"
    if listen is None:
        return None
    host, _, port = listen.rpartition(":") if isinstance(listen, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 <= int(port) + local_rank <= 65535:
        raise ValueError(f"{where} must be 'HOST:PORT', the address this node accepts its "
                         f"links on, got {listen!r}")
    return f"{host}:{int(port) + local_rank if int(port) else 0}"


def with_options(seat: LinkedSeat, listen: str | None, token: str | None) -> LinkedSeat:
    """``seat`` with the optimizer's ``listen`` and ``token`` (CommOptions') where they are
    set: ``listen`` moved up by the local rank as :func:`listen_of` does.

    Raises:
        ValueError: ``token`` is not the one the seat was taken with (the rendezvous is
            reached with that one), without showing either.
    """
    changes: dict[str, str | None] = {}
    if listen is not None:
        changes["listen"] = listen_of(listen, seat.local_rank)
    if token is not None:
        if seat.token is not None and not hmac.compare_digest(seat.token.encode(),
                                                              token.encode()):
            raise ValueError("token (the optimizer's) is not the job token init_node took "
                             "(its token= or QCOMM_TOKEN), with which this node reached the "
                             "rendezvous: pass the same one, or set it in one place")
        changes["token"] = token
    return replace(seat, **changes) if changes else seat


def _node_seat(store: dist.Store, nodes: int, ppn: int, local_rank: int,
               node_id: int | None, timeout: datetime.timedelta, address: str
               ) -> tuple[int, int]:
    """The node's seat and incarnation: taken by its local rank 0, read by the others."""
    run = _node_token(ppn)
    key = f"{_PREFIX}node_of/{run}"
    if local_rank == 0:
        node = _take(store, nodes, run, node_id)
        incarnation = claim_incarnation(store, node)
        register_host(store, node, ppn)
        store.set(key, f"{node}:{incarnation}")
        return node, incarnation
    node, incarnation = (int(v) for v in _wait_get(
        store, key, timeout, "local rank 0 of this node to take its seat",
        address).decode().split(":"))
    return node, incarnation


def init_node(rendezvous: str | None = None, *, backend: str = "gloo",
              node_id: int | None = None, timeout_s: float = 300.0,
              join_timeout_s: float = 600.0, listen: str | None = None,
              token: str | None = None) -> LinkedSeat:
    """Initialize torch.distributed over this node's ranks (its torchrun's world), take the
    node's seat through the rendezvous, and make the optimizers link to the other nodes
    through it (module docstring). Call it on every rank of every node instead of
    ``torch.distributed.init_process_group``; the optimizers need ``wait_free=True`` and
    ``on_peer_loss="continue"`` (``SLOW_LINK`` with those).

    Args:
        rendezvous: ``"HOST:PORT"`` of ``python -m qcomm.rendezvous``; None reads
            ``QCOMM_RENDEZVOUS``.
        backend: torch.distributed's backend for the node's group (``"gloo"``,
            ``"cpu:gloo,cuda:nccl"``, ...); the links between nodes are Gloo.
        node_id: the seat, 0 <= node_id < nodes; None: the one this torchrun run held, else
            the lowest never taken. Every rank of a node passes the same.
        timeout_s: the longest silence: of the rendezvous, of this node's first rank, of a
            joiner's state, of a link's other end once it started (its beat at the
            rendezvous, :mod:`.heartbeat`); also the node group's timeout.
        join_timeout_s: the start bound (torchrun's ``join_timeout`` has the same 600 s): how
            long a link waits for the other node's first start and, while that node beats,
            for it to open the link. A node slow to start (torch's import on a loaded
            machine) is waited for, saying so every few seconds, however short
            ``timeout_s`` is; one that died before it opened the link is given up after
            ``timeout_s``.
        listen: ``"HOST:PORT"`` this node accepts its links to the other nodes on, one TCP
            connection per link (:mod:`qcomm.collectives.sockets`; local rank r takes PORT +
            r); None reads ``QCOMM_LISTEN``. Without it (and without a token) the links are
            Gloo's, which need every port open between the nodes.
        token: the job token every link proves it holds (at least 16 characters); None
            reads ``QCOMM_TOKEN``. With one, the links are TCP ones even without ``listen``
            (this node then dials all its links: its peers listen), and the rendezvous is
            reached through an admitted, encrypted connection (:mod:`.tunnel`).

    Returns:
        this process's :class:`LinkedSeat`.

    Raises:
        RefusedError: this torchrun run was refused by the job before (its options or model
        differ; a restart runs the same), raised before taking a seat;
        ValueError: a bad argument or environment variable (named), no seat free;
        AdmissionError: the rendezvous refused this node's token (or its lack of one);
        TimeoutError: the rendezvous or this node's first rank did not answer within
        ``timeout_s``; RuntimeError: torch.distributed initialized already.
    """
    global _seat, _seat_group
    join_timeout_s = check_timeout(join_timeout_s, "join_timeout_s")
    secret = job_token(token)   # named error for a short one, before any connection
    token = None if secret is None else secret.decode()
    listen = listen_of(listen, env_int("LOCAL_RANK", 0) or 0)
    address, store, ppn, local_rank = connect(rendezvous, timeout_s, "init_node", secret)
    refused = refusal_of_this_run(store)
    if refused is not None:   # before the seat: a restart that cannot be admitted takes none
        raise RefusedError(f"{refused} (this torchrun run was refused by the job before, and "
                           "its restarts run the same options: start a new torchrun with the "
                           "job's)")
    timeout = datetime.timedelta(seconds=timeout_s)
    starting = int(store.get(NODES_KEY))
    nodes = int(store.get(MAX_NODES_KEY)) if store.check([MAX_NODES_KEY]) else starting
    if node_id is not None:
        node_id = check_int("node_id", node_id, low=0, high=nodes, high_open=True)
    node, incarnation = _node_seat(store, nodes, ppn, local_rank, node_id, timeout, address)
    fit_threads(store, nodes, node)   # other nodes of the job on this machine: share its cores
    if ppn == 1 and "MASTER_ADDR" not in os.environ:
        # A lone process (no torchrun): its node group is itself, over a store of its own.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        init_torchrun_group(backend, timeout)
    _seat_group = dist.group.WORLD
    seat = LinkedSeat(node, nodes, node * ppn + local_rank, nodes * ppn, ppn, incarnation,
                      address, timeout_s, starting, listen, token, join_timeout_s)
    host, port = parse_address(address)
    start_heartbeat(host, port, seat.rank, incarnation, timeout_s)
    _seat = seat
    return _seat

