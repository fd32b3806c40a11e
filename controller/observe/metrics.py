"""Prometheus metrics of the controller, read from its state at scrape time.

Nothing here runs on the ingest path: a scrape reads the running totals the
controller already keeps (``WorkerState`` counters, ``Controller.accept_counts``,
rejections by reason) in two stages. ``take_snapshot`` runs on the
controller's event loop and only copies plain values (a consistent view,
about 10 ms for 256 workers); ``render_metrics`` turns the
snapshot into metric families and Prometheus text anywhere, e.g. in a thread,
because formatting tens of thousands of samples takes prometheus-client
seconds. ``ControllerCollector`` does both in ``collect`` for use in any
``CollectorRegistry``.

Request classes (``class`` label, the policy file's names; one class
``default`` without them): share of request-steps, TPOT p50 / p99 over the
class's recent requests (``specctl_class_tpot_seconds``), τ and the share
of request-steps that drafted, lifetime request-step and token counters,
and the names nobody configured (``specctl_request_class_unknown_total``)
and typical-rule steps of strict classes
(``specctl_typical_acceptance_violations_total``). Shadow drafts used as
acceptance evidence, and those on typical-rule rows left out
(``specctl_shadow_drafts_total``).

Labels: ``context_bucket`` and ``batch_bucket`` name half-open bucket ranges
``LO-HI`` (``LO-inf`` for the last), ``position`` is the draft position
(tree level) from 1. The per-cell plan families are 2 × 144 series per
worker with the default buckets: ``plan_cells=False`` (config
``metrics_plan_cells``) keeps only the decision at each worker's current load.

A replica sharing state through Redis (``state.backend: redis``) adds the
``specctl_fleet_*`` families: the store's health (up, outages, failed calls
per operation), failed and completed acceptance merges, evidence not yet
merged, seconds since the last merge, live replicas, leases held, alert
events waiting, first plans held for the fleet's statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from controller.observe.metrics_gc import gc_families, gc_pauses
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import controller_pb2, plan_pb2

PLAN_HANDOFF_WINDOW_S = 60.0  # specctl_plan_handoff_seconds: the plans of the last minute

if TYPE_CHECKING:
    from controller.alerts.alerting import DriftAlerting
    from controller.core import Controller, WorkerState
    from controller.core.classes import ClassSummary
    from controller.observe.history import StatusHistory


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """Half-open ranges of bucket lower edges as label values.

    >>> bucket_labels((0, 1024, 4096))
    ['0-1024', '1024-4096', '4096-inf']
    """
    return [f"{lo}-{edges[i + 1] if i + 1 < len(edges) else 'inf'}" for i, lo in enumerate(edges)]


def reason_label(reason: int) -> str:
    """``REJECT_REASON_BAD_VALUE`` -> ``bad_value``."""
    try:
        name = plan_pb2.RejectReason.Name(reason)
    except ValueError:
        return str(reason)
    return name.removeprefix("REJECT_REASON_").lower()


class PositionCounts(NamedTuple):
    """Request-step totals per context bucket ``c`` and draft position ``k + 1``."""

    drafted: np.ndarray  # [c, k]: drafted position k + 1 (depth > k)
    reached: np.ndarray  # [c, k]: drafted it with positions 1..k accepted (depth > k, τ >= k)
    accepted: np.ndarray  # [c, k]: accepted it (depth > k, τ > k)
    tau: np.ndarray  # [c, t]: accepted exactly t tokens


def acceptance_by_position(counts: dict[tuple[int, int, int], int], n_buckets: int,
                           depth: int = 0) -> PositionCounts:
    """Per-position totals from ``(context bucket, depth, τ) -> request-steps``.

    Positions run to the deepest depth seen, at least ``depth``.
    ``accepted / drafted`` is the per-position rate in the sense of vLLM's
    ``spec_decode_num_accepted_tokens_per_pos``; ``accepted / reached`` is α,
    the acceptance of a position given the ones before it were accepted.

    >>> p = acceptance_by_position({(0, 3, 1): 10, (0, 2, 2): 5}, 1)
    >>> p.drafted.tolist(), p.reached.tolist(), p.accepted.tolist(), p.tau.tolist()
    ([[15, 15, 10]], [[15, 15, 0]], [[15, 5, 0]], [[0, 10, 5, 0]])
    """
    if counts:
        keys = np.array(list(counts.keys()), dtype=np.int64).reshape(-1, 3)
        n = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
        depth = max(depth, int(keys[:, 1].max()))
    cells = np.zeros((n_buckets, depth + 1, depth + 1), dtype=np.int64)  # [c, depth, τ]
    if counts:
        np.add.at(cells, (keys[:, 0], keys[:, 1], keys[:, 2]), n)
    d = np.arange(depth + 1)
    k = np.arange(depth)
    drafted_mask = d[None, :] > k[:, None]  # [k, depth]: position k + 1 drafted
    # Σ over cells with depth > k and τ > k (accepted) or τ >= k (reached).
    reach = (d[None, :] >= k[:, None])[:, None, :] & drafted_mask[:, :, None]  # [k, depth, τ]
    accept = (d[None, :] > k[:, None])[:, None, :] & drafted_mask[:, :, None]
    return PositionCounts(
        drafted=np.einsum("cdt,kd->ck", cells, drafted_mask.astype(np.int64)),
        reached=np.einsum("cdt,kdt->ck", cells, reach.astype(np.int64)),
        accepted=np.einsum("cdt,kdt->ck", cells, accept.astype(np.int64)),
        tau=cells.sum(axis=1),
    )


@dataclass(frozen=True)
class WorkerFacts:
    """One worker's values at scrape time (copies, or objects never mutated)."""

    worker_id: str
    engine: str
    model: str
    accelerator: str
    drafter_kind: str
    drafter_version: str
    connected: bool
    steps: int
    tokens: int
    step_seconds: float
    batch_size: float
    realised_goodput: float
    plan_version: int
    acked_version: int
    plans_pushed: int
    decisions_pushed: int
    acks: int
    nacks: int
    rejections: dict[int, int]
    table: DecisionTable | None  # frozen
    expected_goodput: float
    decision_now: Decision | None  # the plan's cell at the worker's mean batch and context
    session: str = "stream"  # "stream" (Connect) or "unary" (Decide only)
    idle_seconds: float = 0.0  # since its last message or Decide
    expired: bool = False  # disconnected by the idle TTL
    plans_used: int = 0  # plans a Decide-only worker applied by using them
    streams_superseded: int = 0
    steps_received: int = 0
    # Hello.telemetry_loss: the worker's own count of steps dropped / unconfirmed, finished dropped.
    telemetry_loss: tuple[int, int, int] = (0, 0, 0)
    classes: tuple["ClassSummary", ...] = ()  # per request class, the policy's order
    unknown_classes: tuple[int, int] = (0, 0)  # request-steps, Decide queries naming an unknown class
    typical_request_steps: int = 0  # verified with the typical rule for a class that allows it
    typical_violations: int = 0  # verified with the typical rule for a strict class
    shadow_drafts: tuple[int, int] = (0, 0)  # RequestStep.shadows: used as acceptance evidence, ignored (relaxed rows)
    class_decisions: tuple[tuple[str, Decision], ...] = ()  # each class's cell at the worker's mean batch and context


