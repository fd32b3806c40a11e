"""What the controller keeps per worker, in small state objects.

``WorkerState`` is the worker's identity (its Hello and drafter limits), its
fitted cost model and five parts that change for different reasons:

- :class:`Session` — how and whether it is connected (stream or Decide, last
  contact, idle expiry, the step ids of the current Hello);
- :class:`LoadTracker` — the load its steps show (batch size, context mix,
  tokens and step time), smoothed;
- :class:`RequestTracker` — its requests in flight and the recent steps and
  finished requests the policy has not seen yet;
- :class:`PlanLedger` — the plans: what was sent, what is in force, what is
  awaiting an ACK, and when the policy ran;
- :class:`Counters` — running totals for metrics; they survive a
  re-registration (a drafter roll-out makes a new ``WorkerState``).

Its traffic per request class (:class:`~controller.core.classes.ClassTracker`)
survives a re-registration too: requests and their latency outlive a drafter.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from controller.core.classes import ClassTracker
from controller.models.cost import StepCostModel
from policies.base import DrafterLimits, LoadProfile, PlanDraft
from policies.classes import SINGLE, ClassSet
from policies.outcome import DEFAULT, STATES
from protos.speculation.v1 import controller_pb2, worker_pb2

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
    classes: ClassSet = SINGLE  # the request classes the plan went out with


@dataclass
class Session:
    """The link: connected or not, how, and since when."""

    connected: bool = True
    kind: int = controller_pb2.WORKER_SESSION_STREAM  # Connect, or Decide only
    last_seen_at: float = 0.0  # clock time of its last message or Decide
    expired: bool = False  # disconnected by the idle TTL, not by its stream ending
    disconnected_at: float = float("inf")  # clock time of the last disconnect; inf while connected
    last_step_id: int = 0  # step ids increase after each Hello
    last_report_at: float = 0.0


@dataclass
class LoadTracker:
    """The worker's load as its steps show it: EMAs of batch size, tokens and
    step time, and the context mix (share and mean per context bucket)."""

    buckets: int
    batch_ema: float = 0.0
    last_batch_size: int = 0  # of the last step ingested
    tokens_ema: float = 0.0
    step_ms_ema: float = 0.0
    context_counts: list[float] = field(default_factory=list)  # since the last fold, per bucket
    context_sums: list[float] = field(default_factory=list)
    context_share: np.ndarray | None = None
    context_mean: np.ndarray | None = None
    # Request-steps per request state (policies.outcome) since the last fold, and their smoothed share.
    state_counts: list[float] = field(default_factory=lambda: [0.0] * len(STATES))
    state_share: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.context_counts = [0.0] * self.buckets
        self.context_sums = [0.0] * self.buckets

    def observe_step(self, batch: int, tokens: int, step_ms: float, first: bool) -> None:
        keep = 1 - LOAD_EMA
        self.batch_ema = batch if first else keep * self.batch_ema + LOAD_EMA * batch
        self.last_batch_size = batch
        self.tokens_ema = keep * self.tokens_ema + LOAD_EMA * tokens
        self.step_ms_ema = keep * self.step_ms_ema + LOAD_EMA * step_ms

    def observed_goodput(self) -> float:
        """Tokens per second of step time, recent."""
        return 1000.0 * self.tokens_ema / self.step_ms_ema if self.step_ms_ema > 0 else 0.0

    def fold(self) -> None:
        """Blend the context mix and the request-state mix seen since the last fold into the smoothed ones."""
        states = np.asarray(self.state_counts)
        if states.sum() > 0:
            share = states / states.sum()
            self.state_share = share if self.state_share is None else 0.7 * self.state_share + 0.3 * share
            self.state_counts = [0.0] * len(states)
        counts = np.asarray(self.context_counts)
        if counts.sum() <= 0:
            return
        share = counts / counts.sum()
        mean = np.divide(np.asarray(self.context_sums), counts, out=np.zeros_like(counts), where=counts > 0)
        if self.context_share is None:
            self.context_share, self.context_mean = share, mean
        else:
            w = 0.3
            self.context_share = (1 - w) * self.context_share + w * share
            self.context_mean = np.where(
                counts > 0, (1 - w) * np.where(self.context_mean > 0, self.context_mean, mean) + w * mean,
                self.context_mean)
        self.context_counts = [0.0] * len(counts)
        self.context_sums = [0.0] * len(counts)

    def profile(self) -> LoadProfile:
        """The load as the policies read it."""
        return LoadProfile(
            mean_batch_size=max(self.batch_ema, 1.0),
            context_share=tuple(self.context_share) if self.context_share is not None else (),
            context_mean=tuple(self.context_mean) if self.context_mean is not None else (),
            state_share=tuple(self.state_share.tolist()) if self.state_share is not None else (),
        )

    def mean_context_len(self) -> float:
        if self.context_share is None or self.context_mean is None:
            return 0.0
        return float(np.dot(self.context_share, self.context_mean))


class ActiveRequest:
    """One request in flight: what each of its steps reads and leaves for the next
    (ingest finds all of it with one lookup a request-step, not one per field)."""

    __slots__ = ("context_len", "drafted_through", "class_name", "state")

    def __init__(self, context_len: int, class_name: str, state: int = DEFAULT) -> None:
        self.context_len = context_len  # as its last step reported it
        # Tokens its drafter had seen after its last drafting step (0: none drafted yet): a drafter
        # that catches up (EAGLE) owes it the rest of its context.
        self.drafted_through = 0
        self.class_name = class_name  # resolved: an unknown name is the default class
        self.state = state  # the request state its last step left it in (policies.outcome.pack_state)

    def __repr__(self) -> str:
        return (f"ActiveRequest(context_len={self.context_len}, drafted_through={self.drafted_through}, "
                f"class_name={self.class_name!r}, state={self.state})")


@dataclass
class RequestTracker:
    """Requests in flight, and what the policy has not seen yet."""

    # Request id -> its record, least recently reported first (the oldest goes past max_active_requests).
    active: OrderedDict[str, ActiveRequest] = field(default_factory=OrderedDict)
    finished_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    recent_finished: deque = field(default_factory=lambda: deque(maxlen=RECENT_FINISHED))

    def context_lens(self) -> dict[str, int]:
        """Request id -> context length, for the active requests."""
        return {rid: r.context_len for rid, r in self.active.items()}

    def classes(self) -> dict[str, str]:
        """Request id -> class name (resolved), for the active requests."""
        return {rid: r.class_name for rid, r in self.active.items()}

    def finish(self, request_id: str) -> None:
        del self.active[request_id]
        self.finished_ids[request_id] = None
        while len(self.finished_ids) > FINISHED_IDS:
            self.finished_ids.popitem(last=False)


@dataclass
class PlanLedger:
    """Plans sent, in force and awaited. ``current`` is the controller's view
    of the worker's table: the newest sent, or after a NACK the last acked
    (``in_force``) again."""

    policy_state: Any = None
    plan_version: int = 0  # newest version sent (plans and request decisions share it)
    current: PlanDraft | None = None
    current_version: int = 0  # the Plan version ``current`` went out as
    in_force: PlanDraft | None = None  # the last Plan the worker acknowledged
    # The request classes each of those two plans went out with (a reload may change them).
    current_classes: ClassSet = SINGLE
    in_force_classes: ClassSet = SINGLE
    acked_version: int = 0
    pending: dict[int, SentPlan] = field(default_factory=dict)  # version -> unacknowledged
    last_nack_reason: str = ""
    refused_table: Any = None  # tables the worker NACKed (plans.plan_key): not sent again until its next Hello
    resend: bool = False  # its Hello was behind ``current``: send it again under a new version
    force_push: bool = False  # e.g. after a policy reload
    last_push_at: float = float("-inf")
    last_decide_at: float = float("-inf")
    new_steps: int = 0  # steps since the policy last ran
    sent_overrides: dict = field(default_factory=dict)  # request id -> Decision sent
    plan_push_ms: deque = field(default_factory=lambda: deque(maxlen=4096))

    def track(self, sent: SentPlan) -> None:
        """Await the ACK of ``sent``, forgetting the oldest plan in flight beyond ``MAX_PENDING``."""
        self.pending[sent.version] = sent
        while len(self.pending) > MAX_PENDING:
            del self.pending[next(iter(self.pending))]  # versions are inserted in increasing order


@dataclass
class Counters:
    """Running totals for the metrics endpoint; carried across a re-registration."""

    steps_total: int = 0
    tokens_total: int = 0
    step_ms_total: float = 0.0
    steps_received: int = 0  # steps read, applied or rejected
    plans_pushed: int = 0
    decisions_pushed: int = 0
    acks: int = 0
    nacks: int = 0
    plans_used: int = 0  # plans a Decide-only worker acknowledged by using them
    streams_superseded: int = 0
    rejections: Counter = field(default_factory=Counter)
    # Request classes: names the policy does not know (served as the default class),
    # in request-steps and in Decide queries; request-steps verified with the typical
    # rule, used (a relaxed class) or a violation (a strict class: acceptance not used).
    unknown_class_request_steps: int = 0
    unknown_class_queries: int = 0
    typical_request_steps: int = 0
    typical_violations: int = 0
    # Shadow drafts (RequestStep.shadows) used as acceptance evidence, and those on relaxed rows (not used).
    shadow_drafts: int = 0
    shadow_drafts_ignored: int = 0

    def carry_from(self, previous: "Counters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(previous, f.name))


# EvidenceBuffer's sinks: the request states (policies.outcome.STATES, strict rule), then the typical rule's.
TYPICAL_SINK = len(STATES)
SINKS = len(STATES) + 1


class EvidenceBuffer:
    """Acceptance evidence of one drafter version not yet folded into the acceptance models.

    Every worker of the version adds to the same buffer (``WorkerState.evidence``):
    :func:`controller.core.ingest.apply_step` one dict update per request-step,
    :func:`controller.core.ingest.fold_evidence` once per fold, before any read of
    the models and at each acceptance tick (``Controller.fold_evidence``). A
    posterior cell is then added to once per fold, whatever the messages and
    workers behind it, not once per message and worker.

    Evidence is kept per *sink*, an index into each list: a request state
    (:data:`policies.outcome.STATES`; strict rule: the pooled model and that
    state's model) or :data:`TYPICAL_SINK` (the typical model).
    """

    __slots__ = ("chains", "offers", "trees", "first")

    def __init__(self) -> None:
        self.chains: list[dict] = [{} for _ in range(SINKS)]  # (context bucket, depth, τ) -> request-steps
        self.offers: list[dict] = [{} for _ in range(SINKS)]  # (context bucket, level, rank) -> [asked, offered]
        self.trees: list[list] = [[] for _ in range(SINKS)]  # (context bucket, accepted_rank, level_candidates)
        # Sink -> clock of the ingest that first buffered evidence for it: a stratum the
        # fold makes starts then, as one made by that ingest did.
        self.first: dict[int, float] = {}

    def clear(self) -> None:
        """Empty it in place (the workers of the version hold it)."""
        for sink in range(SINKS):
            self.chains[sink].clear()
            self.offers[sink].clear()
            self.trees[sink].clear()
        self.first.clear()


@dataclass
class WorkerState:
    """Everything the controller knows about one worker."""

    hello: worker_pb2.Hello
    limits: DrafterLimits
    cost: StepCostModel
    load: LoadTracker
    classes: ClassTracker
    session: Session = field(default_factory=Session)
    requests: RequestTracker = field(default_factory=RequestTracker)
    plans: PlanLedger = field(default_factory=PlanLedger)
    counters: Counters = field(default_factory=Counters)
    steps_ingested: int = 0  # since this state was made (a new drafter starts a new one)
    # (context bucket, depth, τ) -> request-steps of this worker's drafter version
    # (shared with Controller.accept_counts, so a version keeps its counts).
    accept_counts: dict = field(default_factory=dict)
    # Its drafter version's acceptance evidence not folded into the models yet (shared by the
    # version's workers: Controller), and the clock of its first ingest since the last fold.
    evidence: EvidenceBuffer = field(default_factory=EvidenceBuffer)
    evidence_since: float | None = None

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def drafter_key(self) -> tuple[str, str]:
        return (self.limits.kind, self.limits.version)
