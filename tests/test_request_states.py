"""Decisions conditioned on each request's last outcome (issue #28): the state
definition, the agent's tracking and lookup, the controller's per-state
evidence, the goodput policy's state tables and the protocol end to end."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict

from controller.config import PlanSettings, ServerConfig
from controller.core import Controller
from controller.server import start_server
from policies.base import Observation, PlanDraft, Policy
from policies.outcome import (AFTER_HIT, AFTER_MISS, DEFAULT, OTHER, REST_STEPS, RESTING, UNTRACKED, RequestState,
                              next_state, pack_state, unpack_state)
from policies.presets import load_preset, register_policy
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2
from tests.support import TRUTH, free_port, make_hello, wait_for
from tests.test_integration_raw import RawStream, decide, get_status, worker
from worker.sdk.agent import OutcomeTracker, SpeculationAgent
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

EDGES_B, EDGES_C = (1, 8), (0, 1000)


def cells(depth: int, n: int = 4) -> list[plan_pb2.Decision]:
    return [plan_pb2.Decision(depth=depth, width=1 if depth else 0, max_nodes=depth)] * n


def state_plan(version: int = 1, miss: int | None = 0, hit: int | None = 5, default: int = 2,
               extra: list[plan_pb2.StatePlan] = (), resting: int | None = None, other: int | None = None,
               later_extra: list[plan_pb2.StatePlan] = ()) -> plan_pb2.Plan:
    states, later = [], []
    if miss is not None:
        states.append(plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_AFTER_MISS, table=cells(miss)))
    if hit is not None:
        states.append(plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_AFTER_HIT, table=cells(hit)))
    if resting is not None:
        later.append(plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_RESTING, table=cells(resting)))
    if other is not None:
        later.append(plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_OTHER, table=cells(other)))
    return plan_pb2.Plan(version=version, nonce=f"n{version}", batch_size_edges=EDGES_B, context_len_edges=EDGES_C,
                         table=cells(default), state_tables=states + list(extra),
                         later_state_tables=later + list(later_extra))


def step(step_id: int, *requests: RequestTelemetry) -> StepTelemetry:
    return StepTelemetry(step_id, time.time(), len(requests), 1.0, 10.0, list(requests))


def req(rid: str, depth: int, accepted: int = 0) -> RequestTelemetry:
    return RequestTelemetry(rid, 100, depth, 1 if depth else 0, depth, accepted, requested_depth=depth,
                            requested_width=1 if depth else 0, requested_nodes=depth)


# ------------------------------------------------------------ the state

def test_next_state_and_the_proto_values_agree() -> None:
    assert (DEFAULT, AFTER_MISS, AFTER_HIT, RESTING, OTHER) == (
        plan_pb2.REQUEST_STATE_UNSPECIFIED, plan_pb2.REQUEST_STATE_AFTER_MISS, plan_pb2.REQUEST_STATE_AFTER_HIT,
        plan_pb2.REQUEST_STATE_RESTING, plan_pb2.REQUEST_STATE_OTHER)
    assert [next_state(d, a).state for d, a in [(0, 0), (3, 0), (3, 3), (3, 1), (3, 2), (1, 1)]] == [
        DEFAULT, AFTER_MISS, AFTER_HIT, DEFAULT, DEFAULT, AFTER_HIT]
    # A miss, then plain steps: it rests REST_STEPS of them, then it is back in the default state.
    s, seen = next_state(2, 0), []
    for _ in range(REST_STEPS + 2):
        s = next_state(0, 0, s)
        seen.append(s)
    assert seen == [RequestState(RESTING, k) for k in range(1, REST_STEPS + 1)] + [UNTRACKED, UNTRACKED]
    # A draft ends a rest whatever it does; a plain step after a hit or a part-way accept is the default.
    assert next_state(1, 1, RequestState(RESTING, 3)) == RequestState(AFTER_HIT)
    assert next_state(0, 0, RequestState(AFTER_HIT)) == next_state(0, 0, UNTRACKED) == UNTRACKED
    assert all(unpack_state(pack_state(*s)) == s for s in seen)
    # The proto comment states the same rule with the same number of rest steps.
    proto = (Path(__file__).resolve().parent.parent / "protos/speculation/v1/plan.proto").read_text()
    assert f"than {REST_STEPS} such steps in a row" in proto and f"1..{REST_STEPS} plain steps" in proto


def _every_previous_state() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, steps that put a request there) for every state a request can be in."""
    out = [("default", []), ("after_miss", [(2, 0)]), ("after_hit", [(2, 2)])]
    return out + [(f"resting{k}", [(2, 0)] + [(0, 0)] * k) for k in range(1, REST_STEPS + 1)]