@dataclass(frozen=True)
class DriftFacts:
    open_alerts: list[tuple[str, str, str, str, str, str, float]]  # id, kind, version, stratum, action, severity, score
    monitor: dict[str, Any]  # AcceptanceDriftMonitor.snapshot()
    drops: tuple[float, ...]
    stats: dict[str, Any]  # DriftAlerting.stats()


@dataclass(frozen=True)
class MetricsSnapshot:
    context_edges: tuple[int, ...]
    workers: list[WorkerFacts]
    accept_counts: list[tuple[tuple[str, str, str], dict[tuple[int, int, int], int]]]
    rejections: dict[int, int]
    policy_reloads: int
    policy_reload_failures: int
    speedups: dict[str, float]
    streams_superseded: int
    workers_expired: int
    drift: DriftFacts | None
    plan_cells: bool
    fleet: dict[str, Any] | None = None  # FleetReplica.status() (state.backend: redis)
    # ms from created_at to gRPC taking it, of the plans handed over in the last PLAN_HANDOFF_WINDOW_S
    plan_handoff_ms: tuple[float, ...] = ()


def mean_context_len(state: "WorkerState") -> float:
    """The worker's mean context length over its recent load (0 before any)."""
    return state.load.mean_context_len()


def _decision_now(state: "WorkerState") -> Decision | None:
    if state.plans.current is None:
        return None
    return state.plans.current.table.lookup(max(1, round(state.load.batch_ema)), int(mean_context_len(state)))


def _class_decisions(state: "WorkerState") -> tuple[tuple[str, Decision], ...]:
    current = state.plans.current
    classes = state.plans.current_classes
    if current is None or classes.single:
        return ()
    batch, context = max(1, round(state.load.batch_ema)), int(mean_context_len(state))
    return tuple((c.name, current.table_for(c.name).lookup(batch, context)) for c in classes)


