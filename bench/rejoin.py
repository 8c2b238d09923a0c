"""A node that dies and comes back in a training run: ``examples/train_charlm.py`` under one
torchrun per node, the nodes linked through the rendezvous (``--on-peer-loss continue``), node
1's worker SIGKILLed at ``--kill-at`` of its steps.

    python bench/rejoin.py --repeats 3 --fresh --restart

Per repetition, one run of each kind (``KINDS``; same seed, same steps, one CPU thread per
process): no node lost; node 1 lost for good (its torchrun does not restart it); node 1
restarted by its torchrun (``--max-restarts 1``), which rejoins the running job, its AdamW
state copied from the neighbour that hands it its parameters (``rejoin``) or fresh
(``rejoin-fresh``, with ``--fresh``); and, with ``--restart``, the recovery a job that is one
torchrun world has (what DDP and local SGD do under torchrun's elastic restart): the same
gossip in one world of three processes that checkpoints every ``--save-every`` steps, rank 1
SIGKILLed at the same step, every process stopped and started again by torchrun from the
newest checkpoint. Reported, medians [min-max]:

* the validation loss of the nodes' averaged parameters at the end, the wall seconds from the
  launch to the last node's exit, and the seconds from the kill until the lost node trains
  again (rejoin: it starts from its neighbour's state; restart: every rank resumed), per kind;
* for the restart, the steps redone (from the newest checkpoint to the step of the kill);
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
import tempfile
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
NODES = 3
# The kinds of run, in the order each repetition runs them, with what the tables call them.
KINDS = {
    "none": "no node lost",
    "lost": "node 1 lost for good",
    "rejoin": "node 1 restarted by its torchrun, rejoins (AdamW state copied)",
    "rejoin-fresh": "the same, AdamW state fresh",
    "restart": "one torchrun world: every process restarted from the newest checkpoint",
}


def _model_flags(args: argparse.Namespace) -> list[str]:
    """train_charlm's flags every kind of run shares: the model, the data, the steps."""
    return ["--width", str(args.width), "--layers", "1", "--heads", "2", "--context", "32",
            "--batch-size", "8", "--val-windows", "64", "--steps", str(args.steps),
            "--log-every", "10", "--wait-free", "--timeout-s", "20"]


class Node:
    """One torchrun agent and the lines it printed, each with the time it came: one node of
    the job linked through the rendezvous at ``address`` (``node``: its id), or, with
    ``node=None``, the whole job in one torchrun world of ``args.nodes`` processes that
    checkpoints every ``args.save_every`` steps under ``ckpt_dir`` and runs again from the
    newest one when a process dies (torchrun's ``--max-restarts``)."""

    def __init__(self, node: int | None, address: str, args: argparse.Namespace,
                 restarts: int, optimizer_state: str = "copy",
                 ckpt_dir: Path | None = None) -> None:
        if node is None:
            script = [*_model_flags(args), "--procs-per-node", "1", "--ckpt-dir",
                      str(ckpt_dir), "--save-every", str(args.save_every), "--resume", "latest"]
            procs, env = NODES, dict(os.environ)
        else:
            script = [*_model_flags(args), "--on-peer-loss", "continue", "--node-id",
                      str(node), "--join-optimizer-state", optimizer_state]
            procs, env = 1, dict(os.environ, QCOMM_RENDEZVOUS=address)
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(procs), "--max-restarts",
               str(restarts), str(EXAMPLE), *script]
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
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

    def kill_worker(self, rank: int | None = None) -> None:
        """SIGKILL the agent's workers (``rank``: only the one whose RANK it is)."""
        for pid in descendants(self.proc.pid):
            if rank is not None and _rank_of(pid) != rank:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(10)
        return code


