#!/usr/bin/env bash
# Issue 4 on the GPU machine, in one call. Usage: OUT=dir bash benchmarks/gpu_staging.sh [SECTION...]
#   tests      staging tests on CUDA
#   ceiling    host-side copy costs and the fastest host copy (alone and under a DMA stream)
#   probe      where a pageable decode step goes (8 layers of the 8B shape at 16k), variants
#   bandwidth  staging bandwidth against pinned; sweep adds a chunking sweep
#   decode     pageable vs pinned host KV decode at 16k (kvferry bench), per --staging-on mode
#   load       the weight-upload staging peak
#   gates      exactness on CUDA, pageable among the placements
# No sections: all but sweep.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
secs=" ${*:-tests ceiling probe bandwidth decode load gates} "
on() { [[ "$secs" == *" $1 "* ]]; }
nproc; grep -m1 "model name" /proc/cpuinfo; (lscpu | grep -iE "socket|numa|L3|flags" | cut -c1-200; numactl -H 2>/dev/null | head -4; grep -E "Cpus_allowed_list|Mems_allowed_list" /proc/self/status) 2>&1
 python3 -c "import torch; print(torch.__version__, torch.get_num_threads())"
if on tests; then python3 -m pytest -q -p no:cacheprovider tests/test_staging.py 2>&1 | tail -3; fi
if on ceiling; then
  python3 benchmarks/host_copy_probe.py > "$OUT/host_copy.md"
  python3 benchmarks/host_copy_probe.py --ceiling 2048 >> "$OUT/host_copy.md"; cat "$OUT/host_copy.md"
fi
if on probe; then
  python3 benchmarks/pageable_probe.py --out "$OUT/probe" \
    --variants "${PROBE_VARIANTS:-auto:;pump_on_decode:thread=0;pump_t14:pump_threads=14;pump_t8:pump_threads=8;python_thread:native=0,thread=1;python_decode:native=0,thread=0;auto_again:}" \
    -- --random-weights llama3-8b --layers 8 -d 16384 -kvpd ${PROBE_KVPD:-2} --device cuda 2> "$OUT/probe.log"; echo "probe rc=$?"
  cat "$OUT/probe/pageable_probe.md"
fi
# PUMP_COPIES: the pump's memcpy stores to run the bandwidth and decode sections with
# (KVFERRY_PUMP_COPY: memcpy, stream); SWEEP_ARGS: staging_bench.py's sweep flags
if on bandwidth || on sweep; then
  sweep=""; on sweep && sweep=${SWEEP_ARGS:-"--sweep-min-chunk-mib 4,16 --sweep-split 1,4 --sweep-sizes-mib 4,16,64,256"}
  for pc in ${PUMP_COPIES:-memcpy}; do
    mkdir -p "$OUT/staging_$pc"
    KVFERRY_PUMP_COPY=$pc python3 benchmarks/staging_bench.py --out "$OUT/staging_$pc" $sweep 2> "$OUT/staging_$pc.log"
    echo "staging ($pc) rc=$?"
  done
fi
if on decode; then
  for pc in ${PUMP_COPIES:-memcpy}; do for mode in ${DECODE_MODES:-auto decode}; do
    f="$OUT/bench_pageable_${mode}_$pc"
    KVFERRY_PUMP_COPY=$pc python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 16384 -r 3 -nkvo 1 -kvpd ${DECODE_KVPD:-1,2} \
      -pin 1,0 --device cuda --staging-on $mode -o json > "$f.json" 2> "$f.log"; echo "pageable $mode $pc rc=$?"
    python3 - "$f.json" "$mode, $pc" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"staging on {sys.argv[2]}: pin {r['pin']} kvpd {r['kvpd']}: {r['tps']} tok/s, {r['pct_bound']}% of bound, "
          f"pinned {r['pinned_mib']} MiB, same {r['same']}")
PY
  done; done
fi
if on load; then python3 benchmarks/load_peak.py --device cuda --out "$OUT" 2> "$OUT/load_peak.log"; echo "load_peak rc=$?"; fi
if on gates; then
  python3 benchmarks/gpu_gates.py --random-weights llama3-8b --layers 4 --prompt-len 300 --ctx 1024 --chunk 128 \
    --out "$OUT" > "$OUT/gates.txt" 2>&1; echo "gates rc=$?"; tail -1 "$OUT/gates.txt"; grep ^FAIL "$OUT/gates.txt"
fi
exit 0
