"""``specctl bench fleet``: several ``specctl serve`` replicas under one fleet
of real agents, with the embedded store and with Redis side by side in one run.

Processes (every one stopped in ``finally``):

- **replicas**: ``replicas`` × ``python -m specctl.cli serve --config FILE``,
  each on a free loopback port with its own SQLite store and a drift monitor
  sized for seconds rather than hours (``FAST_MONITOR``). In the Redis phase
  each also has ``state: {backend: redis}`` against one ``redis-server``
  started here in a temporary folder (no persistence).
- **the fleet**: this process runs ``workers`` real
  :class:`~worker.sdk.agent.SpeculationAgent` s on its own event loop, each
  given every replica's address, so rendezvous hashing spreads them and
  failover is the agent's own. Every ``1 / steps_per_s`` seconds each worker
  makes one step of ``requests`` chain requests: ``decide`` per request,
  acceptance drawn per position (α = 0.8), contexts that start at 500 or
  1,500 tokens (the [0, 1024) and [1024, 2048) buckets) and grow with the
  tokens made, a ``RequestFinished`` when a request ends.

Each phase (``embedded``, then ``redis``, the same load):

0. **idle**: the replicas' CPU over ``idle_s`` with no worker connected.
1. **warm-up**: until every agent has ACKed a plan, and at least ``warmup_s``.
2. **CPU** over ``measure_s``: CPU time (user + system, every thread) of each
   replica from ``/proc/<pid>/stat``, and of ``redis-server``; steps
   ingested from ``GetStatus`` (Σ ``steps_ingested``) at both ends.
   ``cpu_per_1k_steps`` = replicas' CPU milliseconds per 1,000 steps
   ingested; ``..._marginal`` the same above their idle CPU. Redis commands
   per second from ``INFO commandstats``. Plan push = the agent's time of
   applying a plan − ``Plan.created_at`` (one machine clock), per replica,
   for every plan from the end of the warm-up until the kill (steps 2–4;
   the drops make the policies re-plan).
3. **fleet-posterior convergence**: acceptance in [1024, 2048) drops to
   α = 0.5 on the workers of replica 0 only; every 0.5 s ``GetStatus`` on
   each replica reads α₁ (position 1) of that stratum. The spread is the
   largest minus the smallest replica's α₁; convergence time = the last
   moment the spread exceeded ``CONVERGED_SPREAD`` after the drop (0 if it
   never did; ``None`` if it still does at the end: replicas that share
   nothing never agree). Propagation time = the first moment every other
   replica's α₁ is ``PROPAGATED`` below its value before the drop (``None``
   if never: nothing reaches them without shared state).
4. **alerts**: the drop reaches every worker; for ``alert_s`` every
   replica's open alerts are read each second through ``WatchAlerts``. With
   Redis alert ids are fleet-wide, so the open alerts of a stratum are the
   distinct ids any replica lists; with the embedded store each replica's own
   are added up. ``open_alerts_max_per_stratum`` is the largest count seen.
   Then every alert the replicas know (with their history) is timed against
   the drift (``drift``: detection delay from the drop on replica 0's
   workers, alerts opened before it), and each replica's drift feed
   counters are read from its ``/metrics`` (evidence the monitor saw,
   dropped or shed, forwarded). Then the plan push latency at the agents
   over the plans since the warm-up (``plan_push_ms``), and from each
   replica's ``/metrics`` its own part of it over its plans of the last
   minute: created to taken by gRPC (``plan_handoff_ms``,
   ``specctl_plan_handoff_seconds``).
5. **failover**: ``kill -9`` of replica 0. For each of its workers, the time
   from the kill to the first plan it ACKed from another replica; the
   fallback decisions made meanwhile; then, with the load paused and every
   receipt in, the steps the new replica read against the steps sent minus
   those the dead replica had confirmed (``acknowledged_steps_lost``,
   ``steps_read_twice``).

The Redis phase also reads, at the end, the memory of every key of the fleet
(``MEMORY USAGE``) to give bytes per stratum and per drafter version.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
import yaml

from controller.alerts.proto import EXISTING_ALERTS_METADATA
from policies.table import Decision
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, worker_pb2
from worker.sdk.agent import AgentOptions, SpeculationAgent
from worker.sdk.placement import HEALTH_CHECK, health_request, health_serving
from worker.sdk.telemetry import RequestSummary, RequestTelemetry, StepTelemetry

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "speculation.v1.SpeculationController"
JSON_KEYS = ("cpu_per_1k_steps_redis", "cpu_per_1k_steps_embedded", "failover_s_p99", "plan_push_ms_p99",
             "open_alerts_max_per_stratum")
CONTEXTS = (500, 1500)
DRIFT_CONTEXT = 1500  # its bucket [1024, 2048) drifts
DRIFT_BUCKET_MIN = 1024
ALPHA = 0.8
DRIFT_ALPHA = 0.5
MAX_DEPTH = 6
CONVERGED_SPREAD = 0.02
TRUTH_WINDOW_S = 3.0  # the last seconds of the convergence window: the replicas' settled α₁ against the fleet's
PROPAGATED = 0.05  # a drop of α₁ this large on a replica whose workers did not see it: well above its noise
# The drift monitor at the sizes tests use (tests/test_drift_monitor.py FAST): baselines and
# windows of a few hundred request-steps, so an alert opens seconds after a drop, not hours.
FAST_MONITOR = dict(baseline_steps=500, window=300, round_steps=500, ert=2_000_000, n_bootstrap=512, cusum_paths=128,
                    cusum_horizon=2048)
DRIFT_MONITORS = ("replica", "fleet")  # state.drift_monitor of the Redis replicas
GOAL_FAILOVER_S = 5.0
GOAL_REDIS_CPU = 0.10
GOAL_PUSH_P99_MS = 5.0
READY_TIMEOUT_S = 60.0


class BenchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its threads (``/proc/<pid>/stat``).

    >>> cpu_seconds(os.getpid()) >= 0.0
    True
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14, stime 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def health_check(address: str, timeout_s: float = 1.0) -> bool:
    """Whether the controller at ``address`` answers the gRPC health check with SERVING (blocking)."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_serving(channel.unary_unary(HEALTH_CHECK)(health_request(SERVICE), timeout=timeout_s))
        except grpc.RpcError:
            return False


