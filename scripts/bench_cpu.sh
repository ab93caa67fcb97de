#!/usr/bin/env bash
# The CPU benchmark behind docs/benchmarks.md: SmolLM2-135M-Instruct (the CPU default recipe),
# offline (engine level, against transformers) and served (Triton, concurrency 1..8, with the
# num_draft_tokens=0 baseline on the same server).
#
#   scripts/bench_cpu.sh            # the full run (roughly 30-45 minutes on 2 cores)
#   SMOKE=1 scripts/bench_cpu.sh    # a tiny run that only proves the pipeline works
#
# Run it on an otherwise idle machine: the server, the client and the models share the CPU, and any
# other load skews the numbers. Results land in $OUT (default build/bench/cpu): offline/ and served/
# each hold a .json, a .md table and .png plots; env.txt records the machine and the versions.
set -euo pipefail

cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
RECIPE=${RECIPE:-recipes/smollm2-135m-cpu.yaml}
NAME=${NAME:-smollm2-135m-cpu}
BUILD=${BUILD:-build/$NAME}
OUT=${OUT:-build/bench/cpu}
HTTP_PORT=${HTTP_PORT:-18000}
GRPC_PORT=${GRPC_PORT:-18001}
METRICS_PORT=${METRICS_PORT:-18002}
# torch threads for bench-offline; leave unset on an idle machine (torch uses every core). On a
# shared CPU, THREADS=1 avoids thread contention that slows every contender by 10x or more.
THREADS=${THREADS:-}

if [[ "${SMOKE:-0}" == 1 ]]; then
  OFFLINE_ARGS=(--num-prompts 2 --max-new-tokens 8 --repeats 1 --profile)
  SERVED_ARGS=(--concurrency 1,2 --requests 2 --max-tokens 8 --warmup 1)
else
  OFFLINE_ARGS=(--num-prompts 10 --max-new-tokens 128 --repeats 3 --profile)
  SERVED_ARGS=(--concurrency 1,2,4,8 --requests 16 --max-tokens 128 --warmup 2)
fi

mkdir -p "$OUT"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  uname -srm
  nproc
  grep -m1 "model name" /proc/cpuinfo || true
  "$BIN/python" -c 'import sys; from importlib.metadata import version as v; print("python", sys.version.split()[0]); [print(p, v(p)) for p in ("torch", "transformers", "tritonclient", "nvidia-pytriton")]' 2>/dev/null || true
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt"

# 1. Build the CPU default (skips stages that are up to date).
"$BIN/dflash-trt" build "$RECIPE" --quiet

# 2. Offline: the unquantized resolved target, so transformers runs the very same weights and every
#    greedy output must match token for token (the command fails loudly if one does not).
"$BIN/dflash-trt" bench-offline \
  --target "$BUILD/resolved/target" --drafter "$BUILD/resolved/drafter" \
  --prompts builtin:humaneval --chat --device cpu --dtype float32 --prompt-lookup \
  ${THREADS:+--threads "$THREADS"} "${OFFLINE_ARGS[@]}" --output "$OUT/offline"

# 3. Served: the emitted Triton repository on a real tritonserver; DFlash and the baseline
#    (num_draft_tokens=0) alternate per concurrency level on the same server.
"$BIN/dflash-trt" serve "$BUILD/triton_repo" \
  --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
  > "$OUT/serve.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT

for _ in $(seq 1 240); do
  if "$BIN/python" - "$HTTP_PORT" <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready", timeout=2)
PY
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "dflash-trt serve exited; see $OUT/serve.log" >&2
    exit 1
  fi
  sleep 1
done

"$BIN/dflash-trt" bench --url "127.0.0.1:$GRPC_PORT" --protocol grpc \
  --prompts builtin:humaneval --baseline "${SERVED_ARGS[@]}" --output "$OUT/served"

echo "results: $OUT/offline/offline.md $OUT/served/bench.md"
