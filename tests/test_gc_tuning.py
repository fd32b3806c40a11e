"""The controller and Python's garbage collector (issue #30, plan push p99).

- ``gc:`` in the config: validated, applied by ``specctl serve`` to its own
  process (thresholds, a freeze after start-up), visible on ``/metrics``
  with every collection's pause (``specctl_gc_*``).
- ``gc.hold_during_plan_push``: no automatic collection from a push's policy
  run until gRPC has taken the plan; the hold ends one loop turn after the
  take, and never outlives ``GC_HOLD_MAX_S``.
- A read yields to a plan's idle writer, so the plan leaves before that
  telemetry is ingested (``PlansOnTheWay``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import controller.service as service
from controller.config import ConfigError, GcSettings, PlanSettings, ServerConfig, StoreSettings, load_config
from controller.core.controller import Controller
from controller.observe.metrics_gc import GcPauses, gc_families, gc_pauses
from controller.server import start_server
from controller.service import PlansOnTheWay, SpeculationControllerServicer
from policies.presets import load_preset
from policies.table import Decision
from protos.speculation.v1 import plan_pb2, worker_pb2
from tests.support import free_port, http_get
from tests.test_plan_push import DrivenStream, _until
from worker.sdk.agent import step_to_proto


@pytest.fixture
def restore_gc():
    """These tests change the process's collector: put it back as it was."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_bad_gc_settings_are_refused_naming_field_and_value(tmp_path: Path) -> None:
    for text, expected in (("gc: {thresholds: [0, 10, 10]}", "gc.thresholds=[0, 10, 10]"),
                           ("gc: {thresholds: [700, 10]}", "gc.thresholds"),
                           ("gc: {hold_during_plan_push: sometimes}", "gc.hold_during_plan_push='sometimes'"),
                           ("gc: {freeze: true}", "gc.freeze=True")):
        path = tmp_path / "c.yaml"
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert expected in str(err.value), (text, str(err.value))
    path.write_text("gc: {thresholds: [5000, 20, 50], freeze_after_start: false}\n")
    assert load_config(path).gc == GcSettings(thresholds=(5000, 20, 50), freeze_after_start=False)


async def test_a_server_that_owns_its_process_applies_the_gc_settings(restore_gc) -> None:
    config = ServerConfig(listen="127.0.0.1:0", store=StoreSettings(path=""),
                          gc=GcSettings(thresholds=(4321, 17, 23)))
    gc.unfreeze()
    embedded = await start_server(config, "127.0.0.1:0")  # in someone else's process: hands off
    try:
        assert gc.get_threshold() != (4321, 17, 23) and gc.get_freeze_count() == 0
    finally:
        await embedded.stop(0)
    owner = await start_server(config, "127.0.0.1:0", tune_gc=True)
    try:
        assert gc.get_threshold() == (4321, 17, 23)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000 and gc_pauses().frozen > 10_000  # modules, the policy, the config ...
        # A policy reload freezes again (its new objects are long-lived too), at a housekeeping tick.
        await asyncio.sleep(0.2)  # housekeeping running
        gc.unfreeze()
        owner.controller.set_policy(load_preset("static"))
        deadline = time.monotonic() + 10
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert gc.get_freeze_count() > 10_000
    finally:
        await owner.stop(0)


