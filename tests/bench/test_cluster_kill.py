"""Unit tests of the cluster benchmark's lost node (--kill-node K --kill-at F): the flags'
validation, the -cont method names, and how a run's JSON is classified (stops / continues /
finished) and summarized. No root, no namespaces, no training."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from bench.cluster import compare as C
from bench.cluster import methods as M
from bench.cluster import training as T
from bench.cluster import workload as WL

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "bench" / "cluster"


# ---------------------------------------------------------------------------------------------
# the flags


def _error(capsys, parse, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "names"), [
    (["--kill-node", "0", "--kill-at", "0.5"], ["--kill-node", "node 0 hosts the rendezvous"]),
    (["--kill-node", "2", "--kill-at", "0.5", "--layouts", "2x2,4x1"],
     ["--kill-node 2", "layout 2x2"]),
    (["--kill-node", "1", "--kill-at", "0.5", "--layouts", "4x1,1x4"], ["layout 1x4"]),
    (["--kill-node", "1", "--kill-at", "1"], ["--kill-at", "between 0 and 1"]),
    (["--kill-node", "1", "--kill-at", "0"], ["--kill-at"]),
    (["--kill-node", "1"], ["--kill-node and --kill-at go together"]),
    (["--kill-at", "0.3"], ["--kill-node and --kill-at go together"]),
    (["--pg-timeout", "0"], ["--pg-timeout"]),
])
def test_compare_refuses_bad_kill_flags_naming_the_flag(capsys, argv, names):
    err = _error(capsys, C.parse_args, argv)
    for name in names:
        assert name in err


def test_compare_passes_the_kill_to_every_run_and_nothing_without_one(tmp_path):
    args = C.parse_args(["--kill-node", "1", "--kill-at", "0.33", "--layouts", "2x2,4x1",
                         "--pg-timeout", "60"])
    cmd = C.workload_command("mnist1d", "ddp", args, tmp_path / "d.npz", tmp_path / "o.json",
                             "2x2")
    assert cmd[cmd.index("--kill-node") + 1] == "1"
    assert cmd[cmd.index("--kill-at") + 1] == "0.33"
    assert cmd[cmd.index("--pg-timeout") + 1] == "60"
    healthy = C.workload_command("mnist1d", "ddp", C.parse_args([]), tmp_path / "d.npz",
                                 tmp_path / "o.json", "2x2")
    assert not {"--kill-node", "--kill-at", "--pg-timeout"} & set(healthy)
    # what workload.py makes of them
    wargs = WL.parse_args([*cmd[1:]])
    assert (wargs.kill_node, wargs.kill_at, wargs.pg_timeout) == (1, 0.33, 60.0)
    assert "kill_node" in WL.run_config(wargs)
    assert "kill_node" not in WL.run_config(WL.parse_args([*healthy[1:]]))


@pytest.mark.parametrize(("extra", "name"), [
    (["--kill-node", "0", "--kill-at", "0.5"], "--kill-node"),
    (["--kill-node", "1", "--kill-at", "1.5"], "--kill-at"),
    (["--kill-node", "1"], "--kill-node and --kill-at"),
])
def test_workload_refuses_bad_kill_flags(capsys, extra, name):
    err = _error(capsys, WL.parse_args, ["--method", "ddp", "--data", "d", "--out", "o", *extra])
    assert name in err


@pytest.mark.skipif(os.geteuid() != 0, reason="netns.sh needs root before it reads arguments")
def test_netns_launch_refuses_to_lose_node_0():
    proc = subprocess.run(["bash", str(CLUSTER / "netns.sh"), "launch", "--id", "zz9", "--nodes",
                           "4", "--procs", "1", "--lost-node", "0", "--", "x.py"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--lost-node" in proc.stderr


# ---------------------------------------------------------------------------------------------
# -cont


def test_cont_names_parse_to_a_wait_free_gossip_that_continues():
    want = {"kind": "assgd", "bits": 4, "ddp": True, "sync_every": 16, "fragments": 4,
            "gamma": 0.5, "outer_momentum": 0.5, "rounding": "nearest", "wait_free": True,
            "on_peer_loss": "continue"}
    assert M.qcomm_variant("assgd-4-h16f4-g50-m5-n-ddp-cont") == want
    assert M.qcomm_variant("assgd-4-h16f4-g50-m5-n-ddp-wf-cont") == want  # -wf is implied
    wf = M.qcomm_variant("assgd-4-h16f4-g50-m5-n-ddp-wf")
    assert "on_peer_loss" not in wf and wf["wait_free"] is True
    assert M.qcomm_variant("assgd-4-cont-wf") is None  # -cont comes last
    assert M.qcomm_variant("qcomm-hier-4-h2f2-cont")["on_peer_loss"] == "continue"
    assert M.per_node_budget("assgd-4-cont") and M.continues_after_loss("assgd-4-cont")
    assert not M.continues_after_loss("assgd-4-wf") and not M.continues_after_loss("ddp")
    assert "on_peer_loss=continue" in M.METHODS["assgd-4-cont"].description
    assert M.parse_methods("ddp,assgd-4-n-cont") == ["ddp", "assgd-4-n-cont"]


def test_cont_reaches_the_optimizer_as_on_peer_loss(monkeypatch):
    got = {}

    class FakeASSGD:
        def __init__(self, params, **kw):
            got.update(kw)

        def stats(self):
            return {"bytes_sent": {"intra": 0, "inter": 0}, "live_nodes": 3}

        def node_any(self, flag):
            return flag

    fake = types.ModuleType("qcomm.sgd")
    fake.ASSGD = FakeASSGD
    monkeypatch.setitem(sys.modules, "qcomm.sgd", fake)
    cfg = T.Config(lr=0.1, momentum=0.9, layout=T.Layout(4, 1))
    built = M._qcomm_adapter("assgd-4-cont", types.SimpleNamespace(parameters=list), cfg)
    assert got["wait_free"] is True and got["on_peer_loss"] == "continue"
    assert built.node_any is not None  # per-node budgets, as -wf
    assert built.live_nodes() == 3


# ---------------------------------------------------------------------------------------------
# a run's JSON under a lost node


def _rank(rank, status="stopped", err=("RuntimeError", 11, "step"), steps=10, live=None):
    rec = {"rank": rank, "node": rank, "local_rank": 0, "steps": steps,
           "step_median_s": 0.1 if steps else None, "fwd_bwd_median_s": 0.02 if steps else None,
           "opt_step_median_s": 0.01 if steps else None, "baseline_median_s": 0.025,
           "loop_s": 2.0, "window_s": 2.1, "iface_tx_bytes": 100 * steps,
           "iface_tx_packets": steps, "qcomm_bytes": None, "status": status}
    if status == "stopped":
        rec["error"] = {"type": err[0], "step": err[1], "where": err[2],
                        "message": "Connection closed by peer"}
    if live is not None:
        rec["live_nodes"] = live
    return rec


CURVE = [{"step": 0, "time_s": 0.0, "test_acc": 0.1},
         {"step": 5, "time_s": 0.5, "test_acc": 0.6},
         {"step": 10, "time_s": 1.0, "test_acc": 0.65},
         {"step": 15, "time_s": 1.5, "test_acc": 0.75},
         {"step": 20, "time_s": 2.0, "test_acc": 0.72}]


def _killed(ranks, method="ddp", step=10, time_s=None, happened=True, curve=CURVE, final=0.72,
            missing=()):
    return {
        "method": method, "layout": {"nodes": 4, "procs": 1, "world": 4},
        "model": {"params": 10, "shapes": [[10]]},
        "config": {"steps": 30, "batch": 32, "warmup": 5},
        "final_test_acc": final, "curve": curve, "ranks": ranks, "notes": {},
        "kill": {"node": 2, "at": 0.33, "step": step, "time_s": time_s, "happened": happened,
                 "killed_at_step": step if happened else None,
                 "killed_at_s": (time_s or 1.05) if happened else None},
        "nodes": [{"node": n, "killed": happened and n == 2} for n in range(4)],
        "final_from": "last snapshot", "missing_ranks": list(missing),
    }


def test_a_method_that_stops_counts_only_snapshots_before_the_loss():
    row = C.summarize_run(_killed([_rank(0), _rank(1), _rank(3)]), target=0.7)
    assert row["behaviour"] == "stops at step 11: RuntimeError" and row["outcome"] == "stops"
    assert row["stop"]["step"] == 11 and row["stop"]["ranks"] == [0, 1, 3]
    # 0.75 at step 15 came after the kill (step 10): no time to target, but the best says it
    assert row["time_to_target_s"] is None
    assert row["best"] == pytest.approx(0.75) and row["final"] == pytest.approx(0.72)
    assert row["survivor_nodes"] == 3
    assert row["bytes_rel_diff"] is None and row["payload_rel_diff"] is None
    assert C.summarize_run(_killed([_rank(0), _rank(1), _rank(3)]), target=0.6)[
        "time_to_target_s"] == pytest.approx(0.5)


def test_a_stop_by_time_uses_the_kill_time():
    row = C.summarize_run(_killed([_rank(0), _rank(1), _rank(3)], step=None, time_s=1.6),
                          target=0.7)
    assert row["time_to_target_s"] == pytest.approx(1.5)


def test_ranks_that_stop_apart_and_outside_a_step_say_so():
    ranks = [_rank(0, err=("PeerLostError", 30, "step")),
             _rank(1, err=("PeerLostError", 7, "step")),
             _rank(3, err=("RuntimeError", 30, "finalize"), steps=30)]
    row = C.summarize_run(_killed(ranks, method="assgd-4-wf"), target=0.7)
    assert row["behaviour"] == "stops at steps 7-30: PeerLostError"
    ranks = [_rank(r, err=("RuntimeError", 30, "finalize"), steps=30) for r in (0, 1, 3)]
    row = C.summarize_run(_killed(ranks, method="localsgd"), target=0.7)
    assert row["behaviour"] == "stops at step 30 (finalize): RuntimeError"


def test_a_rank_that_stopped_before_its_first_step_leaves_the_figures_to_the_others():
    ranks = [_rank(0, steps=0, err=("RuntimeError", 1, "step")), _rank(1), _rank(3)]
    row = C.summarize_run(_killed(ranks), target=0.7)
    assert row["step_median_s"] == pytest.approx(0.1)
    assert row["inter_bytes_iface"] == pytest.approx(100)
    assert row["behaviour"] == "stops at steps 1-11: RuntimeError"


def test_survivors_that_finish_continue_with_the_live_nodes():
    ranks = [_rank(r, "finished", steps=30, live=3) for r in (0, 1, 3)]
    res = _killed(ranks, method="assgd-4-cont", final=0.74)
    res["final_from"] = "final parameters"
    row = C.summarize_run(res, target=0.7)
    assert row["behaviour"] == "continues with 3 nodes" and row["outcome"] == "continues"
    assert row["time_to_target_s"] == pytest.approx(1.5)  # after the kill counts
    assert row["final"] == pytest.approx(0.74) and row["final_from"] == "final parameters"
    ranks = [_rank(r, "finished", steps=30) for r in (0, 1, 3)]  # no live_nodes reported
    assert C.summarize_run(_killed(ranks), 0.7)["behaviour"] == "continues with 3 nodes"


def test_no_loss_is_finished_and_a_missing_rank_is_a_stop():
    ranks = [_rank(r, "finished", steps=30) for r in range(4)]
    row = C.summarize_run(_killed(ranks, happened=False), target=0.7)
    assert row["behaviour"] == "finished" and row["time_to_target_s"] == pytest.approx(1.5)
    ranks = [_rank(r, "finished", steps=30) for r in (0, 3)]
    row = C.summarize_run(_killed(ranks, missing=[1]), target=0.7)
    assert row["outcome"] == "stops" and "ranks [1]" in row["behaviour"]


def test_table_and_rows_carry_the_kill_columns_only_under_a_kill():
    stop = {**C.summarize_run(_killed([_rank(0), _rank(1), _rank(3)]), 0.7), "rate": "100mbit"}
    ranks = [_rank(r, "finished", steps=30, live=3) for r in (0, 1, 3)]
    cont = {**C.summarize_run(_killed(ranks, method="assgd-4-cont", final=0.74), 0.7),
            "rate": "100mbit"}
    rows = [{**C.aggregate([r]), "rate": "100mbit"} for r in (stop, cont)]
    text = C.table(rows)
    head = text.splitlines()[0]
    assert "survivors t->target s" in head and "survivors final" in head
    assert head.split()[-2:] == ["best", "behaviour"]
    assert "stops at step 11: RuntimeError" in text and "continues with 3 nodes" in text
    assert "75.00%" in text  # the best before stopping
    md = C.kill_table(rows)
    assert md.splitlines()[2].startswith("| mnist1d | 4x1 | 100mbit | ddp | stops at step 11")
    assert "| assgd-4-cont | continues with 3 nodes | 15" not in md  # 1.5 s
    assert "| assgd-4-cont | continues with 3 nodes | 1.5 | 74.00% | 75.00% |" in md
    healthy = C.table([{**C.summarize_run({**_killed([_rank(r, "finished", steps=30)
                                                      for r in range(4)]), "kill": None}, 0.7),
                        "rate": "1gbit"}])
    assert "behaviour" not in healthy and "survivors" not in healthy


def test_repetitions_that_behave_differently_are_listed():
    a = C.summarize_run(_killed([_rank(0), _rank(1), _rank(3)]), 0.7)
    b = C.summarize_run(_killed([_rank(r, err=("RuntimeError", 12, "step")) for r in (0, 1, 3)],
                                curve=[*CURVE[:3], {**CURVE[3], "test_acc": 0.69}]), 0.7)
    row = C.aggregate([a, a, b])
    assert row["behaviour"] == ("stops at step 11: RuntimeError (2x); "
                                "stops at step 12: RuntimeError (1x)")
    assert row["best"] == pytest.approx(0.75) and row["best_spread"] == [0.69, 0.75]
    assert [r["behaviour"] for r in row["per_repeat"]][2] == "stops at step 12: RuntimeError"


# ---------------------------------------------------------------------------------------------
# workload.py's pieces


def test_a_stop_records_the_class_and_the_first_line():
    rec = WL.stop_record(RuntimeError("Connection closed by peer\nat pair.cc:553"), "step", 11)
    assert rec == {"type": "RuntimeError", "message": "Connection closed by peer",
                   "where": "step", "step": 11}


def test_a_rank_without_steps_has_no_step_figures():
    rec = WL.rank_record(0, 0, 0, 0, [], [], [], [0.02, 0.03], 0.1, 0.2, None, None, None)
    assert rec["step_median_s"] is None and rec["step_max_s"] is None
    assert rec["long_steps"] == [] and rec["baseline_median_s"] == pytest.approx(0.025)


def test_node_processes_is_empty_outside_torchrun():
    # pytest's parent is no torchrun agent: a kill here would touch nothing but this process
    assert WL.node_processes() == []


def test_cut_connections_ends_connected_sockets_and_spares_listeners(tmp_path):
    # In a child process: it shuts down every connected socket of the process it runs in.
    code = textwrap.dedent("""
        import socket
        from bench.cluster import workload as w
        lis = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(lis.getsockname()); b, _ = lis.accept()
        n = w.cut_connections()
        assert b.recv(1) == b"", "the peer sees end-of-stream"
        c = socket.create_connection(lis.getsockname()); lis.accept()  # still listening
        assert a.fileno() >= 0  # the descriptor stays open
        print(n)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == 2  # both ends of the pair; the listener spared


