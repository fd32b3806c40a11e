"""Prometheus metrics over real HTTP: a controller serving gRPC and /metrics on
free loopback ports, a real agent driven by a synthetic worker, a scrape
parsed with prometheus-client's own text parser."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import numpy as np

from controller.config import DriftSettings, PlanSettings, ServerConfig, StoreSettings
from controller.observe.metrics import acceptance_by_position, bucket_labels, mean_context_len
from controller.server import start_server
from controller.protocol import plan_to_proto
from rich.console import Console
from controller.client import fetch_status
from specctl.status import estimated_speedup, plan_summary, render_status
from policies.table import Decision
from protos.speculation.v1 import controller_pb2_grpc, plan_pb2, worker_pb2
from tests.support import SyntheticWorker, feed, free_port, http_get, make_hello, wait_for
from worker.sdk.agent import SpeculationAgent

FAST = PlanSettings(recompute_interval_s=0.05, min_push_interval_s=0.05, hysteresis=0.0)
SHORT, LONG = 500, 6000  # context lengths in buckets 0-1024 and 4096-8192
TRUTH_ALPHA = {SHORT: 0.8, LONG: 0.4}


# A drift monitor that learns its baselines from a few hundred request-steps.
# The tests feed the monitor far faster than traffic would. At the default 2 % of
# each housekeeping tick the monitor fell behind on a slow 2-core EPYC: it had
# seen none of a rolled-out drafter's steps minutes later, and the status page
# test never saw its alert.
QUICK_DRIFT = DriftSettings(cpu_fraction=0.5,
                            monitor=dict(baseline_steps=300, window=200, round_steps=400, ert=200_000,
                                         n_bootstrap=256))


def observed_config(**kw) -> ServerConfig:
    """Metrics and status page on a free port, history sampled every 50 ms, state kept in memory."""
    kw = {"drift": QUICK_DRIFT, **kw}
    return ServerConfig(listen=f"127.0.0.1:{free_port()}", plan=FAST, policy_poll_interval_s=0.1,
                        metrics_listen="127.0.0.1:0", status_sample_interval_s=0.05,
                        store=StoreSettings(path=""), **kw)


@pytest.fixture
async def server():
    running = await start_server(observed_config())
    yield running
    await running.stop(0)


async def scrape(running) -> dict[str, list]:
    """Family name -> samples of ``/metrics``."""
    status, content_type, body = await http_get(f"http://127.0.0.1:{running.status_site.http.port}/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    return {name: f.samples for name, f in families.items()} | {"__types__": {n: f.type for n, f in families.items()}}


def values(samples, **match) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in samples
            if all(s.labels.get(k) == v for k, v in match.items())}


async def send_bad_report(address: str) -> worker_pb2.WorkerMessage:
    """A worker whose step claims more accepted tokens than it drafted; returns the controller's answer."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        call = stub.Connect()
        await call.write(worker_pb2.WorkerMessage(hello=make_hello("w-bad")))
        bad = worker_pb2.StepReport(step_id=1, timestamp=1.0, batch_size=1, draft_ms=1.0, verify_ms=10.0)
        bad.requests.add(request_id="r0", context_len=100, depth=2, width=1, nodes=2, accepted=3)
        await call.write(worker_pb2.WorkerMessage(reports=worker_pb2.StepReports(steps=[bad])))
        while True:
            answer = await asyncio.wait_for(call.read(), 10.0)
            if answer.WhichOneof("payload") == "rejection":
                await call.done_writing()
                return answer


