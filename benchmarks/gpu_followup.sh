#!/usr/bin/env bash
# The GPU measurements behind docs/benchmarks.md and docs/results.md, with random weights
# (no model files needed), in two parts that each fit one 10-minute device call:
#   OUT=dir bash benchmarks/gpu_followup.sh 1   # gates, decode vs bound, pageable vs pinned, load peak
#   OUT=dir bash benchmarks/gpu_followup.sh 2   # staging bandwidth; peers: HF offloaded caches vs kvferry
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
part=${1:-1}
if [ "$part" = 1 ]; then
  # issue 3: exactness gates on the 8B shape (4 layers), then decode against the bound
  python3 benchmarks/gpu_gates.py --random-weights llama3-8b --layers 4 --prompt-len 300 --ctx 1024 --chunk 128 \
    --out "$OUT" > "$OUT/gates.txt" 2>&1; echo "gates rc=$?"; grep -c ^PASS "$OUT/gates.txt"; grep ^FAIL "$OUT/gates.txt"
  OUT=$OUT bash benchmarks/gpu_perf.sh
  # issue 4: pageable vs pinned host KV at 16k, side by side; weight upload peak staging bytes
  python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 16384 -r 3 -nkvo 1 -kvpd 1 -pin 1,0 --device cuda \
    -o json > "$OUT/bench_pageable.json" 2> "$OUT/bench_pageable.log"; echo "pageable rc=$?"
  python3 benchmarks/load_peak.py --device cuda --out "$OUT" 2> "$OUT/load_peak.log"; echo "load_peak rc=$?"
else
  # issue 4: pageable copies through the staging buffer against pinned, 1 MiB to 4 GiB
  python3 benchmarks/staging_bench.py --out "$OUT" 2> "$OUT/staging.log"; echo "staging rc=$?"
  # issue 5: peers with repetitions
  python3 benchmarks/peers.py --preset llama3-8b -d 4096,16384,32768,65536 -n 32 -r 3 --device cuda --out "$OUT" \
    2> "$OUT/peers.log" | tail -7
fi
