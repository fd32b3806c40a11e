"""A simulated GPU worker: continuous batching over the step-cost (roofline or measured) and acceptance models.

Each :meth:`SimWorker.step` is one engine iteration:

1. arrivals up to ``now`` join a FIFO queue (closed-loop users send their
   next request once told their last one finished); queued requests are admitted
   while the batch has fewer than ``max_batch_size`` requests and their KV
   (prompt + full output, reserved up front) fits;
2. ``decide(request_id, context_len, batch_size)`` is asked for every running
   request (exactly ``SpeculationAgent.decide``) and clamped to the drafter's
   limits; when the traffic has request classes (``class_mix``) the request's
   class comes fourth, ``decide(request_id, context_len, batch_size,
   request_class)`` (a three-argument callable, blind to classes, is asked
   without it), and the step reports it per request
   (``RequestTelemetry.request_class``, so ``RequestStep.request_class`` on
   the wire, and ``StepResult.request_classes``); every draft is verified
   strictly (the simulator has no relaxed acceptance);
3. each request's tree is built from its ground-truth ``q`` and its outcome
   sampled; it advances by ``τ + 1`` tokens (fewer if its output ends).
   With the traffic's ``correlated_acceptance`` each request carries a
   hidden state path over its output tokens and draft level ``k`` reads
   the state of token ``generated + k - 1``
   (:class:`worker.sim.acceptance.SpanPath`, seeded by the request id);
4. ``draft_ms`` and ``verify_ms`` come from the cost model with
   ``batch_tokens = Σ (1 + nodes)`` and ``kv_tokens = Σ context_len``, each
   with ~3% log-normal noise;
5. the step returns its duration, a :class:`~worker.sdk.telemetry.StepTelemetry`
   and a :class:`~worker.sdk.telemetry.RequestSummary` per finished request.

The worker never reads a clock: the caller passes ``now`` and advances it by
``StepResult.duration_s`` (see :mod:`worker.sim.runner`). Random streams per
worker: arrivals and lengths (:mod:`worker.sim.traffic`, untouched by
decisions, so every policy sees the same requests), acceptance outcomes, and
timing noise; with correlated acceptance, one more per request for its state
path, keyed by the request id (so also the same under every policy).

A step reports the tree actually built: ``depth`` = its deepest level,
``width`` = most children of any node, ``nodes`` = draft tokens verified.
``accepted`` is the sampled τ even when the request's output ends inside the
accepted run (the engine discards the surplus tokens), so acceptance
statistics stay unbiased; ``generated_tokens`` counts kept tokens only.
"""

from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from policies.table import Decision
from worker.sim.acceptance import AcceptanceTruth, Ramp, Setpoint, SpanModel, SpanPath
from worker.sim.hardware import CostModel
from worker.sim.scenario import DriftChange, Scenario, Traffic, WorkerSpec
from worker.sim.traffic import TrafficGenerator
from worker.sim.tree import EMPTY_TREE, TreeCache, chain_tree, quantize, sample_outcomes
from worker.sdk.telemetry import RequestSummary, RequestTelemetry, StepTelemetry

# decide(request_id, context_len, batch_size) -> Decision; with request classes in the
# traffic: decide(request_id, context_len, batch_size, request_class) -> Decision.
DecideFn = Callable[..., Decision]
ENGINE = "specctl-sim"


def accepts_class(decide: Callable) -> bool:
    """Whether a decide callable takes the request's class as a fourth positional argument
    (``*args`` counts; a callable whose signature cannot be read is assumed to)."""
    try:
        params = inspect.signature(decide).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
            or sum(p.kind in kinds for p in params) >= 4)


# -- hello -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HardwareHints:
    """Field names as in ``speculation.v1.Hardware``.

    Bandwidth and peak are totals over the ``count`` tensor-parallel GPUs, and
    nominal: the achieved efficiency is for the controller to learn.
    """

    accelerator: str
    count: int
    memory_bandwidth_gb_s: float
    peak_tflops: float
    weight_bytes: float
    kv_bytes_per_token: float
    params: float


