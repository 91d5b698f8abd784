#!/usr/bin/env bash
# bench/build_pack.sh OUT_DIR [LAYERS]: the benchmark pack, OUT_DIR/full.pack, of the full preset cut to
# LAYERS layers (default 16: the 3 DeltaNet + 1 attention pattern four times, a third of the model, so
# per-layer figures scale to 48). Text only, NVFP4 experts drawn fast (`synth --fast-experts`: the same
# bytes, magnitudes and routing skew as sampled ones, about 15x cheaper), PLE shrunk to 2000 rows a
# hash head. A previous build's OUT_DIR/src and OUT_DIR/full.pack are replaced; the snapshot stays in
# OUT_DIR/src (a --dense-fp8 pack converts from it) unless KEEP_SNAPSHOT=0. Prints the seconds each
# part took and the sizes; refuses to start when the disk cannot hold the snapshot and the pack
# together (16 layers: 29.0 GB each).
# Environment: EXPERTS (cut the routed experts a layer, default all 512), PYTHON (default python3, with
# flashpack importable), CHECK=1 (also `flashpack inspect --check` the pack: it reads every byte),
# DENSE_FP8=1 (convert with --dense-fp8: dense projections as FP8 rows, as an 8 GB card needs at 48 layers).
set -eo pipefail
OUT_DIR=${1:?usage: bench/build_pack.sh OUT_DIR [LAYERS]}
LAYERS=${2:-16}
PY=${PYTHON:-python3}
SRC=$OUT_DIR/src PACK=$OUT_DIR/full.pack
SYNTH_ARGS=(full "$SRC" --format nvfp4 --fast-experts --layers "$LAYERS" --ple-rows-per-head 2000 --text-only --force)
[ -n "$EXPERTS" ] && SYNTH_ARGS+=(--experts "$EXPERTS")
mkdir -p "$OUT_DIR"
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
gb() { awk -v n="$1" 'BEGIN { printf "%.2f GB", n / 1e9 }'; }

# The snapshot's tensor bytes, from the plan alone (nothing sampled); the pack holds about as many.
need=$("$PY" - "$LAYERS" "${EXPERTS:-0}" <<'EOF'
import sys
from flashpack.convert.synth.init_values import ValueSource
from flashpack.convert.synth.presets import SynthOptions, resolve_plan
from flashpack.convert.synth.tensor_plan import disk_tensors
layers, experts = int(sys.argv[1]), int(sys.argv[2]) or None
plan = resolve_plan(SynthOptions("full", format="nvfp4", layers=layers, experts=experts, text_only=True,
                                 ple_rows_per_head=2000))
print(sum(t.nbytes for t in disk_tensors(plan, ValueSource(plan.cfg, 0, plan.nominal_layers))))
EOF
)
# A previous build's snapshot and pack go first (synth and convert would hold old and new at once);
# anything else there is not ours to delete.
for old in "$SRC:model.safetensors.index.json" "$PACK:manifest.json"; do
  dir=${old%:*} marker=${old##*:}
  [ -e "$dir" ] || continue
  [ -f "$dir/$marker" ] || { echo "build: $dir exists and is no snapshot or pack; not replacing it" >&2; exit 1; }
  rm -rf "$dir"
done
free=$(( $(df --output=avail -B1 "$OUT_DIR" | tail -1) ))
echo "build: $LAYERS layers; snapshot ~$(gb "$need"), pack ~$(gb "$need"); $(gb "$free") free in $OUT_DIR"
if (( 2 * need + (1 << 30) > free )); then  # 1 GiB for the pack's manifest, tokenizer and slack
  echo "build: not enough disk for the snapshot and the pack together; use fewer LAYERS" >&2
  exit 1
fi

start=$(now)
"$PY" -m flashpack.cli synth "${SYNTH_ARGS[@]}" >/dev/null
synthed=$(now)
echo "synth $(seconds "$start" "$synthed") s ($(gb "$(du -sb "$SRC" | cut -f1)"))"
"$PY" -m flashpack.cli convert "$SRC" "$PACK" --force --quiet $( [ "$DENSE_FP8" = 1 ] && echo --dense-fp8 ) >/dev/null
converted=$(now)
echo "convert $(seconds "$synthed" "$converted") s ($(gb "$(du -sb "$PACK" | cut -f1)"))"
if [ "$CHECK" = 1 ]; then
  "$PY" -m flashpack.cli inspect "$PACK" --check 2>/dev/null | tail -3
  echo "check $(seconds "$converted" "$(now)") s"
fi
if [ "$KEEP_SNAPSHOT" = 0 ]; then rm -rf "$SRC"; echo "snapshot removed"; fi
echo "build $(seconds "$start" "$(now)") s; $(gb "$(( $(df --output=avail -B1 "$OUT_DIR" | tail -1) ))") free"
