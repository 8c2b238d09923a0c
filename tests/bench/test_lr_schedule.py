"""The cluster benchmark's learning-rate schedule (bench/cluster/training.py): every method gets
the same one, by the step's index, and a bad name is refused before training."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from bench.cluster import training as T


def test_constant_is_one_everywhere() -> None:
    assert {T.lr_factor("constant", s, 100) for s in range(0, 150, 7)} == {1.0}


def test_cosine_warms_up_linearly_then_decays_to_zero_at_the_end() -> None:
    total = 200   # 5%: 10 warm-up steps
    f = [T.lr_factor("cosine", s, total) for s in range(total + 20)]
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == pytest.approx(1.0)
    half = 10 + (total - 10) // 2
    assert f[half] == pytest.approx(0.5, abs=0.01)
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))   # never rises again
    assert f[total] == pytest.approx(0.0) and f[-1] == 0.0   # past the end: stays at 0
    assert f[total - 1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 189 / 190)))


@pytest.mark.parametrize(("schedule", "total", "words"), [
    ("cosin", 10, "lr schedule must be one of ('constant', 'cosine'), got 'cosin'"),
    ("cosine", 0, "total must be >= 1 step, got 0")])
def test_bad_schedules_are_refused_by_name(schedule: str, total: int, words: str) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        T.scheduled(opt, schedule, total, 0.1)
    assert opt.param_groups[0]["lr"] == 0.1   # nothing changed


def test_scheduled_sets_every_group_by_the_step_not_by_calls() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    at = T.scheduled(opt, "cosine", 100, 0.1)
    at(50)
    want = 0.1 * T.lr_factor("cosine", 50, 100)
    assert [g["lr"] for g in opt.param_groups] == [want, want]
    # a worker that restarts from a checkpoint taken at step 50 holds the lr of step 50 in its
    # param groups: the schedule still starts from the run's lr, not from that
    again = T.scheduled(opt, "cosine", 100, 0.1)
    again(10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * T.lr_factor("cosine", 10, 100))


class _Progressing(torch.optim.SGD):
    """A torch optimizer that knows the job's progress, as a wait-free qcomm optimizer does."""

    def __init__(self, params, progress: int) -> None:
        super().__init__(params, lr=0.1)
        self.progress = progress

    def job_progress(self) -> int:
        return self.progress


class _Work:
    def loss(self, model, i):
        return model(torch.ones(1, 2)).sum()


@pytest.mark.parametrize(("wait_free", "progress", "step", "follows"), [
    (True, 80, 10, 80),     # a slow node: the job is further on than its own index
    (True, 5, 10, 10),      # never behind its own steps
    (False, 80, 10, 10),    # lockstep: every node at the same index; no collective asked
])
def test_the_cluster_workload_schedules_a_wait_free_run_by_the_jobs_progress(
        wait_free: bool, progress: int, step: int, follows: int) -> None:
    import argparse

    from bench.cluster import workload as WL

    model = torch.nn.Linear(2, 1)
    opt = _Progressing(model.parameters(), progress)
    built = T.Built(model, model, opt, node_any=(lambda flag: flag) if wait_free else None)
    args = argparse.Namespace(lr_schedule="cosine", warmup=5, steps=95)
    cfg = argparse.Namespace(lr=0.1)
    WL.step_function(_Work(), built, args, cfg)(step)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * T.lr_factor("cosine", follows, 100))