def test_the_inline_copies_of_the_state_rule_agree_with_next_state() -> None:
    """The agent's tracker and the controller's ingest inline next_state (they
    run per request-step); from every state a request can be in, over every
    (depth, accepted), both must give what it does."""
    pairs = [(d, a) for d in range(0, 9) for a in range(0, d + 1)]
    cases = [(f"{name}/{d}-{a}", history + [(d, a)]) for name, history in _every_previous_state() for d, a in pairs]
    tracker = OutcomeTracker()
    ctl = Controller(ServerConfig(), load_preset("static"), clock=lambda: 0.0)
    state = ctl.hello(make_hello("w-rule", max_depth=8))
    rows = []
    for start in range(0, len(cases), 200):  # engine steps of at most 200 requests (hello.max_batch_size 256)
        chunk = cases[start:start + 200]
        for i in range(max(len(steps) for _, steps in chunk)):  # each request's i-th step, one engine step
            rows.append([(rid, *steps[i]) for rid, steps in chunk if i < len(steps)])
    for i, row in enumerate(rows):
        tracker.observe(step(i + 1, *(req(rid, d, a) for rid, d, a in row)))
    _feed(ctl, state, rows)
    for rid, steps in cases:
        expected = UNTRACKED
        for d, a in steps:
            expected = next_state(d, a, expected)
        assert (tracker.state(rid), tracker.rest(rid)) == expected, rid
        assert unpack_state(state.requests.active[rid].state) == expected, rid


def test_tracker_is_bounded_and_forgets_finished_requests() -> None:
    tracker = OutcomeTracker(max_requests=100)
    tracker.observe(step(1, *[req(f"r{i}", 2, 0) for i in range(150)]))
    assert len(tracker.codes) <= 100
    assert tracker.state("r149") == AFTER_MISS  # the newest are kept
    assert tracker.state("r0") == DEFAULT  # the oldest were forgotten: back to the default state
    tracker.forget("r149")
    assert tracker.state("r149") == DEFAULT
    # Resting requests too: the dict stays bounded, and a trimmed rest just ends.
    for i in range(2, 5):
        tracker.observe(step(i, *[req(f"q{j}", 0 if i > 2 else 2) for j in range(150)]))
        assert len(tracker.codes) <= 100
    assert tracker.state("q149") == RESTING and tracker.rest("q149") == 2


# ------------------------------------------------------------ the agent

def test_agent_picks_the_table_of_each_requests_last_outcome() -> None:
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    assert agent._apply_plan(state_plan(miss=1, hit=5, default=2)).WhichOneof("payload") == "ack"
    assert agent.state_table(AFTER_HIT).lookup(1, 10) == Decision.chain(5)
    assert agent.decide("a", 100, 1) == Decision.chain(2)  # never seen: the default state
    agent.observe(step(1, req("a", 2, 0), req("b", 2, 2), req("c", 2, 1)))
    assert [agent.request_state(r) for r in "abc"] == [AFTER_MISS, AFTER_HIT, DEFAULT]
    assert [agent.decide(r, 100, 1) for r in "abc"] == [Decision.chain(1), Decision.chain(5), Decision.chain(2)]
    agent.observe(step(2, req("b", 5, 3)))  # part-way: back to the default state
    assert agent.decide("b", 100, 1) == Decision.chain(2)
    # An override still wins; a finished request is forgotten with its override.
    msg = plan_pb2.RequestDecisions(version=2, nonce="o", decisions=[plan_pb2.RequestDecision(
        request_id="a", decision=plan_pb2.Decision(depth=4, width=1, max_nodes=4))])
    assert agent._apply_decisions(msg).WhichOneof("payload") == "ack"
    assert agent.decide("a", 100, 1) == Decision.chain(4)
    from worker.sdk.telemetry import RequestSummary
    agent.finish(RequestSummary("a", 10, 3, 2, time.time()))
    assert agent.request_state("a") == DEFAULT and agent.decide("a", 100, 1) == Decision.chain(2)
    # A plan without state tables: one table for all, and the agent stops keeping states.
    plain = plan_pb2.Plan(version=3, nonce="p", batch_size_edges=EDGES_B, context_len_edges=EDGES_C, table=cells(3))
    assert agent._apply_plan(plain).WhichOneof("payload") == "ack"
    agent.observe(step(3, req("c", 2, 0)))
    assert agent.request_state("c") == DEFAULT and agent.decide("c", 100, 1) == Decision.chain(3)


