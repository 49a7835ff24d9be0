#!/usr/bin/env bash
# Everything the GPU issues measure, in one call: GPU parity tests, the throughput/latency
# table, the serving benchmark and (on a 2-GPU machine) tensor parallelism.
# Parts: all | parity | structured | bench | serve | tp | fp8 | int4 | spec | lora | long | sim.
# JSON results land in $OUT (or ./bench-out).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Multi-GPU hosts here keep NVLink multicast off (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
B="python3 -m inference.bench"  # pagoda bench latency|throughput|serve
C="python3 -m benchmarks"  # the GPU checks
PART=${1:-all}

if [[ $PART == all || $PART == parity ]]; then
  OUT=$OUT bash tests/gpu/run_suite.sh
  python3 -m pytest -q -p no:cacheprovider tests/test_sampler.py 2>&1 | tail -3
fi
if [[ $PART == all || $PART == structured ]]; then
  # llguidance travels as a wheel (.whl/, see the device notes); a real tokenizer beside it
  # in .whl/smollm2-tokenizer when there is one.
  if ! python3 -c "import llguidance" 2>/dev/null && ls .whl/llguidance-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-llg .whl/llguidance-*.whl && export PYTHONPATH=/tmp/site-llg${PYTHONPATH:+:$PYTHONPATH}
  fi
  tok=(); [[ -d .whl/smollm2-tokenizer ]] && tok=(--tokenizer .whl/smollm2-tokenizer)
  $C.structured_check --model qwen2.5-1.5b "${tok[@]}" --out "$OUT/structured_check_h200.json" \
      2>&1 | tail -12
fi
if [[ $PART == all || $PART == bench ]]; then
  $B.throughput --model qwen2.5-1.5b --num-prompts 1024 --input-len 512 --output-len 128 \
      --peer transformers --peer-num-prompts 64 --output-json "$OUT/throughput_qwen2.5-1.5b.json"
  $B.latency --model qwen2.5-1.5b --batch-size 1 8 32 128 256 --input-len 512 --output-len 128 \
      --num-iters 2 --output-json "$OUT/latency_qwen2.5-1.5b.json"
  $B.throughput --model qwen2.5-7b --num-prompts 1024 --input-len 512 --output-len 128 \
      --output-json "$OUT/throughput_qwen2.5-7b.json"
  $B.latency --model qwen2.5-7b --batch-size 1 --input-len 512 --output-len 128 \
      --num-iters 2 --output-json "$OUT/latency_qwen2.5-7b.json"
fi
if [[ $PART == all || $PART == serve ]]; then
  bash benchmarks/serve_h200.sh
fi
if [[ $PART == all || $PART == tp ]]; then
  if (( $(python3 -c "import torch; print(torch.cuda.device_count())") >= 2 )); then
    python3 -m benchmarks.tp_check --num-prompts 512 \
        --output-json "$OUT/tp_check_qwen2.5-7b.json" 2>&1 | grep -E "parity|noise|TP=|wrote"
  else
    echo "tp: skipped, this machine has fewer than 2 GPUs"
  fi
fi
if [[ $PART == all || $PART == fp8 ]]; then
  # FP8 weights against bf16: quality (SmolLM2 + a realistic random model) and speed
  # (Qwen2.5-1.5B/7B, batch 1 and 256 offline), one JSON.
  $C.fp8_check --output-json "$OUT/fp8_check_h200.json" 2>&1 | grep -E "^(quality|speed)"
fi
if [[ $PART == all || $PART == int4 ]]; then
  # The word GEMV's launches and the dequantize + cuBLAS path, then batch 1/8 and offline
  # against bf16 in the same call.
  $C.int4_check --budget-s 150 --out "$OUT/int4_check_h200.json" 2>&1 | grep -E "M=|wrote"
  for model in qwen2.5-1.5b qwen2.5-1.5b-awq qwen2.5-7b qwen2.5-7b-awq; do
    $B.latency --model $model --batch-size 1 8 --input-len 512 --output-len 128 --num-iters 2 \
        --output-json "$OUT/latency_$model.json"
  done
  for model in qwen2.5-7b qwen2.5-7b-awq; do
    $B.throughput --model $model --num-prompts 1024 --input-len 512 --output-len 128 \
        --output-json "$OUT/throughput_$model.json"
  done
