"""``Controller``: telemetry in, plans out, free of gRPC.

It owns the workers' states (:mod:`controller.core.state`), the acceptance
model shared by every worker running the same drafter version, the policy
and the plan desk (:mod:`controller.core.plans`). The gRPC servicer only
moves messages between the network and these methods, so the same code runs
under the server, under the simulated-time benchmark and in tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

from controller.config import ServerConfig
from controller.core.classes import ClassTracker
from controller.core.ingest import apply_step, fold_evidence
from controller.core.outcomes import StateAcceptanceModels
from controller.core.plans import PlanDesk
from controller.core.state import EvidenceBuffer, LoadTracker, WorkerState
from controller.models.acceptance import AcceptanceModel, AcceptancePrior
from controller.models.cost import CostParams, StepCostModel
from controller.protocol import (
    ACCEPTANCE_RULE_OF,
    MAX_BATCH_SIZE,
    MAX_CONTEXT_LEN,
    Invalid,
    R,
    RequestRow,
    drafter_limits,
    class_plans,
    plan_to_proto,
    state_plans,
    validate_finished,
    validate_hello,
    validate_step,
)
from policies.base import FinishedRequest, Observation, Policy
from policies.chain import expected_chain_accepted
from policies.table import Decision
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2

log = logging.getLogger("specctl.controller")

# CPU an all-workers status (Controller.status_async) may hold the event loop for before it yields:
# one worker's entry costs up to ~3 ms with a refit, so a slice stays a few ms at any fleet size.
STATUS_SLICE_S = 0.005
PLAN_HANDOFFS_KEPT = 65_536  # Controller.plan_handoffs


def _nothing_waiting() -> bool:
    return False


class Controller:
    """Telemetry in, plans out. All methods take ``now`` from the injected clock."""

    def __init__(self, config: ServerConfig, policy: Policy, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.policy = policy
        self.clock = clock
        self.batch_edges = tuple(config.batch_size_edges)
        self.context_edges = tuple(config.context_len_edges)
        a = config.acceptance
        self.acceptance = AcceptanceModel(
            self.context_edges,
            half_life_s=a.half_life_s,
            max_evidence=a.max_evidence,
            prior=AcceptancePrior(rank1_mean=a.prior_rank1_mean, strength=a.prior_strength),
        )
        # Acceptance under the typical rule (request classes that allow it), kept apart:
        # relaxed acceptance must not inflate the strict model nor look like drift.
        self.acceptance_typical = AcceptanceModel(
            self.context_edges,
            half_life_s=a.half_life_s,
            max_evidence=a.max_evidence,
            prior=AcceptancePrior(rank1_mean=a.prior_rank1_mean, strength=a.prior_strength),
        )
        # The strict rule's evidence split by request state (controller.core.outcomes): extra views, local.
        self.acceptance_by_state = StateAcceptanceModels(
            self.context_edges, a.half_life_s, a.max_evidence,
            AcceptancePrior(rank1_mean=a.prior_rank1_mean, strength=a.prior_strength))
        # Acceptance evidence the models lack: one buffer per drafter version, and the workers
        # that added to them since the last fold (fold_evidence).
        self._evidence: dict[tuple[str, str], EvidenceBuffer] = {}
        self._evidence_pending: list[WorkerState] = []
        for model in (self.acceptance, self.acceptance_typical, *self.acceptance_by_state.models.values()):
            model.fold_pending = self.fold_evidence
        self.plans = PlanDesk(self)
        self.workers: dict[str, WorkerState] = {}
        self.rejections: Counter = Counter()
        self.policy_reloads = 0
        self.policy_reload_failures = 0
        self.streams_superseded = 0
        self.workers_expired = 0
        self._last_tick = float("-inf")
        self.on_step: list[Callable[[WorkerState, worker_pb2.StepReport], None]] = []
        # Same, with the step's validated request rows: cheaper than reading the proto again.
        self.on_step_rows: list[Callable[[WorkerState, worker_pb2.StepReport, list[RequestRow]], None]] = []
        self.on_hello: list[Callable[[WorkerState], None]] = []  # after every accepted Hello
        self.on_disconnect: list[Callable[[WorkerState], None]] = []  # its stream ended, or it went idle
        # Shared state of several replicas (controller.fleet.replica) plugs in here; None: one controller.
        # cost_prior(hello): a fitted starting point for a new worker's cost model, or None (the roofline one).
        self.cost_prior: Callable[[worker_pb2.Hello], CostParams | None] | None = None
        # first_plan_hold(state): True while a worker's first plan should wait (the fleet's statistics
        # for its drafter version are on their way); plans.PlanDesk asks before it plans a first time.
        self.first_plan_hold: Callable[[WorkerState], bool] | None = None
        # plan_waiting(): True while a plan this controller made waits for its stream's writer (the
        # servicer's plans on the way); work done in slices (in_slices: status, the status page)
        # then yields after the worker in hand instead of at the end of its slice.
        self.plan_waiting: Callable[[], bool] = _nothing_waiting
        # (clock when gRPC took a Plan, ms since its created_at), written by the servicer's stream
        # writers: the controller's own part of a plan's push latency, the rest being gRPC, the
        # network and the worker (recent plans only; /metrics: specctl_plan_handoff_seconds).
        self.plan_handoffs: deque[tuple[float, float]] = deque(maxlen=PLAN_HANDOFFS_KEPT)
        # (worker id, drafter kind, drafter version) -> WorkerState.accept_counts
        self.accept_counts: dict[tuple[str, str, str], dict[tuple[int, int, int], int]] = {}
        # worker id -> the fitted cost model and plan of its last status, with what they were built from.
        self._status_cache: dict[str, _WorkerStatusCache] = {}

    # ------------------------------------------------------------- sessions
    def hello(self, hello: worker_pb2.Hello) -> WorkerState:
        """Register (or re-register) a worker; raises ``Invalid``."""
        try:
            validate_hello(hello)
        except Invalid as err:
            self.rejections[err.reason] += 1
            raise
        limits = drafter_limits(hello)
        state = self.workers.get(hello.worker_id)
        if state is None or state.limits != limits or state.hello.model != hello.model:
            state = self._register(hello, limits, previous=state)
        state.hello = hello
        session = state.session
        session.connected = True
        session.expired = False
        session.disconnected_at = float("inf")
        session.last_seen_at = self.clock()
        session.last_step_id = 0  # a restarted worker numbers its steps from 1 again
        self.plans.hello(state, hello.current_plan_version)
        for hook in self.on_hello:
            hook(state)
        return state

    def _register(self, hello: worker_pb2.Hello, limits, previous: WorkerState | None) -> WorkerState:
        """A new state: a new worker, or a new drafter (or model) on a known one."""
        hw = hello.hardware
        prior = self.cost_prior(hello) if self.cost_prior is not None else None
        if prior is None:
            prior = CostParams.from_hardware(hw.memory_bandwidth_gb_s, hw.peak_tflops, hw.weight_bytes,
                                             hw.kv_bytes_per_token, hw.params)
        # Its traffic per class outlives a drafter roll-out (requests go on across it).
        classes = previous.classes if previous is not None else ClassTracker(
            self.policy.classes, len(self.context_edges), self.clock())
        state = WorkerState(hello=hello, limits=limits, cost=StepCostModel(prior=prior),
                            load=LoadTracker(len(self.context_edges)), classes=classes)
        # The forwards it timed at start-up shape the cost curve before any traffic
        # (each weighs `repeats` observations; pairs: every token attends to its row's context).
        state.cost.calibrate((c.batch_tokens, c.kv_tokens, c.kv_tokens * c.batch_tokens / c.batch_size,
                              c.verify_ms, c.repeats) for c in hello.calibration)
        state.plans.policy_state = self.policy.initial_state(seed=_stable_seed(hello.worker_id))
        if previous is not None:
            state.counters.carry_from(previous.counters)
        state.accept_counts = self.accept_counts.setdefault((hello.worker_id, *state.drafter_key), {})
        state.evidence = self._evidence.setdefault(state.drafter_key, EvidenceBuffer())
        self.workers[hello.worker_id] = state
        return state

    def disconnect(self, state: WorkerState) -> None:
        state.session.connected = False
        state.plans.pending.clear()
        state.session.disconnected_at = self.clock()
        for hook in self.on_disconnect:
            hook(state)

    def seen(self, state: WorkerState, kind: int) -> None:
        """Any message or Decide from the worker: it is alive (a Decide-only
        worker past its idle TTL comes back as connected)."""
        session = state.session
        session.last_seen_at = self.clock()
        session.kind = kind
        if not session.connected and kind == controller_pb2.WORKER_SESSION_UNARY:
            session.connected = True
            session.expired = False
            session.disconnected_at = float("inf")

    def idle_workers(self) -> list[WorkerState]:
        """Connected workers silent for ``worker_idle_ttl_s``. Unary workers are
        marked disconnected here; a stream worker's stream is ended by the
        servicer (which then calls ``disconnect``)."""
        now = self.clock()
        cutoff = now - self.config.worker_idle_ttl_s
        idle = [st for st in self.workers.values() if st.session.connected and st.session.last_seen_at <= cutoff]
        for st in idle:
            st.session.expired = True
            self.workers_expired += 1
            log.warning("worker %s sent nothing for %.0f s (worker_idle_ttl_s): taken for gone", st.worker_id,
                        now - st.session.last_seen_at)
            if st.session.kind == controller_pb2.WORKER_SESSION_UNARY:
                self.disconnect(st)
        return idle

    def forget_idle_workers(self) -> list[str]:
        """Drop workers disconnected for ``forget_worker_after_s``: a fleet that
        churns worker ids (autoscaling, restarts under new names) must not
        grow the controller without bound. Returns the ids forgotten."""
        cutoff = self.clock() - self.config.forget_worker_after_s
        gone = [wid for wid, st in self.workers.items()
                if not st.session.connected and st.session.disconnected_at <= cutoff]
        for wid in gone:
            del self.workers[wid]
        if gone:
            dropped = set(gone)
            for key in [k for k in self.accept_counts if k[0] in dropped]:  # every drafter version it ran
                del self.accept_counts[key]
        return gone

    # ------------------------------------------------------------ telemetry
    def reject(self, state: WorkerState | None, err: Invalid) -> plan_pb2.Rejection:
        self.rejections[err.reason] += 1
        if state is not None:
            state.counters.rejections[err.reason] += 1
        log.info("rejected %s: %s %s", plan_pb2.RejectReason.Name(err.reason), err.field, err.detail)
        return err.to_proto()

    def ingest(self, state: WorkerState, reports: worker_pb2.StepReports) -> list[plan_pb2.Rejection]:
        """Apply every valid step; return a rejection for each invalid one."""
        now = self.clock()
        rejections = []
        state.counters.steps_received += len(reports.steps)
        if state.evidence_since is None:  # its drafter version's buffer joins the next fold
            state.evidence_since = now
            self._evidence_pending.append(state)
        finished_ids = state.requests.finished_ids
        max_batch = state.hello.max_batch_size or MAX_BATCH_SIZE
        keep_requests = self.policy.wants_request_outcomes
        for i, step in enumerate(reports.steps):
            try:
                rows = validate_step(step, state.limits, f"steps[{i}]", state.session.last_step_id, max_batch,
                                     finished_ids)
            except Invalid as err:
                rejections.append(self.reject(state, err))
                continue
            apply_step(state, step, rows, self.context_edges, keep_requests, self.config.max_active_requests, now)
            for hook in self.on_step:
                hook(state, step)
            for hook in self.on_step_rows:
                hook(state, step, rows)
        self.tick_acceptance(now)
        return rejections

    def fold_evidence(self) -> None:
        """Fold the acceptance evidence buffered since the last fold into the models.
        The models call it before each read and tick (``AcceptanceModel.fold_pending``)."""
        pending = self._evidence_pending
        if pending:
            self._evidence_pending = []  # first: the fold reads the models, which call back here
            fold_evidence(pending, self.acceptance, self.acceptance_typical, self.acceptance_by_state.models)

    def tick_acceptance(self, now: float) -> bool:
        """Decay both acceptance models if a second has passed since they last were; True if they were.
        Ingest calls it; a replica sharing state also calls it before each merge, so that evidence its
        workers added just before they fell silent is folded into its pending delta and pushed."""
        if now - self._last_tick < 1.0:
            return False
        self.acceptance.tick(now)
        self.acceptance_typical.tick(now)
        self.acceptance_by_state.tick(now)
        self._last_tick = now
        return True

    def finished(self, state: WorkerState, msg: worker_pb2.RequestFinished) -> plan_pb2.Rejection | None:
        try:
            validate_finished(msg)
            if msg.request_id not in state.requests.active:
                raise Invalid(R.REJECT_REASON_UNKNOWN_REQUEST, "finished.request_id",
                              f"{msg.request_id!r} was never reported in a step (or already finished)")
        except Invalid as err:
            return self.reject(state, err)
        state.requests.finish(msg.request_id)
        state.requests.recent_finished.append(
            FinishedRequest(msg.request_id, msg.steps, msg.generated_tokens, msg.accepted_tokens))
        return None

    # ---------------------------------------------------------------- plans
    def observation(self, state: WorkerState, now: float) -> Observation:
        limits = state.limits
        state.load.fold()
        cost = state.cost.refit()
        owed = {}
        requests = state.requests
        if cost.catch_up_ms_per_token > 0:  # only a drafter that has caught up owes anything
            # A drafter with a catch-up window runs only the newest ``window`` tokens it skipped.
            window = limits.catch_up_window or MAX_CONTEXT_LEN
            owed = {rid: min(max(r.context_len - r.drafted_through, 0), window)
                    for rid, r in requests.active.items()}
        return Observation(
            now=now,
            worker_id=state.worker_id,
            drafter=limits,
            batch_edges=self.batch_edges,
            context_edges=self.context_edges,
            acceptance=self.acceptance.view(state.drafter_key, limits.max_depth, limits.max_width),
            cost=cost,
            load=state.load.profile(),
            steps=tuple(requests.recent_steps),
            finished=tuple(requests.recent_finished),
            active_requests=requests.context_lens(),
            catch_up_owed=owed,
            max_batch_size=state.hello.max_batch_size or 256,
            padded_verify=state.hello.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED,
            classes=self.policy.classes,
            class_load=state.classes.class_load(now),
            active_classes=requests.classes(),
            acceptance_typical=self.typical_view(state),
            acceptance_by_state=self.acceptance_by_state.views(state),
        )

    def typical_view(self, state: WorkerState):
        """The typical rule's acceptance for the worker's drafter; None before
        any request-step verified with it (``view`` would make empty strata)."""
        if state.drafter_key not in self.acceptance_typical.keys():
            return None
        return self.acceptance_typical.view(state.drafter_key, state.limits.max_depth, state.limits.max_width)

    def plan_updates(self, state: WorkerState, force: bool = False) -> list[plan_pb2.Plan | plan_pb2.RequestDecisions]:
        """What to push to ``state``'s worker now (see :mod:`controller.core.plans`)."""
        return self.plans.updates(state, force)

    def ack(self, state: WorkerState, msg: worker_pb2.Ack) -> plan_pb2.Rejection | None:
        return self.plans.ack(state, msg)

    def nack(self, state: WorkerState, msg: worker_pb2.Nack) -> plan_pb2.Rejection | None:
        return self.plans.nack(state, msg)

    def use(self, state: WorkerState, version: int) -> None:
        self.plans.use(state, version)

    def decide(self, state: WorkerState, request_id: str, context_len: int, batch_size: int,
               request_class: str = "", request_state: int = 0) -> Decision:
        """One request's decision from the current plan, from its class's table
        (empty or unknown ``request_class``: the default class; unknown counted),
        for the default class its ``request_state``'s table if the plan has one."""
        return self.plans.decide(state, request_id, context_len, batch_size, request_class, request_state)

    def set_policy(self, policy: Policy) -> None:
        """Swap the policy; every worker's policy state restarts and gets a new plan."""
        self.policy = policy
        for state in self.workers.values():
            state.plans.policy_state = policy.initial_state(seed=_stable_seed(state.worker_id))
            state.classes.configure(policy.classes)
            state.plans.last_decide_at = float("-inf")
            state.plans.force_push = True
        self.policy_reloads += 1

    # --------------------------------------------------------------- status
    def status(self, worker_id: str = "") -> controller_pb2.GetStatusResponse:
        """The operator's snapshot, built in one go (tests, tools). On the
        server's event loop use :meth:`status_async`, which yields between workers."""
        out, states = self._status_head(worker_id)
        build = _StatusBuild()
        for state in states:
            out.workers.append(self.worker_status(state, build))
        if not worker_id:
            self._prune_status_cache()
        return out

    async def status_async(self, worker_id: str = "",
                           slice_s: float = STATUS_SLICE_S) -> controller_pb2.GetStatusResponse:
        """:meth:`status`, built in slices of about ``slice_s`` of CPU with a
        yield to the event loop between two: telemetry and plan pushes of the
        whole fleet go on while an operator reads 256 workers' status.

        The workers are those registered when the call starts (one that left
        meanwhile is skipped, one re-registered is shown as it is now); each
        worker's entry is as of the moment it is built, the shared acceptance
        strata as of the first worker of a drafter version.
        """
        out, states = self._status_head(worker_id)
        build = _StatusBuild()
        async for _, state in self.in_slices(states, slice_s):
            out.workers.append(self.worker_status(state, build))
        if not worker_id:
            self._prune_status_cache()
        return out

    async def in_slices(self, states: list[WorkerState], slice_s: float = STATUS_SLICE_S):
        """``(index, state)`` of ``states``, yielding the event loop whenever about
        ``slice_s`` of CPU has gone by since the last yield (for work per worker
        that would otherwise hold the loop for the whole fleet), and at once
        while a plan waits for its writer (:attr:`plan_waiting`: a slice would
        add up to ``slice_s`` to that plan's push). After a yield a worker is
        looked up again: one forgotten meanwhile is skipped, one re-registered
        is given as it is now."""
        started = time.perf_counter()
        plan_waiting = self.plan_waiting
        for i, state in enumerate(states):
            if i and (time.perf_counter() - started > slice_s or plan_waiting()):
                await asyncio.sleep(0)
                started = time.perf_counter()
                state = self.workers.get(state.worker_id)
                if state is None:
                    continue
            yield i, state

    def _status_head(self, worker_id: str) -> tuple[controller_pb2.GetStatusResponse, list[WorkerState]]:
        """The response's fleet-wide fields, and the workers to add to it."""
        out = controller_pb2.GetStatusResponse(
            policy=self.policy.name,
            policy_reloads=self.policy_reloads,
            policy_reload_failures=self.policy_reload_failures,
            streams_superseded=self.streams_superseded,
            workers_expired=self.workers_expired,
            worker_idle_ttl_s=self.config.worker_idle_ttl_s,
        )
        for reason, count in sorted(self.rejections.items()):
            out.rejections.add(reason=reason, count=count)
        if worker_id:
            state = self.workers.get(worker_id)
            return out, [state] if state is not None else []
        return out, list(self.workers.values())

    def _prune_status_cache(self) -> None:
        """Drop the cached status parts of workers no longer registered."""
        if len(self._status_cache) > len(self.workers):
            for wid in [w for w in self._status_cache if w not in self.workers]:
                del self._status_cache[wid]

    def worker_status(self, state: WorkerState, build: "_StatusBuild | None" = None) -> controller_pb2.WorkerStatus:
        """One worker's ``WorkerStatus``. The fitted cost model and the plan in
        force come from a per-worker cache while their inputs are unchanged
        (no step ingested, same prior; same plan acknowledged), so reading the
        status of a quiet fleet refits nothing; ``build`` shares the acceptance
        strata of one drafter version between the workers of one response."""
        build = build if build is not None else _StatusBuild()
        cached = self._status_cache.get(state.worker_id)
        if cached is None:
            cached = self._status_cache[state.worker_id] = _WorkerStatusCache()
        session, ledger, counters = state.session, state.plans, state.counters
        ws = controller_pb2.WorkerStatus(
            hello=state.hello,
            connected=session.connected,
            plan_version=ledger.plan_version,
            acked_plan_version=ledger.acked_version,
            nacks=counters.nacks,
            steps_ingested=state.steps_ingested,
            last_report_at=session.last_report_at,
            cost_model=self._cost_status(state, cached),
            mean_batch_size=state.load.batch_ema,
            mean_context_len=state.load.mean_context_len(),
            observed_goodput_tok_s=state.load.observed_goodput(),
            session=session.kind,
            last_seen_at=session.last_seen_at,
            expired=session.expired,
            streams_superseded=counters.streams_superseded,
            plans_used=counters.plans_used,
            last_nack_reason=ledger.last_nack_reason,
            steps_received=counters.steps_received,
        )
        ws.acceptance.extend(build.strata(self, state, typical=False))
        ws.acceptance_typical.extend(build.strata(self, state, typical=True))
        ws.unknown_class_request_steps = counters.unknown_class_request_steps
        ws.unknown_class_queries = counters.unknown_class_queries
        ws.typical_violations = counters.typical_violations
        ws.shadow_drafts = counters.shadow_drafts
        ws.shadow_drafts_ignored = counters.shadow_drafts_ignored
        for c in state.classes.summaries(self.clock()):
            spec = c.spec
            ws.classes.add(
                name=c.name, is_default=c.is_default, weight=spec.weight, tpot_target_ms=spec.tpot_target_ms or 0.0,
                tpot_quantile=spec.tpot_quantile, acceptance_rule=ACCEPTANCE_RULE_OF[spec.acceptance],
                share=c.share, tpot_ms_p50=c.tpot_ms_p50, tpot_ms_p99=c.tpot_ms_p99, tpot_requests=c.tpot_requests,
                tau=c.tau, spec_fraction=c.spec_fraction, tokens_per_step=c.tokens_per_step,
                step_ms_mean=c.step_ms_mean, mean_context_len=c.mean_context_len, request_steps=c.request_steps,
                tokens=c.tokens, typical_request_steps=c.typical_request_steps)
        if ledger.in_force is not None:  # the plan the worker acknowledged, not one merely sent
            ws.plan.CopyFrom(self._plan_status(state, cached))
        return ws

    def _cost_status(self, state: WorkerState, cached: "_WorkerStatusCache") -> controller_pb2.CostModel:
        """The worker's fitted cost model; refitted only when a step reached it
        since the last status (a refit of unchanged evidence gives the same fit)."""
        cost = state.cost
        key = _StatusKey((cost, cost.prior), (state.steps_ingested, state.counters.steps_total))
        if not key.same_as(cached.cost_key):
            p = cost.refit()
            cached.cost_key = key
            cached.cost_model = controller_pb2.CostModel(
                mem_ms=p.mem_ms, mem_ms_per_kv_token=p.mem_ms_per_kv_token, compute_ms=p.compute_ms,
                compute_ms_per_token=p.compute_ms_per_token, compute_ms_per_pair=p.compute_ms_per_pair,
                compute_ms_per_kv_token=p.compute_ms_per_kv_token,
                compute_knots=p.compute_knots, compute_rise_ms=p.compute_rise_ms, draft_fixed_ms=p.draft_fixed_ms,
                draft_ms_per_level=p.draft_ms_per_level, draft_ms_per_node=p.draft_ms_per_node,
                draft_ms_per_level_kv_token=p.draft_ms_per_level_kv_token,
                catch_up_ms_per_token=p.catch_up_ms_per_token, samples=cost.samples, rmse_ms=cost.rmse_ms,
            )
        return cached.cost_model

    def _plan_status(self, state: WorkerState, cached: "_WorkerStatusCache") -> plan_pb2.Plan:
        """The plan in force as a ``Plan``, rebuilt only when another plan is acknowledged."""
        ledger = state.plans
        key = _StatusKey((ledger.in_force, ledger.in_force_classes),
                         (ledger.acked_version, ledger.last_push_at, self.policy.name))
        if not key.same_as(cached.plan_key):
            classes = ledger.in_force_classes
            cached.plan_key = key
            cached.plan = plan_to_proto(ledger.in_force.table, ledger.acked_version, "", self.policy.name,
                                        ledger.last_push_at, ledger.in_force.expected_goodput_tok_s,
                                        class_plans(classes, ledger.in_force), classes.default,
                                        state_plans(ledger.in_force))
        return cached.plan

    def _strata(self, out, view, state: WorkerState) -> None:
        """``StratumAcceptance`` entries of ``view`` appended to ``out``."""
        kind = state.hello.drafter.kind
        for c, lo in enumerate(self.context_edges):
            alpha = view.chain_alpha(c)
            out.add(
                drafter_kind=kind,
                drafter_version=state.limits.version,
                context_len_min=lo,
                context_len_max=self.context_edges[c + 1] if c + 1 < len(self.context_edges) else 0,
                alpha=alpha.tolist(),
                effective_samples=view.effective_samples(c).tolist(),
                expected_accepted_chain=expected_chain_accepted(alpha),
            )


