#!/usr/bin/env bash
# The H200 lease of docs/benchmarks.md ("The cached decode step and CPU-computed misses"), device calls back
# to back on one machine (the machine goes back 30 s after a call returns):
#   1: llama.cpp's CUDA build, the models written meanwhile (Qwen3-30B-A3B's shapes and $SYNTH), then every gpu test
#      of tests/ops and tests/engine (eight pytest workers; what failed, again alone);
#   2: llama.cpp's rows on the same file (resident, -ncmoe 24; after its build), then every core free: resident and
#      cached (lru, stream) at batch 1 after a 400-token warm-up (25/50/100%, 128 tokens a row), 8 sequences at 50%
#      and llama.cpp's 8 sequences, small budgets against no cache (every policy), stream and hybrid at 25% (decay);
#   3: the CPU-computed misses: llama.cpp's -ncmoe 48 row, stream and hybrid at 50%, the three miss modes with no
#      cache, host memory shared by link and CPU (.ci/gpu-host-share.py), the miss modes on a 16 GB/s link;
#   4: the prefill GEMMs under Nsight Compute (.ci/gpu-moe-gemm.py ncu), the decode expert kernels' sweep
#      (.ci/gpu-expert-sweep.py), the step profile (.ci/gpu-step-profile.py), the
#      prompt's (.ci/gpu-prefill-profile.py), the doorbell's round
#      trip and a streamed miss's cost (.ci/gpu-bell-probe.py, .ci/gpu-miss-probe.py), device against CPU logits over
#      quantized KV caches, captured and eager (.ci/gpu-qkv-probe.py), where the lease has time left.
#   5: throughput as served: batched decode beside llama-batched-bench, moecache bench-serve over HTTP and gRPC.
#   6: issue 19 (STAGE_S seconds, default 400): the disk's read rate, then experts on disk (--ssd-moe, a host-RAM
#      tier of 25% of the experts) against every expert in RAM, the same 25% cache, stream, batch 1; then decode at a
#      32k-token context (one sequence) with the KV cache in each of KV_TYPES (default bf16 q8_0 q4_0; experts
#      resident), as long as the stage's time lasts.
#   7: throughput as served with every routed expert in host RAM behind a cache of half their bytes (bench-serve).
#   8: issue 19's KV types: the decode attention's launches timed at 32k positions and 32k-token decodes with the
#      fastest of each type (.ci/gpu-kv-sweep.py, SWEEP_S seconds of sweep, default 150), then the KL divergence of
#      q8_0 and q4_0 KV against bf16 (`moecache perplexity`, 2 chunks of 8,192 tokens of the package's corpus).
#   9: what 2026-12-07's twelfth lease left untimed, after `1`: the prompt's staging as far ahead as buffers allow (its
#      GPU test, then the 50% prompt's link timeline, .ci/gpu-prefill-profile.py), then issue 17's rows of the three
#      presets in one lease (.ci/gpu-models.sh: llama.cpp's -ngl 99 and -ncmoe L/2, moecache resident, no cache, 50%).
# Every log and JSON of the lease so far comes back in $OUT/gpu-logs.tgz. Usage: .ci/gpu-final.sh 1 | 2 | ... | 9
set -uo pipefail
cd "$(dirname "$0")/.."
export LOGS=${LOGS:-/tmp/moecache-gpu}  # kept between the calls of one lease; packed into $OUT/gpu-logs.tgz at the end
mkdir -p "$LOGS"
[ -n "${OUT:-}" ] && trap 'tar czf "$OUT/gpu-logs.tgz" -C "$LOGS" .' EXIT
PROFILE=/tmp/uniform-profile.json  # every expert once: a 100% cache starts full
[ -f $PROFILE ] || python3 -c "from engine.expert_cache.profile import Profile; \
Profile({l: {e: 1 for e in range(128)} for l in range(48)}).save('$PROFILE')"
pytest_gpu() {  # NAME SECONDS FILES... [-k EXPR]: gpu-marked tests, the whole log in $LOGS/NAME.log
  local name=$1 seconds=$2; shift 2
  # NOTE: SIGINT at the limit: pytest stops and still prints which tests failed (a plain kill printed nothing, lease
  # of 2026-12-06 15:48)
  PYTHONPATH=/tmp/site:$PWD timeout -s INT -k 30 "$seconds" python3 -m pytest -q -m gpu -o cache_dir=/tmp/pytest-cache -rf "$@" 2>&1 \
    | tee "$LOGS/$name.log" | tail -8
  return "${PIPESTATUS[0]}"
}
case "$1" in
1)
  bash .device/h200-llamacpp.sh build
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  # NOTE: the build first, beside nothing that needs cores: beside eight pytest workers it reached 202 of 366 steps in
  # 470 s and never finished in that lease (2026-12-03, lease 15); meanwhile the models are written (the GPU draws
  # them: one core each) and the tests wait. SYNTH: the presets written besides Qwen3-30B-A3B's shapes (default none:
  # beside three models being written the build was still at 131 of 366 steps after 300 s, H100, 2026-12-06).
  for p in qwen3moe-30b-a3b ${SYNTH:-}; do
    [ -f /tmp/$p.gguf ] || PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m service.cli synth /tmp/$p.gguf \
      --preset $p --device cuda > "$LOGS/synth-$p.log" 2>&1 &
  done
  for _ in $(seq 1 60); do grep -q BUILD_DONE /tmp/llamacpp/build.log 2>/dev/null && break; sleep 5; done
  tail -1 /tmp/llamacpp/build.log
  wait
  # NOTE: pytest-xdist carried as a wheel, tests spread one by one: the suite is mostly Triton compiles on the CPU
  # NOTE: the at-once rates' test measures the host's memory: alone, after the others
  # SUITE, SUITE_S: the test paths (the engine's first: they are handed out first) and their limit
  pytest_gpu suite "${SUITE_S:-240}" -n 8 ${SUITE:-tests/engine tests/ops} -k "not neither_the_link_nor_the_cpu" \
    || pytest_gpu suite-again 60 --last-failed ${SUITE:-tests/engine tests/ops}  # what failed beside seven others, alone
  pytest_gpu at-once 40 tests/engine/expert_cache/test_split.py
  ;;
