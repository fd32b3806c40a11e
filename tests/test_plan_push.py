"""A plan is never queued behind a message its stream is still writing (issue #30).

gRPC pulls the next item from the servicer's Connect generator only once the
previous write completed. These tests drive ``SpeculationControllerServicer.
Connect`` the way gRPC does (one ``__anext__`` per completed write), so a
write stays "in flight" exactly as long as the test withholds the next pull,
and check which workers ``push_due_plans`` plans meanwhile; the last test
runs the real server over gRPC.
"""

from __future__ import annotations

import asyncio

import grpc

import controller.service as service
from controller.config import PlanSettings, ServerConfig
from controller.core.controller import Controller
from controller.server import start_server
from controller.service import SpeculationControllerServicer
from policies.presets import load_preset
from policies.table import Decision
from protos.speculation.v1 import plan_pb2, worker_pb2
from tests.support import SyntheticWorker, make_hello, wait_for
from worker.sdk.agent import step_to_proto

SERVICE = "/speculation.v1.SpeculationController/"


class _Context:
    """What Connect asks of a ``grpc.aio.ServicerContext`` when nothing goes wrong."""

    def peer(self) -> str:
        return "test"

    async def abort(self, code, details):
        raise AssertionError(f"Connect aborted: {code} {details}")


class DrivenStream:
    """One worker's Connect call, pulled like gRPC pulls it: ``complete_write``
    is gRPC coming back for the next message after a write completed."""

    def __init__(self, servicer: SpeculationControllerServicer, worker_id: str) -> None:
        self.servicer = servicer
        self.worker_id = worker_id
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.synthetic = SyntheticWorker(lambda ctx: 0.7, seed=len(worker_id))
        self.generator = servicer.Connect(self._requests(make_hello(worker_id)), _Context())
        self.pull = asyncio.ensure_future(self.generator.__anext__())  # gRPC waits for the first message
        self.written: list[plan_pb2.ControllerMessage] = []

    async def _requests(self, hello: worker_pb2.Hello):
        yield worker_pb2.WorkerMessage(hello=hello)
        while (msg := await self.inbox.get()) is not None:
            yield msg

    @property
    def stream(self) -> service.Stream:
        return self.servicer.streams[self.worker_id]

    async def send(self, msg: worker_pb2.WorkerMessage) -> None:
        """A message from the worker, read and applied by the servicer."""
        before = self.stream.state.counters.steps_received, self.stream.state.counters.acks
        await self.inbox.put(msg)
        await _until(lambda: self.inbox.empty()
                     and (self.stream.state.counters.steps_received, self.stream.state.counters.acks) != before)

    async def report_step(self) -> None:
        step = self.synthetic.step(lambda rid, ctx, b: Decision.off(), 2, 500, prefix=f"{self.worker_id}-")
        await self.send(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[step_to_proto(step)])))

    async def taken(self) -> plan_pb2.ControllerMessage:
        """The message gRPC took for writing (the write is in flight from now on)."""
        await _until(self.pull.done)
        msg = self.pull.result()
        self.written.append(msg)
        return msg

    def complete_write(self) -> None:
        self.pull = asyncio.ensure_future(self.generator.__anext__())

    async def close(self) -> None:
        await self.inbox.put(None)
        self.pull.cancel()
        await self.generator.aclose()


async def _until(predicate, turns: int = 200) -> None:
    """Let the event loop run until ``predicate`` holds (counted in loop turns, not time)."""
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not met within 200 loop turns")


def _servicer() -> SpeculationControllerServicer:
    config = ServerConfig(plan=PlanSettings(steps_before_first_plan=0, recompute_interval_s=0.0,
                                            min_push_interval_s=0.0, hysteresis=0.0))
    return SpeculationControllerServicer(Controller(config, load_preset("static")))


async def test_a_worker_whose_stream_is_writing_is_planned_after_the_write_not_behind_it() -> None:
    servicer = _servicer()
    a, b = DrivenStream(servicer, "w-a"), DrivenStream(servicer, "w-b")
    try:
        await _until(lambda: {"w-a", "w-b"} <= set(servicer.streams))
        for w in (a, b):
            await w.report_step()
        await servicer.push_due_plans(10.0)  # first plans, newcomers first
        first = {w.worker_id: (await w.taken()).plan for w in (a, b)}
        assert all(p.version == 1 for p in first.values())
        for w in (a, b):  # the worker applies it: ACK on the stream
            await w.send(worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=1, nonce=first[w.worker_id].nonce)))
        b.complete_write()  # b's write completed; a's is still in flight
        await _until(lambda: b.stream.write_started_at is None)
        assert a.stream.write_started_at is not None
        for w in (a, b):
            await w.report_step()
            w.stream.state.plans.force_push = True  # due, and its next table goes out whatever it is
        decided_a = a.stream.state.plans.last_decide_at
        await servicer.push_due_plans(10.0)
        assert (await b.taken()).plan.version == 2  # other workers' plans do not wait
        assert a.stream.queue.empty()  # nothing queued behind a's write ...
        assert a.stream.state.plans.last_decide_at == decided_a  # ... and its policy did not run yet
        assert list(servicer.deferred) == ["w-a"] and servicer.plans_deferred == 1
        await a.report_step()  # telemetry while it waits is read and applied as always
        a.complete_write()
        await _until(lambda: a.stream.write_started_at is None)
        await servicer.push_due_plans(10.0)  # the deferred worker goes first now
        second = await a.taken()
        assert second.plan.version == 2 and a.stream.state.plans.last_decide_at > decided_a
        assert not servicer.deferred
        # Its plan comes from the telemetry of when it ran: both of a's reports since the first plan.
        assert a.stream.state.steps_ingested == 3 and a.stream.state.plans.new_steps == 0
        await a.send(worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=2, nonce=second.plan.nonce)))
        ledgers = {w.worker_id: w.stream.state.plans for w in (a, b)}
        assert ledgers["w-a"].acked_version == 2 and ledgers["w-b"].acked_version == 1
        assert not servicer.controller.rejections
    finally:
        for w in (a, b):
            await w.close()