class ReplicaProcess:
    """One ``specctl serve`` as a child process: its config file, port, SQLite store and log in ``folder``.

    Parameters
    ----------
    folder : Path
        Where its files go.
    name : str
        File names and the log's.
    config : dict
        Server config fields besides ``listen`` and ``store`` (``plan``, ``drift``, ``state``, ...).
    port : int, optional
        Default a free one; kept across :meth:`kill` and :meth:`start`.
    """

    def __init__(self, folder: Path, name: str, config: dict | None = None, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = port or free_port()
        self.config = {"listen": f"127.0.0.1:{self.port}", "store": {"path": str(self.folder / f"{name}.sqlite3")},
                       **(config or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.folder / f"{name}.log"
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> "ReplicaProcess":
        """Start it and wait until its health check says SERVING (blocking)."""
        path = self.folder / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(path)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.folder, env=env)
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while not health_check(self.address, 0.5):
            if self.proc.poll() is not None:
                raise BenchError(f"specctl serve ({self.name}) exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"specctl serve ({self.name}) did not answer within {timeout_s:.0f} s: "
                                 f"{self.log_tail()}")
            time.sleep(0.05)
        return self

    def log_tail(self, lines: int = 8) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def cpu_s(self) -> float:
        if self.pid is None:
            raise BenchError(f"{self.name} is not running")
        return cpu_seconds(self.pid)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed or said goodbye to."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: a hung replica (its sockets stay open, nothing answers)."""
        if self.pid is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.pid is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, should it be paused), SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class RedisServer:
    """One ``redis-server`` (Debian's, ``make redis``) on a loopback port, in ``folder``.

    Used by the fleet benchmark's Redis phase and by the tests
    (``tests/redis_support.py``). ``persist``: ``appendonly yes`` with
    ``appendfsync always``, so a SIGKILL loses nothing acknowledged; off (the
    default), a restart starts empty. ``port``: fixed, default a free one.
    :meth:`kill` is a crash (SIGKILL), :meth:`restart` comes back on the same
    port.
    """

    def __init__(self, folder: Path, persist: bool = False, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.folder / "redis.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start on ``self.port`` and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchError("redis-server is not installed: `make redis` installs Debian's "
                             "(apt-get install --no-install-recommends redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--save", "", "--daemonize", "no", "--logfile", str(self.log_path),
                "--appendonly", "yes" if self.persist else "no"]
        if self.persist:
            args += ["--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, cwd=self.folder)
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"redis-server on port {self.port} exited with {self.proc.returncode}: "
                                 f"{self._log_tail()}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise BenchError(f"redis-server on port {self.port} did not answer within {timeout_s} s: {self._log_tail()}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def client(self):
        import redis  # the controller extra's; only the Redis phase needs it

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5.0)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no save."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> "RedisServer":
        """Kill (if running) and start again on the same port."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def fleet_hello(worker_id: str) -> worker_pb2.Hello:
    """The Hello of a simulated fleet worker: an H100 serving llama-3-8b with a depth-6 EAGLE chain drafter."""
    return worker_pb2.Hello(
        worker_id=worker_id, engine="bench-fleet", model="llama-3-8b",
        hardware=worker_pb2.Hardware(accelerator="H100-SXM", count=1, memory_bandwidth_gb_s=3350, peak_tflops=989,
                                     weight_bytes=16e9, kv_bytes_per_token=131072, params=8e9),
        drafter=worker_pb2.Drafter(kind=worker_pb2.DRAFTER_KIND_EAGLE, version="v1", max_depth=MAX_DEPTH,
                                   max_width=1, max_tree_nodes=MAX_DEPTH, trained_context_len=8192),
        max_batch_size=256)


@dataclass
class _Sim:
    """One simulated worker's traffic: ``requests`` request slots ``[id, start context, context, tokens left]``."""

    agent: SpeculationAgent
    rng: random.Random
    requests: int
    alpha: dict[int, float] = field(default_factory=lambda: {c: ALPHA for c in CONTEXTS})
    step_id: int = 0
    next_request: int = 0
    slots: list = field(default_factory=list)
    # Position-1 trials and acceptances of requests in the drifted bucket: the fleet's truth there.
    drift_pos1: list = field(default_factory=lambda: [0, 0])

    def new_request(self) -> list:
        self.next_request += 1
        start = self.rng.choice(CONTEXTS)
        return [f"{self.agent.hello.worker_id}-r{self.next_request}", start, start, self.rng.randint(48, 96), 0, 0]

    def step(self) -> None:
        agent, rng = self.agent, self.rng
        while len(self.slots) < self.requests:
            self.slots.append(self.new_request())
        batch = len(self.slots)
        rows = []
        deepest = 0
        for i, slot in enumerate(self.slots):
            rid, start, ctx = slot[0], slot[1], slot[2]
            d = agent.decide(rid, ctx, batch)
            depth = d.depth
            alpha = self.alpha[start]
            accepted = 0
            while accepted < depth and rng.random() < alpha:
                accepted += 1
            if start == DRIFT_CONTEXT and depth:
                self.drift_pos1[0] += 1
                self.drift_pos1[1] += accepted > 0
            deepest = max(deepest, depth)
            rows.append(RequestTelemetry(rid, ctx, depth, 1 if depth else 0, depth, accepted,
                                         requested_depth=depth, requested_width=d.width if depth else 0,
                                         requested_nodes=d.max_nodes if depth else 0))
            made = accepted + 1
            slot[2] += made
            slot[3] -= made
            slot[4] += 1
            slot[5] += accepted
            if slot[3] <= 0:
                agent.finish(RequestSummary(rid, slot[2] - start, slot[4], slot[5], time.time()))
                self.slots[i] = self.new_request()
        self.step_id += 1
        tokens = sum(1 + r.nodes for r in rows)
        agent.observe(StepTelemetry(self.step_id, time.time(), batch, 0.3 + 0.4 * deepest, 10.0 + 0.06 * tokens,
                                    rows))


@dataclass(frozen=True)
class PlanSeen:
    at: float  # wall time the agent applied it
    replica: str
    push_ms: float  # at − Plan.created_at


class FleetLoad:
    """``workers`` real agents on the running event loop, every one given all ``addresses``,
    each stepping ``steps_per_s`` times a second.

    Parameters
    ----------
    addresses : sequence of str
        The replicas.
    workers : int
        Agents (worker ids ``{prefix}-000``, ...).
    steps_per_s : float
        Steps per second per worker.
    requests : int
        Requests in every step.
    options : callable, optional
        ``options(on_plan) -> AgentOptions`` (default: the agent's defaults with a depth-2 fallback,
        no moving back within ten minutes).
    """

    def __init__(self, addresses: Sequence[str], workers: int, steps_per_s: float = 50.0, requests: int = 8,
                 options: Callable[[Callable], AgentOptions] | None = None, prefix: str = "w", seed: int = 0) -> None:
        self.addresses = list(addresses)
        self.steps_per_s = steps_per_s
        self.plans: list[PlanSeen] = []
        self.paused = False
        self.sims: dict[str, _Sim] = {}
        for i in range(workers):
            wid = f"{prefix}-{i:03d}"
            agent = SpeculationAgent(fleet_hello(wid), self.addresses,
                                     (options or _default_options)(self._on_plan(wid)))
            self.sims[wid] = _Sim(agent, random.Random(seed * 100_003 + i), requests)
        self._tasks: list[asyncio.Task] = []

    def _on_plan(self, wid: str) -> Callable:
        def seen(plan) -> None:
            now = time.time()
            self.plans.append(PlanSeen(now, self.sims[wid].agent.stats.replica, (now - plan.created_at) * 1000.0))

        return seen

    @property
    def agents(self) -> dict[str, SpeculationAgent]:
        return {wid: s.agent for wid, s in self.sims.items()}

    def on(self, address: str) -> list[str]:
        """Worker ids whose stream is on ``address`` now."""
        return [wid for wid, s in self.sims.items() if s.agent.stats.replica == address and s.agent.stats.connected]

    def observed(self, wid: str) -> int:
        """Steps worker ``wid`` has made (its step ids are 1..this)."""
        return self.sims[wid].step_id

    def drift_pos1(self) -> tuple[int, int]:
        """Position-1 (trials, acceptances) every worker has drawn so far in the drifted bucket."""
        return (sum(s.drift_pos1[0] for s in self.sims.values()), sum(s.drift_pos1[1] for s in self.sims.values()))

    def set_alpha(self, wids, context: int, alpha: float) -> None:
        for wid in wids:
            self.sims[wid].alpha[context] = alpha

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(s.agent.run()) for s in self.sims.values()]
        self._tasks.append(asyncio.create_task(self._pace()))

    async def _pace(self) -> None:
        period = 1.0 / self.steps_per_s
        due = time.monotonic()
        while True:
            due += period
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -1.0:
                due = time.monotonic()  # more than a second behind: drop the backlog rather than burst
            if not self.paused:
                for s in self.sims.values():
                    s.step()

    async def settle(self, timeout_s: float = 10.0) -> bool:
        """With the load paused: wait until every agent's steps are sent and confirmed by a receipt."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.agent.backlog() == 0 for s in self.sims.values()):
                return True
            await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        for s in self.sims.values():
            s.agent.stop()
        pacer = self._tasks[-1] if self._tasks else None
        if pacer is not None:
            pacer.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _default_options(on_plan: Callable) -> AgentOptions:
    return AgentOptions(fallback=Decision.chain(2), on_plan=on_plan, return_after_s=600.0)


class Replicas:
    """gRPC stubs of a phase's replicas: GetStatus, open alerts."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.channels = {a: grpc.aio.insecure_channel(a) for a in addresses}
        self.stubs = {a: controller_pb2_grpc.SpeculationControllerStub(c) for a, c in self.channels.items()}

    async def status(self, address: str, worker_id: str = "", timeout_s: float = 10.0):
        return await self.stubs[address].GetStatus(controller_pb2.GetStatusRequest(worker_id=worker_id),
                                                   timeout=timeout_s)

    async def ingested(self, address: str) -> int:
        return sum(w.steps_ingested for w in (await self.status(address)).workers)

    async def alpha1(self, address: str, worker_id: str) -> float | None:
        """α at position 1 of the drifted stratum, as replica ``address`` holds it for ``worker_id``'s drafter."""
        try:
            reply = await self.status(address, worker_id, timeout_s=2.0)
        except grpc.aio.AioRpcError:
            return None
        for w in reply.workers:
            for s in w.acceptance:
                if s.context_len_min == DRIFT_BUCKET_MIN and s.alpha:
                    return s.alpha[0]
        return None

    async def open_alerts(self, address: str) -> list[controller_pb2.DriftAlert]:
        """The alerts replica ``address`` lists as open now (WatchAlerts' opening list)."""
        call = self.stubs[address].WatchAlerts(controller_pb2.WatchAlertsRequest(), timeout=5.0)
        try:
            count = int(dict(await call.initial_metadata()).get(EXISTING_ALERTS_METADATA, 0))
            alerts = []
            while len(alerts) < count:
                alerts.append(await call.read())
            return [a for a in alerts if a.status == controller_pb2.ALERT_STATUS_OPEN]
        except grpc.aio.AioRpcError:
            return []
        finally:
            call.cancel()

    async def follow_alerts(self, address: str, events: list[dict]) -> None:
        """Until cancelled: every alert event replica ``address`` sends on a WatchAlerts stream, with the wall
        time it arrived (an alert's ``opened_at`` is its evidence's step time, not when it could be seen)."""
        call = self.stubs[address].WatchAlerts(controller_pb2.WatchAlertsRequest())
        try:
            async for msg in call:
                events.append({"t": time.time(), "replica": address, "id": msg.id,
                               "event": controller_pb2.AlertEvent.Name(msg.event),
                               "context_len_min": msg.context_len_min, "opened_at": msg.opened_at})
        except grpc.aio.AioRpcError:
            pass
        finally:
            call.cancel()

    async def alert_history(self, address: str) -> list[controller_pb2.DriftAlert]:
        """Every alert replica ``address`` knows, open or resolved (WatchAlerts with its history)."""
        call = self.stubs[address].WatchAlerts(controller_pb2.WatchAlertsRequest(include_history=True), timeout=10.0)
        try:
            count = int(dict(await call.initial_metadata()).get(EXISTING_ALERTS_METADATA, 0))
            return [await call.read() for _ in range(count)]
        except grpc.aio.AioRpcError:
            return []
        finally:
            call.cancel()

    async def close(self) -> None:
        for c in self.channels.values():
            await c.close()


