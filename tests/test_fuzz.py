"""Fuzzing the controller's wire surface with hypothesis, against a real server.

The controller runs on a free loopback port in a background event loop;
hypothesis drives it from the test thread, and every call it makes must come
back within ``CALL_TIMEOUT_S`` (a crash or a hang fails the example). Inputs:

- raw bytes and mutated serialized ``WorkerMessage``s on a ``Connect`` stream
  (an identity serializer puts arbitrary bytes on the wire), as the first
  message of a stream, and as ``DecideRequest`` bytes;
- structurally valid ``WorkerMessage``s whose fields carry exactly one known
  defect each — or only extreme but legal values — so the rejection each part
  must draw (reason and field) is known without asking the validator.

Properties: every bad part draws exactly one ``Rejection`` naming a reason,
the field and the value, in order, and the stream stays open; no good part is
rejected; nothing of a bad part is applied and every good step is (the
worker's ``steps_ingested`` follows the model); ``GetStatus`` keeps
answering; a healthy agent connected throughout keeps being served.

CI runs a fixed, derandomized budget. ``SPECCTL_FUZZ_EXAMPLES=N`` runs N
examples per test instead (the README's long run); ``-s`` shows the number
of inputs each test tried.
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from controller.config import PlanSettings, ServerConfig
from controller.server import start_server
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2
from tests.support import SyntheticWorker, free_port, make_hello, wait_for
from worker.sdk.agent import SpeculationAgent

CALL_TIMEOUT_S = 20.0  # generous: CI shares 2 cores; a hang still fails
CONNECT = "/speculation.v1.SpeculationController/Connect"
DECIDE = "/speculation.v1.SpeculationController/Decide"
SENTINEL = "fuzz-sentinel-"
MAX_DEPTH, MAX_WIDTH, MAX_NODES = 6, 4, 24
MAX_CONTEXT_LEN = 1 << 24
MAX_BATCH = 256  # make_hello's max_batch_size: a step above it is rejected
UINT64_MAX = (1 << 64) - 1
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
EXAMPLES = int(os.environ.get("SPECCTL_FUZZ_EXAMPLES", "0"))


def budget(ci_examples: int):
    """Hypothesis settings: a fixed, derandomized budget (or the long run's).
    No shrinking: the server's state carries from one example to the next, so
    a replay is not the same input; the first failure is the one reported."""
    return settings(max_examples=EXAMPLES or ci_examples, derandomize=True, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
                    print_blob=False)


def _identity(data: bytes) -> bytes:
    return data


Expected = tuple[str, str]  # (RejectReason name, field)


# ---------------------------------------------------------------- the rig

class LoopThread:
    """An event loop on its own thread: it hosts the server and the fuzzing
    client, so the test thread can time every call out."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = CALL_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RawStream:
    """A Connect stream that writes arbitrary bytes. After each payload it
    writes a sentinel (an Ack no plan matches), so the rejections each payload
    drew can be told apart. Plans are ACKed on a later exchange."""

    def __init__(self, channel: grpc.aio.Channel, hello: worker_pb2.Hello) -> None:
        self.channel = channel
        self.call = None  # made in open(), on the rig's loop
        self.hello = hello
        self.sentinels = 0
        # (version, nonce, payloads answered before it arrived) of plans not yet ACKed.
        self.unacked: list[tuple[int, str, int]] = []

    async def open(self) -> "RawStream":
        self.call = self.channel.stream_stream(CONNECT, request_serializer=_identity,
                                               response_deserializer=_identity)()
        await self.call.write(worker_pb2.WorkerMessage(hello=self.hello).SerializeToString())
        return self

    async def exchange(self, payloads: list[bytes]) -> list[list[plan_pb2.Rejection]]:
        """Send every payload; return the rejections each one drew."""
        for payload in payloads:
            await self.call.write(payload)
            self.sentinels += 1
            await self.call.write(worker_pb2.WorkerMessage(
                ack=worker_pb2.Ack(version=0, nonce=f"{SENTINEL}{self.sentinels}")).SerializeToString())
        out: list[list[plan_pb2.Rejection]] = []
        current: list[plan_pb2.Rejection] = []
        while len(out) < len(payloads):
            data = await self.call.read()
            if data is grpc.aio.EOF:
                raise AssertionError(f"the server ended the stream: {await self.call.code()} "
                                     f"{await self.call.details()}")
            msg = plan_pb2.ControllerMessage.FromString(data)
            kind = msg.WhichOneof("payload")
            if kind == "rejection":
                r = msg.rejection
                if r.field == "ack" and SENTINEL in r.detail:
                    out.append(current)
                    current = []
                else:
                    current.append(r)
            elif kind in ("plan", "request_decisions"):
                item = getattr(msg, kind)
                self.unacked.append((item.version, item.nonce, len(out)))
            # a TelemetryReceipt needs no answer
        assert not current
        return out

    def forget_plans_until(self, payload_index: int) -> None:
        """Drop plans that may predate payload ``payload_index`` of the last
        exchange (a re-registration there made them void)."""
        self.unacked = [p for p in self.unacked if p[2] > payload_index]

    def take_acks(self) -> list[bytes]:
        acks = [worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=v, nonce=n)).SerializeToString()
                for v, n, _ in self.unacked]
        self.unacked.clear()
        return acks


