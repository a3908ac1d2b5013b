#!/usr/bin/env bash
# The GPU runs still owed by issues 3-5, in one call (random weights: no model files needed).
# Usage: OUT=dir bash benchmarks/gpu_followup.sh     (about 8 minutes on an H200)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
# issue 3: decode against the bound after the write-back lane change
OUT=$OUT bash benchmarks/gpu_perf.sh
# issue 4: pageable vs pinned host KV at 16k, side by side; weight upload peak staging bytes
python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 16384 -r 3 -nkvo 1 -kvpd 1 -pin 1,0 --device cuda \
  -o json > "$OUT/bench_pageable.json" 2> "$OUT/bench_pageable.log"; echo "pageable rc=$?"
python3 benchmarks/load_peak.py --device cuda --out "$OUT" 2> "$OUT/load_peak.log"
# issue 5: peers with repetitions
python3 benchmarks/peers.py --preset llama3-8b -d 4096,16384,32768,65536 -n 32 -r 3 --device cuda --out "$OUT" \
  2> "$OUT/peers.log" | tail -7
