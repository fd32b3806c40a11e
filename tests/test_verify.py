"""Tree verification against plain causal passes and ``generate``.

All model tests use the tiny seeded Llama from ``worker.reference.models.tiny_llama``
(fp32, 2 layers, GQA 4/2): each forward is a millisecond or so.
"""

import pytest
import torch
from transformers import DynamicCache

from worker.reference.engine.tree import TreeBuffers, chain_parents, tree_buffers
from worker.reference.engine.verify import (
    compact_cache,
    greedy_accept,
    greedy_decode,
    prefill,
    verify_tree,
)
from worker.reference.models import tiny_llama

TWO_BY_TWO = [-1, -1, 0, 0, 1, 1]
DEPTH3_WIDTH2 = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
UNEVEN = [-1, 0, 0, 1, -1, 4]


@pytest.fixture(scope="module")
def tiny():
    model, vocab = tiny_llama(seed=0)
    return model, vocab


def _left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return ids, mask


@torch.inference_mode()
def _causal_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]  # [len, vocab]


# --------------------------------------------------------------------------
# (a) one tree pass == a causal pass per branch
# --------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("parents", [TWO_BY_TWO, DEPTH3_WIDTH2, UNEVEN], ids=["2x2", "d3w2", "uneven"])
@pytest.mark.parametrize("prompt_lens", [(9,), (9, 5)], ids=["batch1", "batch2-leftpad"])
def test_tree_branches_match_causal_passes(tiny, parents, prompt_lens):
    model, vocab = tiny
    gen = torch.Generator().manual_seed(len(parents) * 10 + len(prompt_lens))
    tree = tree_buffers(parents)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    ids, mask = _left_pad(prompts)
    batch = len(prompts)
    nodes = torch.randint(0, vocab, (batch, tree.num_nodes), generator=gen)  # [batch, n]

    cache = DynamicCache(config=model.config)
    past_valid = prefill(model, cache, ids, mask)
    block = torch.cat([ids[:, -1:], nodes], dim=1)  # [batch, n+1]
    logits = verify_tree(model, cache, block, tree, past_valid)  # [batch, n+1, vocab]
    assert logits.shape == (batch, tree.num_nodes + 1, vocab)

    for b, prompt in enumerate(prompts):
        for path in tree.retrieve_paths.tolist():
            path = [j for j in path if j >= 0]
            branch = block[b, path].tolist()  # root first
            ref = _causal_logits(model, prompt[:-1] + branch)[-len(path) :]
            torch.testing.assert_close(logits[b, path], ref, atol=1e-4, rtol=0)


@pytest.mark.model
def test_compact_cache_equals_prefill_of_accepted_path(tiny):
    """Gathering a non-contiguous path (root, n1, n4 of the 2x2 tree) must
    leave the cache a causal prefill of those tokens would leave."""
    model, vocab = tiny
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (1, 6), generator=gen)
    tree = tree_buffers(TWO_BY_TWO)
    nodes = torch.randint(0, vocab, (1, tree.num_nodes), generator=gen)
    block = torch.cat([prompt[:, -1:], nodes], dim=1)

    cache = DynamicCache(config=model.config)
    prefill(model, cache, prompt)
    past_len = cache.get_seq_length()
    verify_tree(model, cache, block, tree)
    kept = compact_cache(cache, past_len, torch.tensor([[0, 2, 5]]))
    assert kept.tolist() == [[True, True, True]]
    assert cache.get_seq_length() == past_len + 3

    accepted = torch.cat([prompt, block[:, [2, 5]]], dim=1)
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(accepted, cache=ref, use_cache=True)
    for mine, theirs in zip(cache.layers, ref.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=0)


