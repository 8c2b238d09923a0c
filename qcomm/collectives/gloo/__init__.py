"""The gossip's point-to-point messages over Gloo, beside their in-memory twins
(:mod:`qcomm.collectives.memory`): what a ``torch.distributed`` group
(:class:`~qcomm.collectives.torch_group.TorchGroup`) or a group of Gloo pairs
(:class:`~.pair_group.PairGroup`) makes when a gossip member asks it for a
way to move messages (:mod:`qcomm.collectives.links` states the interfaces).

- :mod:`.transport`: :class:`GlooTransport`, one payload per round to and from each
  neighbour (the bounded-staleness gossip).
- :mod:`.streams`: :class:`GlooStreams`, ordered message streams per neighbour (the wait-free
  gossip), a receiver and a sender thread per link.
- :mod:`.link_groups`: each link of the streams over a ``torch.distributed`` group on a Gloo
  group of two of its own (a wait that times out on one group closes all its connections).
- :mod:`.pair_group`: :class:`PairGroup`, a gossip group whose every link is a Gloo group of
  two made when the link opens, over the job's rendezvous (what lets a node join a running
  job).
"""

from .streams import GlooStreams
from .transport import GlooTransport

__all__ = ["GlooStreams", "GlooTransport"]
