"""Unit tests of the cluster benchmark's pure-Python parts: method registry, byte formulas,
result parsing, repetitions and target checks. No root, no namespaces, no processes."""

from __future__ import annotations

import itertools

import pytest

from bench.cluster import compare as C
from bench.cluster import methods as M
from bench.cluster import torchft_methods as TF
from bench.cluster import training as T
from bench.cluster import workloads as W

SHAPES = [[512, 40], [512], [512, 512], [512], [512, 512], [512], [10, 512], [10]]
NUMEL = 551_434


def test_shapes_are_the_mnist1d_workloads_default_model():
    """SHAPES (the byte formulas' input below) are the parameters of the model the mnist1d
    workload builds by default, and M._prod counts them as torch does."""
    info = W.WORKLOADS["mnist1d"]
    model = W.make_mlp(info.width, info.depth)
    assert [list(p.shape) for p in model.parameters()] == SHAPES
    assert sum(M._prod(s) for s in SHAPES) == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# registry


def test_all_selects_every_family_and_each_method_once():
    """``--methods all`` runs what the three family selections run together, nothing twice."""
    everything = M.parse_methods("all")
    by_family = [n for f in M.FAMILIES for n in M.parse_methods(f)]
    assert len(set(everything)) == len(everything)
    assert sorted(everything) == sorted(by_family)
    assert M.parse_methods("") == everything


@pytest.mark.parametrize("name", list(M.METHODS))
def test_only_torch_methods_run_without_a_requirement(name):
    # availability() looks up `needs`; a torch method needing something could be skipped
    # on a machine that has torch, a qcomm or torchft method without one could never be.
    info = M.METHODS[name]
    assert info.family in M.FAMILIES
    assert (info.needs is None) == (info.family == "torch")


def test_every_torch_method_has_a_builder():
    for name, info in M.METHODS.items():
        if info.family == "torch":
            assert name in M.BUILDERS


@pytest.mark.parametrize(("spec", "want"), [
    ("torch", ["ddp", "ddp-fp16", "ddp-powersgd", "hsdp", "localsgd"]),
    ("torchft", ["torchft-diloco", "torchft-streaming-diloco", "torchft-hsdp"]),
    ("qcomm", ["qcomm-hook", "qcomm-hier-4", "assgd-8", "assgd-4", "assgd-2", "assgd-1",
               "assgd-4-ddp"]),
    ("ddp, assgd-4", ["ddp", "assgd-4"]),
])
def test_parse_methods(spec, want):
    assert M.parse_methods(spec) == want


def test_parse_methods_rejects_unknown_names_and_lists_the_known():
    with pytest.raises(ValueError, match=r"unknown.*'nope'.*ddp"):
        M.parse_methods("ddp,nope")
    with pytest.raises(ValueError) as info:
        M.parse_methods("ddp,nope")
    assert "did you mean" not in str(info.value)  # no name is near it


@pytest.mark.parametrize(("name", "near"), [
    ("dpp", "ddp"), ("torchft-diloc", "torchft-diloco"), ("qcom", "qcomm"), ("al", "all"),
])
def test_a_misspelled_method_names_the_nearest(name, near, capsys):
    with pytest.raises(ValueError, match=rf"unknown \['{name}'\].*; did you mean '{near}'\?$"):
        M.parse_methods(f"ddp,{name}")
    with pytest.raises(ValueError, match=rf"got '{name}'; did you mean '{near}'\?$"):
        M.build(name, None, None)
    from bench.cluster import workload as WL

    with pytest.raises(SystemExit):
        WL.parse_args(["--method", name, "--data", "d.npz", "--out", "o.json"])
    err = capsys.readouterr().err
    assert f"argument --method: unknown method '{name}'; did you mean '{near}'?" in err


def test_availability_torch_always_qcomm_by_module(monkeypatch):
    assert M.availability("ddp") == (True, "")
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    ok, why = M.availability("assgd-4")
    assert not ok and "unavailable" in why and "qcomm.sgd" in why
    assert M.availability("ddp-fp16") == (True, "")


