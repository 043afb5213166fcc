"""The grouped expert kernels, the block-end norms, the gated activation, decode attention and MLA's decode kernels
compile for the H200 (sm90) on a machine without a GPU, and the decode kernels' weight loops spill no more than they
do today.

Triton's interpreter runs the kernels' semantics on the CPU (tests/ops/test_triton_experts.py) but lets through what
only the compiler refuses (a global that is not a constexpr, a type that differs between branches): here each
kernel variant the engine launches is compiled to a cubin for sm90, as the device would at its first launch.
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU expert kernels need it")

from gguf import GGMLQuantizationType as QType  # noqa: E402

from ops.triton import moe_gemm, qlinear, stage  # noqa: E402
from ops.triton.attention import KV_BITS, _split_kernel  # noqa: E402
from ops.triton.down import _down_kernel  # noqa: E402
from ops.triton.fused import _gated_act_kernel, _qk_norm_rope_kernel, _sandwich_kernel  # noqa: E402
from ops.triton.gate_up import ACTIVATIONS, _gate_up_kernel  # noqa: E402
from ops.triton.mla import OUT_ROWS, QK_ROWS, _mla_out_kernel, _mla_qk_kernel  # noqa: E402
from ops.triton.prepare import _prepare_kernel  # noqa: E402
from ops.triton.qdot import KERNEL_TYPES, step_blocks  # noqa: E402
from tools.sass_loops import NVDISASM, PREFILL_TYPES, compile_sass, compile_sm90, kernels, loops, weight_loops  # noqa: E402


def compile_for_sm90(kernel: Any, types: dict[str, str], constexprs: dict[str, object], num_warps: int = 2) -> None:
    """`types`: the arguments whose types differ from `tools.sass_loops.compile_sm90`'s defaults (by name)."""
    compiled = compile_sm90(kernel, types, constexprs, num_warps)
    assert compiled.asm.get("cubin"), "no cubin"


def has_cuda_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


needs_backend = pytest.mark.skipif(not has_cuda_backend(), reason="triton has no CUDA backend to compile with")
# every format with the plain math; the 32-block formats and the Q4_K_M layout with every activation and biases
# the 32-block formats also with 8 blocks a step, which rows of 90 and 22 blocks end in a step past the row
VARIANTS = [(t, "silu", False, 0) for t in KERNEL_TYPES] + \
    [(t, act, True, 0) for t in (QType.Q4_0, QType.MXFP4, QType.Q4_K) for act in ACTIVATIONS] + \
    [(t, "silu", False, 8) for t in (QType.Q8_0, QType.Q4_0, QType.MXFP4)]


@needs_backend
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0].name}-{v[1]}{'-biases' if v[2] else ''}"
                                                             f"{f'-blocks{v[3]}' if v[3] else ''}")
def test_gate_up_and_down_compile_for_sm90(variant: tuple[QType, str, bool, int]) -> None:
    qtype, activation, biases, blocks = variant
    hidden, ff = (2048, 768) if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K) else (2880, 704)
    # the launches of streamed misses (groups scanned in a window, copies), and a resident batch-1 step's (one pair
    # a pass, nothing copied: each pair its own window)
    for window, fill, down_bt in ((64, True, 2), (1, False, 1)):
        compile_for_sm90(_gate_up_kernel, {"alpha": "fp32", "limit": "fp32"},
                         dict(GATE_FMT=int(qtype), UP_FMT=int(qtype), DOWN_FMT=int(qtype), HIDDEN=hidden, BT=1, BR=16,
                              WINDOW=window, GROUP=16, FILL=fill, SPREAD=True, COPY=1024,
                              ACT=ACTIVATIONS[activation], BIAS=biases, BLOCKS=step_blocks(hidden, blocks)))
        compile_for_sm90(_down_kernel, {}, dict(DOWN_FMT=int(qtype), FF=ff, BT=down_bt, BR=32, WINDOW=window,
                                                FILL=fill, SPREAD=True, COPY=1024, BIAS=biases,
                                                BLOCKS=step_blocks(ff, blocks)))


@needs_backend
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_prepare_compiles_for_sm90(qtype: QType) -> None:
    compile_for_sm90(_prepare_kernel, {}, dict(FMT=int(qtype), BLOCK=1024, GROUP=16))


