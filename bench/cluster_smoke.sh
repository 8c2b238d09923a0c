#!/usr/bin/env bash
# CI smoke of the emulated cluster (bench/cluster/): 2 nodes x 1 proc joined by a 1gbit tbf
# link, a few steps of two methods (ddp and assgd-4).
# Passes when every run finished and, for qcomm methods, the inter-node bytes counted by the
# interface counters and by qcomm's stats agree within 5% (torch methods: counters against the
# algorithm's formula, same 5%). Needs root for network namespaces: without it, prints the
# reason and "SKIPPED: not root" and exits 0 (that is the CI's skip).
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
methods=ddp,assgd-4
out=$(mktemp -d /tmp/qcb-smoke.XXXXXX)
trap 'rm -rf "$out"' EXIT

# The outer timeout bounds the whole smoke; compare.py removes its cluster on SIGTERM, and
# its own per-run timeout (--timeout) bounds each torchrun.
timeout --kill-after=20 240 "$PY" bench/cluster/compare.py \
    --layouts 2x1 --rates 1gbit --methods "$methods" --steps 40 --warmup 3 \
    --width 256 --target 0.3 --timeout 150 --out "$out" --strict --no-plots

"$PY" - "$out/summary.json" "$methods" <<'EOF'
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
    print(f"cluster_smoke: {name}: finished; inter-node bytes/step: interface {iface}, "
          f"{r['bytes_reference']} {ref}, apart {diff}")
    if diff is None or diff > 0.05:
        bad.append(f"{name}: inter-node bytes disagree by more than 5%")
if bad:
    print("cluster_smoke: FAILED\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print("cluster_smoke: OK")
EOF
