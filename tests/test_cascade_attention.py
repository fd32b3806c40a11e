"""Cascade attention for tree verification (``worker.reference.engine.cascade``):
the function against one masked softmax over the whole context on seeded
random shapes, the merge, the transformers glue, the engine switched to it
on the tiny seeded model, and the ``--device`` plumbing."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from policies.table import Decision
from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.engine import cascade as cascade_mod
from worker.reference.engine.attention import GROUPED_SDPA
from worker.reference.engine.cascade import (
    CASCADE_SDPA,
    Partial,
    attend_prefix,
    attend_tree,
    cascade_attention,
    merge_attention,
    use_cascade_attention,
)
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.engine.tree import tree_buffers
from worker.reference.models import default_device, set_default_device, tiny_llama

# --------------------------------------------------------------------------
# random cases
# --------------------------------------------------------------------------


def _random_case(seed: int, dtype: torch.dtype):
    """One verify step's attention inputs, laid out as the engine lays them out:
    a rectangular prefix ``[batch, kv_heads, past, dim]`` with per-row left
    padding and compaction holes (``valid``), and every row's own tree padded
    to the largest block (pad entries see only themselves, as in ``batch.py``)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    batch = rng.randint(1, 4)
    kv_heads = rng.choice([1, 2])
    ratio = rng.choice([1, 3])
    heads = kv_heads * ratio
    dim = rng.choice([8, 16])
    past = rng.choice([0, rng.randint(1, 300)])
    valid = torch.zeros(batch, past, dtype=torch.bool)  # [batch, past]
    for b in range(batch):
        real = rng.randint(0, past)  # real slots of this row; the rest is left padding
        valid[b, past - real :] = True
        if real > 2:
            valid[b, past - real :] &= torch.rand(real, generator=g) > 0.2  # holes
    sizes = [rng.randint(1, 16) for _ in range(batch)]  # block entries per row (root + nodes)
    q = max(sizes)
    tree_mask = torch.eye(q, dtype=torch.bool).repeat(batch, 1, 1)  # [batch, q, q]; pads: themselves only
    for b, size in enumerate(sizes):
        parents = [rng.randint(-1, i - 1) for i in range(size - 1)]
        tree_mask[b, :size, :size] = tree_buffers(parents).attn_mask

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    query = randn(batch, heads, q, dim)  # [batch, heads, q, dim]
    prefix_k, prefix_v = randn(batch, kv_heads, past, dim), randn(batch, kv_heads, past, dim)
    tree_k, tree_v = randn(batch, kv_heads, q, dim), randn(batch, kv_heads, q, dim)
    return query, prefix_k, prefix_v, valid, tree_k, tree_v, tree_mask


def _reference(query, prefix_k, prefix_v, valid, tree_k, tree_v, tree_mask, scale=None):
    """One softmax over ``[prefix | block]`` with one boolean mask, in float64,
    KV heads copied out (``repeat_interleave``): ``(out, lse)``."""
    batch, heads, q, dim = query.shape
    ratio = heads // prefix_k.shape[1]
    key = torch.cat([prefix_k, tree_k], dim=2).double().repeat_interleave(ratio, dim=1)  # [batch, heads, kv, dim]
    value = torch.cat([prefix_v, tree_v], dim=2).double().repeat_interleave(ratio, dim=1)
    allowed = torch.cat([valid[:, None, :].expand(batch, q, valid.shape[1]), tree_mask], dim=-1)  # [batch, q, kv]
    scale = dim**-0.5 if scale is None else scale
    scores = (query.double() @ key.transpose(-1, -2)) * scale  # [batch, heads, q, kv]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [batch, heads, q]
    return torch.softmax(scores, -1) @ value, lse


CASES = range(40)


