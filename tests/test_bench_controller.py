"""``specctl bench controller``: the hand-encoded telemetry is valid protocol,
and a tiny run produces the JSON and PNG (no wall-clock assertions)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from bench.controller import JSON_KEYS, SectionTimers, WireLoadWorker, bench_hello, run_controller_bench
from controller.config import ServerConfig
from controller.core import Controller
from controller.protocol import drafter_limits, validate_finished, validate_step
from policies.presets import load_preset
from protos.speculation.v1 import worker_pb2
from tests.support import make_hello


def test_generated_messages_are_valid_protocol():
    w = WireLoadWorker(3, steps_per_s=50.0, seed=1)
    hello = worker_pb2.WorkerMessage.FromString(w.hello_bytes)
    assert hello.WhichOneof("payload") == "hello" and hello.hello.worker_id == w.worker_id
    limits = drafter_limits(bench_hello(w.worker_id))
    last_step, steps, finished_ids, seen = 0, 0, set(), set()
    # 600 steps: every request (lifetime 64..512 steps) finishes at least once.
    for tick in range(1, 41):
        msgs, n = w.due_messages(tick * 0.3, 1.7e9 + tick)
        assert 0 < n <= 64 * len(msgs)
        w.sent += n  # as the stream task does once the writes complete
        for data in msgs:
            msg = worker_pb2.WorkerMessage.FromString(data)
            kind = msg.WhichOneof("payload")
            if kind == "reports":
                assert len(msg.reports.steps) <= 64
                for i, step in enumerate(msg.reports.steps):
                    validate_step(step, limits, f"steps[{i}]", last_step)
                    last_step = step.step_id
                    steps += 1
                    assert step.batch_size == len(step.requests) == w.batch
                    for r in step.requests:
                        assert r.request_id not in finished_ids
                        assert (r.depth, r.width, r.nodes) == (3, 1, 3)
                        seen.add(r.request_id)
            else:
                assert kind == "finished"
                validate_finished(msg.finished)
                assert msg.finished.request_id in seen
                finished_ids.add(msg.finished.request_id)
    assert steps == int(40 * 0.3 * 50)
    assert finished_ids


def test_backlog_is_bounded_and_reported_as_dropped():
    w = WireLoadWorker(0, steps_per_s=50.0, seed=0)
    msgs, n = w.due_messages(1000.0, 1.7e9)  # 50 000 steps due at once
    assert n == 4096 and w.dropped == 50_000 - 4096
    first = worker_pb2.WorkerMessage.FromString(msgs[0])
    assert first.reports.dropped_steps == w.dropped
    assert sum(len(worker_pb2.WorkerMessage.FromString(m).reports.steps) for m in msgs) == 4096


@pytest.mark.timeout(120)
def test_tiny_bench_writes_json_and_png(tmp_path):
    out = io.StringIO()
    rc = run_controller_bench(tmp_path, workers=8, duration_s=1.5, steps_per_s=20.0,
                              decide_batches=5, decide_calls=2000, console=Console(file=out, width=120))
    assert rc == 0, out.getvalue()
    data = json.loads((tmp_path / "controller.json").read_text())
    for key in JSON_KEYS:
        assert key in data, key
    assert data["workers"] == 8 and isinstance(data["workers"], int)
    for key in JSON_KEYS[1:]:
        assert isinstance(data[key], float), (key, data[key])
    assert data["steps_per_s_ingested"] > 0
    assert data["steps_per_s_offered"] > 0
    assert data["bare_grpc_msgs_per_s"] > 0
    assert data["agent_decide_us_median"] > 0
    assert all(isinstance(data[k], bool) for k in data if k.startswith("goal_"))
    assert data["controller"]["rejections"] == 0  # the generator speaks valid protocol
    assert (tmp_path / "controller.png").stat().st_size > 0
    assert "steps/s ingested" in out.getvalue()


def test_section_timers_see_every_policy_run():
    """The controller bench times the policy where it runs (the plan desk), so
    ``run_policy_ms_mean`` is measured whether plan_updates or Decide ran it."""
    ctl = Controller(ServerConfig(), load_preset("goodput"), clock=lambda: 0.0)
    timers = SectionTimers(ctl)
    state = ctl.hello(make_hello("w-timed"))
    ctl.decide(state, "r0", 100, 1)  # no plan yet: Decide plans one
    ctl.plan_updates(state, force=True)
    assert timers.calls["run_policy"] == 2 and timers.calls["plan_updates"] == 1
    assert timers.seconds["run_policy"] > 0


@pytest.mark.timeout(180)
def test_tiny_bench_with_two_generators_and_a_config(tmp_path):
    """Workers split over two generator processes (both send, both receive plans; the first
    measures the window), and the controller runs the given config's gc settings."""
    config = tmp_path / "controller.yaml"
    config.write_text("gc: {thresholds: [900, 12, 14]}\n")
    out = io.StringIO()
    rc = run_controller_bench(tmp_path, workers=8, duration_s=1.5, steps_per_s=20.0, generators=2,
                              config=str(config), decide_batches=2, decide_calls=500,
                              console=Console(file=out, width=120))
    assert rc == 0, out.getvalue()
    data = json.loads((tmp_path / "controller.json").read_text())
    assert data["generators"] == 2 and data["controller"]["workers_registered"] == 8
    assert data["controller"]["rejections"] == 0 and data["controller"]["stream_errors"] == 0
    assert data["plans_received"] >= 8  # every worker's first plan, whichever generator it runs on
    gc_info = data["controller_gc"]
    assert gc_info["thresholds"] == [900, 12, 14] and gc_info["frozen_objects"] > 10_000
    assert len(gc_info["collections"]) == 3 and sum(gc_info["collections"]) > 0


