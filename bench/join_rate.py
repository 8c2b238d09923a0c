"""How a join costs the running members, and how soon the joiner takes part: wait-free gossip
processes whose links are made through the rendezvous (``qcomm.testing.join_world``), one of
which is SIGKILLed and started again as a new process that joins.

    python bench/join_rate.py --repeats 3

Per repetition: ``--members`` processes mix a ``--numel`` vector, each step a round plus
``--step-s`` of sleep standing for the compute; member 1 is killed at step ``--kill-at`` and,
once its neighbours have dropped it, started again with ``--join``. Reported:

* each running member's step rate while the member joins (from its announcement to one second
  after its first step) over its rate in the two seconds before the kill;
* the joiner's seconds from its launch to its announcement (Python, torch, its seat), from the
  announcement to its start (the state from its neighbour), and from its launch to its first
  step.

The gossip alone, without a model or the engine: what the join's protocol costs, not a training
run's time to target.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qcomm.rendezvous import serve  # noqa: E402
from qcomm.testing.join_world import member_command, wait_progress  # noqa: E402
from qcomm.testing.multiprocess import free_port  # noqa: E402


def _member(i: int, port: int, args: argparse.Namespace, out: Path, *extra: str
            ) -> subprocess.Popen:
    cmd = member_command(i, args.members, port, args.steps, out, "--step-s", str(args.step_s),
                         "--numel", str(args.numel), *extra)
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


def one_run(args: argparse.Namespace, out: Path) -> dict:
    """One repetition: the rates and the joiner's timeline."""
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port, args.members),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    server.start()
    ready.wait(10)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    files = [out / f"m{i}.pt" for i in range(args.members)]
    procs = [_member(i, port, args, files[i]) for i in range(args.members)]
    try:
        wait_progress(store, "progress/1/1", args.kill_at)
        killed = time.time()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        time.sleep(1.0)   # its neighbours drop it
        launched = time.time()
        procs[1] = _member(1, port, args, files[1], "--join")
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop.set()
    if codes != [0] * args.members:
        raise RuntimeError(f"a member failed: exit codes {codes}")
    res = [torch.load(f, weights_only=True) for f in files]
    ev = res[1]["events"]
    first_step = res[1]["times"][0]
    window = (ev["announced"], first_step + 1.0)
    ratios = {i: _rate(r["times"], *window) / _rate(r["times"], killed - 2.0, killed)
              for i, r in enumerate(res) if i != 1}
    return {"ratios": ratios, "to_announce": ev["announced"] - launched,
            "state": ev["started"] - ev["announced"], "to_first_step": first_step - launched,
            "live": [r["live"] for r in res]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--members", type=int, default=3, help="Gossip members (processes).")
    ap.add_argument("--steps", type=int, default=1500, help="Steps each member takes.")
    ap.add_argument("--kill-at", type=int, default=300,
                    help="Member 1 is SIGKILLed at this step, then started again to join.")
    ap.add_argument("--step-s", type=float, default=0.01,
                    help="Seconds of sleep per step, standing for the compute.")
    ap.add_argument("--numel", type=int, default=1 << 16, help="Floats each member gossips.")
    ap.add_argument("--repeats", type=int, default=3, help="Repetitions (medians over them).")
    ap.add_argument("--out", default="bench/out/join_rate",
                    help="Folder for the members' result files.")
    args = ap.parse_args()
    runs = []
    for r in range(args.repeats):
        out = Path(args.out) / f"r{r}"
        out.mkdir(parents=True, exist_ok=True)
        runs.append(one_run(args, out))
        print(f"repetition {r}: {runs[-1]}", flush=True)
    med = lambda xs: statistics.median(xs)
    span = lambda xs: f"{med(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"
    ratios = [v for run in runs for v in run["ratios"].values()]
    cpu = platform.processor() or platform.machine()
    print(f"\n{args.members} members, {args.numel} floats, step {args.step_s * 1e3:g} ms + a "
          f"round, {args.repeats} repetitions; {os.cpu_count()} CPUs ({cpu}), load "
          f"{os.getloadavg()[0]:.2f}")
    print("| measure | median [min-max] |\n|---|---|")
    print(f"| running members' step rate during the join / before | {span(ratios)} |")
    for key, what in [("to_announce", "joiner: launch to its announcement, s"),
                      ("state", "joiner: announcement to its start (state from a neighbour), s"),
                      ("to_first_step", "joiner: launch to its first step, s")]:
        print(f"| {what} | {span([run[key] for run in runs])} |")
    live = sorted({n for run in runs for n in run["live"]})
    print(f"| live members at the end, every run | {live} |")


if __name__ == "__main__":
    main()
