"""Request classes through the controller, the Decide RPC and the SDK agent (issue #29).

The server tests drive the real gRPC server on a loopback port with raw
serialized messages (as in ``tests/test_integration_raw.py``); the policy
with a table per class is a tiny test-only one registered here, so the tests
do not depend on how the goodput policy allocates.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict

from controller.alerts.alerting import MonitorFeed
from controller.config import PlanSettings, ServerConfig
from controller.core import Controller
from controller.drift.monitor import AcceptanceDriftMonitor
from controller.protocol import drafter_limits, validate_step
from controller.server import start_server
from policies.base import Observation, PlanDraft, Policy
from policies.presets import PresetError, load_preset_text, register_policy
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2
from specctl.status import status_sections
from tests.support import free_port, make_hello, wait_for
from tests.test_integration_raw import SERVICE, RawStream, decide, get_status, reports, worker
from worker.sdk.agent import STRICT, AcceptanceRule, SpeculationAgent, step_to_proto
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

TYPICAL = plan_pb2.ACCEPTANCE_RULE_TYPICAL
STABLE = PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=1.0)


# ------------------------------------------------------------ test policy

class ClassTablesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = 2  # the plan table (classes without their own)
    depths: dict[str, int] = {}  # class name -> depth of its own table


class ClassTablesPolicy(Policy[ClassTablesConfig]):
    """A chain of ``depth`` everywhere, and of ``depths[name]`` for the classes it names."""

    name = "test-class-tables"
    observed: list[Observation] = []  # every observation decided on (tests read the last)

    def initial_state(self, seed: int = 0) -> None:
        return None

    def decide(self, state: None, obs: Observation) -> tuple[PlanDraft, None]:
        ClassTablesPolicy.observed.append(obs)
        def uniform(d: int) -> DecisionTable:
            return DecisionTable.uniform(Decision.chain(d), obs.batch_edges, obs.context_edges)
        return PlanDraft(uniform(self.config.depth),
                         class_tables={n: uniform(d) for n, d in self.config.depths.items()}), state


register_policy("test-class-tables", ClassTablesConfig, ClassTablesPolicy)

CLASSES_YAML = """
policy: test-class-tables
depth: 2
depths: {interactive: 4, batch: 1}
classes:
  interactive: {weight: 4, tpot_target_ms: 30, tpot_quantile: p99}
  batch: {weight: 1}
  bulk: {weight: 1, acceptance: typical, typical_epsilon: 0.2, typical_delta: 0.5}
