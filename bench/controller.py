"""``specctl bench controller``: how much telemetry the real controller takes
over real gRPC, how fast its plans reach the workers, and what a bare gRPC
stream takes on the same machine with the same load.

Processes (``multiprocessing`` spawn; every one is stopped in ``finally``):

- the **server**: first a bare grpc.aio echo server (``bench.echo``: parses
  every ``WorkerMessage`` and counts steps — the floor), then the real
  controller (``controller.server.start_server``, default config, goodput
  policy, a free loopback port). Only one runs at a time, so neither competes
  with the other for CPU. The controller child times its own sections
  (``ingest``, ``plan_updates`` / ``run_policy``, ``status``) and samples its
  CPU time and event-loop lag; ``SPECCTL_BENCH_PROFILE=1`` also runs cProfile
  in it (``controller.prof`` + ``controller_profile.txt`` next to the JSON;
  numbers of a profiled run are slowed by the profiler).
- the **load generators**: ``workers`` simulated workers spread over
  ``generators`` processes (default one per 32 workers, ``WORKERS_PER_GENERATOR``),
  each a grpc.aio event loop with its workers' streams on one channel per 32
  streams. The processes start their load on one common wall-clock schedule;
  the first one opens and closes the measured window. Each sends Hello, then every
  flush interval of the real agent a ``StepReports`` with the steps due at ``steps_per_s``
  (≈8 requests per step, chain depth 3, per-request context lengths that grow
  as tokens are generated, request ids that rotate with a ``RequestFinished``
  when a request ends). Messages are wire-encoded by hand from per-request
  byte templates so the generator stays cheap, and the workers' flush ticks
  sit on a ``TICK_GRID_S`` grid (shifted per generator) so the workers of one
  slot wake their process once. Like the real agent, a worker
  whose writes block queues at most 4096 steps (oldest dropped) and sends at
  most 64 per message. Every Plan / RequestDecisions is ACKed at once.
- the **parent**: runs the phases, shows progress, times
  ``SpeculationAgent.decide`` and writes ``controller.json`` + ``controller.png``.

Measurements:

- ``steps_per_s_ingested``: Δ Σ ``steps_ingested`` between two GetStatus
  calls, divided by the time between the two snapshots. The snapshot time is
  the newest ``last_report_at`` in each answer (the controller's own clock,
  the same machine clock as ours), so a slow GetStatus does not bend the
  window; it falls back to the midpoints of the two calls.
- ``steps_per_s_offered``: steps whose write the generator completed in that
  same window (interpolated from its 50 ms send log).
- ``bare_grpc_msgs_per_s``: the same measurement against the echo server,
  same generator, same offered load and batching (steps per second).
- ``plan_push_ms_p50/p99``: client side, for every Plan created in the
  window: receive time at the worker − ``Plan.created_at`` (the moment the
  controller built it). It excludes the ACK trip and includes the
  controller's push decision, its send queue, the wait for the stream's
  previous write to complete, gRPC, and the generator's own scheduling
  delay (kept small by the few workers per generator: with all 256 on one
  loop, a plan's receipt waited behind the other workers' encoding and
  sends, time a real worker never spends). ``PlanDesk.updates`` stamps
  ``created_at`` once the policy ran and its table was judged worth
  sending (the hysteresis), so the policy's own compute
  (``run_policy_ms_mean``) is not part of it, but every other policy run
  and ingest batch the loop does before the plan's bytes leave is.
  ``plan_handoff_ms_p50/p99``: the controller's own part of it, server side
  for the plans gRPC took in the window: from ``created_at`` to the moment
  the stream's writer handed the plan to gRPC
  (``Controller.plan_handoffs``); the difference is gRPC,
  the loopback and the generator's wake-up on a machine whose cores the
  controller and the generators share.
  RequestDecisions carry no timestamp; the controller's send→ACK round trip
  (``PlanLedger.plan_push_ms``, both kinds) is reported as
  ``plan_ack_rtt_ms_p50/p99``.
- ``controller_reads_yielded_to_plans``: stream reads that let a queued
  plan's writer go first (``SpeculationControllerServicer.reads_yielded``).
- ``controller_gc``: the controller process's garbage collections during
  its phase per generation (count, total and longest ms), collections held
  while a plan was on its way (``gc.hold_during_plan_push``), objects frozen
  (``gc.freeze_after_start``); ``controller.server_gc_share``: share of the
  window the collector stopped the loop. ``SPECCTL_BENCH_CONFIG=FILE`` runs
  the controller with that config file (e.g. other ``gc:`` settings).
- ``controller_plans_deferred``: rotation turns the controller put off
  because the worker's stream was still writing its previous message
  (``SpeculationControllerServicer.plans_deferred``; such a worker is planned
  once that write completes).
- ``agent_decide_us_median``: ``SpeculationAgent.decide`` with a plan from
  the real goodput policy installed through the agent's compile path, median
  over 20 batches of 10 000 calls.
- ``agent_decide_classes_us_median``: the same with request classes (issue
  #29): the goodput policy under a ``classes:`` section of three classes
  (interactive with a TPOT target, batch, bulk with typical acceptance),
  every call naming a class (1 % a name the plan does not know), so each
  lookup first picks its class's table.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import json
import math
import multiprocessing as mp
import os
import pstats
import random
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import grpc

from bench.echo import SERVICE, Sampler, echo_child, peak_rss_mb, wait_for_stop
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2
from worker.sdk.agent import AgentOptions

CONNECT = f"/{SERVICE}/Connect"
GET_STATUS = f"/{SERVICE}/GetStatus"
FLUSH_S = AgentOptions().flush_interval_s  # telemetry batching period, as the real agent
MAX_STEPS_PER_MESSAGE = 64  # as AgentOptions.max_steps_per_message
QUEUE_STEPS = 4096  # as AgentOptions.queue_size
STREAMS_PER_CHANNEL = 32
# Simulated workers per load-generator process. Plan receipt is stamped by the
# generator's event loop, which also encodes its workers' telemetry: with all
# 256 workers on one loop a plan waited there behind the other workers'
# sends (tens of ms on a busy machine), time a real worker's agent never spends.
WORKERS_PER_GENERATOR = 32
# Flush ticks of one generator's workers are rounded to this grid (each generator's
# grid shifted by shard / shards of it, so the fleet's ticks still spread over the
# interval): the workers on one slot wake the process once. One wake-up per worker
# tick cost the generator about as much CPU again as all else it does per step.
TICK_GRID_S = 0.020
CHAIN_DEPTH = 3
ALPHA = 0.75  # per-position chain acceptance of the simulated drafter
STATUS_TIMEOUT_S = 15.0
READY_TIMEOUT_S = 90.0

GOAL_WORKERS = 256
GOAL_STEPS_PER_S = 50.0
GOAL_PUSH_P99_MS = 5.0
GOAL_INGEST_VS_BARE = 0.5
GOAL_DECIDE_US = 10.0
SUSTAINED = 0.95  # ingested / target that counts as keeping up

JSON_KEYS = ("workers", "steps_per_s_offered", "steps_per_s_ingested", "plan_push_ms_p50", "plan_push_ms_p99",
             "bare_grpc_msgs_per_s", "ingest_vs_bare_ratio", "agent_decide_us_median")


class BenchError(RuntimeError):
    pass


def default_generators(workers: int) -> int:
    """Load-generator processes for ``workers`` simulated workers.

    >>> default_generators(256), default_generators(8), default_generators(33)
    (8, 1, 2)
    """
    return max(1, math.ceil(workers / WORKERS_PER_GENERATOR))


# ------------------------------------------------------------ wire encoding
# WorkerMessage { reports(2): StepReports { steps(1): StepReport {...} } }, encoded by hand.

def varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]
_STEP_TAIL = struct.Struct("<BdBBBdBd")  # timestamp(2) batch_size(3) draft_ms(4) verify_ms(5)
# RequestStep fields after context_len: depth(3)=3 width(4)=1 nodes(5)=3 [accepted(6)].
_CHAIN_TAIL = [bytes((0x18, CHAIN_DEPTH, 0x20, 1, 0x28, CHAIN_DEPTH)) + (bytes((0x30, a)) if a else b"")
               for a in range(CHAIN_DEPTH + 1)]
# StepReport.requests(6) tag + length for a RequestStep of n bytes (every one is well under 256).
_REQUEST_HEAD = [b"\x32" + (_SMALL[n] if n < 0x80 else bytes((n & 0x7F | 0x80, n >> 7))) for n in range(256)]
_CTX_FIELDS_BELOW = 1 << 16  # context lengths with a pre-encoded field (the bench's reach ~43k)
_ctx_fields: list[bytes] = []


def context_fields() -> list[bytes]:
    """``context_len``(2) field bytes for every context length below 65,536, built once per process:
    a list lookup instead of a varint encoding per request-step."""
    if not _ctx_fields:
        _ctx_fields.extend(b"\x10" + varint(n) for n in range(_CTX_FIELDS_BELOW))
    return _ctx_fields


def field_bytes(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: tag byte, varint length, payload."""
    return _SMALL[tag] + varint(len(payload)) + payload


