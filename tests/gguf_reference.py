"""An independent float reference of a GGUF model: every tensor dequantized by gguf-py's numpy code
(`gguf.quants.dequantize`, the Python twin of ggml's C), loaded into HF transformers' model of the
architecture. Nothing of moecache's loader, dequantization or forward is used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

CONFIGS = {"llama": "MixtralConfig", "qwen3moe": "Qwen3MoeConfig"}


def read_tensors(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Metadata and every tensor as float32 in torch order (`[rows, cols]`)."""
    reader = GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        values = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        tensors[t.name] = torch.from_numpy(values.copy()).reshape(tuple(reversed(t.shape.tolist())))
    return metadata, tensors


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's converter permutation of llama Q/K rows (interleaved pairs -> halves)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(metadata: dict[str, Any], vocab_size: int) -> Any:
    import transformers as tf

    arch = metadata["general.architecture"]
    k = lambda key: metadata[f"{arch}.{key}"]  # noqa: E731
    common = dict(vocab_size=vocab_size, hidden_size=k("embedding_length"), num_hidden_layers=k("block_count"),
                  num_attention_heads=k("attention.head_count"), num_key_value_heads=k("attention.head_count_kv"),
                  head_dim=k("attention.key_length"), rms_norm_eps=k("attention.layer_norm_rms_epsilon"),
                  rope_theta=k("rope.freq_base"), max_position_embeddings=k("context_length"),
                  num_experts_per_tok=k("expert_used_count"), tie_word_embeddings=False)
    if arch == "llama":
        return tf.MixtralConfig(**common, num_local_experts=k("expert_count"),
                                intermediate_size=k("expert_feed_forward_length"))
    return tf.Qwen3MoeConfig(**common, num_experts=k("expert_count"), intermediate_size=k("feed_forward_length"),
                             moe_intermediate_size=k("expert_feed_forward_length"), norm_topk_prob=True,
                             mlp_only_layers=[])


def hf_state_dict(arch: str, config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": tensors["token_embd.weight"], "model.norm.weight": tensors["output_norm.weight"],
          "lm_head.weight": tensors["output.weight"]}
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = tensors[b + "attn_norm.weight"]
        sd[p + "post_attention_layernorm.weight"] = tensors[b + "ffn_norm.weight"]
        for proj, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            w = tensors[f"{b}{name}.weight"]
            if arch == "llama" and proj in "qk":
                w = unpermute_qk(w, config.num_attention_heads if proj == "q" else config.num_key_value_heads)
            sd[f"{p}self_attn.{proj}_proj.weight"] = w
        for norm in ("q_norm", "k_norm"):
            if f"{b}attn_{norm}.weight" in tensors:
                sd[f"{p}self_attn.{norm}.weight"] = tensors[f"{b}attn_{norm}.weight"]
        sd[p + "mlp.gate.weight"] = tensors[b + "ffn_gate_inp.weight"]
        sd[p + "mlp.experts.gate_up_proj"] = torch.cat([tensors[b + "ffn_gate_exps.weight"],
                                                        tensors[b + "ffn_up_exps.weight"]], dim=1)
        sd[p + "mlp.experts.down_proj"] = tensors[b + "ffn_down_exps.weight"]
    return sd


def reference_model(path: Path) -> Any:
    """HF transformers' model (float32, eval) holding the GGUF file's dequantized weights."""
    import transformers as tf

    metadata, tensors = read_tensors(path)
    arch = metadata["general.architecture"]
    config = hf_config(metadata, tensors["token_embd.weight"].shape[0])
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(hf_state_dict(arch, config, tensors), strict=True)
    return model.eval()


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position, float32 `[len(ids), vocab]`."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
