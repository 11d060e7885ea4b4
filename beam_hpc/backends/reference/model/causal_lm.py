"""The reference backend's policy network: a decoder-only transformer of the Llama / Qwen2 family,
read from a Hugging Face model folder (``config.json`` + ``model.safetensors``), in plain torch.

Why not transformers' classes: every process that holds the policy (the trainer, each rollout
worker, each outside worker) paid about 2 CPU-seconds to import transformers' model stack (which
pulls in ``torch.distributed.tensor`` and ``torch._dynamo``), more than the tiny model's whole
training step. The two models the backend runs (the 0.8M-parameter tiny Qwen2 and SmolLM2-135M, a
Llama) need a hundred lines of torch. The folders and parameter names are transformers' own, so a
folder it wrote loads unchanged and a checkpoint names its tensors as the folder does. Agreement
with transformers (logits, greedy generation) is tested in ``tests/backends/reference/test_causal_lm.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

FAMILIES = ("qwen2", "llama")  # model_type values read here; Qwen2 differs by its q/k/v biases


@dataclass(frozen=True)
class LMConfig:
    """What the forward pass needs from ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> LMConfig:
        """Read a transformers ``config.json``; a model this module would compute differently
        (another family, activation or RoPE scaling) is refused with what it is."""
        family = c.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"config.json: model_type {family!r}; the reference backend runs {', '.join(FAMILIES)}")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {c.get('hidden_act')!r}; only silu is implemented")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"config.json: rope_type {rope.get('rope_type')!r}; only the default RoPE is implemented")
        heads = int(c["num_attention_heads"])
        llama_bias = bool(c.get("attention_bias", False))
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else llama_bias,
            o_bias=False if family == "qwen2" else llama_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
        )


class LMOutput(NamedTuple):
    logits: torch.Tensor  # [B, S, V]


class KVCache:
    """Keys and values of every layer for a generation of at most ``capacity`` positions, written
    in place (no growing concatenation); the caller keeps the key mask (:meth:`CausalLM.run`)."""

    def __init__(self, config: LMConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys and values at the next positions; return all so far."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LMConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.c = layer, c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        B, S, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, S, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.write(self.layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim),
                                             enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LMConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """The language model. ``forward`` takes transformers' keyword names and returns ``.logits``,
    so the trainer's scoring code reads one interface; ``generate_step`` serves sampling with a
    :class:`KVCache`."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def run(self, input_ids: torch.Tensor, key_mask: torch.Tensor, position_ids: torch.Tensor,
            cache: KVCache | None = None) -> torch.Tensor:
        """Logits for ``input_ids`` ([B, S]). ``key_mask`` ([B, K], 1 = a real token) covers every
        key position: the cache's and these S. A query sees real keys at or before its own
        position, and itself (so that a pad position's row is never empty, which would give NaN)."""
        S = input_ids.shape[1]
        K = key_mask.shape[1]
        q_at = torch.arange(K - S, K, device=input_ids.device)[:, None]
        k_at = torch.arange(K, device=input_ids.device)[None, :]
        mask = ((k_at <= q_at)[None] & key_mask.bool()[:, None, :]) | (k_at == q_at)[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(position_ids, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask[:, None], cache)
        if cache is not None:
            cache.length += S
        return self.lm_head(self.model.norm(x))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False) -> LMOutput:
        del use_cache  # transformers' keyword: the full forward never keeps a cache
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return LMOutput(self.run(input_ids, attention_mask, position_ids))


def load(path: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The model in a transformers folder; every tensor of the file must find its parameter and
    every parameter its tensor (the tied output layer excepted), or the folder is not this model."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = LMConfig.from_dict(json.loads((folder / "config.json").read_text()))
    # Built on the CPU and initialised only to be overwritten: a "meta" build would skip that work,
    # but initialising meta tensors goes through torch's reference ops, which import torch._dynamo.
    model = CausalLM(config)
    state = load_file(str(folder / "model.safetensors"))
    _take(model, {k: v.to(dtype) for k, v in state.items()}, f"{folder}/model.safetensors")
    return model


def from_transformers(hf_model: Any) -> CausalLM:
    """A copy of a transformers model of a family above (the tiny model's builder trains one and
    evaluates it through this module's sampling)."""
    model = CausalLM(LMConfig.from_dict(hf_model.config.to_dict()))
    _take(model, {k: v.detach().clone() for k, v in hf_model.state_dict().items()}, type(hf_model).__name__)
    return model.to(next(hf_model.parameters()).device)


def _take(model: CausalLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Put ``state``'s tensors in as the model's parameters; a name either side lacks means the
    weights are not this model's (the tied output layer excepted)."""
    expected = set(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{source} does not match its config: missing {missing[:3]}, extra {extra[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