def test_bench_refuses_a_bad_config_naming_the_field(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("gc: {thresholds: [0, 1, 1]}\n")
    out = io.StringIO()
    rc = run_controller_bench(tmp_path, workers=2, duration_s=1.0, config=str(config),
                              console=Console(file=out, width=200))
    assert rc == 2 and "gc.thresholds=[0, 1, 1]" in out.getvalue()
    rc = run_controller_bench(tmp_path, workers=2, duration_s=1.0, generators=3,
                              console=Console(file=out, width=200))
    assert rc == 2 and "generators=3" in out.getvalue()


def _reference_messages(index: int, seed: int, ticks: list[tuple[float, float]]) -> list[list[worker_pb2.WorkerMessage]]:
    """What one bench worker sends per tick, built plainly with protobuf objects from the
    generator's specification (same RNG draws in the same order as ``WireLoadWorker``):
    the fast path's hand-encoded bytes must decode to exactly these messages."""
    import math
    import random

    from bench.controller import ALPHA, CHAIN_DEPTH, FLUSH_S, MAX_STEPS_PER_MESSAGE, QUEUE_STEPS

    rng = random.Random(seed * 100_003 + index)
    worker_id = f"bench-w{index:04d}"
    rng.random()  # the tick offset
    acc = []
    for _ in range(1009):
        a = 0
        while a < CHAIN_DEPTH and rng.random() < ALPHA:
            a += 1
        acc.append(a)
    counter = {"next": 0}

    def new_request() -> dict:
        rid = f"{worker_id}-r{counter['next']}"
        counter["next"] += 1
        ctx = int(math.exp(rng.uniform(math.log(200), math.log(40_000))))
        return {"id": rid, "ctx": ctx, "left": rng.randint(64, 512), "generated": 0, "accepted": 0, "steps": 0}

    batch = 6 + index % 5
    slots = [new_request() for _ in range(batch)]
    acc_i, step_id, sent, dropped = 0, 0, 0, 0
    out = []
    for elapsed, timestamp in ticks:
        backlog = int(elapsed * 50.0) - sent - dropped
        unreported = 0
        if backlog > QUEUE_STEPS:
            dropped += backlog - QUEUE_STEPS
            unreported = backlog - QUEUE_STEPS
            backlog = QUEUE_STEPS
        tick_msgs, finished = [], []
        left = max(backlog, 0)
        while left > 0:
            reports = worker_pb2.StepReports()
            for _ in range(min(left, MAX_STEPS_PER_MESSAGE)):
                step_id += 1
                step = reports.steps.add(step_id=step_id, timestamp=timestamp, batch_size=len(slots))
                kv = 0
                for k, s in enumerate(slots):
                    a = acc[acc_i]
                    acc_i = (acc_i + 1) % len(acc)
                    step.requests.add(request_id=s["id"], context_len=s["ctx"], depth=CHAIN_DEPTH, width=1,
                                      nodes=CHAIN_DEPTH, accepted=a)
                    kv += s["ctx"]
                    s["ctx"] += a + 1
                    s["generated"] += a + 1
                    s["accepted"] += a
                    s["steps"] += 1
                    s["left"] -= 1
                    if s["left"] <= 0:
                        finished.append(worker_pb2.WorkerMessage(finished=worker_pb2.RequestFinished(
                            request_id=s["id"], generated_tokens=s["generated"], steps=s["steps"],
                            accepted_tokens=s["accepted"], timestamp=timestamp)))
                        slots[k] = new_request()
                step.verify_ms = max(10.0 + 2.5e-5 * kv, 0.06 * len(slots) * (1 + CHAIN_DEPTH))
                step.draft_ms = 0.3 + 0.4 * CHAIN_DEPTH + 0.002 * CHAIN_DEPTH * len(slots)
            reports.dropped_steps = unreported
            unreported = 0
            tick_msgs.append(worker_pb2.WorkerMessage(reports=reports))
            left -= len(reports.steps)
        sent += max(backlog, 0)
        out.append(tick_msgs + finished)
    assert FLUSH_S > 0
    return out


@pytest.mark.parametrize("index,seed", [(0, 0), (3, 1), (9, 7)])
def test_fast_encoding_decodes_to_the_reference_messages(index, seed):
    """The template-patched wire bytes (per-slot id fields, pre-encoded context fields, a
    slice of the acceptance cycle per step, finish counts from context growth) decode to
    the messages a plain protobuf build of the same simulation makes: every step, request,
    finish and dropped count, over request turnover and a backlog past the queue bound."""
    ticks = [(t * 0.1, 1.7e9 + t * 0.1) for t in range(1, 300)]
    ticks.append((ticks[-1][0] + 8.0, 1.7e9 + 40.0))  # 400 steps due at once: 7 messages in one tick
    ticks.append((ticks[-1][0] + 100.0, 1.7e9 + 140.0))  # 5000 due: 4096 sent, the rest dropped and reported
    ticks += [(ticks[-1][0] + t * 0.1, 1.7e9 + 140.0 + t * 0.1) for t in range(1, 30)]
    expected = _reference_messages(index, seed, ticks)
    w = WireLoadWorker(index, steps_per_s=50.0, seed=seed, tick_grid_s=0.02, grid_phase_s=0.005)
    finished = 0
    for (elapsed, timestamp), want in zip(ticks, expected):
        msgs, n = w.due_messages(elapsed, timestamp)
        w.sent += n
        got = [worker_pb2.WorkerMessage.FromString(m) for m in msgs]
        assert got == want, (elapsed, [m.WhichOneof("payload") for m in got])
        finished += sum(m.WhichOneof("payload") == "finished" for m in got)
    assert finished > 10 and w.dropped > 0


def test_ticks_sit_on_the_generator_grid():
    """Each generator's workers tick on its grid slots (shifted per generator), spread over the flush interval."""
    from bench.controller import FLUSH_S, PhaseConfig

    cfgs = [PhaseConfig("p", "t", workers=64, steps_per_s=50.0, warmup_s=0.1, duration_s=1.0, shard=k, shards=2,
                        tick_grid_s=0.02) for k in range(2)]
    offsets = {}
    for cfg in cfgs:
        for i in cfg.indices:
            w = WireLoadWorker(i, 50.0, 0, cfg.tick_grid_s, cfg.grid_phase_s)
            slot = (w.offset - cfg.grid_phase_s) / cfg.tick_grid_s
            assert abs(slot - round(slot)) < 1e-9 and 0 <= w.offset < FLUSH_S + cfg.tick_grid_s
            offsets.setdefault(cfg.shard, set()).add(round(w.offset, 6))
    assert offsets[0] == {0.0, 0.02, 0.04, 0.06, 0.08}
    assert offsets[1] == {0.01, 0.03, 0.05, 0.07, 0.09}
    # No grid: the drawn offset as is, so other benchmarks' workers keep their spread.
    import random

    assert WireLoadWorker(5, 50.0, 0).offset == random.Random(5).random() * FLUSH_S
