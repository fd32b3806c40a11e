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
