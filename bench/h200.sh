#!/usr/bin/env bash
# One device call: the README's table of measured figures. Builds the benchmark pack (bench/build_pack.sh:
# the full preset's first LAYERS layers, default 16, dense projections as FP8 rows so that every budget down
# to 8 GB runs on one pack) while the GPU tests run, then `flashpack bench` emulating 48 layers at each of
# BUDGETS, every record the tiers hold pre-warmed ('*'). Results: $OUT/results.tgz (bench-NAME.json each,
# table.md from bench/table.py), beside gpu.txt, build.log and tests.log.
# Run with carry ["wheels"] (transformers 5.23, fla-core, jsonschema, zstandard; /work/.library/device/README.md):
# the script stops at once when one of the packages the stages import is missing there.
#
# Environment:
#   STAGES   what runs after the build, in order (default "tests budgets"):
#              tests    the CUDA tests (beside the build): TESTS, the test files (default: the kernels', the
#                       engine's and the store's GPU tests), within TESTS_TIMEOUT seconds (default 420; on a
#                       fresh machine beside the build four compile-heavy files took longer)
#              budgets  each of BUDGETS (unbounded 32-128 24-64 8-32), PROMPT tokens then GEN decoded
#              long     24/64 with a 32,768-token prompt
#              presets  8/32 with each named experiment of PRESETS (runtime/bench/presets.py), between
#                       two controls: e.g. PRESETS="copy-thread whole-reads"
#              speculation  each of SPEC_BUDGETS (default BUDGETS): plain decode against checked steps of
#                       replayed drafts right with probability alpha (runtime/bench/speculation.py;
#                       SPEC_ARGS: more of its arguments, e.g. "--set compile_checked=false"; SPEC_NAME: a
#                       suffix for the results' names). SPEC_VARIANTS="NAME=ARGS;NAME=ARGS" instead runs
#                       each variant (its ARGS after SPEC_ARGS) in turn, SPEC_REPEATS (default 1) times
#                       (A/B/A/B), as speculation-BUDGET-NAME.json (a repeat: -again); with BEFORE, each
#                       variant runs with this tree, then with that one (NAME-before)
#              first    a warmed engine's first requests of each kind against the next (bench/first_requests.py,
#                       every record resident, a 32,768-token document): on a fresh machine the compile caches are
#                       empty, so it shows what the warm-up leaves to a first start's requests; first-requests.{json,md}
#              collector  bench/collector_pauses.py on a tiny synthetic pack: a warmed GPU engine's full garbage
#                       collection, unfrozen and frozen, and the collections twenty requests of mixed lengths met
#                       (their checked steps captured as the attention caches grow); collector-pauses.json
#              step     a short prompt step's time on a tiny synthetic pack (bench/prompt_step.py: its layers'
#                       arithmetic is microseconds, so the step is the host's time a layer), each of
#                       STEP_VARIANTS="NAME=KEY=VALUE,...;NAME=..." (default: base, compile_prompt_pieces and
#                       prompt_graphs_max_tokens=128, all without speculation) alternated STEP_REPEATS (3)
#                       rounds in one process;
#                       prompt-step-tiny.{json,md}. Needs no benchmark pack: a call of only tests and step builds none
#              reuse    prompt-state reuse at each of REUSE_BUDGETS (default 24-64; bench/prompt_reuse.py): a
#                       follow-up on a 32,768-token document with no reuse, a live hit and a stored hit after
#                       a restart, and a 10-turn conversation; the stored states on the pack's disk;
#                       prompt-reuse-BUDGET.{json,md}; REUSE_ARGS: more of its arguments, e.g. "--trace /tmp/results"
#                       or "--set delta_rule_recurrent_max_tokens=16", or "--set compile_prompt_pieces=true
#                       --ab-rounds 5" (live hits with that setting and without, alternated in one process; with
#                       --ab-aside NAME, repeatable, a series of pairs each with only NAME set aside); REUSE_NAME: a suffix for the results' names.
#                       REUSE_VARIANTS="NAME=ARGS;NAME=ARGS" instead runs each variant (its ARGS after REUSE_ARGS)
#                       in turn, REUSE_REPEATS (default 1) times (A/B/A/B); REUSE_TAIL: log lines shown (40)
#              profile  bench/profile_decode.py at PROFILE_BUDGET (default 24-64), 48 layers emulated, every record
#                       pre-warmed, with PROFILE_ARGS (e.g. "--phase extend --prompt-len 32768 --extend-tokens 100
#                       --fresh-extension --trace"); profile-PROFILE_NAME.{txt,json} (default name: the budget)
#   BEFORE   another flashpack tree (e.g. .before, carried): each budget is benched with this tree and with
#            that one alternately, REPEATS (default 2) times each (A/B/A/B), on the same pack; in the reuse
#            and speculation stages each variant runs with this tree, then with that one (NAME-before)
#   BUILD_PACK  non-empty: build the benchmark pack even when no stage needs it (for the next call on a
#            warm machine, which keeps it)
#   PACK_DIR where the pack is built (default .bench-pack in the repository, which a warm machine keeps
#            between calls: a pack already there is used as it is)
# A bench of a call's first process compiles the decode graphs' kernels (~100 s on empty compile caches);
# later ones take ~40-60 s. The build of 16 layers takes about 2 minutes.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import transformers, fla, jsonschema, zstandard, xxhash, tqdm" || { echo "h200: a package is missing (carry wheels/)"; exit 1; }
LAYERS=${LAYERS:-16} GEN=${GEN:-32} PROMPT=${PROMPT:-512} W=${PACK_DIR:-$PWD/.bench-pack} R=/tmp/results
STAGES=${STAGES:-"tests budgets"} BUDGETS=${BUDGETS:-"unbounded 32-128 24-64 8-32"} REPEATS=${REPEATS:-2}
has() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
df -h "$(dirname "$W")" | tail -1 | tee -a $OUT/gpu.txt
start=$(date +%s)
needs_pack=0
for stage in $STAGES; do [[ " tests step " == *" $stage "* ]] || needs_pack=1; done
[ -n "$BUILD_PACK" ] && needs_pack=1
if [ $needs_pack = 0 ]; then
  echo "no stage needs the benchmark pack" > $OUT/build.log