def replica_config(state: dict | None) -> dict:
    config: dict[str, Any] = {"drift": {"monitor": FAST_MONITOR}}
    if state is not None:
        config["state"] = state
    return config


async def _wait(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


def _summary(values: Sequence[float], digits: int = 3) -> dict:
    out = {"n": len(values)}
    for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
        v = percentile(values, q)
        out[name] = None if v is None else round(v, digits)
    return out


async def run_phase(backend: str, folder: Path, replicas: int, workers: int, steps_per_s: float, requests: int,
                    warmup_s: float, measure_s: float, converge_s: float, alert_s: float, idle_s: float = 5.0,
                    progress: Callable[[str], None] = print, drift_monitor: str = "replica", seed: int = 0,
                    failover: bool = True, drift_alpha: float = DRIFT_ALPHA,
                    ports: Sequence[int] | None = None) -> dict:
    """One backend's phase (see the module docstring); returns its measurements.

    ``seed``: the simulated workers' draws (the same seed, the same arrivals and acceptances up to the
    plans' effect on depth). ``failover``: run step 5 (``kill -9``); off, the phase ends after the alerts.
    ``drift_alpha``: the drifted bucket's acceptance after the drops (steps 3 and 4). ``ports``: the
    replicas' (default free ones); the agents place themselves by rendezvous over the addresses, so two
    phases on the same ports spread the same workers the same way."""
    redis = RedisServer(folder / "redis").start() if backend == "redis" else None
    procs: list[ReplicaProcess] = []
    load: FleetLoad | None = None
    view: Replicas | None = None
    followers: list[asyncio.Task] = []
    try:
        for i in range(replicas):
            state = ({"backend": "redis", "url": redis.url, "fleet": "bench", "replica_id": f"r{i}",
                      "drift_monitor": drift_monitor} if redis is not None else None)
            config = replica_config(state)
            # /metrics, for the drift feed's counters (read once, after the alerts) and the plans'
            # hand-off times; the status page's history sampler kept out of the CPU window (one sample
            # per worker when it first appears).
            config.update(metrics_listen=f"127.0.0.1:{free_port()}", status_sample_interval_s=86400.0,
                          metrics_plan_cells=False)
            procs.append(ReplicaProcess(folder, f"{backend}-r{i}", config, port=ports[i] if ports else None))
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs))
        addresses = [p.address for p in procs]
        progress(f"[{backend}] {replicas} replicas up: {', '.join(addresses)}")
        view = Replicas(addresses)
        # What a replica costs with no worker at all (housekeeping ticks, and with Redis its
        # periodic merges, heartbeats and leases): the part of the CPU that steps do not explain.
        idle0, t_idle = [p.cpu_s() for p in procs], time.monotonic()
        await asyncio.sleep(idle_s)
        idle_util = [(p.cpu_s() - c) / (time.monotonic() - t_idle) for p, c in zip(procs, idle0)]
        load = FleetLoad(addresses, workers, steps_per_s, requests, seed=seed)
        started = time.monotonic()
        await load.start()
        agents = load.agents
        if not await _wait(lambda: all(a.plan_version > 0 for a in agents.values()), 60.0):
            raise BenchError(f"[{backend}] not every agent got a plan within 60 s")
        await asyncio.sleep(max(0.0, warmup_s - (time.monotonic() - started)))
        spread = {a: len(load.on(a)) for a in addresses}
        progress(f"[{backend}] every agent has a plan; workers per replica {list(spread.values())}")

        # Alert events as they reach an operator, from here on (detection delay, false alarms).
        alert_events: list[dict] = []
        followers = [asyncio.create_task(view.follow_alerts(a, alert_events)) for a in addresses]

        # ---- CPU per ingested step, plan push, Redis commands.
        cpu0 = [p.cpu_s() for p in procs]
        redis_cpu0 = redis.cpu_s() if redis else 0.0
        commands0 = redis.client().info("commandstats") if redis else {}
        steps0 = [await view.ingested(a) for a in addresses]
        t0, plans0 = time.monotonic(), len(load.plans)
        await asyncio.sleep(measure_s)
        t1 = time.monotonic()
        cpu1 = [p.cpu_s() for p in procs]
        redis_cpu1 = redis.cpu_s() if redis else 0.0
        commands1 = redis.client().info("commandstats") if redis else {}
        steps1 = [await view.ingested(a) for a in addresses]
        steps = sum(steps1) - sum(steps0)
        cpu = sum(cpu1) - sum(cpu0)
        idle_cpu = sum(idle_util) * (t1 - t0)
        per_replica = []
        for i, a in enumerate(addresses):
            n = steps1[i] - steps0[i]
            per_replica.append({
                "address": a, "workers": spread[a], "steps_per_s": n / (t1 - t0),
                "cpu_util": (cpu1[i] - cpu0[i]) / (t1 - t0), "cpu_util_idle": idle_util[i],
                "cpu_per_1k_steps_ms": (cpu1[i] - cpu0[i]) * 1e6 / n if n else None,
            })
        out: dict[str, Any] = {
            "backend": backend, "window_s": t1 - t0, "idle_window_s": idle_s, "steps": steps,
            "steps_per_s": steps / (t1 - t0),
            "cpu_per_1k_steps_ms": cpu * 1e6 / steps if steps else None,
            # Above the idle replicas' own: what ingesting and planning for these steps cost.
            "cpu_per_1k_steps_marginal_ms": (cpu - idle_cpu) * 1e6 / steps if steps else None,
            "replicas": per_replica,
        }
        if redis is not None:
            out["redis_server_cpu_per_1k_steps_ms"] = (redis_cpu1 - redis_cpu0) * 1e6 / steps if steps else None
            calls = {k: v["calls"] - commands0.get(k, {}).get("calls", 0) for k, v in commands1.items()}
            calls.pop("cmdstat_info", None)  # our own reads
            out["redis_commands_per_s"] = {k.removeprefix("cmdstat_"): round(v / (t1 - t0), 2)
                                           for k, v in sorted(calls.items()) if v}
            out["redis_ops_per_s"] = sum(calls.values()) / (t1 - t0)
            usec = {k.removeprefix("cmdstat_"): v["usec_per_call"] for k, v in commands1.items()}
            out["redis_usec_per_call"] = usec
        progress(f"[{backend}] {out['steps_per_s']:.0f} steps/s ingested, "
                 f"{out['cpu_per_1k_steps_ms']:.1f} ms CPU per 1k steps "
                 f"({out['cpu_per_1k_steps_marginal_ms']:.1f} above idle)")

        # ---- Fleet-posterior convergence: only replica 0's workers see the drop.
        watched = {a: (load.on(a) or [None])[0] for a in addresses}
        load.set_alpha(load.on(addresses[0]), DRIFT_CONTEXT, drift_alpha)
        t_drop = time.time()
        series: list[dict] = []
        truth_from = None  # position-1 counts when the last TRUTH_WINDOW_S of the window began
        while time.time() - t_drop < converge_s:
            if truth_from is None and time.time() - t_drop >= converge_s - TRUTH_WINDOW_S:
                truth_from = load.drift_pos1()
            alphas = {a: await view.alpha1(a, w) for a, w in watched.items() if w is not None}
            series.append({"t": time.time() - t_drop, "alpha1": alphas})
            await asyncio.sleep(0.5)
        truth_to = load.drift_pos1()
        truth_from = truth_from or (0, 0)
        trials, accepted = truth_to[0] - truth_from[0], truth_to[1] - truth_from[1]
        # One model fed every step, its cap binding (thousands of chains a second in this bucket against
        # max_evidence 2,000), holds mostly the last seconds: their empirical acceptance is its position 1.
        truth = accepted / trials if trials else None
        final = {}
        for a in (a for a in watched if watched[a] is not None):
            last = [s["alpha1"][a] for s in series
                    if s["t"] >= converge_s - TRUTH_WINDOW_S and s["alpha1"].get(a) is not None]
            final[a] = sum(last) / len(last) if last else None
        complete = [s for s in series if len(s["alpha1"]) == len(watched) and None not in s["alpha1"].values()]
        spreads = [(s["t"], max(s["alpha1"].values()) - min(s["alpha1"].values())) for s in complete]
        above = [t for t, sp in spreads if sp > CONVERGED_SPREAD]
        converged = not spreads or spreads[-1][1] <= CONVERGED_SPREAD
        # Propagation: the replicas whose workers did not see the drop learn it from the others.
        others = [a for a in addresses[1:] if watched[a] is not None]
        propagation = None
        if complete and others:
            before = complete[0]["alpha1"]
            propagation = next((s["t"] for s in complete
                                if all(before[a] - s["alpha1"][a] >= PROPAGATED for a in others)), None)
        out["convergence"] = {
            "spread_tolerance": CONVERGED_SPREAD,
            "convergence_s": (above[-1] if above else 0.0) if converged else None,
            "propagated_drop": PROPAGATED, "propagation_s": propagation,
            "spread_max": max((sp for _, sp in spreads), default=None),
            "spread_final": spreads[-1][1] if spreads else None,
            "alpha1_truth": truth, "alpha1_truth_trials": trials,
            "alpha1_final": final,  # each replica's mean over the same last seconds
            "series": series,
        }
        progress(f"[{backend}] convergence: {out['convergence']['convergence_s']} s (final spread "
                 f"{out['convergence']['spread_final']}); the drop reached the other replicas after {propagation} s; "
                 f"settled α₁ {[x and round(x, 3) for x in final.values()]} against the fleet's {truth}")

        # ---- Alerts: the drop reaches every worker.
        load.set_alpha(list(load.sims), DRIFT_CONTEXT, drift_alpha)
        t_all = time.time()
        worst, samples = 0, []
        while time.time() - t_all < alert_s:
            lists = {a: await view.open_alerts(a) for a in addresses}
            per_stratum: dict[str, set | int] = {}
            for a, alerts in lists.items():
                for alert in alerts:
                    key = f"{alert.drafter_version}/{alert.stratum}"
                    if backend == "redis":  # fleet-wide ids: one alert listed by several replicas counts once
                        per_stratum.setdefault(key, set()).add(alert.id)
                    else:  # each replica numbers its own
                        per_stratum.setdefault(key, set()).add(f"{a}/{alert.id}")
            counts = {k: len(v) for k, v in per_stratum.items()}
            worst = max([worst, *counts.values()])
            samples.append({"t": time.time() - t_all, "open": counts,
                            "listed_by": {a: sorted(x.id for x in al) for a, al in lists.items()}})
            await asyncio.sleep(1.0)
        out["alerts"] = {"open_max_per_stratum": worst, "samples": samples}
        progress(f"[{backend}] open alerts per stratum, most: {worst}")
        out["drift"] = await drift_record(view, procs, backend, t_drop, t_all, alert_events)
        progress(f"[{backend}] drift: first alert on the drifted stratum {out['drift']['detection_s']} s after the "
                 f"drop began; {out['drift']['false_alerts_before_drift']} alerts before it")

        # Plan push: every plan applied from the end of the warm-up to here (the first plans of
        # the start-up burst excluded; the drops above make the policies re-plan).
        pushes = load.plans[plans0:]
        out["plan_push_ms"] = _summary([p.push_ms for p in pushes])
        for r in per_replica:
            r["plan_push_ms"] = _summary([p.push_ms for p in pushes if p.replica == r["address"]])
        progress(f"[{backend}] plan push p50 / p99 {out['plan_push_ms']['p50']} / {out['plan_push_ms']['p99']} ms "
                 f"({len(pushes)} plans)")
        for r, proc in zip(per_replica, procs):  # the replica's own part of it, its last minute's plans
            r["plan_handoff_ms"] = await asyncio.to_thread(scrape_plan_handoffs, proc.config["metrics_listen"])
        progress(f"[{backend}] plan created -> taken by gRPC, per replica (last minute, ms): "
                 + ", ".join(f"p50 {r['plan_handoff_ms']['p50']} p99 {r['plan_handoff_ms']['p99']} "
                             f"({r['plan_handoff_ms']['n']} plans)" for r in per_replica))
        if not failover:
            if redis is not None:
                out["redis_memory"] = _redis_memory(redis)
            return out

        # ---- Failover: kill -9 of replica 0 under load.
        victim = procs[0]
        moved = load.on(victim.address)
        before = {w: (len(agents[w].stats.moves), agents[w].stats.fallback_decisions) for w in load.sims}
        t_kill = time.time()
        victim.kill()

        def arrived(w: str) -> bool:
            moves = agents[w].stats.moves
            return len(moves) > before[w][0] and moves[-1].first_plan_at > 0

        await _wait(lambda: all(arrived(w) for w in moved), 30.0)
        failover = []
        for w in moved:
            s = agents[w].stats
            m = s.moves[-1] if len(s.moves) > before[w][0] else None
            failover.append({
                "worker": w, "to": m.target if m else None,
                "detected_s": m.left_at - t_kill if m else None,
                "connected_s": m.connected_at - t_kill if m and m.connected_at else None,
                "first_plan_s": m.first_plan_at - t_kill if m and m.first_plan_at else None,
                "confirmed_through": m.confirmed_through if m else None, "resent": m.resent if m else None,
                "fallback_decisions": s.fallback_decisions - before[w][1],
            })
        # Accounting: pause, let every receipt come in, compare what each new replica read.
        load.paused = True
        settled = await load.settle(15.0)
        lost = twice = 0
        for f in failover:
            if f["to"] is None:
                continue
            [ws] = (await view.status(f["to"], f["worker"])).workers
            expected = load.observed(f["worker"]) - f["confirmed_through"]
            f["steps_read_by_new_replica"] = ws.steps_received
            f["steps_expected"] = expected
            lost += max(0, expected - ws.steps_received)
            twice += max(0, ws.steps_received - expected)
        times = [f["first_plan_s"] for f in failover if f["first_plan_s"] is not None]
        out["failover"] = {
            "workers_moved": len(moved), "workers_with_plan": len(times),
            "first_plan_s": _summary(times), "settled": settled,
            "fallback_decisions": sum(f["fallback_decisions"] for f in failover),
            "acknowledged_steps_lost": lost, "steps_read_twice": twice,
            "others_moved": sum(1 for w in load.sims if w not in moved and len(agents[w].stats.moves) > before[w][0]),
            "workers": failover,
        }
        progress(f"[{backend}] kill -9 {victim.name}: {len(times)}/{len(moved)} workers on a plan elsewhere, "
                 f"p99 {out['failover']['first_plan_s']['p99']} s; fallback decisions "
                 f"{out['failover']['fallback_decisions']}; acknowledged steps lost {lost}")

        if redis is not None:
            out["redis_memory"] = _redis_memory(redis)
        return out
    finally:
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        if load is not None:
            await load.stop()
        if view is not None:
            await view.close()
        for p in procs:
            p.stop()
        if redis is not None:
            redis.stop()


