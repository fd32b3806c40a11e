"""What the agent's telemetry loses is counted, sent in its next Hello and
shown by the controller (GetStatus, the status page); heartbeats keep an
idle agent from expiring; a twin stream is seen for what it is."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import grpc

from controller.config import PlanSettings, ServerConfig
from controller.server import start_server
from protos.speculation.v1 import worker_pb2
from tests.support import free_port, make_hello, wait_for
from worker.sdk.agent import AgentOptions, SpeculationAgent
from worker.sdk.telemetry import RequestTelemetry, StepTelemetry

PLAN = PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05)


def step(step_id: int) -> StepTelemetry:
    return StepTelemetry(step_id=step_id, timestamp=time.time(), batch_size=1, draft_ms=0.5, verify_ms=10.0,
                         requests=[RequestTelemetry(f"r{step_id % 3}", 200 + step_id, 2, 1, 2, 1)])


async def test_unconfirmed_and_dropped_steps_reach_the_next_hello_and_the_status_page():
    grpc_port, web_port = free_port(), free_port()

    def cfg(receipt_interval_s: float) -> ServerConfig:
        return ServerConfig(listen=f"127.0.0.1:{grpc_port}", plan=PLAN, policy_poll_interval_s=0.05,
                            receipt_interval_s=receipt_interval_s, metrics_listen=f"127.0.0.1:{web_port}")

    # One receipt, then none for a minute: whatever is written after it stays unconfirmed.
    running = await start_server(cfg(receipt_interval_s=60.0))
    agent = SpeculationAgent(make_hello("w-loss"), f"127.0.0.1:{grpc_port}",
                             AgentOptions(queue_size=8, flush_interval_s=0.02, backoff_max_s=0.2)).start()
    try:
        await wait_for(lambda: agent.stats.connected)
        for i in range(1, 6):
            agent.observe(step(i))
        await wait_for(lambda: agent.stats.steps_confirmed == 5)
        assert agent.stats.receipts == 1
        for i in range(6, 11):
            agent.observe(step(i))
        await wait_for(lambda: "w-loss" in running.controller.workers and running.controller.workers["w-loss"].steps_ingested == 10)
        await running.stop(0)  # the stream breaks: steps 6-10 were never confirmed
        await wait_for(lambda: not agent.stats.connected and agent.stats.steps_unconfirmed == 5)
        for i in range(11, 26):  # the controller is away: the 8-step queue drops 7 of 15
            agent.observe(step(i))
        assert agent.stats.steps_dropped_total == 7

        running = await start_server(cfg(receipt_interval_s=0.1))
        await wait_for(lambda: "w-loss" in running.controller.workers, timeout=15.0)
        [ws] = running.controller.status("w-loss").workers
        loss = ws.hello.telemetry_loss
        assert (loss.steps_dropped, loss.steps_unconfirmed) == (7, 5)
        await wait_for(lambda: agent.stats.steps_confirmed == 13)  # the 8 the queue kept
        page = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{web_port}/status.json").read())
        [worker] = json.loads(page)["workers"]
        assert worker["telemetry_loss"] == {"steps_dropped": 7, "steps_unconfirmed": 5, "finished_dropped": 0}
        html = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{web_port}/").read())
        assert "7 dropped · 5 unconfirmed" in html.decode()
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{web_port}/metrics").read().decode())
        assert 'specctl_worker_telemetry_lost_total{what="steps_unconfirmed",worker="w-loss"} 5.0' in metrics
    finally:
        agent.close()
        await running.stop(0)


async def test_heartbeats_keep_an_idle_agent_connected():
    running = await start_server(ServerConfig(listen=f"127.0.0.1:{free_port()}", plan=PLAN,
                                              policy_poll_interval_s=0.05, worker_idle_ttl_s=0.5))
    agent = SpeculationAgent(make_hello("w-idle"), running.address,
                             AgentOptions(flush_interval_s=0.02, heartbeat_interval_s=0.1)).start()
    try:
        await wait_for(lambda: agent.stats.connected)
        await asyncio.sleep(1.5)  # three TTLs without a step
        assert agent.stats.heartbeats >= 3 and agent.stats.reconnects == 0  # at least one per TTL
        state = running.controller.workers["w-idle"]
        assert state.session.connected and not state.session.expired and running.controller.workers_expired == 0
    finally:
        agent.close()
        await running.stop(0)


async def test_agent_superseded_by_a_twin_counts_it_and_backs_off():
    """A superseded agent waits at least half its longest backoff before it takes the id back
    (docs/protocol.md). With full jitter (0 to the longest) this test failed one run in six: the agent
    came back within the 0.9 s and superseded its twin in turn."""
    running = await start_server(ServerConfig(listen=f"127.0.0.1:{free_port()}", plan=PLAN,
                                              policy_poll_interval_s=0.05))
    agent = SpeculationAgent(make_hello("w-twin"), running.address,
                             AgentOptions(backoff_max_s=2.0)).start()
    channel = grpc.aio.insecure_channel(running.address)
    try:
        await wait_for(lambda: agent.stats.connected)
        twin = channel.stream_stream("/speculation.v1.SpeculationController/Connect")()
        await twin.write(worker_pb2.WorkerMessage(hello=make_hello("w-twin")).SerializeToString())
        await wait_for(lambda: agent.stats.superseded == 1)
        assert "superseded by a newer stream" in agent.stats.last_error
        await asyncio.sleep(0.9)
        assert running.controller.streams_superseded == 1  # the agent waits, it does not take the id back
        twin.cancel()
    finally:
        agent.close(timeout=1.0)
        await channel.close()
        await running.stop(0)


async def test_unconfirmed_tracking_is_bounded_without_receipts():
    """A controller that sends no receipts (one per minute here) leaves the agent
    tracking at most 4 x queue_size written steps: a break then counts those."""
    running = await start_server(ServerConfig(listen=f"127.0.0.1:{free_port()}", plan=PLAN,
                                              policy_poll_interval_s=0.05, receipt_interval_s=60.0))
    agent = SpeculationAgent(make_hello("w-bounded"), running.address,
                             AgentOptions(queue_size=4, flush_interval_s=0.01, backoff_max_s=0.2)).start()
    try:
        await wait_for(lambda: agent.stats.connected)
        agent.observe(step(1))
        await wait_for(lambda: agent.stats.steps_confirmed == 1)  # the one receipt
        for first in range(2, 42, 4):  # four at a time, each batch sent before the next: nothing is dropped
            for i in range(first, first + 4):
                agent.observe(step(i))
            await wait_for(lambda: agent.stats.steps_sent == first + 3)
        await wait_for(lambda: "w-bounded" in running.controller.workers
                       and running.controller.workers["w-bounded"].steps_ingested == 41)
        assert agent.stats.steps_dropped_total == 0
        await running.stop(0)
        await wait_for(lambda: not agent.stats.connected and agent.stats.steps_unconfirmed > 0)
        assert agent.stats.steps_unconfirmed == 16
    finally:
        agent.close()
        await running.stop(0)
