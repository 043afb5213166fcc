"""The Triton decode attention (`ops.triton.attention`) against the torch reference `decode_attention_torch`,
the prefill attention against SDPA (`ops.fused.prefill_attention_sdpa`), and the KV write against indexed
writes; over unquantized caches and caches of q8_0 / q4_0 rows (`ops.kv_quant`), where the kernels must
equal themselves over the dequantized cache bit for bit (the same values, the same math).

Fresh random inputs every run: positions anywhere in the cache (0 and max_len - 1 included),
shuffled slots that several tokens may share, one split or many. On CUDA the memory the launcher's
buffers come from is poisoned with NaN first (an unwritten output or a read of an unwritten
partial would surface as NaN).

The CUDA tests carry `@pytest.mark.gpu`. Without CUDA, the same checks run on tiny shapes under
Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be set before Triton compiles
anything, and must not reach the other tests of this process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the GPU attention kernels need it")

from ops.fused import prefill_attention_sdpa, write_kv_torch  # noqa: E402
from ops.kv_quant import dense, quantize_rows, row_bytes  # noqa: E402
from ops.quants import QType  # noqa: E402
from ops.triton import attention  # noqa: E402
from ops.triton.attention import (  # noqa: E402
    KV_BITS,
    SplitLaunch,
    decode_attention,
    decode_attention_torch,
    default_num_splits,
    prefill_attention,
    write_kv,
)
from tests.ops.interpreter import interpret_main, needs_no_cuda, run_interpreted  # noqa: E402

# |out - ref| <= ATOL + RTOL * |ref| elementwise, ref in the same dtype. float32: the kernels use
# ieee float32 dots, so only summation order and exp2 differ (measured ~4e-7). 16-bit: both outputs
# are rounded to the dtype (1 ulp apart at most: 2^-7 relative for bf16) and the kernel rounds the
# probabilities to the dtype before P @ V, as flash attention does. A wrong head, slot, position
# or split weight gives errors of order 0.1 to 1.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@dataclass(frozen=True)
class Case:
    num_tokens: int
    num_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    max_len: int = 1024
    num_slots: int = 6
    num_splits: int | None = None  # None: the launcher's default
    view_len: int | None = None  # pass a view of the first view_len positions of the cache
    k_qtype: QType | None = None  # K and V caches of quantized rows (None: rows of dtype)
    v_qtype: QType | None = None
    window: int = 0  # each token attends to the last `window` positions up to its own (0: all)
    sinks: bool = False  # a random sink logit per head
    value_dim: int | None = None  # a latent cache (MLA): the values are the keys' first value_dim columns
    codes_dot: bool = False  # launched with `SplitLaunch.codes_dot` (products on a quantized side's codes)
    f16_tiles: bool = False  # launched with `SplitLaunch.f16_tiles` (a quantized side's tiles in float16)

    @property
    def qtypes(self) -> tuple[QType | None, QType | None]:
        return self.k_qtype, self.v_qtype


def random_inputs(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, slot_ids, positions (CPU): positions include 0 and the last one, a slot
    shared by two tokens, token order shuffled."""
    length = case.view_len or case.max_len
    q = torch.randn(case.num_tokens, case.num_heads, case.head_dim, generator=generator).to(case.dtype)
    shape = (case.num_slots, case.kv_heads, case.max_len, case.head_dim)
    k = torch.randn(shape, generator=generator).to(case.dtype)
    v = torch.randn(shape, generator=generator).to(case.dtype)
    positions = torch.randint(length, (case.num_tokens,), generator=generator)
    edges = torch.tensor([0, length - 1])
    if case.num_tokens == 1:  # one token: an edge two times in three
        edges = torch.cat([edges, positions])[torch.randint(3, (1,), generator=generator)]
    positions[:len(edges)] = edges
    slot_ids = torch.randint(case.num_slots, (case.num_tokens,), generator=generator)
    slot_ids[-1] = slot_ids[0]
    order = torch.randperm(case.num_tokens, generator=generator)
    if case.k_qtype is not None:
        k = quantize_rows(k, case.k_qtype)
    if case.v_qtype is not None:
        v = quantize_rows(v, case.v_qtype)
    if case.value_dim is not None:
        v = k[..., :case.value_dim]  # one tensor: the latent, the rotary key after it
    return q, k, v, slot_ids[order], positions[order]


