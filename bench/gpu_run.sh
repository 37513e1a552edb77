#!/usr/bin/env bash
# GPU half of issue 7, prepared for a session with a CUDA GPU (not run yet: no GPU was available when written).
#
#   bash bench/gpu_run.sh                 # all sizes (6 fresh processes per size, each loads + quantises)
#   bash bench/gpu_run.sh 0.5b,1.5b       # estimated ~5 min on an H200: fits one 10-minute call
#   bash bench/gpu_run.sh 7b              # estimated ~7 min (builds a 15 GB random-init model in $DELFT_BENCH_MODELS)
# (estimates, not measured: the code path was only dry-run on a CPU with DELFT_BENCH_DEVICE=cpu --sizes tiny)
#
# Installs bitsandbytes / liger-kernel / trl from a folder of .whl files when one is present ($WHEELS, ./.whl,
# ./wheels, ./shared/wheels, /work/shared/wheels), since the GPU machine has no network. To fill ./.whl (py3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 --platform any -d .whl bitsandbytes==0.50.2 liger-kernel==0.8.5 trl==1.16.0
# Results accumulate in bench/results/train_bench_gpu.json (each configuration is written as soon as it finishes)
# and are copied to $OUT when the device tool sets it.
set -uo pipefail
cd "$(dirname "$0")/.."
SIZES="${1:-0.5b,1.5b,7b}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export DELFT_BENCH_MODELS="${DELFT_BENCH_MODELS:-/tmp}"

for dir in "${WHEELS:-}" .whl wheels shared/wheels /work/shared/wheels; do
  if [ -n "$dir" ] && ls "$dir"/*.whl >/dev/null 2>&1; then
    echo "installing $(ls "$dir"/*.whl | xargs -n1 basename | tr '\n' ' ')from $dir into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$dir"/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
    break
  fi
done

python3 - <<'PY' || exit 1
import importlib, torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
for m in ("transformers", "peft", "bitsandbytes", "liger_kernel", "trl"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', 'installed')}")
    except Exception as e:
        print(f"  {m}: MISSING ({type(e).__name__}) - its configurations will fail and be reported")
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

python3 bench/train_bench.py --gpu --sizes "$SIZES" --steps 6 --warmup 2 --timeout 300
rc=$?
if [ -n "${OUT:-}" ]; then cp bench/results/train_bench_gpu.json "$OUT"/ 2>/dev/null || true; fi
exit $rc
