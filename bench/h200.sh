#!/usr/bin/env bash
# One device call: CUDA tests (while the pack builds), build `full --layers $LAYERS`, `flashpack bench`
# at three budgets emulating 48 layers (transformers baseline at 24/64), decode profiles. Results in
# $OUT/results.tgz (rewritten after every stage, so a call cut short still brings back what it finished),
# beside gpu.txt, tests.log and run.log.
# Run with carry ["wheels"] (transformers 5.23 + jsonschema wheels; /work/.library/device/README.md).
# STAGES picks steps and their order (default all, the list below); tests run beside the build, the
# rest after it. staging times the stage_records kernel against the copy engine (bench/kernels.py);
# kernels runs bench/kernels.py's sections KERNELS (default: the router, the hyper-connection mix,
# the BF16 decode matvec against cuBLAS, the NVFP4 decode experts, the matvec/grouped crossover) with
# SWEEP seconds of block-size sweep each (empty: none); unbounded-cublas is unbounded with every
# projection on cuBLAS; unbounded-unfused-mix and unfused-mix bench as unbounded and budgets do with
# --no-fused-mix (hyper-connection mixes as the module's code); ahead-programs benches 24/64 with the
# next layer's staging kernel on AHEAD programs (the engine's AHEAD_PROGRAMS, 32) to see whether it
# starves beside the layers' kernels;
# verify checks the tiny preset layer by layer on the GPU at VERIFY_DTYPES (default float32 bfloat16), beside
# the build (~2 min a dtype: Triton autotunes), and takes the stacks of a process that does not exit;
# reads times record reads from the pack's disk (bench/store.py --only-io): whole, and split as the store's
# reader splits them; sampling times a token's choice on the GPU against copying the logits to the host first;
# no-prefetch and promote bench 24/64 as budgets does, but without next-layer prefetch, or with
# promotions; one-graph and unbounded-one-graph as budgets and unbounded do, with the whole step in
# one CUDA graph (--graph-layers $LAYERS) instead of one graph a layer. hotset and fp8-hot profile the
# synth corpus on the GPU (`flashpack profile`) and pre-warm 24/64 (and fp8-hot 8/32 and 24/64 on the
# --dense-fp8 pack) from that hot set; control benches its 8/32 unchanged again, switch-interval with the
# interpreter's GIL switch interval at each of SWITCH (default 0.0005 s), and late-prefetch,
# guesses-wait, copy-thread, no-read-ahead and whole-reads with one setting changed each (the next
# layer's prefetch once a layer's loads landed; no prefetch read beside a running required read; a
# decode layer's copies handed to the copy thread; no disk reads for the layer after next
# (--no-read-ahead; the default before session 13); each record read whole; the first bench of a call
# runs after the FP8 convert and the hot set's profile, on a disk that reads slower then, so put a
# control first);
# beside benches fp8-hot's 24/64 with BESIDE's counts (default 0 2) of the next graph's predicted records
# staged beside a graph's last experts (decode_graphs.STAGED_BESIDE_EXPERTS, default 1);
# profile-8g and profile-24g profile 8/32 and 24/64 decode on that pack from the same hot set
# (baked once a call).
# fp8 converts a --dense-fp8 pack from the same snapshot and benches 8/32 on it (BF16 dense
# weights alone exceed an 8 GB card at 48 layers); fp8-star does so with the tiers pre-warmed ('*',
# no profile to run first). budgets, long (a 32k prompt) and baseline (with
# transformers + accelerate beside) run 24/64 with every record pre-warmed (--hot-set '*'). TESTS
# overrides the GPU test list.
# Timing on an H200 (runs 14-26): build 124-204 s (LAYERS=4; synth alone 107-183 s; the FP8 pack is
# converted by the first stage that needs it), tests 154-204 s beside it, a float32 verify 150-195 s
# beside it, the first bench of a call ~100-120 s (Inductor compiles), later ones 40-60 s, hotset ~90 s,
# fp8-hot with its FP8 convert and hot set ~265 s, reads ~35 s, the resident profile ~35 s, long ~55 s;
# all stages exceed one call's 600 s, and a machine keeps nothing between calls, so split STAGES over
# calls (each rebuilds).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
LAYERS=${LAYERS:-4} GEN=${GEN:-32} PROMPT=${PROMPT:-512} W=/tmp/fp R=/tmp/results STAGES=${STAGES:-"tests reads unbounded fp8 fp8-star budgets long baseline profile hotset verify prefill-profile prefill-profile-tiered profile-8g profile-24g eager fp8-unbounded staging no-prefetch promote one-graph unbounded-one-graph fp8-hot control beside switch-interval late-prefetch guesses-wait copy-thread no-read-ahead whole-reads sampling kernels unbounded-no-combo unbounded-unfused-mix unfused-mix unbounded-cublas ahead-programs"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
start=$(date +%s)
( timeout 420 python3 -m flashpack.cli synth full $W/src --format nvfp4 --layers $LAYERS --ple-rows-per-head 2000 \
    --text-only --force >/dev/null && echo "synth $(( $(date +%s) - start )) s" >> $OUT/gpu.txt \
  && timeout 150 python3 -m flashpack.cli convert $W/src $W/full.pack --force >/dev/null 2>&1 \
  ; echo "build rc=$? $(( $(date +%s) - start )) s" >> $OUT/gpu.txt ) &
build=$!
verify_tiny() {  # the tiny preset verified on the GPU at each of VERIFY_DTYPES (FP32 must match the reference to 1e-4);
  # a process still alive 20 s after writing its report, or at VERIFY_TIMEOUT, is stuck: its native stacks
  # (cuda-gdb, the machine has no gdb) go to verify-tiny-DTYPE.stacks, then SIGABRT has faulthandler print the Python ones
  timeout 60 python3 -m flashpack.cli synth tiny $W/tiny --force >/dev/null && \
    timeout 60 python3 -m flashpack.cli convert $W/tiny $W/tiny.pack --force >/dev/null 2>&1
  for dtype in ${VERIFY_DTYPES:-float32 bfloat16}; do
    local report=$R/verify-tiny-$dtype.json waited=0 reported=""
    PYTHONFAULTHANDLER=1 python3 -m flashpack.cli verify $W/tiny.pack --reference $W/tiny --device cuda --dtype $dtype \
      --json $report > $R/verify-tiny-$dtype.log 2>&1 &
    local pid=$!
    while kill -0 $pid 2>/dev/null && (( waited < ${VERIFY_TIMEOUT:-200} )); do
      sleep 1; waited=$((waited + 1))
      [ -z "$reported" ] && [ -f $report ] && reported=$waited
      [ -n "$reported" ] && (( waited - reported >= 20 )) && break
    done
    if kill -0 $pid 2>/dev/null; then
      echo "verify $dtype still running at $waited s (report written at ${reported:-never} s)"
      timeout 90 cuda-gdb -p $pid -batch -ex "info threads" -ex "thread apply all bt 30" > $R/verify-tiny-$dtype.stacks 2>&1
      kill -ABRT $pid; sleep 3; kill -KILL $pid 2>/dev/null
    fi
    wait $pid; echo "verify $dtype rc=$? after $waited s"; tail -3 $R/verify-tiny-$dtype.log
  done
}
if has verify; then verify_tiny > $OUT/verify.log 2>&1 & verifying=$!; fi  # beside the build too: it needs only the tiny preset
if has tests; then
  timeout 420 python3 -m pytest ${TESTS:-tests/kernels tests/runtime/test_engine_slots.py tests/runtime/test_decode_graphs.py tests/runtime/test_captured_call.py \
    tests/runtime/test_delta_rule.py tests/runtime/test_dense_fp8.py tests/runtime/test_host_copy.py tests/store/test_store_stream.py \
    tests/store/test_store_fetch.py tests/store/test_store_slot_table.py tests/test_sampling.py} -q --tb=short \
    -p no:cacheprovider -p no:logging > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - start )) s" >> $OUT/tests.log
  tail -40 $OUT/tests.log
