"""Argument checks shared by every layer: one wording, one set of limits.

Every public constructor checks its arguments once, with these functions, and raises

* ``TypeError`` when the value is of the wrong kind (a str where an int goes, a bool where a
  number goes: ``True`` is an int to Python but never a count, a seed or a step size here),
* ``ValueError`` when it is of the right kind but outside its limits,

both with the message ``"<name> must be <what>, got <value>"``, so a user sees the same
sentence for the same mistake whichever class caught it. Each check returns the value in its
normal form (a Python ``int`` or ``float``), which the caller stores.

This module is the bottom layer of qcomm: it imports only the standard library and torch.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import numbers
import operator
import os
import re
from collections.abc import Collection, Iterable, Mapping
from typing import NoReturn, TypeVar

import torch

__all__ = ["SEED_BITS", "SEED_MAX", "check_bucket_mb", "check_choice", "check_host_port",
           "check_instance", "check_int", "check_real", "check_seed", "check_tensor",
           "check_timeout", "describe", "did_you_mean", "env_int", "fail"]

SEED_BITS = 64
SEED_MAX = (1 << SEED_BITS) - 1
"""Seeds are ints in [0, 2**64): the codec's random stream takes 64 bits of key."""

T = TypeVar("T")


def describe(value: object) -> str:
    """How a rejected value is shown: ``repr`` for values, the type's name for objects whose
    ``repr`` would be a page long (tensors, modules)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, type):  # "<class 'torch.nn.modules.linear.Linear'>" hides that it is one
        return f"the class {value.__qualname__}"
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"


def fail(name: str, what: str, value: object, exc: type[Exception] = ValueError, *,
         hint: str = "") -> NoReturn:
    """Raise ``exc("<name> must be <what>, got <value><hint>")``.

    Args:
        name (str): the argument's name.
        what (str): what it must be.
        value (object): what it was (shown by :func:`describe`).
        exc (type[Exception]): the exception to raise.
        hint (str): appended to the message, e.g. :func:`did_you_mean`'s.
    """
    raise exc(f"{name} must be {what}, got {describe(value)}{hint}")


def did_you_mean(value: object, names: Iterable[object]) -> str:
    """``"; did you mean 'continue'?"`` when ``value`` is a string close to one of the string
    ``names`` (a near miss, by :func:`difflib.get_close_matches`), else ``""``.

    Args:
        value (object): the name that was refused.
        names (Iterable[object]): the accepted ones (those that are not strings are passed
            over: a number has no near miss).

    Returns:
        str: the tail of the message that refuses ``value``.
    """
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [n for n in names if isinstance(n, str)], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _interval(kind: str, low: float | None, high: float | None, low_open: bool,
              high_open: bool) -> str:
    """``"an int >= 0"``, ``"a float in (0, 1]"``, ... (the ``<what>`` of a message)."""
    article = "an" if kind[0] in "aeiou" else "a"
    if low is not None and high is not None:
        return (f"{article} {kind} in {'(' if low_open else '['}{_num(low)}, "
                f"{_num(high)}{')' if high_open else ']'}")
    if low is not None:
        return f"{article} {kind} {'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{article} {kind} {'<' if high_open else '<='} {_num(high)}"
    return f"{article} {kind}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _outside(x: float, low: float | None, high: float | None, low_open: bool,
             high_open: bool) -> bool:
    return ((low is not None and (x <= low if low_open else x < low))
            or (high is not None and (x >= high if high_open else x > high)))


def check_host_port(name: str, address: object, what: str, *, low_port: int = 1
                    ) -> tuple[str, int]:
    """``"HOST:PORT"`` as ``(host, port)``, an IPv6 host's brackets dropped; ``what`` says
    whose address it is in the error.

    Raises:
        ValueError: not of that form, or the port outside ``[low_port, 65535]``, naming
            ``name``.
    """
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not low_port <= int(port) <= 65535:
        raise ValueError(f"{name} must be 'HOST:PORT', {what}, got {address!r}")
    return host.strip("[]"), int(port)


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None,
              high_open: bool = False, allow_none: bool = False, what: str | None = None
              ) -> int | None:
    """``value`` as an ``int`` within ``[low, high]`` (``[low, high)`` with ``high_open``).

    numpy and torch integer scalars are accepted (``operator.index``); bools and floats are
    not, not even ``2.0``. ``what`` replaces the generated description (e.g. "an int >= 1
    dividing numel=12").
    """
    if value is None and allow_none:
        return None
    n = None
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            n = operator.index(value)  # type: ignore[arg-type]
    if n is not None and not _outside(n, low, high, False, high_open):
        return n  # the message below is built only for a value that fails (sizes per call)
    desc = what or _interval("int", low, high, False, high_open)
    if n is None:
        # "or None" only where the kind is wrong: to a user who passed 0, "an int >= 1" says
        # it all, in the same words whichever constructor (with or without a None default)
        # checked it.
        fail(name, desc + (" or None" if allow_none else ""), value, TypeError)
    fail(name, desc, value)


def check_real(name: str, value: object, *, low: float | None = None,
               high: float | None = None, low_open: bool = False, high_open: bool = False,
               finite: bool = True, allow_none: bool = False, what: str | None = None
               ) -> float | None:
    """``value`` as a ``float`` within the given bounds (closed unless ``*_open``).

    Any real number but a bool is accepted (ints, numpy floats); with ``finite`` (default)
    NaN and +-Inf are refused. ``what`` replaces the generated description.
    """
    if value is None and allow_none:
        return None
    desc = what or _interval("float", low, high, low_open, high_open)
    if what is None and finite and (low is None or high is None):
        desc = "a finite " + desc.removeprefix("a ")  # an unbounded side: say Inf is refused
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, desc + (" or None" if allow_none else ""), value, TypeError)
    x = float(value)
    if (finite and not math.isfinite(x)) or math.isnan(x) or _outside(
            x, low, high, low_open, high_open):
        fail(name, desc, value)
    return x


def check_choice(name: str, value: object, choices: Collection[T], *,
                 allow_none: bool = False) -> T | None:
    """``value`` if it is one of ``choices`` (or None when allowed), else ValueError listing
    them (and None, when allowed: a choice has no "kind" apart from its value), and the
    nearest choice to a misspelled one (:func:`did_you_mean`)."""
    if value is None and allow_none:
        return None
    try:
        # True == 1: a bool is a choice only where the choices hold that very bool.
        ok = value in choices and not (isinstance(value, bool)
                                       and not any(c is value for c in choices))
    except TypeError:  # unhashable
        ok = False
    if not ok:
        listed = tuple(choices)
        fail(name, f"one of {listed}" + (" or None" if allow_none else ""), value,
             hint=did_you_mean(value, listed))
    return value  # type: ignore[return-value]


def check_instance(name: str, value: object, cls: type[T] | tuple[type, ...], *,
                   allow_none: bool = False, what: str | None = None) -> T | None:
    """``value`` if it is an instance of ``cls`` (or None when allowed), else TypeError naming
    the expected class (``what``: how to call it, default its qualified name)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, cls):
        classes = cls if isinstance(cls, tuple) else (cls,)
        names = what or "a " + " or ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)
        fail_instance(name, value, classes, names)
        fail(name, names + (" or None" if allow_none else ""), value, TypeError)
    return value


