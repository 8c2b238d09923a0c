"""One run of a sweep launched on the emulated cluster through netns.sh: the launch's command
line (slow nodes, a lost node, a node that comes back, a peer's own recovery), the run itself
with node 0's progress streamed into a bar, and netns.sh's other commands.

Imported by compare.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M
from bench.cluster import rejoining as J
from bench.cluster import training as T

HERE = Path(__file__).resolve().parent


NETNS = HERE / "netns.sh"


WORKLOAD = HERE / "workload.py"


RECOVERY = HERE / "recovery.py"

# --links sockets: the port each node accepts its links on (its ranks this port and up), and
# the rendezvous's on node 0; the firewall lets in only those.
LINK_PORT = 29500
RENDEZVOUS_PORT = 29400


LIGHTNING = HERE / "lightning_worker.py"


def netns(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], check=check, **kw)


def launch_command(cluster: str, layout: T.Layout, cmd_args: list[str], timeout: int,
                   log: Path, slow: tuple[int, float] = (0, 1.0), lost: int | None = None,
                   equal_cpu: bool = False, comes_back: bool = False,
                   rejoin: tuple[str, Path] | None = None, links: str = "world") -> list[str]:
    """netns.sh's command that launches one run on the cluster (see :func:`run_one`);
    ``comes_back``: the lost node comes back (``--join-at``): nodes linked through a rendezvous,
    the lost node's torchrun restarting its ranks; ``rejoin`` (a peer's own recovery,
    recovery.py): ``("elastic", file)``, one elastic torchrun job, or ``("heal", file)``, a
    torchrun per node; either way the lost node's torchrun is started again at the time the
    file (recovery.py writes it) names. ``links`` (``--links``): ``gloo`` and ``sockets`` link
    healthy nodes through the rendezvous, ``sockets`` each node accepting on :data:`LINK_PORT`
    (the rendezvous on :data:`RENDEZVOUS_PORT`)."""
    back = ["--linked", "--restart-node", str(lost)] if comes_back and lost is not None else []
    if rejoin is not None and lost is not None:
        back = ["--elastic" if rejoin[0] == "elastic" else "--linked", "--restart-node",
                str(lost), "--rejoin-file", str(rejoin[1])]
    if links != "world":
        back = ["--linked"]
    if links == "sockets":
        back += ["--listen", str(LINK_PORT), "--port", str(RENDEZVOUS_PORT)]
    return ["bash", str(NETNS), "launch", "--id", cluster, "--nodes", str(layout.nodes),
            "--procs", str(layout.procs), "--timeout", str(timeout),
            "--slow-nodes", str(slow[0]), "--slowdown", str(slow[1]),
            *(["--lost-node", str(lost)] if lost is not None and not comes_back else []),
            *back, *(["--equal-cpu"] if equal_cpu else []),
            "--logdir", str(log.parent / log.stem), "--", *cmd_args]


def run_one(cluster: str, layout: T.Layout, cmd_args: list[str], timeout: int, out_json: Path,
            log: Path, bar: Any, slow: tuple[int, float] = (0, 1.0),
            lost: int | None = None, equal_cpu: bool = False,
            comes_back: bool = False, links: str = "world") -> tuple[int, str]:
    """Launch one run on the cluster (``slow``: the last ``slow[0]`` nodes capped to
    ``1 / slow[1]`` of the others' CPU; ``lost``: the node the run kills, whose end is no
    failure); stream node 0's progress into ``bar``; ``links``: :func:`launch_command`'s, a
    fresh job token for ``sockets`` in the launch's environment (never on a command line). A
    command of recovery.py runs as the peer's own recovery (its files of an earlier run into
    the same ``out_json`` removed)."""
    out_json.unlink(missing_ok=True)
    rejoin = None
    if Path(cmd_args[0]) == RECOVERY:
        method = cmd_args[cmd_args.index("--method") + 1]
        stale = J.recovery_files(str(out_json))
        rejoin = ("heal" if M.heals(method) else "elastic", stale["rejoin"])
        shutil.rmtree(stale["dir"], ignore_errors=True)
        for key in ("window", "rejoin", "killed"):
            stale[key].unlink(missing_ok=True)
    cmd = launch_command(cluster, layout, cmd_args, timeout, log, slow, lost, equal_cpu,
                         comes_back, rejoin, links)
    # torchrun of this interpreter's environment (netns.sh looks for TORCHRUN first).
    torchrun = Path(sys.executable).with_name("torchrun")
    extra = {"TORCHRUN": str(torchrun)} if torchrun.exists() else {}
    if links == "sockets":
        extra["QCOMM_TOKEN"] = secrets.token_hex(16)
    env = dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with open(log, "w") as logf, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        tail: list[str] = []
        try:
            for line in proc.stdout:
                logf.write(line)
                if line.startswith("QCB_PROGRESS"):
                    done = int(line.split()[1])
                    bar.update(done - bar.n)
                else:
                    tail = [*tail[-30:], line]
            rc = proc.wait()
        except BaseException:
            # Interrupted (SIGTERM, Ctrl-C): stop the launch, which stops its nodes, before
            # Popen's exit waits for it; the caller then removes the cluster.
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return rc, "".join(tail)


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/run_launch.py is a library of the cluster benchmark "
        "(one run launched through netns.sh), imported by compare.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
