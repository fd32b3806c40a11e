"""What the status page plots: bounded history sampled off the ingest path.

``StatusHistory.sample_due`` runs in the server's housekeeping tick and
samples each worker every ``status_sample_interval_s``, oldest first, within
a CPU budget per tick (a large fleet is sampled less often; ingest never
waits). Per worker it records, in ring buffers of ``capacity`` samples:

* α of every draft position (accepted over reached) and the accepted-length
  distribution, measured since their previous value from differences of
  ``Controller.accept_counts``; a value waits until ``MIN_TRIALS``
  request-steps back it, so a quiet interval extends the next one instead
  of plotting noise;
* the estimated end-to-end speedup of the plan in force: its goodput over
  speculation off at the worker's current load, under the current cost and
  acceptance models;
* the goodput the policy expected, estimated now, and observed (gaps while
  the worker is disconnected);
* each request class's TPOT p50 / p99 over its recent requests (issue #29).

Drafter versions announced in Hellos are recorded as roll-outs when they are
seen (``Controller.on_hello``). ``snapshot`` turns all of it into JSON-ready
data for ``/status.json`` and the page.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from controller.core.controller import STATUS_SLICE_S
from controller.observe.metrics import acceptance_by_position, bucket_labels, mean_context_len, reason_label
from policies.base import Observation
from policies.goodput import observed_mix, table_goodput
from policies.outcome import STATE_NAMES, split_first_states
from protos.speculation.v1 import controller_pb2

if TYPE_CHECKING:
    from controller.alerts.alerting import DriftAlerting
    from controller.core import Controller, WorkerState
    from controller.core.classes import ClassSummary
    from policies.table import DecisionTable

MIN_TRIALS = 30  # request-steps behind a plotted acceptance or τ-share value
SNAPSHOT_SLICE_S = STATUS_SLICE_S  # CPU a snapshot may hold the event loop for before it yields (snapshot_async)
SERIES = ("t", "drafter_version", "plan_version", "alpha", "tau_share", "speedup", "estimated_goodput",
          "expected_goodput", "realised_goodput", "class_tpot")


def estimated_goodputs(controller: "Controller", state: "WorkerState") -> tuple[float, float] | None:
    """(plan in force, speculation off) estimated tokens per second at the
    worker's current load, under today's models; ``None`` before a plan.

    Reads the models without refitting or folding anything, so it can run
    at any time without changing what the policies will see. Speculation off
    is ``table_goodput`` of an all-off table, priced directly: one token per
    request per step of the verify cost.
    """
    if state.plans.current is None:
        return None
    limits = state.limits
    obs = Observation(
        now=controller.clock(),
        worker_id=state.worker_id,
        drafter=limits,
        batch_edges=controller.batch_edges,
        context_edges=controller.context_edges,
        acceptance=controller.acceptance.view(state.drafter_key, limits.max_depth, limits.max_width),
        cost=state.cost.params,
        load=state.load.profile(),
    )
    share, means = observed_mix(obs)
    batch = obs.load.mean_batch_size
    plain_ms = float(obs.cost.verify_ms(batch, batch * float(np.dot(share, means))))
    return table_goodput(state.plans.current.table, obs), 1000.0 * batch / max(plain_ms, 1e-9)


def _class_cell(state: "WorkerState", name: str) -> list[int] | None:
    """[depth, width] of the class's table in the plan in force at the worker's
    mean batch and context; None before a plan."""
    plan = state.plans.in_force
    if plan is None:
        return None
    table = plan.table if state.plans.in_force_classes.single else plan.table_for(name)
    d = table.lookup(max(1, round(state.load.batch_ema)), int(mean_context_len(state)))
    return [d.depth, d.width]


def _class_dict(c: "ClassSummary", cell: list[int] | None = None) -> dict[str, Any]:
    """One class of a worker for ``/status.json`` and the page (``cell``: its plan's decision now)."""
    spec = c.spec
    return {
        "decision_now": cell,
        "name": c.name, "is_default": c.is_default, "weight": spec.weight, "tpot_target_ms": spec.tpot_target_ms,
        "tpot_quantile": spec.tpot_quantile, "acceptance": spec.acceptance, "share": c.share,
        "tpot_ms_p50": c.tpot_ms_p50 if c.tpot_requests else None,
        "tpot_ms_p99": c.tpot_ms_p99 if c.tpot_requests else None, "tpot_requests": c.tpot_requests,
        "tau": c.tau, "spec_fraction": c.spec_fraction, "tokens_per_step": c.tokens_per_step,
        "step_ms_mean": c.step_ms_mean, "mean_context_len": c.mean_context_len, "request_steps": c.request_steps,
        "typical_request_steps": c.typical_request_steps,
    }


def _cells(table: "DecisionTable") -> dict[str, list[list[int]]]:
    """Depth, width and node cap of every cell of ``table``, one list per batch bucket."""
    rows = [table.row(b) for b in range(len(table.batch_edges))]
    return {"depth": [[d.depth for d in row] for row in rows], "width": [[d.width for d in row] for row in rows],
            "max_nodes": [[d.max_nodes for d in row] for row in rows]}


def _state_table(state: int, table: "DecisionTable") -> dict[str, Any]:
    """One request state's table of a plan (``Plan.state_tables`` / ``later_state_tables``), same edges as the plan."""
    return {"state": state, "name": STATE_NAMES.get(state, str(state)), **_cells(table)}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


@dataclass
class WorkerHistory:
    """Ring buffers of one worker's samples (one entry per sample, aligned)."""

    capacity: int
    t: deque = field(init=False)
    drafter_version: deque = field(init=False)
    plan_version: deque = field(init=False)
    alpha: deque = field(init=False)  # per position: accepted / reached since the last value, None while waiting
    tau_share: deque = field(init=False)  # share of speculated request-steps accepting τ = 0..max_depth
    speedup: deque = field(init=False)
    estimated_goodput: deque = field(init=False)  # plan in force, today's models (tok/s)
    expected_goodput: deque = field(init=False)  # what the policy expected when it made the plan (tok/s)
    realised_goodput: deque = field(init=False)
    class_tpot: deque = field(init=False)  # class name -> [TPOT p50, p99] in ms (None: no request measured)
    # Per drafter key: cumulative (reached, accepted, τ) when each position's
    # α and the τ shares were last plotted.
    base: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    # Steps, plan and link at the last estimate, and the estimate: unchanged inputs, same estimate.
    estimate_key: tuple | None = None
    estimate: tuple[float | None, float | None] = (None, None)
    next_due: float = float("-inf")

    def __post_init__(self) -> None:
        for name in SERIES:
            setattr(self, name, deque(maxlen=self.capacity))

    def to_dict(self) -> dict[str, list]:
        return {name: list(getattr(self, name)) for name in SERIES}


@dataclass(frozen=True)
class Rollout:
    t: float
    worker_id: str
    drafter_kind: str
    drafter_version: str
    previous_version: str | None  # None: the worker's first Hello seen

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatusHistory:
    """Bounded history of a controller for the status page.

    Parameters
    ----------
    controller
        The controller to sample; ``on_hello`` gets a hook for roll-outs.
    capacity
        Samples kept per worker.
    max_rollouts
        Drafter version roll-outs kept (oldest dropped).
    alerting
        The server's drift alerting, whose monitor's alerts the page shows.
    """

    def __init__(self, controller: "Controller", capacity: int = 720, max_rollouts: int = 1000,
                 alerting: "DriftAlerting | None" = None) -> None:
        self.controller = controller
        self.alerting = alerting
        self.capacity = capacity
        self.workers: dict[str, WorkerHistory] = {}
        self.rollouts: deque[Rollout] = deque(maxlen=max_rollouts)
        self._versions: dict[str, str] = {}  # worker id -> drafter version last announced
        self.samples = 0  # worker-samples taken
        controller.on_hello.append(self._hello)

    def _hello(self, state: "WorkerState") -> None:
        previous = self._versions.get(state.worker_id)
        if previous != state.limits.version:
            self._versions[state.worker_id] = state.limits.version
            self.rollouts.append(Rollout(self.controller.clock(), state.worker_id, state.limits.kind,
                                         state.limits.version, previous))

    # ------------------------------------------------------------ sampling
    def sample_due(self, interval_s: float, budget_s: float) -> int:
        """Sample the workers not sampled for ``interval_s``, oldest first,
        until ``budget_s`` of CPU is spent; returns how many were sampled."""
        now = self.controller.clock()
        start = time.perf_counter()
        due = [(self._history(s.worker_id).next_due, s.worker_id, s) for s in self.controller.workers.values()]
        done = 0
        for next_due, _, state in sorted(d for d in due if d[0] <= now):
            self._sample_worker(state, now)
            self.workers[state.worker_id].next_due = now + interval_s
            done += 1
            if time.perf_counter() - start > budget_s:
                break
        return done

    def _history(self, worker_id: str) -> WorkerHistory:
        h = self.workers.get(worker_id)
        if h is None:
            h = self.workers[worker_id] = WorkerHistory(self.capacity)
        return h

    def _sample_worker(self, state: "WorkerState", now: float) -> None:
        h = self._history(state.worker_id)
        h.t.append(now)
        h.drafter_version.append(state.limits.version)
        h.plan_version.append(state.plans.acked_version)
        alpha, tau_share = self._acceptance(h, state, len(self.controller.context_edges))
        h.alpha.append(alpha)
        h.tau_share.append(tau_share)
        key = (state.counters.steps_total, state.plans.plan_version, state.session.connected)
        if key != h.estimate_key:  # the models and the load move only with new steps
            h.estimate_key = key
            goodputs = estimated_goodputs(self.controller, state) if state.session.connected else None
            if goodputs is None or goodputs[1] <= 0:
                h.estimate = (None, None)
            else:
                h.estimate = (_finite(goodputs[0] / goodputs[1]), _finite(goodputs[0]))
        h.speedup.append(h.estimate[0])
        h.estimated_goodput.append(h.estimate[1])
        live = state.session.connected and state.plans.current is not None
        h.expected_goodput.append(state.plans.current.expected_goodput_tok_s if live else None)
        realised = state.session.connected and state.counters.steps_total
        h.realised_goodput.append(state.load.observed_goodput() if realised else None)
        h.class_tpot.append({c.name: [c.tpot_ms_p50, c.tpot_ms_p99] if c.tpot_requests else None
                             for c in state.classes.summaries(now)})
        self.samples += 1

    @staticmethod
    def _acceptance(h: WorkerHistory, state: "WorkerState",
                    n_buckets: int) -> tuple[list[float | None], list[float] | None]:
        """α per position and τ shares since each was last plotted, where ``MIN_TRIALS`` back them."""
        p = acceptance_by_position(state.accept_counts, n_buckets, state.limits.max_depth)
        reached, accepted, tau = p.reached.sum(axis=0), p.accepted.sum(axis=0), p.tau.sum(axis=0)
        base = h.base.get(state.drafter_key)
        if base is None:  # everything the version did so far
            base = h.base[state.drafter_key] = tuple(np.zeros_like(x) for x in (reached, accepted, tau))
        elif base[0].shape != reached.shape:  # the drafter's depth changed: start over from here
            base = h.base[state.drafter_key] = tuple(x.copy() for x in (reached, accepted, tau))
        alpha: list[float | None] = []
        for k in range(len(reached)):
            n = reached[k] - base[0][k]
            if n >= MIN_TRIALS:
                alpha.append(float((accepted[k] - base[1][k]) / n))
                base[0][k], base[1][k] = reached[k], accepted[k]
            else:
                alpha.append(None)
        d_tau = tau - base[2]
        speculated = int(d_tau.sum())
        if speculated < MIN_TRIALS:
            return alpha, None
        base[2][:] = tau
        return alpha, [float(x / speculated) for x in d_tau]

    def latest_speedups(self) -> dict[str, float]:
        """Worker id -> estimated speedup of its latest sample (where known)."""
        return {w: h.speedup[-1] for w, h in self.workers.items() if h.speedup and h.speedup[-1] is not None}

    # ------------------------------------------------------------ snapshot
    def snapshot(self, worker_id: str = "", detailed: int = 16) -> dict[str, Any]:
        """What the page shows, as JSON-ready copies (safe to render in another thread).

        Every worker gets its summary; the plan and the history come with the
        first ``detailed`` workers by id, or with ``worker_id`` alone when given.
        """
        out, states = self._snapshot_head(worker_id)
        out["workers"] = [self._worker(s, detail=i < detailed or bool(worker_id)) for i, s in enumerate(states)]
        return out

    async def snapshot_async(self, worker_id: str = "", detailed: int = 16,
                             slice_s: float | None = None) -> dict[str, Any]:
        """:meth:`snapshot` built in slices of about ``slice_s`` of CPU with a
        yield to the event loop between two (the page and ``/status.json`` of a
        large fleet do not stall its telemetry). The workers are those
        registered at the start; one that left meanwhile is skipped.
        ``slice_s``: ``SNAPSHOT_SLICE_S`` when not given."""
        slice_s = SNAPSHOT_SLICE_S if slice_s is None else slice_s
        out, states = self._snapshot_head(worker_id)
        workers = out["workers"] = []
        async for i, state in self.controller.in_slices(states, slice_s):
            workers.append(self._worker(state, detail=i < detailed or bool(worker_id)))
        return out

    def _snapshot_head(self, worker_id: str) -> tuple[dict[str, Any], list["WorkerState"]]:
        """The fleet-wide part of a snapshot, and the workers to add to it (by id)."""
        ctl = self.controller
        states = sorted(ctl.workers.values(), key=lambda s: s.worker_id)
        if worker_id:
            states = [s for s in states if s.worker_id == worker_id]
        alerts = [a.to_dict() for a in self.alerting.monitor.alerts.values()] if self.alerting is not None else []
        return {
            "now": ctl.clock(),
            "policy": ctl.policy.name,
            "policy_reloads": ctl.policy_reloads,
            "policy_reload_failures": ctl.policy_reload_failures,
            "samples": self.samples,
            "rejections": {reason_label(r): n for r, n in sorted(ctl.rejections.items())},
            "drift_monitor": self.alerting is not None,
            "alerts": alerts,
            "rollouts": [r.to_dict() for r in self.rollouts if not worker_id or r.worker_id == worker_id],
            "workers": [],
        }, states

    def _worker(self, state: "WorkerState", detail: bool) -> dict[str, Any]:
        h = state.hello
        history = self.workers.get(state.worker_id)
        out = {
            "worker_id": state.worker_id,
            "engine": h.engine,
            "model": h.model,
            "accelerator": h.hardware.accelerator,
            "drafter_kind": state.limits.kind,
            "drafter_version": state.limits.version,
            "max_depth": state.limits.max_depth,
            "connected": state.session.connected,
            "session": "unary" if state.session.kind == controller_pb2.WORKER_SESSION_UNARY else "stream",
            "idle_s": max(self.controller.clock() - state.session.last_seen_at, 0.0),
            "expired": state.session.expired,
            "streams_superseded": state.counters.streams_superseded,
            "steps_received": state.counters.steps_received,
            # The worker's own count (Hello.telemetry_loss) of what its telemetry lost.
            "telemetry_loss": {"steps_dropped": h.telemetry_loss.steps_dropped,
                               "steps_unconfirmed": h.telemetry_loss.steps_unconfirmed,
                               "finished_dropped": h.telemetry_loss.finished_dropped},
            "plan_version": state.plans.plan_version,
            "acked_plan_version": state.plans.acked_version,
            "plans_pushed": state.counters.plans_pushed,
            "acks": state.counters.acks,
            "nacks": state.counters.nacks,
            "steps": state.counters.steps_total,
            "mean_batch_size": state.load.batch_ema,
            "mean_context_len": mean_context_len(state),
            "realised_goodput_tok_s": state.load.observed_goodput(),
            "estimated_speedup": history.speedup[-1] if history is not None and history.speedup else None,
            "classes": [_class_dict(c, _class_cell(state, c.name))
                        for c in state.classes.summaries(self.controller.clock())],
            "unknown_class_request_steps": state.counters.unknown_class_request_steps,
            "unknown_class_queries": state.counters.unknown_class_queries,
            "typical_violations": state.counters.typical_violations,
            "detail": detail,
            "plan": None,
            "history": None,
        }
        if not detail:
            return out
        if state.plans.in_force is not None:  # what the worker acknowledged, not a plan merely sent
            draft = state.plans.in_force
            table = draft.table
            # Per request state, split as the Plan message splits them (controller.protocol.plan_to_proto):
            # the states every tracking worker knows, and those added since (RESTING, OTHER).
            first, later = split_first_states(sorted(draft.state_tables.items()), lambda item: item[0])
            out["plan"] = {
                "batch_edges": list(table.batch_edges),
                "context_edges": list(table.context_edges),
                "batch_labels": bucket_labels(table.batch_edges),
                "context_labels": bucket_labels(table.context_edges),
                **_cells(table),
                "expected_goodput_tok_s": draft.expected_goodput_tok_s,
                "state_tables": [_state_table(s, t) for s, t in first],
                "later_state_tables": [_state_table(s, t) for s, t in later],
            }
        out["history"] = (history or WorkerHistory(0)).to_dict()
        return out