async def test_scrape_reports_acceptance_plans_and_rejections(server) -> None:
    ctl = server.controller
    agent = SpeculationAgent(make_hello("w0", max_depth=5, version="heads-a"), server.address).start()
    try:
        worker = SyntheticWorker(lambda ctx: TRUTH_ALPHA[ctx], seed=3)
        loads = [(1, SHORT), (4, SHORT), (2, LONG)]
        sent = await feed(agent, worker, loads, rounds=40, decide=lambda rid, ctx, b: Decision.chain(4))
        sent += await feed(agent, worker, loads, rounds=30)
        w0 = ctl.workers["w0"]
        # Settled: every step ingested and planned on (no recompute is due any more) and every
        # plan acknowledged, so the plan, the metrics and the status below describe one state.
        await wait_for(lambda: agent.plan_version >= 1 and w0.counters.steps_total == len(sent) and w0.plans.new_steps == 0
                       and not w0.plans.pending)
        await wait_for(lambda: "w0" in server.status_site.history.latest_speedups())
        rejection = await send_bad_report(server.address)
        assert rejection.rejection.field.endswith("accepted")

        m = await scrape(server)
        types = m["__types__"]
        # Every plan gRPC took (the agent's plans, all within the last minute), timed from its created_at.
        handoffs = [ms for _, ms in ctl.plan_handoffs]
        assert [s.value for s in m["specctl_plan_handoffs"]] == [len(handoffs)] and len(handoffs) >= 1
        quantiles = {s.labels["quantile"]: s.value for s in m["specctl_plan_handoff_seconds"]}
        assert set(quantiles) == {"0.5", "0.99", "1"} and quantiles["1"] == pytest.approx(max(handoffs) / 1000.0)
        assert 0.0 <= quantiles["0.5"] <= quantiles["0.99"] <= quantiles["1"]
        for name in ("specctl_draft_tokens", "specctl_accepted_tokens", "specctl_plan_pushes", "specctl_plan_acks",
                     "specctl_plan_nacks", "specctl_rejected_messages", "specctl_steps", "specctl_step_time_seconds"):
            assert types[name] == "counter", name
        for name in ("specctl_plan_draft_depth", "specctl_plan_tree_width", "specctl_decision_draft_depth",
                     "specctl_decision_speculation_enabled", "specctl_estimated_goodput_tokens_per_second", "specctl_realised_goodput_tokens_per_second",
                     "specctl_estimated_speedup_ratio", "specctl_worker_connected"):
            assert types[name] == "gauge", name

        # Acceptance per position equals what the worker reported, request-step by request-step.
        truth_drafted, truth_accepted = defaultdict(int), defaultdict(int)
        buckets = bucket_labels(ctl.context_edges)
        for step in sent:
            for r in step.requests:
                b = buckets[0] if r.context_len == SHORT else "4096-8192"
                for k in range(1, r.depth + 1):
                    truth_drafted[b, str(k)] += 1
                    truth_accepted[b, str(k)] += k <= r.accepted
        drafted = {(s.labels["context_bucket"], s.labels["position"]): s.value
                   for s in m["specctl_draft_tokens"] if s.labels["worker"] == "w0"}
        accepted = {(s.labels["context_bucket"], s.labels["position"]): s.value
                    for s in m["specctl_accepted_tokens"] if s.labels["worker"] == "w0"}
        assert drafted == {k: v for k, v in truth_drafted.items() if v}
        assert accepted == {k: truth_accepted[k] for k in drafted}
        assert {s.labels["drafter_version"] for s in m["specctl_draft_tokens"]} == {"heads-a"}
        for bucket in ("0-1024", "4096-8192"):
            d = [drafted[bucket, str(k)] for k in range(1, 6) if (bucket, str(k)) in drafted]
            a = [accepted[bucket, str(k)] for k in range(1, len(d) + 1)]
            assert all(x >= y for x, y in zip(d, d[1:])) and all(x >= y for x, y in zip(a, a[1:]))
            assert all(y <= x for x, y in zip(d, a))
        assert accepted["0-1024", "1"] / drafted["0-1024", "1"] == pytest.approx(0.8, abs=0.06)
        assert accepted["4096-8192", "1"] / drafted["4096-8192", "1"] == pytest.approx(0.4, abs=0.08)

        # The plan in force, cell by cell, as the controller holds it, and its cell at the current load.
        table = ctl.workers["w0"].plans.current.table
        depth = values(m["specctl_plan_draft_depth"], worker="w0")
        width = values(m["specctl_plan_tree_width"], worker="w0")
        assert len(depth) == len(width) == len(table.batch_edges) * len(table.context_edges)
        for b, bl in enumerate(bucket_labels(table.batch_edges)):
            for c, cl in enumerate(bucket_labels(table.context_edges)):
                key = (("batch_bucket", bl), ("context_bucket", cl), ("drafter_version", "heads-a"), ("worker", "w0"))
                assert (depth[key], width[key]) == (table.cell(b, c).depth, table.cell(b, c).width)
        state = ctl.workers["w0"]
        now = table.lookup(round(state.load.batch_ema), int(mean_context_len(state)))
        assert values(m["specctl_decision_draft_depth"], worker="w0") == {
            (("drafter_version", "heads-a"), ("worker", "w0")): now.depth}
        assert values(m["specctl_decision_speculation_enabled"], worker="w0") == {
            (("drafter_version", "heads-a"), ("worker", "w0")): float(now.depth > 0)}

        state = ctl.workers["w0"]
        pushes = values(m["specctl_plan_pushes"], worker="w0")
        assert pushes[(("kind", "plan"), ("worker", "w0"))] == state.counters.plans_pushed >= 1
        assert values(m["specctl_plan_acks"], worker="w0") == {(("worker", "w0"),): state.counters.plans_pushed + state.counters.decisions_pushed}
        assert values(m["specctl_plan_nacks"], worker="w0") == {(("worker", "w0"),): 0}
        assert values(m["specctl_steps"], worker="w0") == {(("worker", "w0"),): len(sent)}
        assert values(m["specctl_estimated_goodput_tokens_per_second"], worker="w0")[(("worker", "w0"),)] > 0
        assert values(m["specctl_realised_goodput_tokens_per_second"], worker="w0")[(("worker", "w0"),)] > 0
        assert values(m["specctl_estimated_speedup_ratio"], worker="w0")[(("worker", "w0"),)] > 0

        # The bad report: counted by reason, fleet-wide and for its worker; nothing of it applied.
        assert values(m["specctl_rejected_messages"]) == {(("reason", "invalid_field"),): 1}
        assert values(m["specctl_worker_rejected_messages"], worker="w-bad") == {
            (("reason", "invalid_field"), ("worker", "w-bad")): 1}
        assert values(m["specctl_steps"], worker="w-bad") == {(("worker", "w-bad"),): 0}
        assert "process_resident_memory_bytes" in m
        assert values(m["specctl_drift_open_alerts"]) == {}

        # `specctl status` shows the same plan (in the worker's context bucket) and a speedup estimate.
        (ws,) = (await asyncio.to_thread(fetch_status, server.address, "w0")).workers
        assert plan_summary(ws.plan, ws.mean_context_len) == plan_summary(
            plan_to_proto(table, 1, "", "goodput", 0.0, 0.0), ws.mean_context_len)
        assert estimated_speedup(ws) > 1.0  # memory-bound at batch ≤ 4, α = 0.8: speculation pays
        # The table and the figure it must show come from one snapshot: plans keep being
        # recomputed, so a second fetch may already carry another estimate.
        status = await asyncio.to_thread(fetch_status, server.address)
        (shown,) = [w for w in status.workers if w.hello.worker_id == "w0"]
        console = Console(width=250, record=True)
        for t in render_status(status):
            console.print(t)
        text = console.export_text()
        assert "est. speedup" in text and f"{estimated_speedup(shown):.2f}×" in text
    finally:
        agent.stop()


