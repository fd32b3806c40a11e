"""Correlated acceptance in the simulator (issue 28, item 3): spans of near-copy and
unguessable text as a hidden Markov state per request, default off."""

from __future__ import annotations

import copy
import hashlib
import io
import math

import numpy as np
import pytest
from rich.console import Console

from bench.oracle import OracleDecider
from bench.policies import drive, run_policy_bench
from policies.table import Decision
from worker.sim.acceptance import AcceptanceTruth, CorrelatedAcceptance, PROFILES, SpanModel
from worker.sim.runner import run_simulated
from worker.sim.scenario import ScenarioError, load_scenario, scenario_from_dict, shipped_scenarios
from worker.sim.traffic import TrafficGenerator
from worker.sim.tree import sample_ranks
from worker.sim.worker import SimWorker

EAGLE = {"kind": "eagle", "version": "t1", "max_depth": 8, "max_width": 8, "max_nodes": 64, "trained_context_len": 8192}
COPY_NOVEL = {"states": [{"name": "copy", "acceptance": 0.95, "mean_span": 120},
                         {"name": "novel", "acceptance": 0.1, "mean_span": 60}]}


def scenario(corr: dict | None = None, users: int = 6, duration_s: float = 6.0) -> dict:
    data = {
        "name": "t",
        "duration_s": duration_s,
        "seed": 3,
        "domain_acceptance": {"chat": 1.0, "code": 1.08},
        "traffic": {
            "arrivals": {"kind": "closed", "users": users},
            "prompt_len": {"kind": "lognormal", "median": 600, "sigma": 0.8, "max": 8000},
            "output_len": {"kind": "lognormal", "median": 200, "sigma": 0.5, "min": 16, "max": 1024},
            "domain_mix": {"chat": 0.5, "code": 0.5},
        },
        "workers": [{"id": "w", "hardware": "H100-SXM", "drafter": dict(EAGLE), "max_batch_size": 64}],
    }
    if corr is not None:
        data["traffic"]["correlated_acceptance"] = corr
    return data


def const(decision: Decision):
    return lambda request_id, context_len, batch_size: decision


def run(data: dict, decision: Decision, until: float = 3.0):
    """(stats summary, per-step (request id, τ, ranks) outcomes) of one worker."""
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    outcomes = []
    run_simulated(worker, const(decision), until, on_step=lambda r: outcomes.extend(
        (q.request_id, q.accepted, tuple(q.accepted_rank)) for q in r.telemetry.requests) if r.telemetry else None)
    return worker.stats.summary(), outcomes


# -- off: as today --------------------------------------------------------------------------
# Seeded outcomes of scenario() with the option off, measured before the option existed:
# stats, and a digest of every request-step's (request id, τ, accepted ranks).
GOLDEN = {
    Decision(4, 2, 8): ({"steps": 383, "tokens": 8013, "mean_accepted": 2.51, "finished": 36}, "55ec3157afdb5ad1"),
    Decision.chain(3): ({"steps": 399, "tokens": 6879, "mean_accepted": 1.889, "finished": 30}, "c9a0f9905fa41a66"),
}


@pytest.mark.parametrize("decision", list(GOLDEN))
def test_off_is_identical_to_today(decision):
    summary, outcomes = run(scenario(), decision)
    stats, digest = GOLDEN[decision]
    assert {k: summary[k] for k in stats} == stats
    assert hashlib.sha256(repr(outcomes).encode()).hexdigest()[:16] == digest


def test_neutral_states_change_no_outcome_and_old_scenarios_do_not_mention_it():
    """States that leave every row as it is (scale 1.0) give today's outcomes draw for draw:
    the option draws nothing from the outcome stream."""
    neutral = {"states": [{"name": "a", "scale": 1.0, "mean_span": 5}, {"name": "b", "scale": 1.0, "mean_span": 9}]}
    for decision in (Decision(4, 2, 8), Decision.chain(3)):
        assert run(scenario(neutral), decision) == run(scenario(), decision)
    for path in shipped_scenarios():
        if not path.stem.startswith("correlated-"):
            dumped = load_scenario(path).model_dump(mode="json", exclude_none=True)
            assert "correlated_acceptance" not in dumped["traffic"], path.stem


