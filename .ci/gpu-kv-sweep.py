"""The decode attention's launch over a long quantized KV cache (CUDA): one token of Qwen3-30B-A3B's attention (32 q
heads, 4 kv heads, head_dim 128, bf16 q) at POSITIONS positions, for each cache type, timed over every `SplitLaunch`
of the sweep (plain tiles, products on the codes or float16 tiles; programs wanted, positions a tile, warps, pipeline
stages), each checked against the default launch's output. Each timing cycles through as many layers' caches as pass
200 MB, so that no type's cache is read from L2 (a q8_0 layer at 32k is 36 MB, within an H100's 50 MB L2), as in a
decode step. Prints
the default's time and the fastest launches of each type. With a model, then decodes at a 32k-token context with each
KV type in this process, the fastest launch of each type in place (`moecache bench` as docs/benchmarks.md's 32k rows).
Usage: python3 .ci/gpu-kv-sweep.py [POSITIONS] [SECONDS] [MODEL] (default 32768 and 150: each type's sweep stops after
a third of SECONDS); QUICK=1: a smaller sweep; KV_TYPES (default "bf16 q8_0 q4_0"): the types swept and decoded."""

import itertools
import os
import sys
import time

import torch

from ops import kv_quant
from ops.quants import QType
from ops.triton import attention
from ops.triton.attention import SplitLaunch, decode_attention
from service.cli import main
from tools.bench_kernels import time_calls

POSITIONS = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 150.0
MODEL = sys.argv[3] if len(sys.argv) > 3 else None
TYPES = {"bf16": None, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0}
FORMS = {"tiles": {}, "codes": {"codes_dot": True}, "f16": {"f16_tiles": True}}  # how a quantized side is multiplied
SPACE = (tuple(FORMS), (64, 128, 32), (8, 4), (0, 3), (256, 512, 1024))
if os.environ.get("QUICK"):  # a short lease: float16 tiles first, plain ones, two tile lengths, warps and programs
    SPACE = (("f16", "tiles"), (64, 128), (4, 8), (3,), (256, 512, 1024))
LAUNCHES = [SplitLaunch(p, b, w, s, **FORMS[f]) for f, b, w, s, p in itertools.product(*SPACE)]
torch.manual_seed(0)
dev = torch.device("cuda")
q = torch.randn(1, 32, 128, device=dev).bfloat16()
dense = torch.randn(2, 1, 4, POSITIONS, 128, device=dev).bfloat16()
slot = torch.zeros(1, dtype=torch.int32, device=dev)
pos = torch.full((1,), POSITIONS - 1, dtype=torch.int32, device=dev)


def timed(calls: list) -> float:
    """us a call: a CUDA graph of 20 calls cycling through `calls` (one a layer's cache), the median of its replays"""
    return time_calls([calls[i % len(calls)] for i in range(20)])[0]


print(f"== decode attention, 1 token, 32 q heads / 4 kv heads, head_dim 128, {POSITIONS} positions "
      f"({torch.cuda.get_device_name()})")
SWEPT = os.environ.get("KV_TYPES", " ".join(TYPES)).split()  # the types swept and decoded
for name in SWEPT:
    qtype = TYPES[name]
    deadline = time.monotonic() + SECONDS / len(SWEPT)
    k, v = (dense[i] if qtype is None else kv_quant.quantize_rows(dense[i], qtype) for i in range(2))
    bits = attention.KV_BITS[qtype], attention.KV_BITS[qtype]
    layer_bytes = k.numel() * k.element_size() * 2
    layers = [(k, v)] + [(k.clone(), v.clone()) for _ in range(-(-200_000_000 // layer_bytes) - 1)]

    def call(k: torch.Tensor = k, v: torch.Tensor = v, qtype: QType | None = qtype) -> torch.Tensor:
        return decode_attention(q, k, v, slot, pos, 128 ** -0.5, k_qtype=qtype, v_qtype=qtype)

    calls = [lambda k=lk, v=lv, call=call: call(k, v) for lk, lv in layers]
    attention.SPLIT_LAUNCH.pop(bits, None)
    want = call()
    rows = [(timed(calls), "default", SplitLaunch())]
    print(f"{name}: default {SplitLaunch()} {rows[0][0]:.1f} us ({layer_bytes / 1e6:.1f} MB of K and V, "
          f"{len(layers)} layers' caches: {layer_bytes / rows[0][0] / 1e3:.0f} GB/s)", flush=True)
    for launch in LAUNCHES if qtype is not None else [x for x in LAUNCHES if not (x.codes_dot or x.f16_tiles)]:
        if time.monotonic() > deadline:
            print(f"   (deadline: {name} stopped before {launch})")
            break
        attention.SPLIT_LAUNCH[bits] = launch
        try:
            got = call()
            ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            rows.append((timed(calls), "ok" if ok else "WRONG", launch))
        except Exception as e:  # a launch that does not compile (shared memory, registers) is skipped
            print(f"   {launch}: {type(e).__name__}: {str(e)[:80]}")
    attention.SPLIT_LAUNCH.pop(bits, None)
    ranked = sorted(rows, key=lambda r: r[0])
    for us, status, launch in ranked[:8]:
        print(f"   {us:7.1f} us {status:7s} {launch}")
    best = next((launch for _, status, launch in ranked if status != "WRONG"), SplitLaunch())
    if best != SplitLaunch():
        attention.SPLIT_LAUNCH[bits] = best  # for the decode runs below
    sys.stdout.flush()
del dense, k, v, want, layers, calls
torch.cuda.empty_cache()
for name in SWEPT if MODEL else ():
    bits = attention.KV_BITS[TYPES[name]], attention.KV_BITS[TYPES[name]]
    print(f"== KV {name}, 32k context, launch {attention.SPLIT_LAUNCH.get(bits, SplitLaunch())}", flush=True)
    main(["bench", "-m", MODEL, "--n-cpu-moe", "0", "--kv-cache-dtype", name, "--batches", "1", "--prompt-len", "16",
          "--decode-prompt-len", "32704", "--max-num-seqs", "1", "--warmup-gen-len", "2", "--gen-len", "64",
          "--repeats", "1"])
    sys.stdout.flush()
