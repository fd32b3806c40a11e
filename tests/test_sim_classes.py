"""Request classes in the simulator and the policy benchmark (issue #29): classes flow from the
scenario to decide calls, telemetry and the controller; per-class TPOT is what it says; the
class oracle meets targets where any allocation can and is never below a fixed per-class
allocation on weighted goodput; scenarios without classes are unchanged."""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter

import numpy as np
import pytest

from bench.oracle import ClassOracleDecider
from bench.policies import ControlledFleet, Job, Series, class_metrics, drive, run_job, run_policy_bench
from controller.config import ServerConfig
from policies.classes import parse_classes
from policies.presets import load_preset
from policies.table import Decision
from worker.sdk.agent import step_to_proto
from worker.sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from worker.sim.traffic import interleave_classes
from worker.sim.tree import CONF_SCALE, chain_tree, quantize
from worker.sim.worker import RequestRecord, SimWorker, WorkerStats

CLASSES = {"interactive": {"weight": 4, "tpot_target_ms": 8, "tpot_quantile": "p99"}, "batch": {"weight": 1}}


def classed(duration_s: float = 2.0, users: int = 16, closed: bool = True) -> dict:
    """One H200 with a small EAGLE drafter, a quarter of its users interactive."""
    arrivals = {"kind": "closed", "users": users} if closed else {"kind": "poisson", "rate": 40.0}
    return {
        "name": "classed",
        "duration_s": duration_s,
        "seed": 11,
        "traffic": {
            "arrivals": arrivals,
            "prompt_len": {"kind": "lognormal", "median": 500, "sigma": 0.5, "max": 4000},
            "output_len": {"kind": "lognormal", "median": 48, "sigma": 0.4, "min": 8, "max": 256},
            "domain_mix": {"chat": 0.6, "code": 0.4},
            "class_mix": {"interactive": 1, "batch": 3},
        },
        "workers": [{"id": "h200", "hardware": "H200", "max_batch_size": 128,
                     "drafter": {"kind": "eagle", "version": "t", "max_depth": 4, "max_width": 4, "max_nodes": 16,
                                 "trained_context_len": 8192}}],
        "classes": copy.deepcopy(CLASSES),
        "default_class": "batch",
    }


def without_classes(data: dict) -> dict:
    data = copy.deepcopy(data)
    data.pop("classes"), data.pop("default_class")
    data["traffic"].pop("class_mix")
    return data


# ------------------------------------------------------------------ scenario
@pytest.mark.parametrize("change, expected", [
    ({"traffic": {"class_mix": {"interactive": 1, "bulk": 2}}}, "traffic.class_mix: unknown classes ['bulk']"),
    ({"classes": None, "default_class": None}, "traffic.class_mix: unknown classes ['interactive', 'batch'] "
                                               "(the scenario has no classes: section)"),
    ({"classes": {"interactive": {"acceptance": "loose"}}}, "classes.interactive.acceptance = 'loose'"),
    ({"classes": {"interactive": {"weight": 0}}}, "classes.interactive.weight = 0"),
    ({"default_class": "vip"}, "default_class = 'vip' is not one of the classes"),
    ({"traffic": {"class_mix": {"interactive": -1}}}, "class weights must be finite and >= 0"),
    ({"preset_config": {"goodput": {"classes": {"x": {"tpot_quantile": "p90"}}}}},
     "preset_config.goodput over"),
])
def test_scenario_classes_are_validated_with_the_field_and_value(change, expected):
    data = classed()
    for key, value in change.items():
        if key == "traffic":
            data["traffic"].update(value)
        elif value is None:
            data.pop(key)
        else:
            data[key] = value
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(data, "classes.yaml")
    assert expected in str(err.value)


def test_the_scenarios_classes_go_to_every_preset_unless_it_names_its_own():
    data = classed()
    data["preset_config"] = {"static": {"depth": 2}, "bandit-ucb": {"classes": {"solo": {}}}}
    scenario = scenario_from_dict(data)
    assert scenario.class_set() == parse_classes(CLASSES, "batch", "x")
    assert scenario.preset_fields("goodput") == {"classes": CLASSES, "default_class": "batch"}
    assert scenario.preset_fields("static") == {"classes": CLASSES, "default_class": "batch", "depth": 2}
    assert scenario.preset_fields("bandit-ucb") == {"classes": {"solo": {}}}
    policy = load_preset("goodput", scenario.preset_fields("goodput"))
    assert policy.classes.names == ("interactive", "batch") and policy.classes.default == "batch"
    plain = scenario_from_dict(without_classes(classed()))
    assert plain.preset_fields("goodput") is None and not plain.has_classes


