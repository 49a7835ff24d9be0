#!/usr/bin/env bash
# The whole GPU suite (tests/gpu) in one call. Its time is mostly engine start-ups (kernel
# compiles, CUDA-graph capture) and host work, not GPU time, so on a machine of two or more
# GPUs it runs as concurrent pytest processes: the single-GPU tests in six shards, three per
# GPU (tests/gpu/conftest.py), and the tensor-parallel tests in two shards over both GPUs.
# The tests size their KV caches in blocks, so engines sharing a GPU do not count each
# other's caches against gpu_memory_utilization. On one GPU, four shards share it.
# On one GPU the whole suite takes longer than one 10-minute device call: `run_suite.sh
# shared` runs the sharded part, `run_suite.sh alone` the tests that want the GPU to
# themselves (gpu_alone), in two calls; no argument runs both.
# Exit status: non-zero when any part failed. Logs: $OUT/gpu-suite-*.log (or ./bench-out).
set -u
PART=${1:-all}
case $PART in all|shared|alone) ;; *) echo "usage: $0 [all|shared|alone]" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
# Multi-GPU hosts here keep NVLink multicast off (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
PYTEST=(python3 -m pytest -q -rs -p no:cacheprovider --durations=5 -s)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
status=0
if [[ $PART == alone ]]; then
  :
elif (( gpus >= 2 )); then
  for i in 0 1 2 3 4 5; do
    CUDA_VISIBLE_DEVICES=$((i % 2)) PAGODA_GPU_SHARD=$i/6 "${PYTEST[@]}" tests/gpu -k "not tp2" -m "not gpu_alone" \
        > "$OUT/gpu-suite-shard$i.log" 2>&1 &
  done
  for i in 0 1; do
    PAGODA_GPU_SHARD=$i/2 "${PYTEST[@]}" tests/gpu -k tp2 > "$OUT/gpu-suite-tp2-shard$i.log" 2>&1 &
  done
  for job in $(jobs -p); do wait "$job" || status=1; done
else
  # One GPU: four shards at once all the same (the engines are sized in blocks).
  for i in 0 1 2 3; do
    PAGODA_GPU_SHARD=$i/4 "${PYTEST[@]}" tests/gpu -m "not gpu_alone" > "$OUT/gpu-suite-shard$i.log" 2>&1 &
  done
  for job in $(jobs -p); do wait "$job" || status=1; done
fi
if [[ $PART != shared ]]; then
  "${PYTEST[@]}" tests/gpu -m gpu_alone > "$OUT/gpu-suite-alone.log" 2>&1 || status=1
fi
for log in "$OUT"/gpu-suite*.log; do
  echo "$(basename "$log"): $(grep -E "passed|failed|error" "$log" | tail -1)"
done
exit $status
