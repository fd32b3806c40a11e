"""Speculative sampling keeps the target distribution: chains and trees.

Every check is a chi-square goodness of fit of emitted tokens against the
target's law, with a fixed seed and a generous bar (p > 1e-3); the same
check applied to deliberately broken verification must fail (p < 1e-6),
so it has the power to catch a real bug.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from policies.table import Decision
from worker.reference.drafters.base import DraftTree
from worker.reference.engine import engine as engine_module
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.engine.sampling import TreeSample, sample_accept_chain, sample_accept_tree
from worker.reference.models import tiny_llama

PASS = 1e-3  # a correct sampler fails this once in a thousand seeds
FAIL = 1e-6


def gof_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``expected`` (same total);
    cells expected below 5 are pooled so the test stays valid."""
    counts, expected = counts.double(), expected.double()
    expected = expected / expected.sum() * counts.sum()  # renormalise float rounding
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def _chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    return gof_pvalue(torch.bincount(samples, minlength=len(probs)), probs)


# --------------------------------------------------------------------------
# chains (batched rejection sampling)
# --------------------------------------------------------------------------

P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.07, 0.03],
        [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
    ]
)  # target, positions 0..2 (2 = bonus)
Q = torch.tensor(
    [
        [0.10, 0.40, 0.30, 0.00, 0.10, 0.10],  # q(3) = 0 < p(3): only the residual can emit 3
        [0.30, 0.10, 0.20, 0.20, 0.10, 0.10],
    ]
)  # drafter, positions 0..1
TRIALS = 20_000


def _draft(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.multinomial(q[k], TRIALS, replacement=True, generator=gen) for k in range(len(q))], 1)


def test_sample_accept_chain_preserves_target_distribution():
    gen = torch.Generator().manual_seed(0)
    drafts = _draft(Q, gen)  # [trials, 2]
    out = sample_accept_chain(P.expand(TRIALS, -1, -1), Q.expand(TRIALS, -1, -1), drafts, gen)
    first = torch.where(out.tau >= 1, drafts[:, 0], out.next_token)
    assert _chi2_pvalue(first, P[0]) > PASS

    # Position-independent p: given the first token was accepted, the second
    # emitted token must follow p[1] (exercises tau-indexing past 0).
    reached = out.tau >= 1
    second = torch.where(out.tau[reached] >= 2, drafts[reached, 1], out.next_token[reached])
    assert _chi2_pvalue(second, P[1]) > PASS
    # every draft accepted: the bonus is drawn from the last row of p
    assert _chi2_pvalue(out.next_token[out.tau == 2], P[2]) > PASS
    # acceptance at position 0 is sum(min(p, q)) (= 0.60 here)
    alpha = torch.minimum(P[0], Q[0]).sum().item()
    assert abs(reached.double().mean().item() - alpha) < 0.02


def test_sample_accept_chain_equal_drafter_accepts_all_and_samples_bonus():
    gen = torch.Generator().manual_seed(1)
    q = P[:2]
    drafts = _draft(q, gen)
    out = sample_accept_chain(P.expand(TRIALS, -1, -1), q.expand(TRIALS, -1, -1), drafts, gen)
    assert bool((out.tau == 2).all())
    assert _chi2_pvalue(out.next_token, P[2]) > PASS


# --------------------------------------------------------------------------
# trees (recursive rejection sampling over siblings), synthetic laws
# --------------------------------------------------------------------------

V = 8
CHAIN = [-1, 0]
TWO_BY_TWO = [-1, -1, 0, 0, 1, 1]


