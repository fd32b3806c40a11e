"""Tests of the simulated worker (worker/sim)."""

from __future__ import annotations

import asyncio
import copy
import math

import numpy as np
import pytest

from policies.base import DrafterLimits
from policies.chain import expected_chain_accepted
from policies.table import Decision
from worker.sim.acceptance import PROFILES, AcceptanceTruth
from worker.sim.hardware import CostModel, HardwareProfile, HARDWARE_PROFILES
from worker.sim.runner import run_fleet_simulated, run_realtime, run_simulated
from worker.sim.scenario import ScenarioError, load_scenario, scenario_from_dict, shipped_scenarios
from worker.sim.traffic import TrafficGenerator
from worker.sim.tree import EMPTY_TREE, TreeCache, build_tree, quantize, sample_outcome, sample_outcomes
from worker.sim.worker import SimWorker

EAGLE = {"kind": "eagle", "version": "t1", "max_depth": 8, "max_width": 8, "max_nodes": 64, "trained_context_len": 8192}


def base_scenario(**over) -> dict:
    data = {
        "name": "t",
        "duration_s": 60,
        "seed": 3,
        "domain_acceptance": {"chat": 1.0, "code": 1.08},
        "traffic": {
            "arrivals": {"kind": "poisson", "rate": 4.0},
            "prompt_len": {"kind": "lognormal", "median": 600, "sigma": 0.8, "max": 8000},
            "output_len": {"kind": "lognormal", "median": 128, "sigma": 0.5, "min": 8, "max": 1024},
            "domain_mix": {"chat": 0.5, "code": 0.5},
        },
        "workers": [{"id": "w", "hardware": "H100-SXM", "drafter": dict(EAGLE), "max_batch_size": 64}],
        "changes": [],
    }
    data.update(over)
    return data


def const(decision: Decision):
    return lambda request_id, context_len, batch_size: decision


def goodput(cost: CostModel, batch: int, ctx: int, depth: int, alpha: np.ndarray) -> float:
    """Tokens per ms of a batch of identical requests running a chain of ``depth``."""
    bt = batch * (1 + depth)
    verify = cost.verify_ms(bt, batch * ctx, bt * ctx)
    draft = cost.draft_ms([depth] * batch, [1] * batch, [ctx] * batch)
    return batch * (1 + expected_chain_accepted(alpha, depth)) / (draft + verify)


# -- cost regimes ------------------------------------------------------------
def test_small_batch_is_memory_bound_and_verification_is_almost_free():
    cost = CostModel("H100-SXM")
    one = cost.verify_ms(1, 2000, 2000)
    eight = cost.verify_ms(8, 2000, 8 * 2000)
    assert cost.regime(8, 2000, 8 * 2000) == "memory"
    assert eight / one < 1.01
    alpha = AcceptanceTruth(PROFILES["eagle"], 8192).chain_alpha(2000, "chat", 0.0)
    assert goodput(cost, 1, 2000, 5, alpha) > 2.5 * goodput(cost, 1, 2000, 0, alpha)


def test_large_batch_short_context_is_compute_bound_and_speculation_loses():
    cost = CostModel("H100-SXM")
    batch, ctx = 256, 512
    off = cost.verify_ms(batch, batch * ctx, batch * ctx)
    four = cost.verify_ms(4 * batch, batch * ctx, 4 * batch * ctx)
    assert cost.regime(4 * batch, batch * ctx, 4 * batch * ctx) == "compute"
    # Linear in batch tokens: the marginal token costs the compute slope.
    slope = (cost.verify_ms(8 * batch, batch * ctx, 8 * batch * ctx) - four) / (4 * batch)
    assert slope == pytest.approx(cost.compute_ms(1), rel=0.05)
    assert four / off > 3.0
    alpha = AcceptanceTruth(PROFILES["eagle"], 8192).chain_alpha(ctx, "chat", 0.0)
    g_off = goodput(cost, batch, ctx, 0, alpha)
    assert all(goodput(cost, batch, ctx, d, alpha) < g_off for d in (1, 2, 3, 5))


