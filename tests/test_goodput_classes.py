"""The goodput policy with request classes (issue #29): weighted goodput, TPOT
targets, relaxed acceptance and per-class probes, on hand-built observations."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from controller.models.cost import CostParams
from policies.base import ClassLoad, DrafterLimits, LoadProfile, Observation
from policies.classes import SINGLE, parse_classes
from policies.goodput import (
    RATIO_TOLERANCE,
    UNSEEN_CLASS_SHARE,
    BatchGroup,
    GoodputConfig,
    GoodputPolicy,
    class_mix,
    class_plan_estimate,
    step_goodput,
    table_goodput,
)
from policies.table import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, Decision
from tests.test_goodput_policy import FixedAcceptance, acceptance_with, observation

CTX = 500  # every request of these tests sits in context bucket 0


def with_classes(obs: Observation, spec: dict, default: str, shares: dict[str, float] | None = None,
                 **fields) -> Observation:
    """``obs`` with the classes of a policy file's ``classes:`` section and their loads."""
    loads = {name: ClassLoad(share=s) for name, s in (shares or {}).items()}
    loads.update(fields.pop("class_load", {}))
    return replace(obs, classes=parse_classes(spec, default, "test"), class_load=loads, **fields)


def policy(**config) -> GoodputPolicy:
    return GoodputPolicy(GoodputConfig(**{"probe_fraction": 0.0, **config}))


def nodes(plan, name: str, batch: int, ctx: int = CTX) -> int:
    return plan.table_for(name).lookup(batch, ctx).max_nodes


ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_without_classes_the_plan_is_the_one_before_classes():
    """Pinned from the policy as it was before classes (same observation, same
    numbers), and a policy file with one class changes nothing either."""
    accept = acceptance_with({0: 0.8, 2: 0.6, 6: 0.7})
    pinned = {
        4: (2122.9512162736473, [(6, 2, 12), (6, 2, 11), (0, 0, 0), (0, 0, 0), (0, 0, 0)]),
        48: (5864.682521891782, [(6, 2, 12), (6, 2, 12), (6, 2, 11), (6, 2, 9), (6, 2, 9)]),
    }
    cells = [(1, 500), (8, 500), (48, 3000), (128, 500), (256, 40000)]
    for mean_batch, share in ((4, {0: 1.0}), (48, {0: 0.5, 2: 0.3, 6: 0.2})):
        obs = observation(accept, share, mean_batch=mean_batch)
        assert obs.classes is SINGLE
        plan, _ = policy().decide((0, 0), obs)
        goodput, decisions = pinned[mean_batch]
        assert plan.expected_goodput_tok_s == pytest.approx(goodput, rel=1e-12)
        assert [plan.table.lookup(b, c) for b, c in cells] == [Decision(*d) for d in decisions]
        assert not plan.class_tables
        assert class_plan_estimate(plan, obs).goodput_tok_s == pytest.approx(table_goodput(plan.table, obs))
        one = with_classes(obs, {"gold": {"weight": 5, "tpot_target_ms": 1.0}}, None, {"gold": 1.0})
        again, _ = policy().decide((0, 0), one)
        assert again.table == plan.table and again.expected_goodput_tok_s == plan.expected_goodput_tok_s
        assert not again.class_tables


def test_two_classes_below_the_compute_ridge_both_speculate():
    obs = with_classes(observation(acceptance_with({0: 0.8}), {0: 1.0}, mean_batch=4),
                       {"interactive": {"weight": 4}, "batch": {}}, "batch",
                       {"interactive": 0.25, "batch": 0.75})
    plan, _ = policy().decide((0, 0), obs)
    assert set(plan.class_tables) == {"interactive", "batch"}
    assert plan.table == plan.class_tables["batch"]  # the default class's
    for b in (1, 4, 8):
        assert plan.table_for("interactive").lookup(b, CTX).depth >= 4
        assert plan.table_for("batch").lookup(b, CTX).depth >= 4