@dataclass
class Rig:
    loop: LoopThread
    server: object  # controller.server.RunningServer
    channel: grpc.aio.Channel
    healthy: SpeculationAgent
    inputs: dict[str, int] = field(default_factory=dict)

    def call(self, coro):
        return self.loop.run(coro)

    async def _status(self, worker_id: str) -> controller_pb2.GetStatusResponse:
        method = self.channel.unary_unary("/speculation.v1.SpeculationController/GetStatus",
                                          request_serializer=controller_pb2.GetStatusRequest.SerializeToString,
                                          response_deserializer=controller_pb2.GetStatusResponse.FromString)
        return await method(controller_pb2.GetStatusRequest(worker_id=worker_id), timeout=CALL_TIMEOUT_S)

    def status(self, worker_id: str = "") -> controller_pb2.GetStatusResponse:
        return self.call(self._status(worker_id))

    def healthy_snapshot(self) -> tuple[int, int]:
        [w] = self.status(self.healthy.hello.worker_id).workers
        return w.steps_ingested, self.healthy.plan_version

    def assert_healthy_served(self, before: tuple[int, int]) -> None:
        """The healthy worker's telemetry kept flowing, none of it was refused,
        and a plan forced now still reaches it."""
        steps_before, _ = before
        [w] = self.status(self.healthy.hello.worker_id).workers
        assert w.connected and w.steps_ingested > steps_before
        assert self.healthy.stats.rejections == 0, self.healthy.stats.last_rejection
        version = self.healthy.plan_version

        async def force_plans() -> None:
            ctl = self.server.controller
            ctl.set_policy(ctl.policy)  # every worker gets a new plan
            await wait_for(lambda: self.healthy.plan_version > version, timeout=CALL_TIMEOUT_S)

        self.call(force_plans())

    def count(self, test: str, n: int) -> None:
        self.inputs[test] = self.inputs.get(test, 0) + n


@pytest.fixture(scope="module")
def rig():
    loop = LoopThread()
    # Plans are recomputed at every tick so plans (and ACKs) interleave with the junk;
    # the send queue is large so that no rejection is dropped for a slow reader here.
    config = ServerConfig(listen=f"127.0.0.1:{free_port()}", send_queue_size=10_000,
                          plan=PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=0.0))
    server = loop.run(start_server(config))
    channel = loop.run(_open_channel(server.address))
    healthy = SpeculationAgent(make_hello("fuzz-healthy"), server.address).start()
    stop = threading.Event()

    def feed() -> None:  # an engine stepping next to the fuzzing
        worker = SyntheticWorker(lambda ctx: 0.8, seed=5)
        while not stop.is_set():
            healthy.observe(worker.step(healthy.decide, 4, 600, prefix="h"))
            time.sleep(0.01)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    r = Rig(loop, server, channel, healthy)
    loop.run(wait_for(lambda: healthy.plan_version >= 1, timeout=CALL_TIMEOUT_S))
    yield r
    stop.set()
    feeder.join(5)
    healthy.close()
    loop.run(channel.close())
    loop.run(server.stop(0))
    loop.close()
    print("\nfuzz inputs tried: " + ", ".join(f"{k} {v}" for k, v in r.inputs.items())
          + f"; total {sum(r.inputs.values())}")


async def _open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


# ------------------------------------------------- structured messages

@dataclass
class WorkerModel:
    """What the controller must believe about the fuzzed worker."""

    hello: worker_pb2.Hello
    next_step: int = 0  # last step id handed out
    last_applied: int = 0  # step id of the last step the controller applied
    applied: int = 0  # steps applied since the worker (re-)registered
    fresh: int = 0
    finished: list[str] = field(default_factory=list)
    version: int = 0

    def step_id(self) -> int:
        self.next_step += 1
        return self.next_step

    def request_id(self, stem: str) -> str:
        self.fresh += 1
        return f"{stem}#{self.fresh}"

    def reregistered(self) -> None:
        """A Hello with new drafter limits starts a new worker state."""
        self.last_applied = self.applied = 0
        self.finished.clear()


STEM = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12)  # unicode, NUL included
BAD_MS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -1e-9, 3.6e6, 1e300])
REQUEST_DEFECTS = ["request_id", "context_len", "depth", "accepted", "width", "nodes", "accepted_rank",
                   "level_candidates", "draft_confidence", "rank_value", "candidates_value", "requested_depth",
                   "requested_width", "requested_nodes", "caught_up_tokens"]
STEP_DEFECTS = ["step_id", "timestamp", "batch_size", "requests", "draft_ms", "verify_ms", "catch_up_ms",
                "duplicate_id", "finished_id"]