# the fused prefill GEMMs (`ops.triton.moe_gemm`): every format with the plain math, gpt-oss's and Gemma's maths;
# Q4_K by groups of 16 too (rows not whole super-blocks)
MOE_GEMM_VARIANTS = [(t, "silu", False, t == QType.Q4_K) for t in moe_gemm.KERNEL_TYPES] + \
    [(QType.MXFP4, "swiglu_oai", True, False), (QType.Q4_K, "gelu", True, True), (QType.Q4_K, "silu", False, False)]


@needs_backend
@pytest.mark.parametrize("variant", MOE_GEMM_VARIANTS,
                         ids=lambda v: f"{v[0].name}-{v[1]}{'-biases' if v[2] else ''}{'-super' if v[3] else ''}")
def test_moe_gemm_compiles_for_sm90(variant: tuple[QType, str, bool, bool]) -> None:
    qtype, activation, biases, whole = variant
    config = moe_gemm.MoeGemmConfig()
    tiles = dict(BM=32, BN=config.block_n, BK=32 if whole else config.block_k, E_POW2=128, INTERPRET=False,
                 SUPER=whole)
    compile_for_sm90(moe_gemm._gate_up_kernel, PREFILL_TYPES,
                     dict(GATE_FMT=int(qtype), UP_FMT=int(qtype), ACT=ACTIVATIONS[activation], GATE_BIAS=biases,
                          UP_BIAS=biases, **tiles), config.num_warps)
    compile_for_sm90(moe_gemm._down_kernel, PREFILL_TYPES, dict(BIAS=biases, DOWN_FMT=int(qtype), **tiles),
                     config.num_warps)


@needs_backend
@pytest.mark.parametrize("rows", [1, 32, 512])
def test_q8_linear_compiles_for_sm90(rows: int) -> None:
    c = qlinear.default_config(rows, 5120, 2048)
    compile_for_sm90(qlinear._q8_linear_kernel, {"x": "*bf16", "codes": "*i8", "scales": "*fp16", "bias": "*fp16",
                                                 "y": "*bf16", "work": "*fp32", "arrived": "*i32"},
                     dict(BIAS=rows == 32, W_LEFT=c.w_left, SPLIT=c.splits > 1, BM=c.block_m, BN=c.block_n,
                          BK=c.block_k, INTERPRET=False), c.num_warps)


@needs_backend
def test_the_gather_of_a_staged_layer_moves_16_bytes_a_load() -> None:
    """`ops.triton.gather_experts` (a prompt's staged layer, from pinned host memory read in place): each of a
    thread's loads and stores moves 16 bytes, as the copy engine's would reach the link's speed only with enough in
    flight."""
    sass = compile_sass(stage._gather_kernel, dict(BLOCK=stage.GATHER_BLOCK), 4, {"expert_bytes": 884736},
                        types={"sources": "*i64", "rows": "*i64", "dst": "*u8", "num_experts": "i32",
                               "expert_bytes": "i32"})
    moves = collections.Counter(re.findall(r"\b((?:LDG|STG)\.E(?:\.\d+)?)\b", sass))
    assert moves["LDG.E.128"] == moves["STG.E.128"] == stage.GATHER_BLOCK // (16 * 128), moves
    assert set(moves) <= {"LDG.E.128", "STG.E.128", "LDG.E.64"}, moves  # the 64-bit loads: the expert's address and row


@needs_backend
def test_moe_gemm_sum_compiles_for_sm90() -> None:
    compile_for_sm90(moe_gemm._sum_kernel, PREFILL_TYPES, dict(BH=moe_gemm.SUM_COLS))


@needs_backend
@pytest.mark.parametrize("shape", [(False, False, False, 3), (True, True, True, 1)],
                         ids=["after-attention", "after-ffn"])
def test_sandwich_norm_compiles_for_sm90(shape: tuple[bool, bool, bool, int]) -> None:
    has_b, has_post, scaled, following = shape
    pointers = ("x", "a", "b", "wa", "wb", "wp", "w1", "w2", "w3", "y", "o1", "o2", "o3")
    compile_for_sm90(_sandwich_kernel, {**{name: "*bf16" for name in pointers}, "eps": "fp32", "scale": "fp32"},
                     dict(HAS_B=has_b, HAS_POST=has_post, SCALED=scaled, NEXT=following, BLOCK=4096), num_warps=8)


