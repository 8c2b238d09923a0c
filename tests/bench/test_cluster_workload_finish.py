"""The end of a healthy cluster run (bench/cluster/workload.py ``finish``): rank 0 evaluates
and writes the results only after the last collective, so no rank waits on that evaluation
under the process group's timeout. The collectives are recorded, not run: no processes."""

from __future__ import annotations

import argparse
import types

import pytest

from bench.cluster import training as T
from bench.cluster import workload as WL

COLLECTIVES = ("barrier", "gather_object")


def _collectives(calls: list[str]) -> list[str]:
    return [c for c in calls if c in COLLECTIVES]


class _Left(Exception):
    """Raised instead of ``os._exit``: the test's way out of ``finish``."""


def _finish_calls(monkeypatch, tmp_path, rank: int) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(WL.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(WL.dist, "gather_object",
                        lambda obj, out, dst: calls.append("gather_object"))
    monkeypatch.setattr(WL, "read_counters", lambda here, built, node: (None, None, None))
    monkeypatch.setattr(WL, "write_result", lambda *a: calls.append("write_result"))

    def leave(code: int) -> None:
        calls.append(f"exit {code}")
        raise _Left

    monkeypatch.setattr(WL.os, "_exit", leave)
    built = types.SimpleNamespace(
        flush=lambda: calls.append("flush"), finalize=lambda: calls.append("finalize"),
        close=lambda: calls.append("close"), pace=lambda: None, sharded=False,
        context=types.SimpleNamespace(__exit__=lambda *a: None))
    here = WL.Place(rank=rank, world=4, node=rank // 2, local_rank=rank % 2,
                    layout=T.Layout(nodes=2, procs=2), iface="lo")
    timed = WL.Timed(steps=2, step_times=[0.1, 0.1], fwd_bwd=[0.05, 0.05],
                     opt_times=[0.01, 0.01], snapshots=[], t_open=0.0, t_loop=0.2, stop=None)
    args = argparse.Namespace(out=str(tmp_path / "run.json"))
    with pytest.raises(_Left):
        WL.finish(args, None, built, here, timed, (None, None, None), [0.1], (10, []))
    return calls


def test_rank_0_writes_after_the_last_collective(monkeypatch, tmp_path):
    calls = _finish_calls(monkeypatch, tmp_path, rank=0)
    last_collective = max(i for i, c in enumerate(calls) if c in COLLECTIVES)
    assert calls.count("write_result") == 1
    assert calls.index("write_result") > last_collective
    assert calls.index("close") < calls.index("write_result")
    assert calls[-1] == "exit 0"


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_every_rank_takes_the_same_collectives_and_only_rank_0_writes(monkeypatch, tmp_path,
                                                                      rank):
    ours = _finish_calls(monkeypatch, tmp_path, rank=rank)
    rank_0 = _finish_calls(monkeypatch, tmp_path, rank=0)
    assert "write_result" not in ours
    assert _collectives(ours) == _collectives(rank_0)
    assert ours[-1] == "exit 0"
