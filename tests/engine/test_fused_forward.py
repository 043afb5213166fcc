"""The forward pass through the fused kernels (`ops.fused` on CUDA: norms with the residual add and a block's end, q/k
norm + rope, router top-k, decode attention, the KV write) equals the torch path, prefill and decode steps
alike, with an unquantized KV cache and with q8_0 K and q4_0 V (the same quantizer in both paths,
`tests/ops/test_triton_attention.py` checks it bit for bit).

Without CUDA the kernels run under Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be
set before Triton compiles anything); on CUDA the gpu tests of tests/engine/test_gpu_engine.py run
the same kernels inside the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the fused kernels need it")

HERE = Path(__file__).resolve()


def teacher_forced_logits(path: str, k_type: str, v_type: str) -> torch.Tensor:
    """Two prompts prefilled, then three decode steps of fixed tokens: `[4, seqs, vocab]`."""
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.model import SeqSpan

    engine = LLMEngine(EngineConfig(model=ModelConfig(path, device="cpu", max_context=64, cuda_graphs=False,
                                                      cache_type_k=k_type, cache_type_v=v_type),
                                    cache=CacheConfig(), scheduler=SchedulerConfig(max_num_seqs=4,
                                                                                   max_num_batched_tokens=64)))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    steps: list[torch.Tensor] = []

    def run(spans: list[SeqSpan], tokens: list[list[int]]) -> None:
        keys = [str(i) for i, t in enumerate(tokens) for _ in t]
        engine.forward(spans, tokens, keys, lambda logits: steps.append(logits.float()))

    run([SeqSpan(i, 0, len(p)) for i, p in enumerate(prompts)], prompts)
    for t in range(3):
        run([SeqSpan(i, len(p) + t, 1) for i, p in enumerate(prompts)], [[7 + t]] * len(prompts))
    return torch.stack(steps)


# bf16 on every layout; q8_0 K and q4_0 V on the standard one, and beside sliding windows and sinks
# (gpt-oss) and per-layer head sizes (gemma4), whose decode attention runs the same kernel with its window and sinks
CASES = [("qwen3moe", "bf16", "bf16"), ("qwen3moe", "q8_0", "q4_0"), ("deepseek2-tiny", "bf16", "bf16"),
         ("gpt-oss-tiny", "bf16", "bf16"), ("gpt-oss-tiny", "q8_0", "q4_0"), ("gemma4-tiny", "bf16", "bf16"),
         ("gemma4-tiny", "q8_0", "q4_0")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the gpu tests run the kernels")
@pytest.mark.parametrize(("model", "k_type", "v_type"), CASES, ids=["-".join(c) for c in CASES])
def test_fused_forward_equals_the_torch_forward(small_moe_gguf: Path, preset_gguf: Callable[[str], Path],
                                                tmp_path: Path, model: str, k_type: str, v_type: str) -> None:
    path = small_moe_gguf if model == "qwen3moe" else preset_gguf(model)
    outputs = {}
    for name, interpret in (("torch", "0"), ("fused", "1")):
        env = dict(os.environ, TRITON_INTERPRET=interpret, PYTHONPATH=str(HERE.parents[2]))
        out = tmp_path / f"{name}.pt"
        result = subprocess.run([sys.executable, str(HERE), str(path), str(out), k_type, v_type], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        outputs[name] = torch.load(out)
    torch_path, fused = outputs["torch"], outputs["fused"]
    error = (fused - torch_path).norm() / torch_path.norm()
    # float32, summation order only; the native expert kernel's two-plane int8 activations round the
    # slightly different inputs apart: measured 1.4e-5 on deepseek2-tiny and 9.2e-5 on gemma4-tiny (whose
    # GELU experts and soft-capped logits amplify it; 5e-7 with the reference experts).
    # A quantized cache turns those last-bit differences of k and v into a whole quantization step where a
    # value lies on a rounding boundary (measured 1.6e-3); a wrong scale, block or nibble gives errors of
    # order 0.1 to 1
    bound = 2e-4 if (k_type, v_type) == ("bf16", "bf16") else 1e-2
    assert error < bound, f"relative error {error:.1e}"


if __name__ == "__main__":
    torch.save(teacher_forced_logits(sys.argv[1], sys.argv[3], sys.argv[4]), sys.argv[2])