default_class: batch
"""


def config(policy: Path | str = "static", **kw) -> ServerConfig:
    return ServerConfig(**{"listen": f"127.0.0.1:{free_port()}", "plan": STABLE, "policy": str(policy),
                           "policy_poll_interval_s": 0.05, **kw})


def rstep(rid: str, cls: str = "", accepted: int = 0, depth: int = 3, rule: int = 0,
          ctx: int = 300) -> worker_pb2.RequestStep:
    return worker_pb2.RequestStep(request_id=rid, context_len=ctx, depth=depth, width=1 if depth else 0, nodes=depth,
                                  accepted=min(accepted, depth), request_class=cls, acceptance_rule=rule)


def report(step_id: int, requests: list[worker_pb2.RequestStep], draft_ms: float = 1.0, verify_ms: float = 10.0,
           catch_up_ms: float = 0.0) -> worker_pb2.StepReport:
    return worker_pb2.StepReport(step_id=step_id, timestamp=time.time(), batch_size=len(requests), draft_ms=draft_ms,
                                 verify_ms=verify_ms, catch_up_ms=catch_up_ms, requests=requests)


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the controller's /metrics: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def classes_file(tmp_path: Path) -> Path:
    path = tmp_path / "classes.yaml"
    path.write_text(CLASSES_YAML)
    return path


# -------------------------------------------- plans and Decide per class

async def test_plans_carry_class_tables_and_decide_answers_per_class(classes_file: Path):
    port = free_port()
    running = await start_server(config(classes_file, metrics_listen=f"127.0.0.1:{port}"))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stream = await RawStream(channel, make_hello("w-cls")).open()
        # Steps naming an unknown class: served as the default class, counted, never refused.
        await stream.send(reports(report(1, [rstep("u1", "mystery", 1), rstep("u2", "interactive", 2)])))
        await wait_for(lambda: stream.of("plan"))
        plan = stream.of("plan")[0]
        await stream.ack(plan)
        assert not stream.of("rejection") and worker(running, "w-cls").steps_ingested == 1
        assert plan.default_class == "batch"
        by_name = {c.name: c for c in plan.classes}
        assert list(by_name) == ["interactive", "batch", "bulk"]  # the policy file's order
        cells = len(plan.batch_size_edges) * len(plan.context_len_edges)
        assert {d.depth for d in plan.table} == {2}
        assert len(by_name["interactive"].table) == cells and {d.depth for d in by_name["interactive"].table} == {4}
        assert {d.depth for d in by_name["batch"].table} == {1}
        assert list(by_name["bulk"].table) == []  # the plan table, sent once
        assert by_name["bulk"].acceptance_rule == TYPICAL
        assert (by_name["bulk"].typical_epsilon, by_name["bulk"].typical_delta) == (0.2, 0.5)
        assert by_name["interactive"].acceptance_rule == plan_pb2.ACCEPTANCE_RULE_STRICT
        assert by_name["interactive"].typical_epsilon == 0.0

        # Decide answers from each class's table; no class and an unknown one get the default's.
        queries = [("interactive", 4), ("batch", 1), ("bulk", 2), ("", 1), ("nope", 1), ("NOPE", 1)]
        response = await decide(channel, controller_pb2.DecideRequest(worker_id="w-cls", queries=[
            controller_pb2.DecideQuery(request_id=f"q{i}", context_len=300, batch_size=2, request_class=name)
            for i, (name, _) in enumerate(queries)]))
        assert [d.depth for d in response.decisions] == [depth for _, depth in queries]
        assert not response.rejections

        await wait_for(lambda: worker(running, "w-cls").plans.acked_version == plan.version)
        [ws] = (await get_status(channel, "w-cls")).workers
        assert ws.unknown_class_queries == 2 and ws.unknown_class_request_steps == 1
        classes = {c.name: c for c in ws.classes}
        assert classes["batch"].is_default and classes["batch"].request_steps == 1  # the unknown name landed here
        assert classes["interactive"].request_steps == 1 and classes["interactive"].tpot_target_ms == 30.0
        assert classes["bulk"].acceptance_rule == TYPICAL
        assert [c.name for c in ws.plan.classes] == ["interactive", "batch", "bulk"]  # the plan in force
        m = await asyncio.to_thread(metrics, port)
        assert m[("specctl_request_class_unknown_total", (("source", "step"), ("worker", "w-cls")))] == 1
        assert m[("specctl_request_class_unknown_total", (("source", "decide"), ("worker", "w-cls")))] == 2
        assert m[("specctl_class_decision_draft_depth", (("class", "interactive"), ("worker", "w-cls")))] == 4
        assert m[("specctl_class_tpot_target_seconds",
                  (("class", "interactive"), ("quantile", "0.99"), ("worker", "w-cls")))] == pytest.approx(0.030)
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)


async def test_a_policy_without_classes_sends_plans_without_them(tmp_path: Path):
    path = tmp_path / "static.yaml"
    path.write_text("policy: static\ndepth: 3\n")
    running = await start_server(config(path))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stream = await RawStream(channel, make_hello("w-one")).open()
        await stream.steps(1)
        await wait_for(lambda: stream.of("plan"))
        plan = stream.of("plan")[0]
        # Byte-identical to a plan made before classes existed: fields 9 and 10 are absent.
        assert [f.name for f, _ in plan.ListFields()] == [
            "version", "nonce", "batch_size_edges", "context_len_edges", "table", "policy", "created_at"]
        legacy = plan_pb2.Plan(version=plan.version, nonce=plan.nonce, batch_size_edges=plan.batch_size_edges,
                               context_len_edges=plan.context_len_edges, table=plan.table, policy=plan.policy,
                               created_at=plan.created_at, expected_goodput_tok_s=plan.expected_goodput_tok_s)
        assert plan.SerializeToString() == legacy.SerializeToString()
        # A name sent anyway is one the policy does not know: the table answers, the name is counted.
        response = await decide(channel, controller_pb2.DecideRequest(worker_id="w-one", queries=[
            controller_pb2.DecideQuery(request_id="q", context_len=10, batch_size=1, request_class="interactive")]))
        assert response.decisions[0].depth == 3
        [ws] = (await get_status(channel, "w-one")).workers
        assert ws.unknown_class_queries == 1
        assert [(c.name, c.is_default) for c in ws.classes] == [("default", True)]
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)


# ------------------------------------------------------ TPOT per class

async def test_per_class_tpot_in_status_and_metrics_matches_a_hand_computation(classes_file: Path):
    port = free_port()
    running = await start_server(config(classes_file, metrics_listen=f"127.0.0.1:{port}"))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stream = await RawStream(channel, make_hello("w-tpot")).open()
        # (draft, verify, catch-up ms) and per request (class, accepted, depth).
        steps = [
            ((1.0, 10.0, 0.0), {"i0": ("interactive", 2, 3), "b0": ("batch", 0, 3), "b1": ("", 1, 3)}),
            ((2.0, 14.0, 1.0), {"i0": ("interactive", 3, 3), "i1": ("interactive", 1, 3), "b0": ("batch", 2, 3),
                                "b2": ("batch", 0, 3)}),
            ((0.5, 8.0, 0.0), {"i1": ("interactive", 0, 0), "b1": ("batch", 3, 3), "b2": ("batch", 1, 3)}),
        ]
        for i, ((draft, verify, catch), rows) in enumerate(steps):
            await stream.send(reports(report(i + 1, [rstep(rid, cls, acc, depth) for rid, (cls, acc, depth)
                                                     in rows.items()], draft, verify, catch)))
        await wait_for(lambda: worker(running, "w-tpot").steps_ingested == 3)
        # By hand: every request waits for its steps' whole time and gets accepted + 1 tokens of each.
        #   i0: (11 + 17) / (3 + 4) = 4.0     i1: (17 + 8.5) / (2 + 1) = 8.5
        #   b0: (11 + 17) / (1 + 3) = 7.0     b1: (11 + 8.5) / (2 + 4) = 3.25    b2: (17 + 8.5) / (1 + 2) = 8.5
        tpot = {"interactive": [4.0, 8.5], "batch": [7.0, 3.25, 8.5]}
        [ws] = (await get_status(channel, "w-tpot")).workers
        classes = {c.name: c for c in ws.classes}
        m = await asyncio.to_thread(metrics, port)
        for name, values in tpot.items():
            p50, p99 = np.percentile(values, [50, 99])
            c = classes[name]
            assert c.tpot_requests == len(values)
            assert (c.tpot_ms_p50, c.tpot_ms_p99) == (pytest.approx(p50), pytest.approx(p99))
            for q, want in (("0.5", p50), ("0.99", p99)):
                key = ("specctl_class_tpot_seconds", (("class", name), ("quantile", q), ("worker", "w-tpot")))
                assert m[key] == pytest.approx(want / 1000.0)
        assert classes["bulk"].tpot_requests == 0 and classes["bulk"].share == 0.0
        # Load and acceptance per class (no time passed: the recent sums are the plain sums).
        assert classes["interactive"].share == pytest.approx(4 / 10) and classes["batch"].share == pytest.approx(6 / 10)
        assert classes["interactive"].tau == pytest.approx((2 + 3 + 1) / 3)  # its drafting request-steps
        assert classes["interactive"].spec_fraction == pytest.approx(3 / 4)
        assert classes["batch"].tokens_per_step == pytest.approx((1 + 2 + 3 + 1 + 4 + 2) / 6)
        assert classes["batch"].step_ms_mean == pytest.approx((11 + 11 + 17 + 17 + 8.5 + 8.5) / 6)
        assert m[("specctl_class_request_steps_total", (("class", "batch"), ("worker", "w-tpot")))] == 6
        assert m[("specctl_class_speculation_fraction", (("class", "interactive"), ("worker", "w-tpot")))] == \
            pytest.approx(0.75)
        assert m[("specctl_class_accepted_tokens_per_draft", (("class", "interactive"), ("worker", "w-tpot")))] == \
            pytest.approx(2.0)
        # `specctl status` has a section of them.
        section = next(s for s in status_sections(await get_status(channel)) if s.title.startswith("request classes"))
        assert [row[1] for row in section.rows] == ["interactive", "batch (default)", "bulk"]
        assert section.rows[0][3] == f"{4.0 + 0.5 * 4.5:.1f} / {4.0 + 0.99 * 4.5:.1f} (2)"
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)


# --------------------------------------------------- acceptance rules

def _classes_controller(clock: list[float]) -> Controller:
    return Controller(ServerConfig(), load_preset_text(CLASSES_YAML), clock=lambda: clock[0])


def _alpha1(view, samples: bool = False) -> float:
    return float(view.effective_samples(0)[0] if samples else view.chain_alpha(0)[0])


def test_typical_steps_feed_their_own_model_and_violations_feed_none() -> None:
    clock = [1000.0]
    ctl = _classes_controller(clock)
    state = ctl.hello(make_hello("w-rule"))
    # Strict: the batch class accepts nothing. Typical: the bulk class accepts everything.
    steps = [report(i + 1, [rstep(f"s{i}", "batch", 0), rstep(f"t{i}", "bulk", 3, rule=TYPICAL)])
             for i in range(40)]
    assert ctl.ingest(state, worker_pb2.StepReports(steps=steps)) == []
    strict = ctl.acceptance.view(state.drafter_key, 6, 1)
    typical = ctl.typical_view(state)
    assert typical is not None
    assert _alpha1(strict, samples=True) == pytest.approx(40) and _alpha1(strict) < 0.1
    assert _alpha1(typical, samples=True) == pytest.approx(40) and _alpha1(typical) > 0.9
    assert sum(state.accept_counts.values()) == 40  # the strict per-position counts: strict steps only
    assert state.counters.typical_request_steps == 40 and state.counters.typical_violations == 0

    # A typical step of a strict class: counted, and no model moves.
    before = (_alpha1(strict, True), _alpha1(typical, True))
    violating = [report(41 + i, [rstep(f"v{i}", "interactive", 3, rule=TYPICAL)]) for i in range(5)]
    assert ctl.ingest(state, worker_pb2.StepReports(steps=violating)) == []
    after = (_alpha1(ctl.acceptance.view(state.drafter_key, 6, 1), True), _alpha1(ctl.typical_view(state), True))
    assert after == before
    assert state.counters.typical_violations == 5
    ws = ctl.worker_status(state)
    assert ws.typical_violations == 5 and len(ws.acceptance_typical) == len(ctl.context_edges)
    assert ws.acceptance_typical[0].alpha[0] > 0.9 > 0.1 > ws.acceptance[0].alpha[0]
    assert {c.name: c.typical_request_steps for c in ws.classes} == {"interactive": 5, "batch": 0, "bulk": 40}

    # The policy sees the typical rule's acceptance apart, and each active request's class.
    obs = ctl.observation(state, clock[0])
    assert obs.acceptance_typical is not None and obs.classes.names == ("interactive", "batch", "bulk")
    assert obs.active_classes["t3"] == "bulk" and obs.active_classes["v0"] == "interactive"
    assert obs.class_load["batch"].share == pytest.approx(40 / 85)


def test_no_typical_acceptance_before_a_typical_step() -> None:
    clock = [0.0]
    ctl = _classes_controller(clock)
    state = ctl.hello(make_hello("w-strict-only"))
    ctl.ingest(state, worker_pb2.StepReports(steps=[report(1, [rstep("a", "bulk", 1)])]))
    assert ctl.observation(state, 0.0).acceptance_typical is None
    assert not ctl.worker_status(state).acceptance_typical


def test_an_unknown_acceptance_rule_is_refused_with_its_field() -> None:
    ctl = _classes_controller([0.0])
    state = ctl.hello(make_hello("w-bad-rule"))
    [rejection] = ctl.ingest(state, worker_pb2.StepReports(steps=[report(1, [rstep("a", "bulk", 1, rule=7)])]))
    assert rejection.field == "steps[0].requests[0].acceptance_rule" and "7" in rejection.detail


def test_drift_detection_never_sees_typical_steps() -> None:
    limits = drafter_limits(make_hello("w-drift"))
    step = report(1, [rstep("a", "batch", 1), rstep("b", "bulk", 3, rule=TYPICAL), rstep("c", "interactive", 2)])
    rows = validate_step(step, limits, "steps[0]", 0)
    assert [r.acceptance_rule for r in rows] == [0, TYPICAL, 0] and rows[1].request_class == "bulk"

    class State:
        worker_id = "w-drift"

    state = State()
    state.limits = limits
    monitor = AcceptanceDriftMonitor()
    monitor.observe_step(state, step)
    assert monitor._steps == 2  # the typical request-step was skipped
    feed = MonitorFeed(AcceptanceDriftMonitor())
    feed.on_rows(state, step, rows)
    assert feed.buffered == 2


# ------------------------------------------------- hysteresis and classes

class _Flip(Policy[ClassTablesConfig]):
    """Model-based: the plan table stays, the class tables follow ``_Flip.depths``."""

    name = "test-flip"
    model_based = True
    depths: dict[str, int] = {}

    def initial_state(self, seed: int = 0) -> None:
        return None

    def decide(self, state: None, obs: Observation) -> tuple[PlanDraft, None]:
        def uniform(d: int) -> DecisionTable:
            return DecisionTable.uniform(Decision.chain(d), obs.batch_edges, obs.context_edges)
        return PlanDraft(uniform(2), class_tables={n: uniform(d) for n, d in _Flip.depths.items()}), state


FLIP_CLASSES = """
policy: static
classes:
  interactive: {weight: %s, tpot_target_ms: %s}
  batch: {weight: %s}
