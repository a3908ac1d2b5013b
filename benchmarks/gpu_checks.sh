#!/usr/bin/env bash
# GPU checks on the default model: CLI on cuda vs cpu, exactness gates, pageable vs pinned.
# Usage: OUT=dir MODEL=path.gguf bash benchmarks/gpu_checks.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
P="What is the capital of France?"
for dt in f32 bf16; do
  for dev in cuda cpu; do
    python3 -m kvferry run -m "$MODEL" -p "$P" --chat -n 48 --temp 0 --device $dev --dtype $dt --no-progress \
      > "$OUT/run_${dev}_${dt}.txt" 2>> "$OUT/run.log"
  done
  cmp -s "$OUT/run_cuda_${dt}.txt" "$OUT/run_cpu_${dt}.txt" && echo "run $dt: cuda == cpu" || echo "run $dt: cuda != cpu"
done
python3 -m kvferry run -m "$MODEL" -p "$P" --chat -n 48 --temp 0 --device cuda -nkvo -kvpd 1 --kv-debug 1 --no-progress \
  > "$OUT/run_cuda_nkvo.txt" 2> "$OUT/run_nkvo.log"
cmp -s "$OUT/run_cuda_nkvo.txt" "$OUT/run_cuda_bf16.txt" && echo "run -nkvo == device" || echo "run -nkvo != device"
python3 benchmarks/gpu_gates.py --device cuda --model "$MODEL" --out "$OUT" 2>"$OUT/gates.log" | tee "$OUT/gates.txt" | tail -4
python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 16384 -r 3 -nkvo 1 -kvpd 1 -pin 1,0 --device cuda \
  -o json > "$OUT/bench_pageable.json" 2> "$OUT/bench_pageable.log"; echo "pageable bench rc=$?"