@needs_backend
@pytest.mark.parametrize("head_dim", [256, 512])
def test_decode_attention_with_windows_and_sinks_compiles_for_sm90(head_dim: int) -> None:
    types = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "lse": "*fp32", "sinks": "*fp32",
             "slot_ids": "*i64", "positions": "*i64", "qk_scale": "fp32"}
    compile_for_sm90(_split_kernel, types, dict(GROUP=8, BG=16, BN=max(16, 8192 // head_dim), D=head_dim, ROPE=0,
                                                K_BITS=0, V_BITS=0, SINKS=True, WIDEN=False, CODES_DOT=False,
                                                F16_TILES=False),
                     num_warps=8)


@needs_backend
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0], ids=lambda t: t.name)
def test_a_quantized_kv_cache_is_read_in_vectors(qtype: QType) -> None:
    """Decode attention over a q8_0 / q4_0 cache (Qwen3-30B-A3B's heads: 128 values, 8 q heads a kv head, 32k
    positions) reads a row's codes in 8-byte vectors, some as asynchronous copies ahead of the loop's products as a
    bf16 cache's tiles are, and its scales once: no byte loads (three a value in ggml's block layout: 195 and 139
    loads a thread a step, where these take 29 and 17)."""
    sass = quantized_attention_sass(qtype, f16_tiles=False)
    loads = collections.Counter(re.findall(r"\b((?:LDG|LDGSTS)\.E(?:\.[\w]+)*)\b", sass))
    assert not any(".U8" in k for k in loads) and sum(loads.values()) <= 32, loads
    assert loads["LDGSTS.E.64"] > 0, loads


@needs_backend
def test_q8_0_float16_tiles_dequantize_two_values_an_instruction() -> None:
    """`SplitLaunch.f16_tiles` over a q8_0 cache (the shipped launch's 4 warps, 64 positions a tile): the loop
    subtracts and scales two codes an instruction (`_q8_half`), reads the codes as asynchronous copies, and runs at
    most three quarters of the float32 dequantization's instructions (2,592 a position; 1,600 with these)."""
    plain, half = (loops(quantized_attention_sass(QType.Q8_0, f16, warps=4)) for f16 in (False, True))
    plain_loop, half_loop = max(plain, key=len), max(half, key=len)
    ops = collections.Counter(line.split()[0] for line in half_loop if line.split())
    values = 2 * 64 * 128 // 128  # K and V tiles' values a thread a step
    assert ops["HMUL2"] == ops["HADD2"] == values // 2, ops
    assert any("LDGSTS" in line for line in half_loop)
    assert len(half_loop) <= 0.75 * len(plain_loop), (len(half_loop), len(plain_loop))


def quantized_attention_sass(qtype: QType, f16_tiles: bool, warps: int = 8) -> str:
    """The split kernel's SASS over q8_0 / q4_0 caches of Qwen3-30B-A3B's heads (128 values, 8 q heads a kv head) at
    32k positions, bf16 q, 64 positions a tile."""
    row, length = {QType.Q8_0: 136, QType.Q4_0: 72}[qtype], 32768
    types = {"q": "*bf16", "k": "*u8", "v": "*u8", "o": "*fp32", "lse": "*fp32", "sinks": "*fp32",
             "slot_ids": "*i32", "positions": "*i32", "qk_scale": "fp32"}
    strides = {f"{c}_s{i}": stride for c in "kv" for i, stride in enumerate((4 * length * row, length * row, row))}
    return compile_sass(_split_kernel, dict(GROUP=8, BG=16, BN=64, D=128, ROPE=0, K_BITS=KV_BITS[qtype],
                                            V_BITS=KV_BITS[qtype], SINKS=False, WIDEN=False, CODES_DOT=False,
                                            F16_TILES=f16_tiles), warps,
                        {**strides, "q_s0": 4096, "q_s1": 128, "max_len": length}, types)


@needs_backend
def test_mla_decode_kernels_compile_for_sm90() -> None:
    """DeepSeek-V2-Lite's decode step: the latent attention (16 heads, 512-wide values, a 64-wide rotary key), the
    query and cache entry, the output's decompression."""
    types = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "lse": "*fp32", "sinks": "*fp32",
             "slot_ids": "*i64", "positions": "*i64", "qk_scale": "fp32"}
    compile_for_sm90(_split_kernel, types, dict(GROUP=16, BG=16, BN=16, D=512, ROPE=64, K_BITS=0, V_BITS=0,
                                                SINKS=False, WIDEN=False, CODES_DOT=False), num_warps=8)
    compile_for_sm90(_mla_qk_kernel, {"q": "*bf16", "kv": "*bf16", "k_b": "*bf16", "kv_norm": "*bf16", "out": "*bf16",
                                      "cache": "*bf16", "positions": "*i64", "slot_ids": "*i64", "inv_freq": "*fp32",
                                      "eps": "fp32", "gain": "fp32"},
                     dict(NEOX=False, NOPE=128, RANK=512, HALF=32, ROWS=QK_ROWS), num_warps=4)
    compile_for_sm90(_mla_out_kernel, {"x": "*bf16", "v_b": "*bf16", "out": "*bf16"}, dict(RANK=512, ROWS=OUT_ROWS),
                     num_warps=4)


