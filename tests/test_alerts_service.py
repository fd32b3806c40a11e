"""Drift alerts end to end over real gRPC: a worker whose acceptance drops in
one context bucket → WatchAlerts streams OPENED / RETRAIN_HEADS (and the
webhook and the command get it) → AckAlert → ACKNOWLEDGED, in the SQLite
store → a restarted controller on the same store has the open alert and the
baseline back → a new drafter version resolves the old alerts as superseded
and learns its own baseline. ReloadPolicy, refusals, and a controller with
the monitor off."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import controller.config

from controller.config import (AlertSettings, CommandSettings, ConfigError, DriftSettings, PlanSettings,
                               ServerConfig, StoreSettings, WebhookSettings, load_config)
from controller.alerts.proto import EXISTING_ALERTS_METADATA
from controller.drift import AcceptanceDriftMonitor, Action
from controller.server import RunningServer, start_server
from controller.alerts.store import StateStore
from policies.presets import PRESET_DIR
from policies.table import Decision
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, worker_pb2
from tests.support import SyntheticWorker, free_port, make_hello, wait_for
from tests.test_drift_monitor import FAST, custom_stream, feed
from tests.test_sinks import RECORDER, Hook
from worker.sdk.agent import AgentOptions, SpeculationAgent

E = controller_pb2.AlertEvent
DRIFTED = "ctx[1024,2048)"
CONTEXTS = (500, 1500)  # one request batch per bucket: [0,1024) and [1024,2048)


def alert_config(store: Path, **kw) -> ServerConfig:
    return ServerConfig(listen=f"127.0.0.1:{free_port()}", policy_poll_interval_s=0.1,
                        plan=PlanSettings(recompute_interval_s=0.2, min_push_interval_s=0.2),
                        drift=DriftSettings(cpu_fraction=1.0, monitor=FAST), store=StoreSettings(path=str(store)),
                        **kw)


class Fleet:
    """One worker running depth-6 chains on two context buckets; ``alpha`` per bucket is set by the test."""

    def __init__(self, server: RunningServer, version: str = "v1", seed: int = 0) -> None:
        self.server = server
        self.alpha = {500: 0.8, 1500: 0.8}
        self.worker = SyntheticWorker(lambda ctx: self.alpha[ctx], seed=seed)
        self.agent = SpeculationAgent(make_hello("w-drift", max_depth=6, version=version), server.address,
                                      AgentOptions(fallback=Decision.chain(6))).start()
        self.steps = 0

    async def run(self, steps: int) -> None:
        """``steps`` steps of batch 8 per bucket, then wait until the monitor has seen all of them."""
        chain = Decision.chain(6)
        feed = self.server.alerting.feed
        target = feed.observed + 2 * 8 * steps
        for _ in range(steps):
            for ctx in CONTEXTS:
                self.agent.observe(self.worker.step(lambda *_: chain, 8, ctx, prefix=f"c{ctx}-"))
            self.steps += 1
            if self.steps % 50 == 0:
                await asyncio.sleep(0.05)  # let the agent flush (its queue holds 4096 steps)
        await wait_for(lambda: feed.observed >= target, timeout=60)

    def close(self) -> None:
        self.agent.close()


class Watch:
    """A WatchAlerts stream read in the background."""

    def __init__(self, address: str, **request) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = controller_pb2_grpc.SpeculationControllerStub(self.channel).WatchAlerts(
            controller_pb2.WatchAlertsRequest(**request))
        self.events: list[controller_pb2.DriftAlert] = []
        self.ended: grpc.StatusCode | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                self.events.append(msg)
            self.ended = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            self.ended = err.code()
        except asyncio.CancelledError:  # our own cancel()
            self.ended = grpc.StatusCode.CANCELLED

    async def existing_count(self) -> int:
        return int(dict(await self.call.initial_metadata())[EXISTING_ALERTS_METADATA])

    def of(self, event: int) -> list[controller_pb2.DriftAlert]:
        return [m for m in self.events if m.event == event]

    async def close(self) -> None:
        self.call.cancel()
        await self.task
        await self.channel.close()


async def test_drift_alert_lifecycle_across_ack_restart_and_a_new_drafter_version(tmp_path: Path) -> None:
    store = tmp_path / "state.sqlite3"
    hook = Hook()
    script, runs = tmp_path / "retrain.py", tmp_path / "runs.jsonl"
    script.write_text(RECORDER)
    sinks = AlertSettings(webhook=WebhookSettings(urls=[hook.url]),
                          command=CommandSettings(argv=[sys.executable, str(script), str(runs)],
                                                  actions=["RETRAIN_HEADS"]))
    server = await start_server(alert_config(store, alerts=sinks))
    fleet = Fleet(server)
    watch = Watch(server.address, include_history=True)
    try:
        assert await watch.existing_count() == 0
        await fleet.run(200)  # baselines: 1600 request-steps per bucket
        assert watch.events == []
        fleet.alpha[1500] = 0.8 * 0.85  # the content moved, in one bucket only
        for _ in range(30):
            await fleet.run(50)
            if watch.of(E.ALERT_EVENT_OPENED):
                break
        await asyncio.sleep(0.2)
        (opened,) = watch.of(E.ALERT_EVENT_OPENED)
        assert opened.action == controller_pb2.ALERT_ACTION_RETRAIN_HEADS and opened.stratum == DRIFTED
        assert (opened.drafter_kind, opened.drafter_version) == (worker_pb2.DRAFTER_KIND_EAGLE, "v1")
        assert opened.status == controller_pb2.ALERT_STATUS_OPEN and opened.expected_tau_change < -0.05
        assert len(opened.baseline_hist) == 7 and sum(opened.baseline_hist) == opened.n_baseline >= 500

        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)
            acked = (await stub.AckAlert(controller_pb2.AckAlertRequest(alert_id=opened.id, acked_by="oncall"))).alert
            assert acked.id == opened.id and acked.acked_by == "oncall" and acked.acked_at > 0
            assert acked.status == controller_pb2.ALERT_STATUS_OPEN  # acknowledged, still open
            for request, code in ((controller_pb2.AckAlertRequest(alert_id="drift-999999"), grpc.StatusCode.NOT_FOUND),
                                  (controller_pb2.AckAlertRequest(), grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.AckAlert(request)
                assert err.value.code() == code
        await wait_for(lambda: watch.of(E.ALERT_EVENT_ACKNOWLEDGED))
        assert [(m.id, m.acked_by) for m in watch.of(E.ALERT_EVENT_ACKNOWLEDGED)] == [(opened.id, "oncall")]
        await asyncio.to_thread(server.alerting.store.flush)
        with sqlite3.connect(store) as conn:
            assert conn.execute("SELECT status, acked_by FROM alerts WHERE id = ?", (opened.id,)).fetchone() == \
                ("OPEN", "oncall")
            assert [e for (e,) in conn.execute("SELECT event FROM alert_events WHERE alert_id = ? ORDER BY seq",
                                               (opened.id,))] == ["opened", "acknowledged"]
        # The sinks got it too: the webhook every event, the command the opening.
        await wait_for(lambda: len(hook.bodies) == 2 and runs.exists())
        assert [(b["event"], b["alert"]["id"]) for b in hook.bodies] == [("opened", opened.id),
                                                                          ("acknowledged", opened.id)]
        assert f'"SPECCTL_ALERT_ID": "{opened.id}"' in runs.read_text()
        before = strata(server)
    finally:
        fleet.close()
        await server.stop(0)
        await watch.task
        hook.close()
    assert watch.ended == grpc.StatusCode.OK  # the stream ended with the server, cleanly

    # ---- restart on the same store: the open alert and the baselines are back.
    server = await start_server(alert_config(store))
    fleet = Fleet(server, seed=1)
    fleet.alpha[1500] = 0.8 * 0.85  # still drifted
    watch = Watch(server.address)
    try:
        assert await watch.existing_count() == 1
        await wait_for(lambda: len(watch.events) == 1)
        (back,) = watch.events
        assert (back.event, back.id, back.acked_by, back.status) == (E.ALERT_EVENT_EXISTING, opened.id, "oncall",
                                                                     controller_pb2.ALERT_STATUS_OPEN)
        assert strata(server) == before
        await fleet.run(300)  # many windows of drifted traffic: had the baseline been relearned, it would resolve
        assert strata(server)[DRIFTED] == before[DRIFTED]
        assert [m.id for m in server.alerting.monitor.open_alerts()] == [opened.id]
        assert len(watch.events) == 1

        # ---- the worker rolls to retrained heads: v1's alert resolves as superseded, v2 learns its own normal.
        fleet.close()
        fleet = Fleet(server, version="v2", seed=2)
        fleet.alpha = {500: 0.8, 1500: 0.8 * 0.85}
        await fleet.run(250)
        await wait_for(lambda: watch.of(E.ALERT_EVENT_RESOLVED))
        (resolved,) = watch.of(E.ALERT_EVENT_RESOLVED)
        assert resolved.id == opened.id and resolved.resolution == "superseded by eagle/v2"
        snapshot = server.alerting.monitor.snapshot()["versions"]
        assert [v["drafter_version"] for v in snapshot] == ["v2"]
        assert all(s["baseline_ready"] for s in snapshot[0]["strata"])
        assert server.alerting.monitor.open_alerts() == []

        history = Watch(server.address, include_history=True, drafter_version="v1")
        assert await history.existing_count() == 1
        await wait_for(lambda: len(history.events) == 1)
        assert history.events[0].status == controller_pb2.ALERT_STATUS_RESOLVED
        await history.close()
    finally:
        fleet.close()
        await server.stop(0)
        await watch.task
    with sqlite3.connect(store) as conn:
        assert list(conn.execute("SELECT drafter_version FROM baselines")) == [("v2",)]


def strata(server: RunningServer) -> dict[str, int]:
    """Baseline request-steps per stratum of v1."""
    (v1,) = [v for v in server.alerting.monitor.snapshot()["versions"] if v["drafter_version"] == "v1"]
    return {s["stratum"]: s["baseline"] for s in v1["strata"] if s["baseline_ready"]}


async def test_reload_policy_reports_what_is_in_force(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    shutil.copy(PRESET_DIR / "goodput.yaml", policy)
    config = alert_config(tmp_path / "state.sqlite3").model_copy(update={"policy": str(policy),
                                                                         "policy_poll_interval_s": 3600})
    server = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)
            policy.write_text("policy: static\ndepth: 99\n")
            refused = await stub.ReloadPolicy(controller_pb2.ReloadPolicyRequest())
            assert not refused.loaded and refused.policy == "goodput" and "depth" in refused.error
            policy.write_text("policy: static\ndepth: 2\n")
            loaded = await stub.ReloadPolicy(controller_pb2.ReloadPolicyRequest())
            assert (loaded.loaded, loaded.policy, loaded.error) == (True, "static", "")
            status = await stub.GetStatus(controller_pb2.GetStatusRequest())
            assert (status.policy_reloads, status.policy_reload_failures) == (1, 1)
    finally:
        await server.stop(0)


async def test_with_the_monitor_off_alert_calls_are_unavailable(tmp_path: Path) -> None:
    config = alert_config(tmp_path / "state.sqlite3").model_copy(update={"drift": DriftSettings(enabled=False)})
    server = await start_server(config)
    try:
        assert server.alerting is None and server.controller.on_step_rows == []
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.AckAlert(controller_pb2.AckAlertRequest(alert_id="drift-000001"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "drift.enabled" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.WatchAlerts(controller_pb2.WatchAlertsRequest()):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
    assert not (tmp_path / "state.sqlite3").exists()


async def test_malformed_alert_requests_are_refused(tmp_path: Path) -> None:
    server = await start_server(alert_config(tmp_path / "state.sqlite3"))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            ack = channel.unary_unary("/speculation.v1.SpeculationController/AckAlert")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ack(b"\xff\xff\xff")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.value.details()
    finally:
        await server.stop(0)


def drifted_store(path: Path) -> list[str]:
    """A store as a controller leaves it after a content drift: baselines and open RETRAIN_HEADS alerts."""
    data = custom_stream(6000, 10, (100, 4000), factor=np.r_[np.ones(3000), np.full(3000, 0.85)])
    mon = AcceptanceDriftMonitor(**FAST)
    feed(mon, data, t0=int(time.time()) - 6000)
    store = StateStore(str(path))
    for alert in mon.alerts.values():
        store.record_event("opened", alert.to_dict(), alert.opened_at)
    store.save_monitor(mon.to_dict(alerts=False), time.time())
    store.close()
    alerts = mon.open_alerts()
    assert alerts and all(a.action is Action.RETRAIN_HEADS for a in alerts)
    return [a.id for a in alerts]


CLI_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}


async def specctl(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "specctl.cli", *args, env=CLI_ENV,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


async def read_line(proc: asyncio.subprocess.Process, predicate) -> str:
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line, "specctl alerts --follow ended early"
        if predicate(line):
            return line


async def test_specctl_alerts_lists_follows_and_acknowledges(tmp_path: Path) -> None:
    store = tmp_path / "state.sqlite3"
    ids = drifted_store(store)
    server = await start_server(alert_config(store))  # restores the baselines and the open alerts
    follow = None
    try:
        rc, out = await specctl("alerts", "--controller", server.address)
        assert rc == 0 and all(i in out for i in ids) and "RETRAIN_HEADS" in out, out

        follow = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specctl.cli", "alerts", "--follow", "--controller", server.address, env=CLI_ENV,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        existing = await read_line(follow, lambda line: ids[0] in line)
        assert "EXISTING" in existing and "RETRAIN_HEADS" in existing and "OPEN" in existing

        rc, out = await specctl("alerts", "ack", ids[0], "--controller", server.address, "--by", "tester")
        assert rc == 0 and f"{ids[0]} acknowledged by tester" in out, out
        acked = await read_line(follow, lambda line: "ACKNOWLEDGED" in line)
        assert ids[0] in acked and "acked by tester" in acked

        rc, out = await specctl("alerts", "ack", "drift-999999", "--controller", server.address)
        assert rc == 1 and "NOT_FOUND" in out and "drift-999999" in out
        rc, out = await specctl("alerts", "--history", "--json", "--controller", server.address)
        lines = [json.loads(line) for line in out.splitlines()]
        assert rc == 0 and {d["alert"]["id"] for d in lines} == set(ids)
        assert {d["alert"]["acked_by"] for d in lines if d["alert"]["id"] == ids[0]} == {"tester"}
    finally:
        await server.stop(0)  # ends the follow stream cleanly
        if follow is not None:
            assert await asyncio.wait_for(follow.wait(), 60) == 0


@pytest.mark.parametrize("yaml_text, message", [
    ("drift: {sample_fraction: 0}", "drift.sample_fraction=0"),
    ("drift: {monitor: {window: 5}}", "window must be >= 20, got 5"),
    ("drift: {monitor: {windw: 500}}", "unknown field(s) windw"),
    ("drift: {monitor: {context_edges: [0, 10]}}", "context_len_edges"),
    ("alerts: {webhook: {urls: ['hooks.example/x']}}", "'hooks.example/x' is not an http:// or https:// URL"),
    ("alerts: {command: {argv: [retrain], actions: [RETRAIN]}}", "unknown action 'RETRAIN'"),
    ("alerts: {command: {events: [closed]}}", "unknown event 'closed'"),
    ("store: {pth: x.db}", "store.pth"),
])
def test_alert_settings_are_validated_naming_the_field(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_a_relative_store_path_is_taken_from_the_config_files_folder(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "controller.yaml"
    path.parent.mkdir()
    path.write_text("store: {path: state/alerts.sqlite3}\ndrift: {monitor: {ert: 1.0e8}}\n")
    config = load_config(path)
    assert config.store.path == str(tmp_path / "etc" / "state" / "alerts.sqlite3")
    assert ServerConfig().store.path == controller.config.DEFAULT_STORE_PATH  # tests/conftest.py moves it
    assert load_config(None).store.path == controller.config.DEFAULT_STORE_PATH
