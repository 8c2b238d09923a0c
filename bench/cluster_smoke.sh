#!/usr/bin/env bash
# CI smoke of the emulated cluster (bench/cluster/): 2 nodes x 1 proc joined by a 1gbit tbf
# link. First the smallest MNIST-1D setting with four methods: ddp, one qcomm method (assgd-4),
# torchft's DiLoCo (torchft-diloco, two outer rounds in the 40-step window) and qcomm's wait-free
# gossip (its nodes until the first has taken the 40 steps); then a small
# character transformer (charlm: AdamW, validation loss) through torchft's streaming DiLoCo
# (six fragment syncs in the 24-step window); the wait-free gossip again over one-port TCP
# links with a job token, encrypted, behind a firewall (--links sockets); last, a lost node
# that comes back (--join-at: qcomm's live join, local SGD's elastic restart from a checkpoint,
# torchft's heal).
# Passes when every run finished and, for qcomm methods, the inter-node bytes counted by the
# interface counters and by qcomm's stats agree within 5% (torch and torchft methods: counters
# against the algorithm's formula, same 5%). One repetition per method (--repeats 1) keeps CI
# fast; the median-of-repetitions logic is unit-tested. Needs root for network namespaces:
# without it, prints the reason and "SKIPPED: not root" and exits 0 (that is the CI's skip).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "cluster_smoke: network namespaces, veth pairs, a bridge and tc qdiscs need root"
    echo "SKIPPED: not root"
    exit 0
fi
for tool in ip tc timeout; do
    command -v "$tool" >/dev/null || { echo "cluster_smoke: '$tool' not found" >&2; exit 1; }
done

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
out=$(mktemp -d /tmp/qcb-smoke.XXXXXX)
# On failure, the last lines of every run's logs (its torchruns', each node's, the
# rendezvous's) go to stderr first: the directory that holds them goes with the exit.
on_exit() {
    local status=$?
    if [ "$status" -ne 0 ]; then
        find "$out" -name '*.log' | sort | while read -r log; do
            echo "cluster_smoke: the last lines of ${log#"$out"/}:" >&2
            grep -v '^QCB_PROGRESS' "$log" | tail -n 15 >&2 || true
        done
    fi
    rm -rf "$out"
}
trap on_exit EXIT

# check DIR METHODS: every method finished, and its two inter-node byte counts agree.
check() {
    "$PY" - "$1/summary.json" "$2" <<'EOF'
import json
import sys

summary = json.load(open(sys.argv[1]))
want = sys.argv[2].split(",")
rows = {r["method"]: r for r in summary["rows"]}
bad = []
for name in want:
    r = rows.get(name)
    if r is None or r.get("status") != "ok":
        bad.append(f"{name}: did not finish ({None if r is None else r.get('status')})")
        continue
    diff, iface = r["bytes_rel_diff"], r["inter_bytes_iface"]
    ref = r["inter_bytes_qcomm"] if r["inter_bytes_qcomm"] is not None else r["inter_bytes_formula"]
    ttt = r["time_to_target_s"]
    print(f"cluster_smoke: {r['workload']} {name}: finished; time to target "
          f"{'never' if ttt is None else f'{ttt:.2f} s'}, final {r['metric']} {r['final']:.4f}; "
          f"inter-node bytes/step: interface {iface}, {r['bytes_reference']} {ref}, apart "
          f"{'-' if diff is None else f'{100 * diff:.2f}%'}")
    if diff is None or diff > 0.05:
        bad.append(f"{name}: inter-node bytes disagree by more than 5%")
if bad:
    print("cluster_smoke: FAILED\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
EOF
}

# The outer timeouts bound each compare.py, which removes its cluster on SIGTERM; its own
# per-run timeout (--timeout) bounds each torchrun.
# assgd-4-h4f2-wf: the wait-free gossip, every node until the first has taken its 40 steps.
methods=ddp,assgd-4,torchft-diloco,assgd-4-h4f2-wf
timeout --kill-after=20 360 "$PY" bench/cluster/compare.py --workload mnist1d \
    --layouts 2x1 --rates 1gbit --methods "$methods" --steps 40 --warmup 3 --repeats 1 \
    --width 256 --target 0.25 --timeout 150 --time-budget fastest --out "$out/mnist1d" \
    --strict --no-plots
check "$out/mnist1d" "$methods"

# The same wait-free gossip with the nodes linked through qcomm's rendezvous over one-port TCP
# links, the job token checked and every link encrypted, each node behind a firewall that lets
# in only its link port (node 0 the rendezvous's too).
methods=assgd-4-h4f2-cont
timeout --kill-after=20 200 "$PY" bench/cluster/compare.py --workload mnist1d \
    --layouts 2x1 --rates 1gbit --methods "$methods" --steps 40 --warmup 3 --repeats 1 \
    --width 256 --target 0.25 --timeout 150 --time-budget fastest --links sockets \
    --out "$out/sockets" --strict --no-plots
check "$out/sockets" "$methods"

methods=torchft-streaming-diloco
timeout --kill-after=20 200 "$PY" bench/cluster/compare.py --workload charlm \
    --layouts 2x1 --rates 1gbit --methods "$methods" --steps 24 --warmup 3 --repeats 1 \
    --width 128 --depth 2 --target 3.0 --timeout 150 --out "$out/charlm" --strict --no-plots
check "$out/charlm" "$methods"

# A lost node that comes back, in 3 nodes: qcomm's wait-free gossip (linked through qcomm's
# rendezvous, node 1's ranks killed and restarted by its torchrun), local SGD (one elastic
# torchrun job restarted from its checkpoint) and torchft's DiLoCo (healed from a live group);
# for the peers node 1's torchrun is killed and started again. Node 1 lost at 0.15 of a 36 s
# window (5.4 s), back at 0.3 (10.8 s). Passes when every run finished and each row says when
# the node took part again.
# The window leaves 30 s from the kill to its end: the restarted ranks import torch and build
# the method before they can join (10-18 s from the kill on a 2-core machine with two busy
# processes beside it), and a node back after the window has closed finds the survivors gone.
# The 24 s window of before left 18 s, and a loaded CI machine once used all of it.
# --max-steps: the window is wall-clock time on any machine. Left out, a node stops at
# 100 x --steps = 4000 steps, which a machine taking 220 steps a second reaches in 18 s, before
# the lost node is back: the survivors had ended and nobody let it in.
methods=assgd-4-h4f2-cont,localsgd,torchft-diloco
timeout --kill-after=20 600 "$PY" bench/cluster/compare.py --workload mnist1d \
    --layouts 3x1 --rates 1gbit --methods "$methods" --steps 40 --warmup 3 --repeats 1 \
    --width 256 --target 0.25 --timeout 180 --time-budget 36 --max-steps 100000 \
    --kill-node 1 --kill-at 0.15 --join-at 0.3 --pg-timeout 60 --out "$out/rejoin" --no-plots
"$PY" - "$out/rejoin/summary.json" <<'EOF'
import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
bad = []
for row in rows:
    back = (row.get("rejoin") or {}).get("kill_to_first_step_s")
    print(f"cluster_smoke: rejoin {row['method']}: {row.get('status')}, {row.get('behaviour')}")
    if row.get("status") != "ok" or back is None:
        bad.append(f"{row['method']}: the lost node did not come back")
if len(rows) != 3 or bad:
    print("cluster_smoke: FAILED\n  " + "\n  ".join(bad or [f"{len(rows)} rows"]),
          file=sys.stderr)
    sys.exit(1)
EOF
echo "cluster_smoke: OK"
