"""Integration rules of speculation.v1, driven through a raw gRPC client.

Nothing here uses the SDK agent: each test writes serialized messages on a
plain channel as an engine team's own client would (issue #25: a client
written from the protos alone found each of these). The controller is the
real server on a loopback port.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from controller.config import PlanSettings, ServerConfig
from controller.server import start_server
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2
from tests.support import free_port, make_hello, wait_for

SERVICE = "/speculation.v1.SpeculationController/"
STABLE = PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=1.0)


def config(**kw) -> ServerConfig:
    settings = {"listen": f"127.0.0.1:{free_port()}", "plan": STABLE, "policy_poll_interval_s": 0.05, **kw}
    return ServerConfig(**settings)


def step(step_id: int, batch: int = 1, ctx: int = 300, depth: int = 3, accepted: int = 2, verify_ms: float = 12.0,
         prefix: str = "r", reported: int | None = None) -> worker_pb2.StepReport:
    n = batch if reported is None else reported
    return worker_pb2.StepReport(
        step_id=step_id, timestamp=time.time(), batch_size=batch, draft_ms=1.0, verify_ms=verify_ms,
        requests=[worker_pb2.RequestStep(request_id=f"{prefix}{i}", context_len=ctx, depth=depth,
                                         width=1 if depth else 0, nodes=depth, accepted=min(accepted, depth))
                  for i in range(n)])


def worker(running, worker_id: str):
    """The controller's state of ``worker_id``, or a stand-in with nothing yet
    (a raw client's Hello may still be on its way when a test first looks)."""
    from types import SimpleNamespace

    return running.controller.workers.get(worker_id) or SimpleNamespace(
        steps_ingested=-1, plans=SimpleNamespace(acked_version=-1), counters=SimpleNamespace(nacks=0))


def reports(*steps: worker_pb2.StepReport) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=list(steps)))


class RawStream:
    """One Connect call: writes WorkerMessages, collects ControllerMessages."""

    def __init__(self, channel: grpc.aio.Channel, hello: worker_pb2.Hello) -> None:
        self.call = channel.stream_stream(SERVICE + "Connect", request_serializer=lambda b: b,
                                          response_deserializer=plan_pb2.ControllerMessage.FromString)()
        self.hello = hello
        self.received: list[plan_pb2.ControllerMessage] = []
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self._reader: asyncio.Task | None = None
        self.next_step = 1

    async def open(self) -> "RawStream":
        await self.send(worker_pb2.WorkerMessage(hello=self.hello))
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                self.received.append(msg)
        except grpc.aio.AioRpcError:
            pass
        self.ended = (await self.call.code(), await self.call.details())

    async def send(self, msg: worker_pb2.WorkerMessage) -> None:
        await self.call.write(msg.SerializeToString())

    async def steps(self, count: int, **kw) -> None:
        for _ in range(count):
            await self.send(reports(step(self.next_step, **kw)))
            self.next_step += 1

    def of(self, kind: str) -> list:
        return [getattr(m, kind) for m in self.received if m.WhichOneof("payload") == kind]

    async def ack(self, plan: plan_pb2.Plan) -> None:
        await self.send(worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=plan.version, nonce=plan.nonce)))

    async def close(self) -> None:
        self.call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


async def get_status(channel: grpc.aio.Channel, worker_id: str = "") -> controller_pb2.GetStatusResponse:
    call = channel.unary_unary(SERVICE + "GetStatus", request_serializer=lambda b: b,
                               response_deserializer=controller_pb2.GetStatusResponse.FromString)
    return await call(controller_pb2.GetStatusRequest(worker_id=worker_id).SerializeToString())


async def decide(channel: grpc.aio.Channel, request: controller_pb2.DecideRequest) -> controller_pb2.DecideResponse:
    call = channel.unary_unary(SERVICE + "Decide", request_serializer=lambda b: b,
                               response_deserializer=controller_pb2.DecideResponse.FromString)
    return await call(request.SerializeToString())


async def first_plan(stream: RawStream, timeout: float = 10.0) -> plan_pb2.Plan:
    """Report steps until a Plan arrives; ACK it."""
    deadline = time.monotonic() + timeout
    while not stream.of("plan"):
        assert time.monotonic() < deadline, "no plan arrived"
        await stream.steps(5)
        await asyncio.sleep(0.05)
    plan = stream.of("plan")[-1]
    await stream.ack(plan)
    return plan


