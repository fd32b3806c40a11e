"""``SpeculationAgent``: the SDK an existing engine embeds.

The engine's step loop calls two methods, neither of which touches the
network:

- ``decide(request_id, context_len, batch_size) -> Decision`` — a lookup in
  the last plan received (per-request override first, then the table), a few
  microseconds, thread-safe: plans are immutable and swapped by reference.
- ``observe(step)`` / ``finish(summary)`` — append to a bounded queue; when
  it is full the oldest step is dropped and counted, the engine never waits.

A background task holds the Connect stream: it sends Hello, batches queued
telemetry into ``StepReports``, validates every Plan and RequestDecisions it
receives and answers each with an Ack or a Nack (a refused plan leaves the
previous one in force), and reconnects with exponential backoff and full
jitter. Before any plan arrives, and while cut off from the controller, the
agent keeps deciding on the fallback decision or the last plan it applied.

Nothing is lost without being counted: steps the queue dropped, and steps
written to a stream that broke before a ``TelemetryReceipt`` covered them,
are in ``AgentStats`` and in every Hello the agent sends
(``Hello.telemetry_loss``). When idle it sends an empty ``StepReports`` as a
heartbeat so the controller does not take it for gone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from policies.table import Decision, DecisionTable
from protos.speculation.v1 import controller_pb2_grpc, plan_pb2, worker_pb2
from worker.sdk.telemetry import RequestSummary, StepTelemetry

log = logging.getLogger("specctl.agent")
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)  # a config problem, not a blip
_SESSION_OVER = object()  # outbox sentinel: the request generator of an ended call returns


@dataclass
class AgentStats:
    connected: bool = False
    plan_version: int = 0
    plans_applied: int = 0
    decisions_applied: int = 0
    nacks_sent: int = 0
    dropped_steps: int = 0  # dropped since the last StepReports (reported in its dropped_steps)
    steps_sent: int = 0
    # Telemetry loss since start (Hello.telemetry_loss): queue drops, and steps
    # written to a stream that broke before a receipt covered them.
    steps_dropped_total: int = 0
    steps_unconfirmed: int = 0
    finished_dropped: int = 0
    steps_confirmed: int = 0
    receipts: int = 0
    superseded: int = 0  # streams the controller ended because another took this worker id
    heartbeats: int = 0
    reconnects: int = 0
    rejections: int = 0
    last_rejection: str = ""
    last_error: str = ""


@dataclass
class AgentOptions:
    fallback: Decision = field(default_factory=lambda: Decision.off())
    queue_size: int = 4096  # steps kept while the controller is slow or away
    flush_interval_s: float = 0.1  # telemetry batching period (plans move on seconds, not steps)
    max_steps_per_message: int = 64
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    # An empty StepReports after this long with nothing to send: the controller
    # takes a worker silent for worker_idle_ttl_s (default 120 s) for gone.
    heartbeat_interval_s: float = 15.0


def step_to_proto(step: StepTelemetry) -> worker_pb2.StepReport:
    report = worker_pb2.StepReport(
        step_id=step.step_id,
        timestamp=step.timestamp,
        batch_size=step.batch_size,
        draft_ms=step.draft_ms,
        verify_ms=step.verify_ms,
        catch_up_ms=step.catch_up_ms,
    )
    for r in step.requests:
        ranks, cands = (r.accepted_rank, r.level_candidates) if r.width != 1 or r.accepted_rank else ((), ())
        report.requests.add(
            request_id=r.request_id,
            context_len=r.context_len,
            depth=r.depth,
            width=r.width,
            nodes=r.nodes,
            accepted=r.accepted,
            accepted_rank=ranks,
            level_candidates=cands,
            draft_confidence=r.draft_confidence,
            domain=r.domain,
            requested_depth=r.requested_depth,
            requested_width=r.requested_width,
            requested_nodes=r.requested_nodes,
            caught_up_tokens=r.caught_up_tokens,
        )
    return report


def compile_plan(plan: plan_pb2.Plan, hello: worker_pb2.Hello, current_version: int) -> DecisionTable:
    """Turn a Plan into a lookup table or raise ValueError naming the problem."""
    if plan.version <= current_version:
        raise ValueError(f"version {plan.version} is not newer than the plan in force ({current_version})")
    d = hello.drafter
    decisions = []
    for i, cell in enumerate(plan.table):
        if cell.depth > d.max_depth or cell.width > d.max_width or cell.max_nodes > d.max_tree_nodes:
            raise ValueError(
                f"table[{i}] = (depth {cell.depth}, width {cell.width}, max_nodes {cell.max_nodes}) exceeds the "
                f"drafter's limits ({d.max_depth}, {d.max_width}, {d.max_tree_nodes})"
            )
        decisions.append(Decision(cell.depth, cell.width, cell.max_nodes))
    return DecisionTable(tuple(plan.batch_size_edges), tuple(plan.context_len_edges), tuple(decisions))


class SpeculationAgent:
    """Local decisions + background telemetry/control stream for one worker."""

    def __init__(self, hello: worker_pb2.Hello, target: str, options: AgentOptions | None = None,
                 channel_credentials: grpc.ChannelCredentials | None = None, token: str | None = None) -> None:
        """``channel_credentials``: TLS (``grpc.ssl_channel_credentials``, with a client
        certificate for mutual TLS); ``token``: this worker's bearer token when the
        controller has auth on."""
        self.hello = hello
        self.target = target
        self.options = options or AgentOptions()
        self.credentials = channel_credentials
        self._call_metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._table = DecisionTable.uniform(self.options.fallback, (1,), (0,))
        self._overrides: dict[str, Decision] = {}
        self._steps: deque[StepTelemetry] = deque()
        self._finished: deque[RequestSummary] = deque()
        self._lock = threading.Lock()
        self.stats = AgentStats()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._outbox: asyncio.Queue | None = None  # the live session's, while connected
        # Step ids written on the live stream that no receipt has covered yet. A controller
        # sends one about every second, so this holds about a second of steps; bounded for one
        # that sends none (older than receipts), where a break then counts the newest it holds.
        self._unconfirmed: deque[int] = deque(maxlen=4 * self.options.queue_size)

    # ------------------------------------------------------------ hot path
    def decide(self, request_id: str, context_len: int, batch_size: int) -> Decision:
        override = self._overrides.get(request_id)
        if override is not None:
            return override
        return self._table.lookup(batch_size, context_len)

    def observe(self, step: StepTelemetry) -> None:
        with self._lock:
            if len(self._steps) >= self.options.queue_size:
                self._steps.popleft()
                self.stats.dropped_steps += 1
                self.stats.steps_dropped_total += 1
            self._steps.append(step)

    def finish(self, summary: RequestSummary) -> None:
        with self._lock:
            if len(self._finished) >= self.options.queue_size:
                self._finished.popleft()
                self.stats.finished_dropped += 1
            self._finished.append(summary)
        if summary.request_id in self._overrides:
            overrides = dict(self._overrides)
            overrides.pop(summary.request_id, None)
            self._overrides = overrides

    def roll_drafter(self, drafter: worker_pb2.Drafter) -> None:
        """Switch to a new drafter (e.g. retrained heads) without a reconnect.

        The controller learns it from a new Hello on the live stream; the steps
        observed before the roll are sent ahead of that Hello so their outcomes
        are credited to the old version. Until a plan for the new drafter
        arrives, decisions are the last plan's clamped to the new limits.
        Callable from any thread.
        """
        hello = worker_pb2.Hello()
        hello.CopyFrom(self.hello)
        hello.drafter.CopyFrom(drafter)
        d = hello.drafter
        self._table = self._table.clamped(d.max_depth, d.max_width, d.max_tree_nodes)
        self._overrides = {}
        if self._loop is None or not self._loop.is_running():
            self.hello = hello
            return
        done = threading.Event()

        def on_loop() -> None:
            # Drain under the old Hello, then switch: nothing observed before the
            # roll is reported as the new version's.
            pending = self._drain() if self._outbox is not None else []
            self.hello = hello
            if self._outbox is not None:
                for msg in pending:
                    self._outbox.put_nowait(msg)
                self._outbox.put_nowait(worker_pb2.WorkerMessage(hello=self._current_hello()))
            done.set()

        self._loop.call_soon_threadsafe(on_loop)
        done.wait(5.0)

    def _current_hello(self) -> worker_pb2.Hello:
        hello = worker_pb2.Hello()
        hello.CopyFrom(self.hello)
        hello.current_plan_version = self.stats.plan_version
        loss = hello.telemetry_loss
        loss.steps_dropped = self.stats.steps_dropped_total
        loss.steps_unconfirmed = self.stats.steps_unconfirmed
        loss.finished_dropped = self.stats.finished_dropped
        return hello

    @property
    def plan_version(self) -> int:
        return self.stats.plan_version

    @property
    def table(self) -> DecisionTable:
        return self._table

    # -------------------------------------------------------- thread usage
    def start(self) -> "SpeculationAgent":
        """Run the stream on a background thread with its own event loop."""
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            ready.set()
            self._loop.run_until_complete(self.run())
            self._loop.close()

        self._thread = threading.Thread(target=main, name=f"specctl-agent-{self.hello.worker_id}", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def close(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---------------------------------------------------------- the stream
    async def run(self) -> None:
        """Hold the stream until ``stop()``; reconnect with backoff + full jitter."""
        self._stop = asyncio.Event()
        backoff = self.options.backoff_initial_s
        first = True
        while not self._stop.is_set():
            if not first:
                self.stats.reconnects += 1
            first = False
            started = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - any failure means: reconnect
                self.stats.last_error = f"{type(err).__name__}: {err}"
                if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.ABORTED:
                    # Another stream took this worker id (a twin with the same id, or our own
                    # restart's leftover): come back slowly, or the two take the id in turns.
                    self.stats.superseded += 1
                    backoff = self.options.backoff_max_s
                    log.warning("controller %s ended worker %r's stream: %s", self.target, self.hello.worker_id,
                                err.details())
                elif isinstance(err, grpc.aio.AioRpcError) and err.code() in _REFUSED:
                    log.warning("controller %s refused worker %r: %s %s", self.target, self.hello.worker_id,
                                err.code().name, err.details())
                else:
                    log.debug("stream to %s ended: %s", self.target, self.stats.last_error)
            self.stats.connected = False
            if time.monotonic() - started > 2.0:
                backoff = self.options.backoff_initial_s  # the link was healthy: start over
            delay = random.uniform(0, backoff)
            backoff = min(backoff * 2, self.options.backoff_max_s)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def _session(self) -> None:
        if self.credentials is not None:
            channel = grpc.aio.secure_channel(self.target, self.credentials)
        else:
            channel = grpc.aio.insecure_channel(self.target)
        async with channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)
            outbox: asyncio.Queue = asyncio.Queue()
            self._outbox = outbox
            stream_up = asyncio.Event()
            call = stub.Connect(self._outbound(outbox, stream_up), metadata=self._call_metadata)
            try:
                # Telemetry stays queued until the stream is really up: steps
                # drained into a call that never connects would be lost.
                await call.wait_for_connection()
                stream_up.set()
                self.stats.connected = True
                stop_task = asyncio.create_task(self._stop.wait())
                read_task = asyncio.create_task(self._inbound(call, outbox))
                try:
                    await asyncio.wait({stop_task, read_task}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stop_task.cancel()
                    read_task.cancel()
                    call.cancel()
            finally:
                # A call the controller ended (refused, restarted) leaves the request
                # generator waiting: the sentinel ends it without draining telemetry.
                self._outbox = None
                outbox.put_nowait(_SESSION_OVER)
                stream_up.set()
                # Written, never confirmed: they may or may not have reached the controller.
                self.stats.steps_unconfirmed += len(self._unconfirmed)
                self._unconfirmed.clear()
            if read_task.done() and not read_task.cancelled() and read_task.exception():
                raise read_task.exception()

    async def _outbound(self, outbox: asyncio.Queue, stream_up: asyncio.Event):
        yield worker_pb2.WorkerMessage(hello=self._current_hello())
        await stream_up.wait()
        interval = self.options.flush_interval_s
        last_sent = time.monotonic()
        while True:
            try:
                queued = [await asyncio.wait_for(outbox.get(), timeout=interval)]
                while not outbox.empty():
                    queued.append(outbox.get_nowait())
            except asyncio.TimeoutError:
                queued = []
            if _SESSION_OVER in queued:
                return
            drained = self._drain()
            if not queued and not drained and time.monotonic() - last_sent >= self.options.heartbeat_interval_s:
                self.stats.heartbeats += 1
                drained = [worker_pb2.WorkerMessage(reports=worker_pb2.StepReports())]
            for msg in queued + drained:
                if msg.WhichOneof("payload") == "reports":
                    self._unconfirmed.extend(step.step_id for step in msg.reports.steps)
                yield msg
            if queued or drained:
                last_sent = time.monotonic()

    def _drain(self) -> list[worker_pb2.WorkerMessage]:
        with self._lock:
            steps = list(self._steps)
            finished = list(self._finished)
            self._steps.clear()
            self._finished.clear()
            dropped, self.stats.dropped_steps = self.stats.dropped_steps, 0
        out = []
        size = self.options.max_steps_per_message
        for i in range(0, len(steps), size):
            reports = worker_pb2.StepReports(steps=[step_to_proto(s) for s in steps[i : i + size]])
            if i == 0:
                reports.dropped_steps = dropped
            out.append(worker_pb2.WorkerMessage(reports=reports))
        self.stats.steps_sent += len(steps)
        for f in finished:
            out.append(worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(
                request_id=f.request_id, generated_tokens=f.generated_tokens, steps=f.steps,
                accepted_tokens=f.accepted_tokens, timestamp=f.timestamp)))
        return out

    async def _inbound(self, call, outbox: asyncio.Queue) -> None:
        async for msg in call:
            self.stats.connected = True
            kind = msg.WhichOneof("payload")
            if kind == "plan":
                outbox.put_nowait(self._apply_plan(msg.plan))
            elif kind == "request_decisions":
                outbox.put_nowait(self._apply_decisions(msg.request_decisions))
            elif kind == "receipt":
                self._confirm(msg.receipt.last_step_id)
            elif kind == "rejection":
                self.stats.rejections += 1
                r = msg.rejection
                self.stats.last_rejection = f"{plan_pb2.RejectReason.Name(r.reason)} {r.field}: {r.detail}"
                log.debug("controller rejected telemetry: %s", self.stats.last_rejection)

    def _confirm(self, last_step_id: int) -> None:
        """A receipt: the controller has read every step up to ``last_step_id``."""
        self.stats.receipts += 1
        unconfirmed = self._unconfirmed
        while unconfirmed and unconfirmed[0] <= last_step_id:
            unconfirmed.popleft()
            self.stats.steps_confirmed += 1

    def _apply_plan(self, plan: plan_pb2.Plan) -> worker_pb2.WorkerMessage:
        try:
            table = compile_plan(plan, self.hello, self.stats.plan_version)
        except ValueError as err:
            self.stats.nacks_sent += 1
            return worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=plan.version, nonce=plan.nonce,
                                                                  reason=str(err)))
        self._table = table
        self.stats.plan_version = plan.version
        self.stats.plans_applied += 1
        return worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=plan.version, nonce=plan.nonce))

    def _apply_decisions(self, msg: plan_pb2.RequestDecisions) -> worker_pb2.WorkerMessage:
        d = self.hello.drafter
        overrides = dict(self._overrides)
        try:
            for i, rd in enumerate(msg.decisions):
                cell = rd.decision
                if cell.depth > d.max_depth or cell.width > d.max_width or cell.max_nodes > d.max_tree_nodes:
                    raise ValueError(f"decisions[{i}] for {rd.request_id!r} exceeds the drafter's limits")
                overrides[rd.request_id] = Decision(cell.depth, cell.width, cell.max_nodes)
        except ValueError as err:
            self.stats.nacks_sent += 1
            return worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=msg.version, nonce=msg.nonce,
                                                                  reason=str(err)))
        for rid in msg.cleared:
            overrides.pop(rid, None)
        self._overrides = overrides
        self.stats.decisions_applied += 1
        return worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=msg.version, nonce=msg.nonce))
