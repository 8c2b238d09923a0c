"""A gossip group whose links are process groups of two, made over the job's rendezvous: what
lets a process that was not there when the job started (a node restarted after a loss) link to
the running ones.

A ``torch.distributed`` process group is fixed when it is made, so a newcomer cannot enter the
group the others built. Here each link between two members is a Gloo group of its own, made when
the link opens (by both ends, over a ``PrefixStore`` of the rendezvous's store) and aborted when
it is dropped: the receives its streams had posted ahead go with it, and nothing of an old link
is left (threads, sockets, file descriptors). Its key names both ends with their *incarnation*
(how many times the member's seat was taken: a restarted member is a new peer) and how many
links the pair opened before, which both ends count alike (they open and drop their links to
each other together).

Only the wait-free gossip's streams run on it; every collective raises (the members that a
collective would wait for change while it runs: the gossip sums along its ring instead).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist

from qcomm.rendezvous.heartbeat import PulseWatch
from qcomm.rendezvous.refusals import refusal_of_member
from qcomm.rendezvous.seat import INCARNATION_KEY, claim_incarnation
from qcomm.rendezvous.shared_client import SharedClient
from qcomm.rendezvous.waiting import wait_keys
from qcomm.validation import check_int, check_timeout

from ..group import CommGroup, Work
from ..links import MessageStreams
from .streams import GlooStreams

__all__ = ["INCARNATION_KEY", "PairChannel", "PairGroup", "claim_incarnation",
           "open_pair_channel"]

log = logging.getLogger(__name__)


def gloo_devices() -> list:
    """The Gloo devices of a link: one per interface named in ``GLOO_SOCKET_IFNAME`` (a comma
    list) when it is set, as torch's own Gloo groups do, else the default one (the address
    the host name resolves to). A group made with explicit options skips torch's reading of
    the variable, and where the host name resolves to loopback (containers, network
    namespaces) a link would then offer 127.0.0.1 to a peer on another machine.

    Raises:
        RuntimeError: a named interface does not exist or has no address (Gloo's message).
    """
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=n) for n in names]
    return [dist.ProcessGroupGloo.create_default_device()]


class PairChannel:
    """One link's point-to-point on its own Gloo group of two (this end and the peer)."""

    def __init__(self, pg: dist.ProcessGroup, peer: int) -> None:
        self.pg: dist.ProcessGroup | None = pg
        self.peer = peer

    def _group(self) -> dist.ProcessGroup:
        pg = self.pg
        if pg is None:
            raise RuntimeError("the link was closed")
        return pg

    def isend(self, t: torch.Tensor, tag: int) -> Work:
        return self._group().send([t], self.peer, tag)

    def irecv(self, t: torch.Tensor, tag: int) -> Work:
        return self._group().recv([t], self.peer, tag)

    def close(self) -> None:
        """Abort the group and let it go: pending sends and receives fail at once, its
        sockets close (the store connection is the links' shared one: it stays)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.abort()


def _pair_options(timeout: datetime.timedelta) -> dist.ProcessGroupGloo._Options:
    """A link's Gloo options: its timeout and a device of its own."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = gloo_devices()
    return opts


def open_pair_channel(store: dist.Store, first: bool, timeout: datetime.timedelta
                      ) -> PairChannel:
    """A link's Gloo group of two over ``store`` (both ends call this with the same store;
    ``first``: this end is the group's rank 0), blocking until the other end is there, up to
    ``timeout`` (RuntimeError then)."""
    # The options (they hold the link's Gloo device: its listening socket and thread) are
    # passed, never named here, so that they go with a call that fails: where this end gave up
    # waiting for the other ("Connect timeout") and the other dials late, a device still alive
    # hands that connection to the pair Gloo freed with the failed group (SIGSEGV or SIGABRT),
    # and a frame of the error's traceback kept it alive while the error was handled; gone, it
    # refuses the late end, whose link then fails (a loss).
    pg = dist.ProcessGroupGloo(store, 0 if first else 1, 2, _pair_options(timeout))
    return PairChannel(pg, 1 if first else 0)


class PairGroup(CommGroup):
    """This member's handle on a gossip group whose links are groups of two over ``store``
    (module docstring).

    Args:
        rendezvous: ``"HOST:PORT"`` of the rendezvous (its ``TCPStore``). The links are made
            over one connection of their own, apart from the caller's (making one waits in
            the store for the other end, and must not hold up the caller's use of the store:
            a joiner's state comes that way), which they share without one link's wait
            holding up another's (:class:`~qcomm.rendezvous.shared_client.SharedClient`).
        member: this member's index, 0 <= member < size; its incarnation is claimed first
            (:func:`claim_incarnation`).
        size: members (the job's nodes).
        name: what tells this gossip's links from others' in the store (a rail: ``"rail0"``).
        timeout_s: the link groups' timeout, and how long a link waits for its other end to
            open it (with ``join_timeout_s``: how long that end's beat may stand still).
        join_timeout_s: how long a link waits for its other end's first start and then for
            it to open the link while it beats at the rendezvous
            (:mod:`qcomm.rendezvous.heartbeat`): a peer slow to start is waited for, one that
            died is given up after ``timeout_s``. None: ``timeout_s`` bounds the whole wait
            (members that do not beat).
        ranks: the members' global ranks in the job, by member (default: the member
            numbers; a rail of nodes of several ranks: ``node * procs_per_node + local_rank``).
    """

    def __init__(self, rendezvous: str, member: int, size: int, *, name: str = "rail0",
                 timeout_s: float = 300.0, ranks: list[int] | None = None,
                 join_timeout_s: float | None = None) -> None:
        from qcomm.rendezvous.seat import parse_address

        self.host, self.port = parse_address(rendezvous)
        self.size = check_int("size", size, low=1)
        self.rank = check_int("member", member, low=0, high=size, high_open=True)
        self.ranks = list(range(size)) if ranks is None else [int(r) for r in ranks]
        if len(self.ranks) != size:
            raise ValueError(f"ranks must list one global rank per member ({size}), got "
                             f"{self.ranks}")
        self.name = name
        self.timeout = datetime.timedelta(seconds=check_timeout(timeout_s))
        self.join_timeout_s = (None if join_timeout_s is None
                               else check_timeout(join_timeout_s, "join_timeout_s"))
        self._opened: dict[tuple[int, int], int] = {}   # (peer, its incarnation): links opened
        self._lock = threading.Lock()
        self._store: SharedClient | None = None

    def _incarnation(self, store: dist.Store, member: int) -> int:
        """``member``'s current incarnation (waits for its first start, up to the start
        bound, saying so every few seconds)."""
        key = INCARNATION_KEY.format(member=member)
        wait_keys(store, {key: f"member {member} (rank {self.ranks[member]}) to start"},
                  self._open_wait_s(), f"{self.host}:{self.port}", who=self._who())
        return int(store.add(key, 0))

    def _open_wait_s(self) -> float:
        """The longest wait for a link's other end (module docstring of
        :mod:`qcomm.rendezvous.heartbeat`)."""
        timeout_s = self.timeout.total_seconds()
        return timeout_s if self.join_timeout_s is None else max(timeout_s,
                                                                 self.join_timeout_s)

    def _who(self) -> str:
        return f"rank {self.ranks[self.rank]} ({self.name})"

    def connect(self, peer: int, peer_rank: int) -> PairChannel:
        """Make the link to member ``peer``: a Gloo group of two over the rendezvous, made by
        both ends (blocks until the other end comes, up to the timeout, saying every few
        seconds what it waits for; RuntimeError then, as when the rendezvous does not answer,
        and at once when the job refused the peer)."""
        try:
            return self._connect(peer)
        except TimeoutError as e:   # the link's callers take a RuntimeError as its failure
            raise RuntimeError(str(e)) from e

    def _links_store(self) -> SharedClient:
        """The connection this group's links share (made at the first link: module docstring
        of :mod:`qcomm.rendezvous.shared_client`); ValueError/RuntimeError (torch's) when the
        rendezvous cannot be reached, and the next link tries again."""
        from qcomm.rendezvous.tunnel import store_client

        with self._lock:
            if self._store is None:
                self._store = SharedClient(store_client(self.host, self.port, self.timeout),
                                           self.timeout.total_seconds())
            return self._store

    def _connect(self, peer: int) -> PairChannel:
        store = self._links_store()
        me = (self.rank, self._incarnation(store, self.rank))
        other = (peer, self._incarnation(store, peer))
        with self._lock:
            n = self._opened[other] = self._opened.get(other, 0) + 1
        lo, hi = sorted([me, other])
        prefix = f"qcomm/link/{self.name}/{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}/{n}/"
        self._announce(store, prefix)
        # Each end says it is here before the Gloo group, which waits mute and cannot be told
        # that the other end will never come: the job refused it (its options differ).
        store.set(f"{prefix}here/{self.rank}", "1")

        # a peer slow to start is waited for while it beats; one that died is given up
        pulse = (None if self.join_timeout_s is None else
                 PulseWatch(store, self.ranks[peer], other[1], self.timeout.total_seconds()))

        def refused_or_gone() -> None:
            why = refusal_of_member(store, *other)
            if why is not None:
                raise RuntimeError(f"member {peer} (rank {self.ranks[peer]}, incarnation "
                                   f"{other[1]}) was refused by the job: {why}")
            if pulse is not None:
                pulse.check()

        wait_keys(store, {f"{prefix}here/{peer}": f"member {peer} (rank {self.ranks[peer]}, "
                                                  f"incarnation {other[1]}) to open its link"},
                  self._open_wait_s(), f"{self.host}:{self.port}", who=self._who(),
                  check=refused_or_gone)
        return self._channel(store, prefix, me, other)

    def _announce(self, store: dist.Store, prefix: str) -> None:
        """What this end says in the store about a link before it is here (nothing: Gloo
        exchanges its own addresses); a link of another kind publishes where to reach it."""

    def _channel(self, store: dist.Store, prefix: str, me: tuple[int, int],
                 other: tuple[int, int]) -> PairChannel:
        """The link's channel once both ends are here: a Gloo group of two over the store
        under ``prefix``, rank 0 the lower ``(member, incarnation)``."""
        channel = open_pair_channel(dist.PrefixStore(prefix, store), me == min(me, other),
                                    self.timeout)
        log.info("link to rank %d: Gloo, through the rendezvous at %s:%d, in clear",
                 self.ranks[other[0]], self.host, self.port)
        return channel

    def streams(self, peers: list[int], *, nbytes: int, max_backlog: int, timeout_s: float,
                stream_end, stats, level: str) -> MessageStreams:
        return GlooStreams(self.ranks, None, self.rank, peers, nbytes, max_backlog=max_backlog,
                           timeout_s=timeout_s, stream_end=stream_end, stats=stats,
                           level=level, connect=self.connect)

    def _no_collectives(self, what: str):
        raise NotImplementedError(
            f"{what} over a PairGroup: its members change while the job runs, so it has only "
            "the wait-free gossip's streams (sums go along the gossip's ring)")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        self._no_collectives("all_reduce")

    def all_reduce_future(self, tensor: torch.Tensor) -> torch.futures.Future:
        self._no_collectives("all_reduce_future")

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._no_collectives("all_gather_flat")

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._no_collectives("all_to_all_single")

    def barrier(self) -> None:
        self._no_collectives("barrier")

    def transport(self, peers: list[int], *, stats, level: str):
        self._no_collectives("the lockstep gossip's transport")

    def __repr__(self) -> str:
        return f"PairGroup(member={self.rank}, size={self.size}, name={self.name!r})"