def test_past_the_ridge_the_best_effort_class_gives_way_first():
    """Same acceptance, same contexts; interactive tokens count four times. As
    the batch grows past the compute ridge the batch class's nodes drop out
    first: at no batch size does it draft more than interactive, and at some
    it is off while interactive still drafts (longer than one class would)."""
    accept = acceptance_with({0: 0.8})
    single, _ = policy().decide((0, 0), observation(accept, {0: 1.0}, mean_batch=64))
    obs = with_classes(observation(accept, {0: 1.0}, mean_batch=64),
                       {"interactive": {"weight": 4}, "batch": {}}, "batch",
                       {"interactive": 0.25, "batch": 0.75})
    plan, _ = policy().decide((0, 0), obs)
    gave_way = []
    for b in ROWS:
        assert nodes(plan, "batch", b) <= nodes(plan, "interactive", b), b
        if nodes(plan, "batch", b) == 0 < nodes(plan, "interactive", b):
            gave_way.append(b)
    assert gave_way and 256 in gave_way
    assert nodes(plan, "interactive", 256) > nodes(single, "default", 256)
    # Equal weights, a target interactive meets anyway: nodes of equal value, and
    # of those the best-effort class's drop out first.
    loose = with_classes(observation(accept, {0: 1.0}, mean_batch=64),
                         {"interactive": {"tpot_target_ms": 100}, "batch": {}}, "batch",
                         {"interactive": 0.25, "batch": 0.75})
    plan, _ = policy().decide((0, 0), loose)
    assert all(nodes(plan, "batch", b) <= nodes(plan, "interactive", b) for b in ROWS)
    assert any(nodes(plan, "batch", b) == 0 < nodes(plan, "interactive", b) for b in ROWS)


def tpot_of(policy_: GoodputPolicy, obs: Observation, alloc, batch: float) -> list[float]:
    """Each class's predicted TPOT (κ applied), priced again from the plan's nodes
    with :func:`step_goodput`, apart from the solver's own bookkeeping: the step time over
    what the target's requests emit a step, each node at ``tail^level`` of its value (one
    context bucket per class here, so no bucket bounds it more than another)."""
    cb = policy_.class_batch(obs)
    groups, taken, klass = [], [], []
    for k, b in cb.groups:
        groups.append(BatchGroup(batch * cb.share[k] * cb.context_share[k, b], cb.context_mean[k, b],
                                 cb.lists[k][alloc.cap - 1][b]))
        taken.append(alloc.nodes[k][b])
        klass.append(k)
    tokens = np.zeros(len(cb.classes))
    tail = np.zeros(len(cb.classes))
    requests = np.zeros(len(cb.classes))
    for g, m, k in zip(groups, taken, klass):
        tokens[k] += g.count * (1.0 + g.nodes.values[:m].sum())
        tail[k] += g.count * (1.0 + (g.nodes.values[:m] * cb.tail[k] ** g.nodes.levels[:m]).sum())
        requests[k] += g.count
    step_ms = tokens.sum() / float(step_goodput(groups, np.array(taken), obs.cost)) * 1000.0
    return list(step_ms / (tail / requests) * cb.spread)


def target_case(target: float | None, quantile: str = "p99") -> Observation:
    """Batch 256 on the H100 roofline: compute-bound, one node per request pays a
    little. Interactive is a quarter of the requests, its p99 TPOT 1.2× its mean."""
    interactive = {"tpot_quantile": quantile, **({"tpot_target_ms": target} if target else {})}
    measured = ClassLoad(share=0.25, tpot_ms_p50=5.0, tpot_ms_p99=6.0, tokens_per_step=2.0, step_ms_mean=10.0)
    return with_classes(observation(acceptance_with({0: 0.8}), {0: 1.0}, mean_batch=256),
                        {"interactive": interactive, "batch": {}}, "batch", {"batch": 0.75},
                        class_load={"interactive": measured})


