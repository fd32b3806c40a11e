"""The goodput policy as a pure function: hand-built observations, no server."""

from __future__ import annotations

import numpy as np
import pytest

from controller.models.acceptance import AcceptanceModel
from controller.models.cost import CostParams
from policies.base import DrafterLimits, LoadProfile, Observation
from policies.goodput import (
    MIN_NODE_VALUE,
    BatchGroup,
    GoodputConfig,
    GoodputPolicy,
    allocate,
    best_first_nodes,
    capped_node_lists,
    step_goodput,
)
from policies.table import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, Decision

# H100-class roofline for an 8B model: 16 GB of weights at 3.35 TB/s, 128 KiB
# of KV per token, decode GEMMs at ~35% of 989 TFLOP/s dense.
H100_8B = CostParams(mem_ms=5.8, mem_ms_per_kv_token=131072 / 3.35e9, compute_ms=0.5,
                     compute_ms_per_token=2 * 8e9 / (0.35 * 989e12) * 1e3,
                     draft_fixed_ms=0.2, draft_ms_per_level=0.25, draft_ms_per_node=0.001)


def acceptance_with(alpha_by_bucket: dict[int, float], depth: int = 6, width: int = 2, n: int = 400):
    model = AcceptanceModel(DEFAULT_CONTEXT_EDGES, half_life_s=1e9)
    edges = DEFAULT_CONTEXT_EDGES
    rng = np.random.default_rng(0)
    for bucket, alpha in alpha_by_bucket.items():
        for _ in range(n):
            ranks, cands = [], []
            for _level in range(depth):
                cands.append(width)
                if rng.random() < alpha:
                    ranks.append(1)
                elif rng.random() < 0.3:
                    ranks.append(2)
                else:
                    ranks.append(0)
                    break
            model.observe(("eagle", "v1"), depth, width, edges[bucket] + 10, ranks, cands, now=0.0)
    return model.view(("eagle", "v1"), depth, width)


def observation(acceptance, share: dict[int, float], mean_batch: float = 8.0, active=None) -> Observation:
    n = len(DEFAULT_CONTEXT_EDGES)
    shares = tuple(share.get(c, 0.0) for c in range(n))
    means = tuple((DEFAULT_CONTEXT_EDGES[c] + (DEFAULT_CONTEXT_EDGES[c + 1] if c + 1 < n else 2 * DEFAULT_CONTEXT_EDGES[c])) / 2
                  if shares[c] else 0.0 for c in range(n))
    return Observation(
        now=0.0, worker_id="w", drafter=DrafterLimits("eagle", "v1", 6, 2, 12, 8192),
        batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
        acceptance=acceptance, cost=H100_8B,
        load=LoadProfile(mean_batch_size=mean_batch, context_share=shares, context_mean=means),
        active_requests=active or {},
    )


def test_three_regimes_from_one_cost_model():
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.0))
    accept = acceptance_with({0: 0.8, 6: 0.8})
    short, _ = policy.decide(policy.initial_state(), observation(accept, {0: 1.0}))
    assert short.table.lookup(1, 500).depth >= 4  # memory-bound: deep trees are nearly free
    assert short.table.lookup(256, 500).depth == 0  # compute-bound: off
    long, _ = policy.decide(policy.initial_state(), observation(accept, {6: 1.0}))
    assert long.table.lookup(256, 40_000).depth >= 2  # KV-bound at long context: pays again (MagicDec)


def test_width_grows_when_second_candidates_are_accepted():
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.0))
    plan, _ = policy.decide(policy.initial_state(), observation(acceptance_with({0: 0.6}), {0: 1.0}))
    assert plan.table.lookup(1, 500).width == 2


def test_decide_is_pure_and_replayable():
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.5))
    obs = observation(acceptance_with({0: 0.7}), {0: 1.0}, active={f"r{i}": 500 for i in range(64)})
    state = policy.initial_state(seed=3)
    first, s1 = policy.decide(state, obs)
    again, s2 = policy.decide(state, obs)
    assert first.table == again.table and dict(first.overrides) == dict(again.overrides) and s1 == s2
    assert state == policy.initial_state(seed=3)