def draw_request(data, model: WorkerModel, shape: str) -> worker_pb2.RequestStep:
    """A valid request of ``shape`` ("off", "chain" or "tree"), legal extremes included."""
    r = worker_pb2.RequestStep(request_id=model.request_id(data.draw(STEM)),
                               context_len=data.draw(st.integers(0, MAX_CONTEXT_LEN)),
                               domain=data.draw(st.sampled_from(["", "chat", "code", "✓"])))
    if shape == "off":  # asked for a draft or not; none offered
        r.requested_depth = data.draw(st.sampled_from([0, 1, MAX_DEPTH]))
        draw_requested_shape(data, r)
        return r
    r.depth = depth = data.draw(st.integers(1, MAX_DEPTH))
    r.requested_depth = data.draw(st.sampled_from([0, depth, MAX_DEPTH]))
    r.nodes = data.draw(st.integers(depth, MAX_NODES))
    r.accepted = accepted = data.draw(st.integers(0, depth))
    if shape == "chain":
        r.width = 1
        draw_requested_shape(data, r)
        return r
    r.width = width = data.draw(st.integers(1, MAX_WIDTH))
    draw_requested_shape(data, r)
    reached = accepted + 1 if accepted < depth else depth
    cands = [data.draw(st.integers(1, width)) for _ in range(reached)]
    r.level_candidates.extend(cands)
    r.accepted_rank.extend(data.draw(st.integers(1, c)) if i < accepted else 0 for i, c in enumerate(cands))
    if data.draw(st.booleans()):
        r.draft_confidence.extend(data.draw(st.floats(0.0, 1.0, width=32)) for _ in range(reached))
    return r


def draw_requested_shape(data, r: worker_pb2.RequestStep) -> None:
    """The width and node budget asked for, when a depth was: unreported, what
    the step used, or the drafter's limit; and the tokens the drafter caught
    up on, when a draft was asked for (none, one, or the whole context)."""
    if r.requested_depth:
        r.requested_width = data.draw(st.sampled_from([0, max(r.width, 1), MAX_WIDTH]))
        r.requested_nodes = data.draw(st.sampled_from([0, max(r.nodes, 1), MAX_NODES]))
    if r.requested_depth or r.depth:
        r.caught_up_tokens = data.draw(st.sampled_from([0, min(r.context_len, 1), r.context_len]))


def apply_request_defect(data, r: worker_pb2.RequestStep, defect: str) -> str | None:
    """Break ``r`` in one way; return the field the rejection must name
    (relative to the request), or None where the shape has no such field."""
    off, tree = r.depth == 0, bool(r.accepted_rank)
    if defect == "request_id":
        r.request_id = ""
    elif defect == "context_len":
        r.context_len = data.draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(MAX_CONTEXT_LEN + 1, (1 << 31) - 1)))
    elif defect == "depth":
        r.depth = data.draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(MAX_DEPTH + 1, (1 << 31) - 1)))
    elif defect == "accepted":
        r.accepted = data.draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(r.depth + 1, (1 << 31) - 1)))
    elif defect == "width" and not off:
        r.width = data.draw(st.one_of(st.integers(-(1 << 31), 0), st.integers(MAX_WIDTH + 1, (1 << 31) - 1)))
    elif defect == "nodes":
        if off:
            r.nodes = data.draw(st.integers(1, (1 << 31) - 1))
        else:
            r.nodes = data.draw(st.one_of(st.integers(-(1 << 31), r.depth - 1), st.integers(MAX_NODES + 1, (1 << 31) - 1)))
    elif defect == "accepted_rank":  # oversized, both lists alike
        n = data.draw(st.integers(MAX_DEPTH + 1, 20_000))
        del r.accepted_rank[:], r.level_candidates[:]
        r.accepted_rank.extend([1] * n)
        r.level_candidates.extend([1] * n)
    elif defect == "level_candidates":  # oversized, accepted_rank left as it was
        r.level_candidates.extend([1] * data.draw(st.integers(MAX_DEPTH + 1, 20_000)))
    elif defect == "draft_confidence" and (off or tree):
        if off:
            r.draft_confidence.extend([0.5])
        else:
            if not r.draft_confidence:
                r.draft_confidence.extend([0.5] * len(r.accepted_rank))
            k = data.draw(st.integers(0, len(r.draft_confidence) - 1))
            r.draft_confidence[k] = data.draw(st.sampled_from([math.nan, math.inf, -0.5, 1.5]))
            return f"draft_confidence[{k}]"
    elif defect == "rank_value" and tree:
        k = data.draw(st.integers(0, len(r.accepted_rank) - 1))
        r.accepted_rank[k] = r.level_candidates[k] + 1 if k < r.accepted else data.draw(st.integers(1, MAX_WIDTH))
        return f"accepted_rank[{k}]"
    elif defect == "requested_depth":  # negative, past the drafter's limit, or shallower than the tree
        shallower = st.integers(1, r.depth - 1) if r.depth > 1 else st.just(-1)
        r.requested_depth = data.draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(MAX_DEPTH + 1, (1 << 31) - 1),
                                                shallower))
    elif defect in ("requested_width", "requested_nodes"):  # asked with no depth, out of range, or below the tree
        used, limit = (r.width, MAX_WIDTH) if defect == "requested_width" else (r.nodes, MAX_NODES)
        if not r.requested_depth:
            setattr(r, defect, data.draw(st.integers(1, (1 << 31) - 1)))
        else:
            below = st.integers(1, used - 1) if used > 1 else st.just(-1)
            setattr(r, defect, data.draw(st.one_of(st.integers(-(1 << 31), -1),
                                                   st.integers(limit + 1, (1 << 31) - 1), below)))
    elif defect == "caught_up_tokens":  # past the context, negative, or with no draft asked for
        if r.requested_depth or r.depth:
            r.caught_up_tokens = data.draw(st.one_of(st.integers(-(1 << 31), -1),
                                                     st.integers(r.context_len + 1, (1 << 31) - 1)))
        else:
            r.caught_up_tokens = data.draw(st.integers(1, (1 << 31) - 1))
    elif defect == "candidates_value" and tree:
        k = data.draw(st.integers(0, len(r.level_candidates) - 1))
        r.level_candidates[k] = data.draw(st.sampled_from([0, -1, r.width + 1]))
        return f"level_candidates[{k}]"
    else:
        return None
    return defect