def fail_instance(name: str, value: object, cls: type | tuple[type, ...], what: str) -> None:
    """Raise TypeError when ``value`` is the class ``cls`` (or a subclass) where one of its
    instances is expected (``torch.nn.Linear`` for ``torch.nn.Linear(4, 2)``, ``SGD`` for
    ``SGD(params)``), naming the call that was probably meant:
    ``"<name> must be a <Kind> instance, got the class <Name>; did you mean <Name>(...)?"``.
    ``what`` is how the expected kind is called ("a torch.nn.Module"). Returns otherwise: the
    caller raises its own message for any other value."""
    classes = cls if isinstance(cls, tuple) else (cls,)
    if not (isinstance(value, type) and issubclass(value, classes)):
        return
    if re.fullmatch(r"an? [\w.]+", what):  # one kind, named as the caller names it
        kind = what
    else:  # "a X or None", "one of ...": the expected class this one derives from
        base = next(c for c in classes if issubclass(value, c))
        qualified = f"{base.__module__}.{base.__qualname__}"
        kind = f"{'an' if qualified[0] in 'aeiou' else 'a'} {qualified}"
    called = value.__qualname__
    raise TypeError(f"{name} must be {kind} instance, got the class {called}; "
                    f"did you mean {called}(...)?")


def check_seed(value: object, name: str = "seed") -> int:
    """A seed: an int in [0, 2**64) (numpy and torch integer scalars accepted)."""
    return check_int(name, value, low=0, high=SEED_MAX + 1, high_open=True,
                     what="an int in [0, 2**64)")  # type: ignore[return-value]