def test_exploration_brings_speculation_back_after_evidence_fades():
    """Off after a collapse; once the evidence ages, Thompson probes re-test it."""
    model = AcceptanceModel(DEFAULT_CONTEXT_EDGES, half_life_s=10.0)
    for _ in range(300):  # acceptance looked terrible
        model.observe(("eagle", "v1"), 6, 2, 100, [0], [2], now=0.0)
    policy = GoodputPolicy(GoodputConfig(probe_fraction=1.0))
    active = {f"r{i}": 100 for i in range(4)}
    view = model.view(("eagle", "v1"), 6, 2)
    plan, state = policy.decide(policy.initial_state(), observation(view, {0: 1.0}, mean_batch=4, active=active))
    assert plan.table.lookup(4, 100).depth == 0
    assert not [d for d in plan.overrides.values() if d.depth > 0]
    model.tick(now=60.0)  # six half-lives without data: the posterior widens toward the prior
    view = model.view(("eagle", "v1"), 6, 2)
    speculating = 0
    for _ in range(10):
        plan, state = policy.decide(state, observation(view, {0: 1.0}, mean_batch=4, active=active))
        speculating += sum(1 for rid in active if plan.overrides.get(rid, plan.table.lookup(4, 100)).depth > 0)
    assert speculating > 0
    assert set(plan.reasons.values()) <= {"explore"}


def test_allocation_prefers_high_value_requests_under_a_budget():
    q_hi = np.array([[0.9], [0.9], [0.9], [0.9]])
    q_lo = np.array([[0.3], [0.3], [0.3], [0.3]])
    groups = [BatchGroup(64, 500, best_first_nodes(q_hi, 4, 1, 4)), BatchGroup(64, 500, best_first_nodes(q_lo, 4, 1, 4))]
    allocation = allocate(groups, H100_8B)
    hi, lo = allocation.nodes_per_group
    assert hi > lo
    assert allocation.goodput_tok_s >= allocation.goodput_off_tok_s


@pytest.mark.parametrize("field,value", [("probe_fraction", 2.0), ("min_share", -1), ("max_depth", 1000)])
def test_config_refuses_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        GoodputConfig(**{field: value})


def test_capped_lists_from_one_expansion_equal_separate_expansions():
    rng = np.random.default_rng(1)
    for _ in range(100):
        depth, width, nodes = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 65))
        alpha = rng.uniform(0.2, 0.95, depth)
        shape = np.r_[1.0, rng.uniform(0.05, 0.3) * 0.5 ** np.arange(width - 1)]
        q = alpha[:, None] * shape[None, :width]
        lists = capped_node_lists(q, depth, width, nodes)
        assert len(lists) == depth
        for cap in range(1, depth + 1):
            ref = best_first_nodes(q, cap, width, nodes)
            k = int(np.count_nonzero(ref.values > MIN_NODE_VALUE))  # the shared expansion skips rarer nodes
            got = lists[cap - 1]
            assert np.allclose(got.values[:k], ref.values[:k])
            assert (got.depth[: k + 1] == ref.depth[: k + 1]).all() and (got.width[: k + 1] == ref.width[: k + 1]).all()


def test_depth_cap_search_does_not_buy_a_whole_draft_level_for_one_deep_node():
    """Levels 3-5 are near-certain on a chain, then a cliff; second candidates at
    levels 1-2 are worth a lot too. In value order the fifth level's node comes
    before those candidates, so the best value-ordered prefix pays a fifth draft
    forward for the whole batch; capping the depth at four buys them instead."""
    costly_levels = CostParams(mem_ms=5.8, compute_ms=0.5, compute_ms_per_token=2 * 8e9 / (0.35 * 989e12) * 1e3,
                               draft_fixed_ms=0.2, draft_ms_per_level=1.2)
    q = np.array([[0.6, 0.35], [0.6, 0.35], [0.95, 0.0], [0.95, 0.0], [0.95, 0.0], [0.2, 0.1]])
    lists = capped_node_lists(q, 6, 2, 12)
    uncapped = allocate([BatchGroup(8, 500, lists[-1])], costly_levels)
    capped = allocate([BatchGroup(8, 500, lists[3])], costly_levels)
    assert lists[-1].depth[uncapped.nodes_per_group[0]] == 5
    assert capped.goodput_tok_s > 1.03 * uncapped.goodput_tok_s
    obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("eagle", "v1", 6, 2, 12, 8192),
                      batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                      acceptance=FixedAcceptance(q), cost=costly_levels,
                      load=LoadProfile(mean_batch_size=8, context_share=(1.0,) + (0.0,) * 8,
                                       context_mean=(500.0,) + (0.0,) * 8))
    plan, _ = GoodputPolicy(GoodputConfig(probe_fraction=0.0)).decide((0, 0), obs)
    assert plan.table.lookup(8, 500).depth == 4