@pytest.fixture
async def served():
    running = await start_server(config())
    channel = grpc.aio.insecure_channel(running.address)
    yield running, channel
    await channel.close()
    await running.stop(0)


# ------------------------------------------------------ 1. restarted worker

async def test_restarted_worker_gets_its_plan_back_at_once(served):
    running, channel = served
    hello = make_hello("w-restart")
    first = await RawStream(channel, hello).open()
    plan = await first_plan(first)
    await wait_for(lambda: worker(running, "w-restart").plans.acked_version == plan.version)
    await first.close()

    # The worker restarts: version 0, and nothing more is reported. The plan comes back unasked.
    restarted = await RawStream(channel, make_hello("w-restart")).open()
    await wait_for(lambda: restarted.of("plan"), timeout=3.0)
    again = restarted.of("plan")[0]
    assert again.version > plan.version  # versions only move forward
    assert list(again.table) == list(plan.table) and again.nonce != plan.nonce
    [ws] = (await get_status(channel, "w-restart")).workers
    assert ws.acked_plan_version == 0 and not ws.HasField("plan")  # it runs its fallback until it ACKs
    await restarted.ack(again)
    await wait_for(lambda: worker(running, "w-restart").plans.acked_version == again.version)
    [ws] = (await get_status(channel, "w-restart")).workers
    assert ws.plan.version == again.version and list(ws.plan.table) == list(plan.table)

    # A Hello that names the plan the controller holds gets nothing again.
    current = worker_pb2.Hello()
    current.CopyFrom(hello)
    current.current_plan_version = again.version
    await restarted.close()
    same = await RawStream(channel, current).open()
    await asyncio.sleep(0.5)
    assert not same.of("plan")
    await same.close()


# ---------------------------------------------------- 2. duplicate worker id

async def test_newer_stream_for_a_worker_id_ends_the_older_with_aborted(served, caplog):
    running, channel = served
    older = await RawStream(channel, make_hello("w-twin")).open()
    await older.steps(3)
    await wait_for(lambda: worker(running, "w-twin").steps_ingested == 3)
    newer = await RawStream(channel, make_hello("w-twin")).open()
    await wait_for(lambda: older.ended is not None, timeout=3.0)
    code, details = older.ended
    assert code == grpc.StatusCode.ABORTED
    assert "superseded by a newer stream for worker 'w-twin'" in details
    assert any("supersedes" in r.getMessage() for r in caplog.records)
    await newer.steps(2)  # step ids start over after its Hello
    await wait_for(lambda: worker(running, "w-twin").steps_ingested == 5)
    status = await get_status(channel)
    assert status.streams_superseded == 1
    assert status.workers[0].streams_superseded == 1 and status.workers[0].connected
    assert newer.ended is None
    await newer.close()


# ------------------------------------------------ 3. Decide's plan version

async def test_decide_names_the_plan_its_decisions_come_from():
    # No hysteresis: the tables move as the telemetry does.
    running = await start_server(config(plan=PlanSettings(recompute_interval_s=0.0, min_push_interval_s=0.0,
                                                          hysteresis=0.0)))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        await _decide_names_its_plan(running, channel)
    finally:
        await channel.close()
        await running.stop(0)


async def _decide_names_its_plan(running, channel) -> None:
    wid = "w-unary"
    versions, step_id = [], 0
    for call in range(20):
        request = controller_pb2.DecideRequest(worker_id=wid, queries=[
            controller_pb2.DecideQuery(request_id=f"q{call}", context_len=300, batch_size=1)])
        if call == 0:
            request.hello.CopyFrom(make_hello(wid))
        if call >= 5:  # telemetry rides along from the 6th call: new tables follow
            steps = []
            for _ in range(20):
                step_id += 1
                steps.append(step(step_id, batch=1 + step_id % 4, depth=[0, 1, 4][step_id % 3], prefix=f"c{call}-"))
            request.reports.steps.extend(steps)
        response = await decide(channel, request)
        [ws] = (await get_status(channel, wid)).workers
        assert response.plan_version >= 1
        # The decisions come from the plan the answer names, and that plan is in force now.
        assert ws.acked_plan_version == response.plan_version == ws.plan.version
        cell = running.controller.workers[wid].plans.in_force.table.lookup(1, 300)
        got = response.decisions[0]
        assert (got.depth, got.width, got.max_nodes) == (cell.depth, cell.width, cell.max_nodes)
        assert ws.session == controller_pb2.WORKER_SESSION_UNARY
        versions.append(response.plan_version)
    [ws] = (await get_status(channel, wid)).workers
    assert len(set(versions)) >= 2, versions  # new tables came, and each answer named its own
    assert ws.plans_used >= len(set(versions))


