"""Grouped-query attention without copying KV heads, for multi-token queries.

transformers' SDPA path (5.x) attends a grouped-query model (SmolLM2: 9
query heads over 3 KV heads) in one of three ways: ``enable_gqa`` when
there is no mask, a regrouped query when one token is decoded, and
otherwise ``repeat_kv``: a copy of every layer's whole K and V, per row,
expanded to the query heads. An engine that verifies draft blocks always
passes a mask and always has more than one query token, so each verify
step copied the batch's entire KV cache three times over, twice per layer.
On one thread of the AMD EPYC here (family 25) that copy alone took 3.2 ms
per layer call at batch 8 × 2 tokens × 150 positions, against 0.27 ms for
the whole attention with ``enable_gqa`` (a one-off micro-benchmark;
outputs bitwise equal).

``use_grouped_attention(model)`` registers an attention function that
always passes ``enable_gqa`` to ``torch.nn.functional.scaled_dot_product_attention``
(which indexes the KV head of each query head instead of copying) and
switches a CPU model that runs on transformers' SDPA to it. On other
devices it leaves the model alone: there a mask plus ``enable_gqa`` sends
SDPA to its math kernel, which transformers avoids on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["GROUPED_SDPA", "grouped_sdpa_forward", "use_grouped_attention"]

GROUPED_SDPA = "specctl_grouped_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q, dim]
    key: torch.Tensor,  # [batch, kv_heads, kv, dim]
    value: torch.Tensor,  # [batch, kv_heads, kv, dim]
    attention_mask: torch.Tensor | None,  # [batch, 1, q, kv] additive or bool, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: SDPA with ``enable_gqa``.

    Returns the output ``[batch, q, heads, dim]`` as transformers' own SDPA
    function does. Position biases and soft-capping (not in Llama-family
    models) go to transformers' function unchanged.
    """
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = bool(causal) and attention_mask is None and q_len > 1
    if causal and kv_len != q_len:
        # SDPA's is_causal aligns the queries with the first keys; queries that
        # follow a cache must see it all: the bottom-right triangle.
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        causal = False
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None  # [batch, q, heads, dim]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)  # masks built exactly as for "sdpa"


def use_grouped_attention(model) -> bool:
    """Switch a CPU model on transformers' SDPA attention to :func:`grouped_sdpa_forward`.

    Idempotent; returns whether the model now runs it (False: another
    device, or an attention implementation other than SDPA).
    """
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == GROUPED_SDPA:
        return True
    if current != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False
    _register()
    model.set_attn_implementation(GROUPED_SDPA)
    return config._attn_implementation == GROUPED_SDPA