def test_an_off_table_after_a_miss_holds_for_one_step_only() -> None:
    """The trap: a miss table that says off must not keep a request off for good."""
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    assert agent._apply_plan(state_plan(miss=0, hit=4, default=3)).WhichOneof("payload") == "ack"
    seen = []
    for i in range(1, 7):
        d = agent.decide("r", 100, 1)
        seen.append(d.depth)
        agent.observe(step(i, req("r", d.depth, 0)))  # it never accepts anything
    assert seen == [3, 0, 3, 0, 3, 0]  # it drafts every other step, however long it keeps missing


def test_an_off_table_while_resting_holds_for_at_most_the_rest() -> None:
    """With the resting state off too, a request that keeps missing is off for
    1 + REST_STEPS steps after each miss, then drafts by the default state's table."""
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    assert agent._apply_plan(state_plan(miss=0, hit=4, default=3, resting=0)).WhichOneof("payload") == "ack"
    seen = []
    for i in range(1, 2 * (REST_STEPS + 2) + 1):
        d = agent.decide("r", 100, 1)
        seen.append(d.depth)
        agent.observe(step(i, req("r", d.depth, 0)))
    cycle = [3] + [0] * (1 + REST_STEPS)
    assert seen == cycle * 2
    assert agent.request_state("r") == DEFAULT and agent.decide("r", 100, 1) == Decision.chain(3)


def test_a_tracking_agent_decides_its_default_requests_by_the_other_table() -> None:
    """REQUEST_STATE_OTHER is the table of the requests a tracking worker keeps in the
    default state; Plan.table stays the table of everyone else (a unary query that
    names no state, a worker that does not track)."""
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    assert agent._apply_plan(state_plan(miss=0, hit=5, default=2, resting=1, other=4)).WhichOneof("payload") == "ack"
    assert agent.decide("new", 100, 1) == Decision.chain(4)
    agent.observe(step(1, req("m", 2, 0), req("h", 2, 2), req("p", 2, 1)))
    agent.observe(step(2, req("m", 0)))
    assert [agent.decide(r, 100, 1) for r in "mhp"] == [Decision.chain(1), Decision.chain(5), Decision.chain(4)]
    assert agent.state_table(DEFAULT).lookup(1, 100) == Decision.chain(4)


def test_a_tracked_state_without_a_table_is_decided_by_the_plan_table_not_the_other_table() -> None:
    """The policy leaves out a state whose table equals Plan.table; with an OTHER table
    in the plan, such a state's requests must still get Plan.table (as priced), and
    only default-state requests the OTHER table."""
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    assert agent._apply_plan(state_plan(miss=0, hit=None, default=2, other=4)).WhichOneof("payload") == "ack"
    agent.observe(step(1, req("m", 2, 0), req("h", 2, 2), req("p", 2, 1)))
    agent.observe(step(2, req("r", 2, 0)))
    agent.observe(step(3, req("r", 0)))  # r rests; RESTING has no table of its own
    assert [agent.decide(r, 100, 1) for r in "mhpr"] == [
        Decision.off(), Decision.chain(2), Decision.chain(4), Decision.chain(2)]