def test_greedy_accept_picks_longest_agreeing_path():
    tree = tree_buffers(TWO_BY_TWO)  # block: 0 r, 1 n0, 2 n1, 3 n2, 4 n3, 5 n4, 6 n5
    vocab = 10
    # target argmax after each block entry
    target = torch.tensor([[7, 1, 3, 0, 0, 0, 0]])
    logits = torch.nn.functional.one_hot(target, vocab).float()  # [1, 7, vocab]
    # n1 (=7) matches the root's pick, n4 (=3) matches n1's pick; n0 is wrong
    nodes = torch.tensor([[5, 7, 1, 1, 3, 9]])
    acc = greedy_accept(logits, nodes, tree)
    assert acc.path.tolist() == [[0, 2, 5]]
    assert acc.tau.tolist() == [2]
    assert acc.bonus.tolist() == [0]  # target's pick after n4

    # nothing matches: only the root, bonus = root's pick
    acc = greedy_accept(logits, torch.tensor([[0, 0, 0, 0, 0, 0]]), tree)
    assert acc.path.tolist() == [[0, -1, -1]]
    assert acc.bonus.tolist() == [7]


# --------------------------------------------------------------------------
# (b) speculative greedy decode == generate
# --------------------------------------------------------------------------


def _children(tree: TreeBuffers) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
        kids.setdefault(i, [])
    return kids


def _drafter(trees, truth: list[list[int]], vocab: int, p_true: float, seed: int):
    """Random tokens everywhere, except along one random root-to-leaf walk
    where each node carries the true next token with probability ``p_true``.
    ``truth[b]`` is row b's full reference sequence (prompt + generate)."""
    gen = torch.Generator().manual_seed(seed)
    step = [0]

    def draft(committed):
        tree = tree_buffers(trees[step[0] % len(trees)])
        step[0] += 1
        kids = _children(tree)
        nodes = torch.randint(0, vocab, (len(committed), tree.num_nodes), generator=gen)
        for b, seq in enumerate(committed):
            future = truth[b][len(seq) :] + [0] * (tree.depth + 1)
            node, level = -1, 0
            while kids[node]:
                node = kids[node][int(torch.randint(len(kids[node]), (1,), generator=gen))]
                if float(torch.rand(1, generator=gen)) < p_true:
                    nodes[b, node] = future[level]
                level += 1
        return tree, nodes

    return draft


CASES = {
    "oracle-chain4": ([chain_parents(4)], 1.0),
    "oracle-2x2": ([TWO_BY_TWO], 1.0),
    "oracle-d3w2": ([DEPTH3_WIDTH2], 1.0),
    "random-2x2": ([TWO_BY_TWO], 0.0),
    "noisy-mixed": ([chain_parents(0), chain_parents(3), TWO_BY_TWO, DEPTH3_WIDTH2, UNEVEN, chain_parents(1)], 0.7),
}


@pytest.mark.model
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prompt_lens", [(8,), (8, 3, 11)], ids=["batch1", "batch3-leftpad"])
def test_greedy_decode_matches_generate(tiny, case, prompt_lens):
    model, vocab = tiny
    new_tokens = 24
    gen = torch.Generator().manual_seed(sum(prompt_lens))
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    ids, mask = _left_pad(prompts)
    width = ids.shape[1]
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    ref_new = ref[:, width:].tolist()
    truth = [p + r for p, r in zip(prompts, ref_new)]

    trees, p_true = CASES[case]
    out, taus = greedy_decode(model, ids, _drafter(trees, truth, vocab, p_true, seed=3), new_tokens, mask)
    assert out == ref_new

    if p_true == 1.0:  # the oracle is always right: every step accepts a full path
        depth = tree_buffers(trees[0]).depth
        assert min(taus[: len(taus) // 2]) == depth
    if p_true == 0.0:
        assert sum(taus) / len(taus) < 0.2  # random drafts are (nearly) all rejected


@pytest.mark.model
def test_greedy_decode_stops_at_eos(tiny):
    model, vocab = tiny
    prompt = torch.arange(5)[None]
    with torch.inference_mode():
        ref = model.generate(prompt, do_sample=False, max_new_tokens=12)[0, 5:].tolist()
    eos = ref[6]  # pretend the 7th generated token is EOS
    stop = ref.index(eos) + 1
    truth = [prompt[0].tolist() + ref]
    out, _ = greedy_decode(model, prompt, _drafter([chain_parents(3)], truth, vocab, 1.0, 0), 12, eos_token_id=eos)
    assert out == [ref[:stop]]