def take_snapshot(controller: "Controller", history: "StatusHistory | None" = None,
                  alerting: "DriftAlerting | None" = None, plan_cells: bool = True,
                  fleet: Any = None) -> MetricsSnapshot:
    """Copy what the metrics need (call on the controller's event loop)."""
    workers = []
    now = controller.clock()
    for s in controller.workers.values():
        h, c, plans, session = s.hello, s.counters, s.plans, s.session
        loss = h.telemetry_loss
        current = plans.current
        workers.append(WorkerFacts(
            s.worker_id, h.engine, h.model, h.hardware.accelerator, s.limits.kind, s.limits.version, session.connected,
            c.steps_total, c.tokens_total, c.step_ms_total / 1000.0, s.load.batch_ema, s.load.observed_goodput(),
            plans.plan_version, plans.acked_version, c.plans_pushed, c.decisions_pushed, c.acks, c.nacks,
            dict(c.rejections), current.table if current else None,
            current.expected_goodput_tok_s if current else 0.0, _decision_now(s),
            session="unary" if session.kind == controller_pb2.WORKER_SESSION_UNARY else "stream",
            idle_seconds=max(now - session.last_seen_at, 0.0), expired=session.expired, plans_used=c.plans_used,
            streams_superseded=c.streams_superseded, steps_received=c.steps_received,
            telemetry_loss=(loss.steps_dropped, loss.steps_unconfirmed, loss.finished_dropped),
            classes=tuple(s.classes.summaries(now)),
            unknown_classes=(c.unknown_class_request_steps, c.unknown_class_queries),
            typical_request_steps=c.typical_request_steps, typical_violations=c.typical_violations,
            shadow_drafts=(c.shadow_drafts, c.shadow_drafts_ignored),
            class_decisions=_class_decisions(s)))
    drift = None
    if alerting is not None:
        monitor = alerting.monitor
        drift = DriftFacts(
            [(a.id, a.drafter_kind, a.drafter_version, a.stratum, a.action.value, a.severity.value, a.score)
             for a in monitor.open_alerts()],
            monitor.snapshot(), tuple(monitor.config.drops), alerting.stats())
    handed_since = now - PLAN_HANDOFF_WINDOW_S
    handoffs = tuple(ms for at, ms in reversed(controller.plan_handoffs) if at >= handed_since)
    return MetricsSnapshot(
        tuple(controller.context_edges), workers,
        [(key, dict(counts)) for key, counts in controller.accept_counts.items()],
        dict(controller.rejections), controller.policy_reloads, controller.policy_reload_failures,
        history.latest_speedups() if history is not None else {}, controller.streams_superseded,
        controller.workers_expired, drift, plan_cells, fleet.status() if fleet is not None else None, handoffs)


def metric_families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """Every ``specctl_*`` family of ``snap``."""
    yield from _workers(snap)
    yield from _classes(snap)
    yield from _acceptance(snap)
    yield from _plans(snap)
    yield from _plan_handoffs(snap.plan_handoff_ms)
    yield from _rejections(snap)
    if snap.drift is not None:
        yield from _drift(snap.drift)
    if snap.fleet is not None:
        yield from _fleet(snap.fleet)