def test_long_context_large_batch_is_kv_bound_and_speculation_pays_again():
    cost = CostModel(HARDWARE_PROFILES["H200"].model_copy(update={"count": 4}))
    batch, ctx = 64, 32768
    assert batch * (ctx + 512) <= cost.kv_capacity_tokens()  # physically fits
    kv = batch * ctx
    off = cost.verify_ms(batch, kv, batch * ctx)
    four = cost.verify_ms(4 * batch, kv, 4 * batch * ctx)
    assert cost.regime(4 * batch, kv, 4 * batch * ctx) == "memory"
    assert four / off < 1.02
    # The same batch at short context is compute-bound (regime 2) ...
    assert cost.regime(8 * batch, batch * 512, 8 * batch * 512) == "compute"
    # ... but at 32k speculation pays even with acceptance decayed past the 8k training length.
    alpha = AcceptanceTruth(PROFILES["eagle"], 8192).chain_alpha(ctx, "chat", 0.0)
    assert alpha[0] < 0.7
    assert goodput(cost, batch, ctx, 3, alpha) > 1.3 * goodput(cost, batch, ctx, 0, alpha)


def test_draft_costs_by_kind():
    eagle = CostModel("H100-SXM", drafter="eagle")
    medusa = CostModel("H100-SXM", drafter="medusa")
    assert eagle.draft_ms([0, 0], [0, 0], [100, 100]) == 0.0
    # EAGLE: sequential forwards, so cost grows with depth; Medusa: one pass.
    e = [eagle.draft_ms([d], [1], [1000]) for d in (1, 2, 4, 8)]
    assert all(b > a for a, b in zip(e, e[1:]))
    assert e[3] == pytest.approx(8 * e[0], rel=0.15)
    m = [medusa.draft_ms([d], [4], [1000]) for d in (1, 4)]
    assert m[0] < m[1] < 0.5 * e[2]  # one cheap pass of all heads
    # Noise is log-normal around the model with a ~3% spread.
    rng = np.random.default_rng(0)
    samples = np.array([eagle.noisy(10.0, rng) for _ in range(4000)])
    assert np.median(samples) == pytest.approx(10.0, rel=0.01)
    assert np.std(np.log(samples)) == pytest.approx(0.03, rel=0.1)


# -- acceptance --------------------------------------------------------------
def test_rank_probs_are_valid_distributions():
    for name, profile in PROFILES.items():
        model = AcceptanceTruth(profile, 8192, max_width=8)
        for ctx in (0, 1000, 8192, 50_000, 128_000):
            for mult in (0.7, 1.0, 1.3):
                q = model.true_rank_probs(ctx, "chat", 0.0, mult)
                assert q.shape == (model.max_depth, 8)
                assert np.all(q > 0)
                assert np.all(q.sum(axis=1) <= profile.row_cap + 1e-12)
                assert np.all(np.diff(q, axis=1) <= 1e-12), (name, ctx)


