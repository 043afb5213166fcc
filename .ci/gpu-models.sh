#!/usr/bin/env bash
# The rows of the models people run offloaded (Gemma 4, DeepSeek-V2-Lite, gpt-oss-20b shapes) on the H200, after
# `.ci/gpu-final.sh 1` built llama.cpp in the same lease. For each preset: the model written on the device, llama.cpp's
# `-ngl 99` and `--n-cpu-moe` (half the MoE layers on the CPU) rows, then moecache's every-expert-resident row and
# its `--cpu-moe` rows with no cache and a 50% cache, two bench runs (batch 1, 128 decode tokens after a 400-token
# warm-up, as llama-bench's tg128). Every log and JSON in $LOGS (packed into $OUT/gpu-logs.tgz where $OUT is set).
# With PROFILE=1, each preset's resident decode step is profiled after its rows (.ci/gpu-step-profile.py: the kernels
# by time, and the middle step's first 120 kernels in order: a layer's ops one by one).
# PLACEMENTS (default "resident host"), LLAMA_ROWS (default "resident half") and HOST_FRACS (the host rows' cache
# budgets, default 0,0.5) pick the rows where a lease is short.
# Usage: bash .ci/gpu-models.sh [PRESET ...]   (default: gemma4-26b-a4b deepseek-v2-lite gpt-oss-20b)
set -uo pipefail
cd "$(dirname "$0")/.."
export LOGS=${LOGS:-/tmp/moecache-gpu}
mkdir -p "$LOGS"
[ -n "${OUT:-}" ] && trap 'tar czf "$OUT/gpu-logs.tgz" -C "$LOGS" .' EXIT
export PYTHONPATH=/tmp/site:$PWD
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
LLAMA=/tmp/llamacpp/llama.cpp/build/bin/llama-bench
# --n-cpu-moe counts layers from the first: half of each model's MoE layers (DeepSeek-V2-Lite's layer 0 is dense)
declare -A HALF=([gemma4-26b-a4b]=15 [deepseek-v2-lite]=14 [gpt-oss-20b]=12)
presets=("$@")
[ $# -gt 0 ] || presets=(gemma4-26b-a4b deepseek-v2-lite gpt-oss-20b)
for p in "${presets[@]}"; do
  model=/tmp/$p.gguf
  [ -f "$model" ] || timeout 240 python3 -m service.cli synth "$model" --preset "$p" --device "${SYNTH_DEVICE:-cuda}" \
    > "$LOGS/synth-$p.log" 2>&1
  if [ -x $LLAMA ]; then
    for row in ${LLAMA_ROWS:-resident half}; do
      args="-ngl 99"
      [ "$row" = half ] && args="-ngl 99 -ncmoe ${HALF[$p]:-0}"
      echo "== llama-bench $args ($p)" | tee -a "$LOGS/llamacpp-$p.log"
      # shellcheck disable=SC2086
      timeout 120 $LLAMA -m "$model" -fa 1 -t "$(nproc)" -r 2 -p 512 -n 128 $args 2>&1 | grep -E "^\||error|failed" \
        | tee -a "$LOGS/llamacpp-$p.log"
    done
  else
    echo "no llama.cpp build at $LLAMA: its rows are missing" | tee -a "$LOGS/llamacpp-$p.log"
  fi
  for placement in ${PLACEMENTS:-resident host}; do  # every expert resident; every routed expert in host RAM, no cache and 50%
    args="--n-cpu-moe 0"
    [ $placement = host ] && args="--cpu-moe --budget-frac ${HOST_FRACS:-0,0.5}"
    # shellcheck disable=SC2086
    timeout 200 python3 -m service.cli bench -m "$model" --routing synthetic:qwen3 --json "$LOGS/models-$p-$placement.json" \
      --prompt-len 512 --gen-len 128 --warmup-gen-len 400 --repeats 1 --max-num-seqs 1 --batches 1 \
      $args --policy decay --miss-mode stream 2>&1 | tee -a "$LOGS/models-$p.log" | grep -E "^\| +([0-9]|auto)|error|Error"
  done
  if [ "${PROFILE:-0}" = 1 ]; then
    timeout 150 python3 .ci/gpu-step-profile.py "$model" --config resident=resident --steps 8 --warmup 40 --top 30 \
      --sequence 120 > "$LOGS/profile-$p.log" 2>&1
    grep -E "^(==|   (device|gap))" "$LOGS/profile-$p.log"
  fi
done