@pytest.mark.parametrize("seed", CASES)
def test_matches_one_masked_softmax_float64(seed):
    case = _random_case(seed, torch.float64)
    out, lse = cascade_attention(*case)
    ref_out, ref_lse = _reference(*case)
    assert out.dtype == torch.float64 and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)
    # and torch's own SDPA with the same boolean mask over the whole context (GQA by enable_gqa)
    query, prefix_k, prefix_v, valid, tree_k, tree_v, tree_mask = case
    batch, _, q, _ = query.shape
    allowed = torch.cat([valid[:, None, :].expand(batch, q, valid.shape[1]), tree_mask], dim=-1)[:, None]
    sdpa = F.scaled_dot_product_attention(query, torch.cat([prefix_k, tree_k], 2), torch.cat([prefix_v, tree_v], 2),
                                          attn_mask=allowed, enable_gqa=query.shape[1] != prefix_k.shape[1])
    torch.testing.assert_close(out, sdpa, atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", CASES)
def test_matches_one_masked_softmax_float32(seed):
    case = _random_case(seed, torch.float32)
    out, lse = cascade_attention(*case)
    ref_out, ref_lse = _reference(*case)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def test_cases_cover_the_shapes_asked_for():
    """The seeded cases hold batches 1-4, GQA ratios 1 and 3, empty and long
    prefixes, rows with different real lengths, and blocks of 1-16 entries."""
    seen = {"batch": set(), "ratio": set(), "q": set(), "empty": False, "long": False, "ragged": False}
    for seed in CASES:
        query, prefix_k, _, valid, *_ = _random_case(seed, torch.float64)
        seen["batch"].add(query.shape[0])
        seen["ratio"].add(query.shape[1] // prefix_k.shape[1])
        seen["q"].add(query.shape[2])
        seen["empty"] |= valid.shape[1] == 0
        seen["long"] |= valid.shape[1] > 200
        seen["ragged"] |= len(set(valid.sum(-1).tolist())) > 1
    assert seen["batch"] == {1, 2, 3, 4} and seen["ratio"] == {1, 3}
    assert min(seen["q"]) <= 2 and max(seen["q"]) == 16
    assert seen["empty"] and seen["long"] and seen["ragged"]


def test_additive_mask_and_head_broadcast_forms_agree():
    """The engine's mask form (additive, dtype-min, ``[batch, 1, q, q]``), a
    2-D tree mask shared by all rows and a per-head mask give one answer."""
    query, prefix_k, prefix_v, valid, tree_k, tree_v, _ = _random_case(3, torch.float64)
    batch, heads, q, _ = query.shape
    rng = random.Random(3)
    shared = tree_buffers([rng.randint(-1, i - 1) for i in range(q - 1)]).attn_mask  # [q, q]
    additive = torch.zeros(batch, 1, q, q, dtype=torch.float64).masked_fill(~shared, torch.finfo(torch.float64).min)
    per_head = shared[None, None].expand(batch, heads, q, q)
    ref, _ = _reference(query, prefix_k, prefix_v, valid, tree_k, tree_v, shared[None].expand(batch, q, q))
    for mask in (shared, additive, per_head):
        out = cascade_attention(query, prefix_k, prefix_v, valid, tree_k, tree_v, mask).out
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_empty_prefix_is_the_tree_part_alone():
    query, _, _, _, tree_k, tree_v, tree_mask = _random_case(5, torch.float64)
    batch, _, _, dim = query.shape
    empty = tree_k[:, :, :0]  # [batch, kv_heads, 0, dim]
    prefix = attend_prefix(query, empty, empty, torch.zeros(batch, 0, dtype=torch.bool))
    assert torch.all(prefix.out == 0) and torch.all(prefix.lse == float("-inf"))
    tree = attend_tree(query, tree_k, tree_v, tree_mask)
    both = cascade_attention(query, empty, empty, None, tree_k, tree_v, tree_mask)
    torch.testing.assert_close(both.out, tree.out, atol=0, rtol=0)
    torch.testing.assert_close(both.lse, tree.lse, atol=0, rtol=0)


def test_merge_is_symmetric_and_an_empty_part_changes_nothing():
    g = torch.Generator().manual_seed(9)
    a = Partial(torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64),
                torch.randn(2, 3, 4, generator=g, dtype=torch.float64))
    b = Partial(torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64),
                torch.randn(2, 3, 4, generator=g, dtype=torch.float64) + 3)
    ab, ba = merge_attention(a, b), merge_attention(b, a)
    torch.testing.assert_close(ab.out, ba.out, atol=1e-14, rtol=0)
    torch.testing.assert_close(ab.lse, torch.logaddexp(a.lse, b.lse), atol=1e-14, rtol=0)
    nothing = Partial(torch.zeros_like(a.out), torch.full_like(a.lse, float("-inf")))
    kept = merge_attention(nothing, a)
    torch.testing.assert_close(kept.out, a.out, atol=1e-14, rtol=0)
    torch.testing.assert_close(kept.lse, a.lse, atol=0, rtol=0)
    none = merge_attention(nothing, nothing)
    assert torch.all(none.out == 0) and torch.all(none.lse == float("-inf"))


def test_half_precision_inputs_accumulate_in_fp32():
    case = _random_case(11, torch.bfloat16)
    out, lse = cascade_attention(*case)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, _ = _reference(*case)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)


