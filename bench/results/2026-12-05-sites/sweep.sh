#!/usr/bin/env bash
# The training cell over the three kinds of links, interleaved: each seed runs every kind in turn
# (root, for the emulated cluster). SEEDS="4 5" adds seeds to an earlier run's environment.txt.
set -u
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-05-sites
[ -n "${SEEDS:-}" ] || { date -u; lscpu | grep -E "Model name|^CPU\(s\)"; uptime; } > $R/environment.txt
for S in ${SEEDS:-1 2 3}; do
  for L in world gloo sockets; do
    echo "=== seed $S links $L: $(date -u +%H:%M:%S) $(uptime)" >> $R/environment.txt
    timeout --kill-after=30 600 ${PYTHON:-.venv/bin/python} bench/cluster/compare.py \
      --workload mnist1d --layouts 4x1 --rates 100mbit --methods slow-link --repeats 1 \
      --seed $S --steps 900 --target 0.65 --time-budget fastest --equal-cpu \
      --pg-timeout 60 --timeout 400 --no-plots --links $L --out $R/seed$S-$L > $R/seed$S-$L.txt 2>&1
    echo "    rc $? $(date -u +%H:%M:%S) $(uptime)" >> $R/environment.txt
  done
done
