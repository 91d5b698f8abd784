#!/usr/bin/env bash
# One device call: train flashpack's demo model on the H200 into $OUT (MODE=full, the default), or
# time its steps first (MODE=smoke: 60 steps at the default batch, then 30 at twice the batch and 30
# without the indexer loss, each a whole run with its own record).
# Run with carry ["wheels"]: transformers 5.23 (the model code, and its sources are the corpus),
# fla-core (flash-linear-attention's DeltaNet kernels, which transformers picks up by itself) and
# jsonschema's wheels (/work/.library/device/README.md). A first attempt that fails with more than
# 200 s left is retried without fla and without the indexer loss (plain PyTorch DeltaNet, SDPA).
# Full mode writes $OUT/training-record.json, $OUT/train.log and the snapshot as $OUT/snapshot.tar.part-*
# (one device call returns files of at most 16 MiB: `cat snapshot.tar.part-* | tar x` rebuilds it).
# BUDGET is the training loop's wall time in seconds (default 450: corpus, tokenizer, final evaluation
# and the snapshot fit in the rest of a 600 s call); EXTRA passes more trainer flags.
set -o pipefail
start=$(date +%s)
# fla goes to a folder of its own, so a retry can run without it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls wheels/*.whl | grep -v fla_core) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla wheels/fla_core*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site:/tmp/fla PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import fla, torch, transformers; print('fla', fla.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/gpu.txt
summary() {  # one line per record: steps, tokens/s, held-out loss vs unigram, MTP agreement
  python3 - "$@" <<'PY'
import json, sys
print(f"{'run':<10}{'steps':>7}{'tok/s':>10}{'train s':>9}{'total s':>9}{'held-out':>10}{'unigram':>9}{'mtp agree':>10}{'peak GB':>9}")
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except OSError:
        print(f"{path}: no record"); continue
    f, m = r["final"], r["machine"]
    print(f"{path.split('/')[-2]:<10}{r['steps']:>7}{r['tokens_per_s']:>10.0f}{r['train_wall_s']:>9.1f}{r['total_wall_s']:>9.1f}"
          f"{f['loss']:>10.4f}{f['unigram_loss']:>9.4f}{f['mtp_agreement_with_greedy']:>10.3f}{(m.get('peak_device_memory_bytes') or 0)/1e9:>9.1f}")
PY
}
if [ "${MODE:-full}" = smoke ]; then
  timeout 110 python3 -m flashpack.convert.train /tmp/runs/b32 --steps 60 --log-every 10 --eval-every 100000 2>&1 | grep -v '^$' | tee $OUT/b32.log
  timeout 60 python3 -m flashpack.convert.train /tmp/runs/b64 --steps 30 --batch-size 64 --log-every 10 --eval-every 100000 --tokenizer /tmp/runs/b32/snapshot 2>&1 | tee $OUT/b64.log
  timeout 60 python3 -m flashpack.convert.train /tmp/runs/sdpa --steps 30 --indexer-weight 0 --log-every 10 --eval-every 100000 --tokenizer /tmp/runs/b32/snapshot 2>&1 | tee $OUT/sdpa.log
  for run in b32 b64 sdpa; do cp /tmp/runs/$run/training-record.json $OUT/$run-record.json 2>/dev/null; done
  summary /tmp/runs/b32/training-record.json /tmp/runs/b64/training-record.json /tmp/runs/sdpa/training-record.json
else
  timeout 575 python3 -m flashpack.convert.train /tmp/runs/demo --time-budget ${BUDGET:-450} $EXTRA 2>&1 | tee $OUT/train.log
  rc=$?
  left=$(( 585 - $(date +%s) + start ))
  if (( rc != 0 && left > 200 )); then  # a crash early on: retry on the plain PyTorch paths, in the time left
    echo "first attempt failed (rc=$rc); retrying without fla and without the indexer loss, $((left - 130)) s of training"
    PYTHONPATH=/tmp/pkg:/tmp/site timeout $((left - 10)) python3 -m flashpack.convert.train /tmp/runs/demo --force \
      --time-budget $((left - 130)) --indexer-weight 0 $EXTRA 2>&1 | tee $OUT/train-retry.log
  fi
  cp /tmp/runs/demo/training-record.json $OUT/ 2>/dev/null
  (cd /tmp/runs/demo && tar cf - snapshot | split -b 15M - $OUT/snapshot.tar.part-)
  summary /tmp/runs/demo/training-record.json
fi