def bench_hello(worker_id: str) -> worker_pb2.Hello:
    """Same content as ``tests.support.make_hello`` (EAGLE chain drafter, depth ≤ 6, H100 hints)."""
    return worker_pb2.Hello(
        worker_id=worker_id,
        engine="specctl-bench",
        model="llama-3-8b",
        hardware=worker_pb2.Hardware(accelerator="H100-SXM", count=1, memory_bandwidth_gb_s=3350,
                                     peak_tflops=989, weight_bytes=16e9, kv_bytes_per_token=131072, params=8e9),
        drafter=worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_EAGLE, version="v1", max_depth=6, max_width=1,
                                   max_tree_nodes=6, trained_context_len=8192),
        max_batch_size=256,
    )


class WireLoadWorker:
    """One load-generating worker: its telemetry produced at a fixed rate and
    wire-encoded by hand for a raw gRPC stream (not the simulator's
    ``worker.sim.worker.SimWorker``, which models an engine and its acceptance).

    ``tick_grid_s``: the worker's flush ticks (offset in ``[0, FLUSH_S)``,
    drawn per worker) are rounded down to this grid, shifted by
    ``grid_phase_s``; the workers of one generator process that share a grid
    slot then wake its event loop once, not once each (a wake-up with its
    timer, its task switches and its gRPC write completions cost the process
    more than encoding the steps). 0: no grid, the drawn offset as is.
    """

    def __init__(self, index: int, steps_per_s: float, seed: int, tick_grid_s: float = 0.0,
                 grid_phase_s: float = 0.0) -> None:
        self.rng = random.Random(seed * 100_003 + index)
        self.worker_id = f"bench-w{index:04d}"
        self.hello_bytes = worker_pb2.WorkerMessage(hello=bench_hello(self.worker_id)).SerializeToString()
        self.rate = steps_per_s
        self.batch = 6 + index % 5  # 6..10 requests per step, mean 8
        drawn = self.rng.random() * FLUSH_S  # stagger the ticks
        self.offset = (grid_phase_s + tick_grid_s * math.floor(drawn / tick_grid_s)) if tick_grid_s > 0 else drawn
        # τ for a chain of depth 3 with per-position acceptance ALPHA, as a cycle (prime length).
        self.acc = [self._accepted() for _ in range(1009)]
        # The cycle with its first batch repeated: one step's draws are one slice, never wrapped.
        self.acc_ext = self.acc + self.acc[:self.batch]
        self.acc_i = 0
        self.step_id = 0
        self.next_request = 0
        self.slots = [self._new_request() for _ in range(self.batch)]
        self.produced = 0
        self.sent = 0
        self.dropped = 0
        self.dropped_unreported = 0
        self.ctx_fields = context_fields()

    def _accepted(self) -> int:
        a = 0
        while a < CHAIN_DEPTH and self.rng.random() < ALPHA:
            a += 1
        return a

    def _new_request(self) -> list:
        rid = f"{self.worker_id}-r{self.next_request}"
        self.next_request += 1
        ctx = int(math.exp(self.rng.uniform(math.log(200), math.log(40_000))))
        lifetime = self.rng.randint(64, 512)
        # [id field bytes, id, context_len, steps left, context_len at the start, step id before its first step].
        # Tokens generated = context growth, steps = step ids since birth, accepted = generated - steps.
        return [field_bytes(0x0A, rid.encode()), rid, ctx, lifetime, ctx, self.step_id]

    def encode_step(self, timestamp: float, finished: list[bytes]) -> bytes:
        self.step_id = step_id = self.step_id + 1
        b = self.batch
        i = self.acc_i
        accepted = self.acc_ext[i:i + b]
        n = len(self.acc)
        self.acc_i = i + b - n if i + b >= n else i + b
        ctx_fields, heads, tails = self.ctx_fields, _REQUEST_HEAD, _CHAIN_TAIL
        parts = []
        append = parts.append
        kv = 0
        ended = []
        for s, a in zip(self.slots, accepted):
            ctx = s[2]
            kv += ctx
            body = s[0] + (ctx_fields[ctx] if ctx < _CTX_FIELDS_BELOW else b"\x10" + varint(ctx)) + tails[a]
            append(heads[len(body)])
            append(body)
            s[2] = ctx + a + 1
            s[3] -= 1
            if s[3] <= 0:
                ended.append(s)
        if ended:
            slots = self.slots
            for s in ended:  # in slot order, as the old per-slot loop drew the new requests
                generated, steps = s[2] - s[4], step_id - s[5]
                finished.append(worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(
                    request_id=s[1], generated_tokens=generated, steps=steps, accepted_tokens=generated - steps,
                    timestamp=timestamp)).SerializeToString())
                slots[next(k for k, x in enumerate(slots) if x is s)] = self._new_request()
        verify_ms = max(10.0 + 2.5e-5 * kv, 0.06 * b * (1 + CHAIN_DEPTH))
        draft_ms = 0.3 + 0.4 * CHAIN_DEPTH + 0.002 * CHAIN_DEPTH * b
        return (b"\x08" + varint(step_id) + _STEP_TAIL.pack(0x11, timestamp, 0x18, b, 0x21, draft_ms, 0x29, verify_ms)
                + b"".join(parts))

    def due_messages(self, elapsed_s: float, timestamp: float) -> tuple[list[bytes], int]:
        """Messages for the steps produced by now (≤ 64 steps each); steps beyond
        a 4096-step backlog are dropped and reported, as the agent does."""
        self.produced = int(elapsed_s * self.rate)
        backlog = self.produced - self.sent - self.dropped
        if backlog > QUEUE_STEPS:
            self.dropped += backlog - QUEUE_STEPS
            self.dropped_unreported += backlog - QUEUE_STEPS
            backlog = QUEUE_STEPS
        if backlog <= 0:
            return [], 0
        out: list[bytes] = []
        finished: list[bytes] = []
        left = backlog
        while left > 0:
            chunk = min(left, MAX_STEPS_PER_MESSAGE)
            body = b"".join(field_bytes(0x0A, self.encode_step(timestamp, finished)) for _ in range(chunk))
            if self.dropped_unreported:
                body += b"\x10" + varint(self.dropped_unreported)
                self.dropped_unreported = 0
            out.append(field_bytes(0x12, body))
            left -= chunk
        out.extend(finished)
        return out, backlog


# ---------------------------------------------------------- load generator