# ------------------------------------------------------------ 4. idle expiry

async def test_silent_workers_expire_stream_and_unary_alike():
    port = free_port()
    running = await start_server(config(worker_idle_ttl_s=0.6, metrics_listen=f"127.0.0.1:{port}"))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        await decide(channel, controller_pb2.DecideRequest(worker_id="w-decide", hello=make_hello("w-decide")))
        silent = await RawStream(channel, make_hello("w-silent")).open()
        beating = await RawStream(channel, make_hello("w-beat")).open()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # an empty StepReports is a heartbeat
            await beating.send(reports())
            await asyncio.sleep(0.1)
        await wait_for(lambda: silent.ended is not None, timeout=3.0)
        assert silent.ended[0] == grpc.StatusCode.DEADLINE_EXCEEDED and "worker_idle_ttl_s" in silent.ended[1]
        assert beating.ended is None
        workers = {w.hello.worker_id: w for w in (await get_status(channel)).workers}
        assert not workers["w-decide"].connected and workers["w-decide"].expired
        assert workers["w-decide"].session == controller_pb2.WORKER_SESSION_UNARY
        assert not workers["w-silent"].connected and workers["w-silent"].expired
        assert workers["w-beat"].connected and not workers["w-beat"].expired
        status = await get_status(channel)
        assert status.workers_expired == 2 and status.worker_idle_ttl_s == pytest.approx(0.6)
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
        assert 'specctl_worker_connected{session="unary",worker="w-decide"} 0.0' in text
        assert 'specctl_worker_expired{worker="w-decide"} 1.0' in text
        assert "specctl_workers_expired_total 2.0" in text
        # A Decide brings the unary worker back.
        await decide(channel, controller_pb2.DecideRequest(worker_id="w-decide"))
        workers = {w.hello.worker_id: w for w in (await get_status(channel)).workers}
        assert workers["w-decide"].connected and not workers["w-decide"].expired
        await beating.close()
        await silent.close()
    finally:
        await channel.close()
        await running.stop(0)


# ------------------------------------------------------- 5. a NACKed plan