def draw_step(data, model: WorkerModel, index: int) -> tuple[worker_pb2.StepReport, Expected | None]:
    """One step, valid or with one defect; returns it with the rejection it must draw."""
    path = f"steps[{index}]"
    shapes = data.draw(st.lists(st.sampled_from(["off", "chain", "tree"]), max_size=4))
    requests = [draw_request(data, model, s) for s in shapes]
    step = worker_pb2.StepReport(
        timestamp=data.draw(st.floats(0.0, 1e10)),
        draft_ms=data.draw(st.floats(0.0, 3.6e6, exclude_max=True)),
        catch_up_ms=data.draw(st.sampled_from([0.0, 1.5, 3.6e6 - 1.0])),
        verify_ms=data.draw(st.floats(0.0, 3.6e6, exclude_min=True, exclude_max=True)),
        batch_size=data.draw(st.integers(max(1, len(requests)), MAX_BATCH)),
    )
    expected: Expected | None = None
    # Draws never depend on the model (hypothesis replays them against another
    # state): an index into the model's lists is drawn as a number and wrapped.
    pick, j = data.draw(st.integers(0, 1 << 16)), data.draw(st.integers(0, len(requests)))
    defect = data.draw(st.one_of(st.none(), st.sampled_from(STEP_DEFECTS), st.sampled_from(REQUEST_DEFECTS)))
    if defect in REQUEST_DEFECTS and requests:
        j = min(j, len(requests) - 1)
        name = apply_request_defect(data, requests[j], defect)
        if name is not None:
            expected = ("REJECT_REASON_INVALID_FIELD", f"{path}.requests[{j}].{name}")
    elif defect == "timestamp":
        step.timestamp = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0]))
        expected = ("REJECT_REASON_INVALID_FIELD", f"{path}.timestamp")
    elif defect == "batch_size":
        step.batch_size = data.draw(st.one_of(st.integers(-(1 << 31), 0), st.integers(MAX_BATCH + 1, (1 << 31) - 1)))
        expected = ("REJECT_REASON_INVALID_FIELD", f"{path}.batch_size")
    elif defect == "requests":  # more requests than the batch holds
        extra = data.draw(st.integers(2, 5000))
        requests += [worker_pb2.RequestStep(request_id=model.request_id("x")) for _ in range(extra)]
        step.batch_size = data.draw(st.integers(1, min(MAX_BATCH, len(requests) - 1)))
        expected = ("REJECT_REASON_INVALID_FIELD", f"{path}.requests")
    elif defect in ("draft_ms", "verify_ms", "catch_up_ms"):
        setattr(step, defect, data.draw(st.one_of(BAD_MS, st.just(0.0)) if defect == "verify_ms" else BAD_MS))
        expected = ("REJECT_REASON_INVALID_FIELD", f"{path}.{defect}")
    elif defect == "duplicate_id" and requests:
        twin = worker_pb2.RequestStep(request_id=requests[0].request_id, context_len=7)
        requests.append(twin)
        step.batch_size = max(step.batch_size, len(requests))
        expected = ("REJECT_REASON_INVALID_FIELD", f"{path}.requests[{len(requests) - 1}].request_id")
    elif defect == "finished_id" and model.finished:
        requests.insert(j, worker_pb2.RequestStep(request_id=model.finished[pick % len(model.finished)]))
        step.batch_size = max(step.batch_size, len(requests))
        expected = ("REJECT_REASON_UNKNOWN_REQUEST", f"{path}.requests[{j}].request_id")
    step.requests.extend(requests)
    if defect == "step_id":
        step.step_id = pick % (model.last_applied + 1)
        expected = ("REJECT_REASON_STALE_STEP", f"{path}.step_id")
    else:
        step.step_id = model.step_id()
    if expected is None:
        model.last_applied = step.step_id
        model.applied += 1
    return step, expected


