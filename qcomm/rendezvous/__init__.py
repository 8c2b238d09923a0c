"""The job's rendezvous: a process of its own that outlives every node, and the call that seats
a node through it.

    python -m qcomm.rendezvous --host 0.0.0.0 --port 29400 --nodes 3     # once, first
    QCOMM_RENDEZVOUS=HOST:29400 torchrun --standalone --nproc-per-node 2 train.py   # per node

and in ``train.py``, ``qcomm.rendezvous.init_process_group()`` where
``torch.distributed.init_process_group()`` was. :mod:`.server` serves it, :mod:`.seat` seats a
node, :mod:`.node` seats a linked node (one that may leave and come back), :mod:`.heartbeat`
tells a peer slow to start from one that died, :mod:`.start` begins the starting nodes'
gossip together, :mod:`.link_relay` relays the socket links whose two ends both accept
nothing. docs/guide.md, "One torchrun per node", has the launch in full.
"""

from .node import LinkedSeat, init_node, linked_seat
from .refusals import REFUSED_EXIT_CODE, RefusedError
from .seat import ENV_VAR, Seat, init_process_group, parse_address
from .server import serve

__all__ = ["ENV_VAR", "REFUSED_EXIT_CODE", "LinkedSeat", "RefusedError", "Seat", "init_node",
           "init_process_group", "linked_seat",
           "parse_address", "serve"]
