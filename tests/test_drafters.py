"""Drafters in isolation: tree shapes within the decision, prompt lookup,
Medusa's zero-initialised heads, and EAGLE's batched tree expansion against
a plain sequential run of its head."""

from __future__ import annotations

import pytest
import torch

from policies.table import Decision
from worker.reference.drafters.base import CatchUp, DraftContext, Drafter, DraftTree, best_first_tree
from worker.reference.drafters.eagle import EagleDrafter
from worker.reference.drafters.medusa import MedusaDrafter
from worker.reference.drafters.ngram import NgramDrafter
from worker.reference.drafters.oracle import OracleDrafter
from worker.reference.heads.modules import EagleHead
from worker.reference.heads.store import HeadsBundle
from worker.reference.models import tiny_llama


def _check_shape(tree: DraftTree, d: Decision) -> None:
    assert tree.num_nodes <= d.max_nodes
    assert tree.depth() <= d.depth
    assert tree.max_children() <= max(d.width, 0)
    for i, p in enumerate(tree.parents):
        assert -1 <= p < i
    assert all(0.0 <= c <= 1.0 + 1e-6 for c in tree.confidences)


def test_draft_tree_validates_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        DraftTree([-1], [1, 2], [0.5])
    t = DraftTree.chain([4, 5, 6])
    assert t.parents == [-1, 0, 1] and t.depth() == 3 and t.max_children() == 1


@pytest.mark.parametrize("d", [Decision(3, 2, 5), Decision(4, 3, 9), Decision(2, 4, 8), Decision.chain(3)])
def test_best_first_tree_is_prefix_closed_and_best_first(d):
    levels = [[(10 * lvl + r, p) for r, p in enumerate([0.6, 0.25, 0.1, 0.05])] for lvl in range(4)]
    tree = best_first_tree(levels, d)
    _check_shape(tree, d)
    assert tree.num_nodes == min(d.max_nodes, sum(d.width ** k for k in range(1, d.depth + 1)))
    # scores of chosen nodes >= any excluded candidate's: the chain of top-1 is always in
    assert tree.tokens[0] == 0 and (d.depth < 2 or 10 in tree.tokens)


def test_ngram_chain_follows_the_most_recent_match():
    ng = NgramDrafter(max_ngram=3)
    toks = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    (tree,) = ng.propose([DraftContext("r", toks)], [Decision.chain(3)])
    assert tree.tokens == [5, 6, 7]  # the later occurrence of 1 2 3 wins
    # incremental update: extend the same request and look up again
    toks2 = toks + [5, 6]
    (tree,) = ng.propose([DraftContext("r", toks2)], [Decision.chain(2)])
    assert tree.tokens == [7, 1]
    (none,) = ng.propose([DraftContext("s", [1, 2, 3])], [Decision.chain(3)])
    assert none.num_nodes == 0


def test_ngram_tree_merges_distinct_continuations():
    ng = NgramDrafter(max_ngram=2, max_width=3)
    toks = [7, 8, 1, 7, 8, 2, 7, 8, 1, 4, 7, 8]
    d = Decision(2, 3, 6)
    (tree,) = ng.propose([DraftContext("r", toks)], [d])
    _check_shape(tree, d)
    level1 = [t for t, p in zip(tree.tokens, tree.parents) if p == -1]
    assert sorted(level1) == [1, 2]
    assert level1[0] == 1  # seen twice: the highest confidence comes first
    assert tree.confidences[tree.tokens.index(1)] > tree.confidences[tree.tokens.index(2)]


def test_oracle_replays_the_truth():
    o = OracleDrafter({(1, 2): [3, 4, 5, 6]}, max_depth=4)
    (t,) = o.propose([DraftContext("r", [1, 2, 3], prompt_len=2)], [Decision.chain(2)])
    assert t.tokens == [4, 5]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return tiny_llama(seed=0)


def test_medusa_zero_init_heads_predict_the_next_token(tiny):
    model, vocab = tiny
    b = HeadsBundle.build("medusa", {"hidden": 64, "num_heads": 3}, torch.arange(vocab))
    dr = MedusaDrafter(b, model, max_width=2)
    assert isinstance(dr, Drafter)
    feats = torch.randn(4, 64)
    d = Decision(3, 2, 6)
    (tree,) = dr.propose([DraftContext("r", [1, 2, 3, 4, 5], feats)], [d])
    _check_shape(tree, d)
    nxt = int((feats[-1] @ model.lm_head.weight.T).argmax())
    # W1 = 0: h + SiLU(0) = h, so every head's top-1 is the LM head's argmax on the last feature
    assert tree.tokens[0] == nxt
    (chain,) = dr.propose([DraftContext("r", [1, 2, 3, 4, 5, 6])], [Decision.chain(3)])  # no new features
    assert chain.tokens == [nxt] * 3 and chain.parents == [-1, 0, 1]


def _eagle(model, vocab, seed=0):
    torch.manual_seed(seed)
    b = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), torch.arange(vocab))
    for p in b.module.parameters():  # a random, non-trivial head
        torch.nn.init.normal_(p, std=0.2)
    return b