def test_specctl_serve_applies_gc_settings_and_shows_pauses_on_metrics(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
                      f"store: {{path: ''}}\ngc: {{thresholds: [1234, 11, 12]}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        families = None
        while time.monotonic() < deadline:
            try:
                status, _, body = asyncio.run(http_get(f"http://127.0.0.1:{metrics_port}/metrics"))
            except OSError:
                time.sleep(0.2)
                continue
            if status == 200:
                families = {f.name: f.samples for f in text_string_to_metric_families(body.decode())}
                break
        assert families is not None, "no /metrics answer"
        thresholds = {s.labels["generation"]: s.value for s in families["specctl_gc_threshold"]}
        assert thresholds == {"0": 1234, "1": 11, "2": 12}
        assert families["specctl_gc_frozen_objects"][0].value > 10_000
        # The start-up collection before the freeze is a full one, timed like any other.
        counts = {s.labels["generation"]: s.value for s in families["specctl_gc_pause_seconds"]
                  if s.name == "specctl_gc_pause_seconds_count"}
        assert counts["2"] >= 1
        inf = {s.labels["generation"]: s.value for s in families["specctl_gc_pause_seconds"]
               if s.name == "specctl_gc_pause_seconds_bucket" and s.labels["le"] == "+Inf"}
        assert inf == counts
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_pause_histogram_counts_each_collection_once() -> None:
    ticks = iter([0.0, 0.003, 1.0, 1.2, 2.0, 2.0004])
    pauses = GcPauses(clock=lambda: next(ticks))
    for generation in (0, 2, 0):
        pauses._callback("start", {"generation": generation})
        pauses._callback("stop", {"generation": generation, "collected": 5, "uncollectable": 0})
    snap = pauses.snapshot()
    assert snap["collections"] == [2, 0, 1] and snap["collected"] == [10, 0, 5]
    assert snap["longest_s"][2] == pytest.approx(0.2) and snap["seconds"][0] == pytest.approx(0.0034)
    families = {f.name: f for f in gc_families(snap)}
    buckets = {(s.labels["generation"], s.labels["le"]): s.value for s in families["specctl_gc_pause_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0", "0.0005"] == 1 and buckets["0", "0.005"] == 2 and buckets["0", "+Inf"] == 2
    assert buckets["2", "0.1"] == 0 and buckets["2", "0.25"] == 1


def _servicer(hold: bool, policy=None) -> SpeculationControllerServicer:
    config = ServerConfig(plan=PlanSettings(steps_before_first_plan=0, recompute_interval_s=0.0,
                                            min_push_interval_s=0.0, hysteresis=0.0),
                          gc=GcSettings(hold_during_plan_push=hold))
    return SpeculationControllerServicer(Controller(config, policy or load_preset("static")))


class _WatchingPolicy:
    """The static preset, noting whether the collector was on while it decided."""

    def __init__(self) -> None:
        self.inner = load_preset("static")
        self.gc_enabled: list[bool] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decide(self, state, obs):
        self.gc_enabled.append(gc.isenabled())
        return self.inner.decide(state, obs)


@pytest.mark.parametrize("hold", [True, False])
async def test_no_collection_starts_between_a_push_and_its_write(hold: bool, restore_gc) -> None:
    gc.enable()
    policy = _WatchingPolicy()
    servicer = _servicer(hold, policy)
    a = DrivenStream(servicer, "w-gc")
    try:
        await _until(lambda: "w-gc" in servicer.streams)
        await a.report_step()
        holds = gc_pauses().holds
        servicer._push_plans(a.stream)  # the policy runs, the plan is queued for the idle writer
        assert policy.gc_enabled == [not hold]
        assert gc.isenabled() is (not hold)  # still held: the plan has not left
        await a.taken()
        await asyncio.sleep(0)  # the hold ends the turn after gRPC took the plan
        assert gc.isenabled() and not servicer.on_the_way
        assert gc_pauses().holds - holds == (1 if hold else 0)
    finally:
        await a.close()


async def test_a_hold_never_outlives_its_bound(monkeypatch, restore_gc) -> None:
    gc.enable()
    now = [100.0]
    plans = PlansOnTheWay(hold_gc=True, clock=lambda: now[0])
    stream = service.Stream(None, 4, plans)
    stream.send(service.wrap(plan_pb2.Plan(version=1)))  # a writer that never takes it
    assert not gc.isenabled() and plans
    now[0] += service.GC_HOLD_MAX_S / 2
    plans.expire()
    assert not gc.isenabled()
    now[0] += service.GC_HOLD_MAX_S
    plans.expire()
    assert gc.isenabled() and not plans and plans.holds_expired == 1


async def test_a_hold_leaves_a_collector_that_was_off_alone(restore_gc) -> None:
    gc.disable()
    plans = PlansOnTheWay(hold_gc=True)
    plans.begin_push()
    plans.end_push()
    assert not gc.isenabled() and plans.holds == 0


async def test_a_read_lets_a_queued_plan_leave_before_its_telemetry_is_ingested(monkeypatch) -> None:
    servicer = _servicer(hold=False)
    a, b = DrivenStream(servicer, "w-plan"), DrivenStream(servicer, "w-busy")
    order: list[str] = []
    try:
        await _until(lambda: {"w-plan", "w-busy"} <= set(servicer.streams))
        await a.report_step()
        await b.report_step()
        ingest = servicer.controller.ingest

        def noting_ingest(state, reports):
            order.append(f"ingest {state.worker_id}")
            return ingest(state, reports)

        monkeypatch.setattr(servicer.controller, "ingest", noting_ingest)
        taken = a.stream.taken
        monkeypatch.setattr(a.stream, "taken", lambda: (order.append("plan taken"), taken())[1])
        step = b.synthetic.step(lambda rid, ctx, batch: Decision.off(), 2, 500, prefix="w-busy-")
        # b's telemetry is read first (its reader is woken first), then a's plan is queued.
        b.inbox.put_nowait(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[step_to_proto(step)])))
        servicer._push_plans(a.stream)
        await _until(lambda: len(order) == 2)
        assert order == ["plan taken", "ingest w-busy"]
        assert servicer.reads_yielded >= 1
    finally:
        b.pull.cancel()  # b's writer is waiting for a message: let the cancellation land first
        await asyncio.sleep(0)
        for w in (a, b):
            await w.close()