@dataclass
class PhaseConfig:
    """One phase for one load-generator process: its share of the workers
    (indices ``shard``, ``shard + shards``, ...) against ``target``."""

    name: str
    target: str
    workers: int
    steps_per_s: float
    warmup_s: float
    duration_s: float
    seed: int = 0
    shard: int = 0
    shards: int = 1
    tick_grid_s: float = TICK_GRID_S

    @property
    def indices(self) -> range:
        return range(self.shard, self.workers, self.shards)

    @property
    def measures(self) -> bool:
        """The first generator opens and closes the measured window (GetStatus at both edges)."""
        return self.shard == 0

    @property
    def grid_phase_s(self) -> float:
        """This generator's shift of the tick grid: the generators' slots interleave."""
        return self.tick_grid_s * self.shard / self.shards

    @property
    def channels(self) -> int:
        return max(1, min(16, math.ceil(len(self.indices) / STREAMS_PER_CHANNEL)))


@dataclass
class GenStats:
    sent_steps: int = 0
    sent_messages: int = 0
    finished_sent: int = 0
    plans: int = 0
    request_decisions: int = 0
    rejections: int = 0
    receipts: int = 0  # TelemetryReceipts (no answer needed)
    last_rejection: str = ""
    acks_sent: int = 0
    stream_errors: int = 0
    last_error: str = ""
    error_times: list = None  # wall times of stream errors

    def __post_init__(self) -> None:
        self.error_times = []


async def _status(get_status) -> dict:
    t0 = time.time()
    data = await get_status(controller_pb2.GetStatusRequest().SerializeToString(), timeout=STATUS_TIMEOUT_S)
    t1 = time.time()
    resp = controller_pb2.GetStatusResponse.FromString(data)
    steps = sum(w.steps_ingested for w in resp.workers)
    last = max((w.last_report_at for w in resp.workers), default=0.0)
    return {"sent_at": t0, "received_at": t1, "rpc_ms": (t1 - t0) * 1000.0, "steps": steps, "last_report_at": last,
            "workers": len(resp.workers), "connected": sum(w.connected for w in resp.workers)}


async def _status_safe(get_status) -> dict:
    try:
        return await _status(get_status)
    except grpc.aio.AioRpcError as err:
        return {"error": f"{err.code().name}: {err.details()}"}


def _result_or_error(task: asyncio.Task) -> dict:
    if not task.done():
        task.cancel()
        return {"error": f"no answer within {STATUS_TIMEOUT_S:.0f} s"}
    return task.result()


async def _worker(w: WireLoadWorker, call, st: GenStats, plans: list, load_t0: float, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    lock = asyncio.Lock()

    async def read() -> None:
        while True:
            data = await call.read()
            if data is grpc.aio.EOF:
                return
            now = time.time()
            msg = plan_pb2.ControllerMessage.FromString(data)
            kind = msg.WhichOneof("payload")
            if kind == "plan":
                st.plans += 1
                plans.append((msg.plan.created_at, now))
                ack = worker_pb2.Ack(version=msg.plan.version, nonce=msg.plan.nonce)
            elif kind == "request_decisions":
                st.request_decisions += 1
                ack = worker_pb2.Ack(version=msg.request_decisions.version, nonce=msg.request_decisions.nonce)
            elif kind == "receipt":
                st.receipts += 1
                continue
            else:
                st.rejections += 1
                r = msg.rejection
                st.last_rejection = f"{plan_pb2.RejectReason.Name(r.reason)} {r.field}: {r.detail}"
                continue
            async with lock:
                await call.write(worker_pb2.WorkerMessage(ack=ack).SerializeToString())
            st.acks_sent += 1

    reader = asyncio.create_task(read())
    try:
        await call.write(w.hello_bytes)
        next_tick = load_t0 + w.offset
        while not stop.is_set():
            delay = next_tick - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_tick += FLUSH_S
            now = loop.time()
            if next_tick < now:  # fell behind: no burst of ticks, the backlog carries the steps; same grid slot
                next_tick += FLUSH_S * math.ceil((now - next_tick) / FLUSH_S)
            msgs, n = w.due_messages(now - load_t0, time.time())
            if not msgs:
                continue
            async with lock:
                for m in msgs:
                    await call.write(m)
            w.sent += n
            st.sent_steps += n
            st.sent_messages += len(msgs)
            st.finished_sent += sum(m[0] == 0x1A for m in msgs)  # WorkerMessage.finished (field 3)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - counted and reported; the stream is over
        st.stream_errors += 1
        st.error_times.append(time.time())
        st.last_error = f"{type(err).__name__}: {err}"[:300]
    finally:
        reader.cancel()
        call.cancel()


async def run_phase(cfg: PhaseConfig, report: Callable[[dict], None],
                    start: Callable[[], Any] | None = None, stopped: Callable[[], Any] | None = None) -> dict:
    """Drive this generator's share of ``cfg.workers`` streams against ``cfg.target``; return the measurements.

    ``start``: awaited once the channels are connected; it returns the wall
    time (``time.time()``) at which every generator process starts its load,
    so that several processes share one schedule. ``stopped``: awaited by a
    generator that does not measure the window (``cfg.measures`` false) to
    learn when to stop; without it that generator stops at the window's end.
    """
    loop = asyncio.get_running_loop()
    options = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
    channels = [grpc.aio.insecure_channel(cfg.target, options=options) for _ in range(cfg.channels)]
    status_channel = grpc.aio.insecure_channel(cfg.target, options=options) if cfg.measures else None
    st = GenStats()
    plans: list[tuple[float, float]] = []
    send_log: list[tuple[float, int, float]] = []  # (wall time, cumulative steps sent, process CPU s)
    lags: list[float] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    workers: list[WireLoadWorker] = []
    wall_t0 = time.time()
    result: dict[str, Any] = {"phase": cfg.name}
    every = channels + ([status_channel] if status_channel is not None else [])
    try:
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in every)), 30)
        workers = [WireLoadWorker(i, cfg.steps_per_s, cfg.seed, cfg.tick_grid_s, cfg.grid_phase_s) for i in cfg.indices]
        connects = [ch.stream_stream(CONNECT) for ch in channels]
        start_wall = await start() if start is not None else time.time()
        load_t0 = loop.time() + max(0.0, start_wall - time.time())
        wall_t0 = max(start_wall, time.time())
        for i, w in enumerate(workers):
            call = connects[i % len(connects)]()
            tasks.append(asyncio.create_task(_worker(w, call, st, plans, load_t0, stop)))

        async def log_sends() -> None:
            while True:
                due = loop.time() + 0.05
                send_log.append((time.time(), st.sent_steps, time.process_time()))
                await asyncio.sleep(0.05)
                lags.append(max(0.0, (loop.time() - due) * 1000.0))

        async def progress() -> None:
            while True:
                report({"phase": cfg.name, "elapsed": time.time() - wall_t0, "sent": st.sent_steps,
                        "plans": st.plans})
                await asyncio.sleep(0.25)

        tasks.append(asyncio.create_task(log_sends()))
        tasks.append(asyncio.create_task(progress()))
        if not cfg.measures:
            if stopped is not None:
                await stopped()
            else:
                await asyncio.sleep(max(0.0, load_t0 + cfg.warmup_s + cfg.duration_s - loop.time()))
        else:
            # The window is on the generator's clock; the GetStatus calls run beside
            # the load (an overloaded controller may answer late, or not at all).
            get_status = status_channel.unary_unary(GET_STATUS)
            await asyncio.sleep(max(0.0, load_t0 + cfg.warmup_s - loop.time()))
            result["window_wall"] = [time.time()]
            before = asyncio.create_task(_status_safe(get_status))
            await asyncio.sleep(max(0.0, load_t0 + cfg.warmup_s + cfg.duration_s - loop.time()))
            result["window_wall"].append(time.time())
            after = asyncio.create_task(_status_safe(get_status))
            await asyncio.wait([before, after], timeout=STATUS_TIMEOUT_S)  # the load goes on meanwhile
            result.update(before=_result_or_error(before), after=_result_or_error(after))
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in every:
            await ch.close(grace=None)
    send_log.append((time.time(), st.sent_steps, time.process_time()))
    result.update(asdict(st), plans_created_received=plans, send_log=send_log, loop_lag_ms=lags,
                  channels=cfg.channels, wall_t0=wall_t0,
                  dropped_steps=sum(w.dropped for w in workers), produced_steps=sum(w.produced for w in workers))
    return result


