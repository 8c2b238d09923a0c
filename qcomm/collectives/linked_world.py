"""The groups of a job of nodes linked through the rendezvous
(:func:`qcomm.rendezvous.init_node`): the node's group is torch.distributed's default group, each
rail a :class:`~qcomm.collectives.gloo.pair_group.PairGroup` whose links are made as they open,
and no group spans the job."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from qcomm.rendezvous.node import LinkedSeat
from qcomm.validation import env_flag

from .gloo.pair_group import PairGroup
from .sockets import SocketGroup
from .torch_group import TorchWorld

__all__ = ["LinkedWorld"]


class LinkedWorld(TorchWorld):
    """The groups of a job of linked nodes, seen from ``seat``: the node's group is
    torch.distributed's default group (the node's torchrun world); a rail is a
    :class:`~qcomm.collectives.gloo.pair_group.PairGroup` of the nodes' same local ranks (its links
    made through the rendezvous when they open), or a
    :class:`~qcomm.collectives.sockets.SocketGroup` when the seat listens on a port or has a
    job token. No group spans the job."""

    spans_job = False

    def __init__(self, seat: LinkedSeat) -> None:
        self.seat = seat

    def job(self, rank: int | None, world_size: int | None) -> tuple[int | None, int | None]:
        return (self.seat.rank if rank is None else rank,
                self.seat.world_size if world_size is None else world_size)

    def check(self, rank: int, world_size: int) -> None:
        seat = self.seat
        if (rank, world_size) != (seat.rank, seat.world_size):
            raise RuntimeError(f"this Topology is rank {rank} of {world_size}, but the node's "
                               f"seat is rank {seat.rank} of {seat.world_size}")
        if not dist.is_initialized() or dist.get_world_size() != seat.procs_per_node:
            raise RuntimeError("torch.distributed's default group is not this node's ranks "
                               "any more (qcomm.rendezvous.init_node made it)")

    def new_groups(self, rank_lists: Any, rank: int) -> list[Any]:
        seat = self.seat
        out: list[Any] = []
        for ranks in rank_lists:
            ranks = list(ranks)
            if rank not in ranks:
                out.append(None)
            elif all(r // seat.procs_per_node == seat.node for r in ranks):
                out.append(dist.group.WORLD)   # the node: its torchrun world
            elif seat.listen is not None or seat.token is not None:
                # TCP links on the node's one port (and the job token, when set)
                out.append(SocketGroup(seat.rendezvous, seat.node, seat.nodes, ranks=ranks,
                                       name=f"rail{seat.local_rank}", timeout_s=seat.timeout_s,
                                       join_timeout_s=seat.join_timeout_s,
                                       listen=seat.listen or "", token=seat.token))
            else:
                out.append(PairGroup(seat.rendezvous, seat.node, seat.nodes, ranks=ranks,
                                     name=f"rail{seat.local_rank}", timeout_s=seat.timeout_s,
                                     join_timeout_s=seat.join_timeout_s))
        return out

    def links(self) -> str:
        seat = self.seat
        if seat.listen is None and seat.token is None:
            return ("Gloo, a group of two per link made through the rendezvous, every port "
                    "open between the nodes")
        port = (f"accepting on {seat.listen} and dialling the peers that accept less"
                if seat.listen else "dialling every link (this node accepts none)")
        encrypt = seat.token is not None and env_flag("QCOMM_ENCRYPT", True)
        token = ("job token checked, " + ("encrypted (AES-256-GCM)" if encrypt else "in clear")
                 + ", the rendezvous through an encrypted tunnel") if seat.token else \
            "no job token, in clear"
        return f"one-port TCP, {port}; {token} (each link's own line says which)"

    def whole(self, rank: int) -> Any:
        raise RuntimeError("no process group spans a job of linked nodes (its nodes come and "
                           "go): sums over the nodes go along the gossip's ring")

    def __repr__(self) -> str:
        return f"LinkedWorld(node={self.seat.node}, nodes={self.seat.nodes})"
