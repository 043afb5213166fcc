#!/usr/bin/env bash
# The H200 lease of docs/benchmarks.md ("The cached decode step"), two device calls back to back:
#   1: llama.cpp's CUDA build started in the background; the gpu tests of the cache's device path; resident
#      and cached (stream) at batch 1 and 8 side by side, while the build runs (its cores are not theirs);
#   2: after the build: llama.cpp's rows on the same file, then the CPU-miss modes (every core free).
# Usage: .ci/gpu-final.sh 1 | 2
set -uo pipefail
cd "$(dirname "$0")/.."
export LOGS=${OUT:-/tmp/moecache-gpu}
PROFILE=/tmp/uniform-profile.json  # every expert once: a 100% cache starts full
[ -f $PROFILE ] || python3 -c "from engine.expert_cache.profile import Profile; \
Profile({l: {e: 1 for e in range(128)} for l in range(48)}).save('$PROFILE')"
if [ "$1" = 1 ]; then
  bash .device/h200-llamacpp.sh build
  BUDGET_S=60 TESTS="tests/ops/test_cache_step.py tests/engine/test_gpu_engine.py" TESTS_S=55 \
    TESTS_K="test_kernels_equal or graph_steps or no_host_sync" bash .ci/gpu-check tests
  BUDGET_S=175 HEADLINE_S=170 HEADLINE_FRACS=0.25,0.5,1 HEADLINE_EXTRA="--cache-profile $PROFILE" \
    bash .ci/gpu-check headline
else
  grep -q "BUILD_DONE" /tmp/llamacpp/build.log 2>/dev/null || echo "llama.cpp still building"
  BUDGET_S=150 LLAMA_S=145 LLAMA_ROWS="resident cpu half" bash .ci/gpu-check llamabench
  echo "== llama-batched-bench -npl 8 -ngl 99 -ncmoe 24" | tee -a "$LOGS/llamacpp.log"
  timeout 60 /tmp/llamacpp/llama.cpp/build/bin/llama-batched-bench -m /tmp/qwen3moe-30b-a3b.gguf -fa on \
    -t "$(nproc)" -c 8192 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 8 -ngl 99 -ncmoe 24 2>&1 | grep -E "^\||error" \
    | tee -a "$LOGS/llamacpp.log"
  BUDGET_S=90 CACHED_S=85 CACHED_NAME=cpumodes CACHED_FRACS=0,0.5 CACHED_POLICIES=lru CACHED_MODES=cpu,hybrid \
    CACHED_EXTRA="--warmup-gen-len 64 --gen-len 32 --repeats 1" bash .ci/gpu-check cached
fi