async def test_nack_returns_the_controllers_view_to_the_acked_plan(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("policy: static\ndepth: 4\nwidth: 1\n")
    port = free_port()
    running = await start_server(config(policy=str(policy), metrics_listen=f"127.0.0.1:{port}"))
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stream = await RawStream(channel, make_hello("w-nack")).open()
        accepted = await first_plan(stream)
        assert {d.depth for d in accepted.table} == {4}
        await wait_for(lambda: worker(running, "w-nack").plans.acked_version == accepted.version)

        policy.write_text("policy: static\ndepth: 2\nwidth: 1\n")
        reload = channel.unary_unary(SERVICE + "ReloadPolicy", request_serializer=lambda b: b,
                                     response_deserializer=controller_pb2.ReloadPolicyResponse.FromString)
        assert (await reload(controller_pb2.ReloadPolicyRequest().SerializeToString())).loaded
        await wait_for(lambda: len(stream.of("plan")) == 2)
        refused = stream.of("plan")[1]
        assert {d.depth for d in refused.table} == {2}
        await stream.send(worker_pb2.WorkerMessage(nack=worker_pb2.Nack(
            version=refused.version, nonce=refused.nonce, reason="depth 2 is not allowed here")))
        await wait_for(lambda: worker(running, "w-nack").counters.nacks == 1)

        [ws] = (await get_status(channel, "w-nack")).workers
        assert ws.acked_plan_version == accepted.version and ws.plan.version == accepted.version
        assert {d.depth for d in ws.plan.table} == {4}
        assert ws.last_nack_reason == "depth 2 is not allowed here"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
        assert 'specctl_decision_draft_depth{drafter_version="v1",worker="w-nack"} 4.0' in text
        # The refused table is not pushed again while the worker keeps reporting.
        await stream.steps(40)
        await asyncio.sleep(0.5)
        assert len(stream.of("plan")) == 2
        assert running.controller.workers["w-nack"].plans.current.table == running.controller.workers["w-nack"].plans.in_force.table
        await stream.close()
    finally:
        await channel.close()
        await running.stop(0)


# --------------------------------------------- 6. inconsistent telemetry

async def test_batch_size_rule_and_hello_limit(served):
    running, channel = served
    hello = make_hello("w-batch")
    hello.max_batch_size = 8
    stream = await RawStream(channel, hello).open()
    await stream.send(reports(step(1, batch=4, reported=1)))  # fewer reported than ran: allowed, documented
    await stream.send(reports(step(2, batch=60_000, reported=1)))
    await stream.send(reports(step(3, batch=9, reported=2)))
    await stream.send(reports(step(4, batch=1, reported=2)))
    await wait_for(lambda: len(stream.of("rejection")) == 3)
    fields = [(r.field, r.detail) for r in stream.of("rejection")]
    assert fields[0][0] == "steps[0].batch_size" and "60000" in fields[0][1] and "max_batch_size" in fields[0][1]
    assert fields[1][0] == "steps[0].batch_size" and "9 must be in 1..8" in fields[1][1]
    assert fields[2][0] == "steps[0].requests" and "exceed batch_size 1" in fields[2][1]
    assert running.controller.workers["w-batch"].steps_ingested == 1
    [ws] = (await get_status(channel, "w-batch")).workers
    assert ws.steps_received == 4
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decide(channel, controller_pb2.DecideRequest(worker_id="w-batch", queries=[
            controller_pb2.DecideQuery(request_id="q", context_len=10, batch_size=9)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "queries[0].batch_size: 9 must be in 1..8" in err.value.details()
    await stream.close()


async def test_an_outlier_step_leaves_the_fitted_cost_non_negative_and_other_shapes_alone(served):
    running, channel = served
    hello = make_hello("w-outlier")
    stream = await RawStream(channel, hello).open()
    for i in range(400):  # a steady worker: batch 1-8, ~10 ms + 0.5 ms per token
        b = 1 + i % 8
        await stream.send(reports(step(stream.next_step, batch=b, depth=0, verify_ms=10.0 + 0.5 * b,
                                       prefix=f"s{i}-")))
        stream.next_step += 1
    await wait_for(lambda: worker(running, "w-outlier").steps_ingested == 400)
    before = running.controller.workers["w-outlier"].cost.refit()
    await stream.send(reports(step(stream.next_step, batch=256, depth=0, verify_ms=3_000_000.0, prefix="x")))
    await wait_for(lambda: worker(running, "w-outlier").steps_ingested == 401)
    [ws] = (await get_status(channel, "w-outlier")).workers
    cost = ws.cost_model
    for name in ("mem_ms", "mem_ms_per_kv_token", "compute_ms", "compute_ms_per_token", "compute_ms_per_pair",
                 "compute_ms_per_kv_token",
                 "draft_fixed_ms", "draft_ms_per_level", "draft_ms_per_node"):
        assert getattr(cost, name) >= 0.0, (name, getattr(cost, name))
    assert all(r >= 0.0 for r in cost.compute_rise_ms)
    after = running.controller.workers["w-outlier"].cost.params
    for b in range(1, 9):
        assert after.verify_ms(b, b * 300) == pytest.approx(before.verify_ms(b, b * 300), rel=0.02, abs=0.1)
    await stream.close()


# ------------------------------------------------ 10. receipts and losses

async def test_receipts_name_the_last_step_read(served):
    running, channel = served
    stream = await RawStream(channel, make_hello("w-receipt")).open()
    await stream.steps(7)
    await wait_for(lambda: stream.of("receipt"), timeout=3.0)
    receipt = stream.of("receipt")[-1]
    assert receipt.last_step_id == 7 and receipt.steps_received == 7
    await stream.close()


async def test_hello_telemetry_loss_reaches_status(served):
    running, channel = served
    hello = make_hello("w-lossy")
    hello.telemetry_loss.steps_dropped = 12
    hello.telemetry_loss.steps_unconfirmed = 3
    stream = await RawStream(channel, hello).open()
    await wait_for(lambda: "w-lossy" in running.controller.workers)
    [ws] = (await get_status(channel, "w-lossy")).workers
    assert ws.hello.telemetry_loss.steps_dropped == 12 and ws.hello.telemetry_loss.steps_unconfirmed == 3
    await stream.close()
