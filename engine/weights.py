"""Model weights from a GGUF file: dense tensors dequantized to the compute dtype on the device (the matrices that
are only multiplied by kept as Q8_0 where the file has them so and the loader is asked to: `ops.qweight`), routed
experts left as raw GGUF bytes in the file's memory map (placement happens in the expert cache)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.arch import ArchSpec, HParams, deepseek2, gemma4, get_arch
from engine.arch.base import GLOBAL_TENSORS, layer_tensor
from engine.arch.deepseek2 import MLAttention
from engine.arch.gemma4 import GemmaAttention, Sandwich
from engine.gguf.reader import GGUFError, GGUFFile, TensorInfo
from engine.layer_split import LayerSplit
from ops.bank import ExpertWeights, split_gate_up
from ops.quants import QType, dequantize, format_of
from ops.qweight import Matrix, Q8Weight


@dataclass(frozen=True)
class DenseFFN:
    gate_up: Matrix  # [2 * ff, hidden]: gate, then up, one GEMV for both
    down: Matrix  # [hidden, ff]


@dataclass(frozen=True)
class Attention:
    qkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v stacked, one GEMV for all three
    o: Matrix  # [hidden, heads * head_dim]
    q_dim: int  # heads * head_dim: the rows of q; k and v split the rest
    qkv_bias: torch.Tensor | None = None  # q, k, v biases stacked (zeros where one has none)
    q_norm: torch.Tensor | None = None  # [head_dim] or [heads * head_dim]
    k_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None  # [hidden]
    sinks: torch.Tensor | None = None  # float32 [heads]: each head's learned sink logit (gpt-oss)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[tokens, qkv rows]` -> q, k, v (views)."""
        kv_dim = (self.qkv.shape[0] - self.q_dim) // 2
        q, k, v = qkv.split([self.q_dim, kv_dim, kv_dim], dim=-1)
        return q, k, v


@dataclass(frozen=True)
class MoE:
    router: torch.Tensor  # [experts, hidden]
    experts: ExpertWeights  # raw GGUF bytes, host memory map; their math (biases, activation) beside them
    shared: DenseFFN | None = None  # always added, or scaled by sigmoid(x . shared_gate) where it has one
    shared_gate: torch.Tensor | None = None  # [hidden]
    score_bias: torch.Tensor | None = None  # float32 [experts]: added to the scores for choosing (DeepSeek-V3)
    router_bias: torch.Tensor | None = None  # [experts]: added to the router logits (gpt-oss)
    expert_scale: torch.Tensor | None = None  # float32 [experts]: multiplies each expert's weight (Gemma 4)
    router_norm: torch.Tensor | None = None  # [hidden]: the router reads rms_norm(residual) with it (Gemma 4)


@dataclass(frozen=True)
class Layer:
    attn_norm: torch.Tensor
    attn: Attention | MLAttention | GemmaAttention
    ffn_norm: torch.Tensor
    ffn: DenseFFN | MoE
    sandwich: Sandwich | None = None  # Gemma 4's norms after each block, dense MLP beside the experts, scale


@dataclass(frozen=True)
class ModelWeights:
    hparams: HParams
    arch: ArchSpec
    embed: torch.Tensor  # [vocab, hidden]
    norm: torch.Tensor
    output: Matrix  # [vocab, hidden]; the embedding when tied
    layers: tuple[Layer, ...]
    rope_factors: torch.Tensor | None = None  # float32 [head_dim / 2]: full-attention layers' frequency divisors

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.ffn, MoE)]