def test_a_tpot_target_the_unweighted_optimum_misses_is_met_at_a_small_goodput_cost():
    pol = policy()
    free = target_case(None)
    free_alloc = pol.solve_class_row(free, pol.class_batch(free), 256.0)
    free_tpot = tpot_of(pol, free, free_alloc, 256.0)[0]
    assert free_alloc.tpot_ms[0] == pytest.approx(free_tpot)
    assert free_alloc.multipliers == (1.0, 1.0)
    target = 0.85 * free_tpot  # the unweighted optimum misses it by 18 %
    obs = target_case(target)
    alloc = pol.solve_class_row(obs, pol.class_batch(obs), 256.0)
    tpot = tpot_of(pol, obs, alloc, 256.0)
    assert alloc.tpot_ms == pytest.approx(tpot)
    assert tpot[0] <= target
    assert alloc.meets_targets(obs.classes)
    assert alloc.multipliers[1] == 1.0  # best effort is never raised
    assert alloc.goodput_tok_s >= 0.9 * free_alloc.goodput_tok_s  # total tokens: a small loss
    assert alloc.nodes[1][0] < alloc.nodes[0][0]  # the batch class gave way
    # Tighter (30 % under): the interactive class needs two nodes while the batch
    # class has none, an allocation only a raised weight ranks first.
    tight = target_case(0.7 * free_tpot)
    tighter = pol.solve_class_row(tight, pol.class_batch(tight), 256.0)
    assert tighter.meets_targets(tight.classes) and tighter.multipliers[0] > 1.0
    assert tighter.nodes[0][0] >= 2 and tighter.nodes[1][0] == 0
    plan, _ = pol.decide((0, 0), obs)  # and it is the plan's row at the current batch
    assert nodes(plan, "interactive", 256) == alloc.nodes[0][0]
    assert nodes(plan, "batch", 256) == alloc.nodes[1][0]
    # The plan as the controller would price it against the one without the target:
    # less goodput, but it meets the target, so it is the better plan.
    unweighted, _ = pol.decide((0, 0), free)
    new, old = class_plan_estimate(plan, obs), class_plan_estimate(unweighted, obs)
    assert new.tpot_ms == pytest.approx(alloc.tpot_ms) and new.worst_ratio <= 1.0 < old.worst_ratio
    assert new.goodput_tok_s < old.goodput_tok_s
    assert new.better_than(old, 1.05) and not old.better_than(new, 1.0)
    # A p50 target reads the p50 spread (5 ms over a 5 ms mean: κ = 1): the same
    # target is easier, and the plan gives up less.
    p50 = target_case(target, "p50")
    easier = pol.solve_class_row(p50, pol.class_batch(p50), 256.0)
    assert easier.meets_targets(p50.classes) and easier.goodput_tok_s >= alloc.goodput_tok_s


def test_a_p99_target_prices_nodes_at_what_its_slowest_requests_accept():
    """The p99 of a class is its slowest requests, mostly those the drafter follows worst. When they
    accept a fifth of the class's mean draft tokens (tail 1.2 tokens a step against 2.0), a node
    shortens their TPOT by what it is worth to them (each position accepted ``tail_scale`` times as
    often as the mean's, fitted to that fifth): the policy predicts their TPOT from the tail, and a
    target it could meet by growing the mean request's tree is one that tree does not meet for the
    tail, so it buys fewer nodes there (deeper nodes are discounted more:
    tests/test_class_target_margin.py)."""
    pol = policy()
    free = target_case(None)
    free_alloc = pol.solve_class_row(free, pol.class_batch(free), 256.0)
    target = 0.85 * free_alloc.tpot_ms[0]
    mean_priced = target_case(target)
    tail_load = replace(mean_priced.class_load["interactive"], tail_tokens_per_step=1.2, tpot_ms_p99=6.0)
    tail_priced = replace(mean_priced, class_load={**mean_priced.class_load, "interactive": tail_load})
    by_mean = pol.solve_class_row(mean_priced, pol.class_batch(mean_priced), 256.0)
    by_tail = pol.solve_class_row(tail_priced, pol.class_batch(tail_priced), 256.0)
    cb = pol.class_batch(tail_priced)
    nodes = cb.lists[0][-1][0]  # the class's best-first list; the mean's 1.0 token is its first nodes'
    used = np.clip(1.0 - np.concatenate(([0.0], np.cumsum(nodes.values)[:-1])), 0.0, nodes.values)
    assert float(used @ cb.tail[0] ** nodes.levels) == pytest.approx(0.2, rel=1e-6)
    assert cb.tail[1] == 1.0  # best effort has no target to read it
    assert cb.spread[0] == 1.0  # κ: 6 ms observed over 10 ms / 1.2 tail tokens is 0.72, held at 1
    # Its TPOT, re-priced independently: step time over 1 + 0.2 x the class's accepted tokens, times κ.
    assert by_tail.tpot_ms == pytest.approx(tpot_of(pol, tail_priced, by_tail, 256.0))
    # Priced by the mean the target is met with more nodes; for the tail those nodes buy too little.
    assert by_mean.meets_targets(mean_priced.classes)
    assert by_tail.nodes[0][0] < by_mean.nodes[0][0]