def _fleet(status: dict[str, Any]) -> Iterable[Metric]:
    health, sync = status["health"], status["sync"]
    replica = status["replica_id"]
    yield GaugeMetricFamily("specctl_fleet_store_up", "1 if the fleet store (Redis) answered the last call.",
                            value=1.0 if health["up"] else 0.0)
    yield CounterMetricFamily("specctl_fleet_store_outages_total", "Times the fleet store stopped answering.",
                              value=health["outages"])
    failures = CounterMetricFamily("specctl_fleet_store_failures_total",
                                   "Fleet store calls that failed (skipped; the replica served from local state).",
                                   labels=["op"])
    for op, n in sorted(health["failures"].items()):
        failures.add_metric([op], n)
    yield failures
    yield CounterMetricFamily("specctl_fleet_merges_total", "Acceptance merge rounds completed.",
                              value=status["merges"])
    yield CounterMetricFamily("specctl_fleet_merge_failures_total",
                              "Acceptance merge rounds that failed (their evidence waits, merged once later).",
                              value=status["failed_merges"])
    yield GaugeMetricFamily("specctl_fleet_unmerged_evidence",
                            "Acceptance evidence (decayed request-step outcomes) not yet in the fleet totals.",
                            value=sync["unmerged_evidence"])
    since = sync["since_merge_s"]
    yield GaugeMetricFamily("specctl_fleet_seconds_since_merge",
                            "Seconds since the last completed acceptance merge (NaN before the first).",
                            value=float("nan") if since is None else since)
    yield GaugeMetricFamily("specctl_fleet_live_replicas", "Replicas alive in the fleet directory.",
                            value=status["live_replicas"])
    yield GaugeMetricFamily("specctl_fleet_leases_held", "Drift strata whose alerts this replica owns.",
                            value=status["leases_held"])
    yield GaugeMetricFamily("specctl_fleet_alert_events_queued", "Alert events waiting to reach the fleet store.",
                            value=status["alert_events_queued"])
    yield CounterMetricFamily("specctl_fleet_first_plans_held_total",
                              "Workers whose first plan waited for the fleet's acceptance statistics.",
                              value=status["counts"].get("first_plans_held", 0))
    if status["alerts"] is not None:
        findings = CounterMetricFamily(
            "specctl_fleet_drift_findings_total",
            "This replica's drift findings: opened (it owns the stratum's lease), attached (to the alert another "
            "replica opened), deferred (waited for the lease), deferred_dropped (waited too long).",
            labels=["outcome"])
        counts = status["alerts"]["counts"]
        for outcome in ("opened", "attached", "deferred", "deferred_dropped"):
            findings.add_metric([outcome], counts.get(outcome, 0))
        yield findings
    if status.get("drift") is not None:
        yield from _fleet_drift(status["drift"])
    info = InfoMetricFamily("specctl_fleet_replica", "This replica in the fleet.", labels=["replica", "fleet"])
    info.add_metric([replica, health["fleet"]], {})
    yield info


def _fleet_drift(drift: dict[str, Any]) -> Iterable[Metric]:
    """One drift monitor per drafter version fleet-wide (controller.fleet.drift_owner): who runs which, the lag."""
    labels = ["drafter_kind", "drafter_version", "owner"]
    owned = GaugeMetricFamily("specctl_fleet_drift_monitor_owned",
                              "1 if this replica runs the drafter version's drift monitor (owner: who does).",
                              labels=labels)
    lag = GaugeMetricFamily("specctl_fleet_drift_evidence_lag",
                            "Entries of the version's evidence stream not yet fed to its monitor (its owner only).",
                            labels=labels[:2])
    fraction = GaugeMetricFamily("specctl_fleet_drift_sample_fraction",
                                 "Share of requests this replica forwards to the version's drift monitor: its own "
                                 "drift.sample_fraction, or the lower one the monitor's owner published.",
                                 labels=labels[:2])
    for d in drift["versions"]:
        owned.add_metric([d["drafter_kind"], d["drafter_version"], d["owner"]], 1.0 if d["owned_here"] else 0.0)
        if d["owned_here"]:
            lag.add_metric([d["drafter_kind"], d["drafter_version"]], d["evidence_lag"])
        if "sample_fraction" in d:
            fraction.add_metric([d["drafter_kind"], d["drafter_version"]], d["sample_fraction"])
    yield owned
    yield lag
    yield fraction
    outbox = drift["outbox"]
    sent = CounterMetricFamily("specctl_fleet_drift_evidence_total",
                               "Sampled request-step outcomes of this replica's workers on their way to the drift "
                               "monitors: sent to the stream, or dropped (Redis unreachable, buffer full).",
                               labels=["outcome"])
    for outcome in ("sent", "dropped"):
        sent.add_metric([outcome], outbox["counts"].get(outcome, 0))
    yield sent
    yield GaugeMetricFamily("specctl_fleet_drift_evidence_queued", "Sampled outcomes waiting here to be sent.",
                            value=outbox["buffered"])
    takeovers = CounterMetricFamily("specctl_fleet_drift_takeovers_total",
                                    "Drafter versions whose drift monitor this replica took over, by where it started "
                                    "from: the fleet's checkpoint, its own copy, the local store, the stream's start.",
                                    labels=["source"])
    for source in ("checkpoint", "own_copy", "local_store", "stream_start"):
        takeovers.add_metric([source], drift["counts"].get("takeovers_from_" + source, 0))
    yield takeovers


