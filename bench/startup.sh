#!/usr/bin/env bash
# One device call: what a fresh process pays before it answers quickly (bench/startup.py), on a
# real-width pack of LAYERS layers and EXPERTS experts a layer. Cold and warm page cache loads; first
# requests with and without the engine's warm-up, on empty compile caches and on the caches a first
# process left; `flashpack run`'s one-shot path with and without decode graphs. Results: $OUT/startup.jsonl.
# STAGES picks the measurements and their order (default: all, listed below).
# Run with carry ["wheels"] (transformers 5.23, fla-core, jsonschema; /work/.library/device/README.md).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
LAYERS=${LAYERS:-4} EXPERTS=${EXPERTS:-128} W=/tmp/fp J=$OUT/startup.jsonl
start=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - start )) s"; }
EXPERTS=$EXPERTS KEEP_SNAPSHOT=0 timeout 300 bash bench/build_pack.sh $W $LAYERS || exit 1
stamp built
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(cannot drop the page cache)"; }
caches() { export TRITON_CACHE_DIR=/tmp/cache-$1/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cache-$1/inductor; }
measure() { timeout ${T:-150} python3 bench/startup.py $W/full.pack --json $J "$@" 2>&1 | grep -v Warning | tail -12; }
STAGES=${STAGES:-"cold warm fresh fresh-warm-up second-warm-up second-no-fla-cache graphs-fresh graphs-second eager-fresh eager-128 graphs-128"}
for stage in $STAGES; do
  stamp $stage
  case $stage in
    cold) caches load; drop; measure --mode load --label cold ;;  # page cache dropped first
    warm) caches load; measure --mode load --label warm ;;
    fresh) caches a; measure --mode requests --label fresh ;;  # empty compile caches, no warm-up
    fresh-warm-up) caches b; measure --mode requests --warm-up --label fresh-warm-up ;;
    second-warm-up) caches b; measure --mode requests --warm-up --label second-warm-up ;;  # the caches fresh-warm-up left
    second-no-fla-cache) caches b; FLA_CACHE_RESULTS=0 measure --mode requests --warm-up --label second-no-fla-cache ;;
    graphs-fresh) caches c; measure --mode one-shot --tokens 24 --label graphs-fresh ;;
    graphs-second) caches c; measure --mode one-shot --tokens 24 --label graphs-second ;;
    eager-fresh) caches d; measure --mode one-shot --tokens 24 --no-cuda-graphs --label eager-fresh ;;
    eager-128) caches ${EAGER_CACHES:-d}; measure --mode one-shot --tokens 128 --no-cuda-graphs --label eager-128 ;;
    graphs-128) caches ${GRAPH_CACHES:-c}; measure --mode one-shot --tokens 128 --label graphs-128 ;;
  esac
done
stamp done
python3 - "$J" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    extra = {k: row[k] for k in ("first_token_seconds", "decode_tok_s", "warm_up_seconds", "expert_gb_per_s_over_load") if k in row}
    print(f"{row['mode']:<9} {row['label']:<15} load {row['load_seconds']:>7.2f} s  process {row['process_seconds']:>7.2f} s  {extra}")
    for request in row.get("requests", []):
        print(f"    {request['prompt_tokens']:>6} tokens: {request['seconds']:.3f} s (first token {request['first_token_seconds']:.3f} s)")
EOF