def test_acceptance_decays_with_context_gently_inside_steeply_beyond():
    model = AcceptanceTruth(PROFILES["eagle"], trained_context_len=8192)
    ctxs = [0, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    a1 = [model.chain_alpha(c, "chat", 0.0)[0] for c in ctxs]
    assert all(b < a for a, b in zip(a1, a1[1:]))
    assert a1[3] / a1[0] > 0.9  # within the trained length: gentle
    inside_per_doubling = a1[3] / a1[2]
    beyond_per_doubling = a1[4] / a1[3]
    assert beyond_per_doubling < inside_per_doubling
    assert a1[-1] / a1[0] < 0.6
    # Draft-KV error compounds: deeper positions lose more.
    short, long = model.chain_alpha(1000, "chat", 0.0), model.chain_alpha(64000, "chat", 0.0)
    ratio = long / short
    assert np.all(np.diff(ratio) < 0)


def test_medusa_and_eagle_expected_lengths_match_design_numbers():
    for name, d, w, n, lo, hi in [("eagle", 7, 8, 60, 4.0, 5.5), ("medusa", 4, 8, 64, 2.2, 3.6)]:
        model = AcceptanceTruth(PROFILES[name], 8192)
        q = model.true_rank_probs(800, "chat", 0.0)
        tree = build_tree(q, d, w, n)
        assert lo <= 1 + exact_tree_expectation(tree, q) <= hi
    q = AcceptanceTruth(PROFILES["medusa"], 8192).true_rank_probs(800, "chat", 0.0)
    assert q[0, 0] == pytest.approx(0.6, abs=0.01)


def drift_scenario() -> dict:
    return base_scenario(
        duration_s=90,
        changes=[
            {"at_s": 30, "over_s": 5, "kind": "drift", "domain": "code", "factor": 0.7},
            {"at_s": 60, "kind": "drift", "domain": "code", "factor": 1.0},
        ],
    )


def test_scheduled_drift_drops_one_domain_then_recovers():
    worker = SimWorker.fleet(scenario_from_dict(drift_scenario()))[0]
    acc = worker.acceptance
    before, during, after = (acc.true_rank_probs(1000, "code", t) for t in (10, 45, 75))
    chat = acc.true_rank_probs(1000, "chat", 45)
    assert acc.domain_factor("code", 45) == pytest.approx(0.7 * 1.08)
    assert during == pytest.approx(0.7 * 1.08 * chat)  # (before is capped at row_cap)
    assert during[0, 0] < 0.8 * before[0, 0]
    assert after == pytest.approx(before)
    assert acc.true_rank_probs(1000, "chat", 45) == pytest.approx(acc.true_rank_probs(1000, "chat", 10))
    assert acc.domain_factor("code", 32.5) == pytest.approx(1.08 * 0.85)  # halfway down the ramp

    # And the outcomes the worker samples follow it.
    per_phase = {("code", p): [0, 0] for p in range(3)} | {("chat", p): [0, 0] for p in range(3)}
    def record(result):
        if result.telemetry is None:
            return
        phase = 0 if result.now < 30 else 1 if result.now < 60 else 2
        if 30 <= result.now < 36:
            return  # ramp
        for r in result.telemetry.requests:
            cell = per_phase[(r.domain, phase)]
            cell[0] += r.accepted
            cell[1] += 1
    run_simulated(worker, const(Decision.chain(4)), 90, on_step=record)
    mean = {k: a / n for k, (a, n) in per_phase.items()}
    assert mean[("code", 1)] < 0.8 * mean[("code", 0)]
    assert mean[("code", 2)] > 0.9 * mean[("code", 0)]
    assert mean[("chat", 1)] > 0.9 * mean[("chat", 0)]


# -- trees -------------------------------------------------------------------
def exact_tree_expectation(tree, q) -> float:
    """E[τ] = Σ over nodes of the product of q along the node's path."""
    total = 0.0
    stack = [(0, 0, 1.0)]  # node, level, path value
    while stack:
        node, level, value = stack.pop()
        for r in range(int(tree.child_count[node])):
            v = value * q[level, r]
            total += v
            stack.append((int(tree.first_child[node]) + r, level + 1, v))
    return total


def random_q(rng, depth=6, width=5):
    alpha = rng.uniform(0.2, 0.9, size=depth)
    shape = np.concatenate([[1.0], rng.uniform(0.05, 0.3) * 0.6 ** np.arange(width - 1)])
    q = alpha[:, None] * shape[None, :]
    return q * np.minimum(1.0, 0.98 / q.sum(axis=1, keepdims=True))


def test_build_tree_respects_limits():
    rng = np.random.default_rng(1)
    for _ in range(60):
        q = random_q(rng)
        d, w = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        n = int(rng.integers(d, d * w + 3))
        tree = build_tree(q, d, w, n)
        assert tree.depth <= d and tree.width <= w
        assert tree.nodes == min(n, sum(w**k for k in range(1, d + 1)))
        assert sum(tree.level_sizes) == tree.nodes == int(tree.child_count.sum())
        assert len(tree.child_count) == tree.nodes + 1
    assert build_tree(q, 0, 0, 0) is EMPTY_TREE


def test_outcomes_are_consistent():
    rng = np.random.default_rng(2)
    for _ in range(40):
        q = random_q(rng)
        d, w = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        tree = build_tree(q, d, w, int(rng.integers(d, d * w + 1)))
        for _ in range(50):
            out = sample_outcome(tree, q, rng.random(q.shape[0]))
            e = len(out.accepted_rank)
            assert len(out.level_candidates) == e
            assert out.accepted <= tree.depth
            assert all(r >= 1 for r in out.accepted_rank[: out.accepted])
            assert all(0 <= r <= c <= w for r, c in zip(out.accepted_rank, out.level_candidates))
            assert e <= min(out.accepted + 1, tree.depth)
            if e == out.accepted + 1:
                assert out.accepted_rank[-1] == 0  # ended by a rejection
            else:
                assert e == out.accepted  # ended at a leaf
            # walk to the final node: a leaf-ended path really ends at a leaf
            node = 0
            for r in out.accepted_rank[: out.accepted]:
                node = int(tree.first_child[node]) + r - 1
            if e == out.accepted:
                assert tree.child_count[node] == 0


def test_vectorised_outcomes_match_single():
    rng = np.random.default_rng(3)
    qs = np.stack([random_q(rng) for _ in range(30)])
    trees = [build_tree(q, int(rng.integers(0, 7)), int(rng.integers(1, 5)), 12) for q in qs]
    u = rng.random((30, qs.shape[1]))
    acc, ranks, offered = sample_outcomes(trees, qs, u)
    for i, tree in enumerate(trees):
        one = sample_outcome(tree, qs[i], u[i])
        assert acc[i] == one.accepted
        assert tuple(ranks[i]) == one.accepted_rank
        assert tuple(offered[i]) == one.level_candidates


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_chain_mean_accepted_matches_formula(depth):
    q = AcceptanceTruth(PROFILES["eagle"], 8192).true_rank_probs(2000, "chat", 0.0)
    tree = build_tree(q, depth, 1, depth)
    n = 20000
    acc, _, _ = sample_outcomes([tree] * n, np.broadcast_to(q, (n,) + q.shape), np.random.default_rng(depth).random((n, 8)))
    acc = np.array(acc)
    expected = expected_chain_accepted(q[:, 0], depth)
    se = acc.std() / math.sqrt(n)
    assert abs(acc.mean() - expected) < 4 * se + 1e-3


def test_tree_mean_accepted_matches_sum_of_path_products():
    q = AcceptanceTruth(PROFILES["eagle"], 8192).true_rank_probs(2000, "chat", 0.0)
    tree = build_tree(q, 6, 4, 32)
    n = 20000
    acc, _, _ = sample_outcomes([tree] * n, np.broadcast_to(q, (n,) + q.shape), np.random.default_rng(9).random((n, 8)))
    acc = np.array(acc)
    assert abs(acc.mean() - exact_tree_expectation(tree, q)) < 4 * acc.std() / math.sqrt(n)
    assert exact_tree_expectation(tree, q) > expected_chain_accepted(q[:, 0], 6)


def test_tree_cache_reuses_shapes():
    cache = TreeCache(maxsize=2)
    q = AcceptanceTruth(PROFILES["eagle"], 8192).true_rank_probs(2000, "chat", 0.0)
    a = cache.get(quantize(q), 5, 4, 20)
    b = cache.get(quantize(q * (1 + 1e-6)), 5, 4, 20)
    assert a is b and cache.hits == 1
    assert cache.get(quantize(q), 0, 0, 0) is EMPTY_TREE


# -- worker ------------------------------------------------------------------
def test_step_telemetry_accounts_tokens_and_costs():
    data = base_scenario()
    data["workers"][0]["noise_sigma"] = 0.0
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    dec = Decision(5, 3, 16)
    now, steps, finished = 0.0, 0, []
    while now < 20:
        res = worker.step(now, const(dec))
        if res.idle:
            assert res.telemetry is None and res.duration_s >= 0
            now = res.end
            continue
        tel = res.telemetry
        steps += 1
        assert tel.step_id == steps and tel.batch_size == len(tel.requests) <= 64
        bt = sum(1 + r.nodes for r in tel.requests)
        kv = sum(r.context_len for r in tel.requests)
        pairs = sum((1 + r.nodes) * r.context_len for r in tel.requests)
        assert tel.verify_ms == pytest.approx(worker.cost.verify_ms(bt, kv, pairs))
        assert tel.timestamp == pytest.approx(res.end)
        assert res.duration_s == pytest.approx((tel.draft_ms + tel.verify_ms) / 1e3)
        for r in tel.requests:
            assert r.depth <= 5 and r.width <= 3 and r.nodes <= 16
            assert r.domain in ("chat", "code")
            ranks, cands = r.position_outcomes()
            assert len(ranks) == len(cands) <= min(r.accepted + 1, r.depth)
        finished += res.finished
        now = res.end
    st = worker.stats
    assert st.steps == steps and finished
    assert len(st.finished) == len(finished)
    for s, rec in zip(finished, st.finished):
        assert s.request_id == rec.request_id and s.generated_tokens == rec.generated_tokens
        assert s.steps <= s.generated_tokens
    assert st.goodput > 0 and st.speculation_fraction == 1.0
    assert 0 < st.tpot_ms() < 50
    assert st.mean_accepted == pytest.approx(st.accepted_tokens / st.request_steps)


def test_prefill_and_confidence_options():
    data = base_scenario()
    data["workers"][0].update(prefill=True, report_confidence=True)
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    seen_prefill = False
    def check(res):
        nonlocal seen_prefill
        if res.telemetry is None:
            return
        tel = res.telemetry
        assert res.duration_s == pytest.approx((res.prefill_ms + tel.draft_ms + tel.verify_ms) / 1e3)
        seen_prefill |= res.prefill_ms > 0
        for r in tel.requests:
            assert len(r.draft_confidence) == len(r.accepted_rank)
            assert all(0 < c <= 1 for c in r.draft_confidence)
    run_simulated(worker, const(Decision.chain(3)), 5.0, on_step=check)
    assert seen_prefill and worker.stats.prefill_ms > 0


def test_kv_capacity_limits_admission():
    data = base_scenario()
    data["workers"][0].update(kv_capacity_tokens=20_000, max_batch_size=256)
    data["traffic"]["arrivals"]["rate"] = 50.0
    data["traffic"]["prompt_len"] = {"kind": "fixed", "value": 1900}
    data["traffic"]["output_len"] = {"kind": "fixed", "value": 100}
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    res = run_simulated(worker, const(Decision.off()), 5.0, on_step=lambda r: r.telemetry and assert_le(r.telemetry.batch_size, 10))
    assert res.stats.finished and worker.queue_len > 0


def assert_le(a, b):
    assert a <= b


def test_same_seed_same_arrivals_whatever_the_policy():
    scenario = scenario_from_dict(
        base_scenario(
            traffic={
                **base_scenario()["traffic"],
                "arrivals": {"kind": "bursty", "rate_on": 15, "rate_off": 2, "mean_on_s": 3, "mean_off_s": 5},
            },
            changes=[
                {"at_s": 5, "over_s": 5, "kind": "rate", "scale": 2.0},
                {"at_s": 8, "over_s": 4, "kind": "context", "prompt_len": {"kind": "uniform", "min": 2000, "max": 6000}},
                {"at_s": 14, "kind": "domain_mix", "domain_mix": {"code": 1.0}},
            ],
        )
    )
    logs = []
    for dec in (Decision.off(), Decision(6, 4, 32), Decision.chain(2)):
        worker = SimWorker.fleet(scenario)[0]
        log: list = []
        pop = worker.traffic.pop_until
        worker.traffic.pop_until = recording(pop, log)
        run_simulated(worker, const(dec), 20.0)
        log.extend(pop(20.0))  # arrivals after the last step started
        logs.append([a for a in log if a.arrival_s <= 20.0])
    assert len(logs[0]) > 100
    assert logs[0] == logs[1] == logs[2]
    assert {a.domain for a in logs[0] if a.arrival_s > 14} == {"code"}
    assert min(a.prompt_len for a in logs[0] if a.arrival_s > 12) >= 2000
    other = TrafficGenerator(scenario.traffic, scenario.changes, seed=12345)
    assert [a.arrival_s for a in other.pop_until(20.0)] != [a.arrival_s for a in logs[0]]


def recording(pop, log):
    def wrapped(t):
        out = pop(t)
        log.extend(out)
        return out
    return wrapped


def test_outcome_stream_is_seeded():
    scenario = scenario_from_dict(base_scenario())
    runs = []
    for _ in range(2):
        worker = SimWorker.fleet(scenario)[0]
        run_simulated(worker, const(Decision(4, 2, 8)), 10.0)
        runs.append(worker.stats.summary())
    assert runs[0] == runs[1]


def test_hello_info_matches_the_protocol_fields():
    worker = SimWorker.fleet(load_scenario("long-context"))[0]
    hello = worker.hello.to_dict()
    assert hello["engine"] == "specctl-sim" and hello["model"] == "llama-3-8b"
    hw = hello["hardware"]
    assert hw["accelerator"] == "H200" and hw["count"] == 4
    assert hw["memory_bandwidth_gb_s"] == pytest.approx(4 * 4800)
    assert hw["kv_bytes_per_token"] == 128 * 1024 and hw["params"] == 8e9 and hw["weight_bytes"] == 16e9
    limits = DrafterLimits(**hello["drafter"])
    assert (limits.kind, limits.max_depth, limits.max_tree_nodes, limits.trained_context_len) == ("eagle", 8, 64, 8192)


def test_request_rank_probs_for_oracles():
    worker = SimWorker.fleet(scenario_from_dict(base_scenario()))[0]
    res = run_simulated(worker, const(Decision.chain(2)), 3.0)
    r = worker.running[0] if worker.running else None
    if r is not None:
        q = worker.request_rank_probs(r.request_id, res.end_s)
        assert q == pytest.approx(worker.acceptance.true_rank_probs(r.context_len, r.domain, res.end_s, r.multiplier))
    with pytest.raises(KeyError):
        worker.request_rank_probs("nope", 0.0)


# -- runner ------------------------------------------------------------------
class RecordingAgent:
    def __init__(self):
        self.decisions = 0
        self.steps = []
        self.finished = []

    def decide(self, request_id, context_len, batch_size):
        self.decisions += 1
        return Decision.chain(3) if batch_size < 16 else Decision.chain(1)

    def observe(self, step):
        self.steps.append(step)

    def finish(self, summary):
        self.finished.append(summary)


def test_run_simulated_with_an_agent():
    worker = SimWorker.fleet(scenario_from_dict(base_scenario()))[0]
    agent = RecordingAgent()
    res = run_simulated(worker, agent, 20.0)
    assert res.end_s >= 20.0 and res.steps == len(agent.steps) == worker.stats.steps
    assert agent.decisions == worker.stats.request_steps
    assert len(agent.finished) == len(worker.stats.finished)
    assert [s.step_id for s in agent.steps] == list(range(1, res.steps + 1))


def test_fleet_runs_interleave_in_time_order():
    scenario = load_scenario("mixed-fleet")
    workers = SimWorker.fleet(scenario)
    seen = []
    run_fleet_simulated(workers, const(Decision.chain(2)), 2.0, on_step=lambda w, r: seen.append(r.now))
    assert seen == sorted(seen) and len({w.worker_id for w in workers}) == 4


async def test_run_realtime_paces_and_reports():
    worker = SimWorker.fleet(scenario_from_dict(base_scenario()))[0]
    agent = RecordingAgent()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    res = await run_realtime(worker, agent, 3.0, time_scale=0.05)
    wall = loop.time() - t0
    assert res.end_s >= 3.0 and agent.steps and len(agent.steps) == res.steps
    # Paced: 3 scenario seconds at 0.05 take at least 0.15 s of wall time (sleeps aim at absolute deadlines).
    # No upper bound: how much longer a shared machine takes is not the runner's behaviour.
    assert wall >= 0.1
    assert agent.steps[0].timestamp > 1e9  # epoch seconds


# -- scenarios ---------------------------------------------------------------
def bad(mutate) -> str:
    data = copy.deepcopy(base_scenario())
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data)
    return str(info.value)