def _laws(seed: int, sharpness: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random laws after the root ``[V]``, after one token ``[V, V]`` and
    after two ``[V, V, V]``: normalised ``Exp(1) ** sharpness`` (peaked for
    sharpness > 1)."""
    gen = torch.Generator().manual_seed(seed)

    def law(*shape):
        g = (-torch.log(torch.rand(*shape, V, generator=gen))) ** sharpness
        return g / g.sum(-1, keepdim=True)

    return law(), law(V), law(V, V)


TARGET = _laws(0, 1.5)
DRAFT = _laws(1, 1.5)  # a different, imperfect drafter


def _draft_tree(parents, sampled: bool, gen) -> tuple[list[int], torch.Tensor | None]:
    """Tokens for ``parents``: per node, its children drawn without
    replacement from the drafter's law there (``sampled``), or its top
    candidates by that law (deterministic: the tokens depend on the context only)."""
    q_root, q_one, _ = DRAFT
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    tokens = [0] * len(parents)
    rows = [None] * len(parents)
    frontier = [(-1, q_root)]
    while frontier:
        node, q = frontier.pop()
        children = kids.get(node, [])
        if not children:
            continue
        picks = (torch.multinomial(q, len(children), replacement=False, generator=gen) if sampled
                 else q.topk(len(children)).indices)
        for child, tok in zip(children, picks.tolist()):
            tokens[child] = tok
            rows[child] = q
            frontier.append((child, q_one[tok]))
    return tokens, torch.stack(rows) if sampled else None


def _target_rows(parents, tokens) -> torch.Tensor:
    """Block-coordinate target laws: row 0 after the root, row i+1 after node i."""
    p_root, p_one, p_two = TARGET
    rows = [p_root]
    for i, parent in enumerate(parents):
        rows.append(p_one[tokens[i]] if parent < 0 else p_two[tokens[parent], tokens[i]])
    return torch.stack(rows)


def _run_trees(verify, parents, sampled: bool, trials: int, seed: int):
    """First emitted token per trial, and per trial that accepted a level-1
    node its token and the second emitted token."""
    gen = torch.Generator().manual_seed(seed)
    first, reached, second = [], [], []
    for _ in range(trials):
        tokens, proposal = _draft_tree(parents, sampled, gen)
        out = verify(_target_rows(parents, tokens), parents, tokens, proposal, gen)
        emitted = [tokens[j - 1] for j in out.path[1:]] + [out.next_token]
        first.append(emitted[0])
        if len(out.path) > 1:
            reached.append(emitted[0])
            second.append(emitted[1])
    return torch.tensor(first), torch.tensor(reached), torch.tensor(second)


def _tree_pvalues(verify, parents, sampled: bool, trials: int = 4000, seed: int = 0) -> tuple[float, float]:
    """(first token vs p_root, second token vs p(. | first) for trials that
    accepted a level-1 draft): the second check holds conditionally on the
    accepted path, so its expected counts mix p(. | x1) over the observed x1."""
    p_root, p_one, _ = TARGET
    first, reached, second = _run_trees(verify, parents, sampled, trials, seed)
    expected_second = p_one[reached].sum(0)
    return (_chi2_pvalue(first, p_root),
            gof_pvalue(torch.bincount(second, minlength=V), expected_second))


def accept_always(target_probs, parents, tokens, proposal=None, generator=None) -> TreeSample:
    """Broken verification: takes the first child at every level, then a bonus."""
    path, node = [0], 0
    while True:
        kids = [i + 1 for i, p in enumerate(parents) if p + 1 == node]
        if not kids:
            return TreeSample(path, int(torch.multinomial(target_probs[node], 1, generator=generator)))
        node = kids[0]
        path.append(node)


def forget_residual(target_probs, parents, tokens, proposal=None, generator=None) -> TreeSample:
    """Broken verification: tests every sibling against the unchanged p and
    falls back to p itself (no residual update)."""
    path, node = [0], 0
    while True:
        for kid in [i + 1 for i, p in enumerate(parents) if p + 1 == node]:
            x = tokens[kid - 1]
            q_x = 1.0 if proposal is None else float(proposal[kid - 1, x])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * q_x < float(target_probs[node, x]):
                path.append(kid)
                node = kid
                break
        else:
            return TreeSample(path, int(torch.multinomial(target_probs[node], 1, generator=generator)))


@pytest.mark.parametrize("parents", [CHAIN, TWO_BY_TWO], ids=["chain", "2x2"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "deterministic"])
def test_sample_accept_tree_preserves_target_distribution(parents, sampled):
    first, second = _tree_pvalues(sample_accept_tree, parents, sampled)
    assert first > PASS and second > PASS


@pytest.mark.parametrize("broken", [accept_always, forget_residual])
def test_broken_tree_verification_fails_the_same_check(broken):
    first, second = _tree_pvalues(broken, TWO_BY_TWO, sampled=True)
    assert min(first, second) < FAIL


def test_sample_accept_tree_acceptance_covers_the_candidates_mass():
    # Deterministic candidates: P(some root child accepted) = p(x1) + p(x2).
    _, reached, _ = _run_trees(sample_accept_tree, TWO_BY_TWO, False, 4000, 3)
    top2 = DRAFT[0].topk(2).indices
    assert abs(len(reached) / 4000 - float(TARGET[0][top2].sum())) < 0.03


def test_sample_accept_tree_refuses_a_candidate_its_proposal_cannot_draw():
    probs = torch.full((3, 4), 0.25)
    proposal = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="draft node 1 \\(token 2\\) has proposal probability 0"):
        sample_accept_tree(probs, [-1, -1], [0, 2], proposal, torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------
# the engine at temperature > 0 on a tiny seeded model
# --------------------------------------------------------------------------

ROWS = 2000
TEMPERATURE = 0.8
# Two root children, the first with two children: the 2x2 shape within
# Decision(depth=2, width=2), whose node budget is depth x width = 4.
ENGINE_TREE = [-1, -1, 0, 0]


@pytest.fixture(scope="module")
def tiny_laws():
    """The tiny model, a prompt and the target's laws of the first three new
    tokens: ``p1`` of the first (the prefill samples it), ``p2_given[x1]`` /
    ``p3_given[x1, x2]`` of the next ones given those before (the first
    step, which drafts, decides the second and third), and the marginals
    ``p2`` = Σ p1(x1) p2(. | x1), ``p3`` likewise."""
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    prompt = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(11)).tolist()
    law = lambda ids: torch.softmax(model(ids).logits[:, -1] / TEMPERATURE, -1)  # noqa: E731
    with torch.inference_mode():
        p1 = law(torch.tensor([prompt]))[0]
        after = torch.arange(vocab)
        ext = torch.cat([torch.tensor([prompt]).expand(vocab, -1), after[:, None]], 1)
        p2_given = law(ext)  # [vocab, vocab]
        ext2 = torch.cat([ext.repeat_interleave(vocab, 0), after.repeat(vocab)[:, None]], 1)
        p3_given = law(ext2).view(vocab, vocab, vocab)  # [x1, x2, vocab]
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return model, vocab, prompt, (p1, p2, p3), p2_given, p3_given


class TopTwoOfTarget:
    """Deterministic ``ENGINE_TREE`` trees: on the first step (the root is
    the first token x1, from the prefill) the target's own top-2 of the
    second token and the first one's top-2 of the third (likely tokens, so
    a biased verifier shows); elsewhere fixed tokens."""

    kind = "test-top2"
    needs_hidden = False
    version = "test"

    def __init__(self, prompt, p2_given, p3_given):
        from policies.base import DrafterLimits

        self.limits = DrafterLimits(self.kind, self.version, 2, 2, 4)
        self.p2_given, self.p3_given = p2_given, p3_given
        self.prompt_len = len(prompt)

    def _first_step(self, x1: int) -> list[int]:
        second = self.p2_given[x1].topk(2).indices.tolist()
        return second + self.p3_given[x1, second[0]].topk(2).indices.tolist()

    def propose(self, contexts, decisions):
        out = []
        for ctx in contexts:
            on_first = len(ctx.tokens) == self.prompt_len + 1
            tokens = self._first_step(ctx.tokens[-1]) if on_first else [1, 2, 3, 4]
            out.append(DraftTree(list(ENGINE_TREE), list(tokens), [0.6, 0.4, 0.6, 0.4]))
        return out

    def release(self, request_id):
        pass


class SampledFromFixedLaw(TopTwoOfTarget):
    """``ENGINE_TREE`` trees whose siblings are drawn without replacement
    from a fixed law ``q`` (independent of the context), ``proposal`` set."""

    def __init__(self, prompt, p2_given, p3_given, vocab, seed=5):
        super().__init__(prompt, p2_given, p3_given)
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)
        self.gen = gen

    def propose(self, contexts, decisions):
        out = []
        for _ in contexts:
            root = torch.multinomial(self.q, 2, replacement=False, generator=self.gen).tolist()
            below = torch.multinomial(self.q, 2, replacement=False, generator=self.gen).tolist()
            out.append(DraftTree(list(ENGINE_TREE), root + below, [0.5] * 4, proposal=self.q.expand(4, -1)))
        return out


def _engine_pvalues(model, drafter, prompt, laws, seed=0) -> list[float]:
    """p-values of the first three tokens of ``ROWS`` sampled answers against their laws."""
    engine = Engine(model, drafter, static_decide(Decision(2, 2, 4)), max_batch=ROWS, temperature=TEMPERATURE,
                    seed=seed)
    outs = engine.generate([prompt] * ROWS, 3)
    assert engine.stats.accepted > 0  # the drafts were really verified, not bypassed
    return [_chi2_pvalue(torch.tensor([o[i] for o in outs]), law) for i, law in enumerate(laws)]


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["top2-of-target", "sampled-q"])
def test_engine_sampling_follows_the_target_first_three_tokens(tiny_laws, drafter):
    model, vocab, prompt, laws, p2_given, p3_given = tiny_laws
    d = (TopTwoOfTarget(prompt, p2_given, p3_given) if drafter == "top2-of-target"
         else SampledFromFixedLaw(prompt, p2_given, p3_given, vocab))
    assert min(_engine_pvalues(model, d, prompt, laws)) > PASS


@pytest.mark.model
def test_engine_with_broken_verification_fails_the_check(tiny_laws, monkeypatch):
    model, vocab, prompt, laws, p2_given, p3_given = tiny_laws
    monkeypatch.setattr(engine_module, "sample_accept_tree", forget_residual)
    # the first token comes from the prefill, with nothing drafted: the drafted ones must show the bias
    assert min(_engine_pvalues(model, TopTwoOfTarget(prompt, p2_given, p3_given), prompt, laws)[1:]) < FAIL


def test_engine_refuses_a_negative_temperature():
    model, _ = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="temperature must be >= 0.*-0.5"):
        Engine(model, temperature=-0.5)
