"""The decode expert kernels' inner loops as the H100/H200 would run them, counted on a machine without a GPU: each
format's gate/up kernel (`ops.triton.gate_up`, both matrices, batch 1) compiled for sm90 as the engine launches it (16
rows, the launcher's warps, `qdot.step_blocks`' blocks a step), disassembled with the nvdisasm Triton ships, and each
loop's instructions counted by kind, with the instructions per weight of the loop that reads the weights (the loop
with the most global loads). A static count: what a change to `ops/triton/qdot.py` costs or saves per weight before a
lease times it.
BLOCKS=N sets the 32-block formats' blocks a step. Needs
Triton's CUDA backend (not its interpreter); CPU CI checks the loops' spills with it (tests/ops/test_triton_compile.py).
With PREFILL=1, the prefill's tensor-core GEMMs instead (`ops.triton.moe_gemm`, gate/up and down, its default tiles at
32 pairs a tile): the same counts for their K loops. With PLANAR=1, MXFP4 as a resident bank holds it
(`ops.bank.to_planar`).
Usage: [BLOCKS=N] [PREFILL=1] [PLANAR=1] python -m tools.sass_loops [FORMAT ...]  (default: every kernel format)"""

import collections
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped, import-not-found, unused-ignore]
from triton.compiler import ASTSource  # type: ignore[import-untyped, import-not-found, unused-ignore]

from ops import quants
from ops.quants import QType
from ops.triton import moe_gemm
from ops.triton.down import _down_kernel
from ops.triton.gate_up import ACTIVATIONS, _gate_up_kernel, default_blocks, warps_for
from ops.triton.qdot import KERNEL_TYPES, kernel_format, step_blocks, steps_super_blocks

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
ROWS, DOWN_ROWS = 16, 32
BLOCKS = int(os.environ.get("BLOCKS", "0"))  # blocks of 32 a step of the 32-block formats (0: the default)
# each format on a preset's shape: hidden and ff sizes, expert math (the gpt-oss one with biases)
SHAPES = {QType.Q4_K: (2048, 768, "silu"), QType.Q5_K: (2048, 768, "silu"), QType.Q6_K: (2048, 768, "silu"),
          QType.Q8_0: (2048, 1408, "silu"), QType.Q4_0: (2816, 704, "gelu"), QType.MXFP4: (2880, 2880, "swiglu_oai")}
SM90 = GPUTarget("cuda", 90, 32)
POINTER_DTYPES = {"fill_flags": "*i8", "x": "*bf16"}  # the rest: float32 data, int64 ids and address tables
INT64 = {"token_ids", "expert_ids", "gate_ptrs", "up_ptrs", "down_ptrs", "host_gate_ptrs", "host_up_ptrs",
         "host_down_ptrs"}
FLOAT32 = {"x_gate", "x_up", "x_sums", "h", "hs", "gate_biases", "up_biases", "down_biases", "weights", "y", "out",
           "sums"}
SCALARS = {"alpha": "fp32", "limit": "fp32"}  # the expert math's (clamped SwiGLU)
PREFILL_TYPES = {"x": "*bf16", "h": "*bf16", "gate": "*u8", "up": "*u8", "down": "*u8", "order": "*i32", "ends": "*i32",
                 "tile_ends": "*i32", "by_token": "*i32", "token_ends": "*i32", "key": "*i32", "gate_bias": "*fp32",
                 "up_bias": "*fp32", "down_bias": "*fp32", **SCALARS}  # `ops.triton.moe_gemm`'s arguments


