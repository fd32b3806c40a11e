"""SpeculationAgent without a controller: fallback, plan validation (ACK /
NACK), overrides, and the bounded telemetry queue."""

from policies.table import Decision
from protos.speculation.v1 import plan_pb2
from tests.support import make_hello
from worker.sdk.agent import AgentOptions, SpeculationAgent, compile_plan, step_to_proto
from worker.sdk.telemetry import RequestSummary, RequestTelemetry, StepTelemetry


def plan(version: int, depth: int = 3, width: int = 1, nodes: int = 3) -> plan_pb2.Plan:
    cell = plan_pb2.Decision(depth=depth, width=width, max_nodes=nodes)
    return plan_pb2.Plan(version=version, nonce=f"n{version}", batch_size_edges=[1, 8], context_len_edges=[0, 4096],
                         table=[cell] * 4)


def agent(**options) -> SpeculationAgent:
    return SpeculationAgent(make_hello("w", max_depth=4, max_width=2, max_nodes=8), "127.0.0.1:1",
                            AgentOptions(**options))


def test_fallback_until_a_plan_arrives_then_the_plan():
    a = agent(fallback=Decision.chain(2))
    assert a.decide("r", 100, 1) == Decision.chain(2)
    reply = a._apply_plan(plan(1))
    assert reply.WhichOneof("payload") == "ack" and reply.ack.nonce == "n1"
    assert a.decide("r", 100, 1) == Decision.chain(3)
    assert a.plan_version == 1


def test_stale_or_out_of_limits_plans_are_nacked_and_the_old_one_stays():
    a = agent()
    a._apply_plan(plan(5))
    stale = a._apply_plan(plan(5, depth=1, nodes=1))
    assert stale.WhichOneof("payload") == "nack" and "not newer" in stale.nack.reason
    too_deep = a._apply_plan(plan(6, depth=9, nodes=9))
    assert too_deep.WhichOneof("payload") == "nack" and "exceeds" in too_deep.nack.reason
    broken = plan(7)
    del broken.table[-1]
    reply = a._apply_plan(broken)
    assert reply.WhichOneof("payload") == "nack" and "expected" in reply.nack.reason
    assert a.plan_version == 5 and a.decide("r", 100, 1) == Decision.chain(3)
    assert a.stats.nacks_sent == 3


def test_request_overrides_win_until_cleared_or_finished():
    a = agent()
    a._apply_plan(plan(1))
    msg = plan_pb2.RequestDecisions(version=2, nonce="x", decisions=[
        plan_pb2.RequestDecision(request_id="probe", decision=plan_pb2.Decision(depth=4, width=2, max_nodes=8))])
    assert a._apply_decisions(msg).WhichOneof("payload") == "ack"
    assert a.decide("probe", 100, 1) == Decision(4, 2, 8)
    assert a.decide("other", 100, 1) == Decision.chain(3)
    a.finish(RequestSummary("probe", 10, 3, 7, 0.0))
    assert a.decide("probe", 100, 1) == Decision.chain(3)


def test_override_decisions_are_counted_by_the_controllers_reason():
    a = agent()
    a._apply_plan(plan(1))

    def override(rid, depth, reason):
        return plan_pb2.RequestDecision(request_id=rid, reason=reason,
                                        decision=plan_pb2.Decision(depth=depth, width=min(depth, 1), max_nodes=depth))

    msg = plan_pb2.RequestDecisions(version=2, nonce="x", decisions=[
        override("a", 2, "price-probe"), override("b", 0, "explore"), override("c", 1, "")])
    assert a._apply_decisions(msg).WhichOneof("payload") == "ack"
    for _ in range(3):
        for rid in ("a", "b", "c", "table"):
            a.decide(rid, 100, 1)
    assert a.stats.override_decisions == {"price-probe": 3, "explore": 3, "": 3}
    assert a.stats.override_draft_asks == {"price-probe": 3, "": 3}  # "b" was switched off: decided, no draft asked
    # A refused message changes nothing; a cleared id goes back to the table and its reason with it.
    too_deep = plan_pb2.RequestDecisions(version=3, nonce="y", decisions=[override("a", 9, "explore")])
    assert a._apply_decisions(too_deep).WhichOneof("payload") == "nack"
    assert a._local.reasons["a"] == "price-probe" and a.decide("a", 100, 1) == Decision.chain(2)
    assert a._apply_decisions(plan_pb2.RequestDecisions(version=4, nonce="z", cleared=["a"])).WhichOneof(
        "payload") == "ack"
    assert a.decide("a", 100, 1) == Decision.chain(3) and "a" not in a._local.reasons
    a.finish(RequestSummary("b", 10, 3, 7, 0.0))
    assert "b" not in a._local.reasons and a.stats.override_decisions["price-probe"] == 4


def test_telemetry_queue_is_bounded_drops_oldest_and_counts():
    a = agent(queue_size=3)
    for i in range(1, 6):
        a.observe(StepTelemetry(i, float(i), 1, 0.1, 1.0, [RequestTelemetry("r", 10, 2, 1, 2, 1)]))
    assert a.stats.dropped_steps == 2
    [message] = a._drain()
    assert [s.step_id for s in message.reports.steps] == [3, 4, 5]
    assert message.reports.dropped_steps == 2


def test_chain_telemetry_uses_the_shorthand_and_trees_carry_positions():
    step = StepTelemetry(1, 1.0, 2, 0.5, 9.0, [
        RequestTelemetry("chain", 100, 3, 1, 3, 2),
        RequestTelemetry("tree", 100, 3, 2, 5, 1, accepted_rank=[2, 0], level_candidates=[2, 2]),
    ])
    report = step_to_proto(step)
    assert list(report.requests[0].accepted_rank) == []
    assert list(report.requests[1].accepted_rank) == [2, 0]
    assert list(report.requests[1].level_candidates) == [2, 2]
    assert compile_plan(plan(1), make_hello(), 0).lookup(100, 10_000) == Decision.chain(3)
