"""The options of a gossip member, each checked by one function.

:class:`~.choco.CompressedGossip` and :class:`~.wait_free.WaitFreeGossip` (through
:class:`~.member.GossipMember`) and the engine's ``CommOptions`` check these options with these
functions, so a bad value gets the same message whichever of them the user built. This module
imports only :mod:`qcomm.validation` and the gossip's own tables, so the engine can import it
without the collectives importing anything back from the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from qcomm.validation import (
    check_choice,
    check_int,
    check_real,
    check_seed,
    check_timeout,
    fail,
)

from .graphs import GRAPHS, check_graph
from .mixing import MIXINGS, check_mixing

__all__ = [
    "GRAPHS",
    "MIXINGS",
    "ON_PEER_LOSS",
    "OPTION_CHECKS",
    "check_fragments",
    "check_gamma",
    "check_graph",
    "check_max_backlog",
    "check_mixing",
    "check_on_peer_loss",
    "check_outer_lr",
    "check_outer_momentum",
    "check_seed",
    "check_staleness",
    "check_timeout",
    "check_total_steps",
]

ON_PEER_LOSS = ("raise", "continue")
"""What a wait-free member does when a neighbour is lost: raise, or continue without it."""


def check_staleness(value: object, name: str = "staleness") -> int:
    """Gossip rounds in flight: an int >= 0.

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        int: ``value`` as a Python int.
    """
    return check_int(name, value, low=0)  # type: ignore[return-value]


def check_gamma(value: object, name: str = "gamma") -> float | None:
    """CHOCO's consensus step: a float in (0, 1], or None (the default for the code width and
    the staleness, :func:`~.gamma.default_gamma`).

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        float | None: ``value`` as a Python float, or None.
    """
    # None is accepted wherever gamma is (CommOptions and the members both default it), so
    # the message of a wrong kind says so in every one of them.
    return check_real(name, value, low=0, high=1, low_open=True, allow_none=True)


def check_fragments(value: object, divides: int, divides_name: str,
                    name: str = "fragments") -> int:
    """A number of fragments: an int >= 1 dividing ``divides``.

    Args:
        value (object): the value given.
        divides (int): what the fragments split evenly (CommOptions: ``sync_every``; a member:
            its ``numel``).
        divides_name (str): how the message names ``divides``.
        name (str): the argument's name in the message.

    Returns:
        int: ``value`` as a Python int.
    """
    what = f"an int >= 1 dividing {divides_name}={divides}"
    n = check_int(name, value, low=1, what=what)
    if divides % n:  # type: ignore[operator]
        fail(name, what, value)
    return n  # type: ignore[return-value]


def check_outer_momentum(value: object, name: str = "outer_momentum") -> float:
    """Nesterov momentum of the gossip's outer step: a float in [0, 1).

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        float: ``value`` as a Python float.
    """
    return check_real(name, value, low=0, high=1, high_open=True)  # type: ignore[return-value]


def check_outer_lr(value: object, name: str = "outer_lr") -> float:
    """Learning rate of the gossip's outer step: a float in (0, 2] (1 with momentum 0: none).

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        float: ``value`` as a Python float.
    """
    return check_real(name, value, low=0, high=2, low_open=True)  # type: ignore[return-value]


def check_max_backlog(value: object, name: str = "max_backlog") -> int:
    """Wait-free messages per neighbour sent and not yet taken: an int >= 1.

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        int: ``value`` as a Python int.
    """
    return check_int(name, value, low=1)  # type: ignore[return-value]


def check_on_peer_loss(value: object, name: str = "on_peer_loss") -> str:
    """What a wait-free member does when a neighbour is lost: one of :data:`ON_PEER_LOSS`.

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        str: ``value``.
    """
    return check_choice(name, value, ON_PEER_LOSS)  # type: ignore[return-value]


def check_total_steps(value: object, name: str = "total_steps") -> int | None:
    """The run's length in local steps, which the outer step anneals over: None (no anneal)
    or an int >= 1.

    Args:
        value (object): the value given.
        name (str): the argument's name in the message.

    Returns:
        int | None: ``value``.
    """
    return check_int(name, value, low=1, allow_none=True)  # type: ignore[return-value]


OPTION_CHECKS: dict[str, Callable[[object], object]] = {
    "mixing": check_mixing,
    "staleness": check_staleness,
    "gamma": check_gamma,
    "timeout_s": check_timeout,
    "seed": check_seed,
    "outer_momentum": check_outer_momentum,
    "outer_lr": check_outer_lr,
    "total_steps": check_total_steps,
    "max_backlog": check_max_backlog,
    "on_peer_loss": check_on_peer_loss,
}
"""The options that a member and ``CommOptions`` both take and check by value alone, with the
one function that checks each (``fragments`` is checked against what it divides, which
differs: :func:`check_fragments`; ``graph`` against what takes it, which differs too: a member
takes the graphs of its class, ``CommOptions`` every graph, or None,
:func:`~.graph_choice.check_option_graph`)."""
