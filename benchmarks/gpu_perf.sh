#!/usr/bin/env bash
# Decode speed on the GPU machine: Llama-3-8B shape, random bf16 weights, batch 1,
# device-resident vs host ordered vs host pipelined (depth 1 and 2), with and without
# CUDA graphs, A/B/A/B.
# Usage: OUT=dir bash benchmarks/gpu_perf.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 4096,16384,32768,65536 -r 3 \
  -nkvo 0,1 -kvpd 0,1,2 -cg on,off --device cuda -o json --plot "$OUT/bench_llama3_8b.png" \
  > "$OUT/bench_llama3_8b.json" 2> "$OUT/bench_llama3_8b.log"
echo "bench rc=$?"; tail -3 "$OUT/bench_llama3_8b.log"
