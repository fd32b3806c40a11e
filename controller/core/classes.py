"""Request classes on the controller: each worker's traffic and latency per class (issue #29).

A request names its class in ``RequestStep.request_class``; the policy file
names the classes (:mod:`policies.classes`). Per worker and class the
controller keeps

- its load: share of the worker's request-steps and its context mix;
- what its request-steps did: tokens per step, the ms of the steps they ran
  in, τ (accepted draft tokens per drafting request-step) and the share of
  its request-steps that drafted;
- its requests' time per output token (TPOT): a request's TPOT is the time
  of the steps it ran in (``draft_ms + verify_ms + catch_up_ms``: every
  request of a step waits for all of it) over the tokens they emitted for it,
  ``Σ (accepted + 1)``. The class's p50 / p99 are over its requests seen in
  the last :data:`TPOT_WINDOW_S` seconds (at most :data:`TPOT_MAX_REQUESTS`,
  the most recent): requests in flight count with their TPOT so far, so a
  worker that never sends ``RequestFinished`` still has one. Beside them,
  the tokens per step of its slowest requests (:data:`TAIL_SHARE` of them
  by TPOT, at least one): a p99 target bounds those requests, and more
  draft nodes help them less than the class's mean says (they are the ones
  the drafter follows worst). And the tokens per step of all the window's
  requests, the mean the tail is compared with: both read the same
  requests under the same plans, where the decayed mean lags a plan change
  by its half-life.

Recent means are sums decayed with a half-life of :data:`CLASS_HALF_LIFE_S`
seconds of controller time, folded when read; between two reads ingest only
adds to plain floats. Memory per worker is bounded by the classes (at most
``policies.classes.MAX_CLASSES``) times :data:`TPOT_MAX_REQUESTS`.

A name the policy does not know is served as the default class and
counted (``Counters.unknown_class_request_steps``), never refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.base import ClassLoad
from policies.classes import SINGLE, ClassSet, RequestClass

TPOT_WINDOW_S = 30.0  # requests seen this recently make a class's TPOT quantiles
TPOT_MAX_REQUESTS = 256  # per class: the most recent requests kept for them (~300 B each)
CLASS_HALF_LIFE_S = 30.0  # recent load and step means
TAIL_SHARE = 0.05  # the slowest requests whose tokens per step a p99 target reads


@dataclass(frozen=True, slots=True)
class ClassSummary:
    """One class on one worker, as status, metrics and the status page show it."""

    name: str
    spec: RequestClass
    is_default: bool
    share: float  # of the worker's reported request-steps, recent
    tpot_ms_p50: float  # 0: no request measured in the window
    tpot_ms_p99: float
    tpot_requests: int
    tail_tokens_per_step: float  # over its slowest TAIL_SHARE of requests by TPOT (0: none measured)
    window_tokens_per_step: float  # over all its requests in the TPOT window (0: none measured)
    tau: float  # accepted draft tokens per drafting request-step, recent
    spec_fraction: float  # request-steps that drafted, recent
    tokens_per_step: float
    step_ms_mean: float
    mean_context_len: float
    context_share: tuple[float, ...]
    context_mean: tuple[float, ...]
    request_steps: int  # lifetime counts
    tokens: int
    typical_request_steps: int

    def load(self) -> ClassLoad:
        return ClassLoad(share=self.share, context_share=self.context_share, context_mean=self.context_mean,
                         tpot_ms_p50=self.tpot_ms_p50, tpot_ms_p99=self.tpot_ms_p99,
                         tokens_per_step=self.tokens_per_step, step_ms_mean=self.step_ms_mean,
                         tail_tokens_per_step=self.tail_tokens_per_step,
                         window_tokens_per_step=self.window_tokens_per_step)


class ClassStats:
    """One class on one worker: sums since the last fold (what ingest adds
    to), decayed sums, lifetime counts and its recent requests' TPOT."""

    __slots__ = ("name", "spec", "relaxed", "steps", "tokens", "step_ms", "drafted", "accepted", "typical",
                 "ctx_counts", "ctx_sums", "recent", "recent_counts", "recent_sums", "steps_total", "tokens_total",
                 "typical_total", "requests")

    def __init__(self, spec: RequestClass, buckets: int) -> None:
        self.name = spec.name
        self.spec = spec
        self.relaxed = spec.relaxed  # its requests may be verified with the typical rule
        # Since the last fold (plain floats: ingest adds to them for every request-step).
        self.steps = self.tokens = self.step_ms = self.drafted = self.accepted = self.typical = 0.0
        self.ctx_counts = [0.0] * buckets
        self.ctx_sums = [0.0] * buckets
        # Decayed: [steps, tokens, step_ms, drafted, accepted] and the context mix.
        self.recent = np.zeros(5)
        self.recent_counts = np.zeros(buckets)
        self.recent_sums = np.zeros(buckets)
        self.steps_total = self.tokens_total = self.typical_total = 0
        # Request id -> [Σ step ms, Σ tokens, last seen (controller clock), steps]. A plain dict, not
        # kept in recency order: moving an entry on every request-step cost ingest ~1 µs a request.
        self.requests: dict[str, list] = {}

    def admit(self, rid: str, now: float) -> None:
        """Start a request's record; past TPOT_MAX_REQUESTS, the least recently seen one goes
        (one scan per new request, only when full)."""
        requests = self.requests
        if len(requests) >= TPOT_MAX_REQUESTS:
            del requests[min(requests, key=lambda r: requests[r][2])]
        requests[rid] = [0.0, 0, now, 0]

    def reconfigure(self, spec: RequestClass) -> None:
        self.spec = spec
        self.relaxed = spec.relaxed

    def fold(self, decay: float) -> None:
        pending = np.array([self.steps, self.tokens, self.step_ms, self.drafted, self.accepted])
        self.recent = self.recent * decay + pending
        self.recent_counts = self.recent_counts * decay + np.asarray(self.ctx_counts)
        self.recent_sums = self.recent_sums * decay + np.asarray(self.ctx_sums)
        self.steps_total += int(self.steps)
        self.tokens_total += int(self.tokens)
        self.typical_total += int(self.typical)
        self.steps = self.tokens = self.step_ms = self.drafted = self.accepted = self.typical = 0.0
        n = len(self.ctx_counts)
        self.ctx_counts = [0.0] * n
        self.ctx_sums = [0.0] * n

    def tpot(self, now: float) -> tuple[float, float, int, float, float]:
        """(p50, p99, requests) of TPOT in ms over the requests seen in the window, the
        tokens per step of the slowest :data:`TAIL_SHARE` of them (at least one), and of all
        of them."""
        cutoff = now - TPOT_WINDOW_S
        requests = self.requests
        for rid in [r for r, rec in requests.items() if rec[2] < cutoff]:  # left the window
            del requests[rid]
        rows = np.array([(ms / tokens, tokens, steps) for ms, tokens, _, steps in requests.values() if tokens > 0])
        if not len(rows):
            return 0.0, 0.0, 0, 0.0, 0.0
        p50, p99 = np.percentile(rows[:, 0], [50.0, 99.0])
        tail = rows[np.argsort(rows[:, 0])[-max(1, int(round(TAIL_SHARE * len(rows)))):]]
        return (float(p50), float(p99), len(rows), float(tail[:, 1].sum() / max(tail[:, 2].sum(), 1.0)),
                float(rows[:, 1].sum() / max(rows[:, 2].sum(), 1.0)))