def draw_message(data, model: WorkerModel, applied_ids: list[str],
                 unacked: list[tuple[int, str, int]]) -> tuple[worker_pb2.WorkerMessage, list[Expected]]:
    """One WorkerMessage and the rejections it must draw, in order."""
    kind = data.draw(st.sampled_from(["reports", "reports", "reports", "finished", "ack", "nack", "hello", "empty"]))
    if kind == "reports":
        reports = worker_pb2.StepReports(dropped_steps=data.draw(st.integers(0, UINT64_MAX)))
        expected = []
        for i in range(data.draw(st.integers(0, 4))):
            step, exp = draw_step(data, model, i)
            reports.steps.append(step)
            if exp is None:
                applied_ids.extend(r.request_id for r in step.requests)
            else:
                expected.append(exp)
        return worker_pb2.WorkerMessage(reports=reports), expected
    if kind == "finished":
        f = worker_pb2.RequestFinished(request_id=model.request_id("never-seen"), generated_tokens=10, steps=5,
                                       accepted_tokens=4, timestamp=data.draw(st.floats(0.0, 1e10)))
        defect = data.draw(st.sampled_from(["valid", "unknown", "request_id", "generated_tokens", "steps",
                                            "accepted_tokens", "accepted_over_generated", "timestamp"]))
        pick = data.draw(st.integers(0, 1 << 16))
        if defect == "valid" and applied_ids:
            f.request_id = rid = applied_ids.pop(pick % len(applied_ids))
            model.finished.append(rid)
            del model.finished[:-1000]
            return worker_pb2.WorkerMessage(finished=f), []
        if defect in ("valid", "unknown"):
            return worker_pb2.WorkerMessage(finished=f), [("REJECT_REASON_UNKNOWN_REQUEST", "finished.request_id")]
        if defect == "request_id":
            f.request_id = ""
        elif defect == "timestamp":
            f.timestamp = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0]))
        elif defect == "accepted_over_generated":
            f.accepted_tokens = f.generated_tokens + data.draw(st.integers(1, 1 << 20))
            defect = "accepted_tokens"
        else:
            setattr(f, defect, data.draw(st.integers(-(1 << 31), -1)))
        return worker_pb2.WorkerMessage(finished=f), [("REJECT_REASON_INVALID_FIELD", f"finished.{defect}")]
    if kind in ("ack", "nack"):
        # The version of a plan really in flight when there is one, with a wrong nonce.
        in_flight, version = data.draw(st.booleans()), data.draw(st.integers(0, UINT64_MAX))
        if in_flight and unacked:
            version = unacked[-1][0]
        nonce = data.draw(st.text(max_size=20))
        if kind == "ack":
            msg = worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=version, nonce=nonce))
        else:
            msg = worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=version, nonce=nonce, reason="fuzz"))
        return msg, [("REJECT_REASON_UNKNOWN_PLAN", kind)]
    if kind == "hello":
        hello = worker_pb2.Hello()
        hello.CopyFrom(model.hello)
        change = data.draw(st.sampled_from(["same", "new_version", "other_worker", "max_depth", "kind",
                                            "max_tree_nodes", "calibration"]))
        if change == "same":  # same state; but a Hello says "(re)started": step ids may begin at 1 again
            model.last_applied = 0
            return worker_pb2.WorkerMessage(hello=hello), []
        if change == "new_version":  # a drafter roll-out mid-stream: a new state for the same worker
            model.version += 1
            hello.drafter.version = model.hello.drafter.version = f"fuzz-v{model.version}"
            model.reregistered()
            applied_ids.clear()
            return worker_pb2.WorkerMessage(hello=hello), []
        if change == "other_worker":
            hello.worker_id = data.draw(st.text(max_size=8).map(lambda s: "other-" + s))
            return worker_pb2.WorkerMessage(hello=hello), [("REJECT_REASON_INVALID_FIELD", "hello.worker_id")]
        if change == "calibration":  # valid samples, then one with a bad field
            good = data.draw(st.integers(0, 2))
            for k in range(good):
                hello.calibration.add(batch_size=1 + k, batch_tokens=3 * (1 + k), kv_tokens=100, verify_ms=50.0,
                                      repeats=3)
            field, value = data.draw(st.sampled_from([
                ("batch_size", 0), ("batch_size", (1 << 16) + 1), ("batch_tokens", 0), ("kv_tokens", -1),
                ("verify_ms", float("nan")), ("verify_ms", float("inf")), ("verify_ms", 0.0), ("verify_ms", -5.0),
                ("repeats", 0), ("repeats", 65)]))
            sample = hello.calibration.add(batch_size=2, batch_tokens=4, kv_tokens=10, verify_ms=40.0, repeats=1)
            setattr(sample, field, value)
            return (worker_pb2.WorkerMessage(hello=hello),
                    [("REJECT_REASON_INVALID_FIELD", f"hello.calibration[{good}].{field}")])
        if change == "max_depth":
            hello.drafter.max_depth = data.draw(st.sampled_from([0, 65, UINT64_MAX >> 32]))
        elif change == "kind":
            hello.drafter.kind = data.draw(st.sampled_from([0, 6, 99]))
        else:
            hello.drafter.max_tree_nodes = data.draw(st.sampled_from([0, MAX_DEPTH - 1, 4097]))
        return worker_pb2.WorkerMessage(hello=hello), [("REJECT_REASON_INVALID_FIELD", f"hello.drafter.{change}")]
    return worker_pb2.WorkerMessage(), [("REJECT_REASON_MALFORMED", "payload")]


def draw_junk(data, model: WorkerModel, unacked: list[tuple[int, str, int]]
              ) -> tuple[list[bytes], list[list[Expected]], int]:
    """1-4 messages, the rejections each must draw, and the index of the last
    one that re-registered the worker (-1 if none)."""
    applied_ids: list[str] = []
    junk: list[bytes] = []
    expected: list[list[Expected]] = []
    rehello = -1
    for _ in range(data.draw(st.integers(1, 4))):
        version = model.version
        msg, exp = draw_message(data, model, applied_ids, unacked)
        if model.version != version:
            rehello = len(junk)
        junk.append(msg.SerializeToString())
        expected.append(exp)
    return junk, expected, rehello