default_class: batch
"""


def _flip_controller(clock: list[float], target_ms: float = 1000.0, weights: tuple[float, float] = (4, 1)
                     ) -> tuple[Controller, _Flip, object]:
    policy = _Flip(ClassTablesConfig())
    policy.classes = load_preset_text(FLIP_CLASSES % (weights[0], target_ms, weights[1])).classes
    ctl = Controller(ServerConfig(plan=PlanSettings(recompute_interval_s=0.0, min_push_interval_s=0.0,
                                                    hysteresis=0.05)), policy, clock=lambda: clock[0])
    return ctl, policy, ctl.hello(make_hello("w-flip"))


def _pushed(ctl: Controller, state, clock: list[float], step_id: int) -> list[plan_pb2.Plan]:
    """Report one step (a request of each class), then what the controller pushes."""
    clock[0] += 1.0
    ctl.ingest(state, worker_pb2.StepReports(steps=[report(step_id, [rstep("i", "interactive", 3),
                                                                     rstep("b", "batch", 3)])]))
    return [u for u in ctl.plan_updates(state) if isinstance(u, plan_pb2.Plan)]


def test_class_tables_are_judged_for_a_new_plan_as_the_policy_solves() -> None:
    clock = [0.0]
    ctl, policy, state = _flip_controller(clock)  # a target every plan meets: weighted goodput decides
    _Flip.depths = {"interactive": 1, "batch": 1}
    [first] = ctl.plan_updates(state, force=True)
    assert _pushed(ctl, state, clock, 1) == []  # the same tables: nothing to send
    _Flip.depths = {"interactive": 1, "batch": 0}  # a class table alone changed, for the worse: held back
    assert _pushed(ctl, state, clock, 2) == []
    _Flip.depths = {"interactive": 4, "batch": 0}  # the weight-4 class drafts deeper: better, a new plan
    [plan] = _pushed(ctl, state, clock, 3)
    assert plan.table == first.table
    assert {c.name: {d.depth for d in c.table} for c in plan.classes} == {"interactive": {4}, "batch": {0}}
    assert ctl.decide(state, "q", 100, 1, "interactive") == Decision.chain(4)
    policy.model_based = False  # a rule-based policy's change goes out as it is
    _Flip.depths = {"interactive": 4, "batch": 1}
    [plan] = _pushed(ctl, state, clock, 4)
    assert {c.name: {d.depth for d in c.table} for c in plan.classes}["batch"] == {1}


def test_a_plan_that_meets_a_missed_target_goes_out_though_it_earns_less() -> None:
    from policies.goodput import class_plan_estimate

    def uniform(d: int) -> DecisionTable:
        return DecisionTable.uniform(Decision.chain(d), ctl.batch_edges, ctl.context_edges)

    def draft(interactive: int, batch: int) -> PlanDraft:
        return PlanDraft(uniform(2), class_tables={"interactive": uniform(interactive), "batch": uniform(batch)})

    # Batch tokens weigh 8 times an interactive one; the interactive class has a TPOT target.
    clock = [0.0]
    ctl, policy, state = _flip_controller(clock, weights=(1, 8))
    _Flip.depths = {"interactive": 0, "batch": 4}
    ctl.plan_updates(state, force=True)
    for step_id in range(1, 4):
        _pushed(ctl, state, clock, step_id)
    obs = ctl.observation(state, clock[0])
    old, new = class_plan_estimate(draft(0, 4), obs), class_plan_estimate(draft(2, 0), obs)
    assert new.weighted_goodput_tok_s < old.weighted_goodput_tok_s and new.tpot_ms[0] < old.tpot_ms[0]
    # A target the plan in force misses and the other meets.
    policy.classes = load_preset_text(FLIP_CLASSES % (1, (old.tpot_ms[0] + new.tpot_ms[0]) / 2, 8)).classes
    ctl.set_policy(policy)
    ctl.plan_updates(state)  # the reload's forced push: the same tables, under the new classes
    assert _pushed(ctl, state, clock, 4) == []
    _Flip.depths = {"interactive": 2, "batch": 0}
    [plan] = _pushed(ctl, state, clock, 5)
    assert {c.name: len(c.table) for c in plan.classes}["interactive"] == 0  # the plan table: depth 2
    assert ctl.decide(state, "q", 100, 1, "interactive") == Decision.chain(2)
    assert ctl.decide(state, "q", 100, 1, "batch") == Decision.off()


# ------------------------------------------------------------- hot reload

async def test_hot_reload_to_classes_and_a_bad_classes_section_keeps_the_old(tmp_path: Path):
    path = tmp_path / "policy.yaml"
    path.write_text("policy: static\ndepth: 3\n")
    running = await start_server(config(path))
    channel = grpc.aio.insecure_channel(running.address)
    reload = channel.unary_unary(SERVICE + "ReloadPolicy", request_serializer=lambda b: b,
                                 response_deserializer=controller_pb2.ReloadPolicyResponse.FromString)
    try:
        stream = await RawStream(channel, make_hello("w-reload")).open()
        await stream.steps(1)
        await wait_for(lambda: stream.of("plan"))
        assert not stream.of("plan")[0].classes

        path.write_text(CLASSES_YAML)
        await wait_for(lambda: running.controller.policy_reloads >= 1)  # the file poller saw it
        await wait_for(lambda: len(stream.of("plan")) >= 2)
        plan = stream.of("plan")[-1]
        assert [c.name for c in plan.classes] == ["interactive", "batch", "bulk"] and plan.default_class == "batch"

        path.write_text(CLASSES_YAML.replace("acceptance: typical", "acceptance: loose"))
        answer = await reload(controller_pb2.ReloadPolicyRequest().SerializeToString())
        assert not answer.loaded
        assert "classes.bulk.acceptance = 'loose': must be 'strict' or 'typical'" in answer.error
        assert running.controller.policy.classes.names == ("interactive", "batch", "bulk")  # the old one in force
        status = await get_status(channel)
        assert status.policy_reload_failures >= 1 and status.policy == "test-class-tables"
        path.write_text(CLASSES_YAML.replace("default_class: batch", "default_class: gold"))
        answer = await reload(controller_pb2.ReloadPolicyRequest().SerializeToString())
        assert not answer.loaded and "default_class = 'gold' is not one of the classes" in answer.error
        response = await decide(channel, controller_pb2.DecideRequest(worker_id="w-reload", queries=[
            controller_pb2.DecideQuery(request_id="q", context_len=10, batch_size=1, request_class="interactive")]))
        assert response.decisions[0].depth == 4
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)


def test_a_reload_keeps_the_history_of_classes_it_keeps() -> None:
    clock = [0.0]
    ctl = _classes_controller(clock)
    state = ctl.hello(make_hello("w-keep"))
    ctl.ingest(state, worker_pb2.StepReports(steps=[report(1, [rstep("a", "interactive", 1), rstep("b", "bulk", 1)])]))
    ctl.set_policy(load_preset_text(CLASSES_YAML.replace("  bulk: {weight: 1, acceptance: typical, "
                                                         "typical_epsilon: 0.2, typical_delta: 0.5}\n", "")))
    ws = ctl.worker_status(state)
    assert [(c.name, c.request_steps) for c in ws.classes] == [("interactive", 1), ("batch", 0)]
    # bulk is gone: its requests are now unknown names, served as the default class.
    ctl.ingest(state, worker_pb2.StepReports(steps=[report(2, [rstep("b", "bulk", 1)])]))
    assert state.counters.unknown_class_request_steps == 1


def test_bad_classes_sections_are_preset_errors() -> None:
    for bad, message in (
        ("classes: {a: {weight: 0}}\n", "classes.a.weight = 0"),
        ("classes: {a: {}, b: {}}\n", "default_class is missing"),
        ("classes: {a: {typical_epsilon: 1.5}}\n", "classes.a.typical_epsilon = 1.5"),
        ("classes: {a: {colour: red}}\n", "unknown key 'colour'"),
        ("default_class: a\n", "needs a 'classes:' section"),
    ):
        with pytest.raises(PresetError, match=message):
            load_preset_text("policy: static\n" + bad)


# ------------------------------------------------------------------ agent

def _hello() -> worker_pb2.Hello:
    return make_hello("w-agent", max_depth=6)


EDGES_B, EDGES_C = (1, 8), (0, 4096)


def _cells(depth: int, n: int = 4) -> list[plan_pb2.Decision]:
    return [plan_pb2.Decision(depth=depth, width=1 if depth else 0, max_nodes=depth)] * n


def class_plan(version: int = 1, **kw) -> plan_pb2.Plan:
    plan = plan_pb2.Plan(version=version, nonce=f"n{version}", batch_size_edges=EDGES_B, context_len_edges=EDGES_C,
                         table=_cells(2), default_class="batch", classes=[
                             plan_pb2.ClassPlan(name="interactive", table=_cells(4)),
                             plan_pb2.ClassPlan(name="batch", table=_cells(1)),
                             plan_pb2.ClassPlan(name="bulk", acceptance_rule=TYPICAL, typical_epsilon=0.09,
                                                typical_delta=0.3)])
    for key, value in kw.items():
        if key == "classes":
            del plan.classes[:]
            plan.classes.extend(value)
        else:
            setattr(plan, key, value)
    return plan


def test_agent_decides_per_class_and_says_which_rule_a_class_may_use() -> None:
    agent = SpeculationAgent(_hello(), "127.0.0.1:1")
    assert agent.acceptance_rule("bulk") == STRICT  # no plan yet: strict for everyone
    assert agent._apply_plan(class_plan()).WhichOneof("payload") == "ack"
    assert agent.classes == ("interactive", "batch", "bulk")
    assert agent.decide("r", 100, 1, "interactive") == Decision.chain(4)
    assert agent.decide("r", 100, 1, "batch") == Decision.chain(1)
    assert agent.decide("r", 100, 1, "bulk") == Decision.chain(2)  # empty table: the plan table
    assert agent.decide("r", 100, 1) == Decision.chain(1)  # no class: the default class
    assert agent.stats.unknown_class == 0
    assert agent.decide("r", 100, 1, "gold") == Decision.chain(1)
    assert agent.stats.unknown_class == 1 and agent.stats.last_unknown_class == "gold"
    assert agent.acceptance_rule("bulk") == AcceptanceRule("typical", 0.09, 0.3)
    rule, epsilon, delta = agent.acceptance_rule("interactive")
    assert (rule, epsilon, delta) == ("strict", 0.0, 0.0)
    assert agent.acceptance_rule("gold") == agent.acceptance_rule("") == STRICT  # the default class: batch
    # Overrides still win over every class table.
    msg = plan_pb2.RequestDecisions(version=2, nonce="o", decisions=[plan_pb2.RequestDecision(
        request_id="r", decision=plan_pb2.Decision(depth=5, width=1, max_nodes=5))])
    assert agent._apply_decisions(msg).WhichOneof("payload") == "ack"
    assert agent.decide("r", 100, 1, "batch") == Decision.chain(5)
    # A plan without classes: every name gets the table, none is counted.
    plain = plan_pb2.Plan(version=3, nonce="p", batch_size_edges=EDGES_B, context_len_edges=EDGES_C, table=_cells(3))
    assert agent._apply_plan(plain).WhichOneof("payload") == "ack"
    assert agent.decide("x", 100, 1, "interactive") == Decision.chain(3) and agent.stats.unknown_class == 1
    assert agent.acceptance_rule("bulk") == STRICT and agent.classes == ()


@pytest.mark.parametrize("change, reason", [
    ({"classes": [plan_pb2.ClassPlan(name="batch", table=_cells(1, 3))]}, "has 3 decisions, expected 0"),
    ({"default_class": "gold"}, "default_class = 'gold' is not one of the plan's classes"),
    ({"classes": []}, "default_class = 'batch' but the plan lists no classes"),
    ({"classes": [plan_pb2.ClassPlan(name="batch", acceptance_rule=TYPICAL, typical_epsilon=0.0,
                                     typical_delta=0.3)]}, "typical_epsilon = 0.0 must be in (0, 1]"),
    ({"classes": [plan_pb2.ClassPlan(name="batch", acceptance_rule=TYPICAL, typical_epsilon=0.1,
                                     typical_delta=1.5)]}, "typical_delta = 1.5 must be in (0, 1]"),
    ({"classes": [plan_pb2.ClassPlan(name="batch", acceptance_rule=TYPICAL, typical_epsilon=math.nan,
                                     typical_delta=0.3)]}, "typical_epsilon = nan"),
    ({"classes": [plan_pb2.ClassPlan(name="batch", acceptance_rule=9)]}, "acceptance_rule = 9"),
    ({"classes": [plan_pb2.ClassPlan(name="batch"), plan_pb2.ClassPlan(name="batch")]}, "appears twice"),
    ({"classes": [plan_pb2.ClassPlan(name="batch", table=_cells(7))]}, "exceeds the drafter's limits"),
    ({"classes": [plan_pb2.ClassPlan(name="batch", table=[plan_pb2.Decision(depth=2, width=0, max_nodes=2)] * 4)]},
     "classes[0].table[0]"),
])
def test_agent_nacks_a_malformed_class_section_and_keeps_its_plan(change, reason) -> None:
    agent = SpeculationAgent(_hello(), "127.0.0.1:1")
    assert agent._apply_plan(class_plan(1)).WhichOneof("payload") == "ack"
    answer = agent._apply_plan(class_plan(2, **change))
    assert answer.WhichOneof("payload") == "nack" and reason in answer.nack.reason, answer.nack.reason
    assert agent.plan_version == 1 and agent.decide("r", 100, 1, "interactive") == Decision.chain(4)


def test_telemetry_names_class_and_rule() -> None:
    step = StepTelemetry(1, 0.0, 2, 1.0, 5.0, [
        RequestTelemetry("a", 10, 2, 1, 2, 1, request_class="bulk", acceptance_rule="typical"),
        RequestTelemetry("b", 10, 2, 1, 2, 1, request_class="interactive", acceptance_rule="strict"),
        RequestTelemetry("c", 10)])
    proto = step_to_proto(step)
    assert [(r.request_class, r.acceptance_rule) for r in proto.requests] == [
        ("bulk", TYPICAL), ("interactive", plan_pb2.ACCEPTANCE_RULE_STRICT), ("", 0)]
    with pytest.raises(ValueError, match="acceptance_rule"):
        RequestTelemetry("d", 10, acceptance_rule="loose")


async def test_agent_gets_class_tables_from_a_real_controller(classes_file: Path):
    running = await start_server(config(classes_file))
    agent = SpeculationAgent(make_hello("w-sdk"), running.address).start()
    try:
        step_id = 0
        deadline = time.monotonic() + 10
        while agent.plan_version == 0:
            assert time.monotonic() < deadline, "no plan"
            step_id += 1
            agent.observe(StepTelemetry(step_id, time.time(), 1, 1.0, 10.0, [
                RequestTelemetry("r", 100, 2, 1, 2, 1, requested_depth=2, request_class="bulk",
                                 acceptance_rule=agent.acceptance_rule("bulk").rule)]))
            await asyncio.sleep(0.05)
        assert agent.decide("q", 100, 1, "interactive") == Decision.chain(4)
        assert agent.decide("q", 100, 1) == Decision.chain(1)
        assert agent.acceptance_rule("bulk") == AcceptanceRule("typical", 0.2, 0.5)
        await wait_for(lambda: worker(running, "w-sdk").plans.acked_version == agent.plan_version)
        assert running.controller.workers["w-sdk"].counters.typical_violations == 0
    finally:
        agent.stop()
        await running.stop(0)


# ------------------------------------------------------------ status page

def test_status_page_shows_classes_and_their_tpot_over_time() -> None:
    from controller.observe.history import StatusHistory
    from controller.observe.web import render_json, render_page

    clock = [1000.0]
    ctl = _classes_controller(clock)
    history = StatusHistory(ctl, capacity=10)
    state = ctl.hello(make_hello("w-page"))
    for i in range(4):
        clock[0] += 5.0
        ctl.ingest(state, worker_pb2.StepReports(steps=[report(i + 1, [
            rstep("i", "interactive", 3), rstep("b", "batch", 0, rule=TYPICAL), rstep("x", "gold", 1)],
            verify_ms=100.0)]))
        history.sample_due(5.0, budget_s=1.0)
    snap = history.snapshot()
    (w,) = snap["workers"]
    classes = {c["name"]: c for c in w["classes"]}
    # interactive: 4 steps of 101 ms over 4 tokens each = 25.25 ms per token; its target is 30.
    assert classes["interactive"]["tpot_ms_p99"] == pytest.approx(101.0 / 4)
    assert classes["batch"]["tpot_requests"] == 2  # b, and x (an unknown name) in the default class
    assert w["typical_violations"] == 4 and w["unknown_class_request_steps"] == 4
    assert w["history"]["class_tpot"][-1]["interactive"] == [pytest.approx(25.25), pytest.approx(25.25)]
    assert w["history"]["class_tpot"][-1]["bulk"] is None
    html = render_page(snap)
    assert "TPOT p99 per request class" in html and 'id="classes-w-page"' in html
    assert "interactive p99 (target 30 p99)" in html and "batch (default)" in html
    assert "4 typical-rule step(s) of a strict class" in html
    assert html.count("<svg") == 7  # the worker's five charts, the class chart, the fleet timeline
    render_json(snap)  # JSON-safe
    # Missed target: the batch class has none, so only a target class can miss.
    clock[0] += 1.0
    ctl.ingest(state, worker_pb2.StepReports(steps=[report(5, [rstep("i2", "interactive", 0)], verify_ms=500.0)]))
    assert "missed" in render_page(history.snapshot())
    # The plan in force, per class, at the worker's load.
    [plan] = ctl.plan_updates(state, force=True)
    assert ctl.ack(state, worker_pb2.Ack(version=plan.version, nonce=plan.nonce)) is None
    cells = {c["name"]: c["decision_now"] for c in history.snapshot()["workers"][0]["classes"]}
    assert cells == {"interactive": [4, 1], "batch": [1, 1], "bulk": [2, 1]}


def test_the_goodput_policys_class_tables_reach_the_agent_intact() -> None:
    clock = [0.0]
    policy = load_preset_text(CLASSES_YAML.replace("policy: test-class-tables\ndepth: 2\ndepths: {interactive: 4, "
                                                   "batch: 1}\n", "policy: goodput\n"))
    ctl = Controller(ServerConfig(), policy, clock=lambda: clock[0])
    hello = make_hello("w-goodput")
    state = ctl.hello(hello)
    for step_id in range(1, 31):
        clock[0] += 0.05
        rows = [rstep(f"{name}{j}", name, 3 if name == "bulk" else j % 4, rule=TYPICAL if name == "bulk" else 0)
                for j in range(8) for name in ("interactive", "batch", "bulk")]
        assert ctl.ingest(state, worker_pb2.StepReports(steps=[report(step_id, rows, verify_ms=25.0)])) == []
    [plan] = [u for u in ctl.plan_updates(state, force=True) if isinstance(u, plan_pb2.Plan)]
    assert [c.name for c in plan.classes] == ["interactive", "batch", "bulk"] and plan.default_class == "batch"
    agent = SpeculationAgent(hello, "127.0.0.1:1")
    assert agent._apply_plan(plan).WhichOneof("payload") == "ack"
    for name in ("interactive", "batch", "bulk", "", "gold"):
        for batch in (1, 8, 24, 64, 256):
            for ctx in (100, 3000, 50_000):
                assert agent.decide("q", ctx, batch, name) == ctl.decide(state, "q", ctx, batch, name)
    assert agent.acceptance_rule("bulk").rule == "typical"


def test_tpot_memory_is_bounded_and_the_window_forgets() -> None:
    from controller.core.classes import TPOT_MAX_REQUESTS, TPOT_WINDOW_S

    clock = [0.0]
    ctl = _classes_controller(clock)
    state = ctl.hello(make_hello("w-bound"))
    n = TPOT_MAX_REQUESTS + 50
    for i in range(n):  # one new request per step, the last five 100 times slower
        ctl.ingest(state, worker_pb2.StepReports(steps=[report(i + 1, [rstep(f"r{i}", "batch", 0)],
                                                               verify_ms=1000.0 if i >= n - 5 else 9.0)]))
    [batch] = [c for c in ctl.worker_status(state).classes if c.name == "batch"]
    assert batch.tpot_requests == TPOT_MAX_REQUESTS and batch.request_steps == n
    assert batch.tpot_ms_p50 == pytest.approx(10.0) and batch.tpot_ms_p99 == pytest.approx(1001.0)
    assert len(state.classes.stats["batch"].requests) == TPOT_MAX_REQUESTS
    clock[0] += TPOT_WINDOW_S + 1.0
    [batch] = [c for c in ctl.worker_status(state).classes if c.name == "batch"]
    assert batch.tpot_requests == 0 and not state.classes.stats["batch"].requests


def test_tail_tokens_per_step_is_read_from_the_slowest_requests():
    """ClassStats.tpot: the tokens per step of the slowest 5 % of requests by TPOT (at least one),
    beside the quantiles, from the per-request sums ingest keeps ([Σ ms, Σ tokens, last seen, steps])."""
    from controller.core.classes import ClassStats
    from policies.classes import RequestClass

    cs = ClassStats(RequestClass("interactive", tpot_target_ms=8.0), buckets=1)
    # 19 requests at 10 ms a step emitting 3 tokens a step (3.3 ms a token), one emitting 1.25 (8 ms).
    for i in range(19):
        cs.requests[f"r{i}"] = [100.0, 30, 5.0, 10]
    cs.requests["slow"] = [100.0, 12.5, 5.0, 10]
    p50, p99, n, tail, window = cs.tpot(now=10.0)
    assert n == 20 and p50 == pytest.approx(100 / 30)
    assert tail == pytest.approx(1.25)  # the slowest one (5 % of 20)
    assert window == pytest.approx((19 * 30 + 12.5) / 200)  # every request of the window, the tail's mean
    for i in range(19, 39):  # 40 requests: the two slowest, (12.5 + 30) tokens over 20 steps
        cs.requests[f"r{i}"] = [100.0, 30, 5.0, 10]
    assert cs.tpot(now=10.0)[3] == pytest.approx(42.5 / 20)
