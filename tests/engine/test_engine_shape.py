"""qcomm.engine.engine stays a small coordinator (checked with :mod:`ast`), and the run's steps
are counted by one clock, the one the gossip advances."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

import qcomm.engine.engine as engine_module
from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.engine import AveragingEngine
from qcomm.sgd import ASSGD

MAX_CLASS_LINES = 249   # under 250
MAX_METHOD_LINES = 40


def _engine_class() -> ast.ClassDef:
    tree = ast.parse(Path(inspect.getfile(engine_module)).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef)
                and n.name == "AveragingEngine")


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


def test_the_engine_class_is_under_250_lines() -> None:
    assert _lines(_engine_class()) <= MAX_CLASS_LINES


def test_no_engine_method_is_over_40_lines() -> None:
    long = [f"{n.name}: {_lines(n)} lines" for n in _engine_class().body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _lines(n) > MAX_METHOD_LINES]
    assert not long, f"engine methods over {MAX_METHOD_LINES} lines: {long}"


def test_alone_the_engine_clock_counts_the_steps() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = ASSGD([p], lr=0.1)
    for _ in range(3):
        p.grad = torch.ones(4)
        opt.step()
    engine = opt.engine
    assert engine.steps == engine.clock.steps == 3
    assert not hasattr(engine, "_steps")
    assert AveragingEngine.__getstate__(engine)["steps"] == 3


def test_with_gossip_the_gossip_advances_the_engine_clock() -> None:
    world = MemoryWorld(2, timeout_s=30)

    def body(rank: int) -> tuple[bool, int, int, int, int]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(256))
        layout = Topology(1, rank=rank, world_size=2, world=world)
        opt = ASSGD([p], lr=0.1, layout=layout, procs_per_node=1, sync_every=2, fragments=2)
        for _ in range(5):
            p.grad = torch.full_like(p, 0.1 * (rank + 1))
            opt.step()
        engine = opt.engine
        shared = engine._runtime.gossip.clock is engine.clock
        out = shared, engine.steps, engine._runtime.gossip.steps, opt.stats()["steps"]
        opt.close()
        return (*out, engine.steps)

    for shared, steps, gossip_steps, reported, after_close in world.run(body):
        assert shared
        assert steps == gossip_steps == reported == after_close == 5