def merge_generator_results(results: list[dict]) -> dict:
    """One phase result from each generator process's (the first one measured the window).

    Counters add up, plans and lag samples are pooled, and the send logs
    (cumulative steps sent and process CPU seconds) are summed on the first
    generator's 50 ms grid, so the phase reads like one generator's.

    >>> a = {"sent_steps": 10, "plans_created_received": [(1.0, 1.001)], "loop_lag_ms": [0.5],
    ...      "send_log": [(0.0, 0, 0.0), (1.0, 10, 0.1)], "error_times": [], "last_error": "",
    ...      "last_rejection": "", "channels": 1, "wall_t0": 0.0, "window_wall": [0.2, 0.8]}
    >>> b = dict(a, sent_steps=20, send_log=[(0.0, 0, 0.0), (0.5, 5, 0.1), (2.0, 20, 0.4)],
    ...          plans_created_received=[(1.5, 1.502)])
    >>> del b["window_wall"]
    >>> m = merge_generator_results([a, b])
    >>> m["sent_steps"], m["generators"], len(m["plans_created_received"]), m["window_wall"]
    (30, 2, 2, [0.2, 0.8])
    >>> m["send_log"][-1]  # at t = 1.0: 10 + 10 steps (b interpolated), 0.1 + 0.2 CPU s
    (1.0, 20.0, 0.3)
    """
    first = results[0]
    merged = dict(first)
    for key, value in first.items():
        if isinstance(value, int) and not isinstance(value, bool):
            merged[key] = sum(r.get(key, 0) for r in results)
    for key in ("plans_created_received", "loop_lag_ms", "error_times"):
        merged[key] = [x for r in results for x in r.get(key, [])]
    merged["error_times"].sort()
    for key in ("last_error", "last_rejection"):
        merged[key] = next((r[key] for r in results if r.get(key)), "")
    merged["send_log"] = [(t, sum(_interp(r["send_log"], t, 1) for r in results),
                           round(sum(_interp(r["send_log"], t, 2) for r in results), 9))
                          for t, _, _ in first["send_log"]]
    merged["generators"] = len(results)
    return merged


async def _recv(conn) -> tuple[str, Any]:
    """The next message from the parent, read without blocking the event loop."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(conn.fileno(), ready.set)
    try:
        while not conn.poll():
            await ready.wait()
            ready.clear()
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


def generator_child(conn) -> None:
    """``multiprocessing`` target: run phases on command until told to stop.

    Per phase: ``("run", cfg)`` in, ``("armed", None)`` out once connected,
    ``("go", start_wall)`` in, progress out, and for a generator that does
    not measure the window ``("stop", None)`` in; then ``("result", ...)`` out."""
    try:
        while True:
            cmd, payload = conn.recv()
            if cmd != "run":
                break
            cfg = PhaseConfig(**payload)
            deadline = READY_TIMEOUT_S + cfg.warmup_s + cfg.duration_s + 2 * STATUS_TIMEOUT_S + 60.0

            async def start() -> float:
                conn.send(("armed", None))
                kind, start_wall = await _recv(conn)
                if kind != "go":
                    raise BenchError(f"expected go, got {kind!r}")
                return start_wall

            async def stopped() -> None:
                await _recv(conn)

            try:
                result = asyncio.run(asyncio.wait_for(
                    run_phase(cfg, lambda p: conn.send(("progress", p)), start, stopped), deadline))
            except Exception as err:  # noqa: BLE001 - reported to the parent
                conn.send(("error", f"load generator {cfg.shard}, phase {cfg.name}: {type(err).__name__}: {err}"))
                continue
            conn.send(("result", result))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        conn.close()


# ------------------------------------------------------- controller child

class SectionTimers:
    """Wraps the controller's entry points on the instance and sums their CPU time."""

    SECTIONS = ("ingest", "plan_updates", "run_policy", "status", "ack", "finished")

    def __init__(self, ctl) -> None:
        self.seconds = {k: 0.0 for k in self.SECTIONS}
        self.calls = {k: 0 for k in self.SECTIONS}
        self.ack_rtt: list[tuple[float, float]] = []  # (wall time, send→ACK ms)
        for name in self.SECTIONS:
            # The policy runs inside the plan desk (plan_updates and Decide both call it there).
            owner = ctl.plans if name == "run_policy" else ctl
            setattr(owner, name, self._wrap(name, getattr(owner, name)))
        inner_ack = ctl.ack

        def ack(state, msg):
            rejection = inner_ack(state, msg)
            if rejection is None and state.plans.plan_push_ms:
                self.ack_rtt.append((time.time(), state.plans.plan_push_ms[-1]))
            return rejection

        ctl.ack = ack

    def _wrap(self, name: str, fn):
        # perf_counter, not thread_time: thread CPU time is a syscall (~8 µs
        # here) and would itself become a visible share of a 30 µs ingest.
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - t
                calls[name] += 1

        return timed

    def snapshot(self) -> dict:
        out = {f"s_{k}": v for k, v in self.seconds.items()}
        out.update({f"n_{k}": v for k, v in self.calls.items()})
        return out


def bench_server_config(config_path: str | None = None):
    """The controller phase's config: the defaults (or the file ``config_path``,
    e.g. to compare ``gc:`` settings), a free loopback port, and a drift store of
    its own: nothing learned by another run on this folder comes back."""
    from controller.config import ServerConfig, StoreSettings, load_config

    base = load_config(config_path) if config_path else ServerConfig()
    return base.model_copy(update={"listen": "127.0.0.1:0", "store": StoreSettings(path="")})


def _gc_counters() -> dict:
    from controller.observe.metrics_gc import gc_pauses

    snap = gc_pauses().snapshot()
    return {"gc_s": sum(snap["seconds"]), "gc_full": snap["collections"][2]}


