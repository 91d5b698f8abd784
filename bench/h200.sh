#!/usr/bin/env bash
# One device call: CUDA tests, build `full --layers $LAYERS`, `flashpack bench` at three budgets
# (emulating 48 layers) with the transformers baseline at one, and a decode profile. Results in $OUT.
# Run with carry ["wheels"] (transformers 5.23 + jsonschema wheels; /work/.library/device/README.md).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
fp() { python3 -m flashpack.cli "$@"; }
LAYERS=${LAYERS:-4} GEN=${GEN:-32} PROMPT=${PROMPT:-512} W=/tmp/fp
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
if [ -z "$SKIP_TESTS" ]; then
  timeout 200 python3 -m pytest tests/kernels tests/runtime/test_engine_slots.py -q -x -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests.log
fi
start=$(date +%s)
timeout 360 python3 -m flashpack.cli synth full $W/src --format nvfp4 --layers $LAYERS --ple-rows-per-head 20000 --text-only --force >/dev/null || exit 1
timeout 120 python3 -m flashpack.cli convert $W/src $W/full.pack --force 2>&1 | tail -2
echo "build: $(( $(date +%s) - start )) s" | tee -a $OUT/gpu.txt
bench() {  # name, vram, ram, extra args
  local name=$1 vram=$2 ram=$3; shift 3
  timeout ${BENCH_TIMEOUT:-150} python3 -m flashpack.cli bench $W/full.pack --device cuda ${vram:+--vram-budget $vram} \
    ${ram:+--ram-budget $ram} --prompt-len $PROMPT --gen $GEN --emulate-layers 48 --json $OUT/bench-$name.json "$@" 2>&1 \
    | grep -v "it/s\]" | tail -30
}
bench unbounded "" ""
bench 24g-64g 24GiB 64GiB --baseline transformers --baseline-layers 2
bench 8g-32g 8GiB 32GiB
timeout 90 python3 bench/profile_decode.py $W/full.pack --name resident --out $OUT 2>&1 | tail -2
timeout 90 python3 bench/profile_decode.py $W/full.pack --vram-budget 4.3GiB --ram-budget 6GiB --name tiered --out $OUT 2>&1 | tail -2
