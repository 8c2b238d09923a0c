"""The guide's two-site recipe (docs/guide.md, "Across sites") on the emulated cluster, as sites
would run it: machines a, b, c and one more (the internet's: machine b's public address, a port
forward, and a stray process) are network namespaces (bench/cluster/netns.sh) behind a
firewall that lets a new TCP connection in only on the link port 29500 (and the rendezvous's
29400 on a), c behind a NAT that lets none in. The guide's commands run as written, but for
the addresses (the cluster's) and a tiny model's steps.

Checked, in one job of three nodes: the firewall bites (a connection to a port it does not
open, or to c at all, never gets through); the job trains over one-port TCP links with the
token, encrypted, c dialling both of its links; a bit flipped by b's port forward ends that
link as a named lost peer (its frame fails its authentication); b's worker is then killed, its
torchrun starts it again and it rejoins; meanwhile a stray process with a wrong token is
refused by the rendezvous and by a node's port, both logged, and the job goes on; the three
end with one model. Root only (namespaces); it says so and skips otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qcomm.testing.multiprocess import descendants
from tests.examples.test_train_charlm import TINY, TORCHRUN
from tests.rendezvous.test_launch import STOP_FILE
from tests.rendezvous.test_rejoin import LINKED, STEPS, _assert_rejoined, _end_once_back

REPO = Path(__file__).resolve().parents[2]
NETNS = REPO / "bench" / "cluster" / "netns.sh"
GUIDE = REPO / "docs" / "guide.md"
VENV = Path(sys.executable).parent.parent
LINK_PORT, RENDEZVOUS_PORT, CLOSED_PORT = 29500, 29400, 29600
# The guide's public addresses, and the cluster's machines that stand for them: a is node 0's
# namespace, b's public address the port forward on the fourth namespace (the internet's).
ADDRESSES = {"203.0.113.9": "10.77.0.1", "198.51.100.7": "10.77.0.4"}
WAIT_S = 150   # the longest any wait here takes: a hang fails the test

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster's network namespaces "
                       "need root (bench/cluster/netns.sh)"),
    pytest.mark.skipif(shutil.which("tc") is None or shutil.which("ip") is None,
                       reason="the emulated cluster needs iproute2's ip and tc"),
    pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun next to {sys.executable}"),
]

# Probes one TCP port from inside a namespace: "open" when a connection is made within 3 s.
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("open")
except OSError as e:
    print(f"closed: {e}")
"""
# Listens on a port (answering nothing) until killed, for the probes.
LISTEN = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    s.accept()
"""
# A process that is not of the job, with a wrong token: takes a seat at the rendezvous.
STRAY_SEAT = """
from qcomm.rendezvous import init_node
try:
    init_node(timeout_s=20)
    print("seated")
except Exception as e:
    print(f"refused: {type(e).__name__}: {e}")
"""
# The same, dialling a node's link port as one of the job's links.
STRAY_LINK = """
import os, socket, sys
from qcomm.wire.admission import AdmissionError, dial
from qcomm.wire.frames import FrameError
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
try:
    dial(sock, {"link": "qcomm/link/rail0/0.1-1.1/1/", "member": 1, "incarnation": 1},
         os.environ["QCOMM_TOKEN"].encode())
    print("admitted")
except (AdmissionError, FrameError) as e:
    print(f"refused: {type(e).__name__}: {e}")
"""


def guide_commands() -> tuple[str, list[str]]:
    """The guide's "Across sites" recipe: (the rendezvous's command, the nodes' commands a, b,
    c), continuation lines joined, comments dropped."""
    text = GUIDE.read_text()
    section = text[text.index("### Across sites"):]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    commands = [" ".join(c.split()) for c in block.replace("\\\n", " ").splitlines()
                if c.strip() and not c.lstrip().startswith("#")]
    rendezvous = [c for c in commands if "-m qcomm.rendezvous" in c]
    nodes = [c for c in commands if "torchrun" in c]
    assert len(rendezvous) == 1 and len(nodes) == 3, commands
    return rendezvous[0], nodes


def on_cluster(command: str) -> str:
    """A node's command of the guide with the cluster's addresses and a tiny model's steps."""
    for public, here in ADDRESSES.items():
        command = command.replace(public, here)
    assert " --steps 3000 " in command + " ", command
    # Later flags win: LINKED's steps, not TINY's. A minute before a silent link counts as lost
    # (LINKED's 20 s lets a node that waits 10 s for a busy neighbour drop it): 3 nodes, a port
    # forward and their startups share 2 cores here, where a node that joins, or starts while
    # the others train, can leave a link unread for longer; a node killed or a link tampered
    # with is a lost peer at once, whatever this says.
    tiny = shlex.join([*TINY, *LINKED, "--timeout-s", "60"])
    return command.replace("--steps 3000", tiny)


