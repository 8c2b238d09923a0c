"""The peers' recoveries from a lost node that comes back (bench/cluster/recovery.py: torchrun's
elastic restart from a checkpoint, torchft's heal), without a cluster: its flags, how compare.py
launches them, and how the lives of its ranks become one run's record. The launch itself runs as
root on the emulated cluster (bench/cluster_smoke.sh)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.cluster import compare as C
from bench.cluster import methods as M
from bench.cluster import recovery as R
from bench.cluster import rejoining as J
from bench.cluster import training as T

CLUSTER = Path(__file__).resolve().parents[2] / "bench" / "cluster"
GOOD = ["--method", "ddp", "--data", "d.npz", "--out", "o.json", "--time-budget", "30",
        "--kill-node", "1", "--kill-at", "0.1", "--join-at", "0.2"]


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        R.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("change", "names"), [
    ({"--method": "ddp-powersgd-r4"}, ["--method", "ddp, localsgd, torchft-diloco"]),
    ({"--method": "assgd-4-h4f2-cont"}, ["--method"]),
    ({"--join-at": None}, ["--join-at"]),
    ({"--kill-at": "0.3"}, ["--kill-at", "--join-at", "0.3"]),
    ({"--time-budget": "0"}, ["--time-budget"]),
    ({"--ckpt-every-s": "0"}, ["--ckpt-every-s"]),
    ({"--fsdp": True}, ["--fsdp"]),
])
def test_bad_flags_are_refused_by_name(capsys, change, names) -> None:
    argv = list(GOOD)
    for flag, value in change.items():
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
        if value is True:
            argv.append(flag)
        elif value is not None:
            argv += [flag, value]
    err = _error(capsys, argv)
    for name in names:
        assert name in err


def test_good_flags_parse_with_the_workloads_defaults() -> None:
    args = R.parse_args([*GOOD, "--method", "localsgd-p32"])
    assert (args.method, args.snapshots, args.ckpt_every_s) == ("localsgd-p32", 60, 1.0)


@pytest.mark.parametrize(("name", "elastic", "heals"), [
    ("ddp", True, False), ("localsgd", True, False), ("localsgd-p32", True, False),
    ("ddp-powersgd-r4", False, False), ("torchft-diloco-h32", False, True),
    ("torchft-streaming-diloco-h32-o7-m5", False, True), ("torchft-hsdp", False, False),
    ("assgd-2-h16f4-g80-m9-o5-n-ddp-cont", False, False)])
def test_which_methods_recover_how(name, elastic, heals) -> None:
    assert M.restarts_elastically(name) is elastic
    assert M.heals(name) is heals
    assert M.recovers_by_itself(name) is (elastic or heals)


def test_compare_runs_the_peers_own_recoveries_and_qcomm_under_its_own_join(tmp_path) -> None:
    args = C.parse_args(["--layouts", "4x1", "--time-budget", "30", "--kill-node", "1",
                         "--kill-at", "0.1", "--join-at", "0.2",
                         "--methods", "ddp,localsgd-p32,torchft-diloco-h32,assgd-4-h4f2-cont"])
    out = tmp_path / "o.json"
    for name in ("ddp", "localsgd-p32", "torchft-diloco-h32"):
        cmd = C.workload_command("mnist1d", name, args, tmp_path / "d.npz", out, "4x1")
        assert Path(cmd[0]) == C.RECOVERY
        parsed = R.parse_args(cmd[1:])   # every flag compare.py passes, recovery.py takes
        assert (parsed.kill_node, parsed.kill_at, parsed.join_at) == (1, 0.1, 0.2)
        assert parsed.time_budget == 30
    cmd = C.workload_command("mnist1d", "assgd-4-h4f2-cont", args, tmp_path / "d.npz", out,
                             "4x1")
    assert Path(cmd[0]) == C.WORKLOAD
    # without --join-at DDP runs in workload.py, as every healthy or lost-node run does
    plain = C.parse_args(["--layouts", "4x1"])
    assert Path(C.workload_command("mnist1d", "ddp", plain, tmp_path / "d.npz", out,
                                   "4x1")[0]) == C.WORKLOAD


def test_the_launch_restarts_the_lost_nodes_torchrun_at_the_rejoin_files_time(tmp_path) -> None:
    lay, rejoin = T.Layout(4, 1), tmp_path / "o.json.rejoin"
    cmd = C.launch_command("c1", lay, ["x.py"], 100, tmp_path / "r.log", lost=1,
                           comes_back=True, rejoin=("elastic", rejoin))
    assert "--linked" not in cmd and "--lost-node" not in cmd
    i = cmd.index("--elastic")
    assert cmd[i + 1:i + 5] == ["--restart-node", "1", "--rejoin-file", str(rejoin)]
    # torchft's heal: a torchrun per node (linked), the node's torchrun started again
    heal = C.launch_command("c1", lay, ["x.py"], 100, tmp_path / "r.log", lost=1,
                            comes_back=True, rejoin=("heal", rejoin))
    i = heal.index("--linked")
    assert heal[i + 1:i + 5] == ["--restart-node", "1", "--rejoin-file", str(rejoin)]
    assert "--elastic" not in heal
    linked = C.launch_command("c1", lay, ["x.py"], 100, tmp_path / "r.log", lost=1,
                              comes_back=True)
    assert "--linked" in linked and "--rejoin-file" not in linked


def _life(node: int, start: float, ends: list[float], baseline: list[float] | None = None,
          seat: float | None = None) -> dict:
    return {"node": node, "local_rank": 0, "process_start": start,
            "seat_taken": start + 0.5 if seat is None else seat, "step_ends": ends,
            "step_times": [0.1] * len(ends), "fwd_bwd": [0.05] * len(ends),
            "opt_times": [0.01] * len(ends), "baseline": baseline or [],
            "resumed_at_step": 0, "status": "finished"}


def test_a_ranks_lives_merge_into_one_record() -> None:
    opened = 100.0
    lives = [_life(0, 95.0, [101.0, 102.0, 103.0], baseline=[0.02, 0.04]),
             _life(0, 110.0, [114.0, 115.0]),
             _life(1, 95.0, [101.0, 102.5], baseline=[0.03])]
    merged = R.merge_lives(lives, procs=1, opened=opened)
    assert [r["rank"] for r in merged] == [0, 1]
    first = merged[0]
    assert first["steps"] == 5 and first["lives"] == 2
    assert first["step_ends"] == [101.0, 102.0, 103.0, 114.0, 115.0]
    assert first["baseline_median_s"] == pytest.approx(0.03)   # its first life's baseline
    assert first["loop_s"] == pytest.approx(15.0)              # window to its last step
    assert first["iface_tx_bytes"] is None and first["status"] == "finished"
    assert merged[1]["steps"] == 2 and merged[1]["lives"] == 1


def test_the_joiners_timeline_starts_when_its_torchrun_starts_again() -> None:
    lives = [_life(1, 95.0, [101.0, 102.0]),            # its first life, killed
             _life(1, 111.0, [118.0, 119.0], seat=114.0),
             _life(0, 95.0, [101.0])]
    t = R.joiner_timeline(lives, node=1, back=110.0)
    assert t == {"process_start": 110.0, "build_start": 110.0, "seat_taken": 114.0,
                 "first_step_end": 118.0}
    assert R.joiner_timeline(lives[:1], node=1, back=110.0)["first_step_end"] is None


def test_a_restart_that_stops_the_running_nodes_is_measured_against_the_loss() -> None:
    """The running nodes of an elastic restart take no step between the loss and the join, so
    the rate before the join is undefined and the rate before the loss says what the join
    cost: nothing ran for most of the window."""
    running = [100 + i / 10 for i in range(30)] + [118.0 + i / 10 for i in range(30)]
    ranks = [{"rank": 0, "node": 0, "step_ends": running},
             {"rank": 1, "node": 1, "step_ends": [118.0],
              "timeline": R.joiner_timeline([_life(1, 111.0, [118.0], seat=114.0)], 1, 110.0)}]
    s = J.join_summary(ranks, kill_time=103.0, join_node=1)
    assert s["running_rate_vs_before_join_min"] is None
    assert s["kill_to_first_step_s"] == pytest.approx(15.0)
    assert s["restart_to_first_step_s"] == pytest.approx(8.0)
    # 10 steps in the window 110..119 against 10/s before the loss
    assert s["running_rate_vs_before_kill_median"] == pytest.approx(10 / 9 / 10, rel=1e-6)


@pytest.mark.skipif(os.geteuid() != 0, reason="netns.sh needs root before it reads arguments")
@pytest.mark.parametrize(("extra", "name"), [
    (["--elastic", "--restart-node", "1"], "--rejoin-file"),
    (["--elastic", "--rejoin-file", "f"], "--restart-node"),
    (["--rejoin-file", "f"], "--elastic or --linked"),
    (["--linked", "--rejoin-file", "f"], "--restart-node"),
    (["--elastic", "--linked", "--restart-node", "1", "--rejoin-file", "f"], "--linked"),
])
def test_netns_launch_refuses_an_incomplete_elastic_launch(extra, name) -> None:
    proc = subprocess.run(["bash", str(CLUSTER / "netns.sh"), "launch", "--id", "zz9", "--nodes",
                           "4", "--procs", "1", *extra, "--", "x.py"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and name in proc.stderr


def test_a_healed_group_takes_part_from_its_step_after_the_heal() -> None:
    """torchft's heal: the returning group's steps before its first quorum are overwritten by
    the state it fetches there, so its return counts from the step after (contributes_from)."""
    life = _life(1, 111.0, [114.0, 114.1, 116.5, 116.6], seat=113.0)
    life["contributes_from"] = 116.5
    t = R.joiner_timeline([life], node=1, back=110.0)
    assert t["first_step_end"] == 116.5


def test_the_checkpoint_transport_names_the_node_by_its_routable_address() -> None:
    import socket
    from datetime import timedelta

    from bench.cluster import torchft_methods as TF

    transport = TF._routable_http_transport("10.77.0.3", timedelta(seconds=5))
    try:
        addr = transport.address()
        assert addr.startswith("http://10.77.0.3:") and addr.endswith("/checkpoint/")
        assert socket.gethostname() not in addr
    finally:
        transport.shutdown(wait=False)
