#!/usr/bin/env bash
# Issue 4 on the GPU machine, in one call: staging tests on CUDA, host-side copy costs,
# staging bandwidth against pinned (with a chunking sweep), pageable vs pinned host KV decode
# at 16k, and the weight-upload peak. Usage: OUT=dir bash benchmarks/gpu_staging.sh [quick]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
nproc; grep -m1 "model name" /proc/cpuinfo; python3 -c "import torch; print(torch.__version__, torch.get_num_threads())"
python3 -m pytest -q -p no:cacheprovider tests/test_staging.py 2>&1 | tail -2
python3 benchmarks/host_copy_probe.py | tee "$OUT/host_copy.md"
# where a pageable decode step's time goes (8 layers of the 8B shape at 16k), knobs around the defaults
python3 benchmarks/pageable_probe.py --out "$OUT/probe" --variants "default:;sw5:switch=0.005;t12:threads=12;default2:" \
  -- --random-weights llama3-8b --layers 8 -d 16384 -kvpd 2 --device cuda 2> "$OUT/probe.log"; echo "probe rc=$?"
sweep=""; [ "${1:-}" = quick ] || sweep="--sweep-min-chunk-mib 4,16 --sweep-split 1,4 --sweep-sizes-mib 4,16,64,256"
python3 benchmarks/staging_bench.py --out "$OUT" $sweep 2> "$OUT/staging.log"; echo "staging rc=$?"
python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 16384 -r 3 -nkvo 1 -kvpd 1,2 -pin 1,0 --device cuda \
  -o json > "$OUT/bench_pageable.json" 2> "$OUT/bench_pageable.log"; echo "pageable rc=$?"
python3 - "$OUT/bench_pageable.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"pin {r['pin']} kvpd {r['kvpd']}: {r['tps']} tok/s, {r['pct_bound']}% of bound, pinned {r['pinned_mib']} MiB, same {r['same']}")
PY
python3 benchmarks/load_peak.py --device cuda --out "$OUT" 2> "$OUT/load_peak.log"; echo "load_peak rc=$?"
# exactness on CUDA, pageable among the placements (8B shape, 4 layers)
python3 benchmarks/gpu_gates.py --random-weights llama3-8b --layers 4 --prompt-len 300 --ctx 1024 --chunk 128 \
  --out "$OUT" > "$OUT/gates.txt" 2>&1; echo "gates rc=$?"; tail -1 "$OUT/gates.txt"; grep ^FAIL "$OUT/gates.txt"