async def test_without_drift_monitor_no_drift_families() -> None:
    running = await start_server(observed_config(drift=DriftSettings(enabled=False)))
    try:
        m = await scrape(running)
        assert "specctl_steps" in m and not [name for name in m if name.startswith("specctl_drift")]
    finally:
        await running.stop(0)


async def test_drift_monitor_scores_and_open_alerts(server) -> None:
    """The server's drift monitor is read at scrape time (fed directly here: the
    detection itself is tested with the monitor)."""
    monitor = server.alerting.monitor
    rng = np.random.default_rng(5)
    limits = server.controller.hello(make_hello("w-drift", max_depth=6)).limits
    for t in range(4500):
        alpha = 0.8 if t < 3000 else 0.8 * 0.85  # the content moved: acceptance 15 % lower
        tau = 0
        while tau < 6 and rng.random() < alpha:
            tau += 1
        monitor.observe_request(limits, 500, tau, 6, now=float(t))
    assert monitor.open_alerts()
    m = await scrape(server)
    open_alerts = values(m["specctl_drift_open_alerts"], drafter_version="v1")
    assert sum(open_alerts.values()) == len(monitor.open_alerts())
    assert {dict(k)["action"] for k in open_alerts} == {a.action.value for a in monitor.open_alerts()}
    scores = values(m["specctl_drift_alert_score"])
    assert len(scores) == len(monitor.open_alerts()) and all(v > 1 for v in scores.values())
    assert {dict(k)["drop"] for k in values(m["specctl_drift_cusum_score"])} == {"0.1", "0.035"}
    assert values(m["specctl_drift_request_steps"]) == {(): 4500}
    assert values(m["specctl_drift_alert_events"])[(("event", "opened"),)] == len(monitor.open_alerts())
    assert values(m["specctl_drift_sample_fraction"]) == {(): 1.0}