class Site:
    """The cluster (four namespaces behind the firewall) and what runs in it, each process's
    output in a file of its own."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.id = tmp, secrets.token_hex(2)
        self.procs: dict[str, subprocess.Popen] = {}
        self.token = secrets.token_hex(16)
        # The guide's working directory: its .venv and examples/; its ~/.qcomm_token.
        (tmp / ".venv").symlink_to(VENV)
        (tmp / "examples").symlink_to(REPO / "examples")
        (tmp / ".qcomm_token").write_text(self.token + "\n")
        (tmp / ".qcomm_token").chmod(0o600)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QCOMM_")}
        self.env.update(HOME=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        subprocess.run(["bash", str(NETNS), "up", "--id", self.id, "--nodes", "4", "--rate",
                        "1gbit", "--owner", str(os.getpid()), "--firewall", str(LINK_PORT),
                        "--firewall0", str(RENDEZVOUS_PORT), "--nat-node", "2"],
                       check=True, timeout=60)

    def ns(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", f"qcb{self.id}n{k}"]

    def start(self, name: str, k: int, argv: list[str], env: dict[str, str] | None = None
              ) -> None:
        with open(self.log(name), "w") as f:
            self.procs[name] = subprocess.Popen(
                [*self.ns(k), *argv], cwd=self.tmp, env=dict(self.env, **(env or {})),
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, k: int, program: str, *args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run([*self.ns(k), sys.executable, "-c", program, *args],
                              cwd=self.tmp, env=dict(self.env, **(env or {})), text=True,
                              capture_output=True, timeout=60).stdout.strip()

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def output(self, name: str) -> str:
        return self.log(name).read_text()

    def wait_for(self, name: str, pattern: str) -> re.Match:
        deadline = time.monotonic() + WAIT_S
        while (m := re.search(pattern, self.output(name), re.M)) is None:
            assert time.monotonic() < deadline, f"{name}: {self.output(name)[-3000:]}"
            assert self.procs[name].poll() is None, f"{name}: {self.output(name)[-3000:]}"
            time.sleep(0.1)
        return m

    def exit_codes(self, names: list[str]) -> list[int | None]:
        deadline = time.monotonic() + WAIT_S
        while any(self.procs[n].poll() is None for n in names) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [self.procs[n].poll() for n in names]

    def stop(self) -> None:
        for p in self.procs.values():
            pids = [*descendants(p.pid), p.pid] if p.poll() is None else []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        subprocess.run(["bash", str(NETNS), "down", "--id", self.id], timeout=60)


class Nodes:
    """The job's nodes as tests.rendezvous.test_rejoin's checks and ends read them: node n's
    output, a wait for a line of it, and the job's end (its --stop-file, in the nodes' working
    directory)."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def output(self, node: int) -> str:
        return self.site.output(f"node{node}")

    def wait_for(self, node: int, pattern: str) -> None:
        self.site.wait_for(f"node{node}", pattern)

    def end(self) -> None:
        (self.site.tmp / STOP_FILE).touch()


