"""Tiny random models built with HF transformers and written to GGUF with our writer, the way llama.cpp's
converter lays them out (tensor names, Q/K permutation for llama), so transformers is the reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.arch import get_arch
from engine.arch.base import HParams
from ops.quants import QType, dequantize, quantize
from tools.gguf_writer import TensorSpec, tensor_from_float, write_gguf

ARCH_OF_MODEL = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def tiny_config(model_type: str, **overrides: Any) -> Any:
    import transformers as tf

    experts = dict(num_experts=8, num_experts_per_tok=2)
    configs = {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SHAPE, **experts, head_dim=32, intermediate_size=96,
                                               moe_intermediate_size=32, norm_topk_prob=True,
                                               mlp_only_layers=[1]),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**SHAPE, **experts, intermediate_size=96, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64),
        "mixtral": lambda: tf.MixtralConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2,
                                            intermediate_size=32),
        "olmoe": lambda: tf.OlmoeConfig(**SHAPE, **experts, intermediate_size=32),
    }
    config = configs[model_type]()
    config.initializer_range = 0.08  # peaky logits: greedy choices are far from ties
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), torch_dtype=torch.float32)
    for name, p in model.named_parameters():  # norms start at 1.0; perturb them so they matter
        if "norm" in name or "layernorm" in name:
            p.data.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def hparams_of(model: Any) -> HParams:
    c = model.config
    arch = get_arch(ARCH_OF_MODEL[c.model_type])
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return HParams(
        arch=arch.name, num_layers=c.num_hidden_layers, hidden=c.hidden_size, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=head_dim, vocab_size=c.vocab_size,
        context_length=c.max_position_embeddings, rms_eps=c.rms_norm_eps, rope_theta=float(rope["rope_theta"]),
        num_experts=getattr(c, "num_experts", None) or c.num_local_experts, top_k=c.num_experts_per_tok,
        expert_ff=getattr(c, "moe_intermediate_size", None) or c.intermediate_size,
        dense_ff=c.intermediate_size, shared_ff=getattr(c, "shared_expert_intermediate_size", 0) or 0,
        norm_topk=bool(getattr(c, "norm_topk_prob", arch.norm_topk)),
    )


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter permutes llama Q/K rows so interleaved-pair RoPE equals HF's rotate-half."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, float tensor) pairs in llama.cpp's layout."""
    c, sd = model.config, model.state_dict()
    is_llama = c.model_type == "mixtral"
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        yield b + "attn_norm.weight", sd[p + "input_layernorm.weight"]
        yield b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            w = sd[f"{p}self_attn.{proj}_proj.weight"]
            if is_llama and proj in "qk":
                w = permute_qk(w, c.num_attention_heads if proj == "q" else c.num_key_value_heads)
            yield f"{b}{name}.weight", w
            if f"{p}self_attn.{proj}_proj.bias" in sd:
                yield f"{b}{name}.bias", sd[f"{p}self_attn.{proj}_proj.bias"]
        for norm in ("q_norm", "k_norm"):
            if f"{p}self_attn.{norm}.weight" in sd:
                yield f"{b}attn_{norm}.weight", sd[f"{p}self_attn.{norm}.weight"]
        yield from _ffn_tensors(sd, p, b)
    yield "output_norm.weight", sd["model.norm.weight"]
    yield "output.weight", sd["lm_head.weight"]


def _ffn_tensors(sd: dict[str, torch.Tensor], p: str, b: str) -> Iterator[tuple[str, torch.Tensor]]:
    if p + "mlp.gate_proj.weight" in sd:  # a dense layer
        for proj in ("gate", "up", "down"):
            yield f"{b}ffn_{proj}.weight", sd[f"{p}mlp.{proj}_proj.weight"]
        return
    yield b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"]
    gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)  # [experts, 2 * ff, hidden]
    yield b + "ffn_gate_exps.weight", gate
    yield b + "ffn_up_exps.weight", up
    yield b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"]
    if p + "mlp.shared_expert.gate_proj.weight" in sd:
        for proj in ("gate", "up", "down"):
            yield f"{b}ffn_{proj}_shexp.weight", sd[f"{p}mlp.shared_expert.{proj}_proj.weight"]
        yield b + "ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"][0]


def qtype_for(name: str, qtype: QType) -> QType:
    """Matrices in `qtype`; norms, biases and routers stay F32 as llama.cpp's quantizer keeps them."""
    small = name.endswith(("norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
    return QType.F32 if small else qtype


def write_hf_gguf(model: Any, path: Path, qtype: QType = QType.F32, metadata: dict[str, Any] | None = None) -> Path:
    hp = hparams_of(model)
    md = {**get_arch(hp.arch).metadata(hp), **(metadata or {})}
    specs: list[TensorSpec] = [tensor_from_float(n, t, qtype_for(n, qtype)) for n, t in gguf_tensors(model)]
    write_gguf(path, hp.arch, md, specs)
    return path


def round_trip_weights(model: Any, qtype: QType) -> None:
    """Replace the model's weights by their quantize->dequantize round trip (what the GGUF holds)."""
    sd = model.state_dict()
    with torch.no_grad():
        for name, tensor in sd.items():
            is_router = name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
            if tensor.dim() >= 2 and "norm" not in name and not is_router:
                tensor.copy_(dequantize(quantize(tensor, qtype), qtype, tensor.shape[-1]).reshape(tensor.shape))
