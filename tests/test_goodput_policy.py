"""The goodput policy as a pure function: hand-built observations, no server."""

from __future__ import annotations

import numpy as np
import pytest

from controller.acceptance import AcceptanceModel
from controller.cost import CostParams
from policies.base import DrafterLimits, LoadProfile, Observation
from policies.goodput import GoodputConfig, GoodputPolicy, allocate, BatchGroup, best_first_nodes
from policies.table import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES

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
