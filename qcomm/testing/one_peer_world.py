"""Many wait-free gossip members on the one-peer graph as processes on localhost, one killed
and started again as a new process that joins the running ones: what
``bench/one_peer_processes.py`` reports on and ``tests/collectives/test_one_peer_processes.py``
checks (:func:`run`).

Each member is :mod:`qcomm.testing.join_world` with ``--graph one-peer-exp`` (OnePeerWaitFree
over Gloo groups of two made through a rendezvous in this process), started either as its own
interpreter (``start="spawn"``: each imports torch) or forked from a ``forkserver`` that
imported it once (``start="fork"``: a new process all the same, at a fraction of the cost on
few cores). Every member starts together (every link made before anyone steps); member
``kill`` is SIGKILLed once every member has taken ``kill_at`` steps and started again once
member 0 has taken ``rejoin_at``. Every wait is bounded (a member's silence ``silence_s``, the
whole run ``timeout_s``); whatever is still running at the end is killed.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qcomm.rendezvous import serve
from qcomm.testing.join_world import member_args, member_command, run_forked, wait_progress
from qcomm.testing.multiprocess import free_port

__all__ = ["OnePeerRun", "run"]

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class OnePeerRun:
    """What one run does (module docstring); ``numel`` floats per member, ``step_s`` seconds
    of sleep per step standing for the compute."""

    members: int = 16
    steps: int = 2500
    step_s: float = 0.01
    numel: int = 4096
    kill: int = 5
    kill_at: int = 100
    rejoin_at: int = 200
    timeout_s: float = 1800.0
    silence_s: float = 30.0
    start: str = "spawn"


class _Member:
    """One member's process, spawned or forked, its output in a file."""

    def __init__(self, config: OnePeerRun, i: int, port: int, out: Path, log: Path,
                 *extra: str) -> None:
        opts = (i, config.members, port, config.steps, out, "--step-s", str(config.step_s),
                "--numel", str(config.numel), "--graph", "one-peer-exp",
                "--timeout-s", str(config.silence_s), *extra)
        if config.start == "fork":
            ctx = multiprocessing.get_context("forkserver")
            # the server imports it once; every member forked from it starts warm
            ctx.set_forkserver_preload(["qcomm.testing.join_world"])
            self._proc: Any = ctx.Process(target=run_forked, args=(member_args(*opts), str(log)))
            self._proc.start()
        else:
            with open(log, "wb") as f:
                self._proc = subprocess.Popen(member_command(*opts), cwd=REPO,
                                              env={**os.environ, "PYTHONPATH": str(REPO)},
                                              stdout=f, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.code() is None:
            os.kill(self._proc.pid, signal.SIGKILL)

    def code(self) -> int | None:
        """The exit status (negative: the signal), or None while it runs."""
        p = self._proc
        return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode

    def wait(self, deadline: float) -> int | None:
        """The exit status once it ended, or None at ``deadline`` (``time.monotonic``)."""
        left = max(0.0, deadline - time.monotonic())
        if isinstance(self._proc, subprocess.Popen):
            try:
                return self._proc.wait(left)
            except subprocess.TimeoutExpired:
                return None
        self._proc.join(left)
        return self._proc.exitcode


def _members(config: OnePeerRun, port: int, store: dist.Store, tmp: Path,
             outs: list[Path]) -> tuple[list[int | None], list[Path], int]:
    """Start, kill, restart and wait for the members: their exit statuses (None: still
    running at the deadline, then killed), their logs, and the step the killed one had
    reported at its death."""
    deadline = time.monotonic() + config.timeout_s
    k = config.kill
    logs = [tmp / f"m{i}.log" for i in range(config.members)]
    procs = [_Member(config, i, port, outs[i], logs[i], "--start-together")
             for i in range(config.members)]
    try:
        for i in range(config.members):   # every link made and used before the kill
            wait_progress(store, f"progress/{i}/1", config.kill_at, deadline - time.monotonic())
        procs[k].kill()
        procs[k].wait(time.monotonic() + 10)
        killed_at = int(store.get(f"progress/{k}/1"))
        wait_progress(store, "progress/0/1", config.rejoin_at, deadline - time.monotonic())
        logs[k] = tmp / f"m{k}.rejoined.log"
        procs[k] = _Member(config, k, port, outs[k], logs[k], "--join")
        codes = [p.wait(deadline) for p in procs]
    finally:
        for p in procs:   # nothing is left running, whatever failed
            p.kill()
            p.wait(time.monotonic() + 10)
    return codes, logs, killed_at


def run(config: OnePeerRun, tmp: Path) -> dict:
    """One run (module docstring): every member's outcome and the spread of the ends.

    Raises:
        RuntimeError: a member exited other than 0 or did not end within ``timeout_s`` (its
            log's tail in the message); TimeoutError: the members did not reach the kill's
            or the restart's step in time.
    """
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port, config.members),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    server.start()
    t0 = time.time()
    try:
        if not ready.wait(30):
            raise RuntimeError("the rendezvous did not start within 30 s")
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        outs = [tmp / f"m{i}.pt" for i in range(config.members)]
        codes, logs, killed_at = _members(config, port, store, tmp, outs)
    finally:
        stop.set()
    if any(codes):
        bad = [f"member {i} exited {c} (None: did not end within {config.timeout_s:g} s):\n"
               f"{logs[i].read_text(errors='replace')[-2000:]}"
               for i, c in enumerate(codes) if c]
        raise RuntimeError("\n".join(bad))
    return _outcome(config, [torch.load(o, weights_only=True) for o in outs], killed_at,
                    time.time() - t0, t0)


def _outcome(config: OnePeerRun, res: list[dict], killed_at: int, wall_s: float,
             t0: float) -> dict:
    start = torch.stack([torch.randn(config.numel, generator=torch.Generator().manual_seed(i))
                         for i in range(config.members)])
    end = torch.stack([r["x"] for r in res])
    spread = lambda v: float((v - v.mean(0)).norm())
    joiner = res[config.kill]
    return {"members": config.members, "steps": config.steps, "numel": config.numel,
            "killed": config.kill, "killed_at_step": killed_at, "wall_s": wall_s,
            "joiner": {"announced_s": joiner["events"]["announced"] - t0,
                       "started_s": joiner["events"]["started"] - t0,
                       "first_step": joiner["first_step"]},
            "end_spread_over_start": spread(end) / spread(start),
            "survivors_sum_same_bits": all(torch.equal(r["sum"], res[0]["sum"]) for r in res),
            "live_counted": [r["live"] for r in res],
            "per_member": [{"member": i, "incarnation": r["incarnation"],
                            "losses": r["losses"], "lost": r["lost"],
                            "why_lost": [f"step {e['step']}: {e['detail']}"
                                         for e in r["loss_detail"]],
                            "steps_taken": len(r["times"]),
                            "links": {int(p): int(n) for p, n in r["peers"].items()},
                            "bytes_per_step": r["bytes_sent"] / max(1, len(r["times"]))}
                           for i, r in enumerate(res)]}
