"""Each gossip link of a fixed process group on a Gloo group of two of its own.

Gloo fails every connection of a group when one of its waits times out: a receive that waits
``timeout_s`` for a silent neighbour closes the group's other connections too ("Application
timeout caused pair closure"), and the neighbours at their other ends see this member as lost.
On the one group all members share, one hung member then cut every link of the members that
noticed it: with ``on_peer_loss="continue"`` each survivor of a ring of four dropped every
other node and trained alone. So the wait-free streams over a ``torch.distributed`` group do
not share its connections: each link is a Gloo group of two (a
:class:`~.pair_group.PairChannel`) made over the group's own store when the link opens, whose
timeout fails that link only, and which is aborted when the link is dropped or closed.

A link's keys name the group, which of the streams made over it in this process (members make
their gossip's streams in the same order: the engine's members each make theirs at their
first round, optimizer by optimizer), the two ends, and how many times these two opened a link
before (both ends count alike), under the restart count torchrun gives a restarted worker
group (a group's store may outlive its workers).
"""

from __future__ import annotations

import datetime
import os
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from qcomm.rendezvous.shared_client import SharedClient

from .pair_group import PairChannel, open_pair_channel

__all__ = ["LinkGroups", "link_connect"]

# Streams made over each process group in this process (weak: a destroyed group goes).
_streams_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_made_lock = threading.Lock()


def _group_store(group: dist.ProcessGroup) -> dist.Store | None:
    """The store ``group`` was made over (its prefix keeps its keys apart from other groups');
    None for a group torch.distributed did not make (built by hand)."""
    from torch.distributed import distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group)
    return None if entry is None else entry[1]


def link_connect(group: dist.ProcessGroup | None, member: int
                 ) -> Callable[[int, int], PairChannel] | None:
    """``connect`` for :class:`~.streams.GlooStreams` over ``group``: each link a group of its
    own (:class:`LinkGroups`); None (point-to-point on ``group`` itself) when the group has no
    store to make them over."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    store = _group_store(pg)
    return None if store is None else LinkGroups(pg, store, member).connect


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The group's own timeout (what its creator gave ``init_process_group``/``new_group``)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):   # no CPU backend: torch's default
        return dist.default_pg_timeout


class LinkGroups:
    """The links of one set of streams over ``pg``: ``connect(peer, peer_rank)`` makes the
    link to member ``peer`` (blocks until the other end makes it too, up to the group's own
    timeout; RuntimeError then).

    Args:
        pg: the process group; its members are the gossip's.
        store: the store it was made over.
        member: this member's index in ``pg``.
    """

    def __init__(self, pg: dist.ProcessGroup, store: dist.Store, member: int) -> None:
        self.timeout = _group_timeout(pg)
        # The group's store client is shared with its other users, and a Gloo group's
        # rendezvous blocks in `get` until the other end is there: polled instead, so that a
        # link waiting for a slow peer holds up no other link and no other caller.
        self.store = SharedClient(store, self.timeout.total_seconds())
        self.member = member
        with _made_lock:
            instance = _streams_made[pg] = _streams_made.get(pg, 0) + 1
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"qcomm/links/{restart}/{pg.group_name}/{instance}"
        self._opened: dict[int, int] = {}
        self._lock = threading.Lock()

    def connect(self, peer: int, peer_rank: int) -> PairChannel:
        with self._lock:
            n = self._opened[peer] = self._opened.get(peer, 0) + 1
        lo, hi = sorted((self.member, peer))
        return open_pair_channel(dist.PrefixStore(f"{self.prefix}/{lo}-{hi}/{n}/", self.store),
                                 self.member == lo, self.timeout)
