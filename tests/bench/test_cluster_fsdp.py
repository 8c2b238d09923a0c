"""The cluster benchmark's sharded runs (``--fsdp``): which methods have a sharded form and why
the others do not, the byte formulas of one shard per rail, the flags' refusals, FSDP2's whole
model back from its shards and the mean of the shards between nodes (a pooled Gloo world of 2
nodes x 2 ranks), and whole runs of workload.py on this machine, every sharded method training a
small transformer: 2 nodes x 2 ranks with the environment torchrun gives them (no namespaces, no
link emulation), forked from a server that imported torch once (four interpreters and two
torchrun agents per run cost more than the runs; the smoke of the emulated cluster runs
workload.py under torchrun)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from bench.cluster import charlm
from bench.cluster import compare as C
from bench.cluster import methods as M
from bench.cluster import sharding as S
from bench.cluster import training as T
from bench.cluster import workload as WL
from bench.cluster import workloads as W
from qcomm.testing.multiprocess import free_ports, run_world
from tests.bench.test_cluster_kill import _error  # a flag refused: exit 2, argparse's message

REPO = Path(__file__).resolve().parents[2]
SHAPES = [[512, 40], [512], [512, 512], [512], [10, 512], [10]]
NUMEL = sum(M._prod(s) for s in SHAPES)


# ---------------------------------------------------------------------------------------------
# which methods run sharded


@pytest.mark.parametrize(("name", "form"), [
    ("hsdp", "mesh"),
    ("torchft-hsdp", "shard"),
    ("qcomm-hier-4", "shard"),
    ("qcomm-hier-4-h2f2-g100-n", "shard"),
    ("torchft-diloco", "shard"),
    ("torchft-diloco-h16-o10-m5", "shard"),
    ("torchft-streaming-diloco", "shard"),
    ("ddp", None), ("ddp-powersgd-r4", None), ("localsgd-p8", None), ("qcomm-hook", None),
    ("qcomm-hier-4-h2f2-g100-n-ddp", None), ("qcomm-hier-4-cont", None), ("assgd-4", None),
])
def test_sharded_forms(name, form):
    assert M.sharded_form(name) == form


@pytest.mark.parametrize(("name", "words"), [
    ("ddp", ["n/a with --fsdp", "whole model per rank", "hsdp"]),
    ("qcomm-hier-4-h2f2-g100-n-ddp", ["n/a with --fsdp", "DDP", "FSDP2 replaces"]),
    ("qcomm-hier-4-wf", ["n/a with --fsdp", "its own time"]),
])
def test_a_method_without_a_sharded_form_says_why(name, words):
    ok, why = M.applicability(name, "charlm", fsdp=True)
    assert not ok
    for w in words:
        assert w in why
    assert M.applicability(name, "charlm") == (True, "")


@pytest.mark.parametrize("name", ["hsdp", "torchft-hsdp"])
def test_hsdp_runs_only_sharded(name):
    ok, why = M.applicability(name, "charlm")
    assert not ok and "without --fsdp" in why
    assert M.applicability(name, "charlm", fsdp=True) == (True, "")
    assert M.METHODS[name].bits == 32


def test_hsdp_is_torchs_and_torchft_hsdp_needs_torchft():
    assert "hsdp" in M.parse_methods("torch") and M.METHODS["hsdp"].needs is None
    assert "torchft-hsdp" in M.parse_methods("torchft")
    assert M.METHODS["torchft-hsdp"].needs == "torchft"


def test_build_refuses_a_method_without_a_sharded_form_before_touching_the_model():
    module = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in module.parameters()]
    cfg = T.Config(lr=0.1, momentum=0.0, layout=T.Layout(2, 2), fsdp=True)
    with pytest.raises(ValueError, match=r"ddp.*n/a with --fsdp"):
        M.build("ddp", module, cfg)
    with pytest.raises(ValueError, match=r"hsdp.*without --fsdp"):
        M.build("hsdp", module, T.Config(lr=0.1, momentum=0.0, layout=T.Layout(2, 2)))
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert not S.is_sharded(module)


# ---------------------------------------------------------------------------------------------
# bytes: one shard per rail


@pytest.mark.parametrize("name", ["hsdp", "torchft-hsdp"])
@pytest.mark.parametrize(("nodes", "procs"), [(2, 2), (4, 1), (3, 2), (2, 4)])
def test_hsdp_sends_each_shard_allreduced_on_its_rail(name, nodes, procs):
    """A node's ranks each allreduce a 1/procs shard with their rail: 2 (N-1)/N of the fp32
    model per node, whatever procs is (DDP's ring sends the same, one rank per node)."""
    lay = T.Layout(nodes, procs)
    got = M.expected_inter_bytes(name, SHAPES, lay)
    assert got == pytest.approx(2 * (nodes - 1) / nodes * 4 * NUMEL)


def test_sharded_diloco_sends_one_shard_per_rail():
    """Replicated, every rank of a node allreduces the whole pseudo-gradient (procs copies);
    sharded, each rank its shard: procs times less."""
    lay = T.Layout(2, 2)
    whole = M.expected_inter_bytes("torchft-diloco-h16", SHAPES, lay, window=(5, 100))
    shard = M.expected_inter_bytes("torchft-diloco-h16", SHAPES, lay, window=(5, 100),
                                   sharded=True)
    assert shard == pytest.approx(whole / 2)
    # 100 steps from step 5 hold syncs after steps 15, 31, ..., 95: six of the model
    assert shard == pytest.approx(6 * 4 * NUMEL * 1.0 / 100)
    # the period named in the method (-h32) counts sharded as it does whole: 3 syncs
    named = M.expected_inter_bytes("torchft-diloco-h32", SHAPES, lay, window=(5, 100),
                                   sharded=True)
    assert named == pytest.approx(3 * 4 * NUMEL / 100)


# ---------------------------------------------------------------------------------------------
# the flags


@pytest.mark.parametrize(("extra", "words"), [
    (["--method", "ddp"], ["--method ddp", "n/a with --fsdp"]),
    (["--method", "hsdp", "--kill-node", "1", "--kill-at", "0.5"], ["--fsdp", "--kill-node"]),
    (["--method", "qcomm-hier-4", "--time-budget", "10"], ["--fsdp", "--time-budget"]),
    (["--method", "qcomm-hier-4", "--until-fastest"], ["--fsdp", "--until-fastest"]),
])
def test_workload_refuses_what_cannot_run_sharded(capsys, extra, words):
    err = _error(capsys, WL.parse_args, ["--data", "d", "--out", "o", "--fsdp", *extra])
    for w in words:
        assert w in err


def test_compare_passes_fsdp_on_and_refuses_it_with_a_lost_node(capsys, tmp_path):
    args = C.parse_args(["--fsdp", "--workload", "charlm", "--width", "256"])
    cmd = C.workload_command("charlm", "hsdp", args, tmp_path / "d.npz", tmp_path / "o.json",
                             "2x2")
    assert "--fsdp" in cmd
    wargs = WL.parse_args(cmd[1:])
    assert wargs.fsdp and wargs.width == 256 and WL.run_config(wargs)["fsdp"]
    plain = C.workload_command("charlm", "ddp", C.parse_args([]), tmp_path / "d.npz",
                               tmp_path / "o.json", "2x2")
    assert "--fsdp" not in plain
    err = _error(capsys, C.parse_args, ["--fsdp", "--kill-node", "1", "--kill-at", "0.5"])
    assert "--fsdp" in err and "--kill-node" in err


# ---------------------------------------------------------------------------------------------
# the sharding


def test_repeated_layers_are_the_blocks_or_the_layers():
    model = charlm.CharTransformer(width=16, layers=3, heads=2, context=8)
    assert S.repeated_layers(model) == list(model.blocks)
    mlp = W.make_mlp(8, 2)
    assert S.repeated_layers(mlp) == [m for m in mlp if isinstance(m, torch.nn.Linear)]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # width 12 over 2 ranks, vocabulary 128, 3 heads: uneven shards of some tensors (e.g. the
    # 3 x 12 rows of qkv split 18 + 18, the 12-long norms 6 + 6, the position table 9 rows
    # as 5 + 4)
    return charlm.CharTransformer(width=12, layers=2, heads=3, context=9)


def _sharding_body(rank: int, world: int) -> dict[str, Any]:
    lay = T.Layout(2, 2)
    node = rank // lay.procs
    out: dict[str, Any] = {}
    for form in ("shard", "mesh"):
        seed = node if form == "shard" else 7   # HSDP's replicas start equal
        whole = {k: v.clone() for k, v in _model(seed).state_dict().items()}
        module = S.shard(_model(seed), lay, form)
        out[f"{form}_sharded"] = S.is_sharded(module)
        out[f"{form}_gathered_equal"] = all(
            torch.equal(v, whole[k]) for k, v in S.full_state(module).items())
        out[f"{form}_local"] = sum(p.to_local().numel() for p in module.parameters())
        if form == "shard":
            S.average_rails(module, lay)
            out["averaged"] = S.full_state(module)
    return out


def test_shards_gather_to_the_whole_model_and_rails_average_the_nodes(gloo):
    res = gloo.run(_sharding_body, 4, timeout_s=120)
    total = sum(p.numel() for p in _model(0).parameters())
    for r in res:
        assert r["shard_sharded"] and r["mesh_sharded"]
        assert r["shard_gathered_equal"] and r["mesh_gathered_equal"]
    # each node's two ranks hold the model between them, once
    assert res[0]["shard_local"] + res[1]["shard_local"] == total
    assert res[0]["mesh_local"] + res[1]["mesh_local"] == total
    # the nodes' models differed (seeds 0 and 1); after the rails' average every rank holds
    # their mean: a sum of two floats and a halving, the float64 mean rounded (bit for bit)
    a, b = _model(0).state_dict(), _model(1).state_dict()
    for r in res:
        for k, v in r["averaged"].items():
            want = ((a[k].double() + b[k].double()) / 2).float()
            assert torch.equal(v, want), k


# ---------------------------------------------------------------------------------------------
# whole runs on this machine


@pytest.fixture(scope="module")
def charlm_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("charlm") / "charlm.npz"
    W.make_data("charlm", path, seed=0)
    return path


TINY = ["--workload", "charlm", "--width", "32", "--depth", "2", "--context", "16",
        "--steps", "12", "--warmup", "2", "--snapshots", "4", "--eval-windows", "32",
        "--baseline-steps", "2", "--diloco-sync-every", "4", "--pg-timeout", "60"]


SHARDED = ("hsdp", "torchft-hsdp", "qcomm-hier-4-h2f2-g100-n", "torchft-diloco-h4")


class _Left(Exception):
    """Raised in a test rank instead of workload.py's ``os._exit(code)``."""


def _workload_rank(rank: int, world: int, argv: list[str], port: int) -> int:
    """One rank of workload.py on a node of two, as torchrun starts it: torchrun's variables,
    then its main, which makes its own Gloo world through MASTER_ADDR:MASTER_PORT (the test
    world's group is left first). The code it leaves with (``os._exit``, once rank 0 wrote the
    JSON: it skips the group's teardown) comes back as the rank's result."""
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank % 2),
                      LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), GROUP_WORLD_SIZE="2",
                      QCB_IFACE="lo")
    with mock.patch.object(WL.os, "_exit", side_effect=_Left) as leave:
        try:
            WL.main(argv)
        except _Left:
            return leave.call_args.args[0]
    raise AssertionError("workload.py returned instead of leaving through os._exit")