@dataclass(frozen=True, slots=True)
class DrafterInfo:
    """Field names as in ``speculation.v1.Drafter`` and ``policies.base.DrafterLimits``."""

    kind: str
    version: str
    max_depth: int
    max_width: int
    max_tree_nodes: int
    trained_context_len: int


@dataclass(frozen=True, slots=True)
class HelloInfo:
    """What a worker says about itself first (``speculation.v1.Hello`` fields)."""

    worker_id: str
    engine: str
    model: str
    hardware: HardwareHints
    drafter: DrafterInfo
    max_batch_size: int

    def to_dict(self) -> dict:
        return asdict(self)


# -- requests and results ----------------------------------------------------
@dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    domain: str
    multiplier: float
    admitted_s: float = math.nan
    generated: int = 0
    steps: int = 0
    accepted: int = 0
    spans: SpanPath | None = None  # hidden acceptance states of its output tokens (correlated acceptance)
    request_class: str = ""  # "" = none (the policy's default class)

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def reserved_kv(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A finished request, for latency statistics (times in scenario seconds).

    :attr:`tpot_ms` is its time per output token in simulated time: the
    time it spent in the batch (the steps it was in, back to back: each
    step's draft + verify, plus the prefill of requests admitted in that
    step when the worker charges prefill) over the tokens it emitted. With
    ``prefill: false`` (every shipped scenario) that is exactly its decode
    step time, Σ (draft_ms + verify_ms) over its steps, over its tokens.
    """

    request_id: str
    domain: str
    arrival_s: float
    admitted_s: float
    finished_s: float
    prompt_len: int
    generated_tokens: int
    steps: int
    accepted_tokens: int
    request_class: str = ""

    @property
    def tpot_ms(self) -> float:
        """Milliseconds per output token while in the batch."""
        return 1e3 * (self.finished_s - self.admitted_s) / max(self.generated_tokens, 1)

    @property
    def queue_s(self) -> float:
        return self.admitted_s - self.arrival_s


@dataclass(slots=True)
class StepResult:
    """One call of :meth:`SimWorker.step`.

    ``idle`` steps have no telemetry; their ``duration_s`` runs to the next
    arrival (``inf`` when none will come).
    """

    now: float
    duration_s: float
    telemetry: StepTelemetry | None = None
    finished: list[RequestSummary] = field(default_factory=list)
    tokens: int = 0
    prefill_ms: float = 0.0
    idle: bool = False
    # With request classes: each request's class, in ``telemetry.requests`` order (empty without).
    request_classes: tuple[str, ...] = ()
    request_tokens: tuple[int, ...] = ()  # with request classes: tokens each request emitted, same order
    records: list[RequestRecord] = field(default_factory=list)  # the requests that finished in this step

    @property
    def end(self) -> float:
        return self.now + self.duration_s


@dataclass(slots=True)
class WorkerStats:
    """Running totals of one worker."""

    steps: int = 0
    busy_s: float = 0.0
    tokens: int = 0
    request_steps: int = 0
    spec_request_steps: int = 0
    accepted_tokens: int = 0
    draft_nodes: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    prefill_ms: float = 0.0
    arrived: int = 0
    admitted: int = 0
    rejected: int = 0
    finished: list[RequestRecord] = field(default_factory=list)
    class_tokens: dict[str, int] = field(default_factory=dict)  # tokens per request class (with classes)

    @property
    def goodput(self) -> float:
        """Tokens emitted per busy second."""
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean τ per request-step (non-speculating steps count as 0)."""
        return self.accepted_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def mean_accepted_speculating(self) -> float:
        """Mean τ per request-step that speculated."""
        return self.accepted_tokens / self.spec_request_steps if self.spec_request_steps else 0.0

    @property
    def speculation_fraction(self) -> float:
        return self.spec_request_steps / self.request_steps if self.request_steps else 0.0

    def tpot_ms(self, quantile: float | None = None) -> float:
        """Mean (or a quantile of) per-request TPOT over finished requests."""
        values = [r.tpot_ms for r in self.finished]
        if not values:
            return math.nan
        return float(np.mean(values)) if quantile is None else float(np.quantile(values, quantile))

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "busy_s": round(self.busy_s, 3),
            "tokens": self.tokens,
            "goodput_tok_s": round(self.goodput, 1),
            "mean_accepted": round(self.mean_accepted, 3),
            "speculation_fraction": round(self.speculation_fraction, 3),
            "finished": len(self.finished),
            "arrived": self.arrived,
            "rejected": self.rejected,
            "tpot_ms_mean": round(self.tpot_ms(), 3),
            "tpot_ms_p90": round(self.tpot_ms(0.9), 3),
            "mean_batch": round(self.request_steps / self.steps, 2) if self.steps else 0.0,
        }