def test_a_stopped_repetition_keeps_only_the_snapshots_before_the_loss_for_the_verdicts():
    stopped = C.summarize_run(_killed([_rank(0), _rank(1), _rank(3)]), 0.7)
    ranks = [_rank(r, "finished", steps=30, live=3) for r in (0, 1, 3)]
    goes_on = C.summarize_run(_killed(ranks, method="assgd-4-cont"), 0.7)
    row = C.aggregate([stopped])
    assert [p["step"] for p in row["per_repeat"][0]["curve"]] == [0, 5, 10]  # kill at step 10
    assert "counted_curve" not in row
    row = C.aggregate([goes_on])
    assert [p["step"] for p in row["per_repeat"][0]["curve"]] == [0, 5, 10, 15, 20]


# ---------------------------------------------------------------------------------------------
# rank 0's wait for the other ranks' records


def test_rank_0_stops_waiting_for_records_before_the_launch_kills_it() -> None:
    """Without the launch's kill time rank 0 waits the longest a communication may block plus
    two minutes; with it, it stops ASSEMBLE_S before it, so a rank that never writes its
    record leaves a JSON naming it (the smoke's 180 s launch used to end at exit 124, no
    JSON, while rank 0 waited 420 s)."""
    import time

    from bench.cluster import lost_node_end as L

    now, wall = time.monotonic(), time.time()
    assert L.records_deadline(60.0, {}) - now == pytest.approx(420.0, abs=1.0)
    assert L.records_deadline(900.0, {}) - now == pytest.approx(1020.0, abs=1.0)
    soon = {"QCB_KILLED_AT": str(int(wall) + 180)}
    assert L.records_deadline(60.0, soon) - now == pytest.approx(180 - L.ASSEMBLE_S, abs=2.0)
    late = {"QCB_KILLED_AT": str(int(wall) + 10_000)}
    assert L.records_deadline(60.0, late) - now == pytest.approx(420.0, abs=1.0)
