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

The run is :func:`qcomm.testing.one_peer_world.run` (also the suite's test, on fewer steps;
``--start fork``: members forked from one process that imported torch, as the test starts
them). Every wait is bounded (a member's silence ``timeout_s``, the whole run
``--timeout-s``): a hang fails the run. Wall times on a machine with fewer cores than members
say nothing of speed; the script reports them only to show it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qcomm.testing.one_peer_world import OnePeerRun, run  # noqa: E402


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
    ap.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                    help="each member its own interpreter (spawn, default), or forked from a "
                         "process that imported torch once (fork: faster on few cores)")
    ap.add_argument("--json", default="", help="also write the outcome to this JSON file.")
    args = ap.parse_args()
    if args.members < 2:
        ap.error(f"--members must be >= 2, got {args.members}")
    if not 0 <= args.kill < args.members:
        ap.error(f"--kill must be a member, 0 to {args.members - 1}, got {args.kill}")
    config = OnePeerRun(members=args.members, steps=args.steps, step_s=args.step_s,
                        numel=args.numel, kill=args.kill, timeout_s=args.timeout_s,
                        silence_s=args.silence_s, start=args.start)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = run(config, Path(tmp))
        except (RuntimeError, TimeoutError) as e:   # a member failed or hung (its log's
            # tail), or the members did not reach the kill's or the restart's step in time
            raise SystemExit(str(e)) from e
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