def test_state_tables_refine_the_default_class_only() -> None:
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    plan = state_plan(miss=1, hit=5, default=2)
    plan.classes.extend([plan_pb2.ClassPlan(name="gold", table=cells(4)), plan_pb2.ClassPlan(name="batch")])
    plan.default_class = "batch"
    assert agent._apply_plan(plan).WhichOneof("payload") == "ack"
    agent.observe(step(1, req("r", 2, 2)))
    assert agent.decide("r", 100, 1, "gold") == Decision.chain(4)  # another class ignores its state
    assert agent.decide("r", 100, 1, "batch") == Decision.chain(5)
    assert agent.decide("r", 100, 1, "unknown") == Decision.chain(5)  # the default class: counted, refined
    assert agent.decide("r", 100, 1) == Decision.chain(5)


@pytest.mark.parametrize("extra, reason", [
    ([plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_UNSPECIFIED, table=cells(1))],
     "state_tables[2].state = 0 is the default state"),
    ([plan_pb2.StatePlan(state=7, table=cells(1))], "state_tables[2].state = 7 is not a RequestState"),
    ([plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_AFTER_HIT, table=cells(1))],
     "state_tables[2].state = REQUEST_STATE_AFTER_HIT appears twice"),
])
def test_agent_nacks_a_malformed_state_table_naming_the_field(extra, reason) -> None:
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    assert agent._apply_plan(state_plan(1)).WhichOneof("payload") == "ack"
    answer = agent._apply_plan(state_plan(2, extra=extra))
    assert answer.WhichOneof("payload") == "nack" and reason in answer.nack.reason, answer.nack.reason
    assert agent.plan_version == 1


@pytest.mark.parametrize("later, reason", [
    ([plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_UNSPECIFIED, table=cells(1))],
     "later_state_tables[0].state = 0 is the default state"),
    ([plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_AFTER_MISS, table=cells(1))],
     "later_state_tables[0].state = REQUEST_STATE_AFTER_MISS appears twice"),
    ([plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_RESTING, table=cells(7))],
     "later_state_tables[0].table[0] = (depth 7"),
])
def test_agent_nacks_a_malformed_later_state_table_naming_the_field(later, reason) -> None:
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    answer = agent._apply_plan(state_plan(1, later_extra=later))
    assert answer.WhichOneof("payload") == "nack" and reason in answer.nack.reason, answer.nack.reason


def test_agent_skips_a_later_state_it_does_not_know() -> None:
    """A state added after this worker, in later_state_tables, is skipped (its requests
    stay on Plan.table, as on a worker that predates it); the same in state_tables is refused."""
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    future = [plan_pb2.StatePlan(state=9, table=cells(5))]
    assert agent._apply_plan(state_plan(1, miss=1, resting=0, later_extra=future)).WhichOneof("payload") == "ack"
    assert set(agent._local.plan.state_tables) == {AFTER_MISS, AFTER_HIT, RESTING}
    assert agent.decide("r", 100, 1) == Decision.chain(2)
    answer = agent._apply_plan(state_plan(2, extra=future))
    assert answer.WhichOneof("payload") == "nack" and "state_tables[2].state = 9 is not a RequestState" in \
        answer.nack.reason


@pytest.mark.parametrize("miss, reason", [
    (cells(1, 3), "state_tables[0] (REQUEST_STATE_AFTER_MISS).table has 3 decisions, expected"),
    (cells(7), "state_tables[0].table[0] = (depth 7"),
    ([plan_pb2.Decision(depth=2, width=0, max_nodes=2)] * 4, "state_tables[0].table[0]"),
])
def test_agent_nacks_a_state_table_of_the_wrong_size_or_beyond_its_limits(miss, reason) -> None:
    agent = SpeculationAgent(make_hello(max_depth=6), "127.0.0.1:1")
    plan = state_plan(1, miss=None)
    plan.state_tables.insert(0, plan_pb2.StatePlan(state=plan_pb2.REQUEST_STATE_AFTER_MISS, table=miss))
    answer = agent._apply_plan(plan)
    assert answer.WhichOneof("payload") == "nack" and reason in answer.nack.reason, answer.nack.reason
    assert agent.plan_version == 0


