#!/usr/bin/env bash
# One device call: train flashpack's demo model on the H200 into $OUT, with the settings the committed
# model was trained with (demo_model/TRAINING.md): TRAIN_FLAGS, default `--steps 1104 --indexer-weight 0`
# (the schedule its time budget fixed; eager attention and the indexer loss were not run on the GPU).
# Run with carry ["wheels"]: transformers 5.23 (the model code, and its sources are the corpus) and
# jsonschema's wheels (/work/.library/device/README.md). DeltaNet runs on transformers' chunked PyTorch
# form: fla-core 0.6.0 refuses its gated-delta backward on Hopper under Triton < 3.7.1 (the H200 image
# has 3.6), so FLA=1 (install wheels/fla_core*.whl too) is for a machine with a newer Triton; there a
# failed first attempt is retried without fla in the time left.
# Writes $OUT/training-record.json, $OUT/train.log and the snapshot as $OUT/snapshot.tar.part-* (a call
# returns files of at most 16 MiB: `cat snapshot.tar.part-* | tar x` rebuilds it). Measured (run of
# 2026-12-01): 36 M tokens in 1,104 steps, 318 s of training, 328 s for the trainer in all.
set -o pipefail
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls wheels/*.whl | grep -v fla_core) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla wheels/fla_core*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
[ "${FLA:-0}" = 1 ] && export PYTHONPATH=$PYTHONPATH:/tmp/fla
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
FLAGS=${TRAIN_FLAGS:---steps 1104 --indexer-weight 0}
timeout 575 python3 -m flashpack.convert.train /tmp/runs/demo $FLAGS 2>&1 | tee $OUT/train.log
rc=$?
left=$(( 585 - $(date +%s) + start ))
if (( rc != 0 && left > 200 )) && [ "${FLA:-0}" = 1 ]; then
  echo "the attempt with fla failed (rc=$rc); retrying without it, $((left - 130)) s of training"
  PYTHONPATH=/tmp/pkg:/tmp/site timeout $((left - 10)) python3 -m flashpack.convert.train /tmp/runs/demo --force \
    --time-budget $((left - 130)) --indexer-weight 0 2>&1 | tee $OUT/train-retry.log
fi
cp /tmp/runs/demo/training-record.json $OUT/ 2>/dev/null
(cd /tmp/runs/demo && tar cf - snapshot | split -b 15M - $OUT/snapshot.tar.part-)
python3 - /tmp/runs/demo/training-record.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
f, m = r["final"], r["machine"]
print(f"{'steps':>7}{'tok/s':>10}{'train s':>9}{'total s':>9}{'held-out':>10}{'unigram':>9}{'mtp agree':>10}{'peak GB':>9}")
print(f"{r['steps']:>7}{r['tokens_per_s']:>10.0f}{r['train_wall_s']:>9.1f}{r['total_wall_s']:>9.1f}{f['loss']:>10.4f}"
      f"{f['unigram_loss']:>9.4f}{f['mtp_agreement_with_greedy']:>10.3f}{(m.get('peak_device_memory_bytes') or 0) / 1e9:>9.1f}")
PY
