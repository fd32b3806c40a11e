"""Several ``specctl serve`` replicas sharing state through a real ``redis-server``.

Three replica processes on loopback (``state: {backend: redis}``) and one
Redis, shared by the tests of this module in file order (each test uses its
own drafter versions and worker ids; the policy test runs after the ones
that compare plans, the Redis crash last). Workers are raw gRPC streams, as
an engine's own client would write them.

* the acceptance each replica plans from converges on the fleet's totals,
  and a worker that moves to a replica that never saw its drafter version
  gets a first plan equal to the one an identical worker gets where the
  statistics were learnt (a worker of an unknown version, planned from the
  prior, gets another one);
* a drift seen by the workers of two replicas opens one alert fleet-wide,
  streamed by WatchAlerts and acknowledged from any replica;
* a policy reload on one replica reaches the others, a refused file none;
* Redis hung (SIGSTOP), then killed (-9) and restarted empty mid-run:
  replicas keep answering, ingesting and planning, count the merges that
  failed, and reconcile when it is back.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import pytest
import redis
import yaml

from controller.alerts.proto import EXISTING_ALERTS_METADATA
from controller.models.cost import CostParams
from policies.presets import PRESET_DIR
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2
from tests.redis_support import RedisServer
from tests.support import free_port, http_get, make_hello
from tests.test_drift_monitor import FAST
from tests.test_integration_raw import RawStream

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs SIGHUP")

MERGE_S = 0.5
E = controller_pb2.AlertEvent


class Replica:
    """One ``specctl serve`` process with a config and a policy file of its own."""

    def __init__(self, folder: Path, index: int, redis_url: str) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.id = f"r{index}"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        self.policy = folder / "policy.yaml"
        shutil.copy(PRESET_DIR / "goodput.yaml", self.policy)
        config = {
            "listen": self.address, "policy": str(self.policy),
            "policy_poll_interval_s": 3600,  # reloads come from SIGHUP, ReloadPolicy and the other replicas
            "plan": {"recompute_interval_s": 0.2, "min_push_interval_s": 0.2},
            "store": {"path": ""},
            "metrics_listen": self.metrics_url.split("/")[2],
            "drift": {"cpu_fraction": 1.0, "monitor": FAST},
            "state": {"backend": "redis", "url": redis_url, "fleet": "replicas-test", "replica_id": self.id,
                      "merge_interval_s": MERGE_S, "heartbeat_interval_s": 0.5, "replica_ttl_s": 3.0,
                      "lease_ttl_s": 3.0, "seed_grace_s": 1.0, "op_timeout_s": 0.3, "connect_timeout_s": 0.3},
        }
        self.config = folder / "controller.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.log = folder / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Replica":
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=self.folder,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = controller_pb2_grpc.SpeculationControllerStub(channel)
            while True:
                assert self.proc.poll() is None, f"{self.id} exited: {self.log.read_text()[-3000:]}"
                try:
                    stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=1.0)
                    return
                except grpc.RpcError:
                    assert time.monotonic() < deadline, f"{self.id} never answered: {self.log.read_text()[-3000:]}"
                    time.sleep(0.1)

    def stop(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.log.read_text()


def run_fleet(folder: Path, make_replica: Callable[[Path, int, str], Replica] = Replica):
    """A Redis and three replicas (``make_replica(folder, index, url)``), for a
    module fixture to ``yield from``: yields (redis, replicas), then stops them
    and checks every replica stopped in order."""
    redis = RedisServer(folder / "redis").start()
    replicas = [make_replica(folder / f"r{i}", i, redis.url).start() for i in range(3)]
    try:
        for r in replicas:
            r.wait_ready()
        yield redis, replicas
    finally:
        logs = [r.stop() for r in replicas]
        redis.stop()
    for r, text in zip(replicas, logs):  # an orderly stop: a last merge, out of the directory
        assert "Traceback" not in text, f"{r.id}:\n{text[-4000:]}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    """A Redis and three replicas, shared by this module's tests."""
    yield from run_fleet(tmp_path_factory.mktemp("replicas"))


# ------------------------------------------------------------------ helpers