# ------------------------------------------------- the controller's evidence

def _feed(ctl: Controller, state, rows: list[list[tuple[str, int, int]]]) -> None:
    for i, row in enumerate(rows):
        ctl.ingest(state, worker_pb2.StepReports(steps=[worker_pb2.StepReport(
            step_id=i + 1, timestamp=0.0, batch_size=len(row), draft_ms=1.0, verify_ms=10.0,
            requests=[worker_pb2.RequestStep(request_id=rid, context_len=100, depth=d, width=1 if d else 0, nodes=d,
                                             accepted=a, requested_depth=d, requested_width=1 if d else 0,
                                             requested_nodes=d) for rid, d, a in row])]))


def test_ingest_routes_evidence_by_state_and_leaves_the_pooled_model_as_it_was() -> None:
    # One request: a miss, a full accept, part-way, a plain step, a miss, two plain steps, part-way.
    rows = [[("r", 4, 0)], [("r", 4, 4)], [("r", 4, 2)], [("r", 0, 0)], [("r", 4, 0)], [("r", 0, 0)], [("r", 0, 0)],
            [("r", 4, 1)]]
    clock = [0.0]
    ctl = Controller(ServerConfig(), load_preset("static"), clock=lambda: clock[0])
    state = ctl.hello(make_hello("w", max_depth=4))
    _feed(ctl, state, rows)
    # The states the steps were in: default, after_miss, after_hit, default, default (after a plain step),
    # after_miss, resting (1 plain step), resting (2).
    prior = ctl.acceptance.prior
    prior_a, prior_b = prior.rank1_mean * prior.strength, (1 - prior.rank1_mean) * prior.strength

    def params(s: int):
        a, b = ctl.acceptance_by_state.models[s].view(state.drafter_key, 4, 1)._params[0]
        return (a[:, 0] - prior_a).tolist(), (b[:, 0] - prior_b).tolist()

    assert params(DEFAULT) == (pytest.approx([0, 0, 0, 0]), pytest.approx([2, 0, 0, 0]))  # (4, 0) twice
    assert params(AFTER_MISS) == (pytest.approx([1, 1, 1, 1]), pytest.approx([0, 0, 0, 0]))  # (4, 4)
    assert params(AFTER_HIT) == (pytest.approx([1, 1, 0, 0]), pytest.approx([0, 0, 1, 0]))  # (4, 2)
    assert params(RESTING) == (pytest.approx([1, 0, 0, 0]), pytest.approx([0, 1, 0, 0]))  # (4, 1)
    # Its last step accepted part-way.
    assert {rid: r.state for rid, r in state.requests.active.items()} == {"r": DEFAULT}
    assert state.load.state_counts == [3.0, 2.0, 1.0, 2.0]
    # The pooled model and accept_counts are what a controller without state models makes of the same steps.
    bare = Controller(ServerConfig(), load_preset("static"), clock=lambda: clock[0])
    bare.acceptance_by_state.models = {}  # no routing at all
    bare_state = bare.hello(make_hello("w", max_depth=4))
    _feed(bare, bare_state, rows)
    pooled = ctl.acceptance.view(state.drafter_key, 4, 1)._params[0]
    assert all(np.array_equal(x, y) for x, y in zip(pooled, bare.acceptance.view(state.drafter_key, 4, 1)._params[0]))
    assert state.accept_counts == bare_state.accept_counts and sum(state.accept_counts.values()) == 5
    # A finished request is forgotten.
    assert ctl.finished(state, worker_pb2.RequestFinished(request_id="r", generated_tokens=10, steps=6)) is None
    assert "r" not in state.requests.active


# ------------------------------------------------------------ the policy