# -- on: marginal vs whole chains ---------------------------------------------------------
def sampled_chains(model: SpanModel, q: np.ndarray, requests: int = 3000, seed: int = 1):
    """Rank-1 outcomes [samples, 4] of draft windows at token positions drawn independently of
    the outcomes (so every token counts alike), and the states of those windows."""
    rng = np.random.default_rng(seed)
    states = []
    for i in range(requests):
        path = model.path(np.random.SeedSequence([seed, i]))
        for start in np.sort(rng.integers(0, 2000, size=4)):
            states.append(path.window(int(start), 4))
    states = np.array(states)
    qs = model.apply(np.broadcast_to(q[:4], (len(states), 4, q.shape[1])).copy(), states)
    ranks = sample_ranks(qs, rng.random((len(states), 4)))
    return ranks == 1, states, qs


def test_marginal_acceptance_matches_the_config_and_whole_chains_are_far_likelier():
    model = SpanModel(CorrelatedAcceptance.model_validate(COPY_NOVEL), row_cap=0.98)
    assert model.stationary == pytest.approx([120 / 180, 60 / 180])
    expected = 0.95 * 120 / 180 + 0.1 * 60 / 180  # the config's per-token mean, at every position
    q = AcceptanceTruth(PROFILES["eagle"], 8192).true_rank_probs(1000, "chat", 0.0)
    accepted, _, _ = sampled_chains(model, q)
    n = len(accepted)
    per_position = accepted.mean(axis=0)
    se = math.sqrt(expected * (1 - expected) / n)
    # Windows of one request share their states, so allow a little more than binomial error.
    assert np.all(np.abs(per_position - expected) < 6 * se), (per_position, expected)
    whole = accepted.all(axis=1).mean()
    independent = float(np.prod(per_position))
    assert whole > 2.0 * independent, (whole, independent)
    # Given the state: 0.95^4 in a copy span, 0.1^4 in a novel one (and a little for windows that straddle).
    assert whole == pytest.approx(120 / 180 * 0.95**4 + 60 / 180 * 0.1**4, abs=0.03)
    # Rejected at once: the first position fails about as often as the mean says, and then the chain is empty.
    assert (~accepted[:, 0]).mean() == pytest.approx(1 - expected, abs=6 * se)


def test_a_scale_state_keeps_the_request_shape_and_the_row_valid():
    corr = CorrelatedAcceptance.model_validate({"states": [
        {"name": "up", "scale": 1.3, "mean_span": 50}, {"name": "same", "scale": 1.0, "mean_span": 50},
        {"name": "down", "scale": 0.1, "mean_span": 50}]})
    model = SpanModel(corr, row_cap=0.98)
    q = AcceptanceTruth(PROFILES["eagle"], 8192).true_rank_probs(1000, "chat", 0.0)
    same = model.transform(q, 1)
    assert np.array_equal(same, q)
    up, down = model.transform(q, 0), model.transform(q, 2)
    assert np.all(up[:, 0] == pytest.approx(np.minimum(1.3 * q[:, 0], 0.98)))
    assert down[:, 0] == pytest.approx(0.1 * q[:, 0])
    for rows in (up, down):
        assert np.all(rows >= 0) and np.all(rows.sum(axis=1) <= 0.98 + 1e-12)
        assert np.all(np.diff(rows, axis=1) <= 1e-12)  # ranks stay ordered