2)
  # llama.cpp first, after its build: moecache's rows must not share the cores with the compile
  for _ in $(seq 1 60); do grep -q BUILD_DONE /tmp/llamacpp/build.log 2>/dev/null && break; sleep 5; done
  grep -q "BUILD_DONE 0" /tmp/llamacpp/build.log || { echo "llama.cpp's build is not done: no rows"; exit 1; }
  BUDGET_S=120 LLAMA_S=115 LLAMA_ROWS="resident half" bash .ci/gpu-check llamabench
  # NOTE: 128 decode tokens a row, as llama-bench's tg128 beside them (a new request's first tokens hit less: replaying
  # bench's requests at 50%, its first 8 steps hit 93%, the rest 97%: .ci/policy-replay.py)
  BUDGET_S=150 HEADLINE_S=145 HEADLINE_FRACS=0.25,0.5,1 HEADLINE_BATCHES=1 \
    HEADLINE_EXTRA="--cache-profile $PROFILE --warmup-gen-len 400 --gen-len 128" bash .ci/gpu-check headline
  BUDGET_S=60 BATCH8_S=55 bash .ci/gpu-check batch8
  echo "== llama-batched-bench -npl 8 -ngl 99 -ncmoe 24" | tee -a "$LOGS/llamacpp.log"
  timeout 60 /tmp/llamacpp/llama.cpp/build/bin/llama-batched-bench -m /tmp/qwen3moe-30b-a3b.gguf -fa on \
    -t "$(nproc)" -c 8192 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 8 -ngl 99 -ncmoe 24 2>&1 | grep -E "^\||error" \
    | tee -a "$LOGS/llamacpp.log"
  BUDGET_S=135 SMALL_S=130 bash .ci/gpu-check small
  BUDGET_S=100 CACHED_S=95 CACHED_NAME=modes25 CACHED_FRACS=0.25 CACHED_POLICIES=decay CACHED_MODES=stream,hybrid \
    CACHED_EXTRA="--repeats 4 --cache-profile $PROFILE --gen-len 128" bash .ci/gpu-check cached
  ;;
