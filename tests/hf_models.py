"""Tiny random models built with HF transformers and written to GGUF with our writer, the way llama.cpp's
converter lays them out (tensor names, Q/K permutation for llama), so transformers is the reference."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.arch import get_arch
from engine.arch.base import LAYER_TENSORS, MLA, HParams, Routing, YaRN, sliding_pattern
from ops.quants import QType, dequantize, quantize
from tools.gguf_writer import TensorSpec, tensor_from_float, write_gguf

ARCH_OF_MODEL = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
                 "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss", "gemma4_text": "gemma4"}
# MLA heads (nope 16 + rope 16, values 24), a q LoRA for V3, experts in 4 groups of 2, one leading dense layer
MLA_SHAPE = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                 num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2, intermediate_size=96,
                 moe_intermediate_size=32)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707,
        "mscale_all_dim": 0.707, "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0}
# gpt-oss: YaRN without rounding the correction range, as its checkpoints set it
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
# Gemma 4 as 26B-A4B is built (full layers wider with fewer KV heads and keys as values, proportional rope,
# soft-capped logits, MoE beside every dense MLP) in 4 layers, the last reading layer 1's KV cache
GEMMA4_SHAPE = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                    sliding_window=8, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                    enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                    intermediate_size=96, num_kv_shared_layers=1,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


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
        # V2: softmax routing limited to the best group (by its best expert), scaled weights
        "deepseek_v2": lambda: tf.DeepseekV2Config(**{**SHAPE, "num_key_value_heads": 4, **MLA_SHAPE,
                                                      "n_group": 2, "topk_group": 1, "num_experts_per_tok": 3},
                                                   q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
                                                   topk_method="group_limited_greedy"),
        # V3: sigmoid routing with the correction bias, renormalised and scaled; YaRN rope
        "deepseek_v3": lambda: tf.DeepseekV3Config(**{**SHAPE, "num_key_value_heads": 4}, **MLA_SHAPE,
                                                   q_lora_rank=64, n_shared_experts=1, routed_scaling_factor=2.5,
                                                   norm_topk_prob=True, rope_parameters=dict(YARN)),
        # a window of 8 positions on layers 0 and 2 (40-token prompts slide it), sinks, biases everywhere
        "gpt_oss": lambda: tf.GptOssConfig(**SHAPE, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                                           intermediate_size=32, sliding_window=8,
                                           rope_parameters=dict(GPT_OSS_YARN)),
        # its per-layer shapes are drawn at construction: the overrides go in there
        "gemma4_text": lambda: tf.Gemma4TextConfig(**{**SHAPE, "num_hidden_layers": 4, **GEMMA4_SHAPE, **overrides}),
    }
    config = configs[model_type]()
    config.initializer_range = 0.08  # peaky logits: greedy choices are far from ties
    for key, value in overrides.items():
        setattr(config, key, value)
    if model_type == "gemma4_text":  # its prompt-slicing shortcut before shared-KV layers needs per-layer inputs
        config.output_hidden_states = True
    if model_type == "gpt_oss":  # its layer kinds were drawn for the default layer count
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(config.num_hidden_layers)]
    return config


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), torch_dtype=torch.float32)
    for name, p in model.named_parameters():  # norms start at 1.0; perturb them so they matter
        if "norm" in name or "layernorm" in name:
            p.data.add_(torch.randn_like(p) * 0.1)
    for name, p in model.named_parameters():  # gpt-oss's expert biases start at 0: make them count
        if name.endswith("_proj_bias"):
            p.data.add_(torch.randn_like(p) * 0.1)
    for name, b in model.named_buffers():  # DeepSeek-V3's correction bias starts at 0: make it move choices
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn_like(b) * 0.05)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # Gemma 4's scales start at 1
        if name.endswith(("router.scale", "per_expert_scale", "layer_scalar")):
            t.data.add_(torch.randn_like(t) * 0.2)
    return model.eval()


def hparams_of(model: Any) -> HParams:
    c = model.config
    if c.model_type == "gemma4_text":
        return gemma4_hparams(c)
    arch = get_arch(ARCH_OF_MODEL[c.model_type])
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    hp = HParams(
        arch=arch.name, num_layers=c.num_hidden_layers, hidden=c.hidden_size, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=head_dim, vocab_size=c.vocab_size,
        context_length=c.max_position_embeddings, rms_eps=c.rms_norm_eps, rope_theta=float(rope["rope_theta"]),
        num_experts=getattr(c, "num_experts", None) or c.num_local_experts, top_k=c.num_experts_per_tok,
        expert_ff=getattr(c, "moe_intermediate_size", None) or c.intermediate_size,
        dense_ff=c.intermediate_size, shared_ff=getattr(c, "shared_expert_intermediate_size", 0) or 0,
        norm_topk=bool(getattr(c, "norm_topk_prob", arch.norm_topk)),
    )
    if arch.name == "gpt-oss":
        return gpt_oss_hparams(hp, c, rope)
    return deepseek_hparams(hp, c, rope) if arch.name == "deepseek2" else hp


def gpt_oss_hparams(hp: HParams, c: Any, rope: dict[str, Any]) -> HParams:
    """The sliding layers (HF's layer_types) and the YaRN of an HF GptOss config."""
    sliding = tuple(i for i, kind in enumerate(c.layer_types) if kind == "sliding_attention")
    assert sliding == sliding_pattern(c.num_hidden_layers, 2), "the tiny config keeps gpt-oss's alternation"
    yarn = YaRN(rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"],
                truncate=rope.get("truncate", True)) if rope.get("rope_type") == "yarn" else None
    return replace(hp, sliding_window=c.sliding_window, sliding_layers=sliding, yarn=yarn)


def gemma4_hparams(c: Any) -> HParams:
    """Both kinds of layer of an HF Gemma4Text config: the full ones' heads, the sliding ones' in swa_*."""
    kinds = c.layer_types
    full, swa = (c.per_layer_config[kinds.index(kind)] for kind in ("full_attention", "sliding_attention"))
    rope = c.rope_parameters
    return HParams(
        arch="gemma4", num_layers=c.num_hidden_layers, hidden=c.hidden_size, num_heads=c.num_attention_heads,
        num_kv_heads=full.num_key_value_heads, head_dim=full.head_dim, vocab_size=c.vocab_size,
        context_length=c.max_position_embeddings, rms_eps=c.rms_norm_eps,
        rope_theta=rope["full_attention"]["rope_theta"], num_experts=c.num_experts or 0, top_k=c.top_k_experts or 0,
        expert_ff=c.moe_intermediate_size or 0, dense_ff=c.intermediate_size, norm_topk=True,
        sliding_window=c.sliding_window,
        sliding_layers=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
        swa_head_dim=swa.head_dim, swa_kv_heads=swa.num_key_value_heads,
        swa_rope_theta=rope["sliding_attention"]["rope_theta"], kv_shared_layers=c.num_kv_shared_layers,
        logit_softcap=c.final_logit_softcapping or 0.0)


def deepseek_hparams(hp: HParams, c: Any, rope: dict[str, Any]) -> HParams:
    """MLA shapes, routing and YaRN of an HF DeepseekV2/V3 config."""
    is_v3 = c.model_type == "deepseek_v3"
    grouped = is_v3 or c.topk_method == "group_limited_greedy"
    routing = Routing(gating="sigmoid" if is_v3 else "softmax", num_groups=c.n_group if grouped else 1,
                      topk_groups=c.topk_group if grouped else 1, group_score="top2" if is_v3 else "max",
                      scale=c.routed_scaling_factor)
    yarn = YaRN(rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"],
                attn_factor=1.0) if rope.get("rope_type") == "yarn" else None
    mla = MLA(c.q_lora_rank or 0, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
              rope.get("mscale_all_dim", 0.0) if yarn else 0.0)
    return replace(hp, num_kv_heads=1, head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim, mla=mla, yarn=yarn,
                   routing=routing, norm_topk=bool(is_v3 and c.norm_topk_prob),
                   shared_ff=c.moe_intermediate_size * c.n_shared_experts, num_dense_layers=c.first_k_dense_replace)


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter permutes llama Q/K rows so interleaved-pair RoPE equals HF's rotate-half."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, float tensor) pairs in llama.cpp's layout."""
    c, sd = model.config, model.state_dict()
    if c.model_type == "gemma4_text":
        yield from gemma4_tensors(c, sd)
        return
    is_llama = c.model_type == "mixtral"
    ffn_norm = LAYER_TENSORS[get_arch(ARCH_OF_MODEL[c.model_type]).ffn_norm]
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        yield b + "attn_norm.weight", sd[p + "input_layernorm.weight"]
        yield b + ffn_norm, sd[p + "post_attention_layernorm.weight"]
        if c.model_type.startswith("deepseek"):
            yield from _mla_tensors(c, sd, p, b)
        else:
            yield from _attention_tensors(c, sd, p, b, is_llama)
        yield from (_gpt_oss_experts(sd, p, b) if c.model_type == "gpt_oss" else _ffn_tensors(sd, p, b))
    yield "output_norm.weight", sd["model.norm.weight"]
    yield "output.weight", sd["lm_head.weight"]


def _attention_tensors(c: Any, sd: dict[str, torch.Tensor], p: str, b: str,
                       is_llama: bool) -> Iterator[tuple[str, torch.Tensor]]:
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
    if f"{p}self_attn.sinks" in sd:
        yield f"{b}attn_sinks.weight", sd[f"{p}self_attn.sinks"]


GEMMA4_NAMES = {  # HF name within a layer -> GGUF name within a block, as llama.cpp's converter maps them
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
}


def gemma4_tensors(c: Any, sd: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma 4 as llama.cpp's converter writes it: merged gate/up experts, the router's per-expert scale as the
    experts' down scale, tied output, and `rope_freqs` making the full layers' rope proportional."""
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    full = c.per_layer_config[c.layer_types.index("full_attention")]
    rope = c.rope_parameters["full_attention"]
    rotated = int(full.head_dim * rope["partial_rotary_factor"] / 2)
    yield "rope_freqs.weight", torch.tensor([1.0] * rotated + [1e30] * (full.head_dim // 2 - rotated))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, name in GEMMA4_NAMES.items():
            if p + hf in sd:
                yield f"blk.{i}.{name}", sd[p + hf]
    yield "output_norm.weight", sd["model.norm.weight"]


def _gpt_oss_experts(sd: dict[str, torch.Tensor], p: str, b: str) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's router and experts as llama.cpp's converter writes them: gate and up de-interleaved from
    gate_up_proj (x @ gate_up_proj[e], columns gate, up, gate, up, ...), matrices as [out, in] rows."""
    m = p + "mlp."
    yield b + "ffn_gate_inp.weight", sd[m + "router.weight"]
    yield b + "ffn_gate_inp.bias", sd[m + "router.bias"]
    gate_up, gate_up_bias = sd[m + "experts.gate_up_proj"].transpose(1, 2), sd[m + "experts.gate_up_proj_bias"]
    yield b + "ffn_gate_exps.weight", gate_up[:, ::2]
    yield b + "ffn_up_exps.weight", gate_up[:, 1::2]
    yield b + "ffn_down_exps.weight", sd[m + "experts.down_proj"].transpose(1, 2)
    yield b + "ffn_gate_exps.bias", gate_up_bias[:, ::2]
    yield b + "ffn_up_exps.bias", gate_up_bias[:, 1::2]
    yield b + "ffn_down_exps.bias", sd[m + "experts.down_proj_bias"]


def _mla_tensors(c: Any, sd: dict[str, torch.Tensor], p: str, b: str) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek's attention as llama.cpp's converter writes it: kv_b_proj split into k_b (transposed) and v_b."""
    a = p + "self_attn."
    names = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
             "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}
    for hf, name in names.items():
        if f"{a}{hf}.weight" in sd:
            yield f"{b}{name}.weight", sd[f"{a}{hf}.weight"]
    kv_b = sd[a + "kv_b_proj.weight"].view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
    k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
    yield b + "attn_k_b.weight", k_b.transpose(1, 2)
    yield b + "attn_v_b.weight", v_b


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
    if p + "mlp.gate.e_score_correction_bias" in sd:
        yield b + "exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"]
    for shared in ("shared_expert", "shared_experts"):
        if f"{p}mlp.{shared}.gate_proj.weight" in sd:
            for proj in ("gate", "up", "down"):
                yield f"{b}ffn_{proj}_shexp.weight", sd[f"{p}mlp.{shared}.{proj}_proj.weight"]
    if p + "mlp.shared_expert_gate.weight" in sd:
        yield b + "ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"][0]


def qtype_for(name: str, qtype: QType, expert_qtype: QType | None = None) -> QType:
    """Matrices in `qtype` (routed experts in `expert_qtype` if given); norms, biases, sinks and routers stay
    F32 as llama.cpp's quantizer keeps them."""
    small = name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", ".bias", "ffn_gate_inp.weight",
                           "ffn_gate_inp_shexp.weight"))
    small = small or name.endswith(("attn_k_b.weight", "attn_v_b.weight"))  # 16- and 32-column rows: no blocks
    small = small or name.endswith(("attn_sinks.weight", ".scale", "layer_output_scale.weight", "rope_freqs.weight"))
    if small:
        return QType.F32
    return expert_qtype if expert_qtype is not None and name.endswith("_exps.weight") else qtype


