"""The controller's state and logic, free of gRPC.

``Controller`` owns the telemetry store (one ``WorkerState`` per worker), the
acceptance model shared by every worker running the same drafter version,
each worker's cost model, the policy and the plan bookkeeping. The gRPC
servicer only moves messages between the network and these methods, so the
same code runs under the server, under the simulated-time benchmark and in
tests.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
import secrets
import time
import zlib
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from controller.models.acceptance import AcceptanceModel, AcceptancePrior, expected_chain_accepted, offer_slots
from controller.config import ServerConfig
from controller.models.cost import CostParams, StepCostModel
from controller.protocol import (
    MAX_BATCH_SIZE,
    Invalid,
    R,
    decision_to_proto,
    drafter_limits,
    plan_to_proto,
    validate_finished,
    validate_hello,
    validate_step,
)
from policies.base import (
    DrafterLimits,
    FinishedRequest,
    LoadProfile,
    Observation,
    PlanDraft,
    Policy,
    RequestOutcome,
    StepOutcome,
)
from policies.goodput import table_goodput
from policies.table import Decision
from protos.speculation.v1 import controller_pb2, plan_pb2, worker_pb2

log = logging.getLogger("specctl.controller")

RECENT_STEPS = 512  # steps buffered for the policy between two decide() calls
RECENT_FINISHED = 1024
# Finished request ids remembered to refuse reports about them. Such a report is an
# engine bug, a step or two late: the last few hundred catch it, and the memory does
# not grow with the requests a worker serves (200 workers: ~8 MB at most).
FINISHED_IDS = 256
MAX_PENDING = 64  # plans in flight per worker; a worker that never ACKs (stuck, or deaf) costs no more
LOAD_EMA = 0.2


@dataclass
class SentPlan:
    version: int
    nonce: str
    draft: PlanDraft
    sent_at: float
    kind: str  # "plan" | "request_decisions"


@dataclass
class WorkerState:
    """Everything the controller knows about one worker."""

    hello: worker_pb2.Hello
    limits: DrafterLimits
    cost: StepCostModel
    connected: bool = True
    session: int = controller_pb2.WORKER_SESSION_STREAM  # how it talks to us (Connect or Decide)
    last_seen_at: float = 0.0  # clock time of its last message or Decide
    expired: bool = False  # disconnected by the idle TTL, not by its stream ending
    last_step_id: int = 0
    disconnected_at: float = float("inf")  # clock time of the last disconnect; inf while connected
    steps_ingested: int = 0
    last_report_at: float = 0.0
    active: OrderedDict[str, int] = field(default_factory=OrderedDict)  # request id -> context_len
    # Request id -> tokens its drafter had seen after the request's last drafting
    # step: a drafter that catches up (EAGLE) owes it the rest of its context.
    drafted_through: dict[str, int] = field(default_factory=dict)
    finished_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    recent_finished: deque = field(default_factory=lambda: deque(maxlen=RECENT_FINISHED))
    # Load profile: EMA of batch size, of the context-bucket share and mean.
    batch_ema: float = 0.0
    last_batch_size: int = 0  # of the last step ingested
    context_counts: list[float] = field(default_factory=list)
    context_sums: list[float] = field(default_factory=list)
    context_share: np.ndarray | None = None
    context_mean: np.ndarray | None = None
    tokens_ema: float = 0.0
    step_ms_ema: float = 0.0
    # Plans. ``current`` is the controller's view of the worker's table: the
    # newest sent, or after a NACK the last acked (``in_force``) again.
    policy_state: Any = None
    plan_version: int = 0  # newest version sent (plans and request decisions share it)
    current: PlanDraft | None = None
    current_version: int = 0  # the Plan version ``current`` went out as
    in_force: PlanDraft | None = None  # the last Plan the worker acknowledged
    pending: dict[int, SentPlan] = field(default_factory=dict)  # version -> unacknowledged
    acked_version: int = 0
    nacks: int = 0
    last_nack_reason: str = ""
    refused_table: Any = None  # a table the worker NACKed: not sent again until its next Hello
    resend: bool = False  # its Hello was behind ``current``: send it again under a new version
    last_push_at: float = float("-inf")
    last_decide_at: float = float("-inf")
    new_steps: int = 0
    force_push: bool = False  # e.g. after a policy reload
    sent_overrides: dict[str, Decision] = field(default_factory=dict)
    plan_push_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    rejections: Counter = field(default_factory=Counter)
    # Running totals for the metrics endpoint; CARRIED_COUNTERS survive a re-registration.
    steps_total: int = 0
    tokens_total: int = 0
    step_ms_total: float = 0.0
    plans_pushed: int = 0
    decisions_pushed: int = 0
    acks: int = 0
    plans_used: int = 0  # plans a Decide-only worker acknowledged by using them
    streams_superseded: int = 0
    steps_received: int = 0  # steps read, applied or rejected
    # (context bucket, depth, τ) -> request-steps of this worker's drafter version
    # (shared with Controller.accept_counts, so a version keeps its counts).
    accept_counts: dict = field(default_factory=dict)

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def drafter_key(self) -> tuple[str, str]:
        return (self.limits.kind, self.limits.version)

    def observed_goodput(self) -> float:
        return 1000.0 * self.tokens_ema / self.step_ms_ema if self.step_ms_ema > 0 else 0.0


CARRIED_COUNTERS = ("steps_total", "tokens_total", "step_ms_total", "plans_pushed", "decisions_pushed", "acks",
                    "nacks", "rejections", "plans_used", "streams_superseded", "steps_received")


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
        self.workers: dict[str, WorkerState] = {}
        self.rejections: Counter = Counter()
        self.policy_reloads = 0
        self.policy_reload_failures = 0
        self.streams_superseded = 0
        self.workers_expired = 0
        self._last_tick = float("-inf")
        self.on_step: list[Callable[[WorkerState, worker_pb2.StepReport], None]] = []
        # Same, with the step's validated request rows (rid, ctx, depth, width, nodes, τ, ranks, candidates,
        # requested depth):
        # cheaper than reading the proto again.
        self.on_step_rows: list[Callable[[WorkerState, worker_pb2.StepReport, list], None]] = []
        self.on_hello: list[Callable[[WorkerState], None]] = []  # after every accepted Hello
        # (worker id, drafter kind, drafter version) -> WorkerState.accept_counts
        self.accept_counts: dict[tuple[str, str, str], dict[tuple[int, int, int], int]] = {}

    # ----------------------------------------------------------------- hello
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
            hw = hello.hardware
            prior = CostParams.from_hardware(
                hw.memory_bandwidth_gb_s, hw.peak_tflops, hw.weight_bytes, hw.kv_bytes_per_token, hw.params
            )
            previous = state
            state = WorkerState(hello=hello, limits=limits, cost=StepCostModel(prior=prior))
            # The forwards it timed at start-up shape the cost curve before any traffic
            # (each weighs `repeats` observations; pairs: every token attends to its row's context).
            state.cost.calibrate((c.batch_tokens, c.kv_tokens, c.kv_tokens * c.batch_tokens / c.batch_size,
                                  c.verify_ms, c.repeats) for c in hello.calibration)
            state.context_counts = [0.0] * len(self.context_edges)
            state.context_sums = [0.0] * len(self.context_edges)
            state.policy_state = self.policy.initial_state(seed=_stable_seed(hello.worker_id))
            if previous is not None:
                for name in CARRIED_COUNTERS:
                    setattr(state, name, getattr(previous, name))
            state.accept_counts = self.accept_counts.setdefault((hello.worker_id, *state.drafter_key), {})
            self.workers[hello.worker_id] = state
        state.hello = hello
        state.connected = True
        state.expired = False
        state.disconnected_at = float("inf")
        state.last_seen_at = self.clock()
        state.last_step_id = 0  # a restarted worker numbers its steps from 1 again
        state.refused_table = None  # a new session may accept what the last one refused
        # Versions only move forward, also across controller restarts: the
        # worker tells us the plan it runs and the next one must be newer.
        running = hello.current_plan_version
        if state.current is not None and running < state.current_version:
            # It decodes on an older plan than ours (restarted, or another stream
            # had the id): it gets ours again at once, and its overrides with it.
            state.resend = True
            state.sent_overrides = {}
        if running != state.acked_version:  # what it runs now is what it says it runs
            known = state.current is not None and running == state.current_version
            state.in_force = state.current if known else None  # None: its fallback, or a table we never made
            state.acked_version = running
        state.plan_version = max(state.plan_version, running)
        for hook in self.on_hello:
            hook(state)
        return state

    def disconnect(self, state: WorkerState) -> None:
        state.connected = False
        state.pending.clear()
        state.disconnected_at = self.clock()

    def seen(self, state: WorkerState, session: int) -> None:
        """Any message or Decide from the worker: it is alive (a Decide-only
        worker past its idle TTL comes back as connected)."""
        state.last_seen_at = self.clock()
        state.session = session
        if not state.connected and session == controller_pb2.WORKER_SESSION_UNARY:
            state.connected = True
            state.expired = False
            state.disconnected_at = float("inf")

    def idle_workers(self) -> list[WorkerState]:
        """Connected workers silent for ``worker_idle_ttl_s``. Unary workers are
        marked disconnected here; a stream worker's stream is ended by the
        servicer (which then calls ``disconnect``)."""
        cutoff = self.clock() - self.config.worker_idle_ttl_s
        idle = [st for st in self.workers.values() if st.connected and st.last_seen_at <= cutoff]
        for st in idle:
            st.expired = True
            self.workers_expired += 1
            log.warning("worker %s sent nothing for %.0f s (worker_idle_ttl_s): taken for gone", st.worker_id,
                        self.clock() - st.last_seen_at)
            if st.session == controller_pb2.WORKER_SESSION_UNARY:
                self.disconnect(st)
        return idle

    def forget_idle_workers(self) -> list[str]:
        """Drop workers disconnected for ``forget_worker_after_s``: a fleet that
        churns worker ids (autoscaling, restarts under new names) must not
        grow the controller without bound. Returns the ids forgotten."""
        cutoff = self.clock() - self.config.forget_worker_after_s
        gone = [wid for wid, st in self.workers.items() if not st.connected and st.disconnected_at <= cutoff]
        for wid in gone:
            del self.workers[wid]
        if gone:
            dropped = set(gone)
            for key in [k for k in self.accept_counts if k[0] in dropped]:  # every drafter version it ran
                del self.accept_counts[key]
        return gone

    # -------------------------------------------------------------- telemetry
    def reject(self, state: WorkerState | None, err: Invalid) -> plan_pb2.Rejection:
        self.rejections[err.reason] += 1
        if state is not None:
            state.rejections[err.reason] += 1
        log.info("rejected %s: %s %s", plan_pb2.RejectReason.Name(err.reason), err.field, err.detail)
        return err.to_proto()

    def ingest(self, state: WorkerState, reports: worker_pb2.StepReports) -> list[plan_pb2.Rejection]:
        """Apply every valid step; return a rejection for each invalid one."""
        now = self.clock()
        rejections = []
        state.steps_received += len(reports.steps)
        chains: dict[tuple[int, int, int], int] = {}  # (bucket, depth, τ) -> request-steps, applied in bulk
        offers: dict[tuple[int, int, int], list[int]] = {}  # (bucket, level, rank) -> [asked, offered], in bulk
        finished_ids = state.finished_ids
        max_batch = state.hello.max_batch_size or MAX_BATCH_SIZE
        for i, step in enumerate(reports.steps):
            try:
                rows = validate_step(step, state.limits, f"steps[{i}]", state.last_step_id, max_batch)
                if finished_ids:
                    for j, row in enumerate(rows):
                        if row[0] in finished_ids:
                            raise Invalid(R.REJECT_REASON_UNKNOWN_REQUEST, f"steps[{i}].requests[{j}].request_id",
                                          f"{row[0]!r} already finished", step.step_id)
            except Invalid as err:
                rejections.append(self.reject(state, err))
                continue
            self._apply_step(state, step, rows, chains, offers, now)
        if chains or offers:
            posteriors = self.acceptance.strata(state.drafter_key, state.limits.max_depth, state.limits.max_width, now)
            tally = state.accept_counts
            for key, count in chains.items():
                bucket, depth, accepted = key
                posteriors[bucket].observe_chain(depth, accepted, count)
                tally[key] = tally.get(key, 0) + count
            for (bucket, level, rank), (asked, offered) in offers.items():
                posteriors[bucket].observe_offers(asked, offered, level, rank)
        self._maybe_tick(now)
        return rejections

    def _apply_step(self, state: WorkerState, step: worker_pb2.StepReport, rows: list, chains: dict, offers: dict,
                    now: float) -> None:
        edges = self.context_edges
        counts, sums = state.context_counts, state.context_sums
        active = state.active
        keep_requests = self.policy.wants_request_outcomes
        outcomes = []
        unreported = step.batch_size - len(rows)  # requests not reported decode one token each
        batch_tokens = tokens = unreported
        kv_tokens = max_depth = total_nodes = level_kv = attn_pairs = caught_up = 0
        drafted_through = state.drafted_through
        posteriors = None
        for row in rows:
            (rid, ctx, depth, width, nodes, accepted, ranks, cands, requested, requested_width, requested_nodes,
             caught) = row
            caught_up += caught
            if requested or depth:
                drafted_through[rid] = ctx + accepted + 1
            batch_tokens += 1 + nodes
            kv_tokens += ctx
            attn_pairs += (1 + nodes) * ctx
            total_nodes += nodes
            tokens += 1 + accepted
            c = bisect_right(edges, ctx) - 1  # edges start at 0, so c >= 0
            counts[c] += 1.0
            sums[c] += ctx
            if requested:
                tally = offers.get((c, 0, 0))
                if tally is None:
                    tally = offers[(c, 0, 0)] = [0, 0]
                tally[0] += 1
                tally[1] += depth > 0
                if requested_width * requested > 1:  # slots past a draft at all
                    for level, rank, offered in offer_slots(depth, accepted, nodes, ranks, cands, requested,
                                                            requested_width, requested_nodes):
                        tally = offers.setdefault((c, level, rank), [0, 0])
                        tally[0] += 1
                        tally[1] += offered
            if depth:
                level_kv += depth * ctx
                if depth > max_depth:
                    max_depth = depth
                if ranks is None:
                    key = (c, depth, accepted)
                    chains[key] = chains.get(key, 0) + 1
                else:
                    if posteriors is None:
                        limits = state.limits
                        posteriors = self.acceptance.strata(state.drafter_key, limits.max_depth, limits.max_width, now)
                    posteriors[c].observe(ranks, cands)
                    key = (c, depth, accepted)
                    state.accept_counts[key] = state.accept_counts.get(key, 0) + 1
            if rid in active:
                active.move_to_end(rid)
            active[rid] = ctx
            if keep_requests:
                outcomes.append(RequestOutcome(rid, ctx, depth, width, nodes, accepted))
        while len(active) > self.config.max_active_requests:
            drafted_through.pop(active.popitem(last=False)[0], None)
        draft_ms, verify_ms, batch = step.draft_ms, step.verify_ms, step.batch_size
        catch_up_ms = step.catch_up_ms
        if caught_up:
            state.cost.observe_catch_up(caught_up, catch_up_ms)
        if state.hello.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED:  # what the forward really computed
            widest = 1 + max((row[4] for row in rows), default=0)
            batch_tokens, attn_pairs = batch * widest, kv_tokens * widest
        state.cost.observe_step(batch_tokens, kv_tokens, max_depth, total_nodes, level_kv, draft_ms, verify_ms,
                                attn_pairs)
        state.recent_steps.append(
            StepOutcome(step.step_id, step.timestamp, batch, draft_ms, verify_ms, tuple(outcomes), tokens,
                        catch_up_ms))
        keep = 1 - LOAD_EMA
        state.batch_ema = batch if state.steps_ingested == 0 else keep * state.batch_ema + LOAD_EMA * batch
        state.last_batch_size = batch
        state.tokens_ema = keep * state.tokens_ema + LOAD_EMA * tokens
        state.step_ms_ema = keep * state.step_ms_ema + LOAD_EMA * (draft_ms + verify_ms + catch_up_ms)
        state.last_step_id = step.step_id
        state.steps_ingested += 1
        state.steps_total += 1
        state.tokens_total += tokens
        state.step_ms_total += draft_ms + verify_ms + catch_up_ms
        state.new_steps += 1
        state.last_report_at = now
        for hook in self.on_step:
            hook(state, step)
        for hook in self.on_step_rows:
            hook(state, step, rows)

    def finished(self, state: WorkerState, msg: worker_pb2.RequestFinished) -> plan_pb2.Rejection | None:
        try:
            validate_finished(msg)
            if msg.request_id not in state.active:
                raise Invalid(R.REJECT_REASON_UNKNOWN_REQUEST, "finished.request_id",
                              f"{msg.request_id!r} was never reported in a step (or already finished)")
        except Invalid as err:
            return self.reject(state, err)
        del state.active[msg.request_id]
        state.drafted_through.pop(msg.request_id, None)
        state.finished_ids[msg.request_id] = None
        while len(state.finished_ids) > FINISHED_IDS:
            state.finished_ids.popitem(last=False)
        state.recent_finished.append(
            FinishedRequest(msg.request_id, msg.steps, msg.generated_tokens, msg.accepted_tokens))
        return None

    def _maybe_tick(self, now: float) -> None:
        if now - self._last_tick >= 1.0:
            self.acceptance.tick(now)
            self._last_tick = now

    # ------------------------------------------------------------------ acks
    def ack(self, state: WorkerState, msg: worker_pb2.Ack) -> plan_pb2.Rejection | None:
        sent = state.pending.get(msg.version)
        if sent is None or sent.nonce != msg.nonce:
            return self.reject(state, Invalid(R.REJECT_REASON_UNKNOWN_PLAN, "ack",
                                              f"version={msg.version} nonce={msg.nonce!r} names no plan in flight"))
        del state.pending[msg.version]
        state.acks += 1
        if sent.kind == "plan" and msg.version > state.acked_version:
            state.acked_version = msg.version
            state.in_force = sent.draft
        state.plan_push_ms.append((self.clock() - sent.sent_at) * 1000.0)
        return None

    def use(self, state: WorkerState, sent_version: int) -> None:
        """A Decide-only worker applies a plan by deciding from it (there is no
        stream to ACK on): count it as acknowledged."""
        sent = state.pending.pop(sent_version, None)
        if sent is None:
            return
        state.plans_used += 1
        if sent.kind == "plan" and sent_version > state.acked_version:
            state.acked_version = sent_version
            state.in_force = sent.draft

    def nack(self, state: WorkerState, msg: worker_pb2.Nack) -> plan_pb2.Rejection | None:
        sent = state.pending.get(msg.version)
        if sent is None or sent.nonce != msg.nonce:  # a wrong nonce leaves the plan in flight
            return self.reject(state, Invalid(R.REJECT_REASON_UNKNOWN_PLAN, "nack",
                                              f"version={msg.version} nonce={msg.nonce!r} names no plan in flight"))
        del state.pending[msg.version]
        state.nacks += 1
        state.last_nack_reason = msg.reason
        log.warning("worker %s refused plan %d: %s", state.worker_id, msg.version, msg.reason)
        if sent.kind == "plan":
            state.refused_table = sent.draft.table
            if msg.version == state.current_version:
                # Our view returns to what the worker runs: the last plan it acked.
                state.current = state.in_force
                state.current_version = state.acked_version if state.in_force is not None else 0
        else:
            # The overrides it refused are not in force: forget them so they are offered again on change.
            for rid in list(state.sent_overrides):
                if rid in sent.draft.overrides and sent.draft.overrides[rid] == state.sent_overrides[rid]:
                    del state.sent_overrides[rid]
        return None

    # ----------------------------------------------------------------- plans
    def observation(self, state: WorkerState, now: float) -> Observation:
        limits = state.limits
        self._fold_load(state)
        cost = state.cost.refit()
        owed = {}
        if cost.catch_up_ms_per_token > 0:  # only a drafter that has caught up owes anything
            owed = {rid: max(ctx - state.drafted_through.get(rid, 0), 0) for rid, ctx in state.active.items()}
        return Observation(
            now=now,
            worker_id=state.worker_id,
            drafter=limits,
            batch_edges=self.batch_edges,
            context_edges=self.context_edges,
            acceptance=self.acceptance.view(state.drafter_key, limits.max_depth, limits.max_width),
            cost=cost,
            load=LoadProfile(
                mean_batch_size=max(state.batch_ema, 1.0),
                context_share=tuple(state.context_share) if state.context_share is not None else (),
                context_mean=tuple(state.context_mean) if state.context_mean is not None else (),
            ),
            steps=tuple(state.recent_steps),
            finished=tuple(state.recent_finished),
            active_requests=dict(state.active),
            catch_up_owed=owed,
            max_batch_size=state.hello.max_batch_size or 256,
            padded_verify=state.hello.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED,
        )

    def _fold_load(self, state: WorkerState) -> None:
        counts = np.asarray(state.context_counts)
        if counts.sum() <= 0:
            return
        share = counts / counts.sum()
        mean = np.divide(np.asarray(state.context_sums), counts, out=np.zeros_like(counts), where=counts > 0)
        if state.context_share is None:
            state.context_share, state.context_mean = share, mean
        else:
            w = 0.3
            state.context_share = (1 - w) * state.context_share + w * share
            state.context_mean = np.where(counts > 0, (1 - w) * np.where(state.context_mean > 0, state.context_mean, mean) + w * mean,
                                          state.context_mean)
        state.context_counts = [0.0] * len(counts)
        state.context_sums = [0.0] * len(counts)

    def run_policy(self, state: WorkerState, now: float) -> tuple[PlanDraft, Observation]:
        obs = self.observation(state, now)
        draft, state.policy_state = self.policy.decide(state.policy_state, obs)
        state.recent_steps.clear()
        state.recent_finished.clear()
        state.new_steps = 0
        state.last_decide_at = now
        return draft, obs

    def plan_updates(self, state: WorkerState, force: bool = False) -> list[plan_pb2.Plan | plan_pb2.RequestDecisions]:
        """Run the policy when due and return what to push (maybe nothing).

        A new table is pushed when it differs from the one in force and — for
        model-based policies — when the estimated goodput gain clears the
        hysteresis; never more often than ``min_push_interval_s``. Per-request
        overrides go out as their diff.
        """
        now = self.clock()
        settings = self.config.plan
        if state.resend and state.current is not None:
            # The worker's Hello was behind: the current plan again, at once.
            state.resend = False
            return [self._send_table(state, state.current, now)]
        state.resend = False
        force = force or state.force_push
        due = state.new_steps > 0 and now - state.last_decide_at >= settings.recompute_interval_s
        if not (force or due):
            return []
        if state.current is None and state.steps_ingested < settings.steps_before_first_plan and not force:
            return []
        draft, obs = self.run_policy(state, now)
        state.force_push = False
        now = self.clock()  # push latency is counted from here, after the policy ran
        out: list = []
        if self._should_push_table(state, draft, obs, force):
            out.append(self._send_table(state, draft, now))
        decisions = self._override_diff(state, draft, now)
        if decisions is not None:
            out.append(decisions)
        return out

    def _send_table(self, state: WorkerState, draft: PlanDraft, now: float) -> plan_pb2.Plan:
        state.plan_version += 1
        nonce = secrets.token_hex(8)
        plan = plan_to_proto(draft.table, state.plan_version, nonce, self.policy.name, now,
                             draft.expected_goodput_tok_s)
        _track(state, SentPlan(plan.version, nonce, draft, now, "plan"))
        state.current = draft
        state.current_version = plan.version
        state.last_push_at = now
        state.plans_pushed += 1
        return plan

    def _should_push_table(self, state: WorkerState, draft: PlanDraft, obs: Observation, force: bool) -> bool:
        if state.refused_table is not None and draft.table == state.refused_table:
            return False  # the worker said no to this table; wait for a different one (or its next Hello)
        if state.current is None or force:
            return True
        if draft.table == state.current.table:
            return False
        if obs.now - state.last_push_at < self.config.plan.min_push_interval_s:
            return False
        if not self.policy.model_based:
            return True
        # Both tables judged under today's estimates: the old plan's own
        # estimate was made with yesterday's. At the mean batch and at the batch
        # of the last step: when the load jumps (4 -> 8 requests) the mean lags
        # for dozens of steps, and a stale row of the old table runs meanwhile.
        batches = {max(1.0, obs.load.mean_batch_size), float(max(1, state.last_batch_size))}
        margin = 1.0 + self.config.plan.hysteresis
        return any(table_goodput(draft.table, obs, b) > table_goodput(state.current.table, obs, b) * margin
                   for b in batches)

    def _override_diff(self, state: WorkerState, draft: PlanDraft, now: float) -> plan_pb2.RequestDecisions | None:
        wanted = {rid: d for rid, d in draft.overrides.items() if rid in state.active}
        changed = {rid: d for rid, d in wanted.items() if state.sent_overrides.get(rid) != d}
        cleared = [rid for rid in state.sent_overrides if rid not in wanted]
        if not changed and not cleared:
            return None
        state.plan_version += 1
        nonce = secrets.token_hex(8)
        msg = plan_pb2.RequestDecisions(
            version=state.plan_version,
            nonce=nonce,
            decisions=[
                plan_pb2.RequestDecision(request_id=rid, decision=decision_to_proto(d),
                                         reason=draft.reasons.get(rid, self.policy.name))
                for rid, d in changed.items()
            ],
            cleared=cleared,
        )
        _track(state, SentPlan(msg.version, nonce, draft, now, "request_decisions"))
        state.sent_overrides = wanted
        state.decisions_pushed += 1
        return msg

    # ---------------------------------------------------------------- decide
    def decide(self, state: WorkerState, request_id: str, context_len: int, batch_size: int) -> Decision:
        """One request's decision from the current plan (planned now if there
        is none yet: it then goes out as version 1 like any other plan)."""
        override = state.sent_overrides.get(request_id)
        if override is not None:
            return override
        if state.current is None:
            self._send_table(state, self.run_policy(state, self.clock())[0], self.clock())
        return state.current.table.lookup(batch_size, context_len)

    # ---------------------------------------------------------------- policy
    def set_policy(self, policy: Policy) -> None:
        """Swap the policy; every worker's policy state restarts and gets a new plan."""
        self.policy = policy
        for state in self.workers.values():
            state.policy_state = policy.initial_state(seed=_stable_seed(state.worker_id))
            state.last_decide_at = float("-inf")
            state.force_push = True
        self.policy_reloads += 1

    # ---------------------------------------------------------------- status
    def status(self, worker_id: str = "") -> controller_pb2.GetStatusResponse:
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
        for state in self.workers.values():
            if worker_id and state.worker_id != worker_id:
                continue
            out.workers.append(self.worker_status(state))
        return out

    def worker_status(self, state: WorkerState) -> controller_pb2.WorkerStatus:
        p = state.cost.refit()
        ws = controller_pb2.WorkerStatus(
            hello=state.hello,
            connected=state.connected,
            plan_version=state.plan_version,
            acked_plan_version=state.acked_version,
            nacks=state.nacks,
            steps_ingested=state.steps_ingested,
            last_report_at=state.last_report_at,
            cost_model=controller_pb2.CostModel(
                mem_ms=p.mem_ms, mem_ms_per_kv_token=p.mem_ms_per_kv_token, compute_ms=p.compute_ms,
                compute_ms_per_token=p.compute_ms_per_token, compute_ms_per_pair=p.compute_ms_per_pair,
                compute_knots=p.compute_knots, compute_rise_ms=p.compute_rise_ms, draft_fixed_ms=p.draft_fixed_ms,
                draft_ms_per_level=p.draft_ms_per_level, draft_ms_per_node=p.draft_ms_per_node,
                draft_ms_per_level_kv_token=p.draft_ms_per_level_kv_token,
                catch_up_ms_per_token=p.catch_up_ms_per_token, samples=state.cost.samples, rmse_ms=state.cost.rmse_ms,
            ),
            mean_batch_size=state.batch_ema,
            mean_context_len=_mean_context(state),
            observed_goodput_tok_s=state.observed_goodput(),
            session=state.session,
            last_seen_at=state.last_seen_at,
            expired=state.expired,
            streams_superseded=state.streams_superseded,
            plans_used=state.plans_used,
            last_nack_reason=state.last_nack_reason,
            steps_received=state.steps_received,
        )
        view = self.acceptance.view(state.drafter_key, state.limits.max_depth, state.limits.max_width)
        kind = state.hello.drafter.kind
        for c, lo in enumerate(self.context_edges):
            alpha = view.chain_alpha(c)
            ws.acceptance.add(
                drafter_kind=kind,
                drafter_version=state.limits.version,
                context_len_min=lo,
                context_len_max=self.context_edges[c + 1] if c + 1 < len(self.context_edges) else 0,
                alpha=alpha.tolist(),
                effective_samples=view.effective_samples(c).tolist(),
                expected_accepted_chain=expected_chain_accepted(alpha),
            )
        if state.in_force is not None:  # the plan the worker acknowledged, not one merely sent
            ws.plan.CopyFrom(plan_to_proto(state.in_force.table, state.acked_version, "", self.policy.name,
                                           state.last_push_at, state.in_force.expected_goodput_tok_s))
        return ws


def _track(state: WorkerState, sent: SentPlan) -> None:
    """Await the ACK of ``sent``, forgetting the oldest plan in flight beyond ``MAX_PENDING``."""
    pending = state.pending
    pending[sent.version] = sent
    while len(pending) > MAX_PENDING:
        del pending[next(iter(pending))]  # versions are inserted in increasing order


def _mean_context(state: WorkerState) -> float:
    if state.context_share is None or state.context_mean is None:
        return 0.0
    return float(np.dot(state.context_share, state.context_mean))


def _stable_seed(text: str) -> int:
    return zlib.crc32(text.encode())
