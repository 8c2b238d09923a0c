"""qcomm.sgd.log_stats / stats_scalars: opt.stats() to any logger in one call."""

from __future__ import annotations

import logging

import pytest
import torch

from qcomm.sgd import ASSGD, log_stats, stats_scalars

# What a wait-free rank's opt.stats() holds after a run that lost a neighbour (rank 2), got it
# back, and lost rank 6 for good (keys and forms: qcomm.engine.report.engine_stats).
WAIT_FREE = {
    "steps": 40, "skipped_steps": 1,
    "bytes_sent": {"intra": 1000, "inter": 2**40 + 3},    # past float32's exact range
    "messages_sent": {"intra": 10, "inter": 7},
    "staleness": 1, "gossip_rounds": 10, "fragment_rounds": [3, 3, 2, 2], "gamma": 0.8,
    "consensus_distance": None,
    "rounds_received": {2: 8, 4: 9}, "lag_rounds": {2: 2, 4: 1}, "live_nodes": 3,
    "dropped_ranks": [2, 6], "rejoined_ranks": [2],
    "terms_paired": {"paired": 15, "possible": 20}, "mix_lag_rounds": {1: 6, 2: 3, 4: 1},
}


class Writer:
    """SummaryWriter's add_scalar."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append((tag, value, step))


class LightningLike:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.calls.append((metrics, step))


class WandbLike:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def log(self, data: dict, *, step: int) -> None:
        self.calls.append((data, step))


class Fake:
    """An optimizer whose stats() is WAIT_FREE."""

    def stats(self) -> dict:
        return WAIT_FREE


def test_the_wait_free_figures() -> None:
    s = stats_scalars(WAIT_FREE)
    assert s["qcomm/bytes_inter"] == 2**40 + 3          # float64: exact
    assert s["qcomm/bytes_intra"] == 1000.0 and s["qcomm/messages_inter"] == 7.0
    assert s["qcomm/live_nodes"] == 3.0
    assert s["qcomm/lost_nodes"] == 1.0                 # 6 is still lost, 2 came back
    assert s["qcomm/joins"] == 1.0
    assert s["qcomm/lag_rounds"] == 2.0
    assert s["qcomm/mix_lag"] == pytest.approx((1 * 6 + 2 * 3 + 4 * 1) / 10)
    assert s["qcomm/steps"] == 40.0 and s["qcomm/skipped_steps"] == 1.0
    assert "qcomm/consensus_distance" not in s
    assert all(type(v) is float for v in s.values())
    assert set(stats_scalars(WAIT_FREE, prefix="")) == {k.removeprefix("qcomm/") for k in s}


def test_a_real_optimizer_alone_reports_its_steps_and_no_bytes() -> None:
    model = torch.nn.Linear(4, 2)
    opt = ASSGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    writer = Writer()
    scalars = log_stats(opt, writer, 3)
    assert scalars["qcomm/steps"] == 3.0 and scalars["qcomm/bytes_inter"] == 0.0
    assert "qcomm/live_nodes" not in scalars            # lockstep: no wait-free figures
    assert writer.calls == [(k, v, 3) for k, v in scalars.items()]


@pytest.mark.parametrize("sink", [LightningLike(), WandbLike()], ids=["log_metrics", "log"])
def test_dict_loggers_get_one_call(sink) -> None:
    scalars = log_stats(Fake(), sink, 7)
    assert sink.calls == [(scalars, 7)]


def test_a_python_logger_gets_one_line(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="train"):
        log_stats(Fake(), logging.getLogger("train"), 5)
    [record] = caplog.records
    assert record.getMessage().startswith("step 5: steps=40 ")
    assert "live_nodes=3" in record.getMessage() and "joins=1" in record.getMessage()


def test_bad_arguments_are_named_and_write_nothing() -> None:
    with pytest.raises(TypeError, match="sink must have add_scalar"):
        log_stats(Fake(), object(), 1)
    with pytest.raises(TypeError, match="opt must be a qcomm optimizer"):
        log_stats(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), Writer(), 1)
    writer = Writer()
    for step in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            log_stats(Fake(), writer, step)
    assert writer.calls == []
    with pytest.raises(TypeError, match="stats must be the dict"):
        stats_scalars([1, 2])