async def test_metrics_endpoint_answers_errors_and_stays_up(server) -> None:
    base = f"http://127.0.0.1:{server.status_site.http.port}"
    status, _, body = await http_get(base + "/nope")
    assert status == 404 and b"/metrics" in body
    reader, writer = await asyncio.open_connection("127.0.0.1", server.status_site.http.port)
    writer.write(b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.read()).startswith(b"HTTP/1.1 405")
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.status_site.http.port)
    writer.write(b"GARBAGE\r\n\r\n")
    assert (await reader.read()).startswith(b"HTTP/1.1 400")
    writer.close()
    status, _, _ = await http_get(base + "/metrics")
    assert status == 200


def test_acceptance_by_position_matches_a_direct_count() -> None:
    counts = {(0, 4, 0): 3, (0, 4, 4): 2, (1, 1, 1): 7, (1, 3, 2): 1}
    p = acceptance_by_position(counts, 2, depth=5)
    assert p.drafted.tolist() == [[5, 5, 5, 5, 0], [8, 1, 1, 0, 0]]
    assert p.reached.tolist() == [[5, 2, 2, 2, 0], [8, 1, 1, 0, 0]]
    assert p.accepted.tolist() == [[2, 2, 2, 2, 0], [8, 1, 0, 0, 0]]
    assert p.tau.tolist() == [[3, 0, 0, 0, 2, 0], [0, 7, 1, 0, 0, 0]]


def test_plan_summary_merges_equal_decisions_by_batch() -> None:
    plan = plan_pb2.Plan(batch_size_edges=[1, 2, 4, 8, 16], context_len_edges=[0, 1024])
    for depth, width in [(5, 1), (3, 1), (5, 1), (3, 1), (4, 2), (2, 1), (4, 2), (0, 0), (0, 0), (0, 0)]:
        plan.table.add(depth=depth, width=width, max_nodes=depth * width)
    assert plan_summary(plan, 500) == "b1-3: 5 · b4-15: 4×2 · b16+: off"
    assert plan_summary(plan, 5000) == "b1-3: 3 · b4-7: 2 · b8+: off"


async def test_plan_cells_can_be_left_out() -> None:
    """A large fleet keeps the per-worker decision at its current load and drops the per-cell series."""
    running = await start_server(observed_config(metrics_plan_cells=False))
    agent = SpeculationAgent(make_hello("w0"), running.address).start()
    try:
        await feed(agent, SyntheticWorker(lambda ctx: 0.8, seed=1), [(1, SHORT)], rounds=20)
        await wait_for(lambda: agent.plan_version >= 1)
        m = await scrape(running)
        assert "specctl_plan_draft_depth" not in m and "specctl_plan_tree_width" not in m
        assert values(m["specctl_decision_draft_depth"], worker="w0")
    finally:
        agent.stop()
        await running.stop(0)


def test_plan_handoffs_of_the_last_minute_only() -> None:
    from controller.core import Controller
    from controller.observe.metrics import PLAN_HANDOFF_WINDOW_S, take_snapshot
    from policies.presets import load_preset

    now = [1000.0]
    ctl = Controller(ServerConfig(), load_preset("static"), clock=lambda: now[0])
    assert take_snapshot(ctl).plan_handoff_ms == ()
    ctl.plan_handoffs.extend([(1000.0 - PLAN_HANDOFF_WINDOW_S - 1.0, 40.0), (990.0, 2.0), (999.0, 3.0)])
    assert sorted(take_snapshot(ctl).plan_handoff_ms) == [2.0, 3.0]
    now[0] = 1000.0 + PLAN_HANDOFF_WINDOW_S - 5.0
    assert take_snapshot(ctl).plan_handoff_ms == (3.0,)