def test_in_the_simulator_a_chain_is_accepted_whole_or_not_at_all():
    """Seeded simulator steps with a chain of 4: all-or-nothing far more often than the
    independent product of the per-step rank-1 rate."""
    _, on = run(scenario(COPY_NOVEL, users=16, duration_s=20.0), Decision.chain(4), until=20.0)
    _, off = run(scenario(None, users=16, duration_s=20.0), Decision.chain(4), until=20.0)
    for outcomes, correlated in ((on, True), (off, False)):
        taus = np.array([tau for _, tau, _ in outcomes])
        p1 = float((taus >= 1).mean())
        whole, none = float((taus == 4).mean()), float((taus == 0).mean())
        assert none == pytest.approx(1 - p1)
        if correlated:
            assert whole > 2.0 * p1**4, (whole, p1)
            assert whole + none > 0.75
        else:
            assert whole < 1.3 * p1**4  # independent positions, falling with depth: at most the product


# -- spans -------------------------------------------------------------------------------
def test_span_lengths_and_transitions_follow_the_config():
    corr = CorrelatedAcceptance.model_validate({"states": [
        {"name": "copy", "acceptance": 0.97, "mean_span": 80, "next": {"prose": 3, "novel": 1}},
        {"name": "prose", "scale": 1.0, "mean_span": 25},
        {"name": "novel", "acceptance": 0.05, "mean_span": 8, "next": {"copy": 1}}]})
    model = SpanModel(corr, row_cap=0.98)
    lengths: dict[int, list[int]] = {0: [], 1: [], 2: []}
    moves = np.zeros((3, 3))
    tokens = np.zeros(3)
    for i in range(400):
        path = model.path(np.random.SeedSequence([7, i]))
        path.window(0, 3000)
        spans = path.spans()
        for (start, end, s), nxt in zip(spans, spans[1:] + [None]):
            lengths[s].append(end - start)
            tokens[s] += end - start
            if nxt is not None:
                moves[s, nxt[2]] += 1
    for s, mean in enumerate((80, 25, 8)):
        x = np.array(lengths[s])
        se = math.sqrt((1 - 1 / mean) * mean**2 / len(x))  # geometric: variance (1 - p) / p²
        assert abs(x.mean() - mean) < 4 * se, (s, x.mean(), mean)
        assert x.min() >= 1
    assert moves[0, 1] / moves[0].sum() == pytest.approx(0.75, abs=0.03)
    assert moves[2, 0] == moves[2].sum() and np.all(np.diag(moves) == 0)
    assert moves[1, 0] / moves[1].sum() == pytest.approx(0.5, abs=0.04)
    assert tokens / tokens.sum() == pytest.approx(model.stationary, abs=0.02)


def test_the_state_advances_with_emitted_tokens_and_is_the_same_under_every_policy():
    data = scenario(COPY_NOVEL, users=4, duration_s=8.0)
    paths = {}
    for decision in (Decision.chain(1), Decision.chain(6)):
        worker = SimWorker.fleet(scenario_from_dict(data))[0]
        seen: dict[str, list[tuple[int, list[int]]]] = {}
        owned = {}

        def decide(rid, ctx, b, worker=worker, seen=seen, owned=owned):
            r = next(x for x in worker.running if x.request_id == rid)
            seen.setdefault(rid, []).append((r.generated, worker.span_states([r])[0].tolist()))
            owned[rid] = r.spans
            return decision

        run_simulated(worker, decide, 8.0)
        changed = 0
        for rid, steps in seen.items():
            spans = owned[rid].spans()
            for generated, states in steps:  # draft level k reads token generated + k - 1
                assert states == [next(s for a, e, s in spans if a <= t < e) for t in range(generated, generated + 8)]
            # Between steps the state moves on by the tokens emitted: it changes only across a span's end.
            for (g0, s0), (g1, s1) in zip(steps, steps[1:]):
                assert g1 > g0
                if s1[0] != s0[0]:
                    changed += 1
                    assert any(g0 < e <= g1 for _, e, _ in spans)
        assert changed > 0
        paths[decision] = owned
    common = set(paths[Decision.chain(1)]) & set(paths[Decision.chain(6)])
    assert len(common) >= 4
    for rid in common:
        a, b = paths[Decision.chain(1)][rid], paths[Decision.chain(6)][rid]
        a.grow(3000), b.grow(3000)
        assert a.spans() == b.spans()