def _spans_controller(correlated: bool, seed: int = 0, steps: int = 400, batch: int = 48,
                      policy: str | None = None) -> tuple[Controller, object]:
    """A controller fed depth-4 chains of ``batch`` requests whose acceptance moves
    through hidden spans (copy 0.95, novel 0.05, ~30 tokens each) or, with
    ``correlated`` false, is 0.5 at every position of every request (the same mean)."""
    clock = [0.0]
    ctl = Controller(ServerConfig(), load_preset(policy or "goodput"), clock=lambda: clock[0])
    state = ctl.hello(make_hello("w", max_depth=6))
    rng = np.random.default_rng(seed)
    copy = {f"r{i}": bool(rng.random() < 0.5) for i in range(batch)}
    for i in range(steps):
        clock[0] += 0.01
        requests = []
        for rid in copy:
            accepted = 0
            alpha = (0.95 if copy[rid] else 0.05) if correlated else 0.5
            while accepted < 4 and rng.random() < alpha:
                accepted += 1
            if rng.random() < (1 + accepted) / 30:  # the span ends
                copy[rid] = not copy[rid]
            requests.append(worker_pb2.RequestStep(request_id=rid, context_len=500, depth=4, width=1, nodes=4,
                                                   accepted=accepted))
        tokens = batch * 5
        ctl.ingest(state, worker_pb2.StepReports(steps=[worker_pb2.StepReport(
            step_id=i + 1, timestamp=clock[0], batch_size=batch, draft_ms=TRUTH.draft_ms(4, batch * 4),
            verify_ms=TRUTH.verify_ms(tokens, batch * 500), requests=requests)]))
    return ctl, state


def test_policy_plans_state_tables_on_correlated_evidence_and_none_on_independent() -> None:
    ctl, state = _spans_controller(correlated=True)
    draft, obs = ctl.plans.run_policy(state, ctl.clock())
    assert set(obs.acceptance_by_state) == {DEFAULT, AFTER_MISS, AFTER_HIT}  # nothing rested: every step drafted
    assert obs.acceptance_by_state[AFTER_MISS].rank_probs(0)[0, 0] < 0.2 < 0.8 < \
        obs.acceptance_by_state[AFTER_HIT].rank_probs(0)[0, 0]
    assert draft.state_tables, "correlated evidence: state tables expected"
    assert set(draft.state_tables) <= {AFTER_MISS, AFTER_HIT, OTHER}
    cells_ = [(b, c) for b in range(len(obs.batch_edges)) for c in range(len(obs.context_edges))]
    miss, hit = draft.state_tables.get(AFTER_MISS, draft.table), draft.state_tables.get(AFTER_HIT, draft.table)
    other = draft.state_tables.get(OTHER, draft.table)
    # Less after a miss, more after a hit, never the other way round.
    assert all(miss.cell(b, c).max_nodes <= table.cell(b, c).max_nodes <= hit.cell(b, c).max_nodes
               for b, c in cells_ for table in (draft.table, other))
    assert any(miss.cell(b, c) != draft.table.cell(b, c) or hit.cell(b, c) != draft.table.cell(b, c)
               for b, c in cells_)
    # The default table is the single-class plan: the same policy without states gives it.
    no_states = load_preset("goodput", {"request_states": False})
    plain, _ = no_states.decide(no_states.initial_state(), obs)
    assert plain.table == draft.table and not plain.state_tables

    ind, ind_state = _spans_controller(correlated=False)
    ind_draft, ind_obs = ind.plans.run_policy(ind_state, ind.clock())
    assert set(ind_obs.acceptance_by_state) == {DEFAULT, AFTER_MISS, AFTER_HIT}  # kept, but they say nothing new
    assert not ind_draft.state_tables
    plain, _ = no_states.decide(no_states.initial_state(), ind_obs)
    assert plain == ind_draft  # the plan is exactly the plan without states