def test_an_unreachable_target_gets_the_smallest_ratio_there_is():
    """1 ms per token cannot be had at batch 256; every allocation of the two
    classes' node lists is priced by brute force, and the plan's worst ratio
    is the smallest (within the tolerance that keeps the batch class from
    being turned off for a hair)."""
    pol = policy()
    obs = target_case(1.0)
    cb = pol.class_batch(obs)
    alloc = pol.solve_class_row(obs, cb, 256.0)
    assert not alloc.meets_targets(obs.classes)
    counts = [256.0 * cb.share[k] for k in range(2)]
    best = np.inf
    for cap in range(1, len(cb.lists[0]) + 1):
        lists = [cb.lists[k][cap - 1][0] for k in range(2)]
        groups = [BatchGroup(counts[k], CTX, lists[k]) for k in range(2)]
        for mi in range(len(lists[0].values) + 1):
            for mb in range(len(lists[1].values) + 1):
                tokens = [counts[k] * (1.0 + lists[k].values[:m].sum()) for k, m in enumerate((mi, mb))]
                step_ms = sum(tokens) / float(step_goodput(groups, np.array([mi, mb]), obs.cost)) * 1000.0
                best = min(best, step_ms / (tokens[0] / counts[0]) * cb.spread[0])
    assert best > 1.0
    assert alloc.tpot_ms[0] <= best * (1.0 + RATIO_TOLERANCE)
    free = target_case(None)
    unweighted = pol.solve_class_row(free, pol.class_batch(free), 256.0)
    assert alloc.tpot_ms[0] < unweighted.tpot_ms[0]


def test_a_relaxed_class_is_valued_with_the_typical_acceptance():
    """Strict and typical classes of equal weight and mix, chains: valued with the
    strict acceptance alone (typical not observed yet) they get the same plan;
    with the typical acceptance observed higher (α 0.85 against 0.6 per
    position) the typical class drafts at least as many nodes at every batch
    size, more at some, and drafts on where the strict one is off."""
    spec = {"batch": {}, "bulk": {"acceptance": "typical"}}
    shares = {"batch": 0.5, "bulk": 0.5}
    base = observation(FixedAcceptance(np.full((6, 1), 0.6)), {0: 1.0}, mean_batch=32)
    unseen, _ = policy().decide((0, 0), with_classes(base, spec, "batch", shares))
    assert unseen.table_for("bulk") == unseen.table_for("batch")
    relaxed, _ = policy().decide((0, 0), with_classes(base, spec, "batch", shares,
                                                      acceptance_typical=FixedAcceptance(np.full((6, 1), 0.85))))
    more = 0
    for b in ROWS:
        assert nodes(relaxed, "bulk", b) >= nodes(relaxed, "batch", b), b
        more += nodes(relaxed, "bulk", b) > nodes(relaxed, "batch", b)
    assert more >= 2
    assert any(nodes(relaxed, "batch", b) == 0 < nodes(relaxed, "bulk", b) for b in ROWS)


