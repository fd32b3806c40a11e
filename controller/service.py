"""The gRPC servicer: thin glue between the network and ``Controller``.

Each Connect stream gets a bounded send queue; when a worker reads too
slowly the oldest queued message is dropped (a newer plan supersedes an
older one, and rejections are counted anyway), so one stuck stream never
holds up another worker's plans.

One stream per worker id: a newer stream's Hello ends the older one with
ABORTED (counted, logged). A stream silent for ``worker_idle_ttl_s`` is
ended with DEADLINE_EXCEEDED. About once a second a stream that brought
steps gets a ``TelemetryReceipt`` naming the last step read, so the worker
knows what a break may have lost.

A stream writes one message at a time: gRPC resumes the Connect generator
only once the previous write completed, and under load (256 busy streams on
one event loop) a completion takes ~100 ms. A plan queued behind a receipt
would wait that long, so a worker whose stream has a write in flight is not
planned until the write completes (at most ``PLAN_WAIT_FOR_WRITE_S``); its
turn is kept, and its plan is computed then, from the telemetry of then.

A plan put in an idle stream's queue leaves on the stream's next turn of
the event loop, but that turn comes after every callback already queued:
under load, the reads of every stream whose telemetry arrived in the same
poll, each ingesting up to 64 steps (milliseconds each). So while a plan
waits for its writer (:class:`PlansOnTheWay`), a read yields one turn
before it ingests, and the writer goes first: the plan's bytes leave before
that telemetry is applied instead of after. With ``gc.hold_during_plan_push``
no automatic garbage collection starts from a push's policy run until gRPC
has taken the plan: a full collection stops the loop for 50-300 ms at 256
workers, and one that fell between a plan and its write delayed the plan
that long. The collection then runs right after the plan left.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from controller.alerts.alerting import WatcherOverflow
from controller.alerts.proto import EXISTING_ALERTS_METADATA, alert_to_proto
from controller.auth import Authenticator, Identity, current_identity, guard_handlers
from controller.core import Controller, WorkerState
from controller.observe.metrics_gc import gc_pauses
from controller.protocol import MAX_BATCH_SIZE, MAX_CONTEXT_LEN, Invalid, R, decision_to_proto
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2

log = logging.getLogger("specctl.service")
SERVICE_NAME = "speculation.v1.SpeculationController"
# A worker whose stream has had one write in flight this long is planned anyway (its plan queues
# behind the write): a reader that slow is not worth starving its re-plans for.
PLAN_WAIT_FOR_WRITE_S = 1.0
# Automatic garbage collection is never held longer than this (a writer that never takes its plan).
GC_HOLD_MAX_S = 0.5


@dataclass(frozen=True)
class Malformed:
    """Stands in for a message whose bytes did not parse."""

    error: str


def lenient_parser(message_type):
    """A deserializer that returns ``Malformed`` instead of raising, so the
    servicer can reject, count and keep the stream (gRPC's default would end
    the call with INTERNAL before any of our code runs)."""

    def parse(data: bytes):
        msg = message_type()
        try:
            msg.ParseFromString(data)
        except Exception as err:  # noqa: BLE001 - any parse failure is a malformed message
            return Malformed(f"{type(err).__name__}: {err}")
        return msg

    return parse


def carries_plan(msg: plan_pb2.ControllerMessage | None) -> bool:
    """A Plan or RequestDecisions: what the push latency goal is about."""
    return msg is not None and msg.WhichOneof("payload") in ("plan", "request_decisions")


class PlansOnTheWay:
    """Streams whose idle writer has a plan to take, and plan pushes being
    computed; while there are any, reads yield to the writers and (with
    ``hold_gc``) automatic garbage collection is held.

    The hold only ever turns off a collector that was on, and turns it back
    on; it ends at most ``GC_HOLD_MAX_S`` after it began (:meth:`expire`)."""

    def __init__(self, hold_gc: bool = False, clock=time.monotonic) -> None:
        self.streams: set[Stream] = set()
        self.hold_gc = hold_gc
        self.clock = clock
        self.computing = 0
        self.gc_held_since: float | None = None
        self.holds = 0
        self.holds_expired = 0

    def __bool__(self) -> bool:
        return bool(self.streams)

    def add(self, stream: "Stream") -> None:
        self.streams.add(stream)
        self._sync()

    def discard(self, stream: "Stream") -> None:
        if stream in self.streams:
            self.streams.discard(stream)
            self._sync()

    def begin_push(self) -> None:
        """A plan push's policy run starts (its plan, if any, is queued before :meth:`end_push`)."""
        self.computing += 1
        self._sync()

    def end_push(self) -> None:
        self.computing -= 1
        self._sync()

    def expire(self) -> None:
        """Release a hold that outlived ``GC_HOLD_MAX_S`` (its writers are forgotten)."""
        if self.gc_held_since is not None and self.clock() - self.gc_held_since >= GC_HOLD_MAX_S:
            self.holds_expired += 1
            self.streams.clear()
            self._release()

    def _sync(self) -> None:
        if not self.hold_gc:
            return
        if self.computing or self.streams:
            if self.gc_held_since is None and gc.isenabled():
                gc.disable()
                self.gc_held_since = self.clock()
                self.holds += 1
                gc_pauses().holds += 1
        else:
            self._release()

    def _release(self) -> None:
        if self.gc_held_since is not None:
            self.gc_held_since = None
            gc.enable()  # a collection that came due meanwhile runs at the next allocation