def test_only_the_listed_domains_carry_a_state():
    data = scenario({**COPY_NOVEL, "domains": ["code"]})
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    run_simulated(worker, const(Decision.chain(2)), 2.0)
    requests = worker.running + [r for r in worker.waiting[worker._waiting_head:]]
    assert {r.domain for r in requests} == {"chat", "code"}
    for r in requests:
        assert (r.spans is not None) == (r.domain == "code")


# -- the oracle reads the state -------------------------------------------------------------
def test_the_oracle_prices_each_request_in_its_state():
    data = scenario(COPY_NOVEL, users=24, duration_s=6.0)
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    oracle = OracleDecider(worker)
    nodes = {0: [], 1: []}

    def before(i, now):
        oracle.begin_step(now)

    def decide(rid, ctx, b):
        d = oracle(rid, ctx, b)
        r = next(x for x in worker.running if x.request_id == rid)
        states = worker.span_states([r])[0]
        nodes[int(states[0])].append(d.max_nodes if d.depth else 0)
        # What it priced is the truth the step samples from, the state included (options are
        # reused while q stays within half a confidence quantum).
        priced = oracle._memo[(rid, states.tobytes())][0]
        assert np.abs(priced - worker.rank_probs([r], oracle.now)[0]).max() < 0.5 / 256
        return d

    drive([worker], [decide], 6.0, before=before)
    assert len(nodes[0]) > 100 and len(nodes[1]) > 100
    assert np.mean(nodes[0]) > 2 * np.mean(nodes[1]), (np.mean(nodes[0]), np.mean(nodes[1]))


# -- config errors ------------------------------------------------------------------------
def bad(mutate) -> str:
    data = scenario(copy.deepcopy(COPY_NOVEL))
    mutate(data["traffic"]["correlated_acceptance"])
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data)
    return str(info.value)


@pytest.mark.parametrize("mutate, field, value", [
    (lambda c: c["states"][0].update(acceptance=1.5), "traffic.correlated_acceptance.states.0.acceptance", "1.5"),
    (lambda c: c["states"][1].update(mean_span=0.5), "traffic.correlated_acceptance.states.1.mean_span", "0.5"),
    (lambda c: c["states"][1].update(mean_span="long"), "traffic.correlated_acceptance.states.1.mean_span", "'long'"),
    (lambda c: c["states"][0].update(scale=1.2), "traffic.correlated_acceptance.states.0", "scale=1.2"),
    (lambda c: c["states"][1].pop("acceptance"), "traffic.correlated_acceptance.states.1", "scale=None"),
    (lambda c: c["states"][1].update(scale=-1, acceptance=None), "states.1.scale", "-1"),
    (lambda c: c.update(states=c["states"][:1]), "traffic.correlated_acceptance.states", "got 1"),
    (lambda c: c["states"][1].update(name="copy"), "traffic.correlated_acceptance", "['copy']"),
    (lambda c: c["states"][1].update(next={"nope": 1}), "states.1.next", "'nope'"),
    (lambda c: c["states"][1].update(next={"novel": 1}), "states.1.next", "'novel'"),
    (lambda c: c["states"][1].update(next={"copy": -2}), "states.1.next", "-2"),
    (lambda c: c.update(domains=["cod"]), "traffic.correlated_acceptance.domains", "'cod'"),
    (lambda c: c.update(colour="red"), "traffic.correlated_acceptance.colour", "'red'"),
])
def test_config_errors_name_the_field_and_the_value(mutate, field, value):
    message = bad(mutate)
    assert field in message and value in message, message