def test_shipped_priority_classes_scenario():
    scenario = load_scenario("priority-classes")
    cs = scenario.class_set()
    assert cs.names == ("interactive", "batch") and cs.get("interactive").tpot_target_ms is not None
    assert not any(c.relaxed for c in cs)  # the simulator verifies strictly: no typical class
    assert scenario.traffic.class_mix and scenario.has_classes


# ------------------------------------------------------------------ the flow
def test_closed_loop_users_keep_their_class_and_split_as_the_mix():
    assert interleave_classes({"a": 1, "b": 1}, 4) == ["a", "b", "a", "b"]
    users = interleave_classes({"interactive": 1, "batch": 3}, 40)
    for n in range(1, 41):  # any prefix of users splits as the mix, within one user
        assert abs(users[:n].count("interactive") - n / 4) <= 1
    w = SimWorker.fleet(scenario_from_dict(classed(duration_s=3.0)))[0]
    seen: dict[str, str] = {}

    def decide(rid, ctx, b, request_class):
        seen[rid] = request_class
        return Decision.chain(2)

    t = 0.0
    while t < 3.0:
        t = w.step(t, decide).end
    by_user: dict[str, set] = {}
    for rid, c in seen.items():
        by_user.setdefault(rid.split("/")[1].split(".")[0], set()).add(c)
    assert all(len(c) == 1 for c in by_user.values())  # a user's requests are all in its class
    assert Counter(c for (c,) in by_user.values()) == Counter(interleave_classes({"interactive": 1, "batch": 3}, 16))


def test_a_class_blind_decide_still_drives_a_classed_scenario():
    """A three-argument decide (no class) is asked as before; the steps still report classes."""
    w = SimWorker.fleet(scenario_from_dict(classed(duration_s=0.5)))[0]
    result = w.step(0.0, lambda rid, ctx, b: Decision.chain(2))
    assert result.telemetry and set(result.request_classes) == {"interactive", "batch"}
    assert [r.request_class for r in result.telemetry.requests] == list(result.request_classes)


def test_open_loop_classes_come_from_their_own_stream_so_nothing_else_changes():
    with_cls = SimWorker.fleet(scenario_from_dict(classed(closed=False)))[0].traffic
    plain = SimWorker.fleet(scenario_from_dict(without_classes(classed(closed=False))))[0].traffic
    a, b = with_cls.pop_until(2.0), plain.pop_until(2.0)
    assert len(a) == len(b) > 40
    for x, y in zip(a, b):
        assert (x.request_id, x.arrival_s, x.prompt_len, x.output_len, x.domain, x.multiplier) == \
               (y.request_id, y.arrival_s, y.prompt_len, y.output_len, y.domain, y.multiplier)
        assert x.request_class in ("interactive", "batch") and y.request_class == ""
    assert 0.1 < sum(x.request_class == "interactive" for x in a) / len(a) < 0.45


def test_classes_flow_from_the_scenario_to_decide_telemetry_and_the_controller():
    scenario = scenario_from_dict(classed(duration_s=1.5))
    workers = SimWorker.fleet(scenario)
    policy = load_preset("goodput", scenario.preset_fields("goodput"))
    fleet = ControlledFleet(workers, policy, ServerConfig(), delay_steps=1)
    reports = []
    ingest = fleet.controller.ingest

    def spy(state, message):
        reports.extend(message.steps)
        return ingest(state, message)

    fleet.controller.ingest = spy
    asked: list[tuple[str, str]] = []
    link = fleet.links[0]

    def decide(rid, ctx, b, request_class):
        asked.append((rid, request_class))
        return link.decide(rid, ctx, b, request_class)

    results = []

    def after(i, result):
        results.append(result)
        fleet.after(i, result)

    drive(workers, [decide], scenario.duration_s, after=after)
    classes = dict(asked)
    assert set(classes.values()) == {"interactive", "batch"}
    for result in results:  # telemetry, the step's class list and the wire message agree
        assert [r.request_class for r in result.telemetry.requests] == list(result.request_classes)
        assert [r.request_class for r in step_to_proto(result.telemetry).requests] == list(result.request_classes)
        assert all(classes[r.request_id] == r.request_class for r in result.telemetry.requests)
        assert sum(result.request_tokens) == result.tokens
    assert reports and all(r.request_class in ("interactive", "batch") for s in reports for r in s.requests)
    assert link.plans_applied >= 1 and link.nacks == 0 and link.unknown_classes == 0
    finished = workers[0].stats.finished
    assert finished and all(rec.request_class == classes[rec.request_id] for rec in finished)