def good_step(model: WorkerModel) -> bytes:
    step = worker_pb2.StepReport(step_id=model.step_id(), timestamp=time.time(), batch_size=2, draft_ms=1.0,
                                 verify_ms=12.0, requests=[worker_pb2.RequestStep(
                                     request_id=model.request_id("good"), context_len=300, depth=3, width=1,
                                     nodes=3, accepted=2)])
    model.last_applied = step.step_id
    model.applied += 1
    return worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[step])).SerializeToString()


def _names(rejections: list[plan_pb2.Rejection]) -> list[Expected]:
    return [(plan_pb2.RejectReason.Name(r.reason), r.field) for r in rejections]


def test_structured_messages_with_adversarial_fields(rig):
    before = rig.healthy_snapshot()
    hello = make_hello("fuzz-fields", max_depth=MAX_DEPTH, max_width=MAX_WIDTH, max_nodes=MAX_NODES)
    stream = rig.call(RawStream(rig.channel, hello).open())
    model = WorkerModel(hello)

    @budget(ci_examples=500)
    @given(st.data())
    def example(data) -> None:
        saved = copy.deepcopy(model)
        try:
            junk, expected, rehello = draw_junk(data, model, stream.unacked)
        except BaseException:  # hypothesis may stop an example mid-draw (too much data): the model must not move
            model.__dict__.update(saved.__dict__)
            raise
        # The plans received so far are ACKed after the junk, so that wrong
        # nonces in it meet plans really in flight; before it when the junk
        # re-registers the worker (its new state knows none of them).
        acks = stream.take_acks()
        if rehello >= 0:
            payloads, expected, rehello = acks + junk, [[] for _ in acks] + expected, rehello + len(acks)
        else:
            payloads, expected = junk + acks, expected + [[] for _ in acks]
        payloads.append(good_step(model))
        expected.append([])
        rig.count("structured", len(junk) + 1)
        got = rig.call(stream.exchange(payloads))
        if rehello >= 0:
            stream.forget_plans_until(rehello)
        assert [_names(g) for g in got] == expected
        for rejection in (r for g in got for r in g):
            assert rejection.detail, rejection
        [status] = rig.status(hello.worker_id).workers
        assert status.steps_ingested == model.applied

    example()
    rig.call(stream.exchange(stream.take_acks()))
    rig.assert_healthy_served(before)


# ------------------------------------------------------------ raw bytes

def _valid_templates() -> list[bytes]:
    hello = make_hello("fuzz-bytes")
    step = worker_pb2.StepReport(step_id=5, timestamp=1.0, batch_size=2, draft_ms=1.0, verify_ms=10.0, requests=[
        worker_pb2.RequestStep(request_id="b-r1", context_len=100, depth=3, width=1, nodes=3, accepted=1),
        worker_pb2.RequestStep(request_id="b-r2", context_len=900, depth=2, width=2, nodes=3, accepted=1,
                               accepted_rank=[2, 0], level_candidates=[2, 1], draft_confidence=[0.7, 0.2])])
    messages = [
        worker_pb2.WorkerMessage(hello=hello),
        worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[step, step], dropped_steps=3)),
        worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(request_id="b-r1", generated_tokens=9, steps=4,
                                                                     accepted_tokens=5)),
        worker_pb2.WorkerMessage(ack=worker_pb2.Ack(version=7, nonce="0123456789abcdef")),
        worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=7, nonce="0123456789abcdef", reason="no")),
    ]
    return [m.SerializeToString() for m in messages]


TEMPLATES = _valid_templates()


