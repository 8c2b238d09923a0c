"""The in-memory world: a whole job's ranks in one process, behind the same group interface
(:mod:`qcomm.collectives.group`) as torch.distributed's process groups. For tests and
simulations; no module of the library outside this package names it.

- :mod:`.world`: :class:`MemoryWorld` (ranks as threads, or stepped from one thread) and its
  :class:`MemoryGroup` s (the collectives, synchronous).
- :mod:`.transport`, :mod:`.streams`: the gossip's point-to-point messages between the
  members of one group (a round's payloads; ordered streams).
- :mod:`.simulate`: :class:`GossipSimulator` and :class:`WaitFreeSimulator`, n gossip members
  driven in lock step on a stepped world.
"""

from .simulate import GossipSimulator, WaitFreeSimulator
from .world import MemoryGroup, MemoryWorld

__all__ = ["GossipSimulator", "MemoryGroup", "MemoryWorld", "WaitFreeSimulator"]
