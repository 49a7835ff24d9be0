#!/usr/bin/env bash
# The whole GPU suite (tests/gpu) in one call. On a machine of two or more GPUs the
# single-GPU tests are split over two pytest processes, one GPU each (tests/gpu/conftest.py),
# then the tensor-parallel tests run over two GPUs; on one GPU everything runs in turn.
# Exit status: non-zero when any part failed. Logs: $OUT/gpu-suite-*.log (or ./bench-out).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Multi-GPU hosts here keep NVLink multicast off (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
PYTEST=(python3 -m pytest -q -rs -p no:cacheprovider --durations=8 -s)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
status=0
summary() { grep -E "passed|failed|error" "$1" | tail -1; }
if (( gpus >= 2 )); then
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i PAGODA_GPU_SHARD=$i/2 "${PYTEST[@]}" tests/gpu -k "not tp2" \
        > "$OUT/gpu-suite-shard$i.log" 2>&1 &
  done
  for job in $(jobs -p); do wait "$job" || status=1; done
  "${PYTEST[@]}" tests/gpu -k tp2 > "$OUT/gpu-suite-tp2.log" 2>&1 || status=1
  for log in "$OUT"/gpu-suite-shard0.log "$OUT"/gpu-suite-shard1.log "$OUT"/gpu-suite-tp2.log; do
    echo "$(basename "$log"): $(summary "$log")"
  done
else
  "${PYTEST[@]}" tests/gpu > "$OUT/gpu-suite.log" 2>&1 || status=1
  echo "gpu-suite.log: $(summary "$OUT/gpu-suite.log")"
fi
exit $status
