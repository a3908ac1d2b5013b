#!/usr/bin/env bash
# Issue 4 on the GPU machine. Usage: OUT=dir bash benchmarks/gpu_staging.sh [SECTION...]
# All sections run past one call's 10 minutes: split them, e.g. `tests ceiling bandwidth sweep`
# in one call and `decode probe load gates` (DECODE_THP="1 0") in the next.
#   tests      staging tests on CUDA
#   ceiling    host-side copy costs and the fastest host copy (alone and under a DMA stream)
#   probe      where a pageable decode step goes (8 layers of the 8B shape at 16k), variants
#   bandwidth  staging bandwidth against pinned; sweep adds a chunking sweep
#   decode     pageable vs pinned host KV decode at 16k (kvferry bench), per --staging-on mode
#              (DECODE_MODES) and huge-page setting of the pageable cache (DECODE_THP: 1 on, 0 off)
#   load       the weight-upload staging peak
#   gates      exactness on CUDA, pageable among the placements
# No sections: all but sweep.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
secs=" ${*:-tests ceiling probe bandwidth decode load gates} "
on() { [[ "$secs" == *" $1 "* ]]; }
nproc; grep -m1 "model name" /proc/cpuinfo; (lscpu | grep -iE "socket|numa|L3|flags" | cut -c1-200; numactl -H 2>/dev/null | head -4; grep -E "Cpus_allowed_list|Mems_allowed_list" /proc/self/status) 2>&1
 python3 -c "import torch; print(torch.__version__, torch.get_num_threads())"
grep -H . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1
if on tests; then python3 -m pytest -q -p no:cacheprovider tests/test_staging.py tests/test_hostmem.py 2>&1 | tail -3; fi
if on ceiling; then
  python3 benchmarks/host_copy_probe.py > "$OUT/host_copy.md"
  python3 benchmarks/host_copy_probe.py --ceiling 2048 >> "$OUT/host_copy.md"; cat "$OUT/host_copy.md"
fi
if on probe; then
  python3 benchmarks/pageable_probe.py --out "$OUT/probe" \
    --variants "${PROBE_VARIANTS:-auto:;worker_t12:pump_threads=12;worker_stream:stream=1;pump_thread:worker=0,thread=1;pump_decode:worker=0,thread=0;python_decode:worker=0,native=0,thread=0;auto_again:}" \
    -- --random-weights llama3-8b --layers 8 -d 16384 -kvpd ${PROBE_KVPD:-2} --device cuda 2> "$OUT/probe.log"; echo "probe rc=$?"
  cat "$OUT/probe/pageable_probe.md"
fi
# PUMP_COPIES: the pump's memcpy stores to run the bandwidth and decode sections with
# (KVFERRY_PUMP_COPY: memcpy, stream); SWEEP_ARGS: staging_bench.py's sweep flags
if on bandwidth || on sweep; then
  sweep=""; on sweep && sweep=${SWEEP_ARGS:-"--sweep-pump-min-chunk-kib 64,256,1024 --sweep-sizes-mib 1,4,16,64"}
  for pc in ${PUMP_COPIES:-memcpy}; do
    mkdir -p "$OUT/staging_$pc"
    KVFERRY_PUMP_COPY=$pc python3 benchmarks/staging_bench.py --out "$OUT/staging_$pc" $sweep 2> "$OUT/staging_$pc.log"
    echo "staging ($pc) rc=$?"
  done
fi
if on decode; then
  for pc in ${PUMP_COPIES:-memcpy}; do for mode in ${DECODE_MODES:-worker decode}; do for thp in ${DECODE_THP:-1}; do
    f="$OUT/bench_pageable_${mode}_${pc}_thp$thp"
    KVFERRY_HOST_THP=$thp KVFERRY_PUMP_COPY=$pc python3 -m kvferry bench --random-weights llama3-8b -p 0 -n 32 -d 16384 -r 3 -nkvo 1 -kvpd ${DECODE_KVPD:-1,2} \
      -pin 1,0 --device cuda --staging-on $mode -o json > "$f.json" 2> "$f.log"; echo "pageable $mode $pc rc=$?"
    python3 - "$f.json" "$mode, $pc, thp $thp" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for r in rows:
    pinned = [p["tps"] for p in rows if p["pin"] == "1" and p["kvpd"] == r["kvpd"]]
    vs = f", {100 * r['tps'] / pinned[0]:.0f}% of pinned" if pinned and r["pin"] == "0" else ""
    print(f"staging on {sys.argv[2]}: pin {r['pin']} kvpd {r['kvpd']}: {r['tps']} tok/s{vs}, {r['pct_bound']}% of bound, "
          f"pinned {r['pinned_mib']} MiB, same {r['same']}")
PY
  done; done; done
fi
if on load; then python3 benchmarks/load_peak.py --device cuda --out "$OUT" 2> "$OUT/load_peak.log"; echo "load_peak rc=$?"; fi
if on gates; then
  python3 benchmarks/gpu_gates.py --random-weights llama3-8b --layers 4 --prompt-len 300 --ctx 1024 --chunk 128 \
    --out "$OUT" > "$OUT/gates.txt" 2>&1; echo "gates rc=$?"; tail -1 "$OUT/gates.txt"; grep ^FAIL "$OUT/gates.txt"
fi
exit 0
