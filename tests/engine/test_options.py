"""CommOptions: a misspelled option name is refused naming the option it looks like, however
the options were built (the constructor, dataclasses.replace, an optimizer's keywords)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable

import pytest

from qcomm.engine import CommOptions

BUILDS: dict[str, Callable[[str], object]] = {
    "constructor": lambda name: CommOptions(**{name: 2}),
    "replace": lambda name: dataclasses.replace(CommOptions(), **{name: 2}),
    "from_kwargs": lambda name: CommOptions.from_kwargs({name: 2}),
    "from_kwargs over a base": lambda name: CommOptions.from_kwargs({name: 2}, CommOptions()),
}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize(("name", "near"), [
    ("stalenes", "staleness"), ("gama", "gamma"), ("timeout", "timeout_s"),
    ("max_backlg", "max_backlog"), ("peer_loss", "on_peer_loss"),
])
def test_a_misspelled_option_names_the_nearest(build: str, name: str, near: str) -> None:
    with pytest.raises(TypeError) as info:
        BUILDS[build](name)
    message = str(info.value)
    assert message.startswith(f"unknown communication option {name!r}; accepted: bits, ")
    assert message.endswith(f"; did you mean {near!r}?")


@pytest.mark.parametrize("build", list(BUILDS))
def test_a_name_far_from_every_option_gets_no_suggestion(build: str) -> None:
    with pytest.raises(TypeError) as info:
        BUILDS[build]("topology")
    assert "did you mean" not in str(info.value)
    assert str(info.value).endswith("timeout_s, token, total_steps, wait_free")


def test_known_names_build_as_before() -> None:
    options = CommOptions(bits=2, staleness=0, gamma=0.4)
    assert CommOptions.from_kwargs({"staleness": 0}, CommOptions(bits=2, gamma=0.4)) == options
    assert dataclasses.replace(options, bits=8).bits == 8
    assert copy.deepcopy(options) == options == pickle.loads(pickle.dumps(options))
    assert CommOptions(2, 64).block_size == 64  # positional, in field order