async def _controller_main(conn, profile_dir: str | None, config_path: str | None = None) -> None:
    from controller.observe.metrics_gc import gc_pauses
    from controller.server import start_server

    # The child is the controller's own process: the config's gc section applies to it, as in specctl serve.
    running = await start_server(bench_server_config(config_path), "127.0.0.1:0", tune_gc=True)
    gc_at_ready = gc_pauses().snapshot()
    loop_errors: list[str] = []

    def on_loop_error(loop, context) -> None:
        exc = context.get("exception")
        loop_errors.append(f"{context.get('message')}: {type(exc).__name__}: {exc}"[:500])

    asyncio.get_running_loop().set_exception_handler(on_loop_error)
    ctl = running.controller
    timers = SectionTimers(ctl)
    workers = ctl.workers
    sampler = Sampler(lambda: {"steps": sum(s.steps_ingested for s in workers.values()), **timers.snapshot(),
                               **_gc_counters()})
    sampler_task = asyncio.create_task(sampler.run())
    profiler = cProfile.Profile() if profile_dir else None
    conn.send(("ready", running.port))
    if profiler is not None:
        profiler.enable()
    open_streams, queue_dropped, plans_deferred, reads_yielded, drift = 0, 0, 0, 0, None
    try:
        await wait_for_stop(conn)
        plans_deferred = running.servicer.plans_deferred
        reads_yielded = running.servicer.reads_yielded
        open_streams = len(running.servicer.streams)
        queue_dropped = sum(s.dropped for s in running.servicer.streams.values())
        drift = running.alerting.stats() if running.alerting is not None else None
    finally:
        if profiler is not None:
            profiler.disable()
        sampler_task.cancel()
        sampler.sample(0.0)
        gc_at_stop = gc_pauses().snapshot()
        await running.stop(0)
    stats = {"samples": sampler.samples, "peak_rss_mb": peak_rss_mb(), "ack_rtt": timers.ack_rtt,
             "policy": ctl.policy.name, "rejections": {int(k): v for k, v in ctl.rejections.items()},
             "workers": len(workers), "steps": sum(s.steps_ingested for s in workers.values()),
             "send_queue_dropped": queue_dropped, "plans_deferred": plans_deferred,
             "reads_yielded": reads_yielded, "plan_handoffs": list(ctl.plan_handoffs),
             "gc": _gc_summary(gc_at_ready, gc_at_stop),
             "open_streams_at_stop": open_streams, "loop_errors": loop_errors[:20],
             "loop_error_count": len(loop_errors), "drift_monitor": drift}
    if profiler is not None:
        path = Path(profile_dir)
        profiler.dump_stats(str(path / "controller.prof"))
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        (path / "controller_profile.txt").write_text(text.getvalue())
        stats["profile"] = str(path / "controller_profile.txt")
    conn.send(("stats", stats))


def _gc_summary(before: dict, after: dict) -> dict:
    """Collections per generation between two ``GcPauses.snapshot()``s: count, total and longest ms
    (the longest over the process's life), the held collections and the settings in force."""
    return {"collections": [a - b for a, b in zip(after["collections"], before["collections"])],
            "total_ms": [(a - b) * 1000.0 for a, b in zip(after["seconds"], before["seconds"])],
            "longest_ms": [x * 1000.0 for x in after["longest_s"]], "holds": after["holds"] - before["holds"],
            "frozen_objects": after["frozen"], "thresholds": after["thresholds"]}


def controller_child(conn, profile_dir: str | None = None, config_path: str | None = None) -> None:
    """``multiprocessing`` target: the real controller until the parent says stop."""
    try:
        asyncio.run(_controller_main(conn, profile_dir, config_path))
    except Exception as err:  # noqa: BLE001 - reported, then exit non-zero
        try:
            conn.send(("error", f"controller: {type(err).__name__}: {err}"))
        except OSError:
            pass
        raise
    finally:
        conn.close()


# ------------------------------------------------------------ decide bench

BENCH_CLASSES = {
    "interactive": {"weight": 4, "tpot_target_ms": 30, "tpot_quantile": "p99"},
    "batch": {"weight": 1},
    "bulk": {"weight": 1, "acceptance": "typical"},
}
# Shares of decide() calls per class name ("" = none given; "nope" is unknown to the plan).
BENCH_CLASS_MIX = (("interactive", 0.45), ("batch", 0.40), ("bulk", 0.09), ("", 0.05), ("nope", 0.01))


def bench_agent_decide(batches: int = 20, calls: int = 10_000, seed: int = 0, classes: bool = False) -> list[float]:
    """µs per ``SpeculationAgent.decide`` call, one value per batch of ``calls``.

    The plan is what the real goodput policy pushes to a fresh worker,
    installed through the agent's own apply path (``compile_plan``); 5 % of
    the request ids carry a per-request override, as the policy's probes do.
    ``classes``: the policy has :data:`BENCH_CLASSES` and each call names a
    class drawn from :data:`BENCH_CLASS_MIX`.
    """
    from controller.config import ServerConfig
    from controller.core import Controller
    from policies.presets import load_preset
    from worker.sdk.agent import SpeculationAgent, compile_plan

    hello = bench_hello("decide-bench")
    policy = load_preset("goodput", {"classes": BENCH_CLASSES, "default_class": "batch"} if classes else None)
    ctl = Controller(ServerConfig(), policy)
    updates = ctl.plan_updates(ctl.hello(hello), force=True)
    plan = next(u for u in updates if isinstance(u, plan_pb2.Plan))
    compile_plan(plan, hello, 0)  # raises if the plan does not compile
    agent = SpeculationAgent(hello, "127.0.0.1:1")  # never started: no network
    if agent._apply_plan(plan).WhichOneof("payload") != "ack":
        raise BenchError("the agent refused the goodput plan")
    if classes and set(agent.classes) != set(BENCH_CLASSES):
        raise BenchError(f"the plan's classes are {agent.classes}, expected {sorted(BENCH_CLASSES)}")
    rng = random.Random(seed)
    rids = [f"req-{i}" for i in range(256)]
    overridden = rids[::20]
    msg = plan_pb2.RequestDecisions(version=plan.version + 1, nonce="bench", decisions=[
        plan_pb2.RequestDecision(request_id=r, decision=plan_pb2.Decision(depth=2, width=1, max_nodes=2),
                                 reason="explore") for r in overridden])
    if agent._apply_decisions(msg).WhichOneof("payload") != "ack":
        raise BenchError("the agent refused the request decisions")
    names, weights = zip(*BENCH_CLASS_MIX)
    inputs = [(rng.choice(rids), int(math.exp(rng.uniform(math.log(50), math.log(200_000)))), rng.randint(1, 256),
               rng.choices(names, weights)[0]) for _ in range(calls)]
    decide = agent.decide
    out = []
    for _ in range(batches):
        t = time.perf_counter()
        if classes:
            for rid, ctx, batch, name in inputs:
                decide(rid, ctx, batch, name)
        else:
            for rid, ctx, batch, _ in inputs:
                decide(rid, ctx, batch)
        out.append((time.perf_counter() - t) / calls * 1e6)
    return out


# ---------------------------------------------------------------- analysis

def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _interp(log: list[tuple], t: float, col: int) -> float:
    """Linear interpolation of column ``col`` of a time-ordered log at time ``t``."""
    if not log:
        return 0.0
    if t <= log[0][0]:
        return float(log[0][col])
    for a, b in zip(log, log[1:]):
        if a[0] <= t <= b[0]:
            if b[0] == a[0]:
                return float(b[col])
            return a[col] + (b[col] - a[col]) * (t - a[0]) / (b[0] - a[0])
    return float(log[-1][col])


def _sample_window(samples: list[dict], t0: float, t1: float, key: str) -> float | None:
    rows = [(s["t"], s[key]) for s in samples if key in s]
    if len(rows) < 2 or t1 <= t0:
        return None
    return (_interp(rows, t1, 1) - _interp(rows, t0, 1)) / (t1 - t0)


def _status_note(s: dict) -> str:
    return s["error"] if "error" in s else f"answered after {s['rpc_ms'] / 1000:.1f} s"


