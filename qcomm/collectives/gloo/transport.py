"""Moving one payload per round between gossip neighbours over ``torch.distributed``: the Gloo
implementation of :class:`~qcomm.collectives.links.Transport` (the interface, and the in-memory
world's implementation, are described there).

:class:`GlooTransport`: ``isend``/``irecv`` on the given process group, receives posted before
sends (non-blocking point-to-point: Gloo moves the bytes on its own I/O threads while the
caller computes, so no communication thread of ours is needed; see
:mod:`qcomm.collectives.gossip.choco`). The tag of a message is its round number modulo
``TAG_MODULUS``, so the ``staleness + 1`` rounds in flight between a pair never match each
other's receives. Bytes sent are counted in
:class:`~qcomm.collectives.stats.CommStats` at the transport's level (``"inter"``: gossip runs
between nodes).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from qcomm.collectives.errors import PeerLostError, PeerTimeoutError, backend_detail
from qcomm.collectives.links import TAG_MODULUS, RoundHandle, Transport
from qcomm.collectives.stats import CommStats

from .ends import LinkEnds

# ---------------------------------------------------------------------------------------------
# torch.distributed point-to-point


class _GlooRound(RoundHandle):
    def __init__(self, round: int, works: list[tuple[int, str, dist.Work]], owner: GlooTransport):
        self.round = round
        self._works = works  # (peer global rank, "recv" | "send", work)
        self._owner = owner
        self._done = False

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for _, _, w in self._works)

    def wait(self, timeout_s: float) -> None:
        if self._done:
            return
        if self._owner.failed is not None:
            raise PeerLostError(
                f"gossip round {self.round}: transport unusable since {self._owner.failed}",
                self._owner.peer_ranks, self._owner.level)
        deadline = time.monotonic() + timeout_s
        missing: list[int] = []
        first: BaseException | None = None
        for peer, _kind, work in self._works:
            # Gloo honours Work.wait(timeout) on point-to-point ops (checked: a receive whose
            # sender never sends raises after the timeout, to the millisecond). Past the
            # deadline each remaining op still gets 1 ms, to name every silent peer.
            left = max(deadline - time.monotonic(), 1e-3)
            try:
                work.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError as e:  # Gloo: timeout, or connection closed by a dead peer
                if peer not in missing:
                    missing.append(peer)
                first = first or e
        if missing:
            what = f"gossip round {self.round} (rank {self._owner.rank})"
            self._owner.failed = what
            level = self._owner.level
            if time.monotonic() < deadline:  # failed early: Gloo saw the connection break
                raise PeerLostError(what, missing, level,
                                    detail=backend_detail(first)) from first
            raise PeerTimeoutError(what, timeout_s, missing, level) from first
        self._works = []
        self._done = True


class GlooTransport(Transport, LinkEnds):
    """Non-blocking point-to-point exchange over a ``torch.distributed`` process group.

    Args:
        group_ranks: global ranks of the members, in member order.
        group: their process group (None: the default group, then ``group_ranks`` must be
            ``range(world_size)``).
        member: this process's member index.
        peers: neighbour member indices.
        stats: byte counter, or None.
        level: the stats level the bytes are counted under.
        recv_first: post the receives before the sends (default); False posts the sends
            first. Receives stay first so a message always finds its buffer posted, although
            over loopback it was measured no faster (docs/gossip_tuning.md,
            ``bench/gossip_transport.py``); the knob is there to measure it on real links.
    """

    def __init__(self, group_ranks: list[int], group: dist.ProcessGroup | None, member: int,
                 peers: list[int], stats: CommStats | None = None, level: str = "inter",
                 recv_first: bool = True):
        self._set_ends(group_ranks, group, member, peers, stats, level)
        self.recv_first = recv_first
        self.failed: str | None = None

    def exchange(self, round: int, payload: torch.Tensor, recv: torch.Tensor) -> RoundHandle:
        if self.failed is not None:
            raise PeerLostError(f"gossip round {round}: transport unusable since {self.failed}",
                                self.peer_ranks, self.level)
        tag = round % TAG_MODULUS
        works: list[tuple[int, str, dist.Work]] = []
        posting: list[int] = []  # the peer (global rank) whose operation is being posted
        # group_src/group_dst are member indices in `group`: no global-rank translation needed
        # (and none can go wrong when group is a sub-group).
        def post_recvs() -> None:
            for k, p in enumerate(self.peers):
                posting[:] = [self.peer_ranks[k]]
                works.append((self.peer_ranks[k], "recv",
                              dist.irecv(recv[k], group=self.group, tag=tag, group_src=p)))

        def post_sends() -> None:
            for k, p in enumerate(self.peers):
                posting[:] = [self.peer_ranks[k]]
                works.append((self.peer_ranks[k], "send",
                              dist.isend(payload, group=self.group, tag=tag, group_dst=p)))

        try:
            if self.recv_first:
                post_recvs()
                post_sends()
            else:
                post_sends()
                post_recvs()
        except RuntimeError as e:  # a connection broke before this round (a peer died)
            self.failed = f"gossip round {round} (rank {self.rank})"
            # Gloo refuses an operation on a broken connection: the peer it was posted to is
            # the one lost (naming every neighbour blamed the live ones too).
            raise PeerLostError(self.failed, posting or self.peer_ranks, self.level,
                                detail=backend_detail(e)) from e
        if self.stats is not None and self.peers:
            self.stats.record(self.level, payload.numel() * len(self.peers),
                              messages=len(self.peers))
        return _GlooRound(round, works, self)

    def close(self) -> None:
        # Gloo has no way to cancel a posted receive; dropping the handles is all that is safe.
        # destroy_process_group afterwards returns at once even with receives pending (checked).
        self.failed = self.failed or "close()"