async def test_a_write_in_flight_too_long_no_longer_holds_the_plan(monkeypatch) -> None:
    servicer = _servicer()
    a = DrivenStream(servicer, "w-slow")
    try:
        await _until(lambda: "w-slow" in servicer.streams)
        await a.report_step()
        await servicer.push_due_plans(10.0)
        assert (await a.taken()).plan.version == 1  # in flight from now on, never completed
        await a.report_step()
        a.stream.state.plans.force_push = True
        await servicer.push_due_plans(10.0)
        assert a.stream.queue.empty() and servicer.plans_deferred == 1
        monkeypatch.setattr(service, "PLAN_WAIT_FOR_WRITE_S", 0.0)  # as if it had waited that long
        await servicer.push_due_plans(10.0)
        queued = a.stream.queue.get_nowait()  # planned anyway: the plan waits behind the stuck write
        assert queued.plan.version == 2
    finally:
        await a.close()


async def test_the_real_server_frees_a_stream_once_its_writes_complete() -> None:
    """Over gRPC: after the worker received its plan and a receipt, the stream has no write in
    flight (were the mark left behind, every later plan of the worker would wait a second)."""
    config = ServerConfig(listen="127.0.0.1:0", receipt_interval_s=0.05,
                          plan=PlanSettings(steps_before_first_plan=1, tick_s=0.02))
    running = await start_server(config, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(running.address)
    call = channel.stream_stream(SERVICE + "Connect", request_serializer=lambda b: b,
                                 response_deserializer=plan_pb2.ControllerMessage.FromString)()
    try:
        synthetic = SyntheticWorker(lambda ctx: 0.7, seed=3)
        await call.write(worker_pb2.WorkerMessage(hello=make_hello("w-real")).SerializeToString())
        step = synthetic.step(lambda rid, ctx, b: Decision.off(), 2, 500, prefix="w-real-")
        await call.write(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(
            steps=[step_to_proto(step)])).SerializeToString())
        kinds: set[str] = set()
        while not {"plan", "receipt"} <= kinds:
            msg = await asyncio.wait_for(call.read(), 10)
            kinds.add(msg.WhichOneof("payload"))
            if msg.HasField("plan"):
                await call.write(worker_pb2.WorkerMessage(ack=worker_pb2.Ack(
                    version=msg.plan.version, nonce=msg.plan.nonce)).SerializeToString())
        stream = running.servicer.streams["w-real"]
        await wait_for(lambda: stream.write_started_at is None and stream.queue.empty(), timeout=10)
        await wait_for(lambda: stream.state.plans.acked_version == 1, timeout=10)
    finally:
        call.cancel()
        await channel.close()
        await running.stop(0)


async def test_the_servicer_times_each_plan_from_created_at_to_grpc_taking_it() -> None:
    """``Controller.plan_handoffs``: per Plan gRPC takes, the controller clock then and the
    ms since the plan's ``created_at`` (the controller's own part of a push);
    other messages on the stream (a receipt) add nothing."""
    servicer = _servicer()
    now = [10.0]
    servicer.controller.clock = lambda: now[0]
    push = servicer._push_plans

    def push_then_wait(stream):  # gRPC takes what a push queued 0.25 s after it was stamped
        sent = push(stream)
        now[0] += 0.25
        return sent

    servicer._push_plans = push_then_wait
    a = DrivenStream(servicer, "w-a")
    try:
        await _until(lambda: "w-a" in servicer.streams)
        await a.report_step()
        await servicer.push_due_plans(10.0)
        plan = (await a.taken()).plan
        assert list(servicer.controller.plan_handoffs) == [(plan.created_at + 0.25, 250.0)]
        a.complete_write()
        await _until(lambda: a.stream.write_started_at is None)
        servicer.send_receipts(0.0)
        assert (await a.taken()).WhichOneof("payload") == "receipt"
        assert len(servicer.controller.plan_handoffs) == 1
    finally:
        await a.close()