elif [ -f $W/full.pack/manifest.json ]; then
  echo "pack kept from an earlier call: $W/full.pack" | tee $OUT/build.log
else
  ( DENSE_FP8=1 KEEP_SNAPSHOT=0 timeout 420 bash bench/build_pack.sh $W $LAYERS > $OUT/build.log 2>&1
    echo "build rc=$? $(( $(date +%s) - start )) s" >> $OUT/build.log ) &
  building=$!
fi
if has tests; then
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest ${TESTS:-tests/kernels tests/runtime/test_engine_slots.py tests/runtime/test_decode_graphs.py \
    tests/runtime/test_captured_call.py tests/runtime/test_delta_rule.py tests/runtime/test_dense_fp8.py \
    tests/runtime/test_host_copy.py tests/runtime/test_engine_config.py tests/store/test_store_stream.py \
    tests/store/test_store_fetch.py tests/store/test_store_slot_table.py tests/store/test_store_config.py \
    tests/test_sampling.py tests/runtime/test_speculative.py tests/runtime/test_rejection.py tests/runtime/test_checked_graphs.py \
    tests/runtime/test_prefix_cache.py tests/runtime/test_stored_states.py tests/runtime/test_arriving_state.py \
    tests/runtime/test_prompt_chunks.py} -q --tb=short -p no:cacheprovider -p no:logging > $OUT/tests.log 2>&1
  echo "tests rc=$? $(( $(date +%s) - start )) s" >> $OUT/tests.log
  tail -25 $OUT/tests.log