class FixedAcceptance:
    """The same rank and offer probabilities in every context bucket (``offer``:
    a draft at all, or every slot's)."""

    def __init__(self, q: np.ndarray, offer: float | np.ndarray = 1.0) -> None:
        self.q = q
        self.offers = np.ones_like(q)
        if np.ndim(offer):
            self.offers = np.asarray(offer, dtype=np.float64)
        else:
            self.offers[0, 0] = offer
        self.context_edges = DEFAULT_CONTEXT_EDGES
        self.max_depth, self.max_width = q.shape

    def rank_probs(self, context_bucket: int) -> np.ndarray:
        return self.q

    def sample_rank_probs(self, context_bucket: int, rng) -> np.ndarray:
        return self.q

    def effective_samples(self, context_bucket: int) -> np.ndarray:
        return np.full(self.max_depth, 1e6)

    def offer_rate(self, context_bucket: int) -> float:
        return float(self.offers[0, 0])

    def offer_probs(self, context_bucket: int) -> np.ndarray:
        return self.offers


def test_hardware_prior_prices_compute_like_a_serving_engine():
    """The prior from nominal hints sits near the simulator's achieved roofline, so a
    first plan at a compute-bound batch does not send maximal trees."""
    from worker.sim.hardware import CostModel

    truth = CostModel("H100-SXM")
    prior = CostParams.from_hardware(3350, 989, 16e9, 131072, 8e9)
    for tokens, kv in [(1, 500), (8, 8000), (1024, 256 * 500), (2048, 256 * 500)]:
        assert prior.verify_ms(tokens, kv) == pytest.approx(truth.verify_ms(tokens, kv), rel=0.2), (tokens, kv)
    with pytest.raises(ValueError, match="flops_efficiency=0"):
        CostParams.from_hardware(3350, 989, 16e9, 131072, 8e9, flops_efficiency=0)


def test_untested_positions_follow_a_recovery_seen_at_tested_ones():
    """Acceptance drops and the policy drafts two levels only; when it recovers, the
    deep positions — no longer tested — must follow position 1 back up within
    seconds, not over many half-lives."""
    key = ("eagle", "v1")
    model = AcceptanceModel(DEFAULT_CONTEXT_EDGES, half_life_s=120.0)
    rng = np.random.default_rng(4)

    def steps(alpha: float, depth: int, t0: float, seconds: int) -> None:
        for t in range(seconds):
            for _ in range(300):
                ranks = []
                for _level in range(depth):
                    ranks.append(1 if rng.random() < alpha else 0)
                    if ranks[-1] == 0:
                        break
                model.observe(key, 6, 1, 100, ranks, [1] * len(ranks), now=t0 + t)
            model.tick(t0 + t + 1.0)

    def alpha(position: int) -> float:
        return float(model.view(key, 6, 1).chain_alpha(0)[position - 1])

    steps(0.8, 6, 0.0, 20)  # every position tested at 0.8
    steps(0.6, 6, 20.0, 20)  # the drop, still tested everywhere
    assert alpha(5) == pytest.approx(0.6, abs=0.05)
    steps(0.8, 2, 40.0, 20)  # recovered, but only two levels drafted
    assert alpha(1) == pytest.approx(0.8, abs=0.03)
    assert alpha(5) == pytest.approx(0.8, abs=0.06)  # followed the reference up
    sticks = model.view(key, 6, 1)._params[0]
    assert (sticks[0] + sticks[1])[4, 0] <= 60  # and it is uncertain again, so probes re-test it