def _two_nodes(method: str, data: Path, out: Path, *extra: str) -> dict[str, Any]:
    """workload.py as 2 nodes x 2 ranks on localhost; its JSON."""
    argv = ["--method", method, "--data", str(data), "--out", str(out), *TINY, *extra]
    (port,) = free_ports(1)
    # check_exit off: workload.py leaves its group to the OS rather than tear it down
    codes = run_world(_workload_rank, 4, args=(argv, port), timeout_s=240,
                      env={"OMP_NUM_THREADS": "1"}, check_exit=False)
    assert codes == [0, 0, 0, 0], codes
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(charlm_data, tmp_path_factory) -> dict[str, dict[str, Any]]:
    where = tmp_path_factory.mktemp("runs")
    out = {m: _two_nodes(m, charlm_data, where / f"{m}.json", "--fsdp")
           for m in SHARDED}
    out["ddp"] = _two_nodes("ddp", charlm_data, where / "ddp.json")
    return out


@pytest.mark.parametrize("method", SHARDED)
def test_every_sharded_method_trains_and_reports_whole_models(runs, method):
    r = runs[method]
    assert r["config"]["fsdp"] is True
    assert r["layout"] == {"nodes": 2, "procs": 2, "world": 4}
    curve = [p["val_loss"] for p in r["curve"]]
    # snapshot 0 and one at each of the 4 step marks, every one a whole model evaluated
    assert len(curve) == 5 and all(torch.isfinite(torch.tensor(curve)))
    assert curve[-1] < curve[0] - 0.3, curve
    assert r["final_val_loss"] < curve[0] - 0.3
    assert len(r["ranks"]) == 4 and all(x["steps"] == 12 for x in r["ranks"])


