"""The bench's methods ``slow-link`` and ``adamw-slow-link`` are the README's ``SLOW_LINK`` and
``ADAMW_SLOW_LINK`` as the library defines them (read, not copied), given the run's length."""

from __future__ import annotations

from types import MappingProxyType

import pytest

import qcomm.sgd
from bench.cluster import methods as M
from qcomm.engine import CommOptions


@pytest.mark.parametrize(("name", "attr", "kind"), [("slow-link", "SLOW_LINK", "assgd"),
                                                    ("adamw-slow-link", "ADAMW_SLOW_LINK",
                                                     "qcomm-hier")])
def test_the_bench_reads_the_setting_from_the_library(monkeypatch, name, attr, kind) -> None:
    opts = M.qcomm_variant(name)
    mine = dict(getattr(qcomm.sgd, attr))
    assert opts == {"kind": kind, "bits": mine.pop("bits"), "ddp": True, "named": True, **mine}
    # a change in the library is what the bench runs: nothing was copied
    monkeypatch.setattr(qcomm.sgd, attr, MappingProxyType({**getattr(qcomm.sgd, attr),
                                                           "gamma": 0.3}))
    assert M.qcomm_variant(name)["gamma"] == 0.3
    assert name in M.METHODS and M.METHODS[name].family == "qcomm"


def test_the_settings_are_valid_options_and_read_only() -> None:
    for setting in (qcomm.sgd.SLOW_LINK, qcomm.sgd.ADAMW_SLOW_LINK):
        CommOptions(**setting, total_steps=100)
        with pytest.raises(TypeError):
            setting["bits"] = 8   # type: ignore[index]
    assert qcomm.sgd.SLOW_LINK["wait_free"] and qcomm.sgd.SLOW_LINK["on_peer_loss"] == "continue"


def test_only_the_named_settings_take_the_runs_length() -> None:
    assert M.qcomm_variant("assgd-2-h16f4-g80-m9-o5-n-ddp-cont").get("named") is None
    assert "named" not in M.METHODS["slow-link"].description