def _workers(snap: MetricsSnapshot) -> Iterable[Metric]:
    info = InfoMetricFamily("specctl_worker", "Worker identity from its latest Hello.",
                            labels=["worker", "engine", "model", "accelerator", "drafter_kind", "drafter_version"])
    connected = GaugeMetricFamily("specctl_worker_connected",
                                  "1 while the worker holds a Connect stream (or, Decide-only, called within "
                                  "worker_idle_ttl_s).", labels=["worker", "session"])
    idle = GaugeMetricFamily("specctl_worker_idle_seconds", "Seconds since the worker's last message or Decide.",
                             labels=["worker"])
    expired = GaugeMetricFamily("specctl_worker_expired",
                                "1 when the worker was taken for gone after worker_idle_ttl_s of silence.",
                                labels=["worker"])
    lost = CounterMetricFamily("specctl_worker_telemetry_lost_total",
                               "Telemetry the worker says it lost (its Hello.telemetry_loss): steps its queue "
                               "dropped, steps a broken stream left unconfirmed, finished requests dropped.",
                               labels=["worker", "what"])
    received = CounterMetricFamily("specctl_steps_received_total", "Step reports read, applied or rejected.",
                                   labels=["worker"])
    steps = CounterMetricFamily("specctl_steps_total", "Engine steps ingested.", labels=["worker"])
    tokens = CounterMetricFamily("specctl_generated_tokens_total",
                                 "Tokens the worker's steps emitted (accepted drafts plus one per request-step).",
                                 labels=["worker"])
    step_time = CounterMetricFamily("specctl_step_time_seconds_total",
                                    "Draft plus verify time of the ingested steps.", labels=["worker"])
    batch = GaugeMetricFamily("specctl_batch_size", "Moving average of the batch size.", labels=["worker"])
    realised = GaugeMetricFamily("specctl_realised_goodput_tokens_per_second",
                                 "Observed tokens per second of step time (moving average).", labels=["worker"])
    for w in snap.workers:
        wid = w.worker_id
        info.add_metric([wid, w.engine, w.model, w.accelerator, w.drafter_kind, w.drafter_version], {})
        connected.add_metric([wid, w.session], 1.0 if w.connected else 0.0)
        idle.add_metric([wid], w.idle_seconds)
        expired.add_metric([wid], 1.0 if w.expired else 0.0)
        for what, value in zip(("steps_dropped", "steps_unconfirmed", "finished_dropped"), w.telemetry_loss):
            lost.add_metric([wid, what], value)
        received.add_metric([wid], w.steps_received)
        steps.add_metric([wid], w.steps)
        tokens.add_metric([wid], w.tokens)
        step_time.add_metric([wid], w.step_seconds)
        batch.add_metric([wid], w.batch_size)
        realised.add_metric([wid], w.realised_goodput)
    yield from (info, connected, idle, expired, lost, received, steps, tokens, step_time, batch, realised)
    yield CounterMetricFamily("specctl_streams_superseded_total",
                              "Connect streams ended because a newer stream took their worker id.",
                              value=snap.streams_superseded)
    yield CounterMetricFamily("specctl_workers_expired_total",
                              "Workers taken for gone after worker_idle_ttl_s without a message.",
                              value=snap.workers_expired)
    yield CounterMetricFamily("specctl_policy_reloads_total", "Policy files loaded after start.",
                              value=snap.policy_reloads)
    yield CounterMetricFamily("specctl_policy_reload_failures_total", "Policy files refused (old policy kept).",
                              value=snap.policy_reload_failures)


