"""Draft-head modules: Medusa residual heads and the EAGLE feature head.

Both read the target's *features*: its last hidden state after the final
norm (the LM head's input), and both score tokens with a **draft LM head**:
the target's (frozen) LM head rows of a reduced draft vocabulary
(``vocab_map``, the most frequent tokens of the training data), so a draft
step does not pay for the full 49k-token head.

- ``MedusaHeads`` (Cai et al. 2024): head k is ``P_k (h + SiLU(W_k h + b_k))``
  with ``W_k`` zero-initialised and ``P_k`` the identity (so every head
  starts as the identity, i.e. predicts what the LM head predicts) followed
  by the draft LM head; head k (1-based) on the feature of token t predicts
  token ``t + 1 + k``.
- ``EagleHead`` (Li et al. 2024): ``fc([f_t ; emb(x_{t+1})])`` then one
  decoder layer (RMSNorm, GQA attention with RoPE, SwiGLU MLP) with its own
  KV cache predicts ``f_{t+1}``; ``draft_lm_head(f_{t+1})`` scores token
  ``t + 2``. Autoregressive at the feature level: deeper draft levels feed
  the head its own predicted features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DraftLayer", "EagleHead", "MedusaHeads", "RMSNorm", "rotary_angles", "rotate"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """``cos``, ``sin`` ``[B, 1, T, D/2]`` of the rotary angles at ``positions`` ``[B, T]``."""
    ang = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves ``(x1, x2)`` of ``x`` ``[B, H, T, D]`` by the angles:
    ``(x1 cos - x2 sin, x2 cos + x1 sin)`` (RoPE, rotate-half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DraftLayer(nn.Module):
    """One Llama-style decoder layer with an explicit KV interface.

    ``forward(x, positions, past_k, past_v, mask)`` with ``x`` ``[B, T, d]``,
    ``past_k/v`` ``[B, Hkv, S, D]`` (or ``None``), ``mask`` additive or bool
    ``[B, 1, T, S + T]`` (True / 0 = attend) returns ``(out, k, v)`` where
    ``k``/``v`` ``[B, Hkv, T, D]`` are the new entries (post-RoPE) to cache.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 theta: float = 10000.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.ln1 = RMSNorm(hidden, eps)
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.ln2 = RMSNorm(hidden, eps)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # not a weight: not saved

    def forward(self, x, positions, past_k=None, past_v=None, mask=None):
        b, t, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_angles(positions, self.inv_freq, q.dtype)  # shared by queries and keys
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)
        # grouped-query attention without copying each KV head for its query heads
        gqa = self.heads != self.kv_heads
        if mask is None:
            attn = F.scaled_dot_product_attention(q, keys, vals, is_causal=past_k is None, enable_gqa=gqa)
        else:
            attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=gqa)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.ln2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, k, v


class MedusaHeads(nn.Module):
    """K heads ``P_k (h + SiLU(W_k h + b_k))`` read by the (frozen) draft LM head.

    ``W_k`` is zero-initialised as in the Medusa paper, so each head starts as
    the identity. Medusa's own per-head LM head ``W2_k`` (initialised from the
    base LM head, trainable) is factored here as ``W_lm P_k`` with ``P_k`` a
    ``d x d`` matrix initialised to the identity: the same starting point,
    ``d^2`` instead of ``vocab x d`` parameters per head. Without a trainable
    map after the residual block a head could not move away from the next
    token: ``SiLU >= -0.28`` cannot cancel the identity branch.
    """

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden, hidden))  # W1, zero init (Medusa paper)
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden))
        self.proj = nn.Parameter(torch.eye(hidden).repeat(num_heads, 1, 1))  # P_k, identity init

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ``[..., d]`` -> ``[K, ..., d]`` per-head features (before the draft LM head)."""
        flat = h.reshape(-1, h.shape[-1])  # [N, d]
        z = torch.einsum("nd,ked->kne", flat, self.weight) + self.bias[:, None]  # [K, N, d]: W_k h + b_k
        out = flat[None] + F.silu(z)
        out = torch.einsum("knd,ked->kne", out, self.proj)
        return out.reshape(self.num_heads, *h.shape)


class EagleHead(nn.Module):
    """``fc([feature ; token embedding])`` -> one ``DraftLayer`` -> next feature."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 theta: float = 10000.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = DraftLayer(hidden, heads, kv_heads, head_dim, intermediate, theta, eps)
        self.norm = RMSNorm(hidden, eps)  # back to the scale of the target's (normed) features
        with torch.no_grad():  # start as "feature in, feature out" on the feature half
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.fc.weight[:, hidden:].normal_(0.0, 0.02)
            self.fc.bias.zero_()

    def forward(self, features, token_embeds, positions, past_k=None, past_v=None, mask=None):
        """``features``/``token_embeds`` ``[B, T, d]`` -> (predicted next features, k, v)."""
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        out, k, v = self.layer(x, positions, past_k, past_v, mask)
        return self.norm(out), k, v

    @staticmethod
    def config_from_target(config) -> dict:
        """Head sizes matching the target's decoder layers."""
        config = getattr(config, "text_config", config)
        heads = config.num_attention_heads
        rope_params = getattr(config, "rope_parameters", None) or {}
        theta = rope_params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        return dict(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            theta=float(theta),
            eps=float(getattr(config, "rms_norm_eps", 1e-5)),
        )


def init_layer_from_target(head: EagleHead, target_layer) -> None:
    """Copy the target's decoder layer weights into the head's layer (warm start)."""
    src = target_layer
    pairs = [
        (head.layer.ln1.weight, src.input_layernorm.weight),
        (head.layer.q.weight, src.self_attn.q_proj.weight),
        (head.layer.k.weight, src.self_attn.k_proj.weight),
        (head.layer.v.weight, src.self_attn.v_proj.weight),
        (head.layer.o.weight, src.self_attn.o_proj.weight),
        (head.layer.ln2.weight, src.post_attention_layernorm.weight),
        (head.layer.gate.weight, src.mlp.gate_proj.weight),
        (head.layer.up.weight, src.mlp.up_proj.weight),
        (head.layer.down.weight, src.mlp.down_proj.weight),
    ]
    with torch.no_grad():
        for dst, s in pairs:
            dst.copy_(s.detach().to(dst.dtype))