3)
  # NOTE: medians of 4 runs for stream against hybrid at 25% and 50%: two runs of one configuration read 189.8 and
  # 199.6 tok/s (H100, 2026-12-06), as far apart as the two modes
  BUDGET_S=75 LLAMA_S=70 LLAMA_ROWS="cpu" bash .ci/gpu-check llamabench
  BUDGET_S=95 CACHED_S=90 CACHED_NAME=hybrid50 CACHED_FRACS=0.5 CACHED_POLICIES=lru CACHED_MODES=stream,hybrid \
    CACHED_EXTRA="--repeats 4 --cache-profile $PROFILE --gen-len 128" bash .ci/gpu-check cached
  BUDGET_S=85 CACHED_S=80 CACHED_NAME=modes0 CACHED_FRACS=0 CACHED_POLICIES=lru CACHED_MODES=cpu,stream,hybrid \
    CACHED_EXTRA="--warmup-gen-len 64 --gen-len 32 --repeats 3" bash .ci/gpu-check cached
  PYTHONPATH=/tmp/site:$PWD timeout 50 python3 .ci/gpu-host-share.py 14 2 2>&1 | tee "$LOGS/host-share.log" | tail -3
  BUDGET_S=70 CACHED_S=65 CACHED_NAME=link16 CACHED_FRACS=0,0.5 CACHED_POLICIES=lru CACHED_MODES=cpu,stream,hybrid \
    CACHED_EXTRA="--warmup-gen-len 100 --gen-len 24 --repeats 1 --link-gbps 16" bash .ci/gpu-check cached
  ;;
4)
  # the prefill GEMMs under Nsight Compute (where their 1.3 ms a layer at 512 tokens goes: docs/benchmarks.md, fourth
  # lease of 2026-12-06), then the decode expert kernels' block shapes and blocks a step, then the step profiles
  PYTHONPATH=/tmp/site:$PWD timeout 120 ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section InstructionStats python3 .ci/gpu-moe-gemm.py ncu > "$LOGS/moe-gemm-ncu.log" 2>&1
  grep -E "^  [_a-z]|Duration|Registers|Achieved Occupancy|Issue Slots Busy|Memory Throughput|No Eligible|Executed Ipc A" \
    "$LOGS/moe-gemm-ncu.log" | head -60
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 .ci/gpu-expert-sweep.py 100 > "$LOGS/expert-sweep.log" 2>&1
  grep -E "^(==|  1 )" "$LOGS/expert-sweep.log" | grep -E "==|blocks|\*" | head -60
  BUDGET_S=165 PROFILE_S=160 PROFILE_LINES=160 bash .ci/gpu-check profile
  ROUTING=model PROFILE=$PROFILE PYTHONPATH=/tmp/site:$PWD timeout 150 python3 .ci/gpu-prefill-profile.py /tmp/qwen3moe-30b-a3b.gguf 512 cpu-moe 2>&1 \
    | tee "$LOGS/prefill-profile.log" | grep -E "^(==|  +[0-9])" | head -70
  PYTHONPATH=/tmp/site:$PWD timeout 45 python3 .ci/gpu-bell-probe.py 14 2>&1 | tee "$LOGS/bell-probe.log" | tail -8
  PYTHONPATH=/tmp/site:$PWD timeout 75 python3 .ci/gpu-miss-probe.py 2>&1 | tee "$LOGS/miss-probe.log" | tail -3
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 .ci/gpu-qkv-probe.py gemma4-tiny gpt-oss-tiny 2>&1 \
    | tee "$LOGS/qkv-probe.log" | grep -E "^(gemma|gpt)"
  ;;
5)
  # throughput as served (issue 16): llama-batched-bench at 1/8/32 sequences, moecache's engine at batches 1/8/32
  # (resident, pp512 beside), then a real server under 1/8/32 streaming clients over HTTP and gRPC
  BUDGET_S=200 LLAMA_S=195 LLAMA_ROWS="batched" bash .ci/gpu-check llamabench
  BUDGET_S=100 RESIDENT_S=95 bash .ci/gpu-check resident
  PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m service.cli bench-serve -m /tmp/qwen3moe-30b-a3b.gguf \
    --clients 1,8,32 --gen-len 128 --join 4 --json "$LOGS/serve.json" 2>&1 | tee "$LOGS/serve.log" | grep -E "^\|"
  ;;