def check_tensor(name: str, value: object, *, dtypes: Collection[torch.dtype] | None = None,
                 numel: int | None = None, ndim: int | None = None,
                 device: torch.device | None = None, contiguous: bool = False,
                 why: str = "") -> torch.Tensor:
    """``value`` if it is a ``torch.Tensor`` with the given properties; the first one that
    fails is named (dtype: TypeError; numel, ndim, device, layout: ValueError).

    Args:
        dtypes: allowed dtypes (None: any).
        numel: required number of elements.
        ndim: required number of dimensions.
        device: required device.
        contiguous: require a contiguous tensor; ``why`` says why (e.g. "it is updated in
            place"), appended to that message.
    """
    if not isinstance(value, torch.Tensor):
        fail_instance(name, value, torch.Tensor, "a torch.Tensor")
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if numel is not None and value.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {value.numel()}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    if contiguous and not value.is_contiguous():
        because = f" ({why})" if why else ""
        raise ValueError(f"{name} must be contiguous{because}, got a non-contiguous tensor of "
                         f"shape {tuple(value.shape)} and strides {value.stride()}")
    return value


# ---------------------------------------------------------------------------------------------
# the limits of options that several constructors take (CommOptions, CompressedGossip, the
# bucketed means, the DDP hook's state): defined once, so they cannot drift apart. The gossip's
# own options are checked in qcomm.collectives.gossip.options.


def check_timeout(value: object, name: str = "timeout_s", *, allow_none: bool = False
                  ) -> float | None:
    """Seconds to wait for a peer: a finite float > 0 (None: the process group's own)."""
    return check_real(name, value, low=0, low_open=True, allow_none=allow_none)


def check_bucket_mb(value: object, name: str = "bucket_mb") -> float:
    """A bucket size in MiB: a finite float > 0."""
    return check_real(name, value, low=0, low_open=True)  # type: ignore[return-value]


def env_int(var: str, minimum: int, env: Mapping[str, str] | None = None) -> int | None:
    """Environment variable ``var`` (of ``env``, default the process's) as an int >=
    ``minimum``; None when unset or empty."""
    env = os.environ if env is None else env
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        fail(f"environment variable {var}", f"an int >= {minimum}", raw)
    return check_int(f"environment variable {var}", value, low=minimum)


def env_flag(var: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Environment variable ``var`` (of ``env``, default the process's) as ``"1"`` (True) or
    ``"0"`` (False); ``default`` when unset or empty. Any other value raises ValueError naming
    the variable: a ``"false"`` or ``"off"`` read as the default would turn off nothing."""
    env = os.environ if env is None else env
    raw = env.get(var, "").strip()
    if raw == "":
        return default
    if raw not in ("0", "1"):
        fail(f"environment variable {var}", "0 or 1", raw)
    return raw == "1"