# -- the worker --------------------------------------------------------------
class SimWorker:
    """Simulated engine for one worker replica.

    Parameters
    ----------
    worker_id
        Stable id (also the request-id prefix).
    spec
        Hardware, model, drafter and batching limits.
    traffic
        What arrives at this worker.
    seed
        Seed (or ``SeedSequence``) of all its random streams.
    changes
        Scheduled changes that apply to it.
    domain_acceptance
        Base acceptance factor per domain.
    decide
        Default decision callable for :meth:`step`.
    time_origin
        Added to telemetry and summary timestamps (e.g. the epoch at start).
    """

    def __init__(
        self,
        worker_id: str,
        spec: WorkerSpec,
        traffic: Traffic,
        *,
        seed: int | np.random.SeedSequence = 0,
        changes: Sequence = (),
        domain_acceptance: Mapping[str, float] | None = None,
        decide: DecideFn | None = None,
        time_origin: float = 0.0,
    ) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.decide = decide
        self.time_origin = time_origin
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        arrivals_ss, outcome_ss, noise_ss = ss.spawn(3)
        self.traffic = TrafficGenerator(traffic, changes, arrivals_ss, id_prefix=worker_id)
        self.classed = traffic.class_mix is not None  # requests carry classes: decide gets them too
        self._outcome_rng = np.random.default_rng(outcome_ss)
        self._noise_rng = np.random.default_rng(noise_ss)

        d = spec.drafter
        self.max_depth, self.max_width, self.max_nodes = d.max_depth, d.max_width, d.max_nodes
        self.cost: CostModel = spec.cost_model()  # the roofline, or a measured table (worker.sim.measured)
        domains = set(traffic.domain_mix) | set(domain_acceptance or {})
        for c in changes:
            domains |= set(getattr(c, "domain_mix", None) or {})
            domains |= {c.domain} if isinstance(c, DriftChange) and c.domain else set()
        drifts = [c for c in changes if isinstance(c, DriftChange)]
        drift = {
            dom: Ramp(1.0, [Setpoint(c.at_s, c.factor, c.over_s) for c in drifts if c.domain in (None, dom)])
            for dom in domains
        }
        self.acceptance = AcceptanceTruth(
            d.acceptance_profile(),
            d.trained_context_len,
            domain_acceptance,
            drift,
            max_depth=self.max_depth,
            max_width=self.max_width,
        )
        corr = traffic.correlated_acceptance
        self.spans = SpanModel(corr, self.acceptance.profile.row_cap) if corr is not None else None
        # The state paths' root: a fourth child of the worker's seed, never drawn from unless the option is on.
        self._span_ss = np.random.SeedSequence(ss.entropy, spawn_key=tuple(ss.spawn_key) + (3,))
        cap = spec.kv_capacity_tokens
        self.kv_capacity = self.cost.kv_capacity_tokens() if cap is None else (cap or math.inf)
        self.kv_reserved = 0
        self.waiting: list[SimRequest] = []
        self._waiting_head = 0
        self.running: list[SimRequest] = []
        self.stats = WorkerStats()
        self.trees = TreeCache()
        self._step_id = 0
        self._clamped: dict[Decision, Decision] = {}
        self._decide_sig: tuple[DecideFn, bool] | None = None  # the last decide callable and whether it takes a class

    @classmethod
    def fleet(cls, scenario: Scenario, decide: DecideFn | None = None, time_origin: float = 0.0) -> list["SimWorker"]:
        """One worker per replica of ``scenario``."""
        return [
            cls(
                wid,
                spec,
                scenario.traffic_for(spec),
                seed=scenario.worker_seed(wid),
                changes=scenario.changes_for(spec, wid),
                domain_acceptance=scenario.domain_acceptance,
                decide=decide,
                time_origin=time_origin,
            )
            for wid, spec in scenario.replicas()
        ]

    # -- introspection -------------------------------------------------------
    @property
    def hello(self) -> HelloInfo:
        hw, m, d = self.cost.hardware, self.cost.model, self.spec.drafter
        return HelloInfo(
            worker_id=self.worker_id,
            engine=ENGINE,
            model=m.name,
            hardware=HardwareHints(
                accelerator=hw.name,
                count=hw.count,
                memory_bandwidth_gb_s=hw.bandwidth_gb_s * hw.count,
                peak_tflops=hw.peak_tflops * hw.count,
                weight_bytes=m.weight_bytes,
                kv_bytes_per_token=m.kv_bytes_per_token,
                params=m.params,
            ),
            drafter=DrafterInfo(d.kind, d.version, d.max_depth, d.max_width, d.max_nodes, d.trained_context_len),
            max_batch_size=self.spec.max_batch_size,
        )

    @property
    def queue_len(self) -> int:
        return len(self.waiting) - self._waiting_head

    def next_arrival_s(self) -> float:
        return self.traffic.peek_time()

    def request_rank_probs(self, request_id: str, t: float) -> np.ndarray:
        """Ground-truth ``q`` [max_depth, max_width] of a running request (for oracles)."""
        for r in self.running:
            if r.request_id == request_id:
                return self.rank_probs([r], t)[0]
        raise KeyError(request_id)

    def rank_probs(self, requests: Sequence[SimRequest], t: float) -> np.ndarray:
        """Ground-truth ``q`` [len(requests), max_depth, max_width] of requests at time ``t``:
        what :meth:`step` samples their outcomes from (and oracles read). With
        correlated acceptance, row ``k`` of a request is in the hidden state of
        its output token ``generated + k - 1``."""
        factors: dict[str, float] = {}
        dom = []
        for r in requests:
            f = factors.get(r.domain)
            if f is None:
                f = factors[r.domain] = self.acceptance.domain_factor(r.domain, t)
            dom.append(f)
        ctx = np.array([r.prompt_len + r.generated for r in requests], np.int64)
        q = self.acceptance.rank_probs_batch(ctx, np.array(dom), np.array([r.multiplier for r in requests]))
        if self.spans is not None:
            q = self.spans.apply(q, self.span_states(requests))
        return q

    def span_states(self, requests: Sequence[SimRequest]) -> np.ndarray:
        """[len(requests), max_depth]: the hidden state of each draft level (-1: none, or the option off)."""
        out = np.full((len(requests), self.max_depth), -1, np.int64)
        for i, r in enumerate(requests):
            if r.spans is not None:
                out[i] = r.spans.window(r.generated, self.max_depth)
        return out

    # -- stepping ------------------------------------------------------------
    def _clamp(self, decision: Decision) -> Decision:
        out = self._clamped.get(decision)
        if out is None:
            if len(self._clamped) > 4096:
                self._clamped.clear()
            out = self._clamped[decision] = decision.clamp(self.max_depth, self.max_width, self.max_nodes)
        return out

    def _takes_class(self, decide: DecideFn) -> bool:
        """Whether ``decide`` takes a fourth argument, the request's class (a class-blind
        three-argument callable is asked without it). Looked up once per callable."""
        last = self._decide_sig
        if last is not None and (last[0] is decide or last[0] == decide):  # == : a bound method made anew
            return last[1]
        takes = accepts_class(decide)
        self._decide_sig = (decide, takes)
        return takes

    def _admit(self, now: float) -> list[SimRequest]:
        for a in self.traffic.pop_until(now):
            r = SimRequest(a.request_id, a.arrival_s, a.prompt_len, a.output_len, a.domain, a.multiplier,
                           request_class=a.request_class)
            if self.spans is not None and self.spans.applies_to(a.domain):
                r.spans = self.spans.path(self._span_seed(a.request_id))
            self.waiting.append(r)
            self.stats.arrived += 1
        admitted = []
        while self._waiting_head < len(self.waiting) and len(self.running) < self.spec.max_batch_size:
            r = self.waiting[self._waiting_head]
            if r.reserved_kv > self.kv_capacity:  # can never fit: the engine refuses it
                self._waiting_head += 1
                self.stats.rejected += 1
                self.traffic.finished(r.request_id, now)
                continue
            if self.kv_reserved + r.reserved_kv > self.kv_capacity:
                break
            self._waiting_head += 1
            r.admitted_s = now
            self.kv_reserved += r.reserved_kv
            self.running.append(r)
            admitted.append(r)
        if self._waiting_head > 1024 and self._waiting_head * 2 > len(self.waiting):
            del self.waiting[: self._waiting_head]
            self._waiting_head = 0
        self.stats.admitted += len(admitted)
        return admitted

    def _span_seed(self, request_id: str) -> np.random.SeedSequence:
        """Seed of a request's state path: the worker's seed and the request id, nothing else."""
        key = request_id.encode()
        root = self._span_ss
        return np.random.SeedSequence(root.entropy, spawn_key=tuple(root.spawn_key) + (zlib.crc32(key),
                                                                                      zlib.adler32(key)))

    def _prefill_ms(self, admitted: list[SimRequest]) -> float:
        if not admitted or not self.spec.prefill:
            return 0.0
        tokens = sum(r.prompt_len for r in admitted)
        pairs = sum(r.prompt_len * (r.prompt_len + 1) / 2 for r in admitted)
        return self.cost.noisy(self.cost.verify_ms(tokens, 0, pairs, batch=len(admitted)), self._noise_rng)

    def step(self, now: float, decide: DecideFn | None = None) -> StepResult:
        """Run one engine iteration starting at scenario time ``now``.

        Parameters
        ----------
        now
            Scenario seconds at the start of the step.
        decide
            ``decide(request_id, context_len, batch_size) -> Decision``
            (``decide(request_id, context_len, batch_size, request_class)``
            when the traffic has classes); defaults to the one given at
            construction.
        """
        decide = decide or self.decide
        if decide is None:
            raise ValueError("SimWorker.step needs a decide callable")
        admitted = self._admit(now)
        if not self.running:
            nxt = self.traffic.peek_time(now)
            return StepResult(now, max(nxt - now, 0.0), idle=True)
        prefill_ms = self._prefill_ms(admitted)

        running = self.running
        b = len(running)
        ctx_l = [r.prompt_len + r.generated for r in running]
        ctx = np.array(ctx_l, np.int64)
        clamp = self._clamp
        if self.classed and self._takes_class(decide):
            decisions = [clamp(decide(r.request_id, c, b, r.request_class)) for r, c in zip(running, ctx_l)]
        else:
            decisions = [clamp(decide(r.request_id, c, b)) for r, c in zip(running, ctx_l)]
        q = self.rank_probs(running, now)
        if any(d.width > 1 for d in decisions):
            qconf = quantize(q)
            keys = [row.tobytes() for row in qconf]
            get = self.trees.get
            trees = [
                get(qconf[i], dcs.depth, dcs.width, dcs.max_nodes, keys[i]) if dcs.depth else EMPTY_TREE
                for i, dcs in enumerate(decisions)
            ]
        else:
            qconf = None
            trees = [chain_tree(dcs.depth) for dcs in decisions]
        u = self._outcome_rng.random((b, self.max_depth))
        acc_l, ranks_l, offered_l = sample_outcomes(trees, q, u)

        nodes = np.fromiter((t.nodes for t in trees), np.int64, b)
        depths = [t.depth for t in trees]
        widths = [t.width for t in trees]
        batch_tokens = int(b + nodes.sum())
        verify = self.cost.noisy(
            self.cost.verify_ms(batch_tokens, float(ctx.sum()), float(((1 + nodes) * ctx).sum()), batch=b),
            self._noise_rng,
        )
        draft = self.cost.noisy(self.cost.draft_ms(depths, widths, ctx), self._noise_rng)
        duration_s = (prefill_ms + draft + verify) / 1e3
        end = now + duration_s
        stamp = self.time_origin + end

        conf_l = None
        if self.spec.report_confidence:  # the drafter's confidence in its top candidate per level
            conf_l = (quantize(q[:, :, 0]) / 256.0).round(4).tolist()
        reqs: list[RequestTelemetry] = []
        finished: list[RequestSummary] = []
        records: list[RequestRecord] = []
        still: list[SimRequest] = []
        class_tokens = self.stats.class_tokens if self.classed else None
        emitted_l: list[int] = []
        tokens = 0
        spec_steps = 0
        st = self.stats
        for i, r in enumerate(running):
            t = trees[i]
            tau = acc_l[i]
            reqs.append(
                RequestTelemetry(
                    r.request_id,
                    ctx_l[i],
                    t.depth,
                    t.width,
                    t.nodes,
                    tau,
                    ranks_l[i],
                    offered_l[i],
                    conf_l[i][: len(ranks_l[i])] if conf_l is not None and t.depth else (),
                    r.domain,
                    request_class=r.request_class,
                )
            )
            emitted = min(tau + 1, r.output_len - r.generated)
            if class_tokens is not None:
                emitted_l.append(emitted)
            r.generated += emitted
            r.steps += 1
            r.accepted += tau
            tokens += emitted
            if class_tokens is not None:
                class_tokens[r.request_class] = class_tokens.get(r.request_class, 0) + emitted
            spec_steps += t.depth > 0
            if r.generated >= r.output_len:
                self.kv_reserved -= r.reserved_kv
                self.traffic.finished(r.request_id, end)
                finished.append(RequestSummary(r.request_id, r.generated, r.steps, r.accepted, stamp))
                record = RequestRecord(r.request_id, r.domain, r.arrival_s, r.admitted_s, end, r.prompt_len,
                                       r.generated, r.steps, r.accepted, r.request_class)
                st.finished.append(record)
                records.append(record)
            else:
                still.append(r)
        self.running = still
        self._step_id += 1
        st.steps += 1
        st.busy_s += duration_s
        st.tokens += tokens
        st.request_steps += b
        st.spec_request_steps += spec_steps
        st.accepted_tokens += sum(acc_l)
        st.draft_nodes += int(nodes.sum())
        st.draft_ms += draft
        st.verify_ms += verify
        st.prefill_ms += prefill_ms
        telemetry = StepTelemetry(self._step_id, stamp, b, draft, verify, reqs)
        classes = tuple(r.request_class for r in running) if self.classed else ()
        return StepResult(now, duration_s, telemetry, finished, tokens, prefill_ms, request_classes=classes,
                          request_tokens=tuple(emitted_l) if self.classed else (), records=records)