@pytest.fixture
def site(tmp_path: Path):
    s = Site(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def check_the_firewall_bites(site: Site) -> None:
    """A listener on a port the firewall does not open (on a), and on the link port of c
    (behind the NAT): no connection from another machine gets through; c dials out."""
    site.start("closed-a", 0, [sys.executable, "-c", LISTEN, str(CLOSED_PORT)])
    site.start("closed-c", 2, [sys.executable, "-c", LISTEN, str(LINK_PORT)])
    site.start("open-a", 0, [sys.executable, "-c", LISTEN, str(LINK_PORT)])
    for name in ("closed-a", "closed-c", "open-a"):
        site.wait_for(name, "^listening")
    assert site.run(1, PROBE, "10.77.0.1", str(CLOSED_PORT)).startswith("closed"), \
        "the firewall let a connection in on a port it does not open"
    assert site.run(1, PROBE, "10.77.0.3", str(LINK_PORT)).startswith("closed"), \
        "the NAT let a connection in"
    assert site.run(1, PROBE, "10.77.0.1", str(LINK_PORT)) == "open"   # the open port is
    assert site.run(2, PROBE, "10.77.0.1", str(LINK_PORT)) == "open"   # and c dials out
    for name in ("closed-a", "closed-c", "open-a"):
        os.killpg(site.procs.pop(name).pid, signal.SIGKILL)


def test_the_guides_two_site_recipe_behind_a_firewall_and_a_nat(site: Site) -> None:
    check_the_firewall_bites(site)
    rendezvous, nodes = guide_commands()
    # b's public address: a port forward on the fourth machine to b's port, which turns into
    # a man in the middle once the flip file exists
    flip = site.tmp / "flip"
    site.start("forward", 3, [sys.executable, "-m", "qcomm.testing.tampering_forwarder",
                              "--listen", f"10.77.0.4:{LINK_PORT}",
                              "--to", f"10.77.0.2:{LINK_PORT}", "--flip-file", str(flip)])
    site.wait_for("forward", "^forwarding")
    site.start("rendezvous", 0, ["bash", "-c", rendezvous])
    site.wait_for("rendezvous", "admitting only the job token's holders, encrypted")
    for n, command in enumerate(nodes):   # seats in order of arrival: a, b, c
        site.start(f"node{n}", n, ["bash", "-c", on_cluster(command)])
        site.wait_for(f"node{n}", r"parameters; 3 processes")
    for n in range(3):   # every node trains (they started one after the other)
        site.wait_for(f"node{n}", rf"^step 200/{STEPS}")
    # a bit flipped on the way to b: the link c -> b ends, named, on b (its frame fails its
    # authentication), and on c
    flip.touch()
    site.wait_for("forward", r"^flipped a bit of the connection from 10\.77\.0\.3")
    site.wait_for("node1", r"rank 1 dropped its gossip neighbour rank 2 at step \d+ "
                           r"\(PeerLostError: .*failed its authentication")
    site.wait_for("node2", r"rank 2 dropped its gossip neighbour rank 1 at step \d+ "
                           r"\(PeerLostError")
    # then b's worker dies; its torchrun starts it again and it rejoins
    for pid in descendants(site.procs["node1"].pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_text()
            if "train_charlm" in argv and "torchrun" not in argv:
                os.kill(pid, signal.SIGKILL)
    # strays with a wrong token, from the fourth machine: refused, the job goes on
    wrong = {"QCOMM_TOKEN": "a-wrong-token-0123456789abcdef",
             "QCOMM_RENDEZVOUS": f"10.77.0.1:{RENDEZVOUS_PORT}"}
    said = site.run(3, STRAY_SEAT, env=wrong)
    assert said.startswith("refused: AdmissionError"), said
    said = site.run(3, STRAY_LINK, "10.77.0.1", str(LINK_PORT), env=wrong)
    assert said.startswith("refused: AdmissionError"), said
    _end_once_back(Nodes(site))   # b back and linked: the job ends at its next logged step
    codes = site.exit_codes(["node0", "node1", "node2"])
    _assert_rejoined(Nodes(site), codes)   # one model, the rejoin as the other tests see it
    outs = [site.output(f"node{n}") for n in range(3)]
    assert all(site.token not in out for out in outs)
    # one-port TCP links with the token, encrypted: c dials both of its, b dials a
    assert re.search(r"link to rank 1: TCP, accepted on \S+, token checked, encrypted",
                     outs[0]), outs[0][-3000:]
    assert f"TCP, dialled 10.77.0.1:{LINK_PORT}, token checked, encrypted" in outs[1], \
        outs[1][-3000:]
    assert f"TCP, dialled 10.77.0.4:{LINK_PORT}, token checked, encrypted" in outs[2], \
        outs[2][-3000:]
    assert f"TCP, dialled 10.77.0.1:{LINK_PORT}, token checked, encrypted" in outs[2], \
        outs[2][-3000:]
    assert "accepted on" not in outs[2], outs[2][-3000:]
    # the refusals, logged by the rendezvous and by a, and nothing taken
    assert "refused a connection from 10.77.0.4" in outs[0], outs[0][-3000:]
    log = site.output("rendezvous")
    assert re.search(r"refused a connection from 10\.77\.0\.4\b.*wrong or missing job token",
                     log), log[-3000:]