def host_bytes(info: TensorInfo) -> torch.Tensor:
    """Zero-copy uint8 torch view of a tensor's bytes in the (read-only) memory map."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the map is not writable
        return torch.from_numpy(info.raw())


class WeightLoader:
    def __init__(self, gguf: GGUFFile, device: torch.device, dtype: torch.dtype,
                 progress: Callable[[int], None] | None = None, keep_q8: str = "none",
                 split: LayerSplit | None = None) -> None:
        """split: the layers' devices where they are several (`device` is then the first's)."""
        self.gguf, self.device, self.dtype, self.progress = gguf, device, dtype, progress
        self.split = split
        self.keep_q8 = keep_q8  # none | output | all: the Q8_0 matrices `matrix` keeps as Q8_0
        self.arch = get_arch(gguf.architecture)
        vocab = gguf.get("tokenizer.ggml.tokens")
        embed = gguf.tensor(GLOBAL_TENSORS["embed"])
        try:
            self.hp = self.arch.hparams(gguf.metadata, len(vocab) if vocab else embed.shape[0])
        except KeyError as exc:
            raise GGUFError(f"{gguf.path}: metadata key {exc} is missing") from None

    def tensor(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        info = self.gguf.tensor(name, shape)
        try:
            format_of(info.qtype)
        except ValueError:
            raise GGUFError(f"{info.path}: tensor '{name}' has unsupported type {info.qtype.name}") from None
        if self.progress:
            self.progress(info.num_bytes)
        return info

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._values(self.tensor(name, shape), shape, dtype or self.dtype)

    def _values(self, info: TensorInfo, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor dequantized to `dtype` on the device."""
        return dequantize(host_bytes(info), info.qtype, info.num_cols).reshape(shape).to(self.device, dtype)

    def matrix(self, *parts: tuple[str, tuple[int, int]], keep: bool | None = None) -> Matrix:
        """`keep`: as Q8_0 where the parts are (default: where the loader keeps every such matrix)."""
        infos = [self.tensor(name, shape) for name, shape in parts]
        if (self.keep_q8 == "all" if keep is None else keep) and all(info.qtype == QType.Q8_0 for info in infos):
            return Q8Weight.stack([Q8Weight.from_gguf(host_bytes(info), shape, self.device)
                                   for info, (_, shape) in zip(infos, parts, strict=True)])
        return torch.cat([self._values(info, shape, self.dtype) for info, (_, shape) in zip(infos, parts, strict=True)])

    def optional(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.dense(name, shape, dtype) if self.gguf.has(name) else None

    def has(self, name: str) -> bool:
        return self.gguf.has(name)

    def host(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        info = self.tensor(name, shape)
        return dequantize(host_bytes(info), info.qtype, info.num_cols).reshape(shape).clone()

    def load(self) -> ModelWeights:
        hp, g = self.hp, GLOBAL_TENSORS
        embed = self.dense(g["embed"], (hp.vocab_size, hp.hidden))
        # NOTE: on several devices each layer is on the device of its range, the embedding on the first, the final
        # norm and the output on the last (the last layer's)
        layers = tuple(self.on(i).layer(i) for i in range(hp.num_layers))
        output = self.output()
        if output is None and embed.device != self.device:  # a tied output matrix: the embedding's copy
            output = embed.to(self.device)
        norm = self.dense(g["norm"], (hp.hidden,))
        factors = self.optional(g["rope_freqs"], (hp.rope_dim // 2,), torch.float32)
        return ModelWeights(hp, self.arch, embed, norm, embed if output is None else output, layers, factors)

    def on(self, layer: int) -> WeightLoader:
        """The loader, loading onto the layer's device from now on."""
        if self.split is not None:
            self.device = torch.device(self.split.device_of(layer))
        return self

    def output(self) -> Matrix | None:
        """The output matrix; None where it is the embedding's (tied)."""
        g, hp = GLOBAL_TENSORS, self.hp
        return self.matrix((g["output"], (hp.vocab_size, hp.hidden)), keep=self.keep_q8 != "none") \
            if self.has(g["output"]) else None

    def layer(self, i: int) -> Layer:
        hp, t = self.hp, lambda role: layer_tensor(i, role)
        if self.arch is gemma4.ARCH:
            return self.gemma_layer(i)
        ffn = self.moe(i) if self.gguf.has(t("router")) else self.dense_ffn(i, "gate", "up", "down", hp.dense_ff)
        attn = deepseek2.load_attention(self, i, hp) if hp.mla else self.attention(i)
        return Layer(self.dense(t("attn_norm"), (hp.hidden,)), attn, self.dense(t(self.arch.ffn_norm), (hp.hidden,)),
                     ffn)

    def gemma_layer(self, i: int) -> Layer:
        hp, t = self.hp, lambda role: layer_tensor(i, role)
        is_moe = self.gguf.has(t("router"))
        ffn: DenseFFN | MoE = replace(self.moe(i), router_norm=gemma4.router_norm(self, i, hp)) if is_moe else \
            self.dense_ffn(i, "gate", "up", "down", hp.dense_ff)
        return Layer(self.dense(t("attn_norm"), (hp.hidden,)), gemma4.load_attention(self, i, hp),
                     self.dense(t("ffn_norm"), (hp.hidden,)), ffn, gemma4.load_sandwich(self, i, hp, is_moe))

    def attention(self, i: int) -> Attention:
        hp, t = self.hp, lambda role: layer_tensor(i, role)
        q_dim, kv_dim = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
        norm_dim = {"head": hp.head_dim, "full": q_dim, "none": 0}[self.arch.qk_norm]
        k_norm_dim = kv_dim if self.arch.qk_norm == "full" else norm_dim
        dims = (q_dim, kv_dim, kv_dim)
        qkv = self.matrix(*((t(role), (dim, hp.hidden)) for role, dim in zip("qkv", dims, strict=True)))
        biases = [self.optional(t(f"{role}_bias"), (dim,)) for role, dim in zip("qkv", dims, strict=True)]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(dim, dtype=self.dtype, device=self.device) if b is None else b
             for dim, b in zip(dims, biases, strict=True)])
        return Attention(
            qkv=qkv, o=self.matrix((t("o"), (hp.hidden, q_dim))), q_dim=q_dim, qkv_bias=bias,
            q_norm=self.dense(t("q_norm"), (norm_dim,)) if norm_dim else None,
            k_norm=self.dense(t("k_norm"), (k_norm_dim,)) if norm_dim else None,
            o_bias=self.optional(t("o_bias"), (hp.hidden,)),
            sinks=self.optional(t("sinks"), (hp.num_heads,), torch.float32),
        )

    def dense_ffn(self, i: int, gate: str, up: str, down: str, ff: int) -> DenseFFN:
        hp, t = self.hp, lambda role: layer_tensor(i, role)
        if not ff:
            ff = self.gguf.tensor(t(gate)).shape[0]
        return DenseFFN(self.matrix((t(gate), (ff, hp.hidden)), (t(up), (ff, hp.hidden))),
                        self.matrix((t(down), (hp.hidden, ff))))

    def moe(self, i: int) -> MoE:
        hp, t = self.hp, lambda role: layer_tensor(i, role)
        shared = shared_gate = None
        if self.gguf.has(t("gate_shexp")):
            shared = self.dense_ffn(i, "gate_shexp", "up_shexp", "down_shexp", hp.shared_ff)
            shared_gate = self.optional(t("shared_gate_inp"), (hp.hidden,))
        return MoE(self.dense(t("router"), (hp.num_experts, hp.hidden)), self.experts(i), shared, shared_gate,
                   self.optional(t("score_bias"), (hp.num_experts,), torch.float32),
                   self.optional(t("router_bias"), (hp.num_experts,)),
                   self.optional(t("down_exps_scale"), (hp.num_experts,), torch.float32))

    def experts(self, i: int) -> ExpertWeights:
        hp, t = self.hp, lambda role: layer_tensor(i, role)
        e, ff = hp.num_experts, hp.expert_ff
        if self.gguf.has(t("gate_up_exps")):  # merged: gate and up are views of one tensor's bytes
            gate_up = self.tensor(t("gate_up_exps"), (e, 2 * ff, hp.hidden))
            gate, up = split_gate_up(host_bytes(gate_up))
            gate_type = up_type = gate_up.qtype
        else:
            gate_info, up_info = (self.tensor(t(role), (e, ff, hp.hidden)) for role in ("gate_exps", "up_exps"))
            gate, up, gate_type, up_type = host_bytes(gate_info), host_bytes(up_info), gate_info.qtype, up_info.qtype
        down = self.tensor(t("down_exps"), (e, hp.hidden, ff))
        return ExpertWeights(gate, up, host_bytes(down), gate_type, up_type, down.qtype, hp.hidden, ff,
                             self.arch.expert_math(self, i, hp))


def load_weights(gguf: GGUFFile, device: torch.device, dtype: torch.dtype,
                 progress: Callable[[int], None] | None = None, keep_q8: str = "none",
                 split: LayerSplit | None = None) -> ModelWeights:
    """`keep_q8`: which Q8_0 matrices that are only multiplied by stay Q8_0 (`WeightLoader.matrix`): none, the
    output's, all. `split`: each layer's weights on the device of its range (several devices)."""
    try:
        return WeightLoader(gguf, device, dtype, progress, keep_q8, split).load()
    except ValueError as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{gguf.path}: {exc}") from exc
