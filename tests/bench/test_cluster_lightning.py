"""The Lightning methods of the cluster benchmark: their names in the registry, the script
compare.py launches for them, the strategy the worker builds, and the cell's tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cluster import compare as C
from bench.cluster import lightning_table as LT
from bench.cluster import methods as M
from bench.cluster import training as T


@pytest.mark.parametrize(("name", "base"), [
    ("lightning-ddp", "ddp"), ("lightning-adamw-slow-link", "adamw-slow-link"),
    ("lightning-qcomm-hier-4-h2f2-g100-n-ddp", "qcomm-hier-4-h2f2-g100-n-ddp")])
def test_lightning_methods_run_their_base_method_s_communication(name, base):
    assert M.is_lightning(name) and name in M.METHODS
    assert M.lightning_base(name) == base and M.resolve(name) == M.resolve(base)
    info = M.METHODS[name]
    assert info.family == "lightning" and info.needs == "lightning"
    assert info.description.startswith("Lightning Trainer, ")


@pytest.mark.parametrize("name", ["lightning-slow-link", "lightning-qcomm-hier-4",
                                  "lightning-localsgd", "lightning-"])
def test_a_method_the_strategy_cannot_run_is_no_lightning_method(name):
    # QcommStrategy wraps the optimizer into a HierarchicalOptimizer with DDP in the node:
    # ASSGD and a qcomm-hier method without -ddp would not be the plain loop's method.
    assert not M.is_lightning(name)
    with pytest.raises(ValueError, match="unknown"):
        M.parse_methods(name)


def test_all_leaves_the_lightning_methods_out():
    assert not any(M.is_lightning(n) for n in M.parse_methods("all"))


def test_workload_py_refuses_a_lightning_method():
    cfg = T.Config(lr=0.1, momentum=0.0, layout=T.Layout(1, 1), seed=0)
    with pytest.raises(ValueError, match=r"lightning_worker\.py"):
        M.build("lightning-ddp", object(), cfg)


def test_compare_launches_the_lightning_worker_for_a_lightning_method(tmp_path):
    args = C.parse_args([])
    cmd = C.workload_command("charlm", "lightning-adamw-slow-link", args, tmp_path / "d.npz",
                             tmp_path / "o.json", "2x2")
    plain = C.workload_command("charlm", "adamw-slow-link", args, tmp_path / "d.npz",
                               tmp_path / "o.json", "2x2")
    assert Path(cmd[0]).name == "lightning_worker.py" and Path(plain[0]).name == "workload.py"
    assert cmd[1:] == [a if a != "adamw-slow-link" else "lightning-adamw-slow-link"
                       for a in plain[1:]]


def test_the_worker_gives_qcomm_strategy_the_plain_loop_s_options():
    pytest.importorskip("lightning")
    from bench.cluster import lightning_worker as LW

    cfg = T.Config(lr=3e-3, momentum=0.0, layout=T.Layout(2, 2), seed=7, optimizer="adamw",
                   total_steps=405)
    assert LW.make_strategy("lightning-ddp", cfg) == "ddp"
    comm = LW.make_strategy("lightning-adamw-slow-link", cfg).comm
    assert (comm.bits, comm.sync_every, comm.fragments, comm.gamma, comm.rounding) == \
        (4, 2, 2, 1.0, "nearest")
    assert (comm.graph, comm.staleness, comm.seed, comm.total_steps, comm.procs_per_node) == \
        ("ring", 1, 7, 405, 2)


def test_the_worker_refuses_what_it_does_not_run():
    pytest.importorskip("lightning")
    from bench.cluster import lightning_worker as LW

    base = ["--workload", "charlm", "--data", "d.npz", "--out", "o.json"]
    with pytest.raises(SystemExit, match="--time-budget"):
        LW.parse_args([*base, "--method", "lightning-ddp", "--time-budget", "5"])
    with pytest.raises(SystemExit, match="must be a Lightning method"):
        LW.parse_args([*base, "--method", "ddp"])


def _run(path: Path, curve: list[tuple[float, float]], step_s: float, inter: int) -> None:
    """A run's JSON as workload.py writes it, with only the fields the tables read."""
    ranks = [{"rank": r, "node": r // 2, "iface_tx_bytes": 1000 * 4 if r % 2 == 0 else None,
              "qcomm_bytes": {"inter": inter * 4, "intra": 0}, "step_mean_s": step_s,
              "step_median_s": step_s, "baseline_median_s": 0.1, "loop_s": 4 * step_s,
              "fwd_bwd_median_s": 0.1, "opt_step_median_s": 0.05}
             for r in range(4)]
    path.write_text(json.dumps({
        "metric": {"name": "val_loss", "goal": "min"}, "layout": {"nodes": 2, "procs": 2},
        "config": {"steps": 4}, "final_val_loss": curve[-1][1], "ranks": ranks,
        "curve": [{"step": s, "fastest_step": s, "time_s": s * step_s, "val_loss": v}
                  for s, v in curve]}))


def test_the_tables_give_lightning_over_the_plain_loop_per_repetition(tmp_path):
    curve = [(1, 2.5), (2, 2.1), (3, 1.95), (4, 1.85)]
    for rep, (plain_s, light_s) in enumerate([(0.2, 0.22), (0.2, 0.3)], start=1):
        _run(tmp_path / f"c_2x2_adamw-slow-link_r{rep}.json", curve, plain_s, 100)
        _run(tmp_path / f"c_2x2_lightning-adamw-slow-link_r{rep}.json", curve, light_s, 100)
    text, data = LT.tables(LT.load_runs(tmp_path), "adamw-slow-link", [2.0, 1.8])
    ratios = data["ratios_by_repetition"]["lightning-adamw-slow-link"]
    assert ratios[2.0] == pytest.approx([1.1, 1.5])
    assert ratios[1.8] == [None, None]   # never reached
    assert "| lightning-adamw-slow-link | 1.30 [1.10-1.50] | never |" in text
    assert "1,000 [1,000-1,000]" in text   # a node's interface bytes per step
    # the rest of the loop: the step less forward + backward (100 ms) and optimizer (50 ms)
    assert data["figures"]["lightning-adamw-slow-link"][2]["rest_ms"] == pytest.approx(150)