# --------------------------------------------------------------------------
# transformers glue and the engine
# --------------------------------------------------------------------------


def test_switch_takes_sdpa_models_and_plain_calls_attend_as_before():
    reference, vocab = tiny_llama(seed=3)
    model, _ = tiny_llama(seed=3)
    assert use_cascade_attention(model) and model.config._attn_implementation == CASCADE_SDPA
    assert use_cascade_attention(model)
    eager, _ = tiny_llama(seed=3, attn_implementation="eager")
    assert not use_cascade_attention(eager) and eager.config._attn_implementation == "eager"
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    from worker.reference.engine.attention import use_grouped_attention

    use_grouped_attention(reference)
    with torch.inference_mode():  # no prefix kwarg: the CPU's grouped SDPA, bit for bit
        assert torch.equal(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


def test_engine_on_the_cpu_keeps_its_masked_path():
    model, _ = tiny_llama(seed=5)
    engine = Engine(model, NgramDrafter())
    assert not engine.cascade and model.config._attn_implementation == GROUPED_SDPA
    eager, _ = tiny_llama(seed=5, attn_implementation="eager")
    with pytest.raises(ValueError, match="SDPA"):
        Engine(eager, cascade=True)


def _recording(engine: Engine) -> list[torch.Tensor]:
    """Every verify's logits (the real block entries of every row), in order."""
    seen: list[torch.Tensor] = []
    accept = engine._accept

    def record(trees, logits, sizes, *rules):  # rules: each row's acceptance rule (issue #29)
        seen.append(logits.clone())
        return accept(trees, logits, sizes, *rules)

    engine._accept = record
    return seen


@pytest.mark.model
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_verify_through_cascade_equals_the_masked_path(monkeypatch, temperature):
    """Same tiny model, same drafter, same seed: the engine switched to cascade
    attention verifies with the logits of its masked path (trees of width 2,
    rows of different lengths joining and leaving, so left padding and holes)."""
    vocab = tiny_llama(seed=6)[1]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=g).repeat(3).tolist() for n in (5, 2, 7, 4, 6)]
    calls = []
    real = cascade_mod.cascade_attention
    monkeypatch.setattr(cascade_mod, "cascade_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = {}
    for cascade in (False, True):
        model, _ = tiny_llama(seed=6)
        engine = Engine(model, NgramDrafter(max_depth=4, max_width=2, max_tree_nodes=6),
                        static_decide(Decision(3, 2, 5)), max_batch=3, temperature=temperature, seed=1,
                        cascade=cascade)
        assert engine.cascade is cascade
        logits = _recording(engine)
        outputs = engine.generate(prompts, 16)
        assert engine.stats.draft_nodes > 0 and engine.stats.steps > 1
        runs[cascade] = outputs, logits, engine.stats.accepted
        assert bool(calls) is cascade
    (out_a, logits_a, acc_a), (out_b, logits_b, acc_b) = runs[False], runs[True]
    assert out_a == out_b and acc_a == acc_b
    assert len(logits_a) == len(logits_b)
    for a, b in zip(logits_a, logits_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    if temperature == 0.0:  # and greedy stays what generate says
        reference, _ = tiny_llama(seed=6)
        for prompt, out in zip(prompts, out_b):
            x = torch.tensor([prompt])
            y = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16)
            assert out == y[0, len(prompt):].tolist()


# --------------------------------------------------------------------------
# --device
# --------------------------------------------------------------------------


def test_default_device_is_the_cpu_and_unusable_devices_are_refused():
    assert default_device() == torch.device("cpu")
    assert set_default_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        set_default_device("warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            set_default_device("cuda")
    assert default_device() == torch.device("cpu")  # a refused device leaves the default alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("argv", [
    ["worker", "--device", "cuda", "--drafter", "ngram"],
    ["worker", "--device", "cuda:0", "--drafter", "medusa"],  # heads follow the target: refused for CUDA only
    ["worker", "--device", "warp-drive", "--drafter", "none"],
    ["train-heads", "--drafter", "eagle", "--out", "unused", "--device", "cuda"],
    ["bench", "engine", "--device", "cuda"],
])
def test_cli_refuses_a_device_torch_cannot_use(argv, capsys):
    from specctl.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--device" in err and ("not available" in err or "not a torch device" in err)
    assert default_device() == torch.device("cpu")


def test_cli_device_defaults_to_cpu():
    from specctl.cli import build_parser

    parser = build_parser()
    for argv in (["worker"], ["bench", "engine"], ["train-heads", "--drafter", "eagle", "--out", "x"]):
        assert parser.parse_args(argv).device == "cpu"