fi
wait $build; cat $OUT/gpu.txt; [ -n "$verifying" ] && wait $verifying && cat $OUT/verify.log; [ -f $W/full.pack/manifest.json ] || exit 1
fp8_pack() {  # the --dense-fp8 pack from the same snapshot, converted when a stage first needs it
  [ -f $W/full-fp8.pack/manifest.json ] || timeout 150 python3 -m flashpack.cli convert $W/src $W/full-fp8.pack \
    --dense-fp8 --force >/dev/null 2>&1
}
hot_set() {  # bake the hot set `corpus` into $W/$1.pack (once): the synth corpus's prompts, 32 tokens each
  [ -f $W/$1.corpus ] && return
  python3 -c "import json; [print(json.dumps({'prompt': t})) for t in json.load(open('convert/synth/corpus.json'))['texts']]" \
    > $W/workload.jsonl
  timeout 200 python3 -m flashpack.cli profile $W/$1.pack --workload $W/workload.jsonl --name corpus \
    --device cuda --max-tokens 32 2>&1 | tail -1 && touch $W/$1.corpus
}
bench() {  # name, vram, ram, extra args (PACK=full-fp8 for the --dense-fp8 pack)
  local name=$1 vram=$2 ram=$3; shift 3
  while [ -f $R/bench-$name.json ]; do name=$name-again; done  # a stage named twice in STAGES keeps both
  local entry=(-m flashpack.cli); [ -n "$BENCH_PY" ] && entry=(-c "$BENCH_PY")  # BENCH_PY: code standing in for the CLI
  timeout ${BENCH_TIMEOUT:-150} python3 "${entry[@]}" bench $W/${PACK:-full}.pack --device cuda ${vram:+--vram-budget $vram} \
    ${ram:+--ram-budget $ram} --emulate-layers 48 --json $R/bench-$name.json --quiet "$@" 2>&1 | tail -22
}
hot_8g() {  # name suffix, a Python statement changing one setting first ("": none), more bench args:
  # 8/32 on the --dense-fp8 pack pre-warmed from the hot set (fp8-hot's, and its variants')
  fp8_pack; hot_set full-fp8
  BENCH_PY=${2:+"$2; from flashpack.cli import main; main()"} PACK=full-fp8 \
    bench 8g-32g-fp8-hot$1 8GiB 32GiB --prompt-len $PROMPT --gen $GEN --hot-set corpus "${@:3}"
}
for stage in $STAGES; do
  echo "== $stage at $(( $(date +%s) - start )) s"
  case $stage in
    reads)  # the pack's records read from disk at 1, 4 and 16 threads, whole and in the reader's parts
      timeout 120 python3 bench/store.py $W/full.pack --device cuda --only-io --io-records 256 --io-file-mb 0 \
        --json $R/store-reads-h200.json 2>&1 | tail -12 ;;
    sampling) timeout 60 python3 bench/sampling.py --device cuda --json $R/sampling.json 2>&1 | tail -5 ;;
    kernels) sweep=${SWEEP-40}  # KERNELS picks bench/kernels.py's sections, SWEEP their sweeps' seconds (empty: none)
      timeout 180 python3 bench/kernels.py --only ${KERNELS:-router,hc-mix,dense,decode,crossover} ${sweep:+--sweep --sweep-seconds $sweep} \
      --json $R/kernels-decode.json 2>&1 | tail -50 ;;
    unbounded-unfused-mix) bench unbounded-unfused-mix "" "" --prompt-len $PROMPT --gen $GEN --no-fused-mix ;;
    unfused-mix) bench 24g-64g-unfused-mix 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' --no-fused-mix ;;
    staging) timeout 120 python3 bench/kernels.py --only staging --sweep --sweep-seconds 20 \
      --json $R/kernels-staging.json 2>&1 | tail -30 ;;
    unbounded) bench unbounded "" "" --prompt-len $PROMPT --gen $GEN ;;
    unbounded-cublas)  # the control for the decode matvec kernel: every BF16 projection on cuBLAS
      BENCH_PY="import sys; from flashpack.runtime.kernels import dispatch; dispatch.DENSE_MATVEC_MAX_TOKENS = 0; from flashpack.cli import main; main()" \
        bench unbounded-cublas "" "" --prompt-len $PROMPT --gen $GEN ;;
    ahead-programs)  # 24/64 with the side stream's staging kernel on AHEAD (default 64) programs instead of 32
      BENCH_PY="import sys; from flashpack.runtime.engine import decode_graphs; decode_graphs.AHEAD_PROGRAMS = ${AHEAD:-64}; from flashpack.cli import main; main()" \
        bench 24g-64g-ahead-${AHEAD:-64} 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' ;;
    unbounded-no-combo)  # the control for the engine's inductor combo kernels: compiled without them
      BENCH_PY="import sys; from flashpack.runtime.engine import decode_graphs; decode_graphs.COMPILE_OPTIONS = {}; from flashpack.cli import main; main()" \
        bench unbounded-no-combo "" "" --prompt-len $PROMPT --gen $GEN ;;
    unbounded-one-graph) bench unbounded-one-graph "" "" --prompt-len $PROMPT --gen $GEN --graph-layers $LAYERS ;;
    one-graph) bench 24g-64g-one-graph 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' --graph-layers $LAYERS ;;
    fp8) fp8_pack; PACK=full-fp8 bench 8g-32g-fp8 8GiB 32GiB --prompt-len $PROMPT --gen $GEN ;;
    fp8-star) fp8_pack; PACK=full-fp8 bench 8g-32g-fp8-star 8GiB 32GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' ;;
    budgets) bench 24g-64g 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' ;;
    long) bench 24g-64g-32k 24GiB 64GiB --prompt-len 32768 --gen 4 --hot-set '*' ;;
    baseline) bench 24g-64g-baseline 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' \
      --baseline transformers --baseline-layers 2 ;;
    profile)  # PROFILES picks: resident tiered overhead (default all)
      if [[ " ${PROFILES:-resident tiered overhead} " == *" resident "* ]]; then
        timeout 90 python3 bench/profile_decode.py $W/full.pack --name resident --trace --out $R 2>&1 | tail -1; fi
      if [[ " ${PROFILES:-resident tiered overhead} " == *" tiered "* ]]; then
        timeout 120 python3 bench/profile_decode.py $W/full.pack --name tiered-24g-64g --vram-budget 24GiB \
          --ram-budget 64GiB --emulate-layers 48 --hot-set '*' --trace --out $R 2>&1 | tail -1; fi
      if [[ " ${PROFILES:-resident tiered overhead} " == *" overhead "* ]]; then
        timeout 90 python3 bench/store_overhead.py $W/full.pack --device cuda --calls 1000 \
          --json $R/store-overhead-h200.json 2>&1 | tail -1; fi ;;
    no-prefetch) bench 24g-64g-no-prefetch 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' --no-prefetch ;;
    promote) bench 24g-64g-promote 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set '*' --promote ;;
    hotset)  # a hot set profiled on the synth corpus, then 24/64 pre-warmed from it (not '*': id order)
      hot_set full
      bench 24g-64g-hot 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set corpus ;;
    fp8-hot) fp8_pack; hot_set full-fp8  # HOT_BUDGETS picks: 8g 24g (default both)
      if [[ " ${HOT_BUDGETS:-8g 24g} " == *" 8g "* ]]; then hot_8g "" ""; fi
      # FP8 dense weights leave a 24 GB card some 3.5 GB more for experts at 48 layers
      if [[ " ${HOT_BUDGETS:-8g 24g} " == *" 24g "* ]]; then
        PACK=full-fp8 bench 24g-64g-fp8-hot 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set corpus; fi ;;
    control)  # fp8-hot's 8/32 again, later in the call, as the control for the variants around it
      hot_8g -control "" ;;
    beside)  # 24/64 as fp8-hot with each of BESIDE (default 0 2) of the next graph's records staged beside a
      # graph's last experts (decode_graphs.STAGED_BESIDE_EXPERTS; 0 as before session 13)
      fp8_pack; hot_set full-fp8
      for n in ${BESIDE:-0 2}; do
        BENCH_PY="from flashpack.runtime.engine import decode_graphs; decode_graphs.STAGED_BESIDE_EXPERTS = $n; from flashpack.cli import main; main()" \
          PACK=full-fp8 bench 24g-64g-fp8-hot-beside-$n 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --hot-set corpus
      done ;;
    late-prefetch)  # a through-store layer prefetches once its own loads landed (before session 11)
      hot_8g -late-prefetch "from flashpack.runtime.model import moe; moe.PREFETCH_DURING_LOADS = False" ;;
    guesses-wait)  # a prefetch read waits while a required read runs (session 11)
      hot_8g -guesses-wait "" --set store.guesses_beside_required=false ;;
    no-read-ahead)  # no disk reads for the layer after next (before session 13)
      hot_8g -no-read-ahead "" --no-read-ahead ;;
    switch-interval)  # the interpreter handing the GIL between threads every SWITCH seconds (default 0.0005; Python's 0.005)
      for s in ${SWITCH:-0.0005}; do hot_8g -switch-$s "import sys; sys.setswitchinterval($s)"; done ;;
    copy-thread)  # a decode layer's host-cache copies handed to the copy thread (before session 12)
      hot_8g -copy-thread "" --set store.copy_on_requesting_thread=false ;;
    whole-reads)  # each record read as one part (before session 11)
      hot_8g -whole-reads "" --set store.read_pieces=1 ;;
    profile-8g|profile-24g)  # 8/32 or 24/64 on the --dense-fp8 pack with the hot set: where a decode layer's time goes
      fp8_pack; hot_set full-fp8
      if [ $stage = profile-8g ]; then vram=8 ram=32; else vram=24 ram=64; fi
      timeout 150 python3 bench/profile_decode.py $W/full-fp8.pack --name tiered-${vram}g-${ram}g-hot --vram-budget ${vram}GiB \
        --ram-budget ${ram}GiB --emulate-layers 48 --hot-set corpus --trace --out $R 2>&1 | tail -12 ;;
    prefill-profile)  # every record resident: where a 32k prompt's compute goes
      timeout 150 python3 bench/profile_decode.py $W/full.pack --phase prefill --prompt-len 32768 \
        --name prefill-32k --trace --out $R 2>&1 | tail -30 ;;
    prefill-profile-tiered)  # the same prompt at 24/64 (every record the tiers hold pre-warmed): the streamed experts' cost
      timeout 150 python3 bench/profile_decode.py $W/full.pack --phase prefill --prompt-len 32768 --vram-budget 24GiB \
        --ram-budget 64GiB --emulate-layers 48 --hot-set '*' --name prefill-32k-24g --trace --out $R 2>&1 | tail -30 ;;
    eager)
      bench unbounded-eager "" "" --prompt-len $PROMPT --gen $GEN --no-cuda-graphs
      bench 24g-64g-eager 24GiB 64GiB --prompt-len $PROMPT --gen $GEN --no-cuda-graphs ;;
    fp8-unbounded) fp8_pack; PACK=full-fp8 bench unbounded-fp8 "" "" --prompt-len $PROMPT --gen $GEN ;;
  esac
  tar czf $OUT/results.tgz -C $R .  # at most 8 files come back from a device call: one archive
done
