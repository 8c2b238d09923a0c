"""A node that dies and comes back in a training run: ``examples/train_charlm.py`` under one
torchrun per node, the nodes linked through the rendezvous (``--on-peer-loss continue``), node
1's worker SIGKILLed at ``--kill-at`` of its steps.

    python bench/rejoin.py --repeats 3

Per repetition, three runs of one job (same seed, same steps, one CPU thread per process): no
node lost; node 1 lost for good (its torchrun does not restart it); node 1 restarted by its
torchrun (``--max-restarts 1``), which rejoins the running job. Reported, medians [min-max]:

* the validation loss of the nodes' averaged parameters at the end, and the wall seconds from
  the launch to the last node's exit, per kind of run;
* the running nodes' step rate from the joiner's announcement to one second after it joined,
  over their rate in the two seconds before the kill (all nodes share this machine's cores: a
  joiner that starts Python and torch takes CPU from them, which separate machines would not);
* the joiner's seconds from the kill to its announcement (torchrun's restart, Python, torch,
  its seat) and from its announcement to its start (the state from its neighbour).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import cpu_model, load_average  # noqa: E402
from qcomm.testing.multiprocess import descendants, free_port  # noqa: E402

EXAMPLE = REPO / "examples" / "train_charlm.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEP = re.compile(r"^step (\d+)/\d+")


class Node:
    """One node's torchrun agent and the lines it printed, each with the time it came."""

    def __init__(self, node: int, address: str, args: argparse.Namespace,
                 restarts: int) -> None:
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "1", "--max-restarts",
               str(restarts), str(EXAMPLE), "--width", str(args.width), "--layers", "1",
               "--heads", "2", "--context", "32", "--batch-size", "8", "--val-windows", "64",
               "--steps", str(args.steps), "--log-every", "10", "--wait-free",
               "--on-peer-loss", "continue", "--timeout-s", "20", "--node-id", str(node)]
        env = dict(os.environ, QCOMM_RENDEZVOUS=address, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, line in self.lines if (m := STEP.match(line))]

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def kill_worker(self) -> None:
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(10)
        return code


def _rate(steps: list[tuple[float, int]], start: float, end: float) -> float:
    """Steps per second between the first and the last step line inside [start, end)."""
    inside = [(t, s) for t, s in steps if start <= t < end]
    if len(inside) < 2:
        raise RuntimeError(f"too few step lines between {start:.2f} and {end:.2f}")
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def one_run(args: argparse.Namespace, kind: str) -> dict:
    """One run of ``kind`` ("none", "lost", "rejoin"): what it ended with and, for a rejoin,
    the rates and the joiner's timeline."""
    port = free_port()
    rendezvous = subprocess.Popen([sys.executable, "-m", "qcomm.rendezvous", "--host",
                                   "127.0.0.1", "--port", str(port), "--nodes", "3"],
                                  cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                  stdout=subprocess.PIPE, text=True)
    rendezvous.stdout.readline()
    t0 = time.time()
    nodes = [Node(n, f"127.0.0.1:{port}", args, 1 if kind == "rejoin" else 0)
             for n in range(3)]
    killed = None
    try:
        if kind != "none":
            at = int(args.kill_at * args.steps)
            while not any(s >= at for _, s in nodes[1].steps()):
                if time.time() - t0 > 300:
                    raise RuntimeError("node 1 did not reach the kill")
                time.sleep(0.02)
            killed = time.time()
            nodes[1].kill_worker()
        codes = [n.finish(600) for n in nodes]
        ended = time.time()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                os.killpg(n.proc.pid, signal.SIGKILL)
        rendezvous.terminate()
        rendezvous.wait(10)
    survivors = [0, 2] if kind == "lost" else [0, 1, 2]
    if any(codes[i] != 0 for i in survivors):
        raise RuntimeError(f"{kind}: exit codes {codes}\n" + "\n".join(
            line for n in nodes for _, line in n.lines[-20:]))
    final = re.search(r"validation loss at step \d+: ([\d.]+) \(global mean",
                      "\n".join(line for _, line in nodes[0].lines))
    out = {"kind": kind, "loss": float(final.group(1)), "wall_s": ended - t0}
    if kind == "rejoin":
        announced = nodes[1].first(r"node 1 \(incarnation 2\) joins the running job")
        joined = nodes[1].first(r"node 1 joined at step")
        out["ratios"] = [_rate(nodes[i].steps(), announced, joined + 1.0)
                         / _rate(nodes[i].steps(), killed - 2.0, killed) for i in (0, 2)]
        out["to_announce"] = announced - killed
        out["state"] = joined - announced
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="Steps of every node.")
    ap.add_argument("--kill-at", type=float, default=0.33,
                    help="Node 1 is killed at this fraction of its steps.")
    ap.add_argument("--width", type=int, default=32, help="The model's embedding width.")
    ap.add_argument("--repeats", type=int, default=3, help="Repetitions (medians over them).")
    args = ap.parse_args()
    if not TORCHRUN.exists():
        ap.error(f"no torchrun next to {sys.executable}")
    runs: dict[str, list[dict]] = {"none": [], "lost": [], "rejoin": []}
    for r in range(args.repeats):
        for kind in runs:   # the three kinds side by side in each repetition
            runs[kind].append(one_run(args, kind))
            print(f"repetition {r}: {runs[kind][-1]}", flush=True)
    med = statistics.median
    span = lambda xs, f=".3f": f"{med(xs):{f}} [{min(xs):{f}}-{max(xs):{f}}]"
    print(f"\n3 nodes x 1 rank on one machine, charlm width {args.width}, {args.steps} steps, "
          f"node 1 killed at {args.kill_at:g}; {args.repeats} repetitions; {os.cpu_count()} "
          f"CPUs ({cpu_model()}), load {load_average()}")
    print("| run | final validation loss | wall s, launch to last exit |\n|---|---|---|")
    for kind, what in [("none", "no node lost"), ("lost", "node 1 lost for good"),
                       ("rejoin", "node 1 restarted by its torchrun, rejoins")]:
        print(f"| {what} | {span([x['loss'] for x in runs[kind]])} | "
              f"{span([x['wall_s'] for x in runs[kind]], '.1f')} |")
    rejoin = runs["rejoin"]
    print("\n| join | median [min-max] |\n|---|---|")
    print(f"| running nodes' step rate during the join / before | "
          f"{span([v for x in rejoin for v in x['ratios']], '.2f')} |")
    print(f"| joiner: kill to its announcement, s | "
          f"{span([x['to_announce'] for x in rejoin], '.2f')} |")
    print(f"| joiner: announcement to its start (state from a neighbour), s | "
          f"{span([x['state'] for x in rejoin], '.2f')} |")


if __name__ == "__main__":
    main()