class Stream:
    """One connected worker's outbound side.

    ``on_the_way``: the servicer's :class:`PlansOnTheWay`, which this stream
    joins while its idle writer has a plan to take."""

    def __init__(self, state: WorkerState, maxsize: int, on_the_way: PlansOnTheWay | None = None) -> None:
        self.state = state
        self.on_the_way = on_the_way if on_the_way is not None else PlansOnTheWay()
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.dropped = 0
        # Why the controller ends this stream, when it does (the call ends with this status).
        self.ending: tuple[grpc.StatusCode, str] | None = None
        # Steps read on this stream, and what the last receipt covered.
        self.steps_read = 0
        self.last_step_id = 0
        self.receipted = 0
        self.receipt_at = float("-inf")
        # time.monotonic() when gRPC took the message now being written; None while no write is in flight.
        self.write_started_at: float | None = None

    def ready_for_plan(self, now: float) -> bool:
        """True unless a write is in flight (for less than ``PLAN_WAIT_FOR_WRITE_S``):
        a plan queued now would leave only when that write completes."""
        started = self.write_started_at
        return started is None or now - started >= PLAN_WAIT_FOR_WRITE_S

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """End the call with ``code``: nothing read after this is applied."""
        if self.ending is None:
            self.ending = (code, message)
        self.send(None)

    def send(self, msg: plan_pb2.ControllerMessage | None) -> None:
        while True:
            try:
                self.queue.put_nowait(msg)
                break
            except asyncio.QueueFull:
                self.queue.get_nowait()
                self.dropped += 1
        if self.write_started_at is None and carries_plan(msg):
            # The writer is idle and takes it on its next turn (a plan behind a write in
            # flight waits for the write's completion, which no yielding read speeds up).
            self.on_the_way.add(self)

    def taken(self) -> None:
        """gRPC took the next message of this stream for writing: it hands the bytes to
        its core in this same turn of the loop, so the stream leaves the plans on the way
        on the next turn (a collection released now would run before the bytes left)."""
        self.write_started_at = time.monotonic()
        if self in self.on_the_way.streams:
            asyncio.get_running_loop().call_soon(self.on_the_way.discard, self)


def wrap(item) -> plan_pb2.ControllerMessage:
    if isinstance(item, plan_pb2.Plan):
        return plan_pb2.ControllerMessage(plan=item)
    if isinstance(item, plan_pb2.RequestDecisions):
        return plan_pb2.ControllerMessage(request_decisions=item)
    return plan_pb2.ControllerMessage(rejection=item)


