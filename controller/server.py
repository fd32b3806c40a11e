"""``specctl serve``: the controller as a grpc.aio server.

Health checking and server reflection are on; the policy file is watched
and reloaded on change or SIGHUP.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from controller.config import ServerConfig
from controller.core import Controller
from controller.recorder import TelemetryRecorder
from controller.reload import PolicySource
from controller.service import SERVICE_NAME, SpeculationControllerServicer, rpc_handlers
from policies.presets import load_preset

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

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = 0.5) -> None:
        for task in self.tasks:
            task.cancel()
        await self.server.stop(grace)
        if self.recorder is not None:
            self.recorder.close()


async def start_server(config: ServerConfig, listen: str | None = None, clock=time.time) -> RunningServer:
    """Start serving on ``listen`` (``host:0`` picks a free port)."""
    policy = load_preset(config.policy)
    controller = Controller(config, policy, clock=clock)
    servicer = SpeculationControllerServicer(controller)
    recorder = TelemetryRecorder(config.record, clock=clock) if config.record else None
    servicer.recorder = recorder
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((rpc_handlers(servicer),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(listen or config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen or config.listen}")
    await server.start()
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    source = PolicySource(controller, config.policy)
    running = RunningServer(server, controller, servicer, source, port, recorder=recorder)
    running.tasks.append(asyncio.create_task(_housekeeping(running, config.policy_poll_interval_s)))
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, source.reload)
    except (RuntimeError, ValueError, NotImplementedError):
        pass  # not the main thread (tests): polling still reloads
    log.info("serving %s on port %d with policy %s", SERVICE_NAME, port, policy.name)
    return running


async def _housekeeping(running: RunningServer, poll_interval_s: float) -> None:
    """Watch the policy file; run due policies and push plans within a CPU budget."""
    plan = running.controller.config.plan
    last_poll = time.monotonic()  # PolicySource read the file at start
    while True:
        await asyncio.sleep(plan.tick_s)
        now = time.monotonic()
        if now - last_poll >= poll_interval_s:
            last_poll = now
            running.policy_source.poll()
        await running.servicer.push_due_plans(plan.tick_s * plan.policy_cpu_fraction)


async def serve_forever(config: ServerConfig, listen: str | None = None) -> None:
    running = await start_server(config, listen)
    print(f"specctl controller listening on {listen or config.listen} (policy {running.controller.policy.name})"
          + (f", recording telemetry to {config.record}" if config.record else ""), flush=True)
    try:
        await running.server.wait_for_termination()
    finally:
        if running.recorder is not None:
            # Stop serving first so nothing is recorded after the file is closed.
            await running.stop(0)