# ------------------------------------------------------------------ TPOT per class
def _record(rid: str, cls: str, tpot_ms: float, tokens: int = 10) -> RequestRecord:
    return RequestRecord(rid, "chat", 0.0, 1.0, 1.0 + tpot_ms * tokens / 1e3, 100, tokens, tokens, 0, cls)


def test_class_metrics_on_a_hand_checkable_case():
    stats = WorkerStats(busy_s=0.5, tokens=100, class_tokens={"interactive": 60, "batch": 30, "": 10})
    stats.finished = [_record("a", "interactive", 10), _record("b", "interactive", 20), _record("c", "interactive", 30),
                      _record("d", "batch", 40), _record("e", "", 50), _record("f", "nope", 60)]

    class Fleet:
        pass

    w = Fleet()
    w.stats = stats
    m = class_metrics([w], parse_classes(CLASSES | {"interactive": {"weight": 4, "tpot_target_ms": 25}}, "batch", "t"))
    inter, batch = m["per_class"]["interactive"], m["per_class"]["batch"]
    assert inter["tpot_ms_p50"] == pytest.approx(20.0) and inter["tpot_ms_p99"] == pytest.approx(29.8)
    assert inter["target_met"] is False and inter["target_met_share"] == pytest.approx(2 / 3, abs=1e-4)
    # A request with no class or an unknown one is in the default class (batch): 40, 50, 60 ms.
    assert batch["finished"] == 3 and batch["tpot_ms_p50"] == pytest.approx(50.0)
    assert batch["target_met"] is None and batch["tpot_target_ms"] is None
    assert inter["goodput_tok_s"] == pytest.approx(120.0) and batch["goodput_tok_s"] == pytest.approx(80.0)
    assert m["weighted_goodput_tok_s"] == pytest.approx((4 * 60 + 40) / 0.5)


def test_a_requests_tpot_is_its_step_time_over_its_tokens():
    """Noise-free steps, no prefill: each request's TPOT is the sum of the durations of
    the steps it was in over the tokens it emitted, checked step by step."""
    data = classed(duration_s=1.0, users=6)
    data["workers"][0]["noise_sigma"] = 0.0
    scenario = scenario_from_dict(data)
    w = SimWorker.fleet(scenario)[0]
    spent: dict[str, float] = {}
    tokens: dict[str, int] = {}
    t = 0.0
    while t < 1.0:
        result = w.step(t, lambda rid, ctx, b, c: Decision.chain(2 if c == "interactive" else 0))
        for r, n in zip(result.telemetry.requests if result.telemetry else (), result.request_tokens):
            spent[r.request_id] = spent.get(r.request_id, 0.0) + 1e3 * result.duration_s
            tokens[r.request_id] = tokens.get(r.request_id, 0) + n
        t = result.end
    assert len(w.stats.finished) > 5
    for rec in w.stats.finished:
        assert rec.generated_tokens == tokens[rec.request_id]
        assert rec.tpot_ms == pytest.approx(spent[rec.request_id] / tokens[rec.request_id], rel=1e-9)
    # Off for batch, one token a step: its TPOT is its mean step time; interactive drafts, so lower.
    m = class_metrics([w], scenario.class_set())["per_class"]
    assert m["interactive"]["tpot_ms_p50"] < m["batch"]["tpot_ms_p50"]