def _classes(snap: MetricsSnapshot) -> Iterable[Metric]:
    labels = ["worker", "class"]
    share = GaugeMetricFamily("specctl_class_share",
                              "The class's share of the worker's reported request-steps (recent, 30 s half-life).",
                              labels=labels)
    tpot = GaugeMetricFamily("specctl_class_tpot_seconds",
                             "Time per output token over the class's requests seen in the last 30 s (each: its "
                             "steps' draft+verify+catch-up time over the tokens they emitted), at the quantile.",
                             labels=["worker", "class", "quantile"])
    target = GaugeMetricFamily("specctl_class_tpot_target_seconds",
                               "The policy's TPOT target of the class, at its quantile (classes with one).",
                               labels=["worker", "class", "quantile"])
    measured = GaugeMetricFamily("specctl_class_tpot_requests", "Requests behind the class's TPOT quantiles.",
                                 labels=labels)
    tau = GaugeMetricFamily("specctl_class_accepted_tokens_per_draft",
                            "τ: accepted draft tokens per drafting request-step of the class (recent).", labels=labels)
    spec = GaugeMetricFamily("specctl_class_speculation_fraction",
                             "Share of the class's request-steps that drafted (recent).", labels=labels)
    steps = CounterMetricFamily("specctl_class_request_steps_total", "Request-steps of the class ingested.",
                                labels=labels)
    tokens = CounterMetricFamily("specctl_class_generated_tokens_total",
                                 "Tokens the class's request-steps emitted (accepted drafts plus one each).",
                                 labels=labels)
    typical = CounterMetricFamily("specctl_class_typical_request_steps_total",
                                  "Request-steps of the class verified with the typical (relaxed) rule.",
                                  labels=labels)
    unknown = CounterMetricFamily("specctl_request_class_unknown_total",
                                  "Request-steps (source=step) and Decide queries (source=decide) naming a class the "
                                  "policy does not know; served as the default class.", labels=["worker", "source"])
    depth = GaugeMetricFamily("specctl_class_decision_draft_depth",
                              "Draft depth the plan gives the class at the worker's mean batch and context "
                              "(plans with classes only).", labels=labels)
    violations = CounterMetricFamily("specctl_typical_acceptance_violations_total",
                                     "Request-steps verified with the typical rule for a class whose plan says "
                                     "strict (their acceptance is not used).", labels=["worker"])
    shadows = CounterMetricFamily("specctl_shadow_drafts_total",
                                  "Shadow drafts (chains proposed for requests that did not draft, compared with the "
                                  "tokens emitted): used as acceptance evidence (used=true), or sent for a relaxed "
                                  "row and not used (used=false).", labels=["worker", "used"])
    for w in snap.workers:
        wid = w.worker_id
        shadows.add_metric([wid, "true"], w.shadow_drafts[0])
        shadows.add_metric([wid, "false"], w.shadow_drafts[1])
        for c in w.classes:
            key = [wid, c.name]
            share.add_metric(key, c.share)
            measured.add_metric(key, c.tpot_requests)
            if c.tpot_requests:
                tpot.add_metric([*key, "0.5"], c.tpot_ms_p50 / 1000.0)
                tpot.add_metric([*key, "0.99"], c.tpot_ms_p99 / 1000.0)
            if c.spec.tpot_target_ms is not None:
                target.add_metric([*key, "0.5" if c.spec.tpot_quantile == "p50" else "0.99"],
                                  c.spec.tpot_target_ms / 1000.0)
            tau.add_metric(key, c.tau)
            spec.add_metric(key, c.spec_fraction)
            steps.add_metric(key, c.request_steps)
            tokens.add_metric(key, c.tokens)
            typical.add_metric(key, c.typical_request_steps)
        unknown.add_metric([wid, "step"], w.unknown_classes[0])
        unknown.add_metric([wid, "decide"], w.unknown_classes[1])
        violations.add_metric([wid], w.typical_violations)
        for name, d in w.class_decisions:
            depth.add_metric([wid, name], d.depth)
    yield from (share, tpot, target, measured, tau, spec, steps, tokens, typical, unknown, violations, depth, shadows)


def _acceptance(snap: MetricsSnapshot) -> Iterable[Metric]:
    labels = ["worker", "drafter_kind", "drafter_version", "context_bucket", "position"]
    drafted = CounterMetricFamily(
        "specctl_draft_tokens_total",
        "Request-steps that drafted a token at this position (tree level); cf. vLLM spec_decode_num_draft_tokens.",
        labels=labels)
    accepted = CounterMetricFamily(
        "specctl_accepted_tokens_total",
        "Request-steps whose draft token at this position was accepted; cf. vLLM "
        "spec_decode_num_accepted_tokens_per_pos.", labels=labels)
    buckets = bucket_labels(snap.context_edges)
    for (worker, kind, version), counts in snap.accept_counts:
        p = acceptance_by_position(counts, len(buckets))
        for c, k in zip(*np.nonzero(p.drafted)):
            key = [worker, kind, version, buckets[c], str(k + 1)]
            drafted.add_metric(key, int(p.drafted[c, k]))
            accepted.add_metric(key, int(p.accepted[c, k]))
    yield drafted
    yield accepted