def _rank_of(pid: int) -> int | None:
    """The RANK in process ``pid``'s environment (None: none, or it is gone)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [v[5:] for v in env if v.startswith(b"RANK=")]
    return int(found[0]) if found else None


def _rate(steps: list[tuple[float, int]], start: float, end: float) -> float:
    """Steps per second between the first and the last step line inside [start, end)."""
    inside = [(t, s) for t, s in steps if start <= t < end]
    if len(inside) < 2:
        raise RuntimeError(f"too few step lines between {start:.2f} and {end:.2f}")
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def one_run(args: argparse.Namespace, kind: str) -> dict:
    """One run of ``kind`` (``KINDS``): what it ended with and, for a rejoin or a restart, the
    joiner's timeline and the running nodes' rates."""
    port = free_port()
    rendezvous = subprocess.Popen([sys.executable, "-m", "qcomm.rendezvous", "--host",
                                   "127.0.0.1", "--port", str(port), "--nodes", str(NODES)],
                                  cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                  stdout=subprocess.PIPE, text=True)
    rendezvous.stdout.readline()
    rejoins, restarts = kind.startswith("rejoin"), kind == "restart"
    state = "fresh" if kind == "rejoin-fresh" else "copy"
    t0 = time.time()
    with tempfile.TemporaryDirectory() as ckpt:
        if restarts:   # the whole job in one world: rank 1's lines come through node 0's agent
            nodes = [Node(None, "", args, 1, ckpt_dir=Path(ckpt))]
        else:
            nodes = [Node(n, f"127.0.0.1:{port}", args, 1 if rejoins else 0, state)
                     for n in range(NODES)]
        watched = nodes[0] if restarts else nodes[1]
        killed = None
        try:
            if kind != "none":
                at = int(args.kill_at * args.steps)
                while not any(s >= at for _, s in watched.steps()):
                    if time.time() - t0 > 300:
                        raise RuntimeError("node 1 did not reach the kill")
                    time.sleep(0.02)
                killed = time.time()
                watched.kill_worker(1 if restarts else None)
            codes = [n.finish(600) for n in nodes]
            ended = time.time()
        finally:
            for n in nodes:
                if n.proc.poll() is None:
                    os.killpg(n.proc.pid, signal.SIGKILL)
            rendezvous.terminate()
            rendezvous.wait(10)
    survivors = [0, 2] if kind == "lost" else list(range(len(nodes)))
    if any(codes[i] != 0 for i in survivors):
        raise RuntimeError(f"{kind}: exit codes {codes}\n" + "\n".join(
            line for n in nodes for _, line in n.lines[-20:]))
    final = re.search(r"validation loss at step \d+: ([\d.]+) \(global mean",
                      "\n".join(line for _, line in nodes[0].lines))
    out = {"kind": kind, "loss": float(final.group(1)), "wall_s": ended - t0}
    if rejoins:
        announced = nodes[1].first(r"node 1 \(incarnation 2\) joins the running job")
        joined = nodes[1].first(r"node 1 joined at step")
        out["ratios"] = [_rate(nodes[i].steps(), announced, joined + 1.0)
                         / _rate(nodes[i].steps(), killed - 2.0, killed) for i in (0, 2)]
        out["to_announce"] = announced - killed
        out["state"] = joined - announced
        out["back_s"] = joined - killed
    if restarts:
        resumed = nodes[0].first(r"^resumed from .* at step \d+")
        line = next(text for t, text in nodes[0].lines if t == resumed)
        out["back_s"] = resumed - killed
        out["redone"] = max(s for t, s in nodes[0].steps() if t < killed) - int(line.split()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="Steps of every node.")
    ap.add_argument("--kill-at", type=float, default=0.33,
                    help="Node 1 is killed at this fraction of its steps.")
    ap.add_argument("--width", type=int, default=32, help="The model's embedding width.")
    ap.add_argument("--repeats", type=int, default=3, help="Repetitions (medians over them).")
    ap.add_argument("--fresh", action="store_true",
                    help="Also run the rejoin with the joiner's AdamW state fresh "
                         "(--join-optimizer-state fresh) beside the one that copies it.")
    ap.add_argument("--restart", action="store_true",
                    help="Also run the recovery of a job that is one torchrun world: every "
                         "process stops at the loss and torchrun (--max-restarts 1) starts them "
                         "all again from the newest checkpoint (--resume latest).")
    ap.add_argument("--save-every", type=int, default=250,
                    help="Steps between the checkpoints of the --restart runs.")
    args = ap.parse_args()
    if not TORCHRUN.exists():
        ap.error(f"no torchrun next to {sys.executable}")
    if args.save_every < 1:
        ap.error(f"--save-every must be >= 1, got {args.save_every}")
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS
                                   if (kind != "rejoin-fresh" or args.fresh)
                                   and (kind != "restart" or args.restart)}
    for r in range(args.repeats):
        for kind in runs:   # every kind side by side in each repetition
            runs[kind].append(one_run(args, kind))
            print(f"repetition {r}: {runs[kind][-1]}", flush=True)
    report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    """The tables: per kind of run, then the join's figures."""
    med = statistics.median
    span = lambda xs, f=".3f": f"{med(xs):{f}} [{min(xs):{f}}-{max(xs):{f}}]"
    print(f"\n{NODES} nodes x 1 rank on one machine, charlm width {args.width}, {args.steps} "
          f"steps, node 1 killed at {args.kill_at:g}; {args.repeats} repetitions; "
          f"{os.cpu_count()} CPUs ({cpu_model()}), load {load_average()}")
    print("| run | final validation loss | wall s, launch to last exit | kill to training "
          "again, s |\n|---|---|---|---|")
    for kind, what in KINDS.items():
        if kind not in runs:
            continue
        back = [x["back_s"] for x in runs[kind] if "back_s" in x]
        print(f"| {what} | {span([x['loss'] for x in runs[kind]])} | "
              f"{span([x['wall_s'] for x in runs[kind]], '.1f')} | "
              f"{span(back, '.2f') if back else '-'} |")
    if "restart" in runs:
        print(f"\nrestart: steps redone since the newest checkpoint (every {args.save_every}): "
              f"{span([x['redone'] for x in runs['restart']], '.0f')}")
    rejoin = runs["rejoin"] + runs.get("rejoin-fresh", [])
    print("\n| join | median [min-max] |\n|---|---|")
    print(f"| running nodes' step rate during the join / before | "
          f"{span([v for x in rejoin for v in x['ratios']], '.2f')} |")
    print(f"| joiner: kill to its announcement, s | "
          f"{span([x['to_announce'] for x in rejoin], '.2f')} |")
    print(f"| joiner: announcement to its start (state from a neighbour), s | "
          f"{span([x['state'] for x in rejoin], '.2f')} |")


if __name__ == "__main__":
    main()