@st.composite
def mutated(draw, templates: list[bytes]) -> bytes:
    """A serialized message with a few byte-level edits: flips, cuts, inserts, duplicated spans."""
    data = bytearray(draw(st.sampled_from(templates)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "duplicate":
            j = draw(st.integers(i, len(data)))
            data[j:j] = data[i:j]
        elif data:
            del data[i:draw(st.integers(i, len(data)))]
    return bytes(data)


JUNK = st.one_of(st.binary(max_size=300), mutated(TEMPLATES))


def bound_for(payload: bytes) -> tuple[int, int, set[str]]:
    """(least, most) rejections ``payload`` may draw and the reasons allowed,
    from what the bytes parse to: unparsable or empty is exactly one MALFORMED,
    an Ack/Nack one UNKNOWN_PLAN (no nonce can match), a report at most one per
    step. Hello and Finished may be valid after a lucky mutation."""
    msg = worker_pb2.WorkerMessage()
    try:
        msg.ParseFromString(payload)
    except Exception:  # noqa: BLE001 - any parse failure must be a MALFORMED rejection
        return 1, 1, {"REJECT_REASON_MALFORMED"}
    kind = msg.WhichOneof("payload")
    if kind is None:
        return 1, 1, {"REJECT_REASON_MALFORMED"}
    if kind in ("ack", "nack"):
        return 1, 1, {"REJECT_REASON_UNKNOWN_PLAN"}
    if kind == "reports":
        return 0, len(msg.reports.steps), {"REJECT_REASON_INVALID_FIELD", "REJECT_REASON_STALE_STEP",
                                           "REJECT_REASON_UNKNOWN_REQUEST"}
    return 0, 1, {"REJECT_REASON_INVALID_FIELD", "REJECT_REASON_UNKNOWN_REQUEST"}


def test_random_and_mutated_bytes_on_a_stream(rig):
    before = rig.healthy_snapshot()
    hello = make_hello("fuzz-bytes")
    stream = rig.call(RawStream(rig.channel, hello).open())
    seen = {"step_id": 0}

    async def last_step_id() -> int:
        return rig.server.controller.workers[hello.worker_id].session.last_step_id

    @budget(ci_examples=500)
    @given(st.lists(JUNK, min_size=1, max_size=4))
    def example(junk: list[bytes]) -> None:
        acked = stream.take_acks()
        rehello = -1  # index (in payloads) of the last Hello: plans received before it may be void
        for i, payload in enumerate(junk):
            msg = worker_pb2.WorkerMessage()
            try:
                msg.ParseFromString(payload)
                seen["step_id"] = max([seen["step_id"], *(s.step_id for s in msg.reports.steps)])
            except Exception:  # noqa: BLE001 - unparsable: no step id to track
                continue
            if msg.WhichOneof("payload") == "hello":  # a lucky mutation may re-register the worker
                rehello = len(acked) + i
        payloads = [*acked, *junk]
        if seen["step_id"] >= UINT64_MAX:  # junk reached the last step id: a new drafter version starts over
            hello.drafter.version += "+"
            rehello = len(payloads)
            payloads.append(worker_pb2.WorkerMessage(hello=hello).SerializeToString())
            seen["step_id"] = 0
        seen["step_id"] += 1
        # Depth 0: valid whatever drafter limits a lucky junk Hello registered.
        good = worker_pb2.StepReport(step_id=seen["step_id"], timestamp=1.0, batch_size=1, draft_ms=0.0,
                                     verify_ms=9.0, requests=[worker_pb2.RequestStep(request_id="b-good")])
        payloads.append(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[good])).SerializeToString())
        rig.count("bytes", len(junk))
        got = rig.call(stream.exchange(payloads))
        if rehello >= 0:  # a re-registration voids the plans in flight before it: never ACK them
            stream.forget_plans_until(rehello)
        acks = len(acked)
        assert not any(got[:acks]), [_names(g) for g in got[:acks]]
        assert not got[-1], _names(got[-1])
        for payload, rejections in zip(junk, got[acks:-1]):
            least, most, reasons = bound_for(payload)
            assert least <= len(rejections) <= most, (payload, _names(rejections))
            for r in rejections:
                assert plan_pb2.RejectReason.Name(r.reason) in reasons and r.field and r.detail, r
        assert rig.call(last_step_id()) == seen["step_id"]

    example()
    assert rig.status(hello.worker_id).workers[0].connected
    rig.assert_healthy_served(before)


def test_junk_as_the_first_message_ends_only_that_stream(rig):
    before = rig.healthy_snapshot()
    hellos = [worker_pb2.WorkerMessage(hello=make_hello(f"fuzz-first-{i}")).SerializeToString() for i in range(3)]

    async def first(payload: bytes) -> grpc.aio.AioRpcError | None:
        call = rig.channel.stream_stream(CONNECT, request_serializer=_identity, response_deserializer=_identity)()
        await call.write(payload)
        await call.done_writing()
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as err:
            return err
        return None

    @budget(ci_examples=120)
    @given(st.one_of(st.binary(max_size=200), mutated(hellos + TEMPLATES[1:])))
    def example(payload: bytes) -> None:
        rig.count("first message", 1)
        err = rig.call(first(payload))
        msg = worker_pb2.WorkerMessage()
        try:
            msg.ParseFromString(payload)
            kind = msg.WhichOneof("payload")
        except Exception:  # noqa: BLE001 - unparsable
            kind = None
        if err is None:  # only a valid Hello opens a stream (closed cleanly here)
            assert kind == "hello" and msg.hello.worker_id
        else:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details(), err

    example()
    rig.assert_healthy_served(before)


