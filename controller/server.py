"""``specctl serve``: the controller as a grpc.aio server.

Health checking and server reflection (v1 and v1alpha) are on; the policy file is watched
and reloaded on change or SIGHUP. The drift monitor runs in the housekeeping
tick (``controller.alerts.alerting``); SIGTERM stops gracefully, saving its baselines.

With ``state: {backend: redis}`` the server is one replica of several that
share what they learn (:class:`controller.fleet.replica.FleetReplica`, imported
only then: without it no Redis client is loaded and nothing extra runs).

A server that owns its process (``specctl serve``; ``start_server(...,
tune_gc=True)``) applies the config's ``gc:`` section to the process's
garbage collector (:func:`apply_gc_settings`); one embedded in another program (tests,
demos) leaves the process's collector as it found it, except for the short
holds around plan pushes (``controller.service.PlansOnTheWay``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from controller.alerts.alerting import DriftAlerting
from controller.auth import Authenticator
from controller.config import GcSettings, ServerConfig, TlsSettings
from controller.core import Controller
from controller.observe.metrics_gc import gc_pauses
from controller.observe.recorder import TelemetryRecorder
from controller.reflection import enable_reflection
from controller.reload import PolicySource
from controller.service import SERVICE_NAME, SpeculationControllerServicer, rpc_handlers
from controller.observe.web import StatusSite
from policies.presets import load_preset

if TYPE_CHECKING:
    from controller.fleet.replica import FleetReplica

log = logging.getLogger("specctl.server")


@dataclass
class RunningServer:
    server: grpc.aio.Server
    controller: Controller
    servicer: SpeculationControllerServicer
    policy_source: PolicySource
    port: int
    tasks: list[asyncio.Task] = field(default_factory=list)
    recorder: TelemetryRecorder | None = None
    status_site: StatusSite | None = None  # /metrics and the status page (metrics_listen)
    alerting: DriftAlerting | None = None  # drift monitor, alert store and sinks (drift.enabled)
    fleet: "FleetReplica | None" = None  # shared state of several replicas (state.backend: redis)
    gc_tuned: bool = False  # the config's gc section applies to this process (start_server's tune_gc)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = 0.5) -> None:
        for task in self.tasks:
            task.cancel()
        if self.status_site is not None:
            await self.status_site.stop()
        if self.alerting is not None:
            await self.alerting.finish_watches()  # they end cleanly now rather than hold the grace period
        await self.server.stop(grace)
        if self.fleet is not None:
            await self.fleet.quiesce()  # no fleet event reaches the alert store once it starts closing
        if self.alerting is not None:
            await self.alerting.close()
        if self.fleet is not None:
            await self.fleet.close()  # a last merge and alert flush, then out of the directory
        if self.recorder is not None:
            self.recorder.close()


def apply_gc_settings(settings: GcSettings) -> None:
    """Apply ``settings`` to this process's garbage collector: the thresholds,
    then (``settings.freeze_after_start``) one full collection
    and ``gc.freeze()``, so that what is alive now (modules, the policy, the
    config, every worker's state so far) is never traversed again. Objects
    frozen stay until the process ends even when they later become garbage
    in a reference cycle; plain reference counting still frees the rest."""
    if settings.thresholds is not None:
        gc.set_threshold(*settings.thresholds)
    if settings.freeze_after_start:
        freeze_survivors()


def freeze_survivors() -> None:
    """One full collection, then everything alive is frozen (and counted for /metrics)."""
    gc.collect()
    gc.freeze()
    gc_pauses().record_freeze()


async def start_server(config: ServerConfig, listen: str | None = None, clock=time.time, *,
                       tune_gc: bool = False) -> RunningServer:
    """Start serving on ``listen`` (``host:0`` picks a free port).

    ``tune_gc``: this server owns its process; apply ``config.gc`` to it
    (:func:`apply_gc_settings`, once the server is up, and a freeze after each policy
    reload)."""
    gc_pauses()  # GC pauses are timed from the start (specctl_gc_* on /metrics)
    policy = load_preset(config.policy)
    controller = Controller(config, policy, clock=clock)
    servicer = SpeculationControllerServicer(controller, Authenticator(config.security.auth))
    recorder = TelemetryRecorder(config.record, clock=clock) if config.record else None
    servicer.recorder = recorder
    alerting = DriftAlerting.from_config(config, clock=clock) if config.drift.enabled else None
    if alerting is not None:
        alerting.attach(controller)
    servicer.alerting = alerting
    # Made before any worker can connect, so it sees every Hello.
    site = StatusSite(controller, config.status_history_samples, alerting, config.status_sample_interval_s,
                      config.metrics_plan_cells) if config.metrics_listen else None
    source = PolicySource(controller, config.policy)
    servicer.policy_source = source
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((rpc_handlers(servicer),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection(server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    tls = config.security.tls
    if tls is not None:
        port = server.add_secure_port(listen or config.listen, server_credentials(tls))
    else:
        if config.security.auth is not None:
            log.warning("bearer tokens are on without TLS: they cross the network in plaintext")
        port = server.add_insecure_port(listen or config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen or config.listen}")
    fleet = None
    if config.state.backend == "redis":
        # Hooked in before the port serves, so that every Hello reaches the directory and the hold.
        fleet = start_fleet(config, controller, source, alerting, _advertised(listen or config.listen, port))
        servicer.fleet = fleet
    try:
        if site is not None:
            site.fleet = fleet
            await site.start(config.metrics_listen)
        await server.start()
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if fleet is not None:  # its threads and connections must not outlive a server that did not start
            await fleet.close(timeout_s=0.5)
        raise
    running = RunningServer(server, controller, servicer, source, port, recorder=recorder, status_site=site,
                            alerting=alerting, fleet=fleet, gc_tuned=tune_gc)
    if tune_gc:
        apply_gc_settings(config.gc)
    running.tasks.append(asyncio.create_task(_housekeeping(running, config.policy_poll_interval_s)))
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, source.reload)
    except (RuntimeError, ValueError, NotImplementedError):
        pass  # not the main thread (tests): polling still reloads
    log.info("serving %s on port %d with policy %s", SERVICE_NAME, port, policy.name)
    return running


def start_fleet(config: ServerConfig, controller: Controller, source: PolicySource,
                alerting: DriftAlerting | None, address: str) -> "FleetReplica":
    """This server as one replica of a fleet sharing state in Redis (``state.backend: redis``)."""
    try:
        from controller.fleet.replica import FleetReplica
    except ImportError as err:  # the redis client is in the controller extra
        raise RuntimeError(f"state.backend: redis needs the redis package ({err}); "
                           "pip install 'specctl[controller]'") from err
    return FleetReplica(config.state, controller, address=address, policy_source=source,
                        alerting=alerting).start()


def _advertised(listen: str, port: int) -> str:
    """Where workers reach this replica: the listen host (this host's name for a wildcard) and the port."""
    host = listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """TLS credentials from the config's files (read at start: a rotated certificate needs a restart)."""
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None,
        require_client_auth=tls.require_client_cert,
    )


async def _housekeeping(running: RunningServer, poll_interval_s: float) -> None:
    """Watch the policy file; sample the status history; run due policies and push plans within a CPU budget."""
    plan = running.controller.config.plan
    last_poll = time.monotonic()  # PolicySource read the file at start
    reloads = running.controller.policy_reloads
    while True:
        await asyncio.sleep(plan.tick_s)
        running.servicer.on_the_way.expire()
        if running.controller.policy_reloads != reloads:
            reloads = running.controller.policy_reloads
            if running.gc_tuned and running.controller.config.gc.freeze_after_start:
                # The new policy's objects are long-lived too. At the top of a tick: no plan is on its way.
                freeze_survivors()
        now = time.monotonic()
        if now - last_poll >= poll_interval_s:
            last_poll = now
            running.policy_source.poll()
            running.servicer.expire_idle()
            running.controller.forget_idle_workers()
        if running.status_site is not None:
            running.status_site.tick(plan.tick_s)
        await running.servicer.push_due_plans(plan.tick_s * plan.policy_cpu_fraction)
        running.servicer.send_receipts(running.controller.config.receipt_interval_s)
        if running.alerting is not None:
            running.alerting.tick(plan.tick_s)
        if running.fleet is not None:
            running.fleet.tick(plan.tick_s)


async def serve_forever(config: ServerConfig, listen: str | None = None) -> None:
    running = await start_server(config, listen, tune_gc=True)
    print(f"specctl controller listening on {listen or config.listen} (policy {running.controller.policy.name})"
          + (f", recording telemetry to {config.record}" if config.record else "")
          + (f", drift alerts stored in {config.store.path or 'memory'}" if running.alerting else "")
          + (f", replica {running.fleet.replica_id} of fleet {config.state.fleet} sharing state in "
             f"{running.fleet.store.health()['url']}" if running.fleet else ""), flush=True)
    if running.status_site is not None:
        host = config.metrics_listen.rpartition(":")[0] or "0.0.0.0"
        print(f"status page http://{host}:{running.status_site.http.port}/ (metrics at /metrics)", flush=True)
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM,
                                                      lambda: asyncio.ensure_future(running.server.stop(1.0)))
    except (RuntimeError, ValueError, NotImplementedError):
        pass
    try:
        await running.server.wait_for_termination()
    finally:
        # Stop serving first so nothing is recorded after the recording closes,
        # then the drift baselines are saved and the store closed.
        await running.stop(0)