def chain_steps(rng: np.random.Generator, first_id: int, count: int, ctx: int, alpha: float, prefix: str,
                batch: int = 8, depth: int = 6) -> list[worker_pb2.StepReport]:
    """``count`` steps of ``batch`` requests drafting depth-``depth`` chains at ``ctx``, each position
    accepted with probability ``alpha``."""
    steps = []
    for k in range(count):
        accepted = np.minimum(rng.geometric(1.0 - alpha, size=batch) - 1, depth)
        steps.append(worker_pb2.StepReport(
            step_id=first_id + k, timestamp=time.time(), batch_size=batch, draft_ms=1.5, verify_ms=14.0,
            requests=[worker_pb2.RequestStep(request_id=f"{prefix}{i}", context_len=ctx, depth=depth, width=1,
                                             nodes=depth, accepted=int(a)) for i, a in enumerate(accepted)]))
    return steps


class Worker:
    """A raw stream to one replica, sending chain steps."""

    def __init__(self, channel: grpc.aio.Channel, hello: worker_pb2.Hello, seed: int = 0) -> None:
        self.stream = RawStream(channel, hello)
        self.rng = np.random.default_rng(seed)
        self.hello = hello

    async def open(self) -> "Worker":
        await self.stream.open()
        return self

    async def send(self, count: int, ctx: int, alpha: float, per_message: int = 10) -> None:
        for start in range(0, count, per_message):
            n = min(per_message, count - start)
            steps = chain_steps(self.rng, self.stream.next_step, n, ctx, alpha, f"{self.hello.worker_id}-c{ctx}-")
            self.stream.next_step += n
            await self.stream.send(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=steps)))
            await asyncio.sleep(0)

    async def send_step(self, step: worker_pb2.StepReport) -> None:
        step = worker_pb2.StepReport.FromString(step.SerializeToString())
        step.step_id = self.stream.next_step
        self.stream.next_step += 1
        await self.stream.send(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[step])))

    async def plan(self, timeout_s: float = 10.0) -> plan_pb2.Plan:
        deadline = time.monotonic() + timeout_s
        while not self.stream.of("plan"):
            assert time.monotonic() < deadline, f"{self.hello.worker_id}: no plan"
            await asyncio.sleep(0.01)
        plan = self.stream.of("plan")[0]
        await self.stream.ack(plan)
        return plan

    async def close(self) -> None:
        await self.stream.close()


def hello(worker_id: str, version: str, accelerator: str = "H100-SXM", current_plan_version: int = 0):
    h = make_hello(worker_id, max_depth=6, version=version)
    h.hardware.accelerator = accelerator
    h.current_plan_version = current_plan_version
    return h


async def status(channel: grpc.aio.Channel, worker_id: str = "") -> controller_pb2.GetStatusResponse:
    return await controller_pb2_grpc.SpeculationControllerStub(channel).GetStatus(
        controller_pb2.GetStatusRequest(worker_id=worker_id), timeout=5.0)


async def until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Await ``predicate()`` (a coroutine function) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


def alphas(ws: controller_pb2.WorkerStatus) -> dict[int, np.ndarray]:
    """Per-position acceptance the replica plans ``ws``'s worker from, per context bucket's lower edge."""
    return {s.context_len_min: np.array(s.alpha) for s in ws.acceptance}


async def metric(replica: Replica, name: str) -> float:
    """One sample of ``replica``'s /metrics (``name`` with its labels, as the text writes it)."""
    _, _, body = await http_get(replica.metrics_url)
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {replica.id}'s metrics")


def redis_fit(url: str, kind: tuple[str, str, str]) -> dict | None:
    """The fitted cost parameters the fleet stores for ``kind`` (accelerator, count, model), or None."""
    client = redis.Redis.from_url(url)
    try:
        raw = client.hget("specctl:{replicas-test}:cost:" + ":".join(kind), "params")
    finally:
        client.close()
    return json.loads(raw) if raw else None


def channels(replicas) -> list[grpc.aio.Channel]:
    return [grpc.aio.insecure_channel(r.address) for r in replicas]


# -------------------------------------------------------------------- tests

