"""Where a Gloo exchange stands in its group, what the transport and the streams both hold:
the members' global ranks, this member and its neighbours, and where its bytes are counted."""

from __future__ import annotations

import torch.distributed as dist

from qcomm.collectives.stats import CommStats

__all__ = ["LinkEnds"]


class LinkEnds:
    """The ends of a member's links in a ``torch.distributed`` group."""

    def _set_ends(self, group_ranks: list[int], group: dist.ProcessGroup | None, member: int,
                  peers: list[int], stats: CommStats | None, level: str) -> None:
        """Fix ``group_ranks`` (global ranks in member order), ``group``, ``member`` and its
        ``rank``, the group's ``size``, the neighbours (``peers``, member indices, and
        ``peer_ranks``), and the byte counter ``stats`` with its ``level``."""
        self.group_ranks = list(group_ranks)
        self.group = group
        self.member = member
        self.size = len(self.group_ranks)
        self.rank = self.group_ranks[member]
        self.peers = list(peers)
        self.peer_ranks = [self.group_ranks[p] for p in peers]
        self.stats = stats
        self.level = level