def test_a_draft_is_valued_with_the_state_it_leads_to() -> None:
    """At a compute-bound batch a request in the default state whose first draft token
    is accepted about as often as it costs stays off by its tokens alone, and so never
    reaches after-hit, whose table drafts: counted with the value of that move
    (policies.state_tables.chain_values) it drafts one node. After a miss (0.2) it
    does not pay even so, and at 256 requests nothing does."""
    from dataclasses import replace

    import policies.state_tables as state_tables
    from policies.goodput import GoodputConfig, GoodputPolicy
    from tests.test_goodput_policy import acceptance_with, observation

    obs = observation(acceptance_with({0: 0.7}), {0: 1.0}, mean_batch=128.0)
    by_state = {s: acceptance_with({0: a}) for s, a in
                [(DEFAULT, 0.6), (AFTER_MISS, 0.2), (AFTER_HIT, 0.92), (RESTING, 0.4)]}
    obs = replace(obs, acceptance_by_state=by_state, load=replace(obs.load, state_share=(0.3, 0.15, 0.35, 0.2)))
    policy = GoodputPolicy(GoodputConfig(probe_fraction=0.0))

    def nodes(plan, state: int, batch: int) -> int:
        return plan.table_for_state(state).lookup(batch, 500).max_nodes

    plan, _ = policy.decide(policy.initial_state(), obs)
    assert (nodes(plan, OTHER, 128), nodes(plan, AFTER_HIT, 128), nodes(plan, AFTER_MISS, 128)) == (1, 1, 0)
    assert all(nodes(plan, s, 256) == 0 for s in (OTHER, AFTER_MISS, AFTER_HIT, RESTING))
    myopic = state_tables._probe_pass
    try:  # the same solve valuing each draft by its tokens only
        state_tables._probe_pass = lambda policy, obs, tr, batch, row, decisions, default_row: decisions
        tokens_only, _ = policy.decide(policy.initial_state(), obs)
    finally:
        state_tables._probe_pass = myopic
    assert nodes(tokens_only, OTHER, 128) == 0 and nodes(tokens_only, AFTER_HIT, 128) == 1


def test_state_tables_reach_the_wire_only_when_there_are_some() -> None:
    from controller.protocol import plan_to_proto, state_plans

    ctl, state = _spans_controller(correlated=True)
    draft, _ = ctl.plans.run_policy(state, ctl.clock())
    plan = plan_to_proto(draft.table, 1, "n", "goodput", 0.0, 1.0, state_tables=state_plans(draft))
    # The first two states where every tracking worker reads them; those added since where a worker
    # that does not know them skips them (and one that predates them ignores the field).
    assert [s.state for s in plan.state_tables] == sorted(set(draft.state_tables) & {AFTER_MISS, AFTER_HIT})
    assert [s.state for s in plan.later_state_tables] == sorted(set(draft.state_tables) - {AFTER_MISS, AFTER_HIT})
    assert OTHER in draft.state_tables  # here the default state's requests get a table of their own
    without = PlanDraft(draft.table)
    legacy = plan_pb2.Plan(version=1, nonce="n", batch_size_edges=draft.table.batch_edges,
                           context_len_edges=draft.table.context_edges,
                           table=plan.table, policy="goodput", created_at=0.0, expected_goodput_tok_s=1.0)
    assert plan_to_proto(without.table, 1, "n", "goodput", 0.0, 1.0,
                         state_tables=state_plans(without)).SerializeToString() == legacy.SerializeToString()


# --------------------------------------------- end to end over gRPC

class StateTablesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = 2
    miss: int = 0
    hit: int = 5


class StateTablesPolicy(Policy[StateTablesConfig]):
    """A chain of ``depth`` everywhere, ``miss`` after a miss and ``hit`` after a full accept."""

    name = "test-state-tables"

    def initial_state(self, seed: int = 0) -> None:
        return None

    def decide(self, state: None, obs: Observation) -> tuple[PlanDraft, None]:
        def uniform(d: int) -> DecisionTable:
            return DecisionTable.uniform(Decision.chain(d), obs.batch_edges, obs.context_edges)
        cfg = self.config
        return PlanDraft(uniform(cfg.depth), state_tables={AFTER_MISS: uniform(cfg.miss),
                                                           AFTER_HIT: uniform(cfg.hit)}), state


register_policy("test-state-tables", StateTablesConfig, StateTablesPolicy)