def dense_caches(case: Case, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches' values in the case's dtype (the dequantized rows of a quantized one)."""
    return dense(k, case.k_qtype, case.head_dim, case.dtype), dense(v, case.v_qtype, case.head_dim, case.dtype)


def poison_allocator(device: torch.device, num_bytes: int) -> None:
    """Leave NaN in the memory the next allocations of this size will get (CUDA caching allocator)."""
    if device.type == "cuda":
        torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(float("nan"))


def assert_close(case: Case, out: torch.Tensor, ref: torch.Tensor, seed: int) -> float:
    """Asserts the tolerance of case.dtype; returns the max abs error."""
    atol, rtol = TOLERANCE[case.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out, ref = out.double().cpu(), ref.double()
    assert out.isfinite().all(), f"{case} seed {seed}: unwritten or non-finite outputs"
    excess = ((out - ref).abs() - rtol * ref.abs()).max().item()
    error = (out - ref).abs().max().item()
    assert excess <= atol, f"{case} seed {seed}: max abs error {error:.2e} (over atol + rtol |ref| by {excess:.2e})"
    return error


def assert_same_values(case: Case, out: torch.Tensor, same: torch.Tensor, seed: int) -> None:
    """The kernel over a quantized cache equals itself over the dequantized cache: in float32 within a few of its
    roundings (a wrong scale, code or rounding of one value is off by a code step, 1e-3 or more; the interpreter's
    products go through numpy's BLAS, whose summation order can differ between a tile the kernel transposed and one
    it loaded: 1.3e-7 seen on an AMD EPYC); in a 16-bit dtype on a GPU within that dtype's tolerance (the tensor
    cores sum a tile the kernel dequantized in registers in another order than one it loaded, and the softmax's
    16-bit steps carry that on: up to 15 roundings of an output measured on the H200)."""
    if case.dtype == torch.float32 or out.device.type != "cuda":
        error = (out.double() - same.double()).abs().max().item()
        assert error <= 1e-6, f"{case} seed {seed}: not the values of the dequantized cache ({error:.1e})"
        return
    assert_close(case, out, same.double().cpu().to(case.dtype), seed)


@contextmanager
def launched(bits: tuple[int, int], launch: SplitLaunch) -> Iterator[None]:
    """`launch` for the cache types `bits` while the block runs; the shipped table after it."""
    shipped = attention.SPLIT_LAUNCH.get(bits)
    attention.SPLIT_LAUNCH[bits] = launch
    try:
        yield
    finally:
        attention.SPLIT_LAUNCH.pop(bits)
        if shipped is not None:
            attention.SPLIT_LAUNCH[bits] = shipped


def run_case(case: Case, device: torch.device, seed: int) -> float:
    """Kernel output vs the reference for fresh random inputs; asserts and returns the max abs error."""
    q, k, v, slot_ids, positions = random_inputs(case, torch.Generator().manual_seed(seed))
    if case.view_len is not None:
        k, v = k[:, :, :case.view_len], v[:, :, :case.view_len]
    scale = case.head_dim ** -0.5
    sinks = 2 * torch.randn(case.num_heads, generator=torch.Generator().manual_seed(seed + 1)) if case.sinks else None
    ref = decode_attention_torch(q, k, v, slot_ids, positions, scale, *case.qtypes, window=case.window, sinks=sinks)
    k_dense, v_dense = (t.to(device) for t in dense_caches(case, k, v))
    q, k, v, slot_ids, positions = (t.to(device) for t in (q, k, v, slot_ids, positions))
    sinks = None if sinks is None else sinks.to(device)
    poison_allocator(device, 64 << 20)
    bits = KV_BITS[case.k_qtype], KV_BITS[case.v_qtype]
    launch = replace(attention.SPLIT_LAUNCH.get(bits, SplitLaunch()), codes_dot=case.codes_dot,
                     f16_tiles=case.f16_tiles)  # as shipped otherwise
    with launched(bits, launch):
        out = decode_attention(q, k, v, slot_ids, positions, scale, num_splits=case.num_splits, k_qtype=case.k_qtype,
                               v_qtype=case.v_qtype, window=case.window, sinks=sinks)
    # NOTE: products on the codes skip the dequantized values' rounding to 16 bits, and float16 tiles round them to
    # float16 where q is bf16: within tolerance of the reference
    if case.qtypes != (None, None) and not case.codes_dot and not (case.f16_tiles and case.dtype == torch.bfloat16):
        with launched((0, 0), launch):  # the same tiles over the dequantized cache: the same sums
            same = decode_attention(q, k_dense, v_dense, slot_ids, positions, scale, num_splits=case.num_splits,
                                    window=case.window, sinks=sinks)
        assert_same_values(case, out, same, seed)
    return assert_close(case, out, ref, seed)


def run_prefill_case(case: Case, device: torch.device, seed: int) -> float:
    """The prefill kernel for a chunk of case.num_tokens tokens of one slot at a random start (0 included)
    vs SDPA over the (dequantized) cache; asserts and returns the max abs error."""
    generator = torch.Generator().manual_seed(seed)
    _, k, v, slot_ids, _ = random_inputs(case, generator)
    q = torch.randn(case.num_tokens, case.num_heads, case.head_dim, generator=generator).to(case.dtype)
    slot = int(slot_ids[0])
    start = int(torch.randint(case.max_len - case.num_tokens + 1, (), generator=generator)) if seed % 2 else 0
    scale = case.head_dim ** -0.5
    ref = prefill_attention_sdpa(q, k, v, slot, start, scale, k_qtype=case.k_qtype, v_qtype=case.v_qtype)
    k_dense, v_dense = (t.to(device) for t in dense_caches(case, k, v))
    q, k, v = q.to(device), k.to(device), v.to(device)
    out = prefill_attention(q, k, v, slot, start, scale, *case.qtypes)
    assert_same_values(case, out, prefill_attention(q, k_dense, v_dense, slot, start, scale), seed)
    return assert_close(case, out, ref, seed)


def check_rejects_bad_inputs(device: torch.device) -> None:
    def inputs(**changes: object) -> dict[str, object]:
        base: dict[str, object] = dict(
            q=torch.randn(2, 8, 64, device=device), k_cache=torch.randn(3, 2, 32, 64, device=device),
            v_cache=torch.randn(3, 2, 32, 64, device=device), slot_ids=torch.tensor([0, 2], device=device),
            positions=torch.tensor([5, 31], device=device), scale=0.125)
        return base | changes

    k = torch.randn(3, 2, 32, 64, device=device)
    bad = [
        ("head_dim", inputs(q=torch.randn(2, 8, 48, device=device), k_cache=k[..., :48], v_cache=k[..., :48])),
        ("head_dim", inputs(q=torch.randn(2, 8, 8, device=device), k_cache=k[..., :8], v_cache=k[..., :8])),
        ("dtype", inputs(k_cache=k.bfloat16())),
        ("q:", inputs(q=torch.randn(2, 64, 8, device=device).transpose(1, 2))),  # strided rows
        ("k_cache", inputs(k_cache=k[..., :32])),
        ("k_cache", inputs(k_cache=k.transpose(2, 3).contiguous().transpose(2, 3))),  # strided rows
        ("kv heads", inputs(q=torch.randn(2, 7, 64, device=device))),
        ("v_cache", inputs(v_cache=k[:2])),
        ("slot_ids", inputs(slot_ids=torch.tensor([0], device=device))),
        ("positions", inputs(positions=torch.tensor([5.0, 3.0], device=device))),
        ("num_splits", inputs(num_splits=0)),
        ("window", inputs(window=-1)),
        ("sinks", inputs(sinks=torch.zeros(4, device=device))),
        ("sinks", inputs(sinks=torch.zeros(8, dtype=torch.float64, device=device))),
    ]
    q8 = torch.zeros(3, 2, 32, 68, dtype=torch.uint8, device=device)  # q8_0 rows of head_dim 64
    bad += [
        ("dtype", inputs(k_cache=q8)),  # bytes without their type
        ("k_cache", inputs(k_cache=q8[..., :64], k_qtype=QType.Q8_0)),  # rows of the wrong size
        ("multiple of 32", inputs(q=torch.randn(2, 8, 16, device=device), k_cache=q8[..., :16],
                                  v_cache=k[..., :16], k_qtype=QType.Q8_0)),
        ("no kernel reads", inputs(k_cache=q8, k_qtype=QType.Q5_0)),
    ]
    for match, kwargs in bad:
        with pytest.raises(ValueError, match=match):
            decode_attention(**kwargs)  # type: ignore[arg-type]
    out = decode_attention(**inputs(k_cache=q8, k_qtype=QType.Q8_0))  # type: ignore[arg-type]
    assert out.shape == (2, 8, 64)
    with pytest.raises(ValueError, match="outside the caches"):
        prefill_attention(torch.randn(4, 8, 64, device=device), q8, q8, 1, 30, 0.125, QType.Q8_0, QType.Q8_0)


def random_cache(shape: tuple[int, ...], qtype: QType | None, head_dim: int, dtype: torch.dtype,
                 generator: torch.Generator) -> torch.Tensor:
    """Random rows `[*shape, row]`: values of dtype, or random bytes of a quantized cache."""
    if qtype is None:
        return torch.randn((*shape, head_dim), generator=generator).to(dtype)
    return torch.randint(256, (*shape, row_bytes(qtype, head_dim, dtype)), generator=generator, dtype=torch.uint8)


def check_write_kv(device: torch.device, seed: int, num_tokens: int = 5, dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 32, k_qtype: QType | None = None, v_qtype: QType | None = None) -> None:
    """The one-launch KV write equals two indexed writes, bit for bit (quantized rows: as `ops.quants`
    quantizes them): k and v as the strided views of a fused q/k/v projection, distinct (slot, position)
    pairs including the cache's last position; every other entry of the caches unchanged."""
    generator = torch.Generator().manual_seed(seed)
    slots, kv_heads, max_len = 4, 2, 96
    k_cache = random_cache((3, slots, kv_heads, max_len), k_qtype, head_dim, dtype, generator)  # 3 layers
    v_cache = random_cache((3, slots, kv_heads, max_len), v_qtype, head_dim, dtype, generator)
    last = slots * max_len - 1  # the last position of the last slot, always written
    cells = torch.cat([torch.tensor([last]), torch.randperm(last, generator=generator)[:num_tokens - 1]])
    slot_ids, positions = cells // max_len, cells % max_len
    qkv = (torch.randn(num_tokens, 3 * kv_heads * head_dim, generator=generator) * 4).to(dtype)
    qkv[0, kv_heads * head_dim:kv_heads * head_dim + 32] = 0  # a zero block of k: d = 0
    k = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim:].view(num_tokens, kv_heads, head_dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_torch(ref_k[1], ref_v[1], slot_ids, positions, k, v, k_qtype, v_qtype)
    out_k, out_v = k_cache.clone().to(device), v_cache.clone().to(device)  # .to(cpu) would not copy
    ids, pos = slot_ids.to(device), positions.to(device)
    write_kv(out_k[1], out_v[1], ids, pos, k.to(device), v.to(device), k_qtype, v_qtype)
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v), f"seed {seed}"
    assert not torch.equal(ref_k, k_cache), "the reference wrote something"
    with pytest.raises(ValueError, match="v_cache"):
        write_kv(out_k[1], out_v[1, :, :, :8], ids, pos, k.to(device), v.to(device), k_qtype, v_qtype)
    if (k_qtype, v_qtype) == (None, None):
        with pytest.raises(ValueError, match="k:"):
            write_kv(out_k[1], out_v[1], ids, pos, k.half().to(device), v.to(device))