def test_series_per_class_adds_up():
    scenario = scenario_from_dict(classed(duration_s=1.0))
    w = SimWorker.fleet(scenario)
    series = Series(scenario.duration_s, bins=4, classes=scenario.class_set())
    drive(w, [lambda rid, ctx, b, c: Decision.chain(3 if c == "interactive" else 1)], 1.0,
          after=lambda i, r: series.add(r))
    exported = series.export()["classes"]
    tokens = series.class_data[0].sum(axis=1)
    assert tokens.sum() == w[0].stats.tokens
    names = ("interactive", "batch")
    assert dict(zip(names, tokens)) == {k: w[0].stats.class_tokens[k] for k in names}
    assert exported["interactive"]["mean_depth"][1] == pytest.approx(3.0)
    assert exported["batch"]["mean_depth"][1] == pytest.approx(1.0)
    assert sum(sum(v["finished"]) for v in exported.values()) == len(w[0].stats.finished)


# ------------------------------------------------------------------ the class oracle
def _expected(worker: SimWorker, decisions: dict[str, Decision], cs, q: np.ndarray) -> tuple[float, dict, float]:
    """(weighted score, per class TPOT quantile, step ms) of an allocation, priced independently of the
    oracle: the simulator's own trees and cost model, each tree's E[accepted] from the drafter's
    confidences along its paths."""
    running = worker.running
    conf = quantize(q)
    trees = []
    for i, r in enumerate(running):
        d = worker._clamp(decisions.get(r.request_id, Decision.off()))
        trees.append(worker.trees.get(conf[i], d.depth, d.width, d.max_nodes) if d.width > 1 else chain_tree(d.depth))
    tok = []
    for i, t in enumerate(trees):
        c = conf[i] / CONF_SCALE
        value = np.zeros(t.nodes + 1)
        value[0], level = 1.0, np.zeros(t.nodes + 1, np.int64)
        for parent in range(t.nodes + 1):
            for k in range(int(t.child_count[parent])):
                child = int(t.first_child[parent]) + k
                level[child] = level[parent] + 1
                value[child] = value[parent] * c[level[parent], k]
        tok.append(value.sum())  # root (the bonus token) + E[accepted]
    tok = np.array(tok)
    ctx = np.array([r.prompt_len + r.generated for r in running], np.float64)
    nodes = np.array([t.nodes for t in trees])
    b = len(running)
    ms = (worker.cost.verify_ms(float(b + nodes.sum()), float(ctx.sum()), float(((1 + nodes) * ctx).sum()), batch=b)
          + worker.cost.draft_ms([t.depth for t in trees], [t.width for t in trees], ctx))
    cls = np.array([cs.index(r.request_class) for r in running])
    weights = np.array([c.weight for c in cs])[cls]
    tpot = {}
    for k, c in enumerate(cs):
        if c.has_target and (cls == k).any():
            tpot[c.name] = float(np.quantile(ms / tok[cls == k], 0.99 if c.tpot_quantile == "p99" else 0.5))
    return float((weights * tok).sum() / ms), tpot, ms


@pytest.mark.parametrize("users", [24, 96])
def test_class_oracle_meets_targets_where_feasible_and_beats_every_fixed_allocation(users):
    data = classed(duration_s=1.0, users=users)
    scenario = scenario_from_dict(data)
    w = SimWorker.fleet(scenario)[0]
    t = 0.0
    for _ in range(6):  # fill the batch
        t = w.step(t, lambda rid, ctx, b, c: Decision.chain(2)).end
    assert len(w.running) >= min(users, 20)
    q = w.rank_probs(w.running, t)
    grid = [Decision.off()] + [Decision(d, wd, d * wd) for d in range(1, 5) for wd in (1, 2, 4)]
    cs0 = scenario.class_set()
    fixed = []  # every fixed per-class allocation of the grid: (score, tpot, ms)
    for a, b in itertools.product(grid, repeat=2):
        alloc = {r.request_id: (a if r.request_class == "interactive" else b) for r in w.running}
        fixed.append(_expected(w, alloc, cs0, q))
    best_tpot = min(f[1]["interactive"] for f in fixed)

    def oracle(target: float, static_grid=None) -> tuple[ClassOracleDecider, tuple]:
        classes = copy.deepcopy(CLASSES)
        classes["interactive"]["tpot_target_ms"] = target
        cs = parse_classes(classes, "batch", "t")
        o = ClassOracleDecider(w, cs, static_grid)
        o.begin_step(t)
        got = _expected(w, o.allocate(), cs, q)
        # What it chose is what the simulator builds and charges (its prefixes included: no static grid).
        assert o.last_choice.score == pytest.approx(got[0], rel=1e-9)
        assert o.last_choice.step_ms == pytest.approx(got[2], rel=1e-9)
        assert o.last_choice.tpot_ms["interactive"] == pytest.approx(got[1]["interactive"], rel=1e-9)
        return o, got

    # Without a binding target it is the weighted optimum: at least every fixed allocation.
    free = oracle(1e4)[1]
    assert free[0] >= max(f[0] for f in fixed) * (1 - 1e-9)
    targets = [best_tpot * 0.8]  # no allocation meets it
    if free[1]["interactive"] > best_tpot * 1.001:  # one the weighted optimum misses and others meet
        targets.append((best_tpot + free[1]["interactive"]) / 2)
    assert len(targets) == 2 or users > 24  # at 24 requests the target binds
    for target in targets:
        o, (score, tpot, _) = oracle(target)
        oracle(target, static_grid=())
        feasible = [f[0] for f in fixed if f[1]["interactive"] <= target * (1 + 1e-9)]
        if feasible:
            assert o.last_choice.feasible and tpot["interactive"] <= target * (1 + 1e-9)
            assert score >= max(feasible) * (1 - 1e-9)
            assert score < free[0]  # the target cost weighted goodput: it did bind
        else:  # nothing meets it: the oracle comes closest, at least as close as any fixed allocation
            assert not o.last_choice.feasible
            assert tpot["interactive"] <= best_tpot * (1 + 1e-9)


