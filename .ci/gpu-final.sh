#!/usr/bin/env bash
# The H200 lease of docs/benchmarks.md ("The cached decode step and CPU-computed misses"), device calls back
# to back on one machine:
#   1: llama.cpp's CUDA build started in the background; the attention and cache-step kernel tests (the lease
#      stops if they fail), the gpu tests of the cache's device path; resident and cached (stream) at batch 1
#      after a 400-token warm-up, while the build runs;
#   2: after the build: llama.cpp's rows on the same file, then the three miss modes at 0 and 25% and hybrid
#      at 50% (stream's is part 1's) with every core free;
#   3: (device time left) batch 8 at 50%; the miss modes on a 16 GB/s link (`--link-gbps`); small budgets against no cache;
#      the step profile of hybrid and stream at 25%.
# Usage: .ci/gpu-final.sh 1 | 2 | 3
set -uo pipefail
cd "$(dirname "$0")/.."
export LOGS=${OUT:-/tmp/moecache-gpu}
PROFILE=/tmp/uniform-profile.json  # every expert once: a 100% cache starts full
[ -f $PROFILE ] || python3 -c "from engine.expert_cache.profile import Profile; \
Profile({l: {e: 1 for e in range(128)} for l in range(48)}).save('$PROFILE')"
case "$1" in
1)
  bash .device/h200-llamacpp.sh build
  # the attention and cache-step kernels every step runs compile and pass first, or the lease stops here
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
    tests/ops/test_triton_attention.py tests/ops/test_cache_step.py \
    -k "(test_matches_reference and bf16) or graph_replay or test_write_kv_matches or test_kernels_equal" 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "kernel tests failed: stopping"; exit 1; }
  BUDGET_S=100 TESTS="tests/ops/test_triton_stage.py tests/engine/test_gpu_engine.py" TESTS_S=95 \
    bash .ci/gpu-check tests
  BUDGET_S=150 HEADLINE_S=145 HEADLINE_FRACS=0.25,0.5,1 HEADLINE_BATCHES=1 \
    HEADLINE_EXTRA="--cache-profile $PROFILE --warmup-gen-len 400" bash .ci/gpu-check headline
  ;;
2)
  grep -q "BUILD_DONE" /tmp/llamacpp/build.log 2>/dev/null || echo "llama.cpp still building"
  BUDGET_S=150 LLAMA_S=145 LLAMA_ROWS="resident cpu half" bash .ci/gpu-check llamabench
  echo "== llama-batched-bench -npl 8 -ngl 99 -ncmoe 24" | tee -a "$LOGS/llamacpp.log"
  timeout 60 /tmp/llamacpp/llama.cpp/build/bin/llama-batched-bench -m /tmp/qwen3moe-30b-a3b.gguf -fa on \
    -t "$(nproc)" -c 8192 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 8 -ngl 99 -ncmoe 24 2>&1 | grep -E "^\||error" \
    | tee -a "$LOGS/llamacpp.log"
  BUDGET_S=140 CACHED_S=135 CACHED_NAME=cpumodes CACHED_FRACS=0,0.25 CACHED_POLICIES=lru CACHED_MODES=cpu,stream,hybrid \
    CACHED_EXTRA="--warmup-gen-len 200 --gen-len 32 --repeats 1 --cache-profile $PROFILE" bash .ci/gpu-check cached
  BUDGET_S=35 CACHED_S=30 CACHED_NAME=hybrid50 CACHED_FRACS=0.5 CACHED_POLICIES=lru CACHED_MODES=hybrid \
    CACHED_EXTRA="--warmup-gen-len 400 --gen-len 32 --repeats 1 --cache-profile $PROFILE" bash .ci/gpu-check cached
  ;;
3)
  BUDGET_S=60 BATCH8_S=55 bash .ci/gpu-check batch8
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_triton_attention.py \
    -k "quantized or prefill or write_kv_quantizes" 2>&1 | tail -5
  BUDGET_S=80 CACHED_S=75 CACHED_NAME=link16 CACHED_FRACS=0,0.5 CACHED_POLICIES=lru CACHED_MODES=cpu,stream,hybrid \
    CACHED_EXTRA="--warmup-gen-len 100 --gen-len 24 --repeats 1 --link-gbps 16" bash .ci/gpu-check cached
  BUDGET_S=200 SMALL_S=195 bash .ci/gpu-check small
  PYTHONPATH=/tmp/site:$PWD timeout 90 python3 .ci/gpu-step-profile.py /tmp/qwen3moe-30b-a3b.gguf --steps 16 \
    --warmup 200 --config "hybrid 25%=cpumoe,budget=0.25,policy=lru,miss=hybrid" \
    --config "stream 25%=cpumoe,budget=0.25,policy=lru,miss=stream" 2>&1 | tee "$LOGS/profile.log" | tail -40
  ;;
esac