def summarize_phase(res: dict, server: dict) -> dict:
    before, after = res["before"], res["after"]
    samples = server.get("samples", [])
    w0, w1 = res["window_wall"]
    internal = _sample_window(samples, w0, w1, "steps")
    prompt = max(1000.0, 100.0 * (w1 - w0))  # ms: a status answered later than this is not "at" the window edge
    status_ok = "error" not in before and "error" not in after
    if status_ok and before["rpc_ms"] <= prompt and after["rpc_ms"] <= prompt:
        if before["last_report_at"] > 0 and after["last_report_at"] > before["last_report_at"]:
            t0, t1 = before["last_report_at"], after["last_report_at"]
            how = "GetStatus; window between the snapshots' newest last_report_at"
        else:
            t0 = (before["sent_at"] + before["received_at"]) / 2
            t1 = (after["sent_at"] + after["received_at"]) / 2
            how = "GetStatus; window between the calls' midpoints"
        span = max(t1 - t0, 1e-9)
        ingested = (after["steps"] - before["steps"]) / span
    else:
        # GetStatus failed or answered too late to stand for the window edges:
        # the server child's own Σ steps_ingested, sampled with timestamps on
        # its event loop, over the generator's window.
        t0, t1 = w0, w1
        span = max(t1 - t0, 1e-9)
        ingested = internal or 0.0
        how = (f"server-internal step counter (GetStatus before: {_status_note(before)}; "
               f"after: {_status_note(after)})")
    log = [(t, n, c) for t, n, c in res["send_log"]]
    offered = (_interp(log, t1, 1) - _interp(log, t0, 1)) / span
    gen_cpu = (_interp(log, t1, 2) - _interp(log, t0, 2)) / span
    srv_cpu = _sample_window(samples, t0, t1, "cpu")
    lag = [s["lag_ms"] for s in samples if t0 <= s["t"] <= t1]
    out = {
        "window_s": span, "window_from": how, "offered": offered, "ingested": ingested,
        "ingested_internal_counter": internal,
        "workers_registered": after.get("workers", server.get("workers")),
        "generator_cpu_util": gen_cpu, "generator_loop_lag_ms_p99": _percentile(res["loop_lag_ms"], 99),
        "server_cpu_util": srv_cpu, "server_loop_lag_ms_p50": _percentile(lag, 50),
        "server_loop_lag_ms_p99": _percentile(lag, 99), "server_peak_rss_mb": server.get("peak_rss_mb"),
        "status_rpc_ms": [before.get("rpc_ms"), after.get("rpc_ms")],
        "workers_connected": after.get("connected"), "rejections": res["rejections"],
        "stream_errors": res["stream_errors"], "dropped_steps": res["dropped_steps"],
        "messages_sent": res["sent_messages"], "t0": t0, "t1": t1,
    }
    if res["last_rejection"]:
        out["last_rejection"] = res["last_rejection"]
    if res["last_error"]:
        out["last_stream_error"] = res["last_error"]
    sections = {}
    for name in SectionTimers.SECTIONS:
        share = _sample_window(samples, t0, t1, f"s_{name}")
        if share is not None:
            sections[name] = {"cpu_share": share, "calls_per_s": _sample_window(samples, t0, t1, f"n_{name}")}
    gc_share = _sample_window(samples, t0, t1, "gc_s")
    if gc_share is not None:
        out["server_gc_share"] = gc_share  # of wall time in the window, the loop stopped by the collector
        out["server_gc_full_per_s"] = _sample_window(samples, t0, t1, "gc_full")
    if sections:
        out["sections"] = sections
        d_steps = _sample_window(samples, t0, t1, "steps")
        if d_steps and "ingest" in sections:
            out["ingest_us_per_step"] = sections["ingest"]["cpu_share"] / d_steps * 1e6
        pol = sections.get("run_policy")
        if pol and pol["calls_per_s"]:
            out["run_policy_ms_mean"] = pol["cpu_share"] / pol["calls_per_s"] * 1000.0
    return out


def _rate_series(log: list[tuple[float, float]], t_ref: float, step: float = 0.5) -> tuple[list[float], list[float]]:
    """(time since t_ref, rate) from a cumulative (time, count) log, resampled every ``step`` s."""
    if len(log) < 2:
        return [], []
    ts, rates = [], []
    t = log[0][0]
    while t + step <= log[-1][0]:
        rates.append((_interp(log, t + step, 1) - _interp(log, t, 1)) / step)
        ts.append(t + step / 2 - t_ref)
        t += step
    return ts, rates


def write_plot(path: Path, results: dict, series: dict, push_ms: list[float]) -> None:
    from matplotlib.figure import Figure  # Agg canvas; no pyplot, no global backend

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    target = results["workers"] * results["steps_per_s_target"]
    names = ["offered", "controller\ningested", "bare gRPC\n(echo)"]
    values = [results["steps_per_s_offered"], results["steps_per_s_ingested"], results["bare_grpc_msgs_per_s"]]
    bars = ax1.bar(names, values, color=["#8da0cb", "#fc8d62", "#66c2a5"])
    ax1.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
    ax1.axhline(target, color="k", ls="--", lw=1, label=f"target {results['workers']}×{results['steps_per_s_target']:g}")
    ax1.set_ylim(0, 1.2 * max(values + [target]))
    ax1.set_ylabel("steps / s")
    ax1.set_title("Telemetry throughput (measured window)")
    ax1.legend(loc="upper center")
    for label, (ts, rates), style in (("offered (controller phase)", series["offered"], ":"),
                                      ("controller ingested", series["ingested"], "-"),
                                      ("bare echo ingested", series["bare"], "--")):
        if ts:
            ax2.plot(ts, rates, style, label=label)
    ax2.axhline(target, color="k", ls="--", lw=0.8)
    ax2.set_xlabel("s since the measured window opened")
    ax2.set_ylabel("steps / s")
    ax2.set_title("Rate over time (0.5 s bins)")
    ax2.legend(fontsize=8)
    if push_ms:
        lo = max(min(push_ms), 1e-3)
        hi = max(max(push_ms), lo * 10)
        bins = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        ax3.hist(push_ms, bins=bins, color="#fc8d62")
        ax3.set_xscale("log")
        for q, val in (("p50", results["plan_push_ms_p50"]), ("p99", results["plan_push_ms_p99"])):
            if val is not None:
                ax3.axvline(val, color="k", lw=1, ls="-" if q == "p50" else "--", label=f"{q} {val:.2f} ms")
        ax3.axvline(GOAL_PUSH_P99_MS, color="r", lw=1, ls=":", label=f"goal p99 ≤ {GOAL_PUSH_P99_MS:g} ms")
        ax3.legend(fontsize=8)
    else:
        ax3.text(0.5, 0.5, "no plans received", ha="center", va="center", transform=ax3.transAxes)
    ax3.set_xlabel("Plan.created_at → received at worker (ms)")
    ax3.set_ylabel("plans")
    ax3.set_title(f"Plan push latency ({results['plan_push_samples']} plans, {results['plan_push_scope']})")
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------- orchestration

def _stop_process(proc, conn=None, grace_s: float = 10.0) -> None:
    if proc is None:
        return
    if conn is not None:
        try:
            conn.send(("stop", None))
        except (OSError, ValueError):
            pass
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _expect(conn, proc, kind: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            got, payload = conn.recv()
            if got == kind:
                return payload
            if got == "error":
                raise BenchError(payload)
        elif not proc.is_alive():
            raise BenchError(f"{proc.name} exited with code {proc.exitcode} before sending {kind!r}")
    raise BenchError(f"{proc.name} sent no {kind!r} within {timeout_s:.0f} s")


@dataclass
class Generator:
    """One load-generator process and the parent's end of its pipe."""

    proc: Any
    conn: Any


def _start_generators(ctx, count: int) -> list[Generator]:
    gens = []
    for k in range(count):
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=generator_child, args=(child,), name=f"specctl-bench-generator-{k}", daemon=True)
        gens.append(Generator(proc, conn))
        proc.start()
        child.close()
    return gens


def _stop_generators(gens: list[Generator]) -> None:
    for g in gens:
        try:
            g.conn.send(("stop", None))
        except (OSError, ValueError):
            pass
    for g in gens:
        _stop_process(g.proc)
        g.conn.close()