@pytest.mark.parametrize(
    "mutate, field, value",
    [
        (lambda d: d["workers"][0].update(max_batch_size=-3), "workers.0.max_batch_size", "-3"),
        (lambda d: d["workers"][0].update(colour="red"), "workers.0.colour", "'red'"),
        (lambda d: d["workers"][0].update(hardware="B200"), "workers.0.hardware", "'B200'"),
        (lambda d: d["traffic"]["arrivals"].update(kind="poison"), "traffic.arrivals", "'poison'"),
        (lambda d: d["traffic"]["prompt_len"].update(sigma="wide"), "traffic.prompt_len.sigma", "'wide'"),
        (lambda d: d.update(duration_s=0), "duration_s", "0"),
        (lambda d: d["workers"][0]["drafter"].update(max_nodes=2), "max_nodes", "2"),
        (lambda d: d["changes"].append({"at_s": 5, "kind": "drift", "domain": "cod", "factor": 0.8}), "changes.0.domain", "'cod'"),
        (lambda d: d["changes"].append({"at_s": 500, "kind": "rate", "scale": 2}), "changes.0.at_s", "500"),
        (lambda d: d["changes"].append({"at_s": 5, "kind": "rate", "scale": 2, "rate": 3}), "rate", "scale=2"),
        (lambda d: d["workers"].append(dict(d["workers"][0])), "duplicate worker ids", "'w'"),
        (lambda d: d["workers"][0]["drafter"].update(acceptance={"alpha": [1.5]}), "alpha", "1.5"),
    ],
)
def test_scenario_errors_name_field_and_value(mutate, field, value):
    message = bad(mutate)
    assert field in message and value in message, message


