"""Nodes the job refused, kept at the rendezvous so that nobody waits or retries in vain.

A node whose communication options or model differ from the running job's is refused at its
first step (:func:`qcomm.engine.agreement.check_job_agreement`). Retrying cannot help: a
torchrun restart (``--max-restarts``) runs the same command again, and a node waiting to link
to the refused one would wait out its whole ``timeout_s``. So the refusal is recorded twice:

* under the node's torchrun run (what stays the same across its restarts,
  :func:`~qcomm.rendezvous.seat.run_base`): a restart is refused at once, before it takes a
  seat, with the same message (a new torchrun, with the options fixed, is a new run);
* under the seat and incarnation refused: a node waiting to link to it stops waiting.

The process refused exits with :data:`REFUSED_EXIT_CODE` (``EX_CONFIG`` of sysexits.h) when its
script catches :class:`RefusedError` as examples/train_charlm.py does.
"""

from __future__ import annotations

import torch.distributed as dist

from .seat import run_base

__all__ = ["REFUSED_EXIT_CODE", "RefusedError", "record_refusal", "refusal_of_member",
           "refusal_of_this_run"]

REFUSED_EXIT_CODE = 78   # EX_CONFIG: a configuration error, which a restart repeats

_RUN_KEY = "qcomm/refused/run/{run}"
_MEMBER_KEY = "qcomm/refused/member/{member}/{incarnation}"


class RefusedError(ValueError):
    """The running job refused this node: its options or model differ from the job's (the
    message names the first difference). Start it again with the job's, as a new run."""


def record_refusal(store: dist.Store, member: int, incarnation: int, message: str) -> None:
    """Record at the rendezvous that ``member`` at ``incarnation`` was refused, and why (also
    under this process's torchrun run, when it has one)."""
    store.set(_MEMBER_KEY.format(member=member, incarnation=incarnation), message)
    run = run_base()
    if run is not None:
        store.set(_RUN_KEY.format(run=run), message)


def refusal_of_this_run(store: dist.Store) -> str | None:
    """Why this process's torchrun run was refused before (a restart of it), else None."""
    run = run_base()
    key = _RUN_KEY.format(run=run)
    if run is None or not store.check([key]):
        return None
    return store.get(key).decode()


def refusal_of_member(store: dist.Store, member: int, incarnation: int) -> str | None:
    """Why ``member`` at ``incarnation`` was refused, else None."""
    key = _MEMBER_KEY.format(member=member, incarnation=incarnation)
    if not store.check([key]):
        return None
    return store.get(key).decode()
