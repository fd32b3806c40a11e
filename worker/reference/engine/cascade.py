"""Cascade attention for tree verification: the cached prefix without a tree
mask, the small tree block with one, merged by their log-sum-exp.

A verify step's queries are the block ``[root | draft nodes]`` (``q`` of
them, block coordinates as in ``tree.py``). The CPU path (``verify.py``,
``batch.py``, ``attention.py``) hands the model one additive mask over
``[past | block]`` and lets torch's SDPA attend the whole context through
it. On a GPU that mask is what costs: measured on an H200 (one forward of
Llama-3-8B shapes in bf16, CUDA graphs), a boolean tree mask over the whole
context made SDPA leave its packed decode path; the forward cost 1.11–1.51x
the packed one at 1k context and 1.76–2.99x at 8k (batch 1–64, q 8).

Attention over the union of two disjoint key sets is the two partial
attentions weighted by their softmax mass, so the step splits in three:

1. :func:`attend_prefix`: the ``q`` queries over the cached prefix, with no
   mask but each row's key padding (``past_valid``: left padding and the
   holes compaction leaves). Every query sees every real prefix slot, so
   this is decode-shaped: the ``g`` query heads of a KV head are stacked
   into ``g · q`` rows of one matrix product, and each KV head is read once.
2. :func:`attend_tree`: the ``q`` queries over the ``q`` block keys with
   the tree mask (a node sees itself and its ancestors): a ``q x q`` problem.
3. :func:`merge_attention`: ``m = max(lse_a, lse_b)``,
   ``out = (e^(lse_a-m)·out_a + e^(lse_b-m)·out_b) / (e^(lse_a-m) + e^(lse_b-m))``,
   ``lse = m + log(e^(lse_a-m) + e^(lse_b-m))``.

Both parts are written out in torch (matrix product, ``logsumexp``, matrix
product), so the same code runs on the CPU (the tests) and on CUDA. Each
part materialises its scores (``[batch, kv_heads, g·q, past]`` in fp32 for
the prefix); a fused decode kernel that returns the log-sum-exp (FlashInfer,
flash-attn's ``return_lse``) can replace :func:`attend_prefix` without
changing the rest.

``cascade_sdpa_forward`` is a transformers attention-interface function:
when the caller passes ``specctl_prefix_valid`` (bool ``[batch, past]``)
through the model's forward, the last ``q`` keys are the block and the
cascade runs; any other call (prefill, ``generate``) goes to the function
the model ran before (``attention.grouped_sdpa_forward`` on the CPU,
transformers' SDPA elsewhere). ``Engine(cascade=None)`` switches to it when
the model is off the CPU; the CPU keeps its masked path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from worker.reference.engine.attention import GROUPED_SDPA, grouped_sdpa_forward

__all__ = [
    "CASCADE_SDPA",
    "PREFIX_VALID_KWARG",
    "Partial",
    "attend_prefix",
    "attend_tree",
    "cascade_attention",
    "cascade_sdpa_forward",
    "merge_attention",
    "use_cascade_attention",
]

CASCADE_SDPA = "specctl_cascade"
PREFIX_VALID_KWARG = "specctl_prefix_valid"  # forward kwarg: bool [batch, past], True = a real cache slot


class Partial(NamedTuple):
    """Attention of some queries over one part of the keys.

    ``out``: ``[batch, heads, q, dim]``, the softmax-weighted values over
    that part alone (zeros where a query saw none of it); ``lse``:
    ``[batch, heads, q]``, the log-sum-exp of its scaled scores (``-inf``
    where a query saw none). Both in the compute dtype (fp32 for half
    inputs, else the input's).
    """

    out: torch.Tensor
    lse: torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp16/bf16 -> fp32; fp32, fp64 stay


def _group(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, heads, q, dim]`` -> ``[batch, kv_heads, g·q, dim]``, ``g = heads / kv_heads``.

    Query head ``h`` reads KV head ``h // g`` (``repeat_kv``'s order), so the
    heads of one KV head are consecutive and a reshape stacks them: row
    ``i·q + t`` of KV head ``k`` is query ``t`` of head ``k·g + i``.
    """
    batch, heads, q, dim = query.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split over {kv_heads} KV heads")
    return query.reshape(batch, kv_heads, (heads // kv_heads) * q, dim)


def _ungroup(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, kv_heads, g·q, ...]`` -> ``[batch, heads, q, ...]`` (inverse of :func:`_group`)."""
    batch, kv_heads, rows = x.shape[:3]
    g = heads // kv_heads
    return x.reshape(batch, heads, rows // g, *x.shape[3:])


def _group_mask(mask: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """A per-query mask ``[batch|1, 1|heads, q, keys]`` in :func:`_group`'s row order:
    ``[batch|1, 1|kv_heads, g·q, keys]``."""
    batch, mask_heads, q, keys = mask.shape
    g = heads // kv_heads
    if mask_heads == 1:
        return mask.expand(batch, g, q, keys).reshape(batch, 1, g * q, keys)
    if mask_heads != heads:
        raise ValueError(f"mask has {mask_heads} heads, the queries {heads}")
    return mask.reshape(batch, kv_heads, g * q, keys)


def _attend(
    query: torch.Tensor,  # [batch, kv_heads, rows, dim]  (rows = g·q, grouped)
    key: torch.Tensor,  # [batch, kv_heads, keys, dim]
    value: torch.Tensor,  # [batch, kv_heads, keys, dim_v]
    scale: float,
    keep: torch.Tensor | None = None,  # bool, broadcasts to [batch, kv_heads, rows, keys]; True = attend
    bias: torch.Tensor | None = None,  # float, broadcasts to [batch, kv_heads, rows, keys]; added to the scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out, with its log-sum-exp: ``(out, lse)``,
    ``[batch, kv_heads, rows, dim_v]`` and ``[batch, kv_heads, rows]``."""
    acc = _compute_dtype(query.dtype)
    scores = torch.matmul(query * scale, key.transpose(-1, -2)).to(acc)  # [batch, kv_heads, rows, keys]
    if bias is not None:
        scores = scores + bias.to(acc)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [batch, kv_heads, rows]; -inf where no key is kept
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan
    probs = torch.exp(scores - safe[..., None])  # [batch, kv_heads, rows, keys]
    out = torch.matmul(probs.to(value.dtype), value).to(acc)  # [batch, kv_heads, rows, dim_v]
    return out, lse


def attend_prefix(
    query: torch.Tensor,  # [batch, heads, q, dim]
    key: torch.Tensor,  # [batch, kv_heads, past, dim]
    value: torch.Tensor,  # [batch, kv_heads, past, dim_v]
    valid: torch.Tensor | None = None,  # bool [batch, past]; True = a real slot; None = all real
    scale: float | None = None,
) -> Partial:
    """Every query over the cached prefix: no per-query mask, only each row's
    key padding. ``past`` may be 0 (nothing cached): zeros and ``-inf``."""
    batch, heads, q, dim = query.shape
    kv_heads, past = key.shape[1], key.shape[2]
    acc = _compute_dtype(query.dtype)
    if past == 0:
        out = torch.zeros(batch, heads, q, value.shape[-1], dtype=acc, device=query.device)  # [batch, heads, q, dim_v]
        lse = torch.full((batch, heads, q), float("-inf"), dtype=acc, device=query.device)  # [batch, heads, q]
        return Partial(out, lse)
    if valid is not None and valid.shape != (batch, past):
        raise ValueError(f"valid is {tuple(valid.shape)}, the prefix holds {(batch, past)}")
    keep = None if valid is None else valid.to(torch.bool)[:, None, None, :]  # [batch, 1, 1, past]
    scale = dim**-0.5 if scale is None else scale
    out, lse = _attend(_group(query, kv_heads), key, value, scale, keep=keep)  # [batch, kv_heads, g·q, dim_v]
    return Partial(_ungroup(out, heads), _ungroup(lse, heads))  # [batch, heads, q, dim_v], [batch, heads, q]


def attend_tree(
    query: torch.Tensor,  # [batch, heads, q, dim]
    key: torch.Tensor,  # [batch, kv_heads, q, dim]
    value: torch.Tensor,  # [batch, kv_heads, q, dim_v]
    mask: torch.Tensor,  # [q, q], [batch, q, q] or [batch, 1|heads, q, q]; bool (True = attend) or additive float
    scale: float | None = None,
) -> Partial:
    """The queries over the block's own keys through the tree mask
    (``TreeBuffers.attn_mask``: an entry sees itself and its ancestors)."""
    batch, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if mask.dim() == 2:
        mask = mask[None, None]  # [1, 1, q, keys]
    elif mask.dim() == 3:
        mask = mask[:, None]  # [batch, 1, q, keys]
    if mask.shape[-2:] != (q, keys):
        raise ValueError(f"tree mask is {tuple(mask.shape)}, expected [..., {q}, {keys}]")
    mask = _group_mask(mask.to(query.device), heads, kv_heads)  # [batch|1, 1|kv_heads, g·q, keys]
    scale = dim**-0.5 if scale is None else scale
    if mask.dtype == torch.bool:
        out, lse = _attend(_group(query, kv_heads), key, value, scale, keep=mask)
    else:
        out, lse = _attend(_group(query, kv_heads), key, value, scale, bias=mask)
    return Partial(_ungroup(out, heads), _ungroup(lse, heads))  # [batch, heads, q, dim_v], [batch, heads, q]


def merge_attention(a: Partial, b: Partial) -> Partial:
    """Attention over the union of two disjoint key sets, from the two parts.

    A query that saw nothing in one part (``lse = -inf``) gets the other
    part unchanged; one that saw nothing in either gets zeros and ``-inf``.
    """
    m = torch.maximum(a.lse, b.lse)  # [batch, heads, q]
    m = m.masked_fill(m == float("-inf"), 0.0)  # both parts empty: weights 0, not nan
    wa = torch.exp(a.lse - m)  # [batch, heads, q]
    wb = torch.exp(b.lse - m)  # [batch, heads, q]
    total = wa + wb  # [batch, heads, q]
    out = (wa[..., None] * a.out + wb[..., None] * b.out) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return Partial(out, m + torch.log(total))  # [batch, heads, q, dim_v], [batch, heads, q]


def cascade_attention(
    query: torch.Tensor,  # [batch, heads, q, dim]
    prefix_key: torch.Tensor,  # [batch, kv_heads, past, dim]
    prefix_value: torch.Tensor,  # [batch, kv_heads, past, dim_v]
    prefix_valid: torch.Tensor | None,  # bool [batch, past]; None = every slot real
    tree_key: torch.Tensor,  # [batch, kv_heads, q, dim]
    tree_value: torch.Tensor,  # [batch, kv_heads, q, dim_v]
    tree_mask: torch.Tensor,  # [q, q], [batch, q, q] or [batch, 1|heads, q, q]; bool or additive
    scale: float | None = None,
) -> Partial:
    """Attention of the block's queries over ``[prefix | block]``: the prefix
    unmasked (key padding only), the block through ``tree_mask``, merged.

    Returns the output ``[batch, heads, q, dim_v]`` in ``query``'s dtype and
    the log-sum-exp ``[batch, heads, q]`` in the compute dtype. Equals one
    softmax over the concatenated keys with the mask
    ``[prefix_valid (every query) | tree_mask]``.

    Examples
    --------
    >>> from worker.reference.engine.tree import tree_buffers
    >>> g = torch.Generator().manual_seed(0)
    >>> tree = tree_buffers([-1, -1, 0])  # block of 4: root, two children, a grandchild
    >>> q_, pk, pv, tk, tv = (torch.randn(s, generator=g, dtype=torch.float64) for s in
    ...                       [(1, 6, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 4, 8), (1, 2, 4, 8)])
    >>> valid = torch.tensor([[False, True, True, True, True]])  # one left-pad slot
    >>> out = cascade_attention(q_, pk, pv, valid, tk, tv, tree.attn_mask).out
    >>> allowed = torch.cat([valid[:, None].expand(1, 4, 5), tree.attn_mask[None]], dim=-1)[:, None]
    >>> full = torch.nn.functional.scaled_dot_product_attention(
    ...     q_, torch.cat([pk, tk], 2), torch.cat([pv, tv], 2), attn_mask=allowed, enable_gqa=True)
    >>> torch.allclose(out, full, atol=1e-12)
    True
    """
    prefix = attend_prefix(query, prefix_key, prefix_value, prefix_valid, scale)  # [batch, heads, q, dim_v]
    tree = attend_tree(query, tree_key, tree_value, tree_mask, scale)  # [batch, heads, q, dim_v]
    merged = merge_attention(prefix, tree)
    return Partial(merged.out.to(query.dtype), merged.lse)


# --------------------------------------------------------------------------
# transformers glue
# --------------------------------------------------------------------------


def _fallback(query: torch.Tensor):
    if query.device.type == "cpu":
        return grouped_sdpa_forward  # what a CPU model ran before (use_grouped_attention)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward  # transformers' own "sdpa"


def cascade_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q, dim]
    key: torch.Tensor,  # [batch, kv_heads, past+q, dim]: the cache with the block appended
    value: torch.Tensor,  # [batch, kv_heads, past+q, dim]
    attention_mask: torch.Tensor | None,  # [batch, 1, q, past+q] additive or bool, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: cascade attention when the
    forward carries ``specctl_prefix_valid``, the model's previous attention
    otherwise.

    With it, the last ``q`` keys are the block; the block part of
    ``attention_mask`` (``[..., past:]``; causal when there is no mask) is
    the tree mask, and the prefix part is not read: ``specctl_prefix_valid``
    says which prefix slots are real, for every query alike. Returns
    ``[batch, q, heads, dim]`` as transformers' own SDPA function does.
    """
    prefix_valid = kwargs.pop(PREFIX_VALID_KWARG, None)  # bool [batch, past]
    if prefix_valid is None:
        return _fallback(query)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs)
    if dropout:
        raise ValueError("cascade attention is for inference (dropout 0)")
    q, past = query.shape[2], prefix_valid.shape[-1]
    if key.shape[2] != past + q:
        raise ValueError(f"cascade attention: {key.shape[2]} keys, expected {past} cached + {q} in the block")
    if attention_mask is None:
        tree_mask = torch.ones(q, q, dtype=torch.bool, device=query.device).tril()  # [q, q]: a chain
    else:
        tree_mask = attention_mask[..., past:]  # [batch, 1, q, q]
    out = cascade_attention(query, key[:, :, :past], value[:, :, :past], prefix_valid.to(query.device),
                            key[:, :, past:], value[:, :, past:], tree_mask, scaling).out  # [batch, heads, q, dim]
    return out.transpose(1, 2).contiguous(), None  # [batch, q, heads, dim]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(CASCADE_SDPA, cascade_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CASCADE_SDPA, sdpa_mask)  # masks built exactly as for "sdpa"


def use_cascade_attention(model) -> bool:
    """Switch a model on SDPA (transformers' or ``GROUPED_SDPA``) to
    :func:`cascade_sdpa_forward`, on any device.

    Idempotent; returns whether the model now runs it (False: an attention
    implementation other than SDPA, left alone). Calls without
    ``specctl_prefix_valid`` attend as before the switch.
    """
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == CASCADE_SDPA:
        return True
    if current not in ("sdpa", GROUPED_SDPA):
        return False
    _register()
    model.set_attn_implementation(CASCADE_SDPA)
    return config._attn_implementation == CASCADE_SDPA
