"""Many wait-free gossip processes on localhost on the one-peer graph, one killed and one
joining while they run: does every live member end with one model, and nothing hang?

    python bench/one_peer_processes.py --members 16 --json bench/out/one_peer_16.json

``--members`` processes (``qcomm.testing.join_world --graph one-peer-exp``: OnePeerWaitFree,
links made through a rendezvous in this process, 4-bit codes, 2 fragments) mix a ``--numel``
vector from independent starts, ``--steps`` steps with ``--step-s`` of sleep each. Member
``--kill`` is SIGKILLed once every member has taken 100 steps (they start together: every
link is made first) and started again as a new process that joins (from a peer's state, on
new links) once member 0 has taken 100 more. Reported: each
member's incarnation, losses seen, steps taken, bytes sent per step (payload, header and
seal of its rounds, before the final drain and sum), the spread of the members' final vectors
over their start's, and whether the survivors' sum is the same bits on every member.

Every wait is bounded (a member's silence ``timeout_s``, the whole run ``--timeout-s``): a
hang fails the run. Wall times on a machine with fewer cores than members say nothing of
speed; the script reports them only to show it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
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
                         "--numel", str(args.numel), "--graph", "one-peer-exp",
                         "--timeout-s", str(args.silence_s), *extra)
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(args: argparse.Namespace, tmp: Path) -> dict:
    """One run: every member's outcome and the spread of the ends."""
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port, args.members),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    server.start()
    ready.wait(10)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    outs = [tmp / f"m{i}.pt" for i in range(args.members)]
    t0 = time.time()
    procs = [_member(i, port, args, outs[i], "--start-together") for i in range(args.members)]
    k = args.kill
    try:
        for i in range(args.members):   # every link made and used before the kill
            wait_progress(store, f"progress/{i}/1", 100, args.timeout_s)
        procs[k].send_signal(signal.SIGKILL)
        procs[k].wait(10)
        wait_progress(store, "progress/0/1", 200, args.timeout_s)
        procs[k] = _member(k, port, args, outs[k], "--join")
        logs = [p.communicate(timeout=max(1.0, args.timeout_s - (time.time() - t0)))[0]
                for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop.set()
    codes = [p.returncode for p in procs]
    if any(codes):
        bad = [f"member {i} exited {c}:\n{logs[i][-2000:]}" for i, c in enumerate(codes) if c]
        raise SystemExit("\n".join(bad))
    res = [torch.load(o, weights_only=True) for o in outs]
    start = torch.stack([torch.randn(args.numel, generator=torch.Generator().manual_seed(i))
                         for i in range(args.members)])
    end = torch.stack([r["x"] for r in res])
    spread = lambda v: float((v - v.mean(0)).norm())
    same_sum = all(torch.equal(r["sum"], res[0]["sum"]) for r in res)
    joiner = res[k]
    return {"members": args.members, "steps": args.steps, "numel": args.numel,
            "killed": k, "wall_s": time.time() - t0,
            "joiner": {"announced_s": joiner["events"]["announced"] - t0,
                       "started_s": joiner["events"]["started"] - t0,
                       "first_step": joiner["first_step"]},
            "end_spread_over_start": spread(end) / spread(start),
            "survivors_sum_same_bits": same_sum, "live_counted": [r["live"] for r in res],
            "per_member": [{"member": i, "incarnation": r["incarnation"],
                            "losses": r["losses"], "steps_taken": len(r["times"]),
                            "links": {int(p): int(n) for p, n in r["peers"].items()},
                            "bytes_per_step": r["bytes_sent"] / max(1, len(r["times"]))}
                           for i, r in enumerate(res)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=16, help="member processes (default 16).")
    ap.add_argument("--steps", type=int, default=2500,
                    help="steps per member (default 2500: the joiner, a new process, joins "
                         "well before the others end, also on a loaded machine).")
    ap.add_argument("--step-s", type=float, default=0.01,
                    help="seconds of sleep per step, standing for the compute (default 0.01).")
    ap.add_argument("--numel", type=int, default=4096, help="floats per member (default 4096).")
    ap.add_argument("--kill", type=int, default=5, help="the member killed and restarted")
    ap.add_argument("--timeout-s", type=float, default=1800.0,
                    help="the whole run's bound in seconds (default 1800); past it, it fails.")
    ap.add_argument("--silence-s", type=float, default=30.0,
                    help="a member's silence bound (timeout_s; loaded cores stall processes)")
    ap.add_argument("--json", default="", help="also write the outcome to this JSON file.")
    args = ap.parse_args()
    if args.members < 2:
        ap.error(f"--members must be >= 2, got {args.members}")
    if not 0 <= args.kill < args.members:
        ap.error(f"--kill must be a member, 0 to {args.members - 1}, got {args.kill}")
    with tempfile.TemporaryDirectory() as tmp:
        out = run(args, Path(tmp))
    rows = out["per_member"]
    print(f"{args.members} members, {args.steps} steps, member {args.kill} killed and "
          f"rejoined; end spread / start spread = {out['end_spread_over_start']:.2e}; "
          f"survivors' sum the same bits on every member: {out['survivors_sum_same_bits']}, "
          f"members counted {sorted(set(out['live_counted']))}; "
          f"wall {out['wall_s']:.0f} s ({os.cpu_count()} cores)")
    j = out["joiner"]
    print(f"member {args.kill}'s new process announced its join at {j['announced_s']:.0f} s, "
          f"started from a peer's state at {j['started_s']:.0f} s, at step {j['first_step']}")
    print("| member | incarnation | losses seen | steps taken | bytes per step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['member']} | {r['incarnation']} | {r['losses']} | {r['steps_taken']} | "
              f"{r['bytes_per_step']:.0f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
