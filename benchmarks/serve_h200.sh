#!/usr/bin/env bash
# The serving benchmark on the GPU machine: our server on the Qwen2.5-1.5B shape (random
# weights), 512 requests of 512 in / 128 out at 32 req/s, then all 512 at once. The server
# runs the engine in a child process (inference/engine_core.py); it must exit with it.
# Needs fastapi/uvicorn/pydantic wheels in .whl when the machine lacks them.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
PORT=8011
# One CSV row per engine step (written when the server stops), for benchmarks.serve_trace.
export PAGODA_STEP_TRACE="$OUT/serve_steps.csv"
python3 -m inference.cli serve qwen2.5-1.5b --load-format dummy --host 127.0.0.1 --port $PORT \
  --disable-uvicorn-access-log --max-model-len 1024 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 1
done
curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null || { tail -30 "$OUT/server.log"; kill $SERVER; exit 1; }
grep -E "start-up by phase|KV cache" "$OUT/server.log" | tail -2
# The load comes from NUM_CLIENTS processes (one Python client tops out near 20k tok/s);
# BURSTS > 1 repeats the burst of 512 at once, to show how stable that row is.
runs="32 inf"; for i in $(seq 2 "${BURSTS:-1}"); do runs+=" inf_$i"; done
for run in $runs; do
  python3 -m inference.cli bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 512 \
    --input-len 512 --output-len 128 --token-ids --request-rate "${run%%_*}" \
    --num-clients "${NUM_CLIENTS:-4}" \
    --save-detailed --output-json "$OUT/serve_qwen2.5-1.5b_rate${run}.json" 2>&1 | tail -14
done
kill -TERM $SERVER; wait $SERVER; echo "server exit code $?"
python3 -m benchmarks.serve_trace "$OUT/serve_qwen2.5-1.5b_rate32.json" "$PAGODA_STEP_TRACE"
sleep 1
if pgrep -f "multiprocessing.spawn import spawn_main" >/dev/null 2>&1; then
  echo "WARNING: an engine process outlived the server"; pgrep -af "spawn_main"
fi