class SpeculationControllerServicer:
    def __init__(self, controller: Controller, authenticator: Authenticator | None = None) -> None:
        self.controller = controller
        self.auth = authenticator or Authenticator(None)  # off unless the config has security.auth
        self.streams: dict[str, Stream] = {}
        self.recorder = None  # controller.observe.recorder.TelemetryRecorder when serving with --record
        self.alerting = None  # controller.alerts.alerting.DriftAlerting unless drift.enabled is false
        self.policy_source = None  # controller.reload.PolicySource of the server
        self.fleet = None  # controller.fleet.replica.FleetReplica with state.backend: redis
        self._next_stream = 0
        # Workers passed over in their rotation turn because their stream was writing, oldest first
        # (an insertion-ordered set), and how many turns were put off so (a count, for the benchmark).
        self.deferred: dict[str, None] = {}
        self.plans_deferred = 0
        # Streams whose idle writer has a plan to take: reads yield to them (module docstring).
        self.on_the_way = PlansOnTheWay(hold_gc=controller.config.gc.hold_during_plan_push)
        controller.plan_waiting = self.on_the_way.__bool__  # status slices yield to a plan's writer too
        self.reads_yielded = 0  # reads that let a plan's writer go first (a count, for the benchmark)
        controller.on_hello.append(self._rebind_stream)

    # ------------------------------------------------------------- Connect
    async def Connect(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext):
        ctl = self.controller
        first = await _next(request_iterator)
        if first is None:
            return
        if isinstance(first, Malformed) or first.WhichOneof("payload") != "hello":
            reason = R.REJECT_REASON_MALFORMED if isinstance(first, Malformed) else R.REJECT_REASON_NO_HELLO
            what = first.error if isinstance(first, Malformed) else f"got {first.WhichOneof('payload')}"
            ctl.rejections[reason] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first message must be a hello ({what})")
        identity = current_identity()
        denied = self.auth.check_worker(identity, first.hello.worker_id)
        if denied is not None:
            await context.abort(denied.code, denied.message)
        if self.recorder is not None:
            self.recorder.hello(first.hello)
        try:
            state = ctl.hello(first.hello)
        except Invalid as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err.field}: {err.detail}")
        ctl.seen(state, controller_pb2.WORKER_SESSION_STREAM)
        stream = Stream(state, ctl.config.send_queue_size, self.on_the_way)
        previous = self.streams.get(state.worker_id)
        if previous is not None:
            # Newest wins (a restarted worker must not wait for its dead stream to time out).
            ctl.streams_superseded += 1
            state.counters.streams_superseded += 1
            peer = context.peer()
            log.warning("worker %s: a new stream from %s supersedes the open one", state.worker_id, peer)
            previous.end(grpc.StatusCode.ABORTED, f"superseded by a newer stream for worker {state.worker_id!r} "
                                                  f"(from {peer}); one stream per worker id, newest wins")
        self.streams[state.worker_id] = stream
        reader = asyncio.create_task(self._read(request_iterator, stream, identity))
        try:
            self._push_plans(stream)
            while True:
                item = await stream.queue.get()
                if item is None:
                    break
                stream.taken()
                if item.WhichOneof("payload") == "plan":
                    now = ctl.clock()
                    ctl.plan_handoffs.append((now, (now - item.plan.created_at) * 1000.0))
                yield item  # gRPC comes back for the next item once this write has completed
                stream.write_started_at = None
            if stream.ending is not None:
                await context.abort(*stream.ending)
        finally:
            reader.cancel()
            self.on_the_way.discard(stream)
            if self.streams.get(state.worker_id) is stream:
                del self.streams[state.worker_id]
                ctl.disconnect(stream.state)

    async def _read(self, request_iterator: AsyncIterator, stream: Stream, identity: Identity | None) -> None:
        ctl = self.controller
        try:
            async for msg in request_iterator:
                if self.on_the_way:
                    self.reads_yielded += 1
                    await asyncio.sleep(0)  # a plan's writer was queued before this read: it goes first
                if stream.ending is not None:
                    break  # superseded, idle or denied: nothing more of this stream is applied
                kind = None if isinstance(msg, Malformed) else msg.WhichOneof("payload")
                if kind == "hello":
                    denied = self.auth.check_worker(identity, msg.hello.worker_id)
                    if denied is not None:
                        stream.end(denied.code, denied.message)
                        break
                ctl.seen(stream.state, controller_pb2.WORKER_SESSION_STREAM)
                if kind == "reports" and msg.reports.steps:
                    stream.steps_read += len(msg.reports.steps)
                    stream.last_step_id = max(stream.last_step_id, max(s.step_id for s in msg.reports.steps))
                for rejection in self.handle(stream.state, msg):
                    stream.send(wrap(rejection))
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            stream.send(None)

    def handle(self, state: WorkerState, msg) -> list[plan_pb2.Rejection]:
        ctl = self.controller
        if isinstance(msg, Malformed):
            return [ctl.reject(state, Invalid(R.REJECT_REASON_MALFORMED, "<message>", msg.error))]
        kind = msg.WhichOneof("payload")
        if self.recorder is not None:
            self._record(state.worker_id, kind, msg)
        if kind == "reports":
            return ctl.ingest(state, msg.reports)
        if kind == "finished":
            rejection = ctl.finished(state, msg.finished)
        elif kind == "ack":
            rejection = ctl.ack(state, msg.ack)
        elif kind == "nack":
            rejection = ctl.nack(state, msg.nack)
        elif kind == "hello" and msg.hello.worker_id != state.worker_id:
            rejection = ctl.reject(state, Invalid(R.REJECT_REASON_INVALID_FIELD, "hello.worker_id",
                                                  f"{msg.hello.worker_id!r} differs from this stream's worker "
                                                  f"{state.worker_id!r}"))
        elif kind == "hello":
            try:
                ctl.hello(msg.hello)
                rejection = None
            except Invalid as err:
                rejection = err.to_proto()
            else:
                stream = self.streams.get(state.worker_id)
                if stream is not None:  # a new session on this stream: its step ids start over
                    stream.last_step_id = 0
        else:
            rejection = ctl.reject(state, Invalid(R.REJECT_REASON_MALFORMED, "payload", "empty WorkerMessage"))
        return [rejection] if rejection is not None else []

    def _rebind_stream(self, state: WorkerState) -> None:
        """A Hello with new drafter limits (on the stream or through Decide)
        registers a new state: the worker's open stream follows it."""
        stream = self.streams.get(state.worker_id)
        if stream is not None:
            stream.state = state

    def _record(self, worker_id: str, kind: str | None, msg) -> None:
        if kind == "reports":
            self.recorder.steps(worker_id, msg.reports)
        elif kind == "finished":
            self.recorder.finished(worker_id, msg.finished)
        elif kind == "hello":
            self.recorder.hello(msg.hello)

    def _push_plans(self, stream: Stream) -> bool:
        sent = False
        self.on_the_way.begin_push()
        try:
            for item in self.controller.plan_updates(stream.state):
                stream.send(wrap(item))
                sent = True
        finally:
            self.on_the_way.end_push()
        return sent

    def send_receipts(self, interval_s: float) -> None:
        """Tell each stream that brought steps since its last receipt how far
        the controller has read (at most once per ``interval_s``)."""
        now = time.monotonic()
        for stream in self.streams.values():
            if stream.steps_read > stream.receipted and now - stream.receipt_at >= interval_s:
                stream.receipted = stream.steps_read
                stream.receipt_at = now
                stream.send(plan_pb2.ControllerMessage(receipt=plan_pb2.TelemetryReceipt(
                    last_step_id=stream.last_step_id, steps_received=stream.steps_read)))

    def expire_idle(self) -> list[str]:
        """Take workers silent for ``worker_idle_ttl_s`` for gone: end their
        streams (DEADLINE_EXCEEDED); Decide-only ones are marked disconnected."""
        ttl = self.controller.config.worker_idle_ttl_s
        gone = []
        for state in self.controller.idle_workers():
            gone.append(state.worker_id)
            stream = self.streams.get(state.worker_id)
            if stream is not None:
                stream.end(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"no message from worker {state.worker_id!r} for {ttl:g} s (worker_idle_ttl_s): "
                           "send an empty StepReports as a heartbeat when idle")
        return gone

    async def push_due_plans(self, budget_s: float) -> None:
        """Run due policies and push their plans, round-robin over the streams,
        within ``budget_s`` of CPU so telemetry ingest is never starved: with
        many workers each one is simply re-planned less often. After each push
        the loop is yielded to, so the plan leaves now rather than after the
        rest of the tick's policy runs.

        Workers this controller has not sent a plan yet go first, outside the
        rotation: a replica taking over a dead one's workers would otherwise
        plan each newcomer in its turn among every re-plan, and with 200
        workers on a budget of ~55 policy runs a second the last one would
        wait ~4 s on its fallback.

        A worker whose stream is still writing its last message (see
        :meth:`Stream.ready_for_plan`) is passed over; if its turn in the
        rotation came with its policy due, it is tried first on the next ticks
        until planned."""
        streams = list(self.streams.values())
        if not streams:
            return
        start = time.perf_counter()
        now = time.monotonic()
        for stream in streams:
            if stream.state.plans.current is not None or not stream.ready_for_plan(now):
                continue
            if self._push_plans(stream):
                await asyncio.sleep(0)
            if time.perf_counter() - start > budget_s:  # a policy run that pushed nothing costs too
                return
        for worker_id in list(self.deferred):
            stream = self.streams.get(worker_id)
            if stream is None:
                del self.deferred[worker_id]
                continue
            if not stream.ready_for_plan(time.monotonic()):
                continue
            del self.deferred[worker_id]
            if self._push_plans(stream):
                await asyncio.sleep(0)
            if time.perf_counter() - start > budget_s:
                return
        first = self._next_stream % len(streams)
        for k in range(len(streams)):
            stream = streams[(first + k) % len(streams)]
            if not stream.ready_for_plan(time.monotonic()):
                if stream.state.worker_id not in self.deferred and self.controller.plans.due(stream.state):
                    self.deferred[stream.state.worker_id] = None
                    self.plans_deferred += 1
                continue
            if self._push_plans(stream):
                await asyncio.sleep(0)
            if time.perf_counter() - start > budget_s:
                self._next_stream = first + k + 1
                return
        self._next_stream = first

    # -------------------------------------------------------------- Decide
    async def Decide(self, request, context: grpc.aio.ServicerContext) -> controller_pb2.DecideResponse:
        ctl = self.controller
        if isinstance(request, Malformed):
            ctl.rejections[R.REJECT_REASON_MALFORMED] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed DecideRequest: {request.error}")
        denied = self.auth.check_worker(current_identity(), request.worker_id)
        if denied is not None:
            await context.abort(denied.code, denied.message)
        if not request.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: must be a non-empty string")
        if request.HasField("hello"):
            if self.recorder is not None:
                self.recorder.hello(request.hello)
            if request.hello.worker_id != request.worker_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"hello.worker_id={request.hello.worker_id!r} differs from worker_id={request.worker_id!r}")
            try:
                ctl.hello(request.hello)
            except Invalid as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err.field}: {err.detail}")
        state = ctl.workers.get(request.worker_id)
        if state is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"worker_id={request.worker_id!r} is unknown: include its hello in the first Decide")
        limit = state.hello.max_batch_size or MAX_BATCH_SIZE
        for i, q in enumerate(request.queries):  # all checked before anything is applied
            if not 1 <= q.batch_size <= limit:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"queries[{i}].batch_size: {q.batch_size} must be in 1..{limit} "
                                    "(hello.max_batch_size)")
            if q.context_len > MAX_CONTEXT_LEN:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"queries[{i}].context_len: {q.context_len} must be in 0..{MAX_CONTEXT_LEN}")
            if q.request_state not in plan_pb2.RequestState.values():
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"queries[{i}].request_state: {q.request_state} is not a RequestState")
        session = (controller_pb2.WORKER_SESSION_STREAM if state.worker_id in self.streams
                   else controller_pb2.WORKER_SESSION_UNARY)
        ctl.seen(state, session)
        response = controller_pb2.DecideResponse()
        if request.HasField("reports"):
            if self.recorder is not None:
                self.recorder.steps(state.worker_id, request.reports)
            response.rejections.extend(ctl.ingest(state, request.reports))
        if self.fleet is not None and state.plans.current is None:
            await self.fleet.wait_first_plan(state)  # planned from the fleet's statistics (bounded wait)
            state = ctl.workers.get(request.worker_id) or state
        ctl.plan_updates(state)  # a new table when one is due; a unary caller gets it in the answers below
        for q in request.queries:
            d = ctl.decide(state, q.request_id, q.context_len, q.batch_size, q.request_class, q.request_state)
            response.decisions.append(decision_to_proto(d))
        if session == controller_pb2.WORKER_SESSION_UNARY:
            for version in list(state.plans.pending):  # it has no stream to ACK on: answering from a plan applies it
                ctl.use(state, version)
        response.plan_version = state.plans.current_version
        return response

    # ----------------------------------------------------------- GetStatus
    async def GetStatus(self, request, context: grpc.aio.ServicerContext) -> controller_pb2.GetStatusResponse:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed GetStatusRequest: {request.error}")
        # Built in slices with yields between them: the fleet's telemetry and plans go on meanwhile.
        response = await self.controller.status_async(request.worker_id)
        if self.fleet is not None:
            self.fleet.annotate(response, request.worker_id)
        return response

    # -------------------------------------------------------------- alerts
    async def WatchAlerts(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed WatchAlertsRequest: {request.error}")
        alerting = await self._alerting(context)
        watcher = alerting.watch(request.drafter_version)
        try:
            existing = await alerting.existing(request.include_history, request.open_only, request.drafter_version)
            await context.send_initial_metadata(((EXISTING_ALERTS_METADATA, str(len(existing))),))
            for alert in existing:
                yield alert_to_proto(alert, "existing")
            while (msg := await watcher.get()) is not None:
                yield msg
        except WatcherOverflow as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}: watch again to resynchronise")
        finally:
            alerting.unwatch(watcher)

    async def AckAlert(self, request, context: grpc.aio.ServicerContext) -> controller_pb2.AckAlertResponse:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed AckAlertRequest: {request.error}")
        if not request.alert_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "alert_id: must be a non-empty string")
        alerting = await self._alerting(context)
        alert = await alerting.acknowledge(request.alert_id, request.acked_by)
        if alert is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"alert_id={request.alert_id!r}: no such alert")
        return controller_pb2.AckAlertResponse(alert=alert_to_proto(alert, "acknowledged"))

    async def ReloadPolicy(self, request, context: grpc.aio.ServicerContext) -> controller_pb2.ReloadPolicyResponse:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed ReloadPolicyRequest: {request.error}")
        source = self.policy_source
        if source is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this controller has no policy file to reload")
        loaded = source.reload()
        return controller_pb2.ReloadPolicyResponse(loaded=loaded, policy=self.controller.policy.name,
                                                   error="" if loaded else source.last_error)

    async def _alerting(self, context: grpc.aio.ServicerContext):
        if self.alerting is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drift monitor is off (drift.enabled: false)")
        return self.alerting


