#!/usr/bin/env bash
# GPU half of issue 7, prepared for a session with a CUDA GPU (not run yet: no GPU was available when written).
#
#   bash bench/gpu_run.sh                 # all sizes (6 fresh processes per size, each loads + quantises)
#   bash bench/gpu_run.sh 0.5b,1.5b       # estimated ~5 min on an H200: fits one 10-minute call
#   bash bench/gpu_run.sh 7b              # estimated ~7 min (builds a 15 GB random-init model in $DELFT_BENCH_MODELS)
# (estimates, not measured: the code path was only dry-run on a CPU with DELFT_BENCH_DEVICE=cpu --sizes tiny)
#
# Installs bitsandbytes / liger-kernel / trl from a folder of .whl files when one is present ($WHEELS, ./wheels,
# ./shared/wheels, /work/shared/wheels), since the GPU machine may have no network. Results accumulate in
# bench/results/train_bench_gpu.json (each configuration is written as soon as it finishes).
set -uo pipefail
cd "$(dirname "$0")/.."
SIZES="${1:-0.5b,1.5b,7b}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export DELFT_BENCH_MODELS="${DELFT_BENCH_MODELS:-/tmp}"

for dir in "${WHEELS:-}" wheels shared/wheels /work/shared/wheels; do
  if [ -n "$dir" ] && ls "$dir"/*.whl >/dev/null 2>&1; then
    echo "installing from $dir"
    for pkg in bitsandbytes liger-kernel trl; do
      python -m pip install -q --no-index --find-links "$dir" "$pkg" 2>&1 | tail -1 || echo "  ($pkg: not in $dir)"
    done
    break
  fi
done

python - <<'PY' || exit 1
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

python bench/train_bench.py --gpu --sizes "$SIZES" --steps 6 --warmup 2 --timeout 300