fi
if [[ $PART == all || $PART == spec ]]; then
  # n-gram on the copy workload, the 1.5B made a copier (--copy-model) that copies all of
  # each document or misses a fifth of its tokens (the copy rate measured is reported), and
  # the off-switch at batch 256.
  NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
  for spec in "" "$NGRAM"; do
    tag=$([[ -n $spec ]] && echo _ngram || echo "")
    for miss in 0.0 0.2; do
      $B.latency --model qwen2.5-1.5b --batch-size 1 --workload copy --document-len 2048 \
          --copy-model --copy-miss-rate $miss --output-len 128 --num-iters 3 \
          ${spec:+--speculative-config "$spec"} --output-json "$OUT/latency_copy_miss$miss$tag.json"
    done
    $B.throughput --model qwen2.5-1.5b --num-prompts 1024 --input-len 512 --output-len 128 \
        --max-num-seqs 256 ${spec:+--speculative-config "$spec"} \
        --output-json "$OUT/throughput_256$tag.json"
  done
fi
if [[ $PART == all || $PART == spec ]]; then
  # A draft model at a stated acceptance: the 7B copies its documents, a Qwen2.5-0.5B-shaped
  # draft copies them missing 30 % of the tokens (acceptance about 70 %); plain 7B beside it.
  DRAFT='{"method": "draft_model", "model": "qwen2.5-0.5b", "num_speculative_tokens": 4}'
  for spec in "" "$DRAFT"; do
    tag=$([[ -n $spec ]] && echo _draft || echo "")
    $B.latency --model qwen2.5-7b --batch-size 1 --workload copy --document-len 2048 \
        --copy-model --draft-copy-miss-rate 0.3 --output-len 128 --num-iters 3 \
        ${spec:+--speculative-config "$spec"} --output-json "$OUT/latency_7b_copy$tag.json"
  done
fi
if [[ $PART == all || $PART == lora ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_gpu.py 2>&1 | tail -3
  $C.lora_bench --model qwen2.5-1.5b --steps 100 2>&1 | tail -8
fi
if [[ $PART == all || $PART == long ]]; then
  # Long context (issue #32's rows): the attention kernel alone (8k/32k decode and prefill
  # beside torch's flash SDPA, then the tiling sweep); TTFT of 8k and 32k prompts, decode at
  # those contexts, batch 1 and 16, KV blocks of 16 and 32 tokens; bf16 and FP8 KV.
  OUT=$OUT $C.kernel_check --long --quick --budget-s 290 2>&1 | grep -E "^checks|^time"
  cp "$OUT/kernel_check.json" "$OUT/kernel_check_long_h200.json" 2>/dev/null
  for kv in auto fp8; do
    for block in 16 32; do
      $B.latency --model qwen2.5-1.5b --batch-size 1 16 --input-len 8192 32704 --output-len 64 \
          --num-iters 2 --block-size $block --kv-cache-dtype $kv --max-model-len 32768 \
          --output-json "$OUT/latency_long_b${block}_$kv.json"
    done
  done
fi
if [[ $PART == all || $PART == sim ]]; then
  # The tuning simulator's calibration (1.5B and 7B), with the live recapture time; copy
  # the JSON to benchmarks/results/ and operator/pagoda_operator/tuning/sim/.
  $C.sim_calibration --output-json "$OUT/sim_calibration_h200.json" 2>&1 | tail -3
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    data = json.loads(f.read_text())
    for r in data if isinstance(data, list) else [data]:
        if "output_tok_s" in r:
            rows.append((r.get("engine", "pagoda"), r["model"], r["workload"],
                         r.get("batch_size", r["num_prompts"]), r.get("input_len", ""),
                         r["output_tok_s"],
                         r.get("ttft_ms", ""), r.get("tpot_ms", ""), r.get("kv_cache_tokens", ""),
                         r.get("startup_s", "")))
print(f"{'engine':13} {'model':13} {'workload':10} {'batch':>5} {'in':>6} {'out tok/s':>10} {'TTFT ms':>8} {'TPOT ms':>8} {'KV tokens':>10} {'start s':>7}")
for r in rows:
    print(f"{r[0]:13} {r[1]:13} {r[2]:10} {r[3]:>5} {r[4]!s:>6} {r[5]:>10} {r[6]!s:>8} {r[7]!s:>8} {r[8]!s:>10} {r[9]!s:>7}")
PY