def _config(tmp_path: Path) -> ServerConfig:
    path = tmp_path / "states.yaml"
    path.write_text("policy: test-state-tables\ndepth: 2\nmiss: 0\nhit: 5\n")
    return ServerConfig(listen=f"127.0.0.1:{free_port()}", policy=str(path),
                        plan=PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=1.0))


async def test_agent_gets_state_tables_from_a_real_controller_and_decide_reads_them(tmp_path: Path):
    running = await start_server(_config(tmp_path))
    agent = SpeculationAgent(make_hello("w-st", max_depth=6), running.address).start()
    channel = grpc.aio.insecure_channel(running.address)
    try:
        step_id, deadline = 0, time.monotonic() + 10
        while agent.plan_version == 0:
            assert time.monotonic() < deadline, "no plan"
            step_id += 1
            agent.observe(step(step_id, req("x", 2, 1)))
            await asyncio.sleep(0.05)
        assert agent.state_table(AFTER_MISS).lookup(4, 100) == Decision.off()
        step_id += 1
        agent.observe(step(step_id, req("m", 2, 0), req("h", 2, 2), req("p", 2, 1)))
        assert [agent.decide(r, 100, 3) for r in "mhp"] == [Decision.off(), Decision.chain(5), Decision.chain(2)]
        await wait_for(lambda: worker(running, "w-st").plans.acked_version == agent.plan_version)
        # GetStatus shows the plan in force with its state tables.
        [ws] = (await get_status(channel, "w-st")).workers
        assert [s.state for s in ws.plan.state_tables] == [plan_pb2.REQUEST_STATE_AFTER_MISS,
                                                             plan_pb2.REQUEST_STATE_AFTER_HIT]
        # The controller tracked the same states from the steps it received.
        await wait_for(lambda: getattr(running.controller.workers["w-st"].requests.active.get("h"), "state", None)
                       == AFTER_HIT)
        # Unary Decide: the query's state picks the table; a state it does not know is refused, naming the field.
        response = await decide(channel, controller_pb2.DecideRequest(worker_id="w-st", queries=[
            controller_pb2.DecideQuery(request_id="q1", context_len=100, batch_size=2,
                                       request_state=plan_pb2.REQUEST_STATE_AFTER_HIT),
            controller_pb2.DecideQuery(request_id="q2", context_len=100, batch_size=2,
                                       request_state=plan_pb2.REQUEST_STATE_AFTER_MISS),
            controller_pb2.DecideQuery(request_id="q3", context_len=100, batch_size=2)]))
        assert [d.depth for d in response.decisions] == [5, 0, 2]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decide(channel, controller_pb2.DecideRequest(worker_id="w-st", queries=[
                controller_pb2.DecideQuery(request_id="q", context_len=1, batch_size=1, request_state=9)]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "queries[0].request_state: 9" in err.value.details()
    finally:
        agent.stop()
        await channel.close()
        await running.stop(0)


async def test_a_raw_stream_nacks_a_malformed_state_table_and_the_controller_keeps_its_view(tmp_path: Path):
    """The controller never sends a malformed table; a worker that refuses one
    (here: a raw client NACKing, naming the field) leaves the plan in force."""
    running = await start_server(_config(tmp_path))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stream = await RawStream(channel, make_hello("w-raw", max_depth=6)).open()
        await stream.steps(1)
        await wait_for(lambda: stream.of("plan"))
        plan = stream.of("plan")[0]
        assert [s.state for s in plan.state_tables] == [plan_pb2.REQUEST_STATE_AFTER_MISS,
                                                          plan_pb2.REQUEST_STATE_AFTER_HIT]
        assert all(len(s.table) == len(plan.table) for s in plan.state_tables)
        await stream.send(worker_pb2.WorkerMessage(nack=worker_pb2.Nack(
            version=plan.version, nonce=plan.nonce,
            reason="state_tables[1].table[0] = (depth 5, ...) exceeds the drafter's limits")))
        await wait_for(lambda: worker(running, "w-raw").counters.nacks == 1)
        assert "state_tables[1]" in worker(running, "w-raw").plans.last_nack_reason
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)