def write_hf_gguf(model: Any, path: Path, qtype: QType = QType.F32, metadata: dict[str, Any] | None = None,
                  expert_qtype: QType | None = None) -> Path:
    hp = hparams_of(model)
    md = {**get_arch(hp.arch).metadata(hp), **(metadata or {})}
    specs: list[TensorSpec] = [tensor_from_float(n, t, qtype_for(n, qtype, expert_qtype))
                               for n, t in gguf_tensors(model)]
    write_gguf(path, hp.arch, md, specs)
    return path


def round_trip_weights(model: Any, qtype: QType, experts_only: bool = False) -> None:
    """Replace the model's weights (or only its routed experts') by their quantize->dequantize round trip
    (what the GGUF holds)."""
    sd = model.state_dict()
    with torch.no_grad():
        for name, tensor in sd.items():
            is_router = name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight",
                                       "router.proj.weight"))
            is_kept = is_router or name.endswith("kv_b_proj.weight")  # the GGUF's k_b and v_b stay F32
            is_matrix = tensor.dim() >= 2 and not name.endswith("bias") and "norm" not in name and not is_kept
            if is_matrix and (".experts." in name or not experts_only):
                # gpt-oss keeps its experts as [in, out]: the GGUF's rows are their columns
                rows = tensor.transpose(-1, -2) if name.endswith(("gate_up_proj", "experts.down_proj")) \
                    and model.config.model_type == "gpt_oss" else tensor
                rows.copy_(dequantize(quantize(rows.contiguous(), qtype), qtype, rows.shape[-1]).reshape(rows.shape))