def test_availability_torchft_names_the_package(monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    ok, why = M.availability("torchft-diloco")
    assert not ok and why == "unavailable: torchft is not installed"


def test_availability_of_a_missing_class_says_why(monkeypatch):
    # The module exists, the class does not (yet): unavailable, with the import error.
    import types

    monkeypatch.setattr(M.importlib, "import_module", lambda name: types.ModuleType(name))
    ok, why = M.availability("qcomm-hier-4")
    assert not ok
    assert why.startswith("unavailable: qcomm.sgd.HierarchicalOptimizer cannot be imported")
    assert "AttributeError" in why


def test_availability_of_a_present_class(monkeypatch):
    import types

    mod = types.ModuleType("qcomm.sgd")
    mod.HierarchicalOptimizer = object
    monkeypatch.setattr(M.importlib, "import_module", lambda name: mod)
    assert M.availability("qcomm-hier-4") == (True, "")


def test_applicability_keeps_assgd_on_mnist1d():
    assert M.applicability("assgd-4", "mnist1d") == (True, "")
    ok, why = M.applicability("assgd-4", "charlm")
    assert not ok and why.startswith("n/a on charlm") and "SGD" in why
    for name in ("ddp", "localsgd", "torchft-diloco", "qcomm-hook", "qcomm-hier-4"):
        assert M.applicability(name, "charlm") == (True, "")


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
    assert M.ring_allreduce_inter_bytes(1000, T.Layout(nodes, procs)) == pytest.approx(1000 * want)


def test_ddp_sends_a_ring_allreduce_of_the_fp32_model():
    assert M.expected_inter_bytes("ddp", SHAPES, T.Layout(2, 2)) == pytest.approx(1.5 * 4 * NUMEL)


@pytest.mark.parametrize(("method", "kwargs", "of_ddp"), [
    ("ddp-fp16", {}, 1 / 2),                       # half the bytes per element
    ("localsgd", {"localsgd_period": 8}, 1 / 8),   # one model average per period
])
def test_expected_bytes_relative_to_ddp(method, kwargs, of_ddp):
    lay = T.Layout(2, 2)
    full = M.expected_inter_bytes("ddp", SHAPES, lay)
    assert M.expected_inter_bytes(method, SHAPES, lay, **kwargs) == pytest.approx(full * of_ddp)


@pytest.mark.parametrize("method", ["assgd-4", "qcomm-hook"])
def test_qcomm_methods_have_no_formula_they_count_their_own_bytes(method):
    assert M.expected_inter_bytes(method, SHAPES, T.Layout(2, 2)) is None


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
    lay = T.Layout(2, 2)
    full = M.expected_inter_bytes("ddp", SHAPES, lay)
    got = M.expected_inter_bytes("localsgd", SHAPES, lay, localsgd_period=8, window=(5, 30))
    assert got == pytest.approx(full * 4 / 30)


@pytest.mark.parametrize(("nodes", "procs", "want"), [
    (1, 4, 0.0),            # one node: no rail crosses a link
    (2, 1, 1.0),            # each rail is a ring of 2: 2 (N-1)/N = 1, one rank per node
    (2, 2, 2.0),            # two rails, each carrying the whole buffer
    (4, 1, 1.5),
    (4, 2, 3.0),
])
def test_rail_allreduce_inter_bytes(nodes, procs, want):
    assert M.rail_allreduce_inter_bytes(1000, T.Layout(nodes, procs)) == pytest.approx(1000 * want)


@pytest.mark.parametrize(("first", "steps", "period", "delay", "want"), [
    (0, 16, 16, 0, [0]),          # plain DiLoCo: sync j after step 16j + 15
    (5, 48, 16, 0, [0, 1, 2]),    # steps 5..52: after 15, 31, 47
    (3, 40, 16, 0, [0, 1]),       # the CI smoke's window: steps 3..42
    (16, 15, 16, 0, []),          # steps 16..30: the next sync is after 31
    (5, 48, 4, 1, list(range(1, 13))),  # streaming, 4 fragments of H=16, delay 1: after 4j + 2
    (0, 3, 4, 1, [0]),
    (0, 2, 4, 1, []),
])
def test_diloco_syncs(first, steps, period, delay, want):
    assert M.diloco_syncs(first, steps, period, delay) == want


def test_diloco_syncs_rejects_a_delay_past_the_period():
    with pytest.raises(ValueError, match="delay"):
        M.diloco_syncs(0, 10, 4, 4)


def test_diloco_bytes_per_step():
    lay = T.Layout(2, 2)
    # one round per 16 steps, every rank of the node sends the whole model on its rail
    got = M.expected_inter_bytes("torchft-diloco", SHAPES, lay, diloco_sync_every=16)
    assert got == pytest.approx(2 * 1.0 * 4 * NUMEL / 16)
    # the window 5..52 holds 3 syncs of the whole model
    got = M.expected_inter_bytes("torchft-diloco", SHAPES, lay, diloco_sync_every=16,
                                 window=(5, 48))
    assert got == pytest.approx(3 * 2 * 4 * NUMEL / 48)


def _default_fragments(count: int) -> list[int]:
    """Parameters per fragment of the mnist1d default model as streaming DiLoCo cuts it (what
    a run records in its notes for the formula)."""
    info = W.WORKLOADS["mnist1d"]
    model = W.make_mlp(info.width, info.depth)
    return [sum(p.numel() for p in f.parameters()) for f in TF.split_fragments(model, count)]


def test_streaming_diloco_counts_each_fragment_it_sends():
    frags = _default_fragments(4)  # one Linear per fragment: 20_992, 262_656, 262_656, 5_130
    lay = T.Layout(2, 1)
    # period 4, delay 1: syncs j = 1..12 start in steps 5..52 -> fragments 1,2,3,0,1,2,3,0,...
    got = M.expected_inter_bytes("torchft-streaming-diloco", SHAPES, lay, diloco_sync_every=16,
                                 fragment_numel=frags, fragment_delay=1, window=(5, 48))
    assert got == pytest.approx(3 * NUMEL * 4 / 48)
    # a window of steps 5..10 holds syncs 1 and 2: fragments 1 and 2
    got = M.expected_inter_bytes("torchft-streaming-diloco", SHAPES, lay, diloco_sync_every=16,
                                 fragment_numel=frags, fragment_delay=1, window=(5, 6))
    assert got == pytest.approx((frags[1] + frags[2]) * 4 / 6)
    # without a window: every fragment once per 16 steps
    got = M.expected_inter_bytes("torchft-streaming-diloco", SHAPES, lay, diloco_sync_every=16,
                                 fragment_numel=frags, fragment_delay=1)
    assert got == pytest.approx(NUMEL * 4 / 16)


def test_diloco_formula_checks_its_fragments():
    with pytest.raises(ValueError, match="fragments hold"):
        M.expected_inter_bytes("torchft-streaming-diloco", SHAPES, T.Layout(2, 1),
                               fragment_numel=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        M.diloco_inter_bytes([1, 2, 3], T.Layout(2, 1), sync_every=16)


def test_powersgd_numel_follows_torchs_rule():
    # (512, 40) rank 4: 512*40 = 20480 >= (552)*4*2 = 4416 -> compressed to 552*4
    # (10, 512) rank 4: 5120 >= 522*4*2 = 4176 -> compressed to 522*4
    # (8, 8) rank 4: 64 < 16*4*2 -> sent as is; vectors always as is
    c, u = M.powersgd_numel([[512, 40], [10, 512], [8, 8], [512], [3, 2, 2]], rank=4)
    # (3, 2, 2) -> (3, 4), r = 3: 12 < 7*3*2 -> as is
    assert c == 552 * 4 + 522 * 4
    assert u == 64 + 512 + 12
    exp = M.expected_inter_bytes("ddp-powersgd", [[512, 40]], T.Layout(2, 1), powersgd_rank=4)
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
            "tcp_retrans_segs": 0 if r % procs == 0 else None,
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


def test_steps_to_target_is_the_first_reaching_snapshots_step():
    curve = [{"step": 0, "time_s": 0.0, "test_acc": 0.1},
             {"step": 10, "time_s": 3.5, "test_acc": 0.66},
             {"step": 20, "time_s": 6.0, "test_acc": 0.64}]
    assert C.steps_to_target(curve, 0.65) == 10
    assert C.steps_to_target(curve, 0.67) is None
    assert C.time_to_target(curve, 0.65) == 3.5


def test_aggregate_counts_a_repetition_that_never_reached_the_target_as_slowest_in_steps():
    reps = [{"status": "ok", "steps_to_target": s, "curve": [], "time_to_target_s": s}
            for s in (100, None, 120)]
    row = C.aggregate(reps)
    assert row["steps_to_target"] == 120 and row["spread"]["steps_to_target"] == [100, 120]
    assert C.aggregate(reps[1:2] + reps[1:2] + reps[:1])["steps_to_target"] is None


def test_time_to_target_of_a_loss_looks_for_at_most():
    curve = [{"step": 0, "time_s": 0.0, "val_loss": 4.8},
             {"step": 10, "time_s": 3.0, "val_loss": 2.2},
             {"step": 20, "time_s": 6.0, "val_loss": 1.9}]
    assert C.time_to_target(curve, 2.2, "val_loss", "min") == 3.0
    assert C.time_to_target(curve, 1.95, "val_loss", "min") == 6.0
    assert C.time_to_target(curve, 1.5, "val_loss", "min") is None


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


def test_summarize_reads_the_workload_and_its_metric():
    res = _result(curve=[{"step": 0, "time_s": 0.0, "val_loss": 4.8},
                         {"step": 100, "time_s": 9.0, "val_loss": 1.8}])
    res.update(workload="charlm", metric={"name": "val_loss", "goal": "min"}, final_val_loss=1.8)
    del res["final_test_acc"]
    row = C.summarize_run(res, target=1.9)
    assert row["workload"] == "charlm" and row["metric"] == "val_loss" and row["goal"] == "min"
    assert row["final"] == 1.8 and row["time_to_target_s"] == 9.0


def test_summarize_torchft_run_uses_its_fragments():
    res = _result("torchft-streaming-diloco", nodes=2, procs=1, steps=48)
    res["config"].update(warmup=5, diloco_sync_every=16)
    res["notes"] = {"sync_every": 16, "fragment_numel": _default_fragments(4),
                    "fragment_sync_delay": 1}
    row = C.summarize_run(res, target=0.7)
    assert row["bytes_reference"] == "formula"
    assert row["inter_bytes_formula"] == pytest.approx(3 * NUMEL * 4 / 48)


# ---------------------------------------------------------------------------------------------
# repetitions


def _rep(step, ttt, final=0.8, iface=100.0, diff=0.01):
    return {"method": "ddp", "workload": "mnist1d", "layout": "2x2", "rate": "1gbit",
            "status": "ok", "metric": "test_acc", "goal": "max", "step_median_s": step,
            "samples_per_s": 1 / step, "time_to_target_s": ttt, "final": final,
            "inter_bytes_iface": iface, "comm_fraction": 0.5, "loop_s": 10 * step,
            "bytes_rel_diff": diff, "payload_rel_diff": diff / 2, "bytes_reference": "formula",
            "inter_bytes_formula": 99.0, "inter_bytes_qcomm": None,
            "curve": [{"step": 0, "time_s": 0.0, "test_acc": step}]}


def test_aggregate_takes_medians_and_the_spread():
    row = C.aggregate([_rep(0.3, 30.0, 0.80), _rep(0.1, 10.0, 0.82, diff=0.03),
                       _rep(0.2, 20.0, 0.81)])
    assert row["repeats"] == row["repeats_ok"] == 3
    assert row["step_median_s"] == pytest.approx(0.2)
    assert row["spread"]["step_median_s"] == [0.1, 0.3]
    assert row["time_to_target_s"] == pytest.approx(20.0)
    assert row["spread"]["time_to_target_s"] == [10.0, 30.0]
    assert row["final"] == pytest.approx(0.81)
    assert row["bytes_rel_diff"] == pytest.approx(0.03)  # the worst repetition
    assert row["curve"][0]["test_acc"] == 0.2  # the median repetition's curve
    assert len(row["per_repeat"]) == 3
    # every repetition keeps its own curve, in run order, for verdicts on other targets
    assert [r["curve"][0]["test_acc"] for r in row["per_repeat"]] == [0.3, 0.1, 0.2]


def test_aggregate_counts_never_as_slowest():
    row = C.aggregate([_rep(0.1, None), _rep(0.2, 12.0), _rep(0.3, 14.0)])
    assert row["time_to_target_s"] == pytest.approx(14.0)
    assert row["spread"]["time_to_target_s"] == [12.0, 14.0]
    row = C.aggregate([_rep(0.1, None), _rep(0.2, None), _rep(0.3, 14.0)])
    assert row["time_to_target_s"] is None


def test_aggregate_keeps_failed_repetitions_visible():
    failed = {"method": "ddp", "workload": "mnist1d", "layout": "2x2", "rate": "1gbit",
              "status": "failed (exit 124)"}
    row = C.aggregate([_rep(0.1, 5.0), failed, _rep(0.3, 7.0)])
    assert row["status"] == "ok" and row["repeats"] == 3 and row["repeats_ok"] == 2
    assert row["failed_repeats"] == ["failed (exit 124)"]
    assert row["step_median_s"] == pytest.approx(0.2)
    only_failed = C.aggregate([failed])
    assert only_failed["status"] == "failed (exit 124)" and only_failed["repeats_ok"] == 0


def test_table_shows_medians_with_their_spread():
    row = {**C.aggregate([_rep(0.3, 30.0), _rep(0.1, 10.0), _rep(0.2, 20.0)])}
    text = C.table([row])
    assert "20.0 [10.0-30.0]" in text and "200.0 [100.0-300.0]" in text


def test_table_counts_the_repetitions_that_ran():
    row = C.aggregate([_rep(0.1, 5.0), {"method": "ddp", "workload": "mnist1d", "layout": "2x2",
                                        "rate": "1gbit", "status": "failed (exit 1)"}])
    assert " 1/2 " in C.table([row])


def _row(method, ttt, final, iface, metric="test_acc", goal="max"):
    return {"method": method, "status": "ok", "time_to_target_s": ttt, "final": final,
            "inter_bytes_iface": iface, "metric": metric, "goal": goal}


def test_check_targets_met():
    rows = [_row("ddp", 50.0, 0.80, 3e6), _row("ddp-fp16", 25.0, 0.80, 1.5e6),
            _row("assgd-4", 10.0, 0.795, 3e5)]
    res = {c["name"]: c for c in C.check_targets(rows)}
    assert res["time-to-target speedup over ddp"]["ok"] is True
    assert res["time-to-target speedup over ddp"]["value"] == pytest.approx(5.0)
    assert res["faster than ddp-fp16"]["ok"] is True
    assert res["final accuracy vs ddp (points)"]["ok"] is True
    assert res["inter-node bytes/step vs ddp"]["ok"] is True


def test_check_targets_missed():
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


def test_check_targets_on_a_loss_counts_torchft_peers_and_reports_the_difference():
    rows = [_row("ddp", 40.0, 1.80, 3e6, "val_loss", "min"),
            _row("torchft-diloco", 12.0, 1.85, 3e5, "val_loss", "min"),
            _row("qcomm-hier-4", 10.0, 1.83, 3e5, "val_loss", "min")]
    res = {c["name"]: c for c in C.check_targets(rows, "qcomm-hier-4")}
    assert res["time-to-target speedup over ddp"]["value"] == pytest.approx(4.0)
    assert res["faster than torchft-diloco"]["ok"] is True
    quality = res["final val_loss vs ddp (difference)"]
    assert quality["ok"] is None and quality["value"] == pytest.approx(0.03)


@pytest.mark.parametrize(("s", "nodes", "procs"), [("2x2", 2, 2), ("4X1", 4, 1)])
def test_parse_layout(s, nodes, procs):
    assert C.parse_layout(s) == T.Layout(nodes, procs)


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


def test_settings_fall_back_to_the_workload_defaults():
    args = C.parse_args(["--workload", "charlm", "--steps", "40"])
    s = C.settings("charlm", args)
    assert s["steps"] == 40 and s["lr"] == W.WORKLOADS["charlm"].lr
    assert s["target"] == W.WORKLOADS["charlm"].target
    assert C.settings("mnist1d", args)["batch"] == 32


def test_workload_command_carries_the_workload_and_diloco_settings(tmp_path):
    args = C.parse_args(["--workload", "charlm", "--diloco-sync-every", "8"])
    cmd = C.workload_command("charlm", "torchft-diloco", args, tmp_path / "d.npz",
                             tmp_path / "o.json", "2x2")
    assert cmd[cmd.index("--workload") + 1] == "charlm"
    assert cmd[cmd.index("--diloco-sync-every") + 1] == "8"
    assert cmd[cmd.index("--lr") + 1] == str(W.WORKLOADS["charlm"].lr)


def test_time_budget_is_one_for_every_layout_or_one_per_layout():
    assert C.parse_time_budget("8", "4x1,2x2") == {"4x1": 8.0, "2x2": 8.0}
    assert C.parse_time_budget("2X2=16, 4x1=8", "4x1,2x2") == {"4x1": 8.0, "2x2": 16.0}


@pytest.mark.parametrize(("budget", "match"), [
    ("soon", "SECONDS or LAYOUT=SECONDS"),
    ("4x1=8,2x2=", "'2x2='"),
    ("4x1=8,2by2=16", "'2by2=16'"),
    ("4x1=8", "no seconds for layout 2x2"),
    ("0", "seconds > 0"),
    ("4x1=8,2x2=-1", "seconds > 0"),
])
def test_a_bad_time_budget_is_refused_naming_the_flag(capsys, budget, match):
    with pytest.raises(SystemExit) as e:
        C.parse_args(["--layouts", "4x1,2x2", "--time-budget", budget])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--time-budget" in err and match in err


def test_each_run_gets_the_time_budget_of_its_layout(tmp_path):
    args = C.parse_args(["--layouts", "4x1,2x2", "--time-budget", "4x1=8,2x2=16"])
    seconds = {}
    for tag in ("4x1", "2x2"):
        cmd = C.workload_command("mnist1d", "assgd-2-ddp-wf", args, tmp_path / "d.npz",
                                 tmp_path / "o.json", tag)
        seconds[tag] = cmd[cmd.index("--time-budget") + 1]
    assert seconds == {"4x1": "8", "2x2": "16"}
    none = C.workload_command("mnist1d", "ddp", C.parse_args([]), tmp_path / "d.npz",
                              tmp_path / "o.json", "2x2")
    assert "--time-budget" not in none


def test_the_fastest_budget_ends_every_node_with_the_first_to_take_its_steps(tmp_path):
    assert C.parse_time_budget("fastest", "4x1,2x2") == {"4x1": "fastest", "2x2": "fastest"}
    args = C.parse_args(["--layouts", "4x1", "--time-budget", "fastest"])
    cmd = C.workload_command("mnist1d", "assgd-2-ddp-wf", args, tmp_path / "d.npz",
                             tmp_path / "o.json", "4x1")
    assert "--until-fastest" in cmd and "--time-budget" not in cmd
    # workload.py refuses both ways at once
    from bench.cluster import workload as WL

    with pytest.raises(SystemExit):
        WL.parse_args(["--method", "ddp", "--data", "d", "--out", "o", "--until-fastest",
                       "--time-budget", "8"])


def test_fastest_marks_thin_out_instead_of_stopping():
    from bench.cluster import workload as WL

    marks = WL.fastest_marks(0.5, 10)
    assert marks[:40] == [0.5 * k for k in range(1, 41)]          # 4 x snapshots, evenly
    gaps = [b - a for a, b in itertools.pairwise(marks[39:])]
    assert gaps[:5] == [1.0] * 5 and gaps[5:10] == [2.0] * 5     # then doubling blocks of 5
    assert marks == sorted(marks) and len(marks) == 40 + 6 * 5
    # a run 10 times the fastest node's compute still gets snapshots at its end
    assert marks[-1] > 10 * 0.5 * 10 and max(gaps) <= marks[-1] / 10


def test_quality_at_equal_steps_reads_the_fastest_node_where_nodes_differ():
    lockstep = [{"step": s, "time_s": s / 10, "test_acc": s / 1000} for s in (0, 150, 300)]
    assert C.quality_at_steps(lockstep, 300, "test_acc", (0.5, 1.0)) == {"150": 0.15,
                                                                         "300": 0.3}
    # wait-free: the nodes' mean step trails the fastest one's; the fastest decides
    wait_free = [{"step": 100, "fastest_step": 150, "time_s": 1, "test_acc": 0.4},
                 {"step": 200, "fastest_step": 290, "time_s": 2, "test_acc": 0.5}]
    assert C.quality_at_steps(wait_free, 300, "test_acc", (0.5, 1.0)) == {"150": 0.4,
                                                                          "300": None}
    # at equal work the nodes' mean step decides
    assert C.quality_at_steps(wait_free, 200, "test_acc", (0.5, 1.0), by="step") == {
        "100": 0.4, "200": 0.5}
    rows = [{"workload": "mnist1d", "layout": "4x1", "rate": "100mbit", "method": "m",
             "quality_at_steps": {"150": 0.4, "300": None}}]
    assert C.equal_steps_table(rows).splitlines()[-1] == "| mnist1d | 4x1 | 100mbit | m | 0.4 | - |"
    rows[0]["quality_at_steps_spread"] = {"150": [0.35, 0.45], "300": None}
    assert C.equal_steps_table(rows).splitlines()[-1] == \
        "| mnist1d | 4x1 | 100mbit | m | 0.4 [0.35-0.45] | - |"


def test_seed_per_repeat_changes_the_runs_seed_and_not_the_datas(tmp_path):
    args = C.parse_args(["--seed", "7", "--seed-per-repeat", "--workload", "mnist1d"])
    cmds = [C.workload_command("mnist1d", "ddp", args, tmp_path / "d.npz", tmp_path / "o.json",
                               "2x2", rep) for rep in (0, 2)]
    seeds = [c[c.index("--seed") + 1] for c in cmds]
    assert seeds == ["7", "9"]
    plain = C.parse_args(["--seed", "7", "--workload", "mnist1d"])
    cmd = C.workload_command("mnist1d", "ddp", plain, tmp_path / "d.npz", tmp_path / "o.json",
                             "2x2", 2)
    assert cmd[cmd.index("--seed") + 1] == "7"


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        C.parse_args(["--repeats", "0"])


# ---------------------------------------------------------------------------------------------
# qcomm variants by name


@pytest.mark.parametrize(("name", "want"), [
    ("assgd-4", {"kind": "assgd", "bits": 4, "ddp": False}),
    ("assgd-2-h8f4", {"kind": "assgd", "bits": 2, "ddp": False, "sync_every": 8,
                      "fragments": 4}),
    ("assgd-4-h8-s2-g30-m5-ddp", {"kind": "assgd", "bits": 4, "ddp": True, "sync_every": 8,
                                  "fragments": 1, "staleness": 2, "gamma": 0.3,
                                  "outer_momentum": 0.5}),
    ("qcomm-hier-4-h16f4", {"kind": "qcomm-hier", "bits": 4, "ddp": False, "sync_every": 16,
                            "fragments": 4}),
    ("assgd-2-h16f4-g50-m9-o5-n-ddp", {"kind": "assgd", "bits": 2, "ddp": True,
                                       "sync_every": 16, "fragments": 4, "gamma": 0.5,
                                       "outer_momentum": 0.9, "outer_lr": 0.5,
                                       "rounding": "nearest"}),
    ("assgd-4-h32f4-g100-m5-o7-complete-n-ddp", {"kind": "assgd", "bits": 4, "ddp": True,
                                                 "sync_every": 32, "fragments": 4, "gamma": 1.0,
                                                 "outer_momentum": 0.5, "outer_lr": 0.7,
                                                 "graph": "complete", "rounding": "nearest"}),
    ("assgd-3", None), ("assgd-4-x", None), ("ddp", None),
])
def test_qcomm_variant_names(name, want):
    assert M.qcomm_variant(name) == want
    assert (name in M.METHODS) == (want is not None or name == "ddp")


def test_an_assgd_variant_is_a_registry_entry_describing_its_options():
    assgd = M.METHODS["assgd-2-h8f4"]
    assert assgd.family == "qcomm" and assgd.bits == 2
    assert assgd.workloads == ("mnist1d", "mnist1d-bn")   # SGD workloads only
    assert "sync_every=8" in assgd.description and "fragments=4" in assgd.description


def test_a_hierarchical_variant_runs_on_every_workload_and_needs_the_optimizer():
    hier = M.METHODS["qcomm-hier-4-h8f4-ddp"]
    assert hier.workloads is None and hier.needs == "qcomm.sgd:HierarchicalOptimizer"


def test_variants_are_selectable_by_name():
    assert M.parse_methods("assgd-4-h8f4,ddp") == ["assgd-4-h8f4", "ddp"]


def test_a_name_that_is_no_variant_is_not_in_the_registry():
    with pytest.raises(KeyError):
        M.METHODS["assgd-16"]


@pytest.mark.parametrize(("name", "want"), [
    ("localsgd-p32", ("localsgd", {"localsgd_period": 32})),
    ("ddp-powersgd-r4", ("ddp-powersgd", {"powersgd_rank": 4})),
    ("torchft-diloco-h32-o7-m5", ("torchft-diloco", {"diloco_sync_every": 32,
                                                     "diloco_outer_lr": 0.7,
                                                     "diloco_outer_momentum": 0.5})),
    ("qcomm-hook-rs", ("qcomm-hook", {"hook_rail": "reduce_scatter"})),
    ("qcomm-hook-b2-ag", ("qcomm-hook", {"hook_bits": 2, "hook_rail": "all_gather"})),
    ("qcomm-hook-rs-n", ("qcomm-hook", {"hook_rail": "reduce_scatter",
                                        "hook_rounding": "nearest"})),
    ("qcomm-hook-st", ("qcomm-hook", {"hook_rounding": "stochastic"})),
    ("qcomm-hook-b2-c1-d4", ("qcomm-hook", {"hook_bits": 2, "hook_bucket_mb": 1.0,
                                            "hook_ddp_bucket_mb": 4.0})),
    ("qcomm-hook", None), ("torchft-diloco", None), ("qcomm-hook-rs2", None),
])
def test_peer_variant_names_set_config_fields(name, want):
    assert M.peer_variant(name) == want
    if want is not None:
        assert name in M.METHODS and M.resolve(name) == want


def _stop_votes(tmp_path, steps: int, flag_at: int | None) -> tuple[int, list[int]]:
    """timed_steps of a fake node of two ranks (rank 1: no snapshots) that ends at the fastest
    node's steps: the steps it took and the steps at which its ranks voted on stopping."""
    import types

    from bench.cluster import workload as WL

    votes: list[int] = []
    flag = tmp_path / "o.fastest"
    taken = [0]

    def node_any(stop: bool) -> bool:
        votes.append(taken[0])
        return stop

    def train_step(i: int) -> tuple[float, float]:
        taken[0] += 1
        if flag_at is not None and taken[0] == flag_at:
            flag.touch()   # another node took its steps first
        return 0.0, 0.0

    here = types.SimpleNamespace(rank=1, node=0, keeps_snapshots=False)
    args = types.SimpleNamespace(steps=steps, snapshots=4, profile=False, warmup=0)
    built = types.SimpleNamespace(node_any=node_any, sharded=False)
    timed = WL.timed_steps(args, here, built, train_step, None, 1000, None, tmp_path / "m",
                           fastest=(flag, 1.0))
    return timed.steps, votes


def test_a_node_votes_on_stopping_every_few_steps_and_at_its_last(tmp_path):
    every = 4
    steps, votes = _stop_votes(tmp_path, 10, None)
    assert steps == 10 and votes == [0, 4, 8, 10]   # at its own --steps, whatever the phase
    (tmp_path / "b").mkdir()
    steps, votes = _stop_votes(tmp_path / "b", 100, 6)
    assert steps == 8 and votes == [0, 4, 8]         # the flag is seen at the next vote
    assert all(v % every == 0 for v in votes)


def test_equal_cpu_caps_every_node_and_goes_with_slow_nodes(tmp_path):
    args = C.parse_args(["--layouts", "4x1", "--equal-cpu"])
    cmd = C.launch_command("abc", T.Layout(4, 1), ["w.py"], 60, tmp_path / "r.log",
                           equal_cpu=args.equal_cpu)
    assert "--equal-cpu" in cmd and cmd[cmd.index("--") + 1:] == ["w.py"]
    plain = C.launch_command("abc", T.Layout(4, 1), ["w.py"], 60, tmp_path / "r.log")
    assert "--equal-cpu" not in plain
    args = C.parse_args(["--layouts", "4x1", "--equal-cpu", "--slow-nodes", "1"])
    cmd = C.launch_command("abc", T.Layout(4, 1), ["w.py"], 60, tmp_path / "r.log",
                           (args.slow_nodes, args.slowdown), equal_cpu=args.equal_cpu)
    assert "--equal-cpu" in cmd and cmd[cmd.index("--slow-nodes") + 1] == "1"


def _budget_run(method: str, steps_by_node: list[int], *, budget: float | None = 8.0,
                max_steps: int | None = 500) -> dict:
    ranks = [{"node": n, "local_rank": lr, "steps": s}
             for n, s in enumerate(steps_by_node) for lr in range(2)]
    return {"method": method, "ranks": ranks,
            "config": {"steps": 100, "time_budget": budget, "max_steps": max_steps}}


def test_a_node_stopped_by_max_steps_under_a_time_budget_is_named():
    from bench.cluster.run_summary import capped_nodes

    # node 1 reached the cap: its budget did not decide where it ended; node 0 did not
    assert capped_nodes(_budget_run("slow-link", [420, 500])) == [1]
    assert capped_nodes(_budget_run("slow-link", [420, 499])) == []
    # without --max-steps the cap is 100 x --steps
    assert capped_nodes(_budget_run("slow-link", [10_000, 9_000], max_steps=None)) == [0]
    # no budget in seconds, or a method whose nodes take --steps: nothing to name
    assert capped_nodes(_budget_run("slow-link", [500, 500], budget=None)) == []
    assert capped_nodes(_budget_run("ddp", [500, 500])) == []