def test_scenario_errors_are_all_reported():
    data = base_scenario()
    data["changes"] += [
        {"at_s": 5, "kind": "drift", "domain": "cod", "factor": 0.8},
        {"at_s": 90, "kind": "rate", "scale": 2, "workers": ["nobody"]},
    ]
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data, "x.yaml")
    lines = info.value.errors
    assert any(l.startswith("changes.0.domain:") and "'cod'" in l for l in lines)
    assert any(l.startswith("changes.1.at_s:") and "90" in l for l in lines)
    assert any(l.startswith("changes.1.workers:") and "'nobody'" in l for l in lines)
    assert "x.yaml" in str(info.value)


def test_arrival_rates_follow_the_schedule():
    data = base_scenario(
        duration_s=400,
        changes=[{"at_s": 100, "over_s": 100, "kind": "rate", "rate": 12.0}, {"at_s": 300, "kind": "rate", "scale": 0.5}],
    )
    scenario = scenario_from_dict(data)
    gen = TrafficGenerator(scenario.traffic, scenario.changes, seed=5)
    times = np.array([a.arrival_s for a in gen.pop_until(400)])
    def count(a, b):
        return int(((times >= a) & (times < b)).sum())
    for (a, b), rate in {(0, 100): 4.0, (200, 300): 12.0, (300, 400): 2.0, (140, 160): 8.0}.items():
        expected = rate * (b - a)
        assert abs(count(a, b) - expected) < 4 * math.sqrt(expected), (a, b)
    bursty = base_scenario()["traffic"] | {
        "arrivals": {"kind": "bursty", "rate_on": 20, "rate_off": 1, "mean_on_s": 5, "mean_off_s": 15}
    }
    scenario = scenario_from_dict(base_scenario(traffic=bursty))
    gen = TrafficGenerator(scenario.traffic, (), seed=6)
    n = len(gen.pop_until(2000))
    assert n / 2000 == pytest.approx(scenario.traffic.arrivals.mean_rate, rel=0.2)  # (20*5 + 15) / 20 = 5.75
    gaps = np.diff([0.0] + [a.arrival_s for a in TrafficGenerator(scenario.traffic, (), seed=6).pop_until(2000)])
    assert np.std(gaps) / np.mean(gaps) > 1.5  # burstier than Poisson (CV 1)