def scrape_plan_handoffs(address: str, timeout_s: float = 5.0) -> dict:
    """``{"p50", "p99", "max"}`` (ms) and ``"n"`` of one replica's ``specctl_plan_handoff_seconds``: its
    plans of the last minute, from ``created_at`` to gRPC taking them (blocking; None where it had none)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    out: dict[str, Any] = {"p50": None, "p99": None, "max": None, "n": 0}
    names = {"0.5": "p50", "0.99": "p99", "1": "max"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specctl_plan_handoff_seconds":
                out[names[sample.labels["quantile"]]] = round(sample.value * 1000.0, 3)
            elif sample.name == "specctl_plan_handoffs":
                out["n"] = int(sample.value)
    return out


def scrape_drift_feed(address: str, timeout_s: float = 5.0) -> dict:
    """The drift feed's counters on one replica's ``/metrics`` (blocking): request-steps its monitor saw,
    request-steps dropped before it (a full buffer; on a fleet monitor's owner, evidence shed beyond
    ``inbound_limit`` too), outcomes forwarded to the fleet's stream or dropped on the way, and the
    drafter versions whose fleet monitor it runs."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    out: dict[str, Any] = {"monitor_request_steps": 0.0, "dropped_request_steps": 0.0, "evidence_sent": 0.0,
                           "evidence_dropped_outbox": 0.0, "owns": [], "sample_fraction": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "specctl_drift_request_steps_total":
                out["monitor_request_steps"] = value
            elif name == "specctl_drift_dropped_request_steps_total":
                out["dropped_request_steps"] = value
            elif name == "specctl_fleet_drift_evidence_total":
                out["evidence_sent" if labels.get("outcome") == "sent" else "evidence_dropped_outbox"] = value
            elif name == "specctl_fleet_drift_monitor_owned" and value >= 1.0:
                out["owns"].append(f"{labels.get('drafter_kind', '')}/{labels.get('drafter_version', '')}")
            elif name == "specctl_fleet_drift_sample_fraction":
                out["sample_fraction"][f"{labels.get('drafter_kind', '')}/{labels.get('drafter_version', '')}"] = value
    return out