# ------------------------------------------------------------------ no classes: unchanged
def test_a_scenario_without_classes_runs_as_before():
    """No class_mix: decide is asked with three arguments, steps carry no classes, run_job
    reports no per-class fields; declaring classes without a class_mix changes no number."""
    plain = without_classes(classed(duration_s=1.0))
    w = SimWorker.fleet(scenario_from_dict(plain))[0]
    result = w.step(0.0, lambda rid, ctx, b: Decision.chain(2))  # a three-argument decide still works
    assert result.telemetry and result.request_classes == () and result.request_tokens == ()
    assert all(r.request_class == "" for r in result.telemetry.requests)
    base = run_job(Job("classed", "static", (2, 1), plain))
    assert "per_class" not in base and "weighted_goodput_tok_s" not in base
    declared = dict(copy.deepcopy(plain), classes=CLASSES, default_class="batch")
    same = run_job(Job("classed", "static", (2, 1), declared))
    for key in ("goodput_tok_s", "tokens", "busy_s", "tpot_ms_p99", "finished"):
        assert same[key] == base[key], key
    assert same["per_class"]["batch"]["tokens"] == same["tokens"]  # every request in the default class


def test_the_benchmark_on_a_classed_scenario(tmp_path):
    data = classed(duration_s=1.5, users=24)
    report = run_policy_bench(out_dir=tmp_path, jobs=1, presets=["goodput", "static"], grid_depths=(0, 2),
                              grid_widths=(1,), scout=False, plots=True, scenario_data_override={"classed": data})
    entry = report["scenarios"]["classed"]
    policies = entry["policies"]
    assert set(policies) == {"goodput", "goodput-one-class", "static", "best_static", "oracle"}
    for name, p in policies.items():
        assert set(p["per_class"]) == {"interactive", "batch"}, name
        for c in p["per_class"].values():
            assert {"tpot_ms_p99", "tpot_ms_p50", "tpot_target_ms", "target_met_share", "goodput_tok_s"} <= set(c)
        assert sum(c["goodput_tok_s"] for c in p["per_class"].values()) == pytest.approx(p["goodput_tok_s"], rel=1e-3)
        assert p["weighted_vs_oracle"] is not None
    assert policies["oracle"]["weighted_vs_oracle"] == 1.0
    assert policies["goodput-one-class"]["controller"]["class_tables"] is False
    goals = entry["class_goals"]
    assert {"interactive tpot_p99<=target", "weighted_vs_oracle>=0.95", "interactive tpot_p99 one-class/classes>=1.3",
            "goodput_loss_vs_one_class<=0.10"} <= set(goals)
    assert "goodput-one-class" not in entry["goals"].get("vs_best_baseline>=0.98", {}).get("baseline", "")
    assert (tmp_path / "policies-classes-classed.png").stat().st_size > 0
    series = json.loads((tmp_path / "policies-series.json").read_text())["classed"]
    assert set(series["goodput"]["classes"]) == {"interactive", "batch"}