def test_scenario_loading_errors(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(path)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    path.write_text("- 1\n")
    with pytest.raises(ScenarioError, match="mapping"):
        load_scenario(path)


REQUIRED = {"demo", "chat-low-load", "bursty", "long-context", "context-shift", "content-drift", "mixed-fleet", "threshold-cliff"}


def test_shipped_scenarios_load_and_run():
    paths = shipped_scenarios()
    assert REQUIRED <= {p.stem for p in paths}
    for path in paths:
        scenario = load_scenario(path)
        assert scenario.name == path.stem
        workers = SimWorker.fleet(scenario)
        results = run_fleet_simulated(workers, const(Decision.chain(2)), 2.0)
        assert any(r.stats.tokens > 0 for r in results), path.stem
    demo = load_scenario("demo")
    kinds = {s.drafter.kind for s in demo.workers}
    hardware = {s.hardware_profile().name for s in demo.workers}
    assert kinds == {"eagle", "medusa"} and hardware == {"H100-SXM", "H200"}
    assert {c.kind for c in demo.changes} >= {"rate", "drift"}


def test_inline_hardware_profile():
    data = base_scenario()
    data["workers"][0]["hardware"] = {"name": "A100", "bandwidth_gb_s": 2039, "peak_tflops": 312, "memory_gb": 80}
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    assert worker.hello.hardware.accelerator == "A100"
    assert isinstance(worker.cost.hardware, HardwareProfile)


# -- closed-loop users ---------------------------------------------------------
def closed(users: int = 6, **arrivals) -> dict:
    data = base_scenario(duration_s=30)
    data["traffic"]["arrivals"] = {"kind": "closed", "users": users, **arrivals}
    return data


def batch_sizes(worker: SimWorker, decision: Decision, until: float) -> list[tuple[float, int]]:
    seen: list[tuple[float, int]] = []
    run_simulated(worker, const(decision), until,
                  on_step=lambda r: seen.append((r.now, r.telemetry.batch_size)) if r.telemetry else None)
    return seen


def test_closed_loop_users_keep_the_batch_full_and_a_faster_policy_serves_more():
    scenario = scenario_from_dict(closed(users=6))
    served = {}
    for decision in (Decision.off(), Decision(5, 4, 16)):
        worker = SimWorker.fleet(scenario)[0]
        sizes = batch_sizes(worker, decision, 20.0)
        assert {b for _, b in sizes} == {6}  # no think time: every user always waits on a reply
        served[decision.depth] = (len(worker.stats.finished), worker.stats.goodput)
    # Speculation decodes faster, so the same users get more replies and the GPU emits more tokens.
    assert served[5][0] > 1.5 * served[0][0] and served[5][1] > 1.5 * served[0][1]


def test_closed_loop_user_requests_are_the_same_whatever_the_policy():
    scenario = scenario_from_dict(closed(users=3))
    firsts = []
    for decision in (Decision.off(), Decision(6, 4, 24)):
        worker = SimWorker.fleet(scenario)[0]
        log: list = []
        worker.traffic.pop_until = recording(worker.traffic.pop_until, log)
        run_simulated(worker, const(decision), 10.0)
        firsts.append({a.request_id: (a.prompt_len, a.output_len, a.domain, a.multiplier) for a in log})
    common = set(firsts[0]) & set(firsts[1])
    assert {f"w/u{u}.0" for u in range(3)} <= common and len(firsts[1]) > len(firsts[0])
    assert all(firsts[0][rid] == firsts[1][rid] for rid in common)


def test_think_time_lowers_concurrency_and_user_changes_follow_the_schedule():
    data = closed(users=20, think_s=2.0)
    data["changes"] = [{"at_s": 10, "kind": "rate", "users": 4}, {"at_s": 20, "kind": "rate", "scale": 0.4}]
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    sizes = np.array(batch_sizes(worker, Decision.chain(2), 30.0))

    def mean(a, b):
        sel = (sizes[:, 0] >= a) & (sizes[:, 0] < b)
        return sizes[sel, 1].mean(), sizes[sel, 1].max()

    busy, most = mean(2, 10)
    assert 2 < busy < 15 and most <= 20  # users spend part of the time thinking
    assert mean(14, 20)[1] <= 4  # the users beyond four stop once their reply is in
    assert 4 < mean(23, 30)[1] <= 8  # scale multiplies the base count: 8 users
    assert worker.stats.rejected == 0


def test_bursty_users_switch_between_two_counts():
    worker = SimWorker.fleet(scenario_from_dict(closed(users=2, burst_users=40, mean_on_s=3, mean_off_s=3)))[0]
    sizes = {b for _, b in batch_sizes(worker, Decision.chain(1), 30.0)}
    assert 2 in sizes and 40 in sizes


@pytest.mark.parametrize(
    "mutate, field, value",
    [
        (lambda d: d["changes"].append({"at_s": 5, "kind": "rate", "rate": 3.0}), "changes.0.rate", "closed-loop"),
        (lambda d: d["traffic"]["arrivals"].update(burst_users=9), "burst_users", "mean_on_s=None"),
        (lambda d: d["traffic"]["arrivals"].update(users=0), "users", "(0)"),
        (lambda d: d["traffic"]["arrivals"].update(think_s=-1), "think_s", "-1"),
        (lambda d: d["changes"].append({"at_s": 5, "kind": "rate", "users": 3, "scale": 2}), "rate", "users=3"),
    ],
)
def test_closed_loop_errors_name_field_and_value(mutate, field, value):
    data = closed()
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data)
    assert field in str(info.value) and value in str(info.value), str(info.value)


def test_users_change_refused_for_open_loop_arrivals():
    data = base_scenario()
    data["changes"].append({"at_s": 5, "kind": "rate", "users": 30})
    with pytest.raises(ScenarioError, match=r"changes.0.users: 30 .*open-loop"):
        scenario_from_dict(data)