class ClassTracker:
    """Every class of one worker, and where a reported name lands.

    ``resolve`` maps a reported name (and ``""``) to its class's stats; a
    name not in it is unknown: :meth:`unknown` counts it and gives the default
    class's stats.
    """

    def __init__(self, classes: ClassSet, buckets: int, now: float = 0.0) -> None:
        self.buckets = buckets
        self.classes = SINGLE
        self.stats: dict[str, ClassStats] = {}
        self.resolve: dict[str, ClassStats] = {}
        self.default: ClassStats | None = None
        self.last_unknown = ""  # the last unknown name reported (for an operator's log line)
        self.folded_at = now
        self.configure(classes)

    def configure(self, classes: ClassSet) -> None:
        """Follow the policy's classes (a reload): classes kept by name keep
        their history; a class no longer named is dropped."""
        self.classes = classes
        stats = {}
        for spec in classes:
            cs = self.stats.get(spec.name)
            if cs is None:
                cs = ClassStats(spec, self.buckets)
            else:
                cs.reconfigure(spec)
            stats[spec.name] = cs
        self.stats = stats
        self.default = stats[classes.default]
        self.resolve = dict(stats)
        self.resolve[""] = self.default

    def unknown(self, name: str) -> ClassStats:
        self.last_unknown = name[:64]
        return self.default

    def fold(self, now: float) -> None:
        """Decay the recent sums to ``now`` and add what came since the last fold."""
        dt = max(now - self.folded_at, 0.0)
        decay = 0.5 ** (dt / CLASS_HALF_LIFE_S)
        self.folded_at = max(now, self.folded_at)
        for cs in self.stats.values():
            cs.fold(decay)

    def summaries(self, now: float) -> list[ClassSummary]:
        """Every class of the policy, in its file order (folds first)."""
        self.fold(now)
        total = float(sum(cs.recent[0] for cs in self.stats.values()))
        out = []
        for name, cs in self.stats.items():
            steps, tokens, step_ms, drafted, accepted = (float(x) for x in cs.recent)
            counts, sums = cs.recent_counts, cs.recent_sums
            n = counts.sum()
            share_ctx = tuple(float(x) for x in counts / n) if n > 0 else ()
            mean_ctx = tuple(float(x) for x in np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)) \
                if n > 0 else ()
            p50, p99, measured, tail, window = cs.tpot(now)
            out.append(ClassSummary(
                name=name, spec=cs.spec, is_default=name == self.classes.default,
                share=steps / total if total > 0 else 0.0,
                tpot_ms_p50=p50, tpot_ms_p99=p99, tpot_requests=measured, tail_tokens_per_step=tail,
                window_tokens_per_step=window,
                tau=accepted / drafted if drafted > 0 else 0.0,
                spec_fraction=drafted / steps if steps > 0 else 0.0,
                tokens_per_step=tokens / steps if steps > 0 else 0.0,
                step_ms_mean=step_ms / steps if steps > 0 else 0.0,
                mean_context_len=float(sums.sum() / n) if n > 0 else 0.0,
                context_share=share_ctx, context_mean=mean_ctx,
                request_steps=cs.steps_total, tokens=cs.tokens_total, typical_request_steps=cs.typical_total,
            ))
        return out

    def class_load(self, now: float) -> dict[str, ClassLoad]:
        """``Observation.class_load``: every class of the policy by name."""
        return {s.name: s.load() for s in self.summaries(now)}