def test_cells_with_data_follow_their_data_only():
    """A deeper position that keeps being tested is not dragged by position 1."""
    key = ("eagle", "v1")
    model = AcceptanceModel(DEFAULT_CONTEXT_EDGES, half_life_s=120.0)
    for t in range(40):
        for i in range(200):
            first = 1 if (i % 10) < (9 if t < 10 else 6) else 0  # position 1 drops from 0.9 to 0.6
            model.observe(key, 2, 1, 100, [1, 1 if i % 2 else 0] if first else [0], [1, 1] if first else [1],
                          now=float(t))
        model.tick(t + 1.0)
    chain = model.view(key, 2, 1).chain_alpha(0)
    assert chain[0] == pytest.approx(0.6, abs=0.05) and chain[1] == pytest.approx(0.5, abs=0.05)


def test_a_padded_forward_and_a_drafter_that_rarely_offers_are_priced_as_they_run():
    """A CPU-like worker at batch 4: a forward costs 80 ms up to 4 tokens, then 8 ms
    per token. A drafter that offers a draft for 30 % of the requests asked (prompt
    lookup), α = 0.5 per position when it does. Ragged batching pays only for the
    drafts offered: speculation still wins. A padded forward pays for the widest
    block on every row, and one of four requests usually brings one: off. A
    drafter that always offers wins even padded."""
    knots = (1.0, 4.0, 5.0)
    cpu = CostParams(mem_ms=0.0, compute_ms=80.0, compute_ms_per_token=8.0, compute_knots=knots,
                     compute_rise_ms=(0.0, 0.0, 8.0), draft_ms_per_level=0.0)
    q = np.array([[0.5], [0.5], [0.5]])

    def decision(offer: float, padded: bool) -> Decision:
        obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("ngram", "", 3, 1, 3, 0),
                          batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                          acceptance=FixedAcceptance(q, offer), cost=cpu,
                          load=LoadProfile(mean_batch_size=4, context_share=(1.0,) + (0.0,) * 8,
                                           context_mean=(300.0,) + (0.0,) * 8),
                          padded_verify=padded)
        plan, _ = GoodputPolicy(GoodputConfig(probe_fraction=0.0)).decide((0, 0), obs)
        return plan.table.lookup(4, 300)

    assert decision(0.3, padded=False).depth >= 1
    assert decision(0.3, padded=True) == Decision.off()
    assert decision(1.0, padded=True).depth >= 1


def test_an_untried_batch_size_must_win_by_the_cost_models_error():
    """The reference worker's first minute at batch 8, padded: plain costs 75 ms
    (measured often), 8 × 2 tokens is priced 100 ms by interpolation, never run;
    α = 0.42 makes a depth-1 draft look 6 % better. One RMSE (12 ms) of caution
    turns it down; once 16 tokens has been measured a few hundred times the same
    price is trusted and speculation goes on. Without caution it goes on at once.
    Probes draw the cost error: some of them try it anyway."""
    knots = (1.0, 8.0, 16.0, 24.0)

    def cost(evidence_at_16: float) -> CostParams:
        return CostParams(mem_ms=0.0, compute_ms=75.0, compute_ms_per_token=3.125, compute_knots=knots,
                          compute_rise_ms=(0.0, 0.0, 25.0, 50.0), draft_ms_per_level=0.0,
                          compute_evidence=(500.0, 500.0, evidence_at_16, 0.0), verify_rmse_ms=12.0)

    active = {f"req-{i}": 300 for i in range(8)}

    def plan(evidence: float, caution: float, probes: float = 0.0, seed: int = 0):
        obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("medusa", "", 1, 1, 1, 0),
                          batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                          acceptance=FixedAcceptance(np.array([[0.42]])), cost=cost(evidence),
                          load=LoadProfile(mean_batch_size=8, context_share=(1.0,) + (0.0,) * 8,
                                           context_mean=(300.0,) + (0.0,) * 8),
                          active_requests=active, padded_verify=True)
        draft, _ = GoodputPolicy(GoodputConfig(probe_fraction=probes, cost_caution=caution)).decide((seed, 0), obs)
        return draft

    assert plan(0.0, caution=0.0).table.lookup(8, 300) == Decision.chain(1)
    untried = plan(0.0, caution=1.0)
    assert untried.table.lookup(8, 300) == Decision.off()
    assert untried.expected_goodput_tok_s == pytest.approx(8 / 75 * 1000)
    assert plan(400.0, caution=1.0).table.lookup(8, 300) == Decision.chain(1)
    probed = [plan(0.0, caution=1.0, probes=1.0, seed=s).overrides for s in range(20)]
    tried = sum(1 for o in probed if o)
    assert 0 < tried < 20
    assert all(d == Decision.chain(1) for o in probed for d in o.values())