def test_a_state_never_entered_is_refused():
    def mutate(c):
        c["states"].append({"name": "stuck", "acceptance": 0.5, "mean_span": 4, "next": {"copy": 1}})
        c["states"][0]["next"] = {"novel": 1}
        c["states"][1]["next"] = {"copy": 1}
    message = bad(mutate)
    assert "'stuck'" in message and "never entered" in message, message


def test_a_worker_override_is_validated_too():
    data = scenario()
    data["workers"][0]["traffic"] = {"correlated_acceptance": {**COPY_NOVEL, "domains": ["math"]}}
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data)
    assert "workers.0.traffic.correlated_acceptance.domains" in str(info.value) and "'math'" in str(info.value)
    data["workers"][0]["traffic"]["correlated_acceptance"]["domains"] = ["code"]
    worker = SimWorker.fleet(scenario_from_dict(data))[0]
    assert worker.spans is not None and worker.spans.domains == {"code"}


# -- shipped scenarios ----------------------------------------------------------------------
def mean_rank1(name: str, samples: int = 4000) -> np.ndarray:
    """Per-position rank-1 acceptance averaged over a scenario's requests and output tokens."""
    sc = load_scenario(name)
    spec = sc.workers[0]
    truth = AcceptanceTruth(spec.drafter.acceptance_profile(), spec.drafter.trained_context_len,
                            sc.domain_acceptance, max_depth=spec.drafter.max_depth, max_width=spec.drafter.max_width)
    rng = np.random.default_rng(0)
    gen = TrafficGenerator(sc.traffic, [], 1)
    arrivals = [gen.draw("x", 0.0, rng) for _ in range(samples)]
    ctx = np.array([a.prompt_len + rng.integers(0, a.output_len) for a in arrivals])
    q = truth.rank_probs_batch(ctx, np.array([sc.domain_acceptance.get(a.domain, 1.0) for a in arrivals]),
                               np.array([a.multiplier for a in arrivals]))
    corr = sc.traffic.correlated_acceptance
    if corr is None:
        return q[:, :, 0].mean(axis=0)
    model = SpanModel(corr, spec.drafter.acceptance_profile().row_cap)
    return model.marginal_rank1(q[:, :, 0]).mean(axis=0)


def test_correlated_mixed_has_the_mean_acceptance_of_bursty():
    assert mean_rank1("correlated-mixed") == pytest.approx(mean_rank1("bursty"), abs=0.02)
    base = load_scenario("bursty").model_dump(exclude_none=True)
    mixed = load_scenario("correlated-mixed").model_dump(exclude_none=True)
    mixed["traffic"].pop("correlated_acceptance")
    assert {k: v for k, v in mixed.items() if k not in ("name", "description")} == \
        {k: v for k, v in base.items() if k not in ("name", "description")}


PRESETS = ["goodput", "static", "trtllm-gate"]
NOISE = 0.02  # a policy can draw luckier outcomes; the oracle maximises each step's expectation


def test_quick_policy_bench_runs_both_scenarios_with_the_oracle_the_ceiling(tmp_path):
    # Three presets keep it short (every preset: about 70 s on two cores); the grid and the oracle run in full.
    report = run_policy_bench(["correlated-copy", "correlated-mixed"], tmp_path, quick=True, jobs=2, plots=False,
                              presets=PRESETS, console=Console(file=io.StringIO()))
    assert set(report["scenarios"]) == {"correlated-copy", "correlated-mixed"}
    for name, entry in report["scenarios"].items():
        policies = entry["policies"]
        assert set(policies) == {*PRESETS, "oracle", "best_static"}
        for policy, p in policies.items():
            assert p["vs_oracle"] is not None and p["vs_oracle"] <= 1.0 + NOISE, (name, policy, p["vs_oracle"])
        oracle = policies["oracle"]["goodput_tok_s"]
        for point in entry["grid"]:
            assert point["goodput_tok_s"] <= oracle * (1.0 + NOISE), (name, point)