@needs_backend
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_gated_act_compiles_for_sm90(gelu: bool) -> None:
    compile_for_sm90(_gated_act_kernel, {"gate_up": "*bf16", "out": "*bf16"},
                     dict(ACT=ACTIVATIONS["gelu" if gelu else "silu"], BLOCK=1024), num_warps=4)


@needs_backend
@pytest.mark.parametrize("write_kv", [False, True], ids=["rope", "rope-and-cache"])
def test_qk_norm_rope_compiles_for_sm90(write_kv: bool) -> None:
    pointers = ("x", "weight", "k_weight", "out", "v", "k_cache", "v_cache")
    compile_for_sm90(_qk_norm_rope_kernel, {**{name: "*bf16" for name in pointers}, "positions": "*i64",
                                            "slot_ids": "*i64", "inv_freq": "*fp32", "eps": "fp32"},
                     dict(HAS_NORM=True, NEOX=True, WRITE_KV=write_kv, BLOCK=64), num_warps=2)


# the decode loops that spill today (tools.sass_loops, docs/kernels.md), at most this many local loads a step
SPILLS = {(QType.Q6_K, "gate/up"): 246, (QType.Q8_0, "gate/up"): 209, (QType.Q6_K, "down"): 8}


@needs_backend
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_the_decode_loops_do_not_spill_more_than_they_do(qtype: QType) -> None:
    """Each format's gate/up and down kernel as the engine launches it at batch 1, compiled for sm90 and disassembled:
    the loop that reads the weights reads no spilled registers back, except where it already does (no more)."""
    if not os.path.exists(NVDISASM):
        pytest.skip(f"no nvdisasm beside Triton's ptxas ({NVDISASM})")
    for loop in weight_loops(qtype):
        assert loop.local_loads <= SPILLS.get((qtype, loop.kernel), 0), str(loop)
        assert loop.weights > 0 and loop.kinds["LDG"] > 0, str(loop)


@needs_backend
def test_planar_mxfp4_is_read_in_vectors() -> None:
    """A resident bank's planar MXFP4 (`ops.bank.to_planar`): the decode loops read a block's 16 code bytes in one
    load and only the scales byte by byte (at most 2 byte loads a matrix a step; GGUF's 17-byte blocks: a load a
    code byte or more, 16 and up a step of gate/up), spilling nothing; the prefill GEMMs compile for it."""
    if not os.path.exists(NVDISASM):
        pytest.skip(f"no nvdisasm beside Triton's ptxas ({NVDISASM})")
    for planar in (False, True):
        for name, text, _ in kernels(QType.MXFP4, planar):
            loop = max(loops(text), key=lambda s: sum(n.startswith("LDG") for n in s))
            loads = collections.Counter(n for n in loop if n.startswith("LDG"))
            if planar:
                assert loads["LDG.E.128"] > 0 and loads["LDG.E.U8"] <= 4 and "LDL" not in loop, (name, loads)
            else:
                assert loads["LDG.E.U8"] >= 16, (name, loads)  # what the check above is against
    assert all(loop.local_loads == 0 for loop in weight_loops(QType.MXFP4, prefill=True, planar=True))


@needs_backend
def test_the_prefill_loops_multiply_on_tensor_cores_without_spilling() -> None:
    """The prefill GEMMs' K loops (`tools.sass_loops`' PREFILL counts, Q4_K_M's gate/up format): tensor-core
    multiplies (mma.sync's HMMA, or wgmma's HGMMA where the weights are the left operand), the weights loaded in
    the loop (LDG, or LDGSTS: copies into shared memory a few steps ahead), no spilled registers read back."""
    if not os.path.exists(NVDISASM):
        pytest.skip(f"no nvdisasm beside Triton's ptxas ({NVDISASM})")
    for loop in weight_loops(QType.Q4_K, prefill=True):
        multiplies, loads = loop.kinds["HMMA"] + loop.kinds["HGMMA"], loop.kinds["LDG"] + loop.kinds["LDGSTS"]
        assert multiplies > 0 and loads > 0 and loop.local_loads == 0, str(loop)
