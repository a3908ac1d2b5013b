#!/usr/bin/env bash
# Issue 4 diagnosis on the GPU machine: where pageable host-KV decode time goes, with variants
# of the host-side knobs, plus the staging bandwidth bench under two of them.
# Usage: OUT=dir bash benchmarks/gpu_pageable_probe.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
B="--random-weights llama3-8b --layers 8 -d 16384 --device cuda"
V="default:;t8:threads=8;t12:threads=12;t4:threads=4;sw:switch=0.0002;poll:poll_us=20;c8:min_mib=8,split=1;c16:min_mib=16,split=1"
V="$V;t12c16:threads=12,min_mib=16,split=1;t12c16sw:threads=12,switch=0.0002,min_mib=16,split=1;default2:"
python3 benchmarks/pageable_probe.py --out "$OUT/kc8k" --variants "$V" -- $B -kvpd 2 2> "$OUT/kc8k.log"; echo "probe rc=$?"
python3 benchmarks/pageable_probe.py --out "$OUT/kc16k" \
  --variants "c16:min_mib=16,split=1;t12:threads=12;s75:h2d_share=0.75,min_mib=24,split=1;s75t12:h2d_share=0.75,min_mib=24,split=1,threads=12" \
  -- $B -kvpd 2 -kvpb 0 --kv-chunk 16384 2> "$OUT/kc16k.log"; echo "probe16k rc=$?"