def test_hsdp_trains_as_ddp_does(runs):
    """HSDP's gradient is the mean over every rank, as DDP's: the same seed gives the same
    curve up to the order of the float additions (each node's shards reduce-scattered, then
    allreduced, against one allreduce)."""
    h, d = runs["hsdp"], runs["ddp"]
    for a, b in zip(h["curve"], d["curve"], strict=True):
        assert a["step"] == b["step"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=2e-3)
    assert h["final_val_loss"] == pytest.approx(d["final_val_loss"], abs=2e-3)
    assert h["model"]["params"] == d["model"]["params"]


def test_sharded_torchft_diloco_says_fsdp2_inside(runs):
    notes = runs["torchft-diloco-h4"]["notes"]
    assert notes["intra_node"] == "FSDP2"
    assert notes["fragment_numel"] == [runs["hsdp"]["model"]["params"]]


def test_torchft_hsdp_averages_as_hsdp_does(runs):
    """torchft's manager sums each shard over the two nodes and halves it, as FSDP2's own
    allreduce averages it: the same floats, so the same curve, bit for bit."""
    a, b = runs["torchft-hsdp"], runs["hsdp"]
    assert [p["val_loss"] for p in a["curve"]] == [p["val_loss"] for p in b["curve"]]
    assert a["final_val_loss"] == b["final_val_loss"]