@torch.no_grad()
def _sequential(head, model, feats, tokens, path):
    """The head run from scratch over pairs (f_t, x_{t+1}), then along ``path``
    feeding its own outputs: the distribution of each next draft token."""
    emb = model.get_input_embeddings()
    n = feats.shape[0]
    x_feat = feats.clone()
    x_tok = list(tokens[1 : n + 1])
    outs = []
    for step in range(len(path) + 1):
        fe = x_feat[None]
        te = emb(torch.tensor([x_tok])).float()
        pos = torch.arange(fe.shape[1])[None]
        out, _, _ = head(fe, te, pos)
        last = out[0, -1]
        outs.append(last)
        if step < len(path):
            x_feat = torch.cat([x_feat, last[None]])
            x_tok.append(path[step])
    return outs


def test_eagle_tree_matches_sequential_head(tiny):
    model, vocab = tiny
    b = _eagle(model, vocab)
    dr = EagleDrafter(b, model, max_depth=4, max_width=3, max_tree_nodes=40)
    assert isinstance(dr, Drafter)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (9,), generator=gen).tolist()
    feats = torch.randn(8, 64, generator=gen)
    d = Decision(3, 3, 39)  # everything expanded: 3 + 9 + 27 candidates, top 3 per level
    (tree,) = dr.propose([DraftContext("r", tokens, feats)], [d])
    _check_shape(tree, d)
    lm = model.lm_head.weight
    # every expanded node's children must be the top-3 of the sequential head along its path
    kids = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)

    def path_to(i):
        out = []
        while i >= 0:
            out.append(tree.tokens[i])
            i = tree.parents[i]
        return out[::-1]

    checked = 0
    for parent, children in kids.items():
        path = [] if parent < 0 else path_to(parent)
        outs = _sequential(b.module, model, feats, tokens, path)
        top = torch.softmax(outs[-1] @ lm.T, -1).topk(3)
        got = [tree.tokens[c] for c in children]
        assert got == top.indices.tolist()[: len(got)], (parent, path)
        for c, p in zip(children, top.values.tolist()):
            assert tree.confidences[c] == pytest.approx(p, rel=1e-4, abs=1e-5)
        checked += 1
    assert checked >= 4  # root plus several expanded nodes, not only the first branch


def test_eagle_incremental_ingest_equals_fresh(tiny):
    """Feeding features step by step gives the same drafts as all at once."""
    model, vocab = tiny
    b = _eagle(model, vocab, seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (12,), generator=gen).tolist()
    feats = torch.randn(11, 64, generator=gen)
    d = Decision(3, 2, 6)
    fresh = EagleDrafter(b, model)
    (want,) = fresh.propose([DraftContext("x", tokens, feats)], [d])
    inc = EagleDrafter(b, model)
    inc.propose([DraftContext("x", tokens[:6], feats[:5])], [Decision.off()])
    inc.propose([DraftContext("x", tokens[:9], feats[5:8])], [d])
    (got,) = inc.propose([DraftContext("x", tokens, feats[8:])], [d])
    assert got.tokens == want.tokens and got.parents == want.parents
    assert got.confidences == pytest.approx(want.confidences, rel=1e-4)
    # batched with another request of a different length: same answer
    other = EagleDrafter(b, model)
    got2, _ = other.propose([DraftContext("x", tokens, feats), DraftContext("y", tokens[:4], feats[:3])], [d, d])
    assert got2.tokens == want.tokens and got2.parents == want.parents


def test_eagle_catch_up_leaves_only_new_pairs_to_the_first_draft(tiny):
    """``ingest_prompts`` and off steps only queue features; ``catch_up``
    runs the head over the queue (prompt and off steps) in one forward, so
    the next ``propose`` ingests its own step's features alone, and drafts
    what a drafter fed everything at once drafts."""
    model, vocab = tiny
    b = _eagle(model, vocab, seed=4)
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, vocab, (14,), generator=gen).tolist()
    feats = torch.randn(13, 64, generator=gen)  # features of tokens[0..12]; tokens[13] is the root
    d = Decision(3, 2, 6)
    (want,) = EagleDrafter(b, model).propose([DraftContext("x", tokens, feats)], [d])

    lazy = EagleDrafter(b, model)
    assert isinstance(lazy, CatchUp) and not isinstance(NgramDrafter(), CatchUp)
    pairs_run = []  # pairs (queries) of every head forward
    lazy.head.fc.register_forward_hook(lambda module, args, out: pairs_run.append(args[0].shape[1]))
    lazy.ingest_prompts([DraftContext("x", tokens[:8], feats[:7], 8)])
    lazy.propose([DraftContext("x", tokens[:10], feats[7:9])], [Decision.off()])
    assert pairs_run == []  # the prompt and an off step: queued, the head does not run
    lazy.catch_up([DraftContext("x", tokens[:12], None, 8)])  # tokens[10..11] were committed by the step before
    assert pairs_run == [7 + 2]  # the prompt minus its last token, and the off step's two
    lazy.catch_up([DraftContext("x", tokens[:12], None, 8), DraftContext("unknown", [1, 2], None, 1)])
    assert pairs_run == [9]  # nothing queued any more; a request it never saw is skipped
    (got,) = lazy.propose([DraftContext("x", tokens, feats[9:])], [d])
    assert pairs_run[1] == 4  # the step before's features only, not the queue again
    assert got.tokens == want.tokens and got.parents == want.parents
    assert got.confidences == pytest.approx(want.confidences, rel=1e-4)