def _plans(snap: MetricsSnapshot) -> Iterable[Metric]:
    now_labels = ["worker", "drafter_version"]
    depth_now = GaugeMetricFamily("specctl_decision_draft_depth",
                                  "Draft depth (tokens) the plan gives at the worker's mean batch and context.",
                                  labels=now_labels)
    width_now = GaugeMetricFamily("specctl_decision_tree_width",
                                  "Tree width the plan gives at the worker's mean batch and context.",
                                  labels=now_labels)
    enabled_now = GaugeMetricFamily("specctl_decision_speculation_enabled",
                                    "1 where the plan speculates at the worker's mean batch and context.",
                                    labels=now_labels)
    cell_labels = ["worker", "drafter_version", "batch_bucket", "context_bucket"]
    depth = GaugeMetricFamily("specctl_plan_draft_depth",
                              "Draft depth (tokens) of each plan cell; 0 = speculation off.", labels=cell_labels)
    width = GaugeMetricFamily("specctl_plan_tree_width", "Tree width (candidates per level) of each plan cell.",
                              labels=cell_labels)
    version = GaugeMetricFamily("specctl_plan_version", "Version of the latest plan or override sent.",
                                labels=["worker"])
    acked = GaugeMetricFamily("specctl_plan_acked_version", "Latest plan version the worker acknowledged.",
                              labels=["worker"])
    estimated = GaugeMetricFamily("specctl_estimated_goodput_tokens_per_second",
                                  "Goodput the policy expected of the latest plan when it made it.", labels=["worker"])
    speedup = GaugeMetricFamily("specctl_estimated_speedup_ratio",
                                "Estimated goodput of the plan over speculation off, same load and models "
                                "(latest status sample).", labels=["worker"])
    pushed = CounterMetricFamily("specctl_plan_pushes_total", "Plans and per-request overrides sent.",
                                 labels=["worker", "kind"])
    acks = CounterMetricFamily("specctl_plan_acks_total", "Plans and overrides the worker acknowledged.",
                               labels=["worker"])
    used = CounterMetricFamily("specctl_plan_used_total",
                               "Plans a Decide-only worker acknowledged by deciding from them.", labels=["worker"])
    nacks = CounterMetricFamily("specctl_plan_nacks_total", "Plans and overrides the worker refused.",
                                labels=["worker"])
    for w in snap.workers:
        wid = w.worker_id
        version.add_metric([wid], w.plan_version)
        acked.add_metric([wid], w.acked_version)
        pushed.add_metric([wid, "plan"], w.plans_pushed)
        pushed.add_metric([wid, "request_decisions"], w.decisions_pushed)
        acks.add_metric([wid], w.acks)
        used.add_metric([wid], w.plans_used)
        nacks.add_metric([wid], w.nacks)
        if wid in snap.speedups:
            speedup.add_metric([wid], snap.speedups[wid])
        if w.table is None:
            continue
        estimated.add_metric([wid], w.expected_goodput)
        d = w.decision_now
        depth_now.add_metric([wid, w.drafter_version], d.depth)
        width_now.add_metric([wid, w.drafter_version], d.width)
        enabled_now.add_metric([wid, w.drafter_version], 1.0 if d.depth else 0.0)
        if not snap.plan_cells:
            continue
        table = w.table
        contexts = bucket_labels(table.context_edges)
        for b, batch_label in enumerate(bucket_labels(table.batch_edges)):
            for c, cell in enumerate(table.row(b)):
                key = [wid, w.drafter_version, batch_label, contexts[c]]
                depth.add_metric(key, cell.depth)
                width.add_metric(key, cell.width)
    yield from (depth_now, width_now, enabled_now, version, acked, estimated, speedup, pushed, acks, used, nacks)
    if snap.plan_cells:
        yield from (depth, width)


def _plan_handoffs(handoff_ms: Sequence[float]) -> Iterable[Metric]:
    """The controller's own part of a plan's push latency: from the plan's ``created_at`` to the
    moment its stream's writer handed it to gRPC, over the plans of the last minute (none: no
    samples). What a worker measures beyond it is gRPC, the network and the worker itself.

    >>> [(s.labels, round(s.value, 4)) for m in _plan_handoffs([1.0, 2.0, 3.0, 10.0]) for s in m.samples]
    [({'quantile': '0.5'}, 0.0025), ({'quantile': '0.99'}, 0.0098), ({'quantile': '1'}, 0.01), ({}, 4.0)]
    """
    seconds = GaugeMetricFamily("specctl_plan_handoff_seconds",
                                "Plan created -> taken by gRPC for writing, over the plans of the last minute.",
                                labels=["quantile"])
    count = GaugeMetricFamily("specctl_plan_handoffs", "Plans taken by gRPC for writing in the last minute.")
    if handoff_ms:
        for label, q in (("0.5", 50), ("0.99", 99), ("1", 100)):
            seconds.add_metric([label], float(np.percentile(handoff_ms, q)) / 1000.0)
    count.add_metric([], float(len(handoff_ms)))
    yield seconds
    yield count