def test_caution_and_min_gain_hold_for_every_class():
    """The reference worker's first minute at batch 8 (as in the single-class
    test): plain steps cost 75 ms, 8 × 2 tokens is priced 100 ms by
    interpolation, a depth-1 draft (α = 0.42) looks 6 % better. Never run, one
    RMSE of caution keeps both classes off, even the one whose 72 ms target
    only the draft meets (70.4 ms expected, 78.9 ms priced with caution);
    measured, both draft. A min_gain of 50 % keeps both off without the
    target; with it off misses the target and the draft meets it, so they
    draft (the batch class too: the padded forward pays for its node anyway)."""
    knots = (1.0, 8.0, 16.0, 24.0)

    def plan(evidence: float, caution: float = 1.0, min_gain: float = 0.01, target: float | None = 72.0):
        cost = CostParams(mem_ms=0.0, compute_ms=75.0, compute_ms_per_token=3.125, compute_knots=knots,
                          compute_rise_ms=(0.0, 0.0, 25.0, 50.0), draft_ms_per_level=0.0,
                          compute_evidence=(500.0, 500.0, evidence, 0.0), verify_rmse_ms=12.0)
        obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("medusa", "", 1, 1, 1, 0),
                          batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                          acceptance=FixedAcceptance(np.array([[0.42]])), cost=cost,
                          load=LoadProfile(mean_batch_size=8, context_share=(1.0,) + (0.0,) * 8,
                                           context_mean=(300.0,) + (0.0,) * 8),
                          padded_verify=True)
        # No margin: the story is the draft meeting the target itself (70.4 ms expected against 72).
        interactive = {"tpot_target_ms": target, "tpot_margin": 0.0} if target else {}
        obs = with_classes(obs, {"interactive": interactive, "batch": {}}, "batch",
                           {"interactive": 0.5, "batch": 0.5})
        draft, _ = policy(cost_caution=caution, min_gain=min_gain).decide((0, 0), obs)
        return [draft.table_for(name).lookup(8, 300) for name in ("interactive", "batch")]

    assert plan(0.0) == [Decision.off(), Decision.off()]
    assert plan(0.0, caution=0.0) == [Decision.chain(1), Decision.chain(1)]
    assert plan(400.0) == [Decision.chain(1), Decision.chain(1)]
    assert plan(400.0, min_gain=0.5, target=None) == [Decision.off(), Decision.off()]
    assert plan(400.0, min_gain=0.5) == [Decision.chain(1), Decision.chain(1)]


def test_probes_get_their_own_class_decision():
    """Acceptance without uncertainty and exact costs: a probe's posterior sample
    is the mean, so its decision is its class's table cell and no override is
    sent, while the two classes' cells differ. Giving probes another class's
    decision would show up as overrides. An unknown class is the default."""
    q = np.array([[0.8], [0.75], [0.7], [0.65], [0.6], [0.5]])
    active = {f"r{i}": CTX for i in range(128)}
    labels = {rid: ("interactive", "batch", "nobody")[i % 3] for i, rid in enumerate(active)}
    obs = with_classes(observation(FixedAcceptance(q), {0: 1.0}, mean_batch=128, active=active),
                       {"interactive": {"weight": 4}, "batch": {}}, "batch",
                       {"interactive": 0.33, "batch": 0.67}, active_classes=labels)
    plan, _ = policy(probe_fraction=1.0).decide((0, 0), obs)
    assert plan.table_for("interactive").lookup(128, CTX) != plan.table_for("batch").lookup(128, CTX)
    assert plan.overrides == {} and plan.reasons == {}


def test_a_class_without_traffic_is_solved_with_a_small_share():
    obs = with_classes(observation(acceptance_with({0: 0.8}), {0: 1.0}, mean_batch=16),
                       {"interactive": {"weight": 2, "tpot_target_ms": 50}, "batch": {}}, "batch",
                       {"batch": 1.0})
    share, context_share, _ = class_mix(obs)
    assert share[0] == pytest.approx(UNSEEN_CLASS_SHARE / (1 + UNSEEN_CLASS_SHARE))
    assert context_share[0, 0] == 1.0  # the worker's mix stands in for its own
    plan, _ = policy().decide((0, 0), obs)
    assert plan.table_for("interactive").lookup(16, CTX).depth >= 2


def test_decide_with_classes_is_pure_and_replayable():
    active = {f"r{i}": CTX for i in range(32)}
    obs = with_classes(observation(acceptance_with({0: 0.7}), {0: 1.0}, mean_batch=32, active=active),
                       {"interactive": {"weight": 3, "tpot_target_ms": 8}, "batch": {}}, "batch",
                       {"interactive": 0.3, "batch": 0.7},
                       active_classes={rid: "interactive" for rid in list(active)[:10]})
    pol = GoodputPolicy(GoodputConfig(probe_fraction=0.5))
    state = pol.initial_state(seed=7)
    first, s1 = pol.decide(state, obs)
    again, s2 = pol.decide(state, obs)
    assert first.class_tables == again.class_tables and first.overrides == again.overrides and s1 == s2
    assert set(first.reasons.values()) <= {"explore"}
    assert all(isinstance(d, Decision) for d in first.overrides.values())