async def drift_record(view: Replicas, procs: Sequence[ReplicaProcess], backend: str, t_drop: float,
                       t_all: float, events: Sequence[dict] = ()) -> dict:
    """Every alert the replicas know (open and resolved, the fleet's history with Redis), timed against the
    drift: it began at ``t_drop`` (replica 0's workers) and reached every worker at ``t_all`` (wall clock).

    An alert's ``opened_at`` is the time of the step that tipped it (the evidence's time), so an alert
    whose evidence predates ``t_drop`` is a false alarm. The first alert on the drifted stratum after it
    gives two delays: ``detection_s``, to the first ``OPENED`` event any replica's WatchAlerts stream
    delivered (``events``, :meth:`Replicas.follow_alerts`: when an operator could see it, evidence
    forwarding and the owner's backlog included), and ``detection_evidence_s``, to its ``opened_at``. With
    ``metrics_listen`` set, each replica's drift feed counters (:func:`scrape_drift_feed`) too."""
    known: dict[str, dict] = {}
    for proc in procs:
        for alert in await view.alert_history(proc.address):
            key = alert.id if backend == "redis" else f"{proc.address}/{alert.id}"
            entry = known.setdefault(key, {
                "id": key, "stratum": alert.stratum, "drifted_stratum": alert.context_len_min == DRIFT_BUCKET_MIN,
                "opened_at": alert.opened_at, "resolved_at": alert.resolved_at or None,
                "opened_s": alert.opened_at - t_drop, "listed_by": []})
            entry["listed_by"].append(proc.address)
    alerts = sorted(known.values(), key=lambda a: a["opened_at"])
    first = next((a for a in alerts if a["drifted_stratum"] and a["opened_at"] >= t_drop), None)
    false_ids = {a["id"] for a in alerts if a["opened_at"] < t_drop}
    seen = [e["t"] for e in events
            if e["event"] == "ALERT_EVENT_OPENED" and e["context_len_min"] == DRIFT_BUCKET_MIN and e["t"] >= t_drop
            and (e["id"] if backend == "redis" else f"{e['replica']}/{e['id']}") not in false_ids]
    shown = min(seen, default=None)
    feeds = {}
    for proc in procs:
        address = proc.config.get("metrics_listen")
        if address and proc.pid is not None:
            try:
                feeds[proc.address] = await asyncio.to_thread(scrape_drift_feed, address)
            except OSError as err:
                feeds[proc.address] = {"error": str(err)}
    return {
        "fleet_drop_after_s": t_all - t_drop,
        "alert_opened": first is not None,
        "detection_s": shown - t_drop if shown is not None else None,
        "detection_after_fleet_drop_s": shown - t_all if shown is not None else None,
        "detection_evidence_s": first["opened_at"] - t_drop if first else None,
        "false_alerts_before_drift": sum(a["opened_at"] < t_drop for a in alerts),
        "alerts_other_strata_after_drift": sum(not a["drifted_stratum"] and a["opened_at"] >= t_drop
                                               for a in alerts),
        "alerts": alerts, "feeds": feeds, "events": list(events),
    }


