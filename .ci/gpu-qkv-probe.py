"""Device against CPU logits over a quantized KV cache, per prompt, captured and eager (CUDA): the teacher-forced
steps of `test_quantized_kv_cache_beside_windows_sinks_and_wide_heads` (tests/engine/test_gpu_engine.py) for bf16,
q8_0 and q8_0/q4_0 caches, to tell a capture's difference from the device's arithmetic.
Usage: python3 .ci/gpu-qkv-probe.py PRESET... (e.g. gemma4-tiny gpt-oss-tiny)"""

import sys
import tempfile
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from tests.engine.test_gpu_engine import rel_error, teacher_forced_logits
from tools.embedded_vocab import build_vocab
from tools.synth import PRESETS, write_synth

PROMPTS = [[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58], [2, 300, 301]]
RUNS = (("cpu", False), ("cuda", True), ("cuda", False)) if torch.cuda.is_available() else (("cpu", False),)
folder = Path(tempfile.mkdtemp())
for name in sys.argv[1:]:
    path = folder / f"{name}.gguf"
    write_synth(path, PRESETS[name], build_vocab(PRESETS[name].vocab), seed=5)  # the tests' file (tests/conftest.py)
    for k_type, v_type in (("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "q4_0")):
        logits = {}
        for device, graphs in RUNS:
            cfg = EngineConfig(model=ModelConfig(str(path), device=device, dtype="float32", max_context=64,
                                                 cuda_graphs=graphs, cache_type_k=k_type, cache_type_v=v_type),
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
            logits[(device, graphs)] = teacher_forced_logits(LLMEngine(cfg), PROMPTS, 24)
        for run in RUNS[1:]:
            steps = [[rel_error(d[p:p + 1], c[p:p + 1]) for d, c in zip(logits[run], logits[RUNS[0]])]
                     for p in range(len(PROMPTS))]
            print(f"{name} K {k_type} V {v_type} {'captured' if run[1] else 'eager'}: worst relative error a step "
                  + ", ".join(f"{max(e):.2e} (prompt of {len(q)})" for e, q in zip(steps, PROMPTS)), flush=True)
            for errors, prompt in zip(steps, PROMPTS):
                print(f"   prompt of {len(prompt)}, each step: " + " ".join(f"{e:.1e}" for e in errors), flush=True)
