#!/usr/bin/env bash
# The H200 lease of docs/benchmarks.md ("The cached decode step and CPU-computed misses"), device calls back
# to back on one machine:
#   1: llama.cpp's CUDA build started in the background; the attention and cache-step kernel tests (the lease
#      stops if they fail) and the gpu tests not yet run on the H200, while the model is written; the step
#      profile of the cached batch-1 step (25/50/100% and resident); resident and cached (stream) at batch 1
#      after a 400-token warm-up, while the build runs;
#   2: after the build: llama.cpp's rows on the same file; then, every core free, the three miss modes with
#      no cache, stream and hybrid at 25% (lru and decay), hybrid at 50%, and 8 sequences at 50%;
#   3: (device time left) small budgets against no cache, every policy; the miss modes on a 16 GB/s link
#      (`--link-gbps`); the quantized KV attention kernels.
# Usage: .ci/gpu-final.sh 1 | 2 | 3
set -uo pipefail
cd "$(dirname "$0")/.."
export LOGS=${OUT:-/tmp/moecache-gpu}
PROFILE=/tmp/uniform-profile.json  # every expert once: a 100% cache starts full
[ -f $PROFILE ] || python3 -c "from engine.expert_cache.profile import Profile; \
Profile({l: {e: 1 for e in range(128)} for l in range(48)}).save('$PROFILE')"
pytest_gpu() {  # NAME SECONDS FILES... [-k EXPR]: gpu-marked tests, the whole log in $LOGS/NAME.log
  local name=$1 seconds=$2; shift 2
  PYTHONPATH=/tmp/site:$PWD timeout "$seconds" python3 -m pytest -q -m gpu -p no:cacheprovider -rf "$@" 2>&1 \
    | tee "$LOGS/$name.log" | tail -8
  return "${PIPESTATUS[0]}"
}
case "$1" in
1)
  bash .device/h200-llamacpp.sh build
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  # the attention and cache-step kernels every step runs compile and pass first, or the lease stops here
  pytest_gpu kernels 120 -x tests/ops/test_triton_attention.py tests/ops/test_cache_step.py \
    -k "(test_matches_reference and bf16) or graph_replay or test_write_kv_matches or test_kernels_equal" \
    || { echo "kernel tests failed: stopping"; exit 1; }
  BUDGET_S=110 TESTS="tests/ops/test_triton_stage.py tests/engine/test_gpu_engine.py" TESTS_S=105 \
    TESTS_K="hold or quantized or gemma4 or captures or streamed_misses" bash .ci/gpu-check tests
  BUDGET_S=130 PROFILE_S=125 PROFILE_LINES=120 bash .ci/gpu-check profile
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
  BUDGET_S=60 CACHED_S=55 CACHED_NAME=modes0 CACHED_FRACS=0 CACHED_POLICIES=lru CACHED_MODES=cpu,stream,hybrid \
    CACHED_EXTRA="--warmup-gen-len 64 --gen-len 32 --repeats 1" bash .ci/gpu-check cached
  BUDGET_S=100 CACHED_S=95 CACHED_NAME=modes25 CACHED_FRACS=0.25 CACHED_POLICIES=lru,decay CACHED_MODES=stream,hybrid \
    CACHED_EXTRA="--repeats 1 --cache-profile $PROFILE" bash .ci/gpu-check cached
  BUDGET_S=40 CACHED_S=35 CACHED_NAME=hybrid50 CACHED_FRACS=0.5 CACHED_POLICIES=lru CACHED_MODES=hybrid \
    CACHED_EXTRA="--repeats 1 --cache-profile $PROFILE" bash .ci/gpu-check cached
  BUDGET_S=60 BATCH8_S=55 bash .ci/gpu-check batch8
  ;;
3)
  BUDGET_S=160 SMALL_S=155 bash .ci/gpu-check small
  BUDGET_S=80 CACHED_S=75 CACHED_NAME=link16 CACHED_FRACS=0,0.5 CACHED_POLICIES=lru CACHED_MODES=cpu,stream,hybrid \
    CACHED_EXTRA="--warmup-gen-len 100 --gen-len 24 --repeats 1 --link-gbps 16" bash .ci/gpu-check cached
  pytest_gpu kvquant 100 tests/ops/test_triton_attention.py -k "quantized or prefill or write_kv_quantizes"
  ;;
esac