def _redis_memory(redis: RedisServer) -> dict:
    """Bytes of every key of the fleet (``MEMORY USAGE``), grouped: acceptance strata of drafter
    version ``v1`` (keys that name it), and the rest."""
    client = redis.client()
    keys = {k.decode(): client.memory_usage(k, samples=0) or 0 for k in client.scan_iter("specctl:*", count=1000)}
    version = {k: b for k, b in keys.items() if ":v1:" in k}
    return {
        "keys": len(keys), "bytes_total": sum(keys.values()),
        "drafter_version_keys": len(version), "bytes_per_drafter_version": sum(version.values()),
        "bytes_per_stratum": (sum(version.values()) / len(version)) if version else None,
        "used_memory": client.info("memory")["used_memory"],
        "largest": sorted(keys.items(), key=lambda kv: -kv[1])[:12],
    }


def run_fleet_bench(out_dir: str | Path = "bench/results", replicas: int = 2, workers: int = 32,
                    steps_per_s: float = 50.0, requests: int = 8, measure_s: float = 20.0, warmup_s: float = 8.0,
                    converge_s: float = 12.0, alert_s: float = 12.0, backends: Sequence[str] = ("embedded", "redis"),
                    plots: bool = True, drift_monitor: str = "replica") -> int:
    """Run the phases, write ``fleet.json`` (+ ``fleet.png``); returns a process exit code.

    Both drift monitor modes side by side (``specctl bench fleet --drift-monitor both``) are
    :func:`bench.fleet_drift.run_drift_modes`, which builds on this module."""
    if replicas < 2:
        raise BenchError("--replicas must be at least 2 (one is killed)")
    if drift_monitor not in DRIFT_MONITORS:
        raise BenchError(f"drift_monitor must be one of {', '.join(DRIFT_MONITORS)}, got {drift_monitor!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="specctl-fleet-") as tmp:
        for backend in backends:
            phases[backend] = asyncio.run(run_phase(backend, Path(tmp) / backend, replicas, workers, steps_per_s,
                                                    requests, warmup_s, measure_s, converge_s, alert_s,
                                                    drift_monitor=drift_monitor))
    report = summarize(phases, replicas=replicas, workers=workers, steps_per_s=steps_per_s, requests=requests,
                       measure_s=measure_s, drift_monitor=drift_monitor)
    (out / "fleet.json").write_text(json.dumps(report, indent=1, default=_jsonable))
    if plots:
        plot_fleet(report, out / "fleet.png")
    print(json.dumps({k: report.get(k) for k in JSON_KEYS}, indent=1))
    return 0


def _jsonable(value):
    if isinstance(value, set):
        return sorted(value)
    return asdict(value)


def summarize(phases: dict[str, dict], **setup) -> dict:
    """The top-level keys (the issue's, from the Redis phase where both ran) over the raw phases."""
    emb, red = phases.get("embedded"), phases.get("redis")
    main = red or emb
    failover_times = [f["first_plan_s"] for p in phases.values() for f in p["failover"]["workers"]
                      if f["first_plan_s"] is not None]
    report: dict[str, Any] = {
        **setup,
        "cpu_per_1k_steps_embedded": emb["cpu_per_1k_steps_ms"] if emb else None,
        "cpu_per_1k_steps_redis": red["cpu_per_1k_steps_ms"] if red else None,
        "failover_s_p50": percentile(failover_times, 50),
        "failover_s_p99": percentile(failover_times, 99),
        "failover_s_max": max(failover_times, default=None),
        "failover_samples": len(failover_times),
        "plan_push_ms_p50": main["plan_push_ms"]["p50"],
        "plan_push_ms_p99": main["plan_push_ms"]["p99"],
        "open_alerts_max_per_stratum": main["alerts"]["open_max_per_stratum"],
        "fallback_decisions_during_failover": sum(p["failover"]["fallback_decisions"] for p in phases.values()),
        "acknowledged_steps_lost": sum(p["failover"]["acknowledged_steps_lost"] for p in phases.values()),
        "steps_read_twice": sum(p["failover"]["steps_read_twice"] for p in phases.values()),
    }
    if emb and red and emb["cpu_per_1k_steps_ms"]:
        report["redis_cpu_overhead"] = red["cpu_per_1k_steps_ms"] / emb["cpu_per_1k_steps_ms"] - 1.0
    for name, p in phases.items():
        report[f"convergence_s_{name}"] = p["convergence"]["convergence_s"]
        report[f"propagation_s_{name}"] = p["convergence"]["propagation_s"]
        report[f"posterior_spread_final_{name}"] = p["convergence"]["spread_final"]
        report[f"alpha1_final_{name}"] = list(p["convergence"]["alpha1_final"].values())
        report[f"alpha1_truth_{name}"] = p["convergence"]["alpha1_truth"]
        report[f"open_alerts_max_per_stratum_{name}"] = p["alerts"]["open_max_per_stratum"]
        report[f"plan_push_ms_per_replica_{name}"] = [r["plan_push_ms"] for r in p["replicas"]]
        report[f"plan_handoff_ms_per_replica_{name}"] = [r.get("plan_handoff_ms") for r in p["replicas"]]
        report[f"cpu_per_1k_steps_marginal_{name}"] = p["cpu_per_1k_steps_marginal_ms"]
        report[f"cpu_util_idle_per_replica_{name}"] = [r["cpu_util_idle"] for r in p["replicas"]]
    if red:
        report["redis_server_cpu_per_1k_steps"] = red["redis_server_cpu_per_1k_steps_ms"]
        report["redis_ops_per_s"] = red["redis_ops_per_s"]
        report["redis_ops_per_s_per_replica"] = red["redis_ops_per_s"] / setup["replicas"]
        report["redis_bytes_per_drafter_version"] = red["redis_memory"]["bytes_per_drafter_version"]
        report["redis_bytes_per_stratum"] = red["redis_memory"]["bytes_per_stratum"]
    report["goals"] = {
        "redis_cpu_overhead_max": GOAL_REDIS_CPU, "failover_s_p99_max": GOAL_FAILOVER_S,
        "plan_push_ms_p99_max": GOAL_PUSH_P99_MS, "open_alerts_per_stratum_max": 1,
    }
    report["phases"] = phases
    return report


def plot_fleet(report: dict, path: Path) -> None:
    """Four panels: CPU per 1k steps, plan push per replica, failover times, α₁ per replica after the drop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = report["phases"]
    colors = {"embedded": "#7f7f7f", "redis": "#d62728"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    names = list(phases)
    values = [phases[n]["cpu_per_1k_steps_ms"] or 0.0 for n in names]
    ax.bar(names, values, color=[colors.get(n, "#1f77b4") for n in names])
    if "redis" in phases and phases["redis"].get("redis_server_cpu_per_1k_steps_ms") is not None:
        values.append(phases["redis"]["redis_server_cpu_per_1k_steps_ms"])
        ax.bar(["redis-server"], values[-1:], color="#ff9896")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("CPU ms per 1,000 steps ingested")
    ax.set_title(f"Controller CPU ({report['replicas']} replicas, {report['workers']} workers)", fontsize=10)

    ax = axes[0][1]
    labels = []
    for n in names:
        for i, r in enumerate(phases[n]["replicas"]):
            pp, x = r["plan_push_ms"], len(labels)
            if pp["p50"] is not None:
                ax.bar([x], [pp["p99"]], color=colors.get(n, "#1f77b4"), alpha=0.45)
                ax.bar([x], [pp["p50"]], color=colors.get(n, "#1f77b4"))
                ax.text(x, pp["p99"], f"n={pp['n']}", ha="center", va="bottom", fontsize=7)
            labels.append(f"{n} r{i}")
    ax.axhline(GOAL_PUSH_P99_MS, color="black", ls=":", lw=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("plan push ms (dark p50, light p99)")
    ax.set_title("Plan push per replica", fontsize=10)

    ax = axes[1][0]
    for n in names:
        times = sorted(f["first_plan_s"] for f in phases[n]["failover"]["workers"] if f["first_plan_s"] is not None)
        if times:
            ax.step(times, [(k + 1) / len(times) for k in range(len(times))], where="post",
                    color=colors.get(n, "#1f77b4"), label=f"{n} (n={len(times)})")
    ax.axvline(GOAL_FAILOVER_S, color="black", ls=":", lw=1)
    ax.set_xlabel("kill -9 → plan ACKed on another replica (s)")
    ax.set_ylabel("share of the dead replica's workers")
    ax.set_title("Failover", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[1][1]
    for n in names:
        series = phases[n]["convergence"]["series"]
        addresses = [r["address"] for r in phases[n]["replicas"]]  # replica 0 first: its workers drift
        for i, a in enumerate(addresses):
            pts = [(s["t"], s["alpha1"][a]) for s in series if s["alpha1"].get(a) is not None]
            if pts:
                ax.plot(*zip(*pts), color=colors.get(n, "#1f77b4"), ls="-" if i == 0 else "--", lw=1.4,
                        label=f"{n} r{i}" + (" (its workers drift)" if i == 0 else ""))
    ax.set_xlabel("seconds after replica 0's workers' acceptance dropped")
    ax.set_ylabel("α₁ of ctx[1024,2048) per replica")
    ax.set_title("Fleet posterior", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