def test_caution_decides_whether_to_speculate_not_which_tree():
    """Batch 1 on a CPU-like worker: a forward costs 60 ms up to 7 tokens, 1–5
    measured all day, 6 never. The five-node tree (6 tokens) has the best
    expected goodput and even one RMSE above its fitted time beats off: it is
    drafted, caution does not pin the worker to four nodes. When the RMSE is
    so large that the untried size could lose to off, the measured four-node
    tree is drafted instead."""
    q = np.array([[0.37, 0.13, 0.07, 0.06], [0.34, 0.09, 0.13, 0.11]])

    def decision(rmse: float) -> Decision:
        cost = CostParams(mem_ms=0.0, compute_ms=60.0, compute_ms_per_token=12.0, compute_knots=(1.0, 5.0, 6.0, 7.0),
                          compute_rise_ms=(0.0, 0.0, 0.0, 0.0), draft_ms_per_level=0.0,
                          compute_evidence=(1e4, 1e4, 0.0, 0.0), verify_rmse_ms=rmse)
        obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("eagle", "", 2, 4, 5, 0),
                          batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                          acceptance=FixedAcceptance(q), cost=cost,
                          load=LoadProfile(mean_batch_size=1, context_share=(1.0,) + (0.0,) * 8,
                                           context_mean=(300.0,) + (0.0,) * 8),
                          padded_verify=True)
        plan, _ = GoodputPolicy(GoodputConfig(probe_fraction=0.0)).decide((0, 0), obs)
        return plan.table.lookup(1, 300)

    assert decision(rmse=14.0).max_nodes == 5
    assert decision(rmse=200.0).max_nodes == 4


def test_siblings_the_drafter_seldom_has_are_not_planned():
    """A CPU-like worker at batch 1: a forward costs 70 ms up to 6 tokens, then 4 ms
    per token. Second candidates would be accepted 30 % of the time at every
    position: with a drafter that offers every slot asked for, the plan spends
    the free tokens on siblings (a shallow, wide tree). A prompt-lookup trie
    has a second continuation for 5 % of the steps: a sibling is worth
    0.05 × 0.3 of its parent, and the plan spends the free tokens on a deep
    chain instead."""
    cpu = CostParams(mem_ms=0.0, compute_ms=70.0, compute_ms_per_token=4.0, compute_knots=(1.0, 6.0, 7.0),
                     compute_rise_ms=(0.0, 0.0, 4.0), draft_ms_per_level=0.0)
    q = np.tile([0.6, 0.3, 0.0, 0.0], (6, 1))
    seldom = np.tile([1.0, 0.05, 0.01, 0.01], (6, 1))

    def decision(offer) -> Decision:
        obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("ngram", "", 6, 4, 16, 0),
                          batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                          acceptance=FixedAcceptance(q, offer), cost=cpu,
                          load=LoadProfile(mean_batch_size=1, context_share=(1.0,) + (0.0,) * 8,
                                           context_mean=(300.0,) + (0.0,) * 8))
        plan, _ = GoodputPolicy(GoodputConfig(probe_fraction=0.0)).decide((0, 0), obs)
        return plan.table.lookup(1, 300)

    tree, chain = decision(1.0), decision(seldom)
    assert tree.width >= 2 and tree.depth <= 4, tree
    assert chain == Decision(5, 1, 5), chain  # 1 + 5 tokens: all the forward has for free



