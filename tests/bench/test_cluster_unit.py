"""Unit tests of the cluster benchmark's pure-Python parts: method registry, byte formulas,
result parsing and target checks. No root, no namespaces, no processes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parents[2] / "bench" / "cluster"


def _load_compare():
    # bench/cluster is a directory of scripts, not a package: compare.py (like workload.py under
    # torchrun) puts its own directory on sys.path and imports `methods` from there. Load it by
    # path and take `methods` from it, so both modules share one Layout class.
    spec = importlib.util.spec_from_file_location("qcb_compare", CLUSTER / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["qcb_compare"] = mod  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(mod)
    return mod


C = _load_compare()
M = C.M

SHAPES = [[512, 40], [512], [512, 512], [512], [512, 512], [512], [10, 512], [10]]
NUMEL = 551_434


def test_shapes_match_the_default_model():
    assert sum(M._prod(s) for s in SHAPES) == NUMEL


# ---------------------------------------------------------------------------------------------
# registry


def test_registry_has_the_issue_methods_in_order():
    assert list(M.METHODS) == ["ddp", "ddp-fp16", "ddp-powersgd", "localsgd", "qcomm-hook",
                               "assgd-8", "assgd-4", "assgd-2", "assgd-1", "assgd-4-ddp"]
    assert {m.family for m in M.METHODS.values()} == {"torch", "qcomm"}
    assert all(m.needs is None for m in M.METHODS.values() if m.family == "torch")
    assert all(m.needs for m in M.METHODS.values() if m.family == "qcomm")


def test_every_torch_method_has_a_builder():
    for name, info in M.METHODS.items():
        if info.family == "torch":
            assert name in M.BUILDERS


@pytest.mark.parametrize(("spec", "want"), [
    ("all", list(M.METHODS)),
    ("torch", ["ddp", "ddp-fp16", "ddp-powersgd", "localsgd"]),
    ("qcomm", ["qcomm-hook", "assgd-8", "assgd-4", "assgd-2", "assgd-1", "assgd-4-ddp"]),
    ("ddp, assgd-4", ["ddp", "assgd-4"]),
])
def test_parse_methods(spec, want):
    assert M.parse_methods(spec) == want


def test_parse_methods_rejects_unknown_names_and_lists_the_known():
    with pytest.raises(ValueError, match=r"unknown.*'nope'.*ddp"):
        M.parse_methods("ddp,nope")


def test_availability_torch_always_qcomm_by_module(monkeypatch):
    assert M.availability("ddp") == (True, "")
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    ok, why = M.availability("assgd-4")
    assert not ok and "unavailable" in why and "qcomm.sgd" in why
    assert M.availability("ddp-fp16") == (True, "")


def test_build_rejects_unknown_and_unavailable(monkeypatch):
    with pytest.raises(ValueError, match="method must be one of"):
        M.build("sgd", None, None)
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="unavailable"):
        M.build("qcomm-hook", None, None)


# ---------------------------------------------------------------------------------------------
# bytes accounting


@pytest.mark.parametrize(("nodes", "procs", "want"), [
    (1, 4, 0.0),            # one node: nothing leaves it
    (2, 1, 1.0),            # 2 (W-1)/W = 1
    (2, 2, 1.5),
    (4, 1, 1.5),
    (4, 8, 2 * 31 / 32),
])
def test_ring_allreduce_inter_bytes(nodes, procs, want):
    assert M.ring_allreduce_inter_bytes(1000, M.Layout(nodes, procs)) == pytest.approx(1000 * want)


def test_expected_bytes_per_method():
    lay = M.Layout(2, 2)
    full = M.expected_inter_bytes("ddp", SHAPES, lay)
    assert full == pytest.approx(1.5 * 4 * NUMEL)
    assert M.expected_inter_bytes("ddp-fp16", SHAPES, lay) == pytest.approx(full / 2)
    assert M.expected_inter_bytes("localsgd", SHAPES, lay, localsgd_period=8) == \
        pytest.approx(full / 8)
    assert M.expected_inter_bytes("assgd-4", SHAPES, lay) is None
    assert M.expected_inter_bytes("qcomm-hook", SHAPES, lay) is None


@pytest.mark.parametrize(("first", "steps", "period", "want"), [
    (5, 30, 8, 4),      # steps 5..34: 8, 16, 24, 32
    (0, 8, 8, 1),       # step 0 averages (after warm-up 0)
    (1, 7, 8, 0),
    (8, 1, 8, 1),
    (5, 600, 8, 75),
])
def test_localsgd_averages(first, steps, period, want):
    assert M.localsgd_averages(first, steps, period) == want


def test_localsgd_formula_counts_the_window_exactly():
    lay = M.Layout(2, 2)
    full = M.expected_inter_bytes("ddp", SHAPES, lay)
    got = M.expected_inter_bytes("localsgd", SHAPES, lay, localsgd_period=8, window=(5, 30))
    assert got == pytest.approx(full * 4 / 30)


def test_powersgd_numel_follows_torchs_rule():
    # (512, 40) rank 4: 512*40 = 20480 >= (552)*4*2 = 4416 -> compressed to 552*4
    # (10, 512) rank 4: 5120 >= 522*4*2 = 4176 -> compressed to 522*4
    # (8, 8) rank 4: 64 < 16*4*2 -> sent as is; vectors always as is
    c, u = M.powersgd_numel([[512, 40], [10, 512], [8, 8], [512], [3, 2, 2]], rank=4)
    # (3, 2, 2) -> (3, 4), r = 3: 12 < 7*3*2 -> as is
    assert c == 552 * 4 + 522 * 4
    assert u == 64 + 512 + 12
    exp = M.expected_inter_bytes("ddp-powersgd", [[512, 40]], M.Layout(2, 1), powersgd_rank=4)
    assert exp == pytest.approx(552 * 4 * 4)


def test_tcp_payload_removes_one_header_set_per_packet():
    assert M.tcp_payload(66_000 + 1_000_000, 1000) == 1_000_000


def test_agreement():
    assert M.agreement(105, 100) == pytest.approx(0.05)
    assert M.agreement(95, 100) == pytest.approx(0.05)
    assert M.agreement(0, 0) == 0.0
    assert M.agreement(1, 0) == float("inf")


# ---------------------------------------------------------------------------------------------
# result parsing


def _result(method="ddp", nodes=2, procs=2, steps=100, tx=1_000_000, qcomm=None, curve=None,
            acc=0.8):
    ranks = []
    for r in range(nodes * procs):
        ranks.append({
            "rank": r, "node": r // procs, "local_rank": r % procs,
            "step_median_s": 0.1, "step_mean_s": 0.1, "fwd_bwd_median_s": 0.02,
            "opt_step_median_s": 0.001, "baseline_median_s": 0.025, "loop_s": 10.0 + r,
            "window_s": 10.5,
            "iface_tx_bytes": tx * steps if r % procs == 0 else None,
            "iface_rx_bytes": tx * steps if r % procs == 0 else None,
            "iface_tx_packets": 10 * steps if r % procs == 0 else None,
            "qcomm_bytes": None if qcomm is None else {"intra": 7 * steps,
                                                       "inter": qcomm * steps},
        })
    return {
        "method": method, "layout": {"nodes": nodes, "procs": procs, "world": nodes * procs},
        "model": {"params": NUMEL, "shapes": SHAPES},
        "config": {"steps": steps, "batch": 32, "powersgd_rank": 4, "localsgd_period": 8},
        "final_test_acc": acc,
        "curve": curve or [{"step": 0, "time_s": 0.0, "test_acc": 0.1},
                           {"step": 50, "time_s": 5.0, "test_acc": 0.72},
                           {"step": 100, "time_s": 10.0, "test_acc": 0.8}],
        "ranks": ranks, "notes": {},
    }


def test_time_to_target():
    curve = _result()["curve"]
    assert C.time_to_target(curve, 0.7) == 5.0
    assert C.time_to_target(curve, 0.1) == 0.0
    assert C.time_to_target(curve, 0.81) is None


def test_summarize_torch_run_compares_counters_with_the_formula():
    expected = 1.5 * 4 * NUMEL
    row = C.summarize_run(_result(tx=int(expected * 1.01)), target=0.7)
    assert row["status"] == "ok" and row["layout"] == "2x2"
    assert row["inter_bytes_iface"] == pytest.approx(int(expected * 1.01))
    assert row["inter_bytes_qcomm"] is None
    assert row["bytes_reference"] == "formula"
    assert row["bytes_rel_diff"] == pytest.approx(0.01, abs=1e-6)
    assert row["inter_packets_iface"] == 10
    assert row["inter_payload_iface"] == pytest.approx(int(expected * 1.01) - 660)
    assert row["time_to_target_s"] == 5.0
    assert row["step_median_s"] == pytest.approx(0.1)
    assert row["comm_fraction"] == pytest.approx(0.75)
    # samples/s from the slowest rank's loop: 4 ranks * 32 * 100 steps / 13 s
    assert row["samples_per_s"] == pytest.approx(4 * 32 * 100 / 13.0)


def test_summarize_qcomm_run_sums_ranks_of_a_node():
    # 2 ranks per node, each sends 50 kB/step inter-node: the node sends 100 kB/step.
    row = C.summarize_run(_result("assgd-4", qcomm=50_000, tx=102_000), target=0.7)
    assert row["inter_bytes_qcomm"] == pytest.approx(100_000)
    assert row["intra_bytes_qcomm"] == pytest.approx(14)
    assert row["bytes_reference"] == "qcomm"
    assert row["bytes_rel_diff"] == pytest.approx(0.02)


def test_summarize_single_node_has_no_counters():
    res = _result(nodes=1, procs=2)
    for r in res["ranks"]:
        r["iface_tx_bytes"] = None
    row = C.summarize_run(res, target=0.7)
    assert row["inter_bytes_iface"] is None and row["bytes_rel_diff"] is None


def _row(method, ttt, acc, iface):
    return {"method": method, "status": "ok", "time_to_target_s": ttt, "final_test_acc": acc,
            "inter_bytes_iface": iface}


def test_check_targets_met_and_missed():
    rows = [_row("ddp", 50.0, 0.80, 3e6), _row("ddp-fp16", 25.0, 0.80, 1.5e6),
            _row("assgd-4", 10.0, 0.795, 3e5)]
    res = {c["name"]: c for c in C.check_targets(rows)}
    assert res["time-to-target speedup over ddp"]["ok"] is True
    assert res["time-to-target speedup over ddp"]["value"] == pytest.approx(5.0)
    assert res["faster than ddp-fp16"]["ok"] is True
    assert res["final accuracy vs ddp (points)"]["ok"] is True
    assert res["inter-node bytes/step vs ddp"]["ok"] is True

    rows = [_row("ddp", 40.0, 0.80, 3e6), _row("assgd-4", 10.0, 0.78, 5e5),
            _row("localsgd", 8.0, 0.80, 4e5)]
    res = {c["name"]: c for c in C.check_targets(rows)}
    assert res["time-to-target speedup over ddp"]["ok"] is False
    assert res["faster than localsgd"]["ok"] is False
    assert res["final accuracy vs ddp (points)"]["ok"] is False
    assert res["final accuracy vs ddp (points)"]["value"] == pytest.approx(-2.0)
    assert res["inter-node bytes/step vs ddp"]["ok"] is False


def test_check_targets_without_assgd_cannot_judge():
    res = C.check_targets([_row("ddp", 40.0, 0.8, 3e6)])
    assert len(res) == 1 and res[0]["ok"] is None


@pytest.mark.parametrize(("s", "nodes", "procs"), [("2x2", 2, 2), ("4X1", 4, 1)])
def test_parse_layout(s, nodes, procs):
    assert C.parse_layout(s) == M.Layout(nodes, procs)


@pytest.mark.parametrize("s", ["2", "2x", "0x2", "axb"])
def test_parse_layout_rejects(s):
    with pytest.raises(ValueError, match="layout"):
        C.parse_layout(s)


@pytest.mark.parametrize(("s", "bps"), [("100mbit", 1e8), ("1gbit", 1e9), ("2.5gbit", 2.5e9),
                                        ("300kbit", 3e5)])
def test_rate_bits_per_s(s, bps):
    assert C.rate_bits_per_s(s) == bps


def test_rate_rejects_bytes_units():
    with pytest.raises(ValueError, match="rate"):
        C.rate_bits_per_s("100mbps")


def test_table_lists_unavailable_methods():
    rows = [{**C.summarize_run(_result(), 0.7), "rate": "1gbit"},
            {"method": "assgd-4", "layout": "2x2", "rate": "1gbit",
             "status": "unavailable: qcomm.sgd is not in this checkout"}]
    text = C.table(rows)
    assert "unavailable" in text and "ddp" in text and "3.31 MB" in text
