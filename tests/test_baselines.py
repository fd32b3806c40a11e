"""Engine baselines driven with hand-built observations: exact engine behaviour."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from pydantic import ValidationError

from policies.base import (
    DrafterLimits,
    FinishedRequest,
    LoadProfile,
    Observation,
    RequestOutcome,
    StepOutcome,
)
from policies.baselines import (
    BanditUcbConfig,
    BanditUcbPolicy,
    GateState,
    HfHeuristicConfig,
    HfHeuristicPolicy,
    SglangAdaptiveConfig,
    SglangAdaptivePolicy,
    SglangSlotConfig,
    SlotParams,
    SlotState,
    StaticConfig,
    StaticPolicy,
    TrtllmConcurrencyConfig,
    TrtllmConcurrencyPolicy,
    TrtllmGateConfig,
    TrtllmGatePolicy,
    VllmBatchTableConfig,
    VllmBatchTablePolicy,
    slot_redecide,
)
from policies.presets import list_presets, load_preset
from policies.table import DEFAULT_BATCH_EDGES, Decision

CONTEXT_EDGES = (0, 4096)
CHECK_BATCHES = tuple(range(1, 300)) + (511, 512, 513, 4095, 4096, 4097, 10_000)


class FakeAcceptance:
    """Stands in for the acceptance model; baselines must not need it."""

    context_edges = CONTEXT_EDGES
    max_depth = 8
    max_width = 4

    def rank_probs(self, context_bucket):
        raise AssertionError("baselines must not read the acceptance model")

    sample_rank_probs = effective_samples = offer_rate = offer_probs = rank_probs


class FakeCost:
    """Stands in for the cost model; baselines must not need it."""

    def verify_ms(self, batch_tokens, kv_tokens):
        raise AssertionError("baselines must not read the cost model")

    draft_ms = verify_ms


def make_obs(steps=(), finished=(), active=None, max_depth=8, now=0.0) -> Observation:
    if active is None:  # by default: everyone seen in the steps is still running
        active = {r.request_id: r.context_len for s in steps for r in s.requests}
    return Observation(
        now=now,
        worker_id="w0",
        drafter=DrafterLimits(max_depth=max_depth, max_width=4, max_tree_nodes=32),
        batch_edges=DEFAULT_BATCH_EDGES,
        context_edges=CONTEXT_EDGES,
        acceptance=FakeAcceptance(),
        cost=FakeCost(),
        load=LoadProfile(),
        steps=tuple(steps),
        finished=tuple(finished),
        active_requests=dict(active),
    )


def make_step(batch_size, accepted, depth=3, step_id=0, step_ms=10.0, ids=None) -> StepOutcome:
    """One step of ``batch_size`` requests; ``accepted`` is one value or one per request."""
    if isinstance(accepted, int):
        accepted = [accepted] * batch_size
    ids = ids or [f"r{i}" for i in range(len(accepted))]
    requests = tuple(
        RequestOutcome(rid, 100, depth, 1 if depth else 0, depth, a) for rid, a in zip(ids, accepted)
    )
    return StepOutcome(step_id, float(step_id), batch_size, step_ms / 2, step_ms / 2, requests)


def finished(accepted_per_step: float, steps: int = 10, rid: str = "f") -> FinishedRequest:
    return FinishedRequest(rid, steps, steps + round(accepted_per_step * steps), round(accepted_per_step * steps))


def depths_by_batch(plan, batches=CHECK_BATCHES, context_len=100) -> dict[int, int]:
    return {b: plan.table.lookup(b, context_len).depth for b in batches}


# ================================================================================= static


def test_static_chain_everywhere():
    policy = StaticPolicy(StaticConfig(depth=3))
    plan, state = policy.decide(policy.initial_state(), make_obs())
    assert set(plan.table.decisions) == {Decision(3, 1, 3)}
    assert plan.overrides == {}


def test_static_tree_off_and_clamp():
    tree = StaticPolicy(StaticConfig(depth=4, width=3, max_nodes=8))
    plan, _ = tree.decide(None, make_obs())
    assert plan.table.lookup(64, 9000) == Decision(4, 3, 8)
    off = StaticPolicy(StaticConfig(depth=0))
    assert set(off.decide(None, make_obs())[0].table.decisions) == {Decision.off()}
    deep = StaticPolicy(StaticConfig(depth=12))
    assert deep.decide(None, make_obs(max_depth=5))[0].table.lookup(1, 0) == Decision.chain(5)


@pytest.mark.parametrize("fields", [{"depth": 3, "width": 2, "max_nodes": 7}, {"depth": 3, "max_nodes": 2}])
def test_static_refuses_impossible_node_budget(fields):
    with pytest.raises(ValidationError, match="max_nodes"):
        StaticConfig(**fields)


# ====================================================================== vLLM batch table

VLLM_RANGES = [(1, 16, 3), (64, 128, 2), (256, 4096, 0)]


def test_vllm_ranges_inclusive_with_carry_forward():
    policy = VllmBatchTablePolicy(VllmBatchTableConfig(num_speculative_tokens=3,
                                                       num_speculative_tokens_per_batch_size=VLLM_RANGES))
    got = depths_by_batch(policy.decide(None, make_obs())[0])
    expected = {1: 3, 16: 3, 17: 3, 63: 3, 64: 2, 128: 2, 129: 2, 255: 2, 256: 0, 4096: 0, 4097: 0, 10_000: 0}
    assert {b: got[b] for b in expected} == expected


def test_vllm_table_matches_engine_lookup_for_every_batch_size():
    cfg = VllmBatchTableConfig(num_speculative_tokens=3,
                               num_speculative_tokens_per_batch_size=[(1, 4, 3), (5, 5, 1), (9, 12, 0), (30, 30, 2)])
    plan, _ = VllmBatchTablePolicy(cfg).decide(None, make_obs())
    assert depths_by_batch(plan) == {b: cfg.k_for_batch(b) for b in CHECK_BATCHES}
    batches = (4, 5, 6, 8, 9, 12, 13, 29, 30, 31, 1000)
    assert [cfg.k_for_batch(b) for b in batches] == [3, 1, 1, 1, 0, 0, 0, 0, 2, 2, 2]


def test_vllm_k_clamped_to_num_speculative_tokens_and_static_without_table():
    cfg = VllmBatchTableConfig(num_speculative_tokens=2, num_speculative_tokens_per_batch_size=[(1, 8, 5), (9, 9, 1)])
    assert [cfg.k_for_batch(b) for b in (1, 8, 9, 10)] == [2, 2, 1, 1]
    static = VllmBatchTablePolicy(VllmBatchTableConfig(num_speculative_tokens=4))
    assert set(depths_by_batch(static.decide(None, make_obs())[0]).values()) == {4}


def test_vllm_unsorted_ranges_are_sorted():
    cfg = VllmBatchTableConfig(num_speculative_tokens_per_batch_size=[(64, 128, 2), (1, 16, 3)])
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 16, 3), (64, 128, 2))


@pytest.mark.parametrize(
    "ranges, message",
    [
        ([(1, 16, 3), (16, 32, 2)], "overlaps"),
        ([(1, 16, 3), (8, 10, 2)], "overlaps"),
        ([(2, 16, 3)], "start at batch size 1"),
        ([(1, 16, 3), (40, 20, 2)], "start > end"),
        ([], "at least one"),
        ([(0, 16, 3)], "greater than or equal to 1"),
    ],
)
def test_vllm_refuses_bad_ranges(ranges, message):
    with pytest.raises(ValidationError, match=message):
        VllmBatchTableConfig(num_speculative_tokens_per_batch_size=ranges)


# ============================================================ TensorRT-LLM concurrency


def test_trtllm_schedule_keys_are_inclusive_upper_ends():
    policy = TrtllmConcurrencyPolicy(TrtllmConcurrencyConfig(max_draft_len=4, draft_len_schedule={4: 4, 8: 2, 32: 1}))
    got = depths_by_batch(policy.decide(None, make_obs())[0])
    expected = {1: 4, 4: 4, 5: 2, 8: 2, 9: 1, 32: 1, 33: 0, 256: 0, 10_000: 0}
    assert {b: got[b] for b in expected} == expected
    assert got == {b: policy.config.draft_len_for_batch(b) for b in CHECK_BATCHES}


def test_trtllm_max_concurrency_cutoff():
    policy = TrtllmConcurrencyPolicy(TrtllmConcurrencyConfig(max_draft_len=3, max_concurrency=20))
    got = depths_by_batch(policy.decide(None, make_obs())[0])
    assert got[20] == 3 and got[21] == 0
    assert {d for b, d in got.items() if b <= 20} == {3} and {d for b, d in got.items() if b > 20} == {0}


def test_trtllm_without_cutoffs_is_static():
    policy = TrtllmConcurrencyPolicy(TrtllmConcurrencyConfig(max_draft_len=2))
    assert set(depths_by_batch(policy.decide(None, make_obs())[0]).values()) == {2}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_draft_len": 4, "max_concurrency": 8, "draft_len_schedule": {4: 4}}, "mutually exclusive"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 3, 8: 2}}, "must equal max_draft_len"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 6}}, "exceed max_draft_len"),
        ({"max_draft_len": 4, "draft_len_schedule": {0: 4}}, "greater than or equal to 1"),
    ],
)
def test_trtllm_refuses_what_the_engine_refuses(fields, message):
    with pytest.raises(ValidationError, match=message):
        TrtllmConcurrencyConfig(**fields)


# ================================================================= TensorRT-LLM gate


def gate_policy(window=4, threshold=1.0, **extra) -> TrtllmGatePolicy:
    return TrtllmGatePolicy(TrtllmGateConfig(max_draft_len=3, acceptance_rate_window_size=window,
                                             acceptance_rate_threshold=threshold, **extra))


def test_gate_waits_for_a_full_window_then_switches_off():
    policy = gate_policy(window=4, threshold=1.0)
    state = policy.initial_state()
    plan, state = policy.decide(state, make_obs(finished=[finished(0.2, rid=f"a{i}") for i in range(3)]))
    assert not state.disabled and set(depths_by_batch(plan).values()) == {3}  # 3 < N: no verdict yet
    plan, state = policy.decide(state, make_obs(finished=[finished(0.2, rid="a3")]))
    assert state.disabled and state.mean_at_disable == pytest.approx(0.2)
    assert set(plan.table.decisions) == {Decision.off()}


def test_gate_stays_off_for_good_when_acceptance_recovers():
    policy = gate_policy(window=2, threshold=1.0)
    low = [finished(0.0, rid="x"), finished(0.5, rid="y")]
    _, state = policy.decide(policy.initial_state(), make_obs(finished=low))
    assert state.disabled
    for t in range(20):  # the drafter is great again: the engine never looks back
        good = [finished(3.0, rid=f"g{t}{i}") for i in range(5)]
        plan, state = policy.decide(state, make_obs(steps=[make_step(1, 3)], finished=good))
        assert state.disabled and set(plan.table.decisions) == {Decision.off()}


def test_gate_rolling_window_and_threshold_is_strict():
    policy = gate_policy(window=3, threshold=1.0)
    seq = [finished(v, rid=f"r{i}") for i, v in enumerate([1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 0.0])]
    state = policy.initial_state()
    means = []
    for request in seq:
        _, state = policy.decide(state, make_obs(finished=[request]))
        means.append(state.disabled)
    # windows: [1,1,1]=1.0 (not < 1), [1,1,1], [1,1,2], [1,2,0]=1.0, [2,0,0]=0.67 -> off
    assert means == [False, False, False, False, False, False, True]


def test_gate_checks_after_every_request_within_one_call():
    # Low then high in one batch of finishes: the engine checks after each
    # request, so the low window trips it even though the final window is fine.
    policy = gate_policy(window=2, threshold=1.0)
    batch = [finished(0.0, rid="a"), finished(0.0, rid="b"), finished(3.0, rid="c"), finished(3.0, rid="d")]
    _, state = policy.decide(policy.initial_state(), make_obs(finished=batch))
    assert state.disabled


def test_gate_ignores_requests_without_iterations_and_keeps_its_schedule():
    policy = gate_policy(window=1, threshold=1.0, draft_len_schedule={4: 3, 8: 1})
    plan, state = policy.decide(policy.initial_state(), make_obs(finished=[FinishedRequest("z", 0, 1, 0)]))
    assert state == GateState()
    assert depths_by_batch(plan, (4, 5, 8, 9)) == {4: 3, 5: 1, 8: 1, 9: 0}


# ==================================================================== SGLang adaptive


def one_slot(candidates, initial=3, key=1, **tuning) -> SglangAdaptivePolicy:
    slot = SglangSlotConfig(candidate_steps=candidates)
    return SglangAdaptivePolicy(SglangAdaptiveConfig(initial_steps=initial, slots={key: slot}, **tuning))


def run_batches(policy, state, n, accepted, batch_size=1):
    """Feed n one-step observations (one batch each); return (plans, state)."""
    plans = []
    for i in range(n):
        plan, state = policy.decide(state, make_obs(steps=[make_step(batch_size, accepted, step_id=i)]))
        plans.append(plan)
    return plans, state


def test_sglang_defaults_are_sglangs():
    policy = SglangAdaptivePolicy(SglangAdaptiveConfig())
    params = {p.batch_size: p for p in policy.slot_params}
    assert {b: p.candidates for b, p in params.items()} == {1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}
    assert params[1].down_hysteresis == -0.25 and params[8].down_hysteresis == 0.0
    assert {(p.ema_alpha, p.update_interval, p.warmup_batches) for p in params.values()} == {(0.2, 5, 10)}
    # initial_steps 3 where it is a candidate, else the middle candidate
    assert [s.steps for s in policy.initial_state()] == [3, 3, 1, 0]


def test_sglang_slot_routing_and_table_edges():
    policy = SglangAdaptivePolicy(SglangAdaptiveConfig())
    assert [policy.slot_index(b) for b in (1, 7, 8, 31, 32, 63, 64, 500)] == [0, 0, 1, 1, 2, 2, 3, 3]
    plan, _ = policy.decide(policy.initial_state(), make_obs())
    got = depths_by_batch(plan)
    expected = {1: 3, 7: 3, 8: 3, 31: 3, 32: 1, 63: 1, 64: 0, 4096: 0}
    assert {b: got[b] for b in expected} == expected
    assert set(plan.table.decisions) <= {Decision.chain(k) for k in range(8)}  # chains only


def test_sglang_warmup_then_steps_down_every_interval():
    policy = one_slot((1, 3, 5, 7), initial=3)
    plans, state = run_batches(policy, policy.initial_state(), 14, accepted=0)
    assert {p.table.lookup(1, 0).depth for p in plans} == {3}  # 10 warm-up + 4: no re-decide yet
    plans, state = run_batches(policy, state, 1, accepted=0)  # batch 15 = first re-decide
    # ema = 2 * 0.8**15 = 0.07 <= 1 - 0.5 - 0.25 -> K 3 -> 1
    assert state[0].steps == 1 and plans[-1].table.lookup(1, 0).depth == 1
    assert state[0].ema == pytest.approx(2 * 0.8**15)


def test_sglang_steps_up_one_candidate_per_redecide():
    policy = one_slot((1, 3, 5, 7), initial=3)
    _, state = run_batches(policy, policy.initial_state(), 15, accepted=3)
    assert state[0].steps == 5  # ema 2.965 > 3 - 0.5
    _, state = run_batches(policy, state, 5, accepted=5)
    assert state[0].steps == 5  # ema 4.33 <= 4.5: stays
    _, state = run_batches(policy, state, 5, accepted=5)
    assert state[0].steps == 7  # ema 4.78 > 4.5


def test_sglang_up_hysteresis_holds_back():
    policy = one_slot((1, 3, 5, 7), initial=3, up_hysteresis=0.5)
    _, state = run_batches(policy, policy.initial_state(), 15, accepted=3)
    assert state[0].steps == 3  # 2.965 is not > 3 - 0.5 + 0.5


def test_sglang_redecide_thresholds_exactly():
    params = SlotParams(1, (1, 3, 5, 7), 0.2, 5, 10, down_hysteresis=-0.25, up_hysteresis=0.0)
    at = lambda k, ema: slot_redecide(params, SlotState(k, ema)).steps  # noqa: E731
    assert at(3, 0.25) == 1 and at(3, 0.26) == 3  # down: ema <= 1 - 0.5 - 0.25
    assert at(7, 2.25) == 3 and at(7, 0.1) == 1  # several candidates down in one re-decide
    assert at(7, 2.26) == 5 and at(5, 4.24) == 5  # between the bands: stays
    assert at(3, 2.5) == 3 and at(3, 2.51) == 5  # up: ema > 3 - 0.5
    zero = SlotParams(8, (0, 1, 3), 0.2, 5, 10, down_hysteresis=0.0, up_hysteresis=0.0)
    assert slot_redecide(zero, SlotState(1, 0.5)).steps == 0  # to 0: ema <= 0.5 + down_hysteresis
    # SGLang's bs8 default has no hysteresis, so K=1 has no dead band: just above 0.5 it rises.
    assert slot_redecide(zero, SlotState(1, 0.51)).steps == 3
    held = SlotParams(8, (0, 1, 3), 0.2, 5, 10, down_hysteresis=0.0, up_hysteresis=0.25)
    assert slot_redecide(held, SlotState(1, 0.51)).steps == 1


def test_sglang_probes_up_from_zero_and_falls_back():
    policy = one_slot((0, 1, 3), initial=0, key=8, down_hysteresis=0.0)
    plans, state = run_batches(policy, policy.initial_state(), 14, accepted=0, batch_size=8)
    assert {p.table.lookup(8, 0).depth for p in plans} == {0} and state[0].ema == -1.0  # K=0: EMA untouched
    _, state = run_batches(policy, state, 1, accepted=0, batch_size=8)
    assert state[0] == SlotState(1, 0.0, 15)  # probe K=1 from the neutral EMA
    _, state = run_batches(policy, state, 5, accepted=0, batch_size=8)
    assert state[0].steps == 0  # drafts rejected: back off
    _, state = run_batches(policy, state, 5, accepted=0, batch_size=8)
    assert state[0].steps == 1  # and probe again next interval
    _, state = run_batches(policy, state, 5, accepted=1, batch_size=8)
    assert state[0].steps == 3  # acceptance holds: 1 - 0.8**5 = 0.67 > 1 - 0.5 -> up


def test_sglang_slots_keep_their_own_counters():
    policy = SglangAdaptivePolicy(SglangAdaptiveConfig())
    _, state = run_batches(policy, policy.initial_state(), 30, accepted=0, batch_size=1)
    assert state[0].batches == 30 and state[1] == SlotState(3, 2.0, 0)  # bs8 slot untouched
    mixed = make_obs(steps=[make_step(9, [3] * 9), make_step(2, [0, 0]), make_step(40, [1] * 40)])
    _, state2 = policy.decide(state, mixed)
    assert [s.batches for s in state2] == [31, 1, 1, 0]
    assert state2[1].ema == pytest.approx(0.8 * 2.0 + 0.2 * 3)


# =========================================================================== HF heuristic


def test_hf_plus_two_minus_one_per_request():
    policy = HfHeuristicPolicy(HfHeuristicConfig(num_assistant_tokens=4))
    state = policy.initial_state()
    step = make_step(2, [4, 1], depth=4, ids=["a", "b"])
    plan, state = policy.decide(state, make_obs(steps=[step]))
    assert plan.overrides == {"a": Decision.chain(6), "b": Decision.chain(3)}
    assert plan.table.lookup(1, 0) == Decision.chain(4)  # new requests start at num_assistant_tokens
    steps = [
        StepOutcome(1, 1.0, 2, 1, 1, (RequestOutcome("a", 9, 6, 1, 6, 5), RequestOutcome("b", 9, 3, 1, 3, 3))),
        StepOutcome(2, 2.0, 2, 1, 1, (RequestOutcome("a", 9, 5, 1, 5, 0), RequestOutcome("b", 9, 5, 1, 5, 5))),
    ]
    plan, state = policy.decide(state, make_obs(steps=steps))
    assert plan.overrides == {"a": Decision.chain(4), "b": Decision.chain(7)}  # a: 6-1-1, b: 3+2+2
    assert dict(state.counters) == {"a": 4, "b": 7}


def test_hf_floor_one_and_cap_at_drafter_depth():
    policy = HfHeuristicPolicy(HfHeuristicConfig())  # HF default 20
    obs = make_obs(steps=[make_step(1, 0, depth=2, ids=["a"])], max_depth=6)
    plan, state = policy.decide(policy.initial_state(), obs)
    assert plan.table.lookup(1, 0) == Decision.chain(6)  # 20 cut to max_depth
    assert plan.overrides["a"] == Decision.chain(5)
    for _ in range(10):
        plan, state = policy.decide(state, make_obs(steps=[make_step(1, 0, depth=1, ids=["a"])], max_depth=6))
    assert plan.overrides["a"] == Decision.chain(1)  # max(1, n - 1)
    for _ in range(10):
        plan, state = policy.decide(state, make_obs(steps=[make_step(1, 6, depth=6, ids=["a"])], max_depth=6))
    assert plan.overrides["a"] == Decision.chain(6)  # never past what the drafter can draft


def test_hf_forgets_finished_and_skips_non_speculative_steps():
    policy = HfHeuristicPolicy(HfHeuristicConfig(num_assistant_tokens=5))
    plan, state = policy.decide(policy.initial_state(), make_obs(steps=[make_step(2, 5, depth=5, ids=["a", "b"])]))
    assert dict(state.counters) == {"a": 7, "b": 7}
    off_step = make_step(1, 0, depth=0, ids=["a"])
    plan, state = policy.decide(state, make_obs(steps=[off_step], active={"a": 10},
                                                finished=[FinishedRequest("b", 3, 9, 6)]))
    assert dict(state.counters) == {"a": 7} and set(plan.overrides) == {"a"}
    assert plan.reasons["a"] == "hf-heuristic n=7"


# ============================================================================ bandit UCB


def reward_obs(tokens_per_s: float, step_id: int = 0) -> Observation:
    """A round of one batch-1 step emitting 10 tokens at ``tokens_per_s``."""
    step = StepOutcome(step_id, 0.0, 1, 0.0, 10_000.0 / tokens_per_s, (RequestOutcome("r", 9, 3, 1, 3, 9),))
    return make_obs(steps=[step])


def run_bandit(policy, rates, rounds, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    state, chosen = policy.initial_state(), []
    plan, state = policy.decide(state, make_obs())
    for t in range(rounds):
        gamma = plan.table.lookup(1, 0).depth
        chosen.append(gamma)
        rate = scale * rates[gamma] * (1.0 + 0.05 * rng.standard_normal())
        plan, state = policy.decide(state, reward_obs(rate, t))
    return chosen, state


def test_bandit_round_robin_warmup():
    policy = BanditUcbPolicy(BanditUcbConfig())
    plan, state = policy.decide(policy.initial_state(), make_obs())
    order = [plan.table.lookup(1, 0).depth]
    plan, state = policy.decide(state, make_obs())  # a round without steps credits nothing
    assert plan.table.lookup(1, 0).depth == 1 and state.counts == (0, 0, 0, 0)
    for t in range(3):
        plan, state = policy.decide(state, reward_obs(100.0 + t, t))
        order.append(plan.table.lookup(1, 0).depth)
    assert order == [1, 2, 3, 4] and state.counts == (1, 1, 1, 0)
    assert set(plan.table.decisions) == {Decision.chain(4)} and plan.overrides == {}


def test_bandit_converges_to_best_arm():
    rates = {1: 50.0, 2: 100.0, 3: 200.0, 4: 120.0}
    chosen, state = run_bandit(BanditUcbPolicy(BanditUcbConfig()), rates, 1000)
    assert chosen[:4] == [1, 2, 3, 4]
    assert chosen[-50:].count(3) >= 45
    assert state.counts[2] == max(state.counts) and state.counts[2] > 700


def test_bandit_reward_scale_does_not_matter():
    rates = {1: 50.0, 2: 100.0, 3: 200.0, 4: 120.0}
    slow, _ = run_bandit(BanditUcbPolicy(BanditUcbConfig()), rates, 200)
    fast, _ = run_bandit(BanditUcbPolicy(BanditUcbConfig()), rates, 200, scale=1000.0)
    assert slow == fast  # normalising by the running max makes UCB scale-free


def test_bandit_refuses_duplicate_arms():
    with pytest.raises(ValidationError, match="distinct"):
        BanditUcbConfig(arms=[1, 2, 2])


# =============================================================== determinism, purity


def observation_sequence(seed: int, length: int = 60) -> list[Observation]:
    rng = np.random.default_rng(seed)
    obs, active, next_id = [], {}, 0
    for t in range(length):
        for _ in range(rng.integers(0, 3)):
            active[f"q{next_id}"] = int(rng.integers(10, 9000))
            next_id += 1
        steps = []
        for s in range(rng.integers(0, 3)):
            ids = list(active)[: int(rng.integers(1, 80))] or ["solo"]
            depth = int(rng.integers(0, 6))
            requests = tuple(
                RequestOutcome(rid, active.get(rid, 50), depth, 1 if depth else 0, depth,
                               int(rng.integers(0, depth + 1)))
                for rid in ids
            )
            steps.append(StepOutcome(t * 10 + s, float(t), len(ids), float(rng.uniform(1, 5)),
                                     float(rng.uniform(5, 20)), requests))
        done = [rid for rid in list(active) if rng.random() < 0.1]
        fins = [FinishedRequest(rid, int(rng.integers(1, 50)), 0, int(rng.integers(0, 60))) for rid in done]
        for rid in done:
            del active[rid]
        obs.append(make_obs(steps=steps, finished=fins, active=dict(active), now=float(t)))
    return obs


BASELINE_PRESETS = ("static", "vllm-batch-table", "trtllm-concurrency", "trtllm-gate",
                    "sglang-adaptive", "hf-heuristic", "bandit-ucb")


def test_every_baseline_preset_is_shipped():
    assert set(BASELINE_PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", BASELINE_PRESETS)
def test_replay_is_deterministic_and_state_is_not_mutated(name):
    policy = load_preset(name)
    sequence = observation_sequence(seed=7)

    def replay():
        state, plans = policy.initial_state(seed=3), []
        for obs in sequence:
            before = copy.deepcopy(state)
            plan, new_state = policy.decide(state, obs)
            assert state == before, "decide() changed the state it was given"
            plans.append(plan)
            state = new_state
        return plans, state

    first, state_a = replay()
    second, state_b = replay()
    assert first == second and state_a == state_b
    assert policy.__dict__.keys() <= {"config", "classes", "slot_params", "slot_keys"}  # configuration only, nothing run-time