def _run_phase(ctx, gens: list[Generator], name: str, server_target, server_args: tuple, cfg: dict, progress,
               task) -> tuple[dict, dict]:
    """One server child and every generator through one phase; the generators'
    results merged (:func:`merge_generator_results`) and the server's stats."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server_target, args=(child, *server_args), name=f"specctl-bench-{name}", daemon=True)
    proc.start()
    child.close()
    try:
        port = _expect(parent, proc, "ready", READY_TIMEOUT_S)
        for k, g in enumerate(gens):
            g.conn.send(("run", dict(cfg, name=name, target=f"127.0.0.1:{port}", shard=k, shards=len(gens))))
        for g in gens:
            _expect(g.conn, g.proc, "armed", READY_TIMEOUT_S)
        # A common start a little ahead, so every generator's first tick is on the same schedule.
        start_wall = time.time() + 0.2
        for g in gens:
            g.conn.send(("go", start_wall))
        total = cfg["warmup_s"] + cfg["duration_s"]
        deadline = time.monotonic() + total + 2 * STATUS_TIMEOUT_S + 90.0
        results: dict[int, dict] = {}
        latest: dict[int, dict] = {}
        while len(results) < len(gens):
            if time.monotonic() > deadline:
                raise BenchError(f"phase {name}: the load generators did not finish in time")
            if not any(g.conn.poll() for g in gens):
                time.sleep(0.05)
                for g in gens:
                    if not g.proc.is_alive():
                        raise BenchError(f"{g.proc.name} exited with code {g.proc.exitcode}")
                if not proc.is_alive():
                    raise BenchError(f"{proc.name} exited with code {proc.exitcode}")
                continue
            for k, g in enumerate(gens):
                while k not in results and g.conn.poll():
                    kind, payload = g.conn.recv()
                    if kind == "progress":
                        latest[k] = payload
                        sent = sum(p["sent"] for p in latest.values())
                        plans = sum(p["plans"] for p in latest.values())
                        progress.update(task, completed=min(latest.get(0, payload)["elapsed"], total),
                                        description=f"{name}: {sent:,} steps sent, {plans:,} plans")
                    elif kind == "result":
                        results[k] = payload
                        if k == 0:  # the window is measured: the others stop now
                            for other in gens[1:]:
                                other.conn.send(("stop", None))
                    elif kind == "error":
                        raise BenchError(payload)
        progress.update(task, completed=total)
        parent.send(("stop", None))
        stats = _expect(parent, proc, "stats", 60.0)
        return merge_generator_results([results[k] for k in range(len(gens))]), stats
    finally:
        _stop_process(proc, parent)
        parent.close()


def run_controller_bench(out_dir: str | os.PathLike, workers: int = 256, duration_s: float = 10.0,
                         steps_per_s: float = 50.0, *, warmup_s: float | None = None,
                         profile: bool | None = None, decide_batches: int = 20, decide_calls: int = 10_000,
                         generators: int | None = None, config: str | None = None, console=None,
                         tick_grid_s: float = TICK_GRID_S) -> int:
    """Run the benchmark; write ``controller.json`` and ``controller.png`` into ``out_dir``.

    ``generators``: load-generator processes (default
    :func:`default_generators`: one per ``WORKERS_PER_GENERATOR`` workers).
    ``config``: a controller config file for the controller phase (default:
    ``SPECCTL_BENCH_CONFIG`` if set, else the defaults).
    ``tick_grid_s``: the generators' tick grid (``WireLoadWorker``; 0: each
    worker's own drawn tick).

    Returns 0 when the benchmark ran (goals met or not: they are reported),
    1 when it could not run.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    generators = default_generators(workers) if generators is None else generators
    if workers < 1 or duration_s <= 0 or steps_per_s <= 0 or not 1 <= generators <= workers:
        console.print(f"[red]specctl bench controller: workers={workers}, duration={duration_s}, "
                      f"steps_per_s={steps_per_s} must be positive and generators={generators} in 1..workers")
        return 2
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if profile is None:
        profile = os.environ.get("SPECCTL_BENCH_PROFILE", "") not in ("", "0")
    config = config or os.environ.get("SPECCTL_BENCH_CONFIG") or None
    if config is not None:
        try:
            bench_server_config(config)
        except (ValueError, OSError) as err:  # ConfigError names the field and the value
            console.print(f"[red]specctl bench controller: {err}")
            return 2
    warmup = warmup_s if warmup_s is not None else min(2.0, max(0.5, duration_s / 5))
    cfg = {"workers": workers, "steps_per_s": steps_per_s, "warmup_s": warmup, "duration_s": duration_s,
           "tick_grid_s": tick_grid_s}
    ctx = mp.get_context("spawn")
    load_before = os.getloadavg()
    phase_s: dict[str, float] = {}
    started = time.monotonic()
    gens: list[Generator] = []
    try:
        gens = _start_generators(ctx, generators)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            t_bare = progress.add_task("bare gRPC echo", total=warmup + duration_s)
            t_ctl = progress.add_task("controller", total=warmup + duration_s, start=True)
            t_dec = progress.add_task("agent.decide", total=decide_batches)
            t = time.monotonic()
            bare_res, bare_srv = _run_phase(ctx, gens, "bare", echo_child, (), cfg, progress, t_bare)
            phase_s["bare"] = time.monotonic() - t
            t = time.monotonic()
            ctl_res, ctl_srv = _run_phase(ctx, gens, "controller", controller_child,
                                          (str(out) if profile else None, config), cfg, progress, t_ctl)
            phase_s["controller"] = time.monotonic() - t
            _stop_generators(gens)
            gens = []
            t = time.monotonic()
            decide_us = bench_agent_decide(batches=decide_batches, calls=decide_calls)
            decide_classes_us = bench_agent_decide(batches=decide_batches, calls=decide_calls, classes=True)
            progress.update(t_dec, completed=decide_batches)
            phase_s["decide"] = time.monotonic() - t
    except (BenchError, OSError) as err:
        console.print(f"[red]specctl bench controller: {err}")
        return 1
    finally:
        _stop_generators(gens)

    bare = summarize_phase(bare_res, bare_srv)
    ctl = summarize_phase(ctl_res, ctl_srv)
    # Plan push latency: plans created inside the measured window (else the whole run, flagged).
    created = [(c, r) for c, r in ctl_res["plans_created_received"]]
    in_window = [(r - c) * 1000.0 for c, r in created if ctl["t0"] <= c <= ctl["t1"]]
    scope = "window"
    push = in_window
    if not push:
        push = [(r - c) * 1000.0 for c, r in created]
        scope = "whole run (no plan created in the window)"
    # The controller's part of it: created_at -> gRPC took the plan (server side, same window).
    handoff = [ms for t, ms in ctl_srv.get("plan_handoffs", []) if ctl["t0"] <= t <= ctl["t1"]]
    rtt_all = [ms for _, ms in ctl_srv.get("ack_rtt", [])]
    rtt_window = [ms for t, ms in ctl_srv.get("ack_rtt", []) if ctl["t0"] <= t <= ctl["t1"]] or rtt_all
    results: dict[str, Any] = {
        "workers": workers,
        "steps_per_s_offered": ctl["offered"],
        "steps_per_s_ingested": ctl["ingested"],
        "plan_push_ms_p50": _percentile(push, 50),
        "plan_push_ms_p99": _percentile(push, 99),
        "bare_grpc_msgs_per_s": bare["ingested"],
        "ingest_vs_bare_ratio": ctl["ingested"] / bare["ingested"] if bare["ingested"] > 0 else None,
        "agent_decide_us_median": _percentile(decide_us, 50),
        # ---- extras
        "steps_per_s_target": steps_per_s,
        "generators": generators,
        "target_steps_per_s_total": workers * steps_per_s,
        "duration_s": duration_s,
        "warmup_s": warmup,
        "bare_steps_per_s_offered": bare["offered"],
        "plan_push_samples": len(push),
        "plan_push_scope": scope,
        "plan_push_ms_max": max(push) if push else None,
        "plans_received": ctl_res["plans"],
        "request_decisions_received": ctl_res["request_decisions"],
        "plan_handoff_ms_p50": _percentile(handoff, 50),
        "plan_handoff_ms_p99": _percentile(handoff, 99),
        "plan_handoff_samples": len(handoff),
        "plan_ack_rtt_ms_p50": _percentile(rtt_window, 50),
        "plan_ack_rtt_ms_p99": _percentile(rtt_window, 99),
        "agent_decide_us_batches": decide_us,
        "agent_decide_classes_us_median": _percentile(decide_classes_us, 50),
        "agent_decide_classes_us_batches": decide_classes_us,
        "controller": {k: v for k, v in ctl.items() if k not in ("t0", "t1")},
        "bare": {k: v for k, v in bare.items() if k not in ("t0", "t1", "sections")},
        "controller_peak_rss_mb": ctl_srv.get("peak_rss_mb"),
        "controller_rejections": ctl_srv.get("rejections", {}),
        "controller_send_queue_dropped": ctl_srv.get("send_queue_dropped"),
        "controller_plans_deferred": ctl_srv.get("plans_deferred"),
        "controller_reads_yielded_to_plans": ctl_srv.get("reads_yielded"),
        "controller_gc": ctl_srv.get("gc"),  # collections during the controller phase, per generation
        "controller_config": config,
        "controller_drift_monitor": ctl_srv.get("drift_monitor"),  # sampled share, µs per request-step, events
        "controller_open_streams_at_stop": ctl_srv.get("open_streams_at_stop"),
        "controller_loop_errors": ctl_srv.get("loop_errors"),
        "controller_loop_error_count": ctl_srv.get("loop_error_count"),
        "generator_stream_error_offsets_s": [round(t - ctl_res["wall_t0"], 2) for t in ctl_res["error_times"][:50]],
        "phase_seconds": phase_s,
        "total_seconds": time.monotonic() - started,
        "profiled": bool(profile),
        "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
    }
    if profile and "profile" in ctl_srv:
        results["controller_profile"] = ctl_srv["profile"]
    target = workers * steps_per_s
    p99, ratio, dec = results["plan_push_ms_p99"], results["ingest_vs_bare_ratio"], results["agent_decide_us_median"]
    results.update(
        goal_sustained_256x50=bool(workers >= GOAL_WORKERS and steps_per_s >= GOAL_STEPS_PER_S
                                   and ctl["ingested"] >= SUSTAINED * target),
        goal_keeps_up_at_this_load=bool(ctl["ingested"] >= SUSTAINED * target),
        goal_plan_push_p99_le_5ms=bool(p99 is not None and p99 <= GOAL_PUSH_P99_MS),
        goal_ingest_ge_half_bare=bool(ratio is not None and ratio >= GOAL_INGEST_VS_BARE),
        goal_decide_le_10us=bool(dec is not None and dec <= GOAL_DECIDE_US),
        goal_decide_classes_le_10us=bool(results["agent_decide_classes_us_median"] is not None
                                         and results["agent_decide_classes_us_median"] <= GOAL_DECIDE_US),
    )
    (out / "controller.json").write_text(json.dumps(results, indent=2))
    t_ref = ctl["t0"]
    series = {
        "offered": _rate_series([(t, n) for t, n, _ in ctl_res["send_log"]], t_ref),
        "ingested": _rate_series([(s["t"], s["steps"]) for s in ctl_srv.get("samples", [])], t_ref),
        "bare": _rate_series([(s["t"], s["steps"]) for s in bare_srv.get("samples", [])], bare["t0"]),
    }
    write_plot(out / "controller.png", results, series, push)
    _print_table(console, results, ctl, bare, out)
    return 0