6)
  # issue 19. (a) the same 25% VRAM cache (decay, stream, batch 1, synthetic qwen3 routing as the headline rows),
  # every expert pinned in RAM (--n-cpu-moe 48) against every expert on disk behind a RAM tier of 25% of the
  # experts' bytes (--ssd-moe --host-cache-mib); (b) decode at a 32k-token context, KV bf16 / q8_0 / q4_0.
  # (c) the KLD of q8_0 and q4_0 KV against bf16 at a long context does not fit in this stage's ~240 s (a
  # --kl-divergence-base run and one run per type, each loading the model and prefilling the context): not run.
  M=/tmp/qwen3moe-30b-a3b.gguf
  py() { PYTHONPATH=/tmp/site:$PWD python3 "$@"; }
  left() { echo $((${STAGE_S:-400} - SECONDS)); }  # seconds the stage has left (STAGE_S: its budget)
  RAM_MIB=$(py -c "from engine.gguf.reader import GGUFFile; \
print(sum(t.num_bytes for t in GGUFFile('$M') if '_exps' in t.name) // 4 >> 20)")
  echo "== RAM tier: 25% of the routed experts = $RAM_MIB MiB" | tee "$LOGS/ssd.log"
  ssd_bench() {  # NAME LIMIT ARGS...
    local name=$1 seconds=$2; shift 2
    PYTHONPATH=/tmp/site:$PWD timeout "$seconds" python3 -m service.cli bench -m $M --routing synthetic:qwen3 \
      --budget-frac 0.25 --policy decay --miss-mode stream --batches 1 --prompt-len 64 --warmup-gen-len 100 \
      --gen-len 64 --repeats 1 --json "$LOGS/$name.json" "$@" 2>&1 | tee -a "$LOGS/ssd.log" | grep -E "^\||rror"
  }
  # the disk's own read rate, the bound of the tier's misses: one reader of 16 MiB blocks, then 16 threads reading
  # expert-sized blocks at random offsets, both O_DIRECT (the page cache out of the way)
  echo "== the disk: $(timeout 30 dd if=$M of=/dev/null bs=16M iflag=direct count=256 2>&1 | tail -1)" | tee -a "$LOGS/ssd.log"
  py - "$M" <<'PY' 2>&1 | tee -a "$LOGS/ssd.log"
