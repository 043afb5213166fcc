"""Gate and up projections of grouped expert pairs with the expert's activation fused: h `[pairs, ff]`,
`act(gate x + gate bias, up x + up bias)` with act SiLU-gated (`silu(g) * u`), GELU-gated (tanh form) or gpt-oss's
clamped SwiGLU (`ops.expert_math.ExpertMath`)."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops.quants import QType
from ops.triton.checks import INDEX_DTYPES, check_rows, check_vector
from ops.triton.pairs import chunk_of, expert_pointers, group_of, slots, window_for
from ops.triton.qdot import (
    GROUP,
    MAGIC,
    has_kernel,
    kernel_format,
    read_place,
    reads_int8,
    rows_dot,
    step_blocks,
    steps_super_blocks,
)
from ops.triton.stage import COPY_BLOCK, Fill, fill_rows2
from ops.triton.tables import ExpertTables

ACTIVATIONS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}  # the kernel's ACT code of each `ExpertMath.activation`


@triton.jit
def _activation(gate, up, alpha, limit, ACT: tl.constexpr):
    if ACT == 0:
        value = gate * tl.sigmoid(gate) * up
    elif ACT == 1:  # gelu_tanh: 0.5 g (1 + tanh(z)) = g sigmoid(2z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        value = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    else:
        g = tl.minimum(gate, limit)
        value = g * tl.sigmoid(alpha * g) * (tl.minimum(tl.maximum(up, -limit), limit) + 1.0)
    return value


@triton.jit
def _store_h(h, h_stride, hs, hs_stride, position, has, rows, rmask, ff, gate, up, gate_bias, up_bias, alpha, limit,
             DOWN_FMT: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr):
    """h of one pair, prepared for the down kernel (its order and scale), and its sums per GROUP rows. gate_bias,
    up_bias: the pair's expert's rows of the biases (BIAS)."""
    if BIAS:
        gate += gate_bias
        up += up_bias
    value = _activation(gate, up, alpha, limit, ACT)
    place, factor = read_place(rows, DOWN_FMT)
    tl.store(h + position.to(tl.int64) * h_stride + place, value * factor, mask=tl.where(has, rmask, False))
    group = tl.program_id(1) * (BR // GROUP) + tl.arange(0, BR // GROUP)
    total = tl.sum(tl.reshape(value, [BR // GROUP, GROUP]), axis=1)
    in_rows = group < ff // GROUP
    tl.store(hs + position.to(tl.int64) * hs_stride + group, total, mask=tl.where(has, in_rows, False))


@triton.jit
def _gate_up_kernel(
    x_gate, x_up, x_stride, x_sums, sums_stride, num_tokens, token_ids, expert_ids, num_pairs,
    gate_ptrs, up_ptrs, down_ptrs, num_experts, gate_row_bytes, up_row_bytes,
    h, h_stride, hs, hs_stride, ff, magic, fill_flags, host_gate_ptrs, host_up_ptrs, gate_biases, up_biases,
    alpha, limit,
    GATE_FMT: tl.constexpr, UP_FMT: tl.constexpr, DOWN_FMT: tl.constexpr, HIDDEN: tl.constexpr,
    BT: tl.constexpr, BR: tl.constexpr, WINDOW: tl.constexpr, GROUP: tl.constexpr,
    FILL: tl.constexpr, SPREAD: tl.constexpr, COPY: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    # program (pair position, block of BR rows of ff); only the pairs that lead a chunk of their group work
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    rmask = rows < ff
    safe_rows = tl.minimum(rows, ff - 1)  # loads stay inside the expert; stores are masked
    expert = tl.load(expert_ids + pid)
    is_valid, safe, gate_addr, up_addr, _down = expert_pointers(expert, num_experts, gate_ptrs, up_ptrs, down_ptrs)
    filling = False
    if FILL:
        filling = tl.load(fill_flags + safe) != 0  # in flight with the pointers
    spread = SPREAD
    if FILL:
        spread = SPREAD & (filling == 0)  # NOTE: a streamed expert is copied once, by the one program that computes it
    positions, is_member, rank, first, end = group_of(expert_ids, num_pairs, pid, expert, is_valid, spread, BT, WINDOW)
    gb, ub = 0.0, 0.0
    if BIAS:  # the expert's rows of the biases `[experts, ff]`
        gb = tl.load(gate_biases + safe.to(tl.int64) * ff + safe_rows)
        ub = tl.load(up_biases + safe.to(tl.int64) * ff + safe_rows)
    if FILL:
        if filling & (end > first):  # the leader of a streamed miss first copies the rows it computes
            row0 = tl.program_id(1) * BR
            fill_rows2(host_gate_ptrs, gate_addr, host_up_ptrs, up_addr, safe, row0, tl.minimum(ff - row0, BR),
                       gate_row_bytes, up_row_bytes, COPY)
            tl.debug_barrier()  # NOTE: the rows are in VRAM before any thread of the program reads them
    for start in range(first, end, BT):
        position, has = chunk_of(positions, is_member, rank, start, BT)
        token = tl.load(token_ids + position, mask=has, other=0)
        has = has & (token >= 0) & (token < num_tokens)
        p0, p1, p2, p3 = slots(position, BT)
        h0, h1, h2, h3 = slots(has.to(tl.int32), BT)
        t0, t1, t2, t3 = slots(tl.where(has, token, 0).to(tl.int64), BT)  # empty slots read row 0
        s0, s1, s2, s3 = x_sums + t0 * sums_stride, x_sums + t1 * sums_stride, x_sums + t2 * sums_stride, \
            x_sums + t3 * sums_stride
        if GATE_FMT == UP_FMT:
            g0, g1, g2, g3, u0, u1, u2, u3 = rows_dot(
                gate_addr, up_addr, safe_rows, gate_row_bytes,
                x_gate + t0 * x_stride, x_gate + t1 * x_stride, x_gate + t2 * x_stride, x_gate + t3 * x_stride,
                s0, s1, s2, s3, magic, GATE_FMT, HIDDEN, BT, True, BLOCKS)
        else:
            g0, g1, g2, g3, _, _, _, _ = rows_dot(
                gate_addr, gate_addr, safe_rows, gate_row_bytes,
                x_gate + t0 * x_stride, x_gate + t1 * x_stride, x_gate + t2 * x_stride, x_gate + t3 * x_stride,
                s0, s1, s2, s3, magic, GATE_FMT, HIDDEN, BT, False, BLOCKS)
            u0, u1, u2, u3, _, _, _, _ = rows_dot(
                up_addr, up_addr, safe_rows, up_row_bytes,
                x_up + t0 * x_stride, x_up + t1 * x_stride, x_up + t2 * x_stride, x_up + t3 * x_stride,
                s0, s1, s2, s3, magic, UP_FMT, HIDDEN, BT, False, BLOCKS)
        _store_h(h, h_stride, hs, hs_stride, p0, h0 > 0, rows, rmask, ff, g0, u0, gb, ub, alpha, limit,
                     DOWN_FMT, BR, GROUP, ACT, BIAS)
        if BT > 1:
            _store_h(h, h_stride, hs, hs_stride, p1, h1 > 0, rows, rmask, ff, g1, u1, gb, ub, alpha, limit,
                     DOWN_FMT, BR, GROUP, ACT, BIAS)
        if BT > 2:
            _store_h(h, h_stride, hs, hs_stride, p2, h2 > 0, rows, rmask, ff, g2, u2, gb, ub, alpha, limit,
                     DOWN_FMT, BR, GROUP, ACT, BIAS)
            _store_h(h, h_stride, hs, hs_stride, p3, h3 > 0, rows, rmask, ff, g3, u3, gb, ub, alpha, limit,
                     DOWN_FMT, BR, GROUP, ACT, BIAS)


def default_block_tokens(num_tokens: int, qtype: QType | None = None) -> int:
    """Pairs of one expert computed per pass over its weights (for a kernel of format `qtype`): enough to share a
    read, few enough that empty slots (most experts have 1-3 tokens of a step) waste little arithmetic. The float
    kernels, on the H200 (docs/kernels.md): 1 is best at 8 tokens, 2 at 32, 4 is worse at both. Q4_K on int8
    (`qdot.reads_int8`): 1 at every size, its second pass finding the weights in cache (H100, one Qwen3-30B-A3B Q4_K
    layer, `.ci/gpu-moe-gemm.py decode`: 199.8 against 238.2 us at 16 tokens, 372.1 against 422.2 at 32, with
    `default_blocks`)."""
    return 1 if num_tokens <= 8 or steps_super_blocks(qtype) else 2


def default_blocks(qtype: QType, num_tokens: int) -> int:
    """`rows_dot`'s blocks a step for gate/up (0: `qdot.step_blocks`' own). Q4_K on int8 reads 2 super-blocks a step
    (blocks = 16), 4 from 2 to 8 tokens: more loads in flight a thread. H100, one Qwen3-30B-A3B Q4_K layer
    (`.ci/gpu-moe-gemm.py decode`), one pair a pass, 1 super-block a step / 2 / 4: 1 token 26.0 / 24.2 / 26.0 us,
    8 tokens 134.5 (2 pairs a pass) / 115.3 / 110.9, 16 tokens 223.3 / 199.8, 32 tokens 463.3 / 372.1."""
    if not steps_super_blocks(qtype):
        return 0
    return 32 if 2 <= num_tokens <= 8 else 16


def warps_for(block_rows: int, qtype: QType | None = None) -> int:
    """Warps of a program of `block_rows` rows. The Q4_K/Q5_K tile puts 8 rows on a warp, one a thread; more warps
    would split a row's chunk. Q4_0's gate/up tile (`qtype`) takes twice as many: a Gemma 4 26B-A4B layer's gate/up
    at batch 1 took 22.5 us with 4 warps of 16 rows, 28.1 with 2 (H100, `.ci/gpu-expert-sweep.py`, docs/benchmarks.md);
    the other formats were slower with more."""
    warps = max(1, min(4, block_rows // 8))
    return 2 * warps if qtype == QType.Q4_0 else warps


def launch_gate_up(x_gate: torch.Tensor, x_up: torch.Tensor, x_sums: torch.Tensor, token_ids: torch.Tensor,
                   expert_ids: torch.Tensor, tables: ExpertTables, h: torch.Tensor, h_sums: torch.Tensor,
                   block_tokens: int | None = None, block_rows: int = 16, num_warps: int | None = None,
                   fill: Fill | None = None, blocks: int = 0, spread: bool = True) -> None:
    """h[p] = act(gate_e(x[t]), up_e(x[t])) for each computed pair p = (t, e) (the tables' math: its activation
    and gate/up biases), prepared for the down
    kernel (`prepare.launch_prepare`'s order and scale for the down format; natural order where the down format
    reads int8 planes, `qdot.reads_int8`), and h_sums[p] its natural sums per 16 rows (`qdot.GROUP`); rows of
    other pairs are left as they were. x_gate, x_up `[tokens, hidden]`:
    x prepared for the gate and up formats; x_sums `[tokens, hidden // 16]`; token_ids, expert_ids
    `[pairs]`; h float32 `[pairs, ff]`, h_sums `[pairs, ff // 16]`. block_tokens: 1, 2 or 4; blocks: the 32-block
    formats' blocks a step (`qdot.step_blocks`, 0: its default); spread: an expert's pairs over programs (`pairs`).
    With `fill`, the gate and up rows of experts whose flag is set are first copied from host memory
    (`ops.triton.stage`)."""
    if not (has_kernel(tables.gate_type) and has_kernel(tables.up_type)):
        raise ValueError(f"no gate/up kernel for {tables.gate_type.name}/{tables.up_type.name}")
    num_pairs, num_tokens, device = expert_ids.shape[0], x_gate.shape[0], tables.device
    for name, t in (("x_gate", x_gate), ("x_up", x_up)):
        check_rows(name, t, (num_tokens, tables.hidden), (torch.float32,), device)
        if t.stride(0) != x_gate.stride(0) or t.stride(0) % 4 or t.data_ptr() % 16:
            raise ValueError(f"{name}: rows must be 16-byte aligned with the stride of x_gate")
    check_rows("x_sums", x_sums, (num_tokens, tables.hidden // GROUP), (torch.float32,), device)
    check_vector("token_ids", token_ids, num_pairs, INDEX_DTYPES, device)
    check_vector("expert_ids", expert_ids, num_pairs, INDEX_DTYPES, device)
    check_rows("h", h, (num_pairs, tables.ff), (torch.float32,), device)
    check_rows("h_sums", h_sums, (num_pairs, tables.ff // GROUP), (torch.float32,), device)
    bt = block_tokens or default_block_tokens(num_tokens, tables.gate_type)
    if bt not in (1, 2, 4) or block_rows < GROUP or triton.next_power_of_2(block_rows) != block_rows:
        raise ValueError(f"need block_tokens in 1, 2, 4 and block_rows a power of two >= {GROUP}, "
                         f"got {bt}, {block_rows}")
    if tables.ff % GROUP:
        raise ValueError(f"ff must be a multiple of {GROUP}, got {tables.ff}")
    if fill is not None:
        fill.check(tables)
    if num_pairs == 0:
        return
    down_order = int(tables.down_type) if has_kernel(tables.down_type) and not reads_int8(tables.down_type) else -1
    source = fill.host if fill is not None else tables
    math = tables.math
    biases = math.gate_bias is not None or math.up_bias is not None
    gate_biases, up_biases = h, h  # any pointer: the kernel reads the biases only where BIAS is set
    if biases:
        gate_biases, up_biases = (bias_rows(b, tables.num_experts, tables.ff, device)
                                  for b in (math.gate_bias, math.up_bias))
    grid = (num_pairs, triton.cdiv(tables.ff, block_rows))
    _gate_up_kernel[grid](
        x_gate, x_up, x_gate.stride(0), x_sums, x_sums.stride(0), num_tokens, token_ids, expert_ids, num_pairs,
        tables.gate_ptrs, tables.up_ptrs, tables.down_ptrs, tables.num_experts,
        tables.gate_row_bytes, tables.up_row_bytes, h, h.stride(0), h_sums, h_sums.stride(0), tables.ff, MAGIC,
        fill.flags if fill is not None else expert_ids, source.gate_ptrs, source.up_ptrs, gate_biases, up_biases,
        math.alpha, math.limit,
        GATE_FMT=kernel_format(tables.gate_type, tables.planar), UP_FMT=kernel_format(tables.up_type, tables.planar),
        DOWN_FMT=down_order, HIDDEN=tables.hidden,
        BT=bt, BR=block_rows, WINDOW=window_for(num_pairs, bt, spread, fill is not None), GROUP=GROUP,
        FILL=fill is not None, SPREAD=spread, COPY=COPY_BLOCK, ACT=ACTIVATIONS[math.activation], BIAS=biases,
        BLOCKS=step_blocks(tables.hidden, blocks or default_blocks(tables.gate_type, num_tokens), tables.gate_type),
        num_warps=num_warps or warps_for(block_rows, tables.gate_type),
    )


def bias_rows(bias: torch.Tensor | None, num_rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A math's bias as the kernels read it: float32 `[num_rows, cols]` on the device, contiguous (zeros for a
    missing one where the other projection has its bias)."""
    if bias is None:
        return torch.zeros((num_rows, cols), dtype=torch.float32, device=device)
    check_rows("bias", bias, (num_rows, cols), (torch.float32,), device)
    return bias.contiguous()