# --- CUDA -----------------------------------------------------------------------------------------

CUDA = torch.device("cuda")


def fresh_seed() -> int:
    return int(torch.randint(1 << 30, ()))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("heads", [(32, 4), (8, 8)], ids=["gqa32-4", "mha8"])
@pytest.mark.parametrize("num_tokens", [1, 3, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(dtype: torch.dtype, num_tokens: int, heads: tuple[int, int], head_dim: int) -> None:
    run_case(Case(num_tokens, *heads, head_dim, dtype), CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 2, 7, 64])
def test_long_context_any_split_count(num_splits: int | None) -> None:
    run_case(Case(1, 32, 4, 128, max_len=4096, num_slots=2, num_splits=num_splits), CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [16, 32, 256])
def test_other_head_dims_and_fp16(head_dim: int, dtype: torch.dtype) -> None:
    run_case(Case(5, 16, 2, head_dim, dtype, max_len=640), CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 100, 1000])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("heads", [(64, 8, 64), (16, 8, 256), (16, 2, 512)], ids=["gpt-oss", "gemma4-swa", "gemma4"])
def test_sliding_windows_and_sinks(heads: tuple[int, int, int], sinks: bool, window: int) -> None:
    # gpt-oss: a 128-position window and a sink logit per head; Gemma 4: 1024-position windows of 256-wide heads,
    # full layers of 512-wide heads. Several splits: windows that start inside a split or past the first ones
    run_case(Case(5, *heads, max_len=2048, window=window, sinks=sinks), CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_latent_cache(dtype: torch.dtype, num_tokens: int) -> None:
    # DeepSeek-V2-Lite's MLA: 16 heads over one latent kv head of 512 values and a 64-wide rotary key after them
    run_case(Case(num_tokens, 16, 1, 576, dtype, max_len=2048, value_dim=512), CUDA, fresh_seed())
    run_case(Case(num_tokens, 16, 1, 576, dtype, max_len=256, value_dim=512, view_len=200), CUDA, fresh_seed())


@pytest.mark.gpu
def test_view_of_a_kv_length_bucket() -> None:
    # the cache sliced to the first `length` positions (strided slots): splits follow `length`
    run_case(Case(4, 32, 4, 128, max_len=2048, view_len=520), CUDA, fresh_seed())


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_positions() -> None:
    case = Case(4, 32, 4, 128, max_len=1024)
    generator = torch.Generator().manual_seed(fresh_seed())
    q, k, v, slot_ids, positions = (t.to(CUDA) for t in random_inputs(case, generator))
    scale = case.head_dim ** -0.5
    decode_attention(q, k, v, slot_ids, positions, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, slot_ids, positions, scale)
    for seed in range(3):
        new_q, _, _, new_slots, new_positions = random_inputs(case, torch.Generator().manual_seed(seed))
        q.copy_(new_q), slot_ids.copy_(new_slots), positions.copy_(new_positions)
        out.fill_(float("nan"))
        graph.replay()
        ref = decode_attention_torch(new_q, k.cpu(), v.cpu(), new_slots, new_positions, scale)
        assert_close(case, out, ref, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_write_kv_matches_indexed_writes(num_tokens: int) -> None:
    check_write_kv(CUDA, fresh_seed(), num_tokens)
    check_write_kv(CUDA, fresh_seed(), num_tokens, head_dim=80)  # not a power of two: masked columns


QTYPE_PAIRS = [(QType.Q8_0, QType.Q8_0), (QType.Q4_0, QType.Q4_0), (QType.Q8_0, QType.Q4_0), (None, QType.Q8_0)]


def qtype_ids(pair: tuple[QType | None, QType | None]) -> str:
    return "-".join(t.name.lower() if t else "bf16" for t in pair)


@pytest.mark.gpu
@pytest.mark.parametrize("qtypes", QTYPE_PAIRS, ids=qtype_ids)
@pytest.mark.parametrize("num_tokens", [1, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_quantized_cache_matches_reference(dtype: torch.dtype, num_tokens: int,
                                           qtypes: tuple[QType | None, QType | None]) -> None:
    """Every launch form: plain tiles, products on the codes and float16 tiles (16-bit q); a float16 q's float16
    tiles hold the dequantized cache's values (`_q8_half`'s byte permutes checked value for value)."""
    for codes_dot, f16_tiles in ((False, False), (True, False), (False, True)) if dtype != torch.float32 else \
            ((False, False),):
        for shape in ((num_tokens, 32, 4, 128, dtype, 2048), (3, 16, 2, 64, dtype, 640)):
            run_case(Case(*shape[:5], max_len=shape[5], k_qtype=qtypes[0], v_qtype=qtypes[1], codes_dot=codes_dot,
                          f16_tiles=f16_tiles), CUDA, fresh_seed())


@pytest.mark.gpu
@pytest.mark.parametrize("qtypes", [*QTYPE_PAIRS, (None, None)], ids=qtype_ids)
@pytest.mark.parametrize("heads", [(32, 4), (8, 8)], ids=["gqa32-4", "mha8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_matches_sdpa(dtype: torch.dtype, heads: tuple[int, int],
                              qtypes: tuple[QType | None, QType | None]) -> None:
    for num_tokens, head_dim in ((300, 128), (17, 64), (1, 256)):
        case = Case(num_tokens, *heads, head_dim, dtype, max_len=1024, k_qtype=qtypes[0], v_qtype=qtypes[1])
        for seed in range(2):  # an odd seed starts the chunk past position 0
            run_prefill_case(case, CUDA, 2 * fresh_seed() + seed)


@pytest.mark.gpu
@pytest.mark.parametrize("qtypes", QTYPE_PAIRS, ids=qtype_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_quantizes_as_the_reference(dtype: torch.dtype, qtypes: tuple[QType | None, QType | None]) -> None:
    for num_tokens, head_dim in ((1, 128), (300, 128), (32, 96)):  # 96: three blocks, padded to four
        check_write_kv(CUDA, fresh_seed(), num_tokens, dtype, head_dim, *qtypes)


@pytest.mark.gpu
def test_launcher_rejects_bad_inputs() -> None:
    check_rejects_bad_inputs(CUDA)


# --- anywhere -----------------------------------------------------------------------------------------


def test_default_splits_fill_the_gpu_for_one_token() -> None:
    assert default_num_splits(1, 4, 4096) == 16
    assert default_num_splits(1, 4, 256) == 1  # the smallest KV bucket: no combine launch
    assert default_num_splits(64, 8, 4096) == 1
    assert default_num_splits(1, 4, 100) == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs on CPU tensors")
def test_cpu_tensors_need_cuda_or_the_interpreter() -> None:
    q, k, v, slot_ids, positions = random_inputs(Case(2, 4, 2, 16, max_len=8), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="CUDA"):
        decode_attention(q, k, v, slot_ids, positions, 0.25)


# --- the interpreter (no CUDA) ------------------------------------------------------------------------

# tiny shapes: the interpreter runs each program in numpy. Blocks of 64 positions for these head
# dims, so these split counts give 4 and 5 splits (the last one short), 2 by default, and 1.
INTERPRETER_CASES = [
    Case(3, 4, 2, 16, torch.float32, max_len=200, num_splits=4),
    Case(3, 8, 2, 32, torch.bfloat16, max_len=200),
    Case(1, 2, 2, 16, torch.float16, max_len=70, num_splits=1),
    Case(2, 4, 1, 64, torch.bfloat16, max_len=300, num_splits=5),
    Case(3, 4, 2, 16, torch.float32, max_len=200, num_splits=3, view_len=150),
    # sliding windows (starting inside a split and past the first ones) and sink logits, heads of 512
    Case(3, 4, 2, 16, torch.float32, max_len=200, num_splits=4, window=50, sinks=True),
    Case(2, 8, 2, 32, torch.bfloat16, max_len=150, window=20),
    Case(2, 4, 1, 64, torch.float32, max_len=100, num_splits=3, sinks=True),
    Case(2, 4, 2, 512, torch.float32, max_len=40, num_splits=2, window=16),
    Case(3, 4, 1, 48, torch.float32, max_len=100, num_splits=3, value_dim=32),
    Case(2, 8, 1, 48, torch.bfloat16, max_len=60, value_dim=32, view_len=50),
]
INTERPRETER_CHECKS = [(str(c), lambda seed, c=c: run_case(c, torch.device("cpu"), seed)) for c in INTERPRETER_CASES]
INTERPRETER_CHECKS.append(("validation", lambda seed: check_rejects_bad_inputs(torch.device("cpu"))))
INTERPRETER_CHECKS.append(("kv write", lambda seed: check_write_kv(torch.device("cpu"), seed, dtype=torch.float32)))
INTERPRETER_CHECKS.append(("kv write 24", lambda seed: check_write_kv(torch.device("cpu"), seed, head_dim=24)))
QUANTIZED_CASES = [
    Case(3, 8, 2, 32, torch.bfloat16, max_len=200, k_qtype=QType.Q8_0, v_qtype=QType.Q4_0),
    Case(2, 4, 1, 64, torch.float32, max_len=150, num_splits=3, k_qtype=QType.Q4_0, v_qtype=QType.Q8_0),
    Case(2, 4, 2, 32, torch.bfloat16, max_len=100, num_splits=2, k_qtype=None, v_qtype=QType.Q4_0, view_len=70),
    Case(3, 8, 2, 32, torch.float16, max_len=200, k_qtype=QType.Q8_0, v_qtype=QType.Q4_0, codes_dot=True),
    Case(2, 4, 1, 64, torch.bfloat16, max_len=150, num_splits=3, k_qtype=QType.Q4_0, v_qtype=QType.Q8_0,
         codes_dot=True),
    Case(2, 4, 2, 32, torch.float16, max_len=100, num_splits=2, k_qtype=QType.Q8_0, v_qtype=None, codes_dot=True),
    Case(2, 4, 1, 64, torch.bfloat16, max_len=150, num_splits=3, k_qtype=QType.Q8_0, v_qtype=QType.Q4_0,
         f16_tiles=True),
]
INTERPRETER_CHECKS += [(str(c), lambda seed, c=c: run_case(c, torch.device("cpu"), seed)) for c in QUANTIZED_CASES]
PREFILL_CASES = [  # chunks of several token blocks and key blocks; the first one at a random start
    Case(40, 8, 2, 32, torch.bfloat16, max_len=100, k_qtype=QType.Q8_0, v_qtype=QType.Q4_0),
    Case(21, 4, 4, 64, torch.float32, max_len=64, k_qtype=QType.Q4_0, v_qtype=None),
    Case(9, 4, 1, 32, torch.float32, max_len=48),
]
INTERPRETER_CHECKS += [(f"prefill {c}", lambda seed, c=c: run_prefill_case(c, torch.device("cpu"), seed))
                       for c in PREFILL_CASES]
INTERPRETER_CHECKS += [
    (f"kv write {qtype_ids(pair)} {dtype}", lambda seed, pair=pair, dtype=dtype: check_write_kv(
        torch.device("cpu"), seed, 7, dtype, 96, *pair))
    for pair, dtype in ((QTYPE_PAIRS[2], torch.bfloat16), (QTYPE_PAIRS[1], torch.float32),
                        (QTYPE_PAIRS[3], torch.bfloat16))]


@needs_no_cuda
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(interpret_main(INTERPRETER_CHECKS))