def test_random_and_mutated_decide_requests(rig):
    before = rig.healthy_snapshot()
    step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=1, draft_ms=1.0, verify_ms=10.0, requests=[
        worker_pb2.RequestStep(request_id="d-r1", context_len=100, depth=3, width=1, nodes=3, accepted=2)])
    templates = [m.SerializeToString() for m in (
        controller_pb2.DecideRequest(worker_id="fuzz-decide", hello=make_hello("fuzz-decide"),
                                     reports=worker_pb2.StepReports(steps=[step]),
                                     queries=[controller_pb2.DecideQuery(request_id="q", context_len=500,
                                                                         batch_size=8)]),
        controller_pb2.DecideRequest(worker_id="fuzz-decide", queries=[
            controller_pb2.DecideQuery(request_id="q2", context_len=4_000_000_000, batch_size=4_000_000_000)]),
    )]

    async def call(payload: bytes):
        decide = rig.channel.unary_unary(DECIDE, request_serializer=_identity, response_deserializer=_identity)
        try:
            return grpc.StatusCode.OK, await decide(payload, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details()

    @budget(ci_examples=300)
    @given(st.one_of(st.binary(max_size=300), mutated(templates)))
    def example(payload: bytes) -> None:
        rig.count("decide", 1)
        code, answer = rig.call(call(payload))
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
            (code, answer)
        if code == grpc.StatusCode.OK:
            request = controller_pb2.DecideRequest.FromString(payload)
            response = controller_pb2.DecideResponse.FromString(answer)
            assert len(response.decisions) == len(request.queries)
            assert all(r.reason and r.field and r.detail for r in response.rejections)
        else:
            assert answer

    example()
    assert rig.status().workers  # GetStatus answers with every worker the junk registered
    rig.assert_healthy_served(before)


def test_a_message_over_the_size_limit_ends_only_its_own_stream(rig):
    """grpc refuses a message over 4 MiB before our code sees it: the stream
    ends with RESOURCE_EXHAUSTED (its reason) and everything else goes on."""
    before = rig.healthy_snapshot()
    stream = rig.call(RawStream(rig.channel, make_hello("fuzz-huge")).open())
    huge = worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(request_id="x" * (5 << 20)))

    async def send_huge() -> grpc.StatusCode:
        await stream.call.write(huge.SerializeToString())
        await stream.call.done_writing()
        try:
            while await stream.call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
        return await stream.call.code()

    assert rig.call(send_huge()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    rig.count("oversized", 1)
    rig.assert_healthy_served(before)


# ------------------------------------------- regressions found by the fuzzing

async def wait_until_planned(rig: Rig, stream: RawStream, model: WorkerModel) -> None:
    """Send good steps until the controller has sent a plan."""
    while not stream.unacked:
        await stream.exchange([good_step(model)])


def test_a_nack_with_a_wrong_nonce_leaves_the_plan_in_flight(rig):
    stream = rig.call(RawStream(rig.channel, make_hello("fuzz-nack")).open())
    model = WorkerModel(stream.hello)
    rig.call(wait_until_planned(rig, stream, model))
    version, nonce, _ = stream.unacked[-1]
    wrong = worker_pb2.WorkerMessage(nack=worker_pb2.Nack(version=version, nonce=nonce + "x", reason="?"))
    acks = stream.take_acks()
    got = rig.call(stream.exchange([wrong.SerializeToString(), *acks]))
    # The wrong nonce is refused; the plan stayed in flight, so the real ACKs
    # that follow it (a plan, maybe a decisions push too) are all accepted.
    assert [_names(g) for g in got[:1 + len(acks)]] == [[("REJECT_REASON_UNKNOWN_PLAN", "nack")]] + [[]] * len(acks)
    state = rig.server.controller.workers["fuzz-nack"]
    assert version not in state.plans.pending and state.counters.nacks == 0


def test_a_hello_on_an_open_stream_moves_the_stream_to_the_new_drafter_version(rig):
    hello = make_hello("fuzz-rollout")
    stream = rig.call(RawStream(rig.channel, hello).open())
    model = WorkerModel(hello)
    rig.call(stream.exchange([good_step(model), good_step(model)]))
    rolled = worker_pb2.Hello()
    rolled.CopyFrom(hello)
    rolled.drafter.version = "v2"
    other = worker_pb2.Hello()
    other.CopyFrom(hello)
    other.worker_id = "someone-else"
    model.reregistered()
    got = rig.call(stream.exchange([worker_pb2.WorkerMessage(hello=rolled).SerializeToString(), good_step(model),
                                    worker_pb2.WorkerMessage(hello=other).SerializeToString()]))
    assert [_names(g) for g in got] == [[], [], [("REJECT_REASON_INVALID_FIELD", "hello.worker_id")]]
    [status] = rig.status("fuzz-rollout").workers
    assert status.hello.drafter.version == "v2" and status.steps_ingested == 1 and status.connected
    assert not rig.status("someone-else").workers


@pytest.mark.parametrize("request_step, field", [
    (dict(level_candidates=[1]), "requests[0].level_candidates"),  # depth 0
    (dict(draft_confidence=[0.5]), "requests[0].draft_confidence"),  # depth 0
    (dict(depth=2, width=1, nodes=2, accepted=2, draft_confidence=[0.5]), "requests[0].draft_confidence"),
    (dict(depth=2, width=1, nodes=2, accepted=0, draft_confidence=[math.nan]), "requests[0].draft_confidence[0]"),
])
def test_per_level_fields_must_match_the_levels_reached(request_step, field):
    from controller.protocol import Invalid, drafter_limits, validate_step

    step = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=1, verify_ms=5.0,
                                 requests=[worker_pb2.RequestStep(request_id="r", **request_step)])
    with pytest.raises(Invalid) as err:
        validate_step(step, drafter_limits(make_hello()), "steps[0]", 0)
    assert err.value.field == f"steps[0].{field}"


def test_a_request_twice_in_one_step_or_a_bad_finish_time_is_refused():
    from controller.protocol import Invalid, drafter_limits, validate_finished, validate_step

    twice = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=3, verify_ms=5.0, requests=[
        worker_pb2.RequestStep(request_id=rid) for rid in ("a", "b", "a")])
    with pytest.raises(Invalid, match="appears twice") as err:
        validate_step(twice, drafter_limits(make_hello()), "steps[0]", 0)
    assert err.value.field == "steps[0].requests[2].request_id"
    with pytest.raises(Invalid) as err:
        validate_finished(worker_pb2.RequestFinished(request_id="a", timestamp=math.inf))
    assert err.value.field == "finished.timestamp"
