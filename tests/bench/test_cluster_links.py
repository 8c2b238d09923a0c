"""compare.py's ``--links``, without a cluster: what netns.sh gets (the linked launch, each
node's port, the rendezvous's, the firewall), what workload.py gets, and the settings refused
by name. netns.sh's own refusals of a bad firewall need root (it checks root first)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.cluster import compare as C
from bench.cluster import training as T
from bench.cluster import workload as WL

CLUSTER = Path(__file__).resolve().parents[2] / "bench" / "cluster"


@pytest.mark.parametrize(("links", "words"), [
    ("world", []), ("gloo", ["--linked"]),
    ("sockets", ["--linked", "--listen", "29500", "--port", "29400"])])
def test_the_launch_links_the_nodes_as_asked(tmp_path, links, words) -> None:
    cmd = C.launch_command("abc", T.Layout(4, 1), ["w.py"], 60, tmp_path / "r.log",
                           links=links)
    launch = cmd[:cmd.index("--")]
    assert [w for w in launch if w in ("--linked", "--listen", "29500", "--port", "29400")] \
        == words
    assert cmd[cmd.index("--") + 1:] == ["w.py"]


def test_the_firewall_opens_one_port_per_rank_and_the_rendezvous_on_node_0() -> None:
    assert C.firewall_args("world", T.Layout(4, 1)) == []
    assert C.firewall_args("gloo", T.Layout(4, 1)) == []
    assert C.firewall_args("sockets", T.Layout(2, 2)) == ["--firewall", "29500,29501",
                                                          "--firewall0", "29400"]


def test_links_reach_the_workload(tmp_path) -> None:
    args = C.parse_args(["--layouts", "4x1", "--methods", "slow-link", "--links", "sockets",
                         "--time-budget", "fastest"])
    cmd = C.workload_command("mnist1d", "slow-link", args, tmp_path / "d.npz",
                             tmp_path / "o.json", "4x1")
    assert cmd[cmd.index("--links") + 1] == "sockets"
    assert WL.parse_args(cmd[1:]).links == "sockets"
    plain = C.workload_command("mnist1d", "slow-link", C.parse_args(["--layouts", "4x1"]),
                               tmp_path / "d.npz", tmp_path / "o.json", "4x1")
    assert "--links" not in plain   # world, the default, is left out


@pytest.mark.parametrize("extra", [["--kill-node", "1", "--kill-at", "0.3"], ["--fsdp"]])
def test_links_with_a_lost_node_or_sharding_are_refused_by_name(capsys, extra) -> None:
    with pytest.raises(SystemExit) as info:
        C.parse_args(["--links", "sockets", "--methods", "slow-link", *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--links sockets" in err and extra[0] in err


def test_linked_nodes_need_a_method_that_continues(tmp_path) -> None:
    args = C.parse_args(["--layouts", "4x1", "--methods", "slow-link,assgd-4", "--links",
                         "gloo", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--links gloo .* not assgd-4$"):
        C.plan(args)


@pytest.mark.skipif(os.geteuid() != 0, reason="netns.sh needs root before it reads arguments")
@pytest.mark.parametrize(("flags", "said"), [
    (["--firewall", "29500,x"], "--firewall must be a comma list of TCP ports"),
    (["--firewall", "70000"], "--firewall: port 70000 is not in [1, 65535]"),
    (["--firewall0", "29400"], "--firewall0 goes with --firewall"),
    (["--nat-node", "3"], "--nat-node must be an integer in [0, nodes)"),
])
def test_netns_refuses_a_bad_firewall_by_name(flags, said) -> None:
    proc = subprocess.run(["bash", str(CLUSTER / "netns.sh"), "up", "--id", "zz8", "--nodes",
                           "3", "--rate", "1gbit", *flags], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not Path("/run/netns/qcbzz8n0").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="netns.sh needs root before it reads arguments")
def test_netns_refuses_listen_without_linked() -> None:
    proc = subprocess.run(["bash", str(CLUSTER / "netns.sh"), "launch", "--id", "zz8",
                           "--nodes", "2", "--procs", "1", "--listen", "29500", "--", "w.py"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--listen goes with --linked" in proc.stderr, proc.stderr
