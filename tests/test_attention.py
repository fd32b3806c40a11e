"""Grouped-query attention without KV-head copies (``worker.reference.engine.attention``):
the function against transformers' own SDPA path on the shapes an engine
runs, the model switch, and greedy decoding through the engine on it."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from policies.table import Decision
from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.engine.attention import GROUPED_SDPA, grouped_sdpa_forward, use_grouped_attention
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.models import tiny_llama


class _Attn(torch.nn.Module):
    """What the attention functions read off a Llama attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _qkv(batch, heads, kv_heads, q, kv, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, q, dim, generator=g), torch.randn(batch, kv_heads, kv, dim, generator=g),
            torch.randn(batch, kv_heads, kv, dim, generator=g))


@pytest.mark.parametrize("batch,q,kv", [(1, 1, 9), (1, 4, 20), (3, 2, 11), (2, 6, 6)])
def test_masked_queries_match_transformers_sdpa(batch, q, kv):
    query, key, value = _qkv(batch, 6, 2, q, kv)
    allowed = torch.rand(batch, 1, q, kv, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True  # every query sees something
    mask = torch.zeros(batch, 1, q, kv).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = _Attn(groups=3)
    ours, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (batch, q, 6, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # and against attention written out head by head, each query head on its KV head
    for h in range(6):
        scores = query[:, h] @ key[:, h // 3].transpose(-1, -2) * 0.25 + mask[:, 0]
        torch.testing.assert_close(ours[:, :, h], torch.softmax(scores, -1) @ value[:, h // 3], rtol=1e-5, atol=1e-6)


def test_unmasked_queries_after_a_cache_see_all_of_it():
    """No mask, 3 queries after 5 cached keys: query i sees keys 0..5+i (SDPA's own
    is_causal would align the queries with the first keys instead)."""
    query, key, value = _qkv(1, 4, 2, 3, 8)
    ours, _ = grouped_sdpa_forward(_Attn(groups=2), query, key, value, None)
    for i in range(3):
        seen = 5 + i + 1
        for h in range(4):
            scores = query[0, h, i] @ key[0, h // 2, :seen].T / 4.0
            torch.testing.assert_close(ours[0, i, h], torch.softmax(scores, -1) @ value[0, h // 2, :seen],
                                       rtol=1e-5, atol=1e-6)


def test_switch_is_idempotent_and_only_takes_sdpa_models():
    model, _ = tiny_llama(seed=2)
    assert use_grouped_attention(model) and model.config._attn_implementation == GROUPED_SDPA
    assert use_grouped_attention(model)
    eager, _ = tiny_llama(seed=2, attn_implementation="eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"


def test_logits_and_greedy_generation_unchanged_by_the_switch():
    reference, vocab = tiny_llama(seed=4)
    model, _ = tiny_llama(seed=4)
    use_grouped_attention(model)
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row: a masked prefill
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)
        kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=16)
        assert torch.equal(model.generate(ids, **kw), reference.generate(ids, **kw))


@pytest.mark.model
def test_engine_runs_on_grouped_attention_and_stays_lossless():
    model, vocab = tiny_llama(seed=6)
    reference, _ = tiny_llama(seed=6)  # left on transformers' SDPA
    g = torch.Generator().manual_seed(7)
    # repetitive prompts so that prompt lookup drafts multi-token blocks
    prompts = [(torch.randint(0, vocab, (6,), generator=g).repeat(4)).tolist() for _ in range(3)]
    engine = Engine(model, NgramDrafter(), static_decide(Decision(3, 2, 5)), max_batch=3)
    assert model.config._attn_implementation == GROUPED_SDPA
    outputs = engine.generate(prompts, 20)
    assert engine.stats.draft_nodes > 0
    for prompt, out in zip(prompts, outputs):
        x = torch.tensor([prompt])
        y = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20)
        assert out == y[0, len(prompt):].tolist()
