"""Deprecated names, kept working for one release with a DeprecationWarning that names the
replacement. Part of the bottom layer: it imports only the standard library.

A module whose public name moved serves the old one through a module ``__getattr__``
(PEP 562)::

    __getattr__ = deprecated_names(__name__, {"derive_seed": ("qcomm.seeds.derive", derive)})

and a dict whose key was renamed (``stats()["gossip_step"]``) is a :class:`DeprecatedKeys`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["DeprecatedKeys", "deprecated_names", "warn_deprecated"]


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (removed in the next release)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def deprecated_names(module: str, aliases: dict[str, tuple[str, Any]]
                     ) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``aliases``: old name -> (replacement's dotted name,
    the object). Other names raise AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        if name in aliases:
            new, obj = aliases[name]
            warn_deprecated(f"{module}.{name}", new)
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


class DeprecatedKeys(dict):
    """A dict in which some keys are deprecated aliases of others: reading one warns and
    gives the value of its replacement. Iteration, ``==`` and pickling are a plain dict's (the
    aliases are real entries, so code that lists the keys still sees them).

    Args:
        data: the entries, aliases included.
        aliases: old key -> new key.
    """

    def __init__(self, data: dict, aliases: dict[str, str]) -> None:
        super().__init__(data)
        self._aliases = dict(aliases)

    def __getitem__(self, key: Any) -> Any:
        if key in self._aliases:
            warn_deprecated(f"the key {key!r}", repr(self._aliases[key]))
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self._aliases:
            warn_deprecated(f"the key {key!r}", repr(self._aliases[key]))
        return super().get(key, default)

    def __reduce__(self) -> tuple:
        return (dict, (dict(self),))  # unpickles as a plain dict