def _fmt(v, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{v}{unit}"


def _print_table(console, r: dict, ctl: dict, bare: dict, out: Path) -> None:
    from rich.table import Table

    def goal(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]not met[/]"

    t = Table(title=f"specctl bench controller — {r['workers']} workers × {r['steps_per_s_target']:g} steps/s "
                    f"({r['duration_s']:g} s window)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("goal")
    t.add_row("steps/s offered", _fmt(r["steps_per_s_offered"]), f"target {r['target_steps_per_s_total']:,.0f}")
    t.add_row("steps/s ingested (controller)", _fmt(r["steps_per_s_ingested"]),
              goal(r["goal_sustained_256x50"]) + " (≥256×50 sustained)")
    t.add_row("bare gRPC echo steps/s", _fmt(r["bare_grpc_msgs_per_s"]), "")
    t.add_row("ingest / bare", _fmt(r["ingest_vs_bare_ratio"], digits=3), goal(r["goal_ingest_ge_half_bare"]) + " (≥ 0.5)")
    t.add_row("plan push p50 / p99 (ms)",
              f"{_fmt(r['plan_push_ms_p50'], digits=2)} / {_fmt(r['plan_push_ms_p99'], digits=2)}",
              goal(r["goal_plan_push_p99_le_5ms"]) + f" (p99 ≤ 5 ms; {r['plan_push_samples']} plans, {r['plan_push_scope']})")
    t.add_row("plan created → taken by gRPC p50 / p99 (ms, server)",
              f"{_fmt(r['plan_handoff_ms_p50'], digits=2)} / {_fmt(r['plan_handoff_ms_p99'], digits=2)}",
              "the controller's part of the push")
    t.add_row("plan send→ACK p50 / p99 (ms, server)",
              f"{_fmt(r['plan_ack_rtt_ms_p50'], digits=2)} / {_fmt(r['plan_ack_rtt_ms_p99'], digits=2)}", "")
    t.add_row("agent.decide median (µs)", _fmt(r["agent_decide_us_median"], digits=3),
              goal(r["goal_decide_le_10us"]) + " (≤ 10 µs)")
    t.add_row("agent.decide median with classes (µs)", _fmt(r["agent_decide_classes_us_median"], digits=3),
              goal(r["goal_decide_classes_le_10us"]) + " (≤ 10 µs, 3 classes)")
    t.add_row("workers registered at the controller", f"{ctl.get('workers_registered')} of {r['workers']}", "")
    t.add_row("controller ingest µs/step / run_policy ms",
              f"{_fmt(ctl.get('ingest_us_per_step'))} / {_fmt(ctl.get('run_policy_ms_mean'), digits=2)}", "")
    t.add_row("controller CPU / loop lag p99", f"{_fmt(ctl['server_cpu_util'], digits=2)} / "
              f"{_fmt(ctl['server_loop_lag_ms_p99'], ' ms')}", "")
    for name, s in (ctl.get("sections") or {}).items():
        if s["cpu_share"] and s["cpu_share"] > 0.005:
            t.add_row(f"  controller CPU in {name}", f"{s['cpu_share']:.0%} ({_fmt(s['calls_per_s'], '/s', 0)})", "")
    t.add_row("generator CPU (controller / bare phase)",
              f"{_fmt(ctl['generator_cpu_util'], digits=2)} / {_fmt(bare['generator_cpu_util'], digits=2)}", "")
    gc_info = r.get("controller_gc")
    if gc_info:
        n, ms, longest = gc_info["collections"], gc_info["total_ms"], gc_info["longest_ms"]
        t.add_row("controller GC: collections gen0/1/2, longest full (ms)",
                  f"{n[0]}/{n[1]}/{n[2]}, {longest[2]:.0f}", f"{sum(ms):,.0f} ms in all; {gc_info['holds']} holds")
    t.add_row("controller peak RSS", _fmt(r["controller_peak_rss_mb"], " MiB"), "")
    t.add_row("rejections / stream errors / dropped steps",
              f"{ctl['rejections']} / {ctl['stream_errors']} / {ctl['dropped_steps']}", "")
    t.add_row("host load average before / after",
              f"{r['host']['loadavg_before'][0]:.2f} / {r['host']['loadavg_after'][0]:.2f} ({r['host']['cpus']} CPUs)", "")
    console.print(t)
    console.print(f"wrote {out / 'controller.json'} and {out / 'controller.png'}")
