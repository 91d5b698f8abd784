#!/usr/bin/env bash
# GPU check for the expert store: tests (cpu + cuda), then bench/store.py on the small preset.
# Run on the device machine with `carry: ["wheels"]` (transformers 5.23 + jsonschema wheels, see
# /work/.library/device/README.md); results land in $OUT. About 6-8 minutes on an H200 box.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/flashpack
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
df -T /tmp . | tee -a $OUT/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())" | tee -a $OUT/gpu.txt
timeout 240 python3 -m pytest tests/store -q -p no:cacheprovider -x 2>&1 | tail -40 | tee $OUT/tests.log
python3 - <<'PY' 2>&1 | tail -3
from flashpack.convert.synth import synthesize
from flashpack.convert.pipeline import convert
p = synthesize("small", "/tmp/b/small", format="bf16", seed=0, router_skew=1.0, force=True)
print(convert(str(p), "/tmp/b/small.pack", progress=False, force=True))
PY
timeout 300 python3 bench/store.py /tmp/b/small.pack --device cuda --max-tokens 32 --io-file-mb ${IO_MB:-4096} --json $OUT/store-small-skew1-h200.json 2>&1 | tee $OUT/bench.md