fi
[ -n "$building" ] && wait $building
cat $OUT/build.log
[ $needs_pack = 0 ] || [ -f $W/full.pack/manifest.json ] || exit 1
tree_path() {  # the PYTHONPATH that imports flashpack from tree $1 (none: this one)
  if [ -z "$1" ]; then echo "$PYTHONPATH"; return; fi
  mkdir -p /tmp/tree && ln -sfn "$(realpath "$1")" /tmp/tree/flashpack && echo /tmp/tree:/tmp/site
}
bench() {  # name, vram, ram, more bench arguments; TREE=DIR runs another flashpack tree's CLI
  local name=$1 vram=$2 ram=$3; shift 3
  while [ -f $R/bench-$name.json ]; do name=$name-again; done  # a name benched twice keeps both
  local path; path=$(tree_path "$TREE")
  echo "== $name at $(( $(date +%s) - start )) s"
  PYTHONPATH=$path timeout ${BENCH_TIMEOUT:-200} python3 -m flashpack.cli bench $W/full.pack --device cuda \
    ${vram:+--vram-budget $vram} ${ram:+--ram-budget $ram} --emulate-layers 48 --hot-set '*' \
    --prompt-len $PROMPT --gen $GEN --json $R/bench-$name.json --quiet "$@" 2>&1 | grep -E "decode tok/s|TTFT s|error" | head -4
}
budget() {  # a budget's name -> "VRAM RAM" ("" "" unbounded)
  case $1 in unbounded) echo '"" ""' ;; 32-128) echo "32GiB 128GiB" ;; 24-64) echo "24GiB 64GiB" ;; 8-32) echo "8GiB 32GiB" ;; esac
}
for stage in $STAGES; do
  case $stage in
    budgets)
      for b in $BUDGETS; do
        eval "set -- $(budget $b)"
        if [ -n "$BEFORE" ]; then
          for ((i = 1; i <= REPEATS; i++)); do
            bench $b "$1" "$2"; TREE=$BEFORE bench $b-before "$1" "$2"
          done
        else
          bench $b "$1" "$2"
        fi
        tar czf $OUT/results.tgz -C $R .
      done ;;
    long) PROMPT=32768 GEN=4 bench 24-64-32k 24GiB 64GiB ;;
    step)
      echo "== step at $(( $(date +%s) - start )) s"
      IFS=';' read -ra variants <<< "${STEP_VARIANTS:-base=speculate=off;pieces=speculate=off,compile_prompt_pieces=true;chunks=speculate=off,prompt_graphs_max_tokens=128}"
      timeout ${STEP_TIMEOUT:-240} python3 bench/prompt_step.py --device cuda "${variants[@]/#/--variant=}" --new 92 --new 16 \
        --repeats ${STEP_REPEATS:-3} --json $R/prompt-step-tiny.json > $OUT/step.log 2>&1
      echo "step rc=$? $(( $(date +%s) - start )) s" >> $OUT/step.log
      grep -v '^{' $OUT/step.log | tail -24 ;;
    speculation)
      IFS=';' read -ra variants <<< "${SPEC_VARIANTS:-${SPEC_NAME:-}=}"
      for b in ${SPEC_BUDGETS:-$BUDGETS}; do
        eval "set -- $(budget $b)"
        for ((i = 1; i <= ${SPEC_REPEATS:-1}; i++)); do
          for variant in "${variants[@]}"; do
            for tree in "" ${BEFORE:+"$BEFORE"}; do
              name=${variant%%=*} extra=${variant#*=} path=$(tree_path "$tree")
              [ -n "$tree" ] && name=${name:+$name-}before
              out=$R/speculation-$b${name:+-$name}
              while [ -f $out.json ]; do out=$out-again; done
              echo "== speculation $b ${name:-} at $(( $(date +%s) - start )) s"
              PYTHONPATH=$path timeout ${BENCH_TIMEOUT:-300} python3 -m flashpack.runtime.bench.speculation $W/full.pack \
                --device cuda ${1:+--vram-budget $1} ${2:+--ram-budget $2} --emulate-layers 48 --hot-set '*' \
                --prompt-len $PROMPT --gen ${SPEC_GEN:-64} $SPEC_ARGS $extra --json $out.json 2>&1 | grep -vE "^alpha" | tail -22
              tar czf $OUT/results.tgz -C $R .
            done
          done
        done
      done ;;
    presets)
      bench 8-32-control 8GiB 32GiB
      for p in $PRESETS; do bench 8-32-$p 8GiB 32GiB --preset $p; done
      bench 8-32-control 8GiB 32GiB ;;
    first)
      echo "== first requests at $(( $(date +%s) - start )) s"
      timeout ${FIRST_TIMEOUT:-300} python3 bench/first_requests.py $W/full.pack --device cuda --emulate-layers 48 \
        --hot-set '*' --document-tokens 32768 --json $R/first-requests.json --profiles /tmp/first-profiles > $OUT/first.log 2>&1
      echo "first rc=$? $(( $(date +%s) - start )) s" >> $OUT/first.log
      tr '\r' '\n' < $OUT/first.log | grep -v "loading experts" | tail -24 ;;
    collector)
      echo "== collector at $(( $(date +%s) - start )) s"
      timeout ${COLLECTOR_TIMEOUT:-240} python3 bench/collector_pauses.py --device cuda --json $R/collector-pauses.json \
        > $OUT/collector.log 2>&1
      echo "collector rc=$? $(( $(date +%s) - start )) s" >> $OUT/collector.log
      tail -30 $OUT/collector.log ;;
    profile)
      eval "set -- $(budget ${PROFILE_BUDGET:-24-64})"
      echo "== profile ${PROFILE_BUDGET:-24-64} at $(( $(date +%s) - start )) s"
      timeout ${PROFILE_TIMEOUT:-240} python3 bench/profile_decode.py $W/full.pack --device cuda ${1:+--vram-budget $1} \
        ${2:+--ram-budget $2} --emulate-layers 48 --hot-set '*' --name ${PROFILE_NAME:-${PROFILE_BUDGET:-24-64}} --out $R \
        $PROFILE_ARGS > $OUT/profile.log 2>&1
      echo "profile rc=$? $(( $(date +%s) - start )) s" >> $OUT/profile.log
      tr '\r' '\n' < $OUT/profile.log | grep -v "loading experts" | tail -40 ;;
    reuse)
      IFS=';' read -ra variants <<< "${REUSE_VARIANTS:-${REUSE_NAME:-}=}"
      for b in ${REUSE_BUDGETS:-24-64}; do
        eval "set -- $(budget $b)"
        for ((i = 1; i <= ${REUSE_REPEATS:-1}; i++)); do
          for variant in "${variants[@]}"; do
            for tree in "" ${BEFORE:+"$BEFORE"}; do
              name=${variant%%=*} extra=${variant#*=} path=$(tree_path "$tree")
              [ -n "$tree" ] && name=${name:+$name-}before
              out=prompt-reuse-$b${name:+-$name}
              while [ -f $R/$out.json ]; do out=$out-again; done
              echo "== reuse $b ${name:-} at $(( $(date +%s) - start )) s"
              PYTHONPATH=$path timeout ${REUSE_TIMEOUT:-360} python3 ${tree:-.}/bench/prompt_reuse.py $W/full.pack --device cuda \
                ${1:+--vram-budget $1} ${2:+--ram-budget $2} --emulate-layers 48 --hot-set '*' --document-tokens 32768 \
                --turns ${REUSE_TURNS:-10} --states-dir $W $REUSE_ARGS $extra --json $R/$out.json > $OUT/$out.log 2>&1
              echo "reuse rc=$? $(( $(date +%s) - start )) s" >> $OUT/$out.log
              rm -rf $W/prompt-states-*  # a run cut short leaves its stored states behind
              tr '\r' '\n' < $OUT/$out.log | grep -v "loading experts" | tail -${REUSE_TAIL:-40}
              tar czf $OUT/results.tgz -C $R .
            done
          done
        done
      done ;;
  esac
  tar czf $OUT/results.tgz -C $R .
done
if ls $R/bench-*.json > /dev/null 2>&1; then  # none where only the reuse stage ran
  python3 bench/table.py $(ls -tr $R/bench-*.json) --json $R/table.json > $R/table.md && cat $R/table.md
fi
tar czf $OUT/results.tgz -C $R .