async def _next(iterator: AsyncIterator):
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


# rpc -> (handler kind, request type, response type); requests parse leniently (see ``lenient_parser``).
RPCS = {
    "Connect": (grpc.stream_stream_rpc_method_handler, worker_pb2.WorkerMessage, plan_pb2.ControllerMessage),
    "Decide": (grpc.unary_unary_rpc_method_handler, controller_pb2.DecideRequest, controller_pb2.DecideResponse),
    "GetStatus": (grpc.unary_unary_rpc_method_handler, controller_pb2.GetStatusRequest,
                  controller_pb2.GetStatusResponse),
    "WatchAlerts": (grpc.unary_stream_rpc_method_handler, controller_pb2.WatchAlertsRequest, controller_pb2.DriftAlert),
    "AckAlert": (grpc.unary_unary_rpc_method_handler, controller_pb2.AckAlertRequest, controller_pb2.AckAlertResponse),
    "ReloadPolicy": (grpc.unary_unary_rpc_method_handler, controller_pb2.ReloadPolicyRequest,
                     controller_pb2.ReloadPolicyResponse),
}


def rpc_handlers(servicer: SpeculationControllerServicer) -> grpc.GenericRpcHandler:
    handlers = {
        name: kind(getattr(servicer, name), request_deserializer=lenient_parser(request),
                   response_serializer=response.SerializeToString)
        for name, (kind, request, response) in RPCS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, guard_handlers(handlers, servicer.auth))