@dataclass(frozen=True)
class _StatusKey:
    """What a cached status part was built from: ``objects`` compared by
    identity (models and plans change in place or are replaced), ``values``
    by equality (counters, versions)."""

    objects: tuple
    values: tuple

    def same_as(self, other: "_StatusKey | None") -> bool:
        return (other is not None and len(other.objects) == len(self.objects)
                and all(a is b for a, b in zip(self.objects, other.objects)) and self.values == other.values)


@dataclass
class _WorkerStatusCache:
    """The expensive parts of one worker's last ``WorkerStatus`` and what they were built from."""

    cost_key: _StatusKey | None = None
    cost_model: controller_pb2.CostModel | None = None
    plan_key: _StatusKey | None = None
    plan: plan_pb2.Plan | None = None


class _StatusBuild:
    """What the workers of one status response share: the acceptance strata
    of a drafter version (one model for all its workers) are read once."""

    def __init__(self) -> None:
        self._strata: dict[tuple, list[controller_pb2.StratumAcceptance]] = {}

    def strata(self, ctl: Controller, state: WorkerState, typical: bool) -> list[controller_pb2.StratumAcceptance]:
        limits = state.limits
        key = (typical, state.drafter_key, state.hello.drafter.kind, limits.version, limits.max_depth,
               limits.max_width)
        entries = self._strata.get(key)
        if entries is None:
            view = ctl.typical_view(state) if typical else ctl.acceptance.view(
                state.drafter_key, limits.max_depth, limits.max_width)
            holder = controller_pb2.WorkerStatus()
            if view is not None:
                ctl._strata(holder.acceptance, view, state)
            entries = self._strata[key] = list(holder.acceptance)
        return entries


def _stable_seed(text: str) -> int:
    return zlib.crc32(text.encode())