def test_without_a_state_section_no_redis_client_is_even_imported() -> None:
    code = ("import sys, asyncio\n"
            "from controller.config import ServerConfig\n"
            "from controller.server import start_server\n"
            "async def main():\n"
            "    running = await start_server(ServerConfig(listen='127.0.0.1:0', store={'path': ''}))\n"
            "    assert running.fleet is None and running.servicer.fleet is None\n"
            "    await running.stop(0)\n"
            "asyncio.run(main())\n"
            "assert 'redis' not in sys.modules, 'redis imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("state, expected", [
    ("{backend: redis}", "state={'backend': 'redis'}: Value error, backend: redis needs url"),
    ("{backend: redis, url: 'http://ops:s3cret@h:1'}", "url 'http://ops:***@h:1': must start with redis://"),
    ("{backend: redis, url: 'redis://h:1', merge_interval_s: 0}", "state.merge_interval_s=0: Input should be greater"),
    ("{backend: sqlite}", "state.backend='sqlite'"),
])
def test_a_bad_state_section_is_refused_naming_the_field(tmp_path: Path, state: str, expected: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(f"listen: 127.0.0.1:0\nstate: {state}\n")
    result = subprocess.run([sys.executable, "-m", "specctl.cli", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "s3cret" not in result.stderr


async def test_statistics_converge_and_a_moved_worker_is_planned_from_them(fleet) -> None:
    _, replicas = fleet
    a, b, c = chans = channels(replicas)
    try:
        # r0's workers only see short contexts, r1's only long ones: each replica's view of the other
        # bucket can only come from the fleet's totals.
        feeders = [await Worker(channel, hello(name, "conv"), seed).open()
                   for channel, name, seed in ((a, "conv-a0", 1), (a, "conv-a1", 2), (b, "conv-b0", 3))]
        for _ in range(4):
            await asyncio.gather(feeders[0].send(60, 300, 0.9), feeders[1].send(60, 300, 0.9),
                                 feeders[2].send(120, 1500, 0.3))
            await asyncio.sleep(0.1)

        async def views():
            sa = {w.hello.worker_id: w for w in (await status(a)).workers}
            sb = {w.hello.worker_id: w for w in (await status(b)).workers}
            if "conv-a0" not in sa or "conv-b0" not in sb:
                return None
            va, vb = alphas(sa["conv-a0"]), alphas(sb["conv-b0"])
            if va[0][0] < 0.8 or vb[1024][0] > 0.45 or va[1024][0] > 0.45 or vb[0][0] < 0.8:
                return None  # not merged yet
            return va, vb

        va, vb = await until(views, 15.0, "both replicas plan from both buckets' evidence")
        await asyncio.sleep(3 * MERGE_S)  # everything merged: the views agree
        sa = {w.hello.worker_id: w for w in (await status(a)).workers}
        sb = {w.hello.worker_id: w for w in (await status(b)).workers}
        va, vb = alphas(sa["conv-a0"]), alphas(sb["conv-b0"])
        for bucket, truth in ((0, 0.9), (1024, 0.3)):
            assert abs(va[bucket][0] - truth) < 0.05 and abs(vb[bucket][0] - truth) < 0.05, (bucket, va, vb)
            np.testing.assert_allclose(va[bucket][:3], vb[bucket][:3], atol=0.03)  # deeper: a few dozen trials
        # The directory says who serves whom, from any replica.
        async def placed():
            where = {p.worker_id: (p.replica_id, p.replica_live) for p in (await status(c)).placements}
            return where.get("conv-a0") == ("r0", True) and where.get("conv-b0") == ("r1", True)

        await until(placed, 5.0, "r2 telling where the workers are")
        assert sa["conv-a0"].replica_id == "r0" and sa["conv-a0"].replica_live

        # One step every newcomer reports: its four requests accept nothing. Planned from the fleet's
        # thousands of steps that is noise; planned from the prior it turns drafting down.
        probe = chain_steps(np.random.default_rng(9), 1, 1, 300, 0.9, "probe-", batch=4)[0]
        for r in probe.requests:
            r.accepted = 0
        mover = await Worker(a, hello("mover", "conv", accelerator="L4-moved")).open()
        await mover.send_step(probe)
        plan_on_a = await mover.plan()
        await mover.close()
        # It moves to r2, which never saw drafter "conv", and says which plan it decodes on.
        mover = await Worker(c, hello("mover", "conv", accelerator="L4-moved",
                                      current_plan_version=plan_on_a.version)).open()
        await mover.send_step(probe)
        moved_plan = await mover.plan(timeout_s=4 * MERGE_S + 2.0)
        twin = await Worker(a, hello("twin", "conv", accelerator="L4-moved")).open()
        await twin.send_step(probe)
        twin_plan = await twin.plan()
        stranger = await Worker(c, hello("stranger", "never-seen", accelerator="L4-moved")).open()
        await stranger.send_step(probe)
        prior_plan = await stranger.plan()
        assert moved_plan.version > plan_on_a.version
        assert list(moved_plan.table) == list(twin_plan.table)
        assert list(prior_plan.table) != list(moved_plan.table)  # what planning from the prior would give
        async def moved():
            ws = (await status(c, "mover")).workers[0]
            placements = {p.worker_id: p.replica_id for p in (await status(b)).placements}
            return ws.replica_id == "r2" and ws.replica_live and placements.get("mover") == "r2"

        await until(moved, 5.0, "the directory following the worker that moved")
        health = (await status(c)).fleet_store
        assert health.first_plans_held >= 2 and health.up and health.live_replicas == 3

        # The feeders' fitted step cost (H100-SXM x 1 x llama-3-8b) is the fleet's prior for that kind now:
        # a worker of that kind new to r2 starts from it, not from its roofline.
        fleet_fit = redis_fit(fleet[0].url, ("H100-SXM", "1", "llama-3-8b"))
        newcomer = await Worker(c, hello("cost-newcomer", "conv")).open()

        async def starts_from_the_fit():
            fit = redis_fit(fleet[0].url, ("H100-SXM", "1", "llama-3-8b")) or fleet_fit
            ws = (await status(c, "cost-newcomer")).workers
            if not fit or not ws:
                return None
            cm = ws[0].cost_model
            return fit if abs(cm.mem_ms - fit["mem_ms"]) < 1e-9 and abs(
                cm.compute_ms_per_token - fit["compute_ms_per_token"]) < 1e-12 else None

        fit = await until(starts_from_the_fit, 12.0, "a new worker on r2 starting from the fleet's cost fit")
        roofline = CostParams.from_hardware(3350, 989, 16e9, 131072, 8e9)
        assert abs(fit["mem_ms"] - roofline.mem_ms) > 0.5  # the fit is not the roofline it started from
        for w in (*feeders, mover, twin, stranger, newcomer):
            await w.close()
    finally:
        for ch in chans:
            await ch.close()


class Watch:
    """A WatchAlerts stream (history included) read in the background."""

    def __init__(self, channel: grpc.aio.Channel, drafter_version: str) -> None:
        self.call = controller_pb2_grpc.SpeculationControllerStub(channel).WatchAlerts(
            controller_pb2.WatchAlertsRequest(include_history=True, drafter_version=drafter_version))
        self.events: list[controller_pb2.DriftAlert] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.call:
                self.events.append(msg)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    def opened(self) -> list[controller_pb2.DriftAlert]:
        return [m for m in self.events if m.event in (E.ALERT_EVENT_OPENED, E.ALERT_EVENT_EXISTING)
                and m.status == controller_pb2.ALERT_STATUS_OPEN]

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_a_drift_on_two_replicas_opens_one_alert_seen_everywhere(fleet) -> None:
    _, replicas = fleet
    chans = channels(replicas)
    watches = [Watch(ch, "drifting") for ch in chans]
    try:
        workers = [await Worker(chans[i], hello(f"drift-{i}", "drifting"), 10 + i).open() for i in (0, 1)]

        async def both_buckets(w: Worker, alpha_long: float) -> None:  # one write at a time per stream
            await w.send(20, 500, 0.8)
            await w.send(20, 1500, alpha_long)

        async def run(alpha_long: float, steps: int) -> None:
            for _ in range(steps // 20):
                await asyncio.gather(*(both_buckets(w, alpha_long) for w in workers))
                await asyncio.sleep(0.05)

        await run(0.8, 160)  # baselines (FAST: 500 request-steps per stratum) on both replicas
        await asyncio.sleep(1.0)
        assert not any(w.opened() for w in watches)

        async def opened_everywhere():
            await run(0.5, 40)  # the drafter got worse on long contexts, for both replicas' workers
            return all(w.opened() for w in watches)

        await until(opened_everywhere, 40.0, "an alert streamed by every replica", interval_s=0.0)
        await run(0.5, 120)  # both replicas keep seeing the drift: still one alert
        await asyncio.sleep(2.0)
        ids = {m.id for w in watches for m in w.opened()}
        assert len(ids) == 1, [(m.id, m.stratum) for w in watches for m in w.opened()]
        [alert_id] = ids
        assert all(len(w.opened()) == 1 for w in watches)
        assert watches[0].opened()[0].stratum == "ctx[1024,2048)"
        opened = [await metric(r, 'specctl_fleet_drift_findings_total{outcome="opened"}') for r in replicas]
        assert sorted(opened) == [0.0, 0.0, 1.0]  # one replica opened it; r2 has no such workers at all
        assert opened[2] == 0.0

        # Acknowledged on the replica that did not open it (or on r2, which has no such workers at all):
        # every replica's history shows it, and a second ack changes nothing.
        stub = controller_pb2_grpc.SpeculationControllerStub(chans[2])
        acked = await stub.AckAlert(controller_pb2.AckAlertRequest(alert_id=alert_id, acked_by="oncall"))
        assert acked.alert.acked_by == "oncall"

        async def acked_everywhere():
            for ch in chans:
                history = controller_pb2_grpc.SpeculationControllerStub(ch).WatchAlerts(
                    controller_pb2.WatchAlertsRequest(include_history=True, drafter_version="drifting"))
                alerts = []
                async for msg in history:
                    if msg.event != E.ALERT_EVENT_EXISTING:
                        break
                    alerts.append(msg)
                    if len(alerts) == int(dict(await history.initial_metadata())[EXISTING_ALERTS_METADATA]):
                        break
                history.cancel()
                if [(m.id, m.acked_by) for m in alerts] != [(alert_id, "oncall")]:
                    return False
            return True

        await until(acked_everywhere, 10.0, "the ack in every replica's history")
        again = await controller_pb2_grpc.SpeculationControllerStub(chans[0]).AckAlert(
            controller_pb2.AckAlertRequest(alert_id=alert_id, acked_by="someone-else"))
        assert again.alert.acked_by == "oncall"
        for w in workers:
            await w.close()
    finally:
        for w in watches:
            await w.close()
        for ch in chans:
            await ch.close()


async def test_a_policy_reload_on_one_replica_reaches_the_others(fleet) -> None:
    _, replicas = fleet
    chans = channels(replicas)
    try:
        before = [await status(ch) for ch in chans]
        assert {s.policy for s in before} == {"goodput"}
        replicas[0].policy.write_text("policy: static\ndepth: 2\n")
        replicas[0].proc.send_signal(signal.SIGHUP)

        async def everywhere():
            now = [await status(ch) for ch in chans]
            return now if {s.policy for s in now} == {"static"} else None

        now = await until(everywhere, 10.0, "the reload on every replica")
        assert [s.policy_reloads - b.policy_reloads for s, b in zip(now, before)] == [1, 1, 1]

        # A file r1 refuses stays on r1: the policy in force everywhere is unchanged.
        replicas[1].policy.write_text("policy: static\ndepth: 99\n")
        reply = await controller_pb2_grpc.SpeculationControllerStub(chans[1]).ReloadPolicy(
            controller_pb2.ReloadPolicyRequest())
        assert not reply.loaded and "depth" in reply.error
        await asyncio.sleep(1.5)
        later = [await status(ch) for ch in chans]
        assert {s.policy for s in later} == {"static"}
        assert [s.policy_reload_failures - n.policy_reload_failures for s, n in zip(later, now)] == [0, 1, 0]
        assert [s.policy_reloads for s in later] == [s.policy_reloads for s in now]
    finally:
        for ch in chans:
            await ch.close()


async def test_redis_killed_and_restarted_replicas_serve_count_and_reconcile(fleet) -> None:
    redis, replicas = fleet
    chans = channels(replicas)
    stop = asyncio.Event()
    workers = [await Worker(chans[i], hello(f"crash-{i}", "crash"), 20 + i).open() for i in (0, 1)]

    async def load(w: Worker, ctx: int, alpha: float) -> None:
        while not stop.is_set():
            await w.send(10, ctx, alpha)
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(load(workers[0], 300, 0.85)), asyncio.create_task(load(workers[1], 1500, 0.4))]
    try:
        await asyncio.sleep(1.5)
        # A Redis that hangs (SIGSTOP) first: answers stay quick, ingest goes on.
        before = [(await status(ch, f"crash-{i}")).workers[0].steps_ingested for i, ch in enumerate(chans[:2])]
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            slowest = 0.0
            for _ in range(6):
                for ch in chans:
                    t = time.monotonic()
                    await status(ch)
                    slowest = max(slowest, time.monotonic() - t)
                await asyncio.sleep(0.2)
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        assert slowest < 0.5, slowest
        after = [(await status(ch, f"crash-{i}")).workers[0].steps_ingested for i, ch in enumerate(chans[:2])]
        assert all(a > b for a, b in zip(after, before))
        await asyncio.sleep(1.0)
        base = [(await status(ch)).fleet_store for ch in chans]
        assert all(h.merges > 0 for h in base)
        redis.kill()
        ingested = [(await status(ch, f"crash-{i}")).workers[0].steps_ingested for i, ch in enumerate(chans[:2])]
        t0 = time.monotonic()
        # While it is down: a newcomer still gets its first plan (the hold ends at its bound), ingest goes on.
        newcomer = await Worker(chans[2], hello("crash-new", "crash-unknown")).open()
        await newcomer.send(2, 300, 0.8)
        await newcomer.plan(timeout_s=4 * MERGE_S + 3.0)
        await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        down = [await status(ch) for ch in chans]
        assert all(not s.fleet_store.up and s.fleet_store.failed_merges > b.failed_merges
                   for s, b in zip(down, base)), [s.fleet_store for s in down]
        assert down[0].fleet_store.unmerged_evidence > 0
        for i, ch in enumerate(chans[:2]):
            assert (await status(ch, f"crash-{i}")).workers[0].steps_ingested > ingested[i]

        redis.start()  # the same port, empty: a replica that had synced re-seeds the totals

        async def reconciled():
            now = [(await status(ch)).fleet_store for ch in chans]
            ok = all(h.up and h.merges > d.fleet_store.merges and h.live_replicas == 3 for h, d in zip(now, down))
            return now if ok else None

        await until(reconciled, 15.0, "every replica merging again")
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(3 * MERGE_S)
        final = [(await status(ch)).fleet_store for ch in chans]
        assert all(h.unmerged_evidence < 1.0 for h in final), final
        failed = [h.failed_merges for h in final]
        await asyncio.sleep(2 * MERGE_S)
        assert [(await status(ch)).fleet_store.failed_merges for ch in chans] == failed  # none since
        # The totals were re-seeded (each replica offering the strata the seeder did not hold) and every
        # replica installs them again: r1 plans r0's bucket from r0's evidence and back, as before.
        seen = []

        async def agree():
            va = alphas((await status(chans[0], "crash-0")).workers[0])
            vb = alphas((await status(chans[1], "crash-1")).workers[0])
            seen[:] = [{c: va[c][:3].round(3).tolist() for c in (0, 1024)},
                       {c: vb[c][:3].round(3).tolist() for c in (0, 1024)}]
            # Each replica plans both buckets from the fleet's settled posterior (the prior says 0.6), the
            # carry included (it runs in the fleet's roll). Within 0.05 of the truth at positions 1-3:
            # position 3 of the 0.4 bucket has ~260 trials a tick, ~0.011 of binomial noise at the cap.
            # (Before the carry left the replicas, one replica once sat 0.07 off after a re-seed.)
            return all(np.abs(v[c][:3] - truth).max() < 0.05
                       for v in (va, vb) for c, truth in ((0, 0.85), (1024, 0.4)))

        try:
            await until(agree, 5.0, "both replicas planning from the same reconciled totals")
        except AssertionError as err:
            raise AssertionError(f"{err}: r0, r1 see {seen}") from None
        # The subscribers reconnected too: a reload reaches the other replicas again.
        before = [(await status(ch)).policy_reloads for ch in chans[:2]]
        replicas[2].policy.write_text("policy: static\ndepth: 3\n")
        reply = await controller_pb2_grpc.SpeculationControllerStub(chans[2]).ReloadPolicy(
            controller_pb2.ReloadPolicyRequest())
        assert reply.loaded

        async def reloaded():
            return [(await status(ch)).policy_reloads for ch in chans[:2]] == [n + 1 for n in before]

        await until(reloaded, 10.0, "a reload after the restart reaching the others")
        await newcomer.close()
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in workers:
            await w.close()
        for ch in chans:
            await ch.close()