def compile_sm90(kernel: triton.JITFunction, types: Mapping[str, str], constexprs: Mapping[str, object],
                 num_warps: int = 2, values: Mapping[str, int] | None = None, num_stages: int = 3) -> Any:
    """The kernel compiled for sm90 (no GPU needed). `types`: the arguments whose types differ from the defaults
    above (by name); the rest are i32. Specialized as a launch specializes it: every pointer 16-byte aligned (torch's
    allocations are), and each integer of `values` (its value at the launch modelled) that is a multiple of 16 known
    to be one (NOTE: without this, byte loads that a launch compiles to 16-byte copies stay byte loads)."""
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in types:
            return types[name]
        return POINTER_DTYPES.get(name) or ("*i64" if name in INT64 else "*fp32" if name in FLOAT32 else "i32")

    signature = {name: kind(name) for name in kernel.arg_names}
    aligned = [name for name, sort in signature.items()
               if sort.startswith("*") or (values or {}).get(name, 1) % 16 == 0]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                       attrs={(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    return triton.compile(source, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})


def compile_sass(kernel: triton.JITFunction, constexprs: Mapping[str, object], warps: int,
                 values: Mapping[str, int], types: Mapping[str, str] = SCALARS, num_stages: int = 3) -> str:
    compiled = compile_sm90(kernel, types, constexprs, warps, values, num_stages)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([NVDISASM, "-c", cubin.name], capture_output=True, text=True, check=True).stdout


def gate_up_blocks(qtype: QType) -> int:
    """The gate/up launch's blocks a step at batch 1."""
    hidden = SHAPES[qtype][0]
    return step_blocks(hidden, BLOCKS or default_blocks(qtype, 1), qtype)


def step_weights(qtype: QType, blocks: int) -> int:
    """Weights of a row a step: `blocks` of 32 (Q4_K on int8: whole super-blocks), a super-block (Q5_K, Q6_K)."""
    if steps_super_blocks(qtype):
        return 256 * max(1, blocks // 8)
    return 256 if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K) else 32 * blocks


def launch_values(qtype: QType, top_k: int = 8) -> dict[str, int]:
    """The integers the decode and prefill launches pass at batch 1 (one expert matrix's strides, row bytes, sizes)."""
    hidden, ff, _ = SHAPES[qtype]
    gate_row, down_row = quants.row_bytes(qtype, hidden), quants.row_bytes(qtype, ff)
    return dict(x_stride=hidden, sums_stride=hidden // 16, num_tokens=1, num_pairs=top_k, num_experts=128,
                gate_row_bytes=gate_row, up_row_bytes=gate_row, down_row_bytes=down_row, h_stride=ff,
                hs_stride=ff // 16, ff=ff, hidden=hidden, y_stride=hidden,
                gate_row=gate_row, up_row=gate_row, down_row=down_row)


def kernels(qtype: QType, planar: bool = False) -> list[tuple[str, str, int]]:
    """(kernel, its SASS, the weights a thread reads a step); planar: MXFP4 as a resident bank holds it."""
    hidden, ff, activation = SHAPES[qtype]
    values = launch_values(qtype)
    common = dict(WINDOW=64, SPREAD=True, COPY=1024, BIAS=activation == "swiglu_oai", BT=1)
    fmt = kernel_format(qtype, planar)
    gate_up = dict(GATE_FMT=fmt, UP_FMT=fmt, DOWN_FMT=int(qtype), HIDDEN=hidden, BR=ROWS, GROUP=16,
                   ACT=ACTIVATIONS[activation], BLOCKS=gate_up_blocks(qtype), FILL=not planar, **common)
    down_blocks = step_blocks(ff, BLOCKS, qtype)
    down = dict(DOWN_FMT=fmt, FF=ff, BR=DOWN_ROWS, BLOCKS=down_blocks, FILL=not planar, **common)
    up_warps, down_warps = warps_for(ROWS, qtype), warps_for(DOWN_ROWS)
    return [("gate/up", compile_sass(_gate_up_kernel, gate_up, up_warps, values),
             ROWS * step_weights(qtype, gate_up_blocks(qtype)) * 2 // (32 * up_warps)),
            ("down", compile_sass(_down_kernel, down, down_warps, values),
             DOWN_ROWS * step_weights(qtype, down_blocks) // (32 * down_warps))]


def prefill_kernels(qtype: QType, planar: bool = False) -> list[tuple[str, str, int]]:
    """`kernels` for the prefill's GEMMs (`ops.triton.moe_gemm`, its default tiles, 32 pairs a tile)."""
    _, _, activation = SHAPES[qtype]
    config, biases = moe_gemm.MoeGemmConfig(), activation == "swiglu_oai"
    hidden, ff, _ = SHAPES[qtype]
    up_super, down_super = moe_gemm.whole_super_blocks(qtype, hidden), moe_gemm.whole_super_blocks(qtype, ff)
    tiles = dict(BM=32, BN=config.block_n, E_POW2=128, INTERPRET=False)
    fmt = kernel_format(qtype, planar)
    gate_up = dict(GATE_FMT=fmt, UP_FMT=fmt, ACT=ACTIVATIONS[activation], GATE_BIAS=biases,
                   UP_BIAS=biases, SUPER=up_super,
                   BK=32 if up_super else config.block_k, **tiles)
    down = dict(BIAS=biases, DOWN_FMT=fmt, SUPER=down_super,
                BK=32 if down_super else config.block_k, **tiles)

    def weights(whole: bool) -> int:  # a thread reads a step: a super-block's 256 columns, or block_k
        return config.block_n * (256 if whole else config.block_k) // (32 * config.num_warps)
    values, warps, stages = launch_values(qtype), config.num_warps, config.num_stages
    return [("prefill gate/up", compile_sass(moe_gemm._gate_up_kernel, gate_up, warps, values, PREFILL_TYPES, stages),
             2 * weights(up_super)),
            ("prefill down", compile_sass(moe_gemm._down_kernel, down, warps, values, PREFILL_TYPES, stages),
             weights(down_super))]


def loops(text: str) -> list[list[str]]:
    """The instructions of each innermost loop (a backward branch's span holding no other)."""
    code: list[tuple[int, str, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(label.group(1))
        elif op := re.search(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line):
            address = int(op.group(1), 16)
            labels |= dict.fromkeys(pending, address)
            pending = []
            code.append((address, op.group(2), op.group(3)))
    spans = []
    for address, name, rest in code:
        target = re.search(r"(\.L_x_\d+)", rest)
        if name.startswith("BRA") and target and labels.get(target.group(1), address) < address:
            spans.append((labels[target.group(1)], address))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [[n for x, n, _ in code if a <= x <= b] for a, b in inner]


@dataclass(frozen=True)
class Loop:
    qtype: QType
    kernel: str  # gate/up | down
    instructions: int  # a step of the loop that reads the weights
    weights: int  # a thread reads a step
    kinds: collections.Counter[str]

    @property
    def local_loads(self) -> int:
        """Spilled registers read back in the loop."""
        return self.kinds["LDL"]

    def __str__(self) -> str:
        return (f"{self.qtype.name} {self.kernel}: {self.instructions} instructions a step for {self.weights} weights "
                f"a thread, {self.instructions / self.weights:.1f} a weight, {self.local_loads} local loads; "
                f"{dict(self.kinds.most_common(8))}")


def weight_loops(qtype: QType, prefill: bool = False, planar: bool = False) -> list[Loop]:
    """The format's gate/up and down loops that read the weights (the innermost loop with the most global loads), of
    the decode kernels or (`prefill`) the prefill's GEMMs; `planar`: MXFP4 as `ops.bank.to_planar` holds it."""
    found = []
    for name, text, per_thread in (prefill_kernels if prefill else kernels)(qtype, planar):
        loop = max(loops(text), key=lambda s: sum(n.startswith("LDG") for n in s))
        found.append(Loop(qtype, name, len(loop), per_thread, collections.Counter(n.split(".")[0] for n in loop)))
    return found


def main() -> None:
    for qtype in [QType.__members__[n] for n in sys.argv[1:]] or KERNEL_TYPES:
        for loop in weight_loops(qtype, os.environ.get("PREFILL") == "1", os.environ.get("PLANAR") == "1"):
            print(loop)


if __name__ == "__main__":
    main()
