"""The control loop over real gRPC: a controller on a free loopback port and
real agents (each on its own thread and event loop, as in an engine)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from controller.config import AcceptanceSettings, PlanSettings, ServerConfig
from controller.server import start_server
from policies.presets import PRESET_DIR
from policies.table import Decision
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2
from tests.support import SyntheticWorker, free_port, make_hello, wait_for
from worker.sdk.agent import AgentOptions, SpeculationAgent

FAST = PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=0.0)


def fast_config(**kw) -> ServerConfig:
    return ServerConfig(listen=f"127.0.0.1:{free_port()}", plan=FAST, policy_poll_interval_s=0.1, **kw)


async def drive(agent: SpeculationAgent, worker: SyntheticWorker, batches, context_lens, steps: int,
                static: Decision | None = None) -> None:
    """Run ``steps`` rounds over every (batch, context) pair, feeding the agent."""
    decide = (lambda rid, ctx, b: static) if static is not None else agent.decide
    for _ in range(steps):
        for batch in batches:
            for ctx in context_lens:
                agent.observe(worker.step(decide, batch, ctx, prefix=f"b{batch}c{ctx}-"))
        await asyncio.sleep(0.01)


@pytest.fixture
async def server():
    # A short evidence half-life so a test sees the model follow a change in seconds.
    running = await start_server(fast_config(acceptance=AcceptanceSettings(half_life_s=2.0)))
    yield running
    await running.stop(0)


async def test_depth_follows_batch_regime_and_context_bucket(server):
    hello = make_hello("w-regime", max_depth=6)
    agent = SpeculationAgent(hello, server.address).start()
    try:
        acceptance = {"short": 0.85, "long": 0.85}
        worker = SyntheticWorker(lambda ctx: acceptance["short" if ctx < 4096 else "long"], seed=1)
        # The worker ran static depth 4 before: the cost model sees both regimes.
        await drive(agent, worker, [1, 8, 64, 256], [500], steps=20, static=Decision.chain(4))
        await drive(agent, worker, [1, 256], [500], steps=30)
        await wait_for(lambda: agent.plan_version >= 1)
        await drive(agent, worker, [1, 256], [500], steps=20)
        # Memory-bound and α = 0.85: deep chains pay; compute-bound: speculation off.
        await wait_for(lambda: agent.decide("fresh-a", 500, 1).depth >= 4 and agent.decide("fresh-b", 500, 256).depth == 0)
        low_batch = agent.decide("fresh-a", 500, 1)

        # Mixed contexts at batch 1; then the long-context bucket's acceptance collapses.
        await drive(agent, worker, [1], [500, 6000], steps=60)
        await wait_for(lambda: agent.decide("fresh-c", 6000, 1).depth >= 4)
        long_before = agent.decide("fresh-c", 6000, 1)
        acceptance["long"] = 0.15
        for _ in range(20):  # old evidence fades as new evidence arrives
            await drive(agent, worker, [1], [500, 6000], steps=20)
            await asyncio.sleep(0.1)
            if agent.decide("fresh-d", 6000, 1).depth < long_before.depth:
                break
        long_after, short_after = agent.decide("fresh-d", 6000, 1), agent.decide("fresh-e", 500, 1)
        assert long_after.depth < long_before.depth, (long_before, long_after)
        assert short_after.depth >= low_batch.depth, (low_batch, short_after)

        await wait_for(lambda: server.controller.workers["w-regime"].plans.acked_version == agent.plan_version)
        status = server.controller.status("w-regime").workers[0]
        cost = status.cost_model
        assert cost.compute_ms_per_token == pytest.approx(0.06, rel=0.15)
        assert cost.mem_ms == pytest.approx(10.0, rel=0.15)
    finally:
        agent.close()


def _report(step_id: int, **request) -> worker_pb2.WorkerMessage:
    fields = dict(request_id="r1", context_len=100, depth=3, width=1, nodes=3, accepted=1)
    fields.update(request)
    return worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[worker_pb2.StepReport(
        step_id=step_id, timestamp=1.0, batch_size=1, draft_ms=1.0, verify_ms=10.0,
        requests=[worker_pb2.RequestStep(**fields)])]))


async def _collect(call, n: int) -> list[plan_pb2.ControllerMessage]:
    out = []
    async for msg in call:
        if msg.WhichOneof("payload") == "rejection":
            out.append(msg.rejection)
            if len(out) == n:
                break
    return out


async def test_malformed_reports_are_rejected_counted_and_others_keep_being_served(server):
    healthy = SpeculationAgent(make_hello("w-healthy"), server.address).start()
    try:
        worker = SyntheticWorker(lambda ctx: 0.8)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)

            # A report before Hello ends the stream with INVALID_ARGUMENT.
            call = stub.Connect(iter([_report(1)]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "hello" in err.value.details()

            # Bad reports after Hello: each rejected with a reason, stream stays.
            outgoing: asyncio.Queue = asyncio.Queue()

            async def messages():
                while True:
                    msg = await outgoing.get()
                    if msg is None:
                        return
                    yield msg

            call = stub.Connect(messages())
            await outgoing.put(worker_pb2.WorkerMessage(hello=make_hello("w-bad")))
            bad = [
                _report(1, accepted=5),  # accepted > depth
                _report(2, context_len=-4),  # negative size
                _report(3, nodes=-1),
                worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(request_id="never-seen")),
                _report(4),  # valid: r1 now known
                _report(4),  # stale step id
            ]
            for msg in bad:
                await outgoing.put(msg)
            rejections = await asyncio.wait_for(_collect(call, 5), timeout=10)
            reasons = [plan_pb2.RejectReason.Name(r.reason) for r in rejections]
            assert reasons == [
                "REJECT_REASON_INVALID_FIELD",
                "REJECT_REASON_INVALID_FIELD",
                "REJECT_REASON_INVALID_FIELD",
                "REJECT_REASON_UNKNOWN_REQUEST",
                "REJECT_REASON_STALE_STEP",
            ]
            assert rejections[0].field == "steps[0].requests[0].accepted" and "5" in rejections[0].detail
            assert rejections[1].field == "steps[0].requests[0].context_len" and "-4" in rejections[1].detail
            # A report about a finished request is refused too.
            await outgoing.put(worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(
                request_id="r1", generated_tokens=4, steps=2, accepted_tokens=2)))
            await outgoing.put(_report(9))
            [late] = await asyncio.wait_for(_collect(call, 1), timeout=10)
            assert late.reason == plan_pb2.REJECT_REASON_UNKNOWN_REQUEST
            await outgoing.put(None)
            call.cancel()

            # Wrong types: bytes that do not parse as a WorkerMessage.
            raw = channel.stream_stream("/speculation.v1.SpeculationController/Connect",
                                        request_serializer=lambda b: b, response_deserializer=lambda b: b)
            hello_bytes = worker_pb2.WorkerMessage(hello=make_hello("w-raw")).SerializeToString()
            # Field 1 (hello) sent as a varint instead of a message: wire-type mismatch.
            call = raw(iter([hello_bytes, b"\x08\x96\x01", b"\xff\xff\xff"]))
            got = []
            async for data in call:
                msg = plan_pb2.ControllerMessage.FromString(data)
                if msg.WhichOneof("payload") == "rejection":
                    got.append(msg.rejection.reason)
                    if len(got) == 2:
                        break
            call.cancel()
            assert got == [plan_pb2.REJECT_REASON_MALFORMED] * 2

        counts = {plan_pb2.RejectReason.Name(c.reason): c.count for c in server.controller.status().rejections}
        assert counts["REJECT_REASON_NO_HELLO"] == 1
        assert counts["REJECT_REASON_INVALID_FIELD"] == 3
        assert counts["REJECT_REASON_UNKNOWN_REQUEST"] == 2
        assert counts["REJECT_REASON_STALE_STEP"] == 1
        assert counts["REJECT_REASON_MALFORMED"] == 2

        # The healthy worker was served throughout and still is.
        await drive(healthy, worker, [1, 4], [300], steps=10)
        await wait_for(lambda: healthy.plan_version >= 1)
        assert healthy.stats.rejections == 0
    finally:
        healthy.close()


async def test_agent_survives_controller_restart():
    config = fast_config()
    running = await start_server(config)
    agent = SpeculationAgent(make_hello("w-restart"), running.address,
                             AgentOptions(backoff_initial_s=0.05, backoff_max_s=0.2)).start()
    try:
        worker = SyntheticWorker(lambda ctx: 0.8, seed=3)
        await drive(agent, worker, [1, 2], [400], steps=10)
        await wait_for(lambda: agent.plan_version >= 1)
        table_before = agent.table
        version_before = agent.plan_version
        await running.stop(0)

        # Cut off: decisions come from the last plan, telemetry queues up.
        await asyncio.sleep(0.3)
        assert agent.table == table_before
        assert agent.decide("any", 400, 1) == table_before.lookup(1, 400)
        await drive(agent, worker, [1], [400], steps=5)

        running = await start_server(config)  # same port, empty state
        await wait_for(lambda: agent.stats.connected and agent.stats.reconnects >= 1)
        await drive(agent, worker, [1, 2], [400], steps=10)
        await wait_for(lambda: agent.plan_version > version_before)
        await wait_for(lambda: running.controller.workers["w-restart"].plans.acked_version == agent.plan_version)
        status = running.controller.status("w-restart").workers[0]
        assert status.steps_ingested > 0
    finally:
        agent.close()
        await running.stop(0)


async def test_bad_policy_file_is_refused_and_old_policy_stays(tmp_path: Path):
    policy_file = tmp_path / "policy.yaml"
    shutil.copy(PRESET_DIR / "goodput.yaml", policy_file)
    running = await start_server(fast_config(policy=str(policy_file)))
    agent = SpeculationAgent(make_hello("w-reload"), running.address).start()
    try:
        worker = SyntheticWorker(lambda ctx: 0.8, seed=4)
        await drive(agent, worker, [1], [300], steps=5)
        await wait_for(lambda: agent.plan_version >= 1)

        policy_file.write_text("policy: goodput\nprobe_fraction: 7\n")  # out of range
        await wait_for(lambda: running.controller.policy_reload_failures == 1)
        assert running.controller.policy.name == "goodput"
        assert "probe_fraction" in running.policy_source.last_error
        policy_file.write_text("policy: goodput\nbogus_key: 1\n")  # unknown key
        await wait_for(lambda: running.controller.policy_reload_failures == 2)
        assert "bogus_key" in running.policy_source.last_error
        assert running.controller.policy.name == "goodput"

        policy_file.write_text("policy: static\ndepth: 2\nwidth: 1\n")
        await wait_for(lambda: running.controller.policy.name == "static")
        await wait_for(lambda: agent.decide("x", 300, 1) == Decision.chain(2))
        assert agent.decide("y", 100_000, 200) == Decision.chain(2)
    finally:
        agent.close()
        await running.stop(0)


async def test_decide_unary_with_piggybacked_telemetry(server):
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Decide(controller_pb2.DecideRequest(worker_id="nobody"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        request = controller_pb2.DecideRequest(
            worker_id="w-unary",
            hello=make_hello("w-unary"),
            reports=_report(1).reports,
            queries=[controller_pb2.DecideQuery(request_id="r1", context_len=100, batch_size=1)],
        )
        response = await stub.Decide(request)
        assert len(response.decisions) == 1
        assert response.plan_version >= 1
        bad = controller_pb2.DecideRequest(worker_id="w-unary", reports=_report(2, accepted=9).reports)
        response = await stub.Decide(bad)
        assert [r.field for r in response.rejections] == ["steps[0].requests[0].accepted"]


async def test_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="speculation.v1.SpeculationController"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for resp in call:
            names = {s.name for s in resp.list_services_response.service}
            break
        assert "speculation.v1.SpeculationController" in names