def test_medusa_head_is_residual_block_then_projection():
    from worker.reference.heads.modules import MedusaHeads

    torch.manual_seed(0)
    m = MedusaHeads(8, 2)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
        m.proj.normal_()
    h = torch.randn(3, 8)
    out = m(h)
    for k in range(2):
        want = (h + torch.nn.functional.silu(h @ m.weight[k].T + m.bias[k])) @ m.proj[k].T
        torch.testing.assert_close(out[k], want)


def test_eagle_layer_equals_the_targets_decoder_layer():
    """With the target's weights copied in, the head's decoder layer computes what
    transformers' Llama layer does: RoPE at the given positions, grouped-query
    attention (4 query heads on 2 KV heads here), causal over a fresh block and
    over cached keys plus a new block."""
    from worker.reference.heads.modules import init_layer_from_target

    model, _ = tiny_llama(seed=3)
    head = EagleHead(**EagleHead.config_from_target(model.config)).eval()
    target = model.model.layers[1]
    init_layer_from_target(head, target)
    assert head.layer.heads == 2 * head.layer.kv_heads
    torch.manual_seed(0)
    x = torch.randn(2, 9, model.config.hidden_size)  # [batch, tokens, hidden]
    positions = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        want = target(x, position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions)
        want = want[0] if isinstance(want, tuple) else want
        full, k, v = head.layer(x, positions)
        torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
        # the last 3 tokens again, attending to the first 6 through their cached keys
        tail, _, _ = head.layer(x[:, 6:], positions[:, 6:], k[:, :, :6], v[:, :, :6], _causal_tail_mask(6, 3))
    torch.testing.assert_close(tail, want[:, 6:], rtol=1e-5, atol=1e-5)


def _causal_tail_mask(past: int, new: int) -> torch.Tensor:
    """Bool mask ``[1, 1, new, past + new]``: every cached key, then causal over the new block."""
    causal = torch.ones(new, new, dtype=torch.bool).tril()
    return torch.cat([torch.ones(new, past, dtype=torch.bool), causal], 1)[None, None]


def test_eagle_catch_up_window_runs_the_newest_pairs_at_their_own_positions(tiny):
    """With ``catch_up_window`` W a request's catch-up runs the head over its
    newest W queued pairs only: on the prompt the drafts equal those of a
    drafter that was given only those W features (same absolute positions);
    after an off stretch the head keeps what it cached before and adds the
    newest W behind a gap."""
    model, vocab = tiny
    b = _eagle(model, vocab, seed=7)
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, vocab, (22,), generator=gen).tolist()
    feats = torch.randn(21, 64, generator=gen)
    d = Decision(3, 2, 6)
    with pytest.raises(ValueError, match="catch_up_window"):
        EagleDrafter(b, model, catch_up_window=0)

    windowed = EagleDrafter(b, model, catch_up_window=4)
    assert windowed.limits.catch_up_window == 4 and EagleDrafter(b, model).limits.catch_up_window == 0
    pairs_run = []
    windowed.head.fc.register_forward_hook(lambda module, args, out: pairs_run.append(args[0].shape[1]))
    (got,) = windowed.propose([DraftContext("x", tokens[:12], feats[:11])], [d])
    (want,) = EagleDrafter(b, model).propose([DraftContext("x", tokens[:12], feats[7:11])], [d])
    assert pairs_run[0] == 4  # not 11
    assert got.tokens == want.tokens and got.parents == want.parents
    assert got.confidences == pytest.approx(want.confidences, rel=1e-4)

    # Off for six tokens (queued), then on again with two new features: eight queued, four run.
    windowed.propose([DraftContext("x", tokens[:18], feats[11:17])], [Decision.off()])
    runs_before = len(pairs_run)
    (resumed,) = windowed.propose([DraftContext("x", tokens[:20], feats[17:19])], [d])
    state = windowed._state["x"]
    assert pairs_run[runs_before] == 4
    assert state.k.shape[1] == 4 + 4 and state.pairs == 19  # cached 7..10, gap 11..14, then 15..18
    assert resumed.tokens and len(resumed.tokens) == len(resumed.parents)
    # Without a window the same history runs all eight queued pairs.
    full = EagleDrafter(b, model)
    full.propose([DraftContext("x", tokens[:12], feats[:11])], [d])
    full.propose([DraftContext("x", tokens[:18], feats[11:17])], [Decision.off()])
    full.propose([DraftContext("x", tokens[:20], feats[17:19])], [d])
    assert full._state["x"].k.shape[1] == full._state["x"].pairs == 19