def test_a_step_that_may_not_draft_is_priced_as_a_mixture_of_plain_and_drafting_forwards():
    """Batch 1, a drafter that offers a draft on 40 % of the steps, a forward flat
    at 70 ms up to 6 tokens and 4 ms per token after: a 10-node chain is priced
    0.4 · T(11 tokens) + 0.6 · T(1), not T(1 + 0.4 · 10) (the flat part, where the
    10-node chain would look almost free)."""
    cpu = CostParams(mem_ms=0.0, compute_ms=70.0, compute_ms_per_token=4.0, compute_knots=(1.0, 6.0, 7.0),
                     compute_rise_ms=(0.0, 0.0, 4.0), draft_ms_per_level=0.0, draft_fixed_ms=0.0,
                     draft_ms_per_node=0.0)
    nodes = best_first_nodes(np.full((10, 1), 0.5), 10, 1, 10, np.array([[0.4]] + [[1.0]] * 9))
    group = BatchGroup(1.0, 300.0, nodes)
    goodput = float(step_goodput([group], np.array([10]), cpu, np.array([0.4])))
    mixture_ms = 0.4 * float(cpu.verify_ms(11.0, 300.0, 11 * 300.0)) + 0.6 * float(cpu.verify_ms(1.0, 300.0, 300.0))
    assert goodput == pytest.approx((1.0 + nodes.values.sum()) / mixture_ms * 1000.0)
    mean_ms = float(cpu.verify_ms(5.0, 300.0, 5 * 300.0))
    assert mixture_ms > 1.1 * mean_ms  # what pricing the mean tokens missed


def test_switching_on_pays_the_drafters_catch_up_and_staying_on_does_not():
    """Batch 8 of the reference worker, where a d1 chain is 6 % better than off
    (as above, with the 16-token price trusted). Its EAGLE-like drafter catches
    up at 0.05 ms a token: eight requests that never drafted owe their 300-token
    contexts, 120 ms in all, 7.5 ms a step over 16 steps, and switching on no
    longer pays (11.36 tokens in 107.5 ms against 8 in 75). Requests that have
    been drafting owe nothing and stay on; a drafter that never catches up
    (rate 0), or a longer horizon (1.9 ms a step), goes on."""
    knots = (1.0, 8.0, 16.0, 24.0)

    def plan(owed: int, per_token: float = 0.05, horizon: float = 16.0) -> Decision:
        cost = CostParams(mem_ms=0.0, compute_ms=75.0, compute_ms_per_token=3.125, compute_knots=knots,
                          compute_rise_ms=(0.0, 0.0, 25.0, 50.0), draft_ms_per_level=0.0,
                          compute_evidence=(500.0, 500.0, 400.0, 0.0), verify_rmse_ms=12.0,
                          catch_up_ms_per_token=per_token)
        active = {f"req-{i}": 300 for i in range(8)}
        obs = Observation(now=0.0, worker_id="w", drafter=DrafterLimits("eagle", "", 1, 1, 1, 0),
                          batch_edges=DEFAULT_BATCH_EDGES, context_edges=DEFAULT_CONTEXT_EDGES,
                          acceptance=FixedAcceptance(np.array([[0.42]])), cost=cost,
                          load=LoadProfile(mean_batch_size=8, context_share=(1.0,) + (0.0,) * 8,
                                           context_mean=(300.0,) + (0.0,) * 8),
                          active_requests=active, catch_up_owed={rid: owed for rid in active},
                          padded_verify=True)
        config = GoodputConfig(probe_fraction=0.0, cost_caution=0.0, catch_up_horizon_steps=horizon)
        draft, _ = GoodputPolicy(config).decide((0, 0), obs)
        return draft.table.lookup(8, 300)

    assert plan(owed=300) == Decision.off()
    assert plan(owed=0) == Decision.chain(1)
    assert plan(owed=300, per_token=0.0) == Decision.chain(1)
    assert plan(owed=300, horizon=64.0) == Decision.chain(1)