def _rejections(snap: MetricsSnapshot) -> Iterable[Metric]:
    total = CounterMetricFamily("specctl_rejected_messages_total",
                                "Messages refused, by reason (nothing of them was applied).", labels=["reason"])
    for reason, count in sorted(snap.rejections.items()):
        total.add_metric([reason_label(reason)], count)
    per_worker = CounterMetricFamily("specctl_worker_rejected_messages_total",
                                     "Messages refused per worker, by reason.", labels=["worker", "reason"])
    for w in snap.workers:
        for reason, count in sorted(w.rejections.items()):
            per_worker.add_metric([w.worker_id, reason_label(reason)], count)
    yield total
    yield per_worker


def _drift(drift: DriftFacts) -> Iterable[Metric]:
    open_alerts = GaugeMetricFamily("specctl_drift_open_alerts", "Drift alerts open.",
                                    labels=["drafter_kind", "drafter_version", "action", "severity"])
    alert_score = GaugeMetricFamily("specctl_drift_alert_score",
                                    "An open alert's statistic over its threshold (> 1 when raised).",
                                    labels=["alert_id", "drafter_kind", "drafter_version", "stratum", "action"])
    counts: dict[tuple[str, str, str, str], int] = {}
    for alert_id, kind, version, stratum, action, severity, score in drift.open_alerts:
        counts[kind, version, action, severity] = counts.get((kind, version, action, severity), 0) + 1
        alert_score.add_metric([alert_id, kind, version, stratum, action], score)
    for key, n in sorted(counts.items()):
        open_alerts.add_metric(list(key), n)
    cusum = GaugeMetricFamily("specctl_drift_cusum_score",
                              "Likelihood-ratio CUSUM statistic over its threshold per tuned drop (alarm at 1).",
                              labels=["drafter_kind", "drafter_version", "drop"])
    p_value = GaugeMetricFamily("specctl_drift_window_p_value",
                                "Calibrated p-value of the stratum's latest accept-length window.",
                                labels=["drafter_kind", "drafter_version", "stratum"])
    for v in drift.monitor.get("versions", ()):
        key = [v["drafter_kind"], v["drafter_version"]]
        for drop, stat, threshold in zip(drift.drops, v["cusum_statistics"], v["cusum_thresholds"]):
            if stat is not None and threshold:
                cusum.add_metric([*key, f"{drop:g}"], stat / threshold)
        for s in v["strata"]:
            if s["last_p_value"] is not None:
                p_value.add_metric([*key, s["stratum"]], s["last_p_value"])
    yield from (open_alerts, alert_score, cusum, p_value)
    yield CounterMetricFamily("specctl_drift_request_steps_total", "Request-steps the drift monitor has seen.",
                              value=drift.monitor.get("steps", 0))
    events = CounterMetricFamily("specctl_drift_alert_events_total", "Alert events (opened, resolved, ...).",
                                 labels=["event"])
    for event, n in sorted(drift.stats.get("events", {}).items()):
        events.add_metric([event], n)
    yield events
    feed = drift.stats.get("feed", {})
    yield GaugeMetricFamily("specctl_drift_sample_fraction",
                            "Share of requests the drift monitor follows (shrinks when it runs out of CPU budget).",
                            value=feed.get("sample_fraction", 0.0))
    yield CounterMetricFamily("specctl_drift_dropped_request_steps_total",
                              "Request-steps dropped before the drift monitor saw them (full buffer).",
                              value=feed.get("dropped", 0))


class _Families:
    """What ``generate_latest`` needs of a registry: ``collect()``."""

    def __init__(self, snap: MetricsSnapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(self.snap)
        yield from gc_families(gc_pauses().snapshot())  # process-wide, like PROCESS
        yield from PROCESS.collect()


PROCESS = ProcessCollector(registry=None)  # this process's CPU, memory and file descriptors


def render_metrics(snap: MetricsSnapshot) -> bytes:
    """Prometheus text (format 0.0.4) of ``snap`` and of the process; safe to call off the event loop."""
    return generate_latest(_Families(snap))


class ControllerCollector(Collector):
    """The ``specctl_*`` families of a controller, for any ``CollectorRegistry``
    (``collect`` must then run where the controller's state is not changing)."""

    def __init__(self, controller: "Controller", history: "StatusHistory | None" = None,
                 alerting: "DriftAlerting | None" = None, plan_cells: bool = True) -> None:
        self.controller = controller
        self.history = history
        self.alerting = alerting
        self.plan_cells = plan_cells

    def collect(self) -> Iterator[Metric]:
        return metric_families(take_snapshot(self.controller, self.history, self.alerting, self.plan_cells))