import mmap, os, random, sys, threading, time
path, size = sys.argv[1], os.path.getsize(sys.argv[1])
fd, block, done = os.open(path, os.O_RDONLY | os.O_DIRECT), 2654208 // 4096 * 4096, []
def reader() -> None:
    buf = mmap.mmap(-1, block)
    done.append(sum(os.preadv(fd, [buf], random.randrange(0, size - block) // 4096 * 4096) for _ in range(48)))
threads = [threading.Thread(target=reader) for _ in range(16)]
start = time.perf_counter(); [t.start() for t in threads]; [t.join() for t in threads]
print(f"== the disk: 16 threads x 48 random reads of {block / 2**20:.2f} MiB, O_DIRECT: "
      f"{sum(done) / (time.perf_counter() - start) / 1e9:.2f} GB/s")
PY
  ssd_bench ssd-in-ram 70 --n-cpu-moe 48
  # NOTE: the file is in the page cache since synth (and the run above): its pages are dropped first with
  # posix_fadvise(POSIX_FADV_DONTNEED) so the tier's first reads come from the NVMe; a RAM-tier miss read again
  # later may still be served by the page cache (the tier reads with preadv, not O_DIRECT)
  py -c "import os; fd = os.open('$M', os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)"
  ssd_bench ssd-on-disk 90 --ssd-moe --host-cache-mib "$RAM_MIB"
  py - "$LOGS/ssd-in-ram.json" "$LOGS/ssd-on-disk.json" <<'PY' 2>&1 | tee -a "$LOGS/ssd.log"
import json, sys
rows = {}
for path in sys.argv[1:]:
    try:
        d = [p for p in json.load(open(path))["configurations"][0]["phases"] if p["kind"] == "decode" and p["run"]]
    except (OSError, KeyError, IndexError, ValueError) as e:
        print(f"{path}: no decode figures ({e!r})"); continue
    p = d[-1]
    rows[path] = p["tokens_per_second"]
    print(f"{path.split('/')[-1]}: {p['tokens_per_second']:.1f} tok/s, VRAM hit {p['hit_ratio']:.1%}, RAM-tier hit "
          f"{p.get('ram_tier_hit_ratio', 0):.1%}, disk {p.get('disk_read_bytes_per_token', 0) / 2**20:.2f} MiB/tok = "
          f"{p.get('disk_read_bytes_per_token', 0) * p['tokens_per_second'] / 1e9:.2f} GB/s")
if len(rows) == 2:
    ram, disk = rows.values()
    print(f"on disk / in RAM: {disk / ram:.2f}x (target >= 0.5x)")
PY
  for kv in ${KV_TYPES:-bf16 q8_0 q4_0}; do  # resident experts, one 32k-token sequence; one warm-up and one measured run
    [ "$(left)" -gt 50 ] || { echo "== KV $kv: no time left in the stage" | tee -a "$LOGS/kv32k.log"; continue; }
    echo "== KV $kv, 32k context" | tee -a "$LOGS/kv32k.log"
    PYTHONPATH=/tmp/site:$PWD timeout "$(left)" python3 -m service.cli bench -m $M --n-cpu-moe 0 --kv-cache-dtype $kv \
      --batches 1 --prompt-len 16 --decode-prompt-len 32704 --max-num-seqs 1 --warmup-gen-len 2 --gen-len 64 --repeats 1 \
      --json "$LOGS/kv32k-$kv.json" 2>&1 | tee -a "$LOGS/kv32k.log" | grep -E "^\||rror"
  done
  ;;
7)
  # throughput as served with the cache (issue 16's "with and without the cache"): every routed expert in host RAM
  # behind a cache of half their bytes (decay, stream), 1/8/32 streaming clients over HTTP and gRPC
  M=/tmp/qwen3moe-30b-a3b.gguf
  HALF_MIB=$(PYTHONPATH=/tmp/site:$PWD python3 -c "from engine.gguf.reader import GGUFFile; \
print(sum(t.num_bytes for t in GGUFFile('$M') if '_exps' in t.name) // 2 >> 20)")
  PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m service.cli bench-serve -m $M --cpu-moe --moe-cache-mib "$HALF_MIB" \
    --miss-mode stream --clients 1,8,32 --gen-len 128 --join 4 --json "$LOGS/serve-cached.json" 2>&1 \
    | tee "$LOGS/serve-cached.log" | grep -E "^\|"
  ;;
8)
  M=/tmp/qwen3moe-30b-a3b.gguf
  PYTHONPATH=/tmp/site:$PWD timeout 480 python3 .ci/gpu-kv-sweep.py 32768 "${SWEEP_S:-150}" $M 2>&1 \
    | tee "$LOGS/kv-sweep.log" | grep -E "^(==|\|| +[0-9.]+ us|[a-z0-9_]+: default)"
  PYTHONPATH=/tmp/site:$PWD python3 -c "from tools.corpus import CORPUS; open('/tmp/corpus.txt', 'w').write(chr(10).join(CORPUS * 8))"
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m service.cli perplexity -m $M -f /tmp/corpus.txt -c 8192 --chunks 2 \
    --kl-divergence-base /tmp/kv-base.kld > "$LOGS/kld-bf16.log" 2>&1
  for kv in q8_0 q4_0; do
    echo "== KL divergence of $kv KV against bf16" | tee -a "$LOGS/kld.log"
    PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m service.cli perplexity -m $M --kv-cache-dtype $kv --kl-divergence \
      --kl-divergence-base /tmp/kv-base.kld 2>&1 | tee -a "$LOGS/kld.log" | grep -E "Mean|KLD|Same top|rror"
  done
  ;;
9)
  M=/tmp/qwen3moe-30b-a3b.gguf
  pytest_gpu staging 60 tests/engine/expert_cache/test_staging.py
  ROUTING=model PROFILE=$PROFILE PYTHONPATH=/tmp/site:$PWD timeout 150 python3 .ci/gpu-prefill-profile.py $M 512 50% \
    2>&1 | tee "$LOGS/prefill-profile.log" | grep -E "^(==|  +[0-9]| +link)" | head -40
  bash .ci/gpu-models.sh 2>&1 | grep -E "^(==|\|)"
  ;;
esac
