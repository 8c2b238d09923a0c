"""A wait at the rendezvous that says what it waits for.

A node waiting for others (their seats, a link's other end) used to block in one
``store.wait`` for up to ``timeout_s`` (300 s by default) and say nothing, so a user could not
tell a slow start from a node that will never come. :func:`wait_keys` waits in slices of
``every_s`` seconds and after each one logs a WARNING (shown without any logging set up) naming
what is still missing, the rendezvous and the time left; a ``check`` called between slices may
end the wait early (a node the job refused will not come).

A thread's waits can be abandoned from outside (:func:`abandon_when`): a link being made on a
thread of its own waits here, and in Gloo's rendezvous through
:class:`~qcomm.rendezvous.shared_client.SharedClient`, for a peer that may never come; when
its streams close, the wait must end at its next poll, not at its bound (minutes), since a
daemon thread still inside torch's store or Gloo when the interpreter exits aborts the process
after a run that had finished (seen: a link to a node that was refused and never came).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from qcomm.validation import check_real

__all__ = ["REPORT_EVERY_S", "WaitAbandoned", "abandon_when", "raise_if_abandoned", "wait_keys"]

log = logging.getLogger("qcomm")

REPORT_EVERY_S = 5.0   # seconds between the lines of a wait

_scope = threading.local()


class WaitAbandoned(RuntimeError):
    """A wait this thread was doing was abandoned (:func:`abandon_when`); a RuntimeError, as a
    link that cannot be made fails."""


@contextlib.contextmanager
def abandon_when(abandoned: Callable[[], bool], what: str) -> Iterator[None]:
    """Within the block, this thread's waits at the rendezvous (:func:`wait_keys`, a
    :class:`~qcomm.rendezvous.shared_client.SharedClient` call that waits) raise
    :class:`WaitAbandoned` at their next poll once ``abandoned()`` is true (``what``: what
    was waited for, for the message)."""
    outer = getattr(_scope, "abandoned", None)
    _scope.abandoned = (abandoned, what)
    try:
        yield
    finally:
        _scope.abandoned = outer


def raise_if_abandoned() -> None:
    """Raise :class:`WaitAbandoned` when this thread's current wait was abandoned."""
    scope = getattr(_scope, "abandoned", None)
    if scope is not None and scope[0]():
        raise WaitAbandoned(f"{scope[1]}: abandoned (closed while it waited)")


def wait_keys(store: dist.Store, keys: dict[str, str], timeout_s: float, where: str, *,
              who: str = "this node", check: Callable[[], None] | None = None,
              every_s: float = REPORT_EVERY_S, poll_s: float = 0.05) -> None:
    """Wait until every key of ``keys`` is set in ``store``; every ``every_s`` seconds without
    them, log ``"<who> waits for <what is missing> at the rendezvous <where>; N s left"``,
    ``keys`` mapping each key to what it stands for (``"node 2 to take its seat"``).

    The keys are polled (``store.check`` every ``poll_s``), not waited for in slices: a
    ``TCPStore`` wait that times out prints two lines of C++ warnings each time.

    Args:
        check: called before each line; what it raises ends the wait (e.g. the job refused
            the node waited for).

    Raises:
        TimeoutError: ``timeout_s`` passed, naming what never came; ValueError:
            ``timeout_s``, ``every_s`` or ``poll_s`` not above 0.
    """
    timeout_s = check_real("timeout_s", timeout_s, low=0, low_open=True)
    every_s = check_real("every_s", every_s, low=0, low_open=True)
    poll_s = check_real("poll_s", poll_s, low=0, low_open=True)
    start = time.monotonic()
    deadline, report = start + timeout_s, start + every_s
    missing = list(keys)
    while True:
        raise_if_abandoned()
        missing = [k for k in missing if not store.check([k])]
        if not missing:
            return
        now = time.monotonic()
        what = "; ".join(keys[k] for k in missing)
        if now >= deadline:
            raise TimeoutError(f"{who} waited {timeout_s:g} s at the rendezvous {where} for "
                               f"{what}")
        if now >= report:
            if check is not None:
                check()
            log.warning("qcomm: %s waits for %s at the rendezvous %s; %.0f s left of %g", who,
                        what, where, deadline - now, timeout_s)
            report = now + every_s
        time.sleep(min(poll_s, deadline - now))
