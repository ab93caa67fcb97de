#!/usr/bin/env bash
# Load-test a served model with NVIDIA AIPerf through Triton's HTTP generate_stream endpoint
# (AIPerf's `template` endpoint type), at several concurrency levels, as docs/benchmarks.md records.
#
#   scripts/aiperf_cpu.sh                       # serves the CPU default build, runs 1 and 4
#   CONCURRENCY="1 2 4 8" scripts/aiperf_cpu.sh
#   URL=127.0.0.1:8000 scripts/aiperf_cpu.sh    # an already running server (nothing started)
#   REPEATS=5 scripts/aiperf_cpu.sh             # the levels interleaved 5 times, then medians
#
# AIPerf is a benchmark tool, not a dependency: it gets its own virtual environment ($AIPERF_VENV,
# created on first use, with AIPerf $AIPERF_VERSION: default 0.13.*, what docs/benchmarks.md's runs
# used). Synthetic prompts of INPUT_TOKENS tokens (AIPerf's own corpus), OUTPUT_TOKENS
# requested per answer, greedy, streaming. Results land in $OUT/c<N>/ (AIPerf's export files), or
# with REPEATS > 1 in $OUT/r<i>/c<N>/: every level once per repeat, in turn, so a machine whose speed
# drifts hits all of them alike. scripts/aiperf_summary.py $OUT prints the table with medians.
# Every run draws its own prompts (AIPerf's --random-seed SEED, SEED+1, ... in run order): the
# engine's prefix cache keeps earlier prompts, and a level that re-sent the previous level's
# prompts would skip their prefill (its TTFT and throughput flattered; docs/benchmarks.md,
# session 17).
# AIPerf's scraping of server metrics and GPU telemetry is off: there is no GPU here, and on a small
# CPU machine the client's own processes take cores from the server it measures.
# RATE (requests/s, default 100) paces AIPerf's issuing loop at a constant rate far above what the
# server serves, so concurrency alone still decides the load: in AIPerf 0.13's pure concurrency
# mode that loop polls for a free slot without sleeping and holds a whole core for the run, half
# of a 2-core machine (RATE=burst restores that mode). docs/benchmarks.md has both.
# NICE=N runs AIPerf at niceness N (19: the lowest priority), so that on a machine it shares with
# the server its own processes take the cores only when the engine leaves them (default 0).
set -euo pipefail

cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
BUILD=${BUILD:-build/smollm2-135m-cpu}
OUT=${OUT:-build/bench/aiperf}
AIPERF_VENV=${AIPERF_VENV:-build/aiperf-venv}
CONCURRENCY=${CONCURRENCY:-"1 4"}
REPEATS=${REPEATS:-1}
SEED=${SEED:-0}
REQUESTS=${REQUESTS:-16}
INPUT_TOKENS=${INPUT_TOKENS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-48}
MODEL=${MODEL:-dflash}
HTTP_PORT=${HTTP_PORT:-18000}
RATE=${RATE:-100}
NICE=${NICE:-0}
PACING=(--request-rate "$RATE" --request-rate-mode constant)
[[ "$RATE" == burst ]] && PACING=()

if [[ ! -x "$AIPERF_VENV/bin/aiperf" ]]; then
  python3 -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/pip" install --quiet "aiperf==${AIPERF_VERSION:-0.13.*}"
fi

mkdir -p "$OUT"
SERVER_PID=
if [[ -z "${URL:-}" ]]; then
  URL=127.0.0.1:$HTTP_PORT
  "$BIN/dflash-trt" serve "$BUILD/triton_repo" --http-port "$HTTP_PORT" --grpc-port 0 \
    --metrics-port 0 > "$OUT.serve.log" 2>&1 &
  SERVER_PID=$!
  trap '[[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null; wait 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do
    curl -sf "http://$URL/v2/health/ready" > /dev/null && break
    sleep 1
  done
fi
curl -sf "http://$URL/v2/health/ready" > /dev/null || { echo "no server ready at $URL" >&2; exit 1; }

# The body Triton's generate extension takes for this model (text_input, max_tokens, stream).
cat > "$OUT/payload.jinja" <<'EOF'
{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": true, "temperature": 0.0}
EOF

for r in $(seq 1 "$REPEATS"); do
  RUN=$OUT
  [[ "$REPEATS" -gt 1 ]] && RUN=$OUT/r$r
  for c in $CONCURRENCY; do
    nice -n "$NICE" "$AIPERF_VENV/bin/aiperf" profile \
      --model "$MODEL" --url "http://$URL" \
      --endpoint-type template --custom-endpoint "/v2/models/$MODEL/generate_stream" --streaming \
      --extra-inputs payload_template:"$OUT/payload.jinja" --extra-inputs response_field:text_output \
      --tokenizer "$BUILD/engine/target" \
      --synthetic-input-tokens-mean "$INPUT_TOKENS" --synthetic-input-tokens-stddev 0 \
      --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 \
      --concurrency "$c" "${PACING[@]}" --request-count "$REQUESTS" --warmup-request-count 1 \
      --random-seed "$SEED" --output-artifact-dir "$RUN/c$c" --ui-type none \
      --no-server-metrics --no-gpu-telemetry
    SEED=$((SEED + 1))
  done
done
python3 scripts/aiperf_summary.py "$OUT"
