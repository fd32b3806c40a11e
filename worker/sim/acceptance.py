"""Ground-truth acceptance of the simulator.

For draft position ``k`` (1-based) and candidate rank ``r`` (1-based, ranked by
the drafter's confidence), ``q[k, r]`` is the probability that the target
accepts the rank-``r`` candidate, given positions ``< k`` were accepted.
Candidates are mutually exclusive, so ``Σ_r q[k, r] ≤ 1`` and the remainder is
the chance that no candidate of that level is accepted. ``q[k, 1]`` is the
per-position acceptance ``α_k`` of a chain (docs/design.md §2); a chain's
expected accepted length is :func:`policies.chain.expected_chain_accepted`.

Short-context rows come from a drafter profile::

    q[k, 1] = alpha[k]
    q[k, r] = alpha[k] * rank_ratio * rank_decay ** (r - 2)    (r >= 2)

so lower ranks get geometrically less. Every row is then multiplied by

- a context factor (seed 000 §04): gentle inside the drafter's trained
  context length ``L`` (``1 - within_drop * ctx / L``), a power law beyond it
  (``(1 - within_drop) * (ctx / L) ** -beyond_exponent``: position
  extrapolation), raised to ``1 + depth_sensitivity * (k - 1)`` because the
  draft's own KV error compounds along the ``k`` sequential draft steps;
- a domain factor: the scenario's base factor for the domain times a
  scheduled drift factor (content drift scales it, e.g. to 0.8; a retrained
  drafter brings it back to 1);
- a per-request predictability multiplier (drawn at arrival, mean 1);

and rows whose sum would pass ``row_cap`` are scaled down to it.

Given a request, positions are then independent: the chance that a chain of
``d`` is accepted whole is ``Π_k q[k, 1]``, exactly what the goodput
policy's tree values assume. Real text is not like that: code being echoed or
a quoted passage is accepted token after token, novel text hardly at all.
:class:`CorrelatedAcceptance` (the scenario's
``traffic.correlated_acceptance``, off by default) adds that: each request
carries a hidden Markov state over its output tokens (:class:`SpanPath`),
spans of geometric length with a mean per state, and in each state every row
of ``q`` is replaced (:meth:`SpanModel.transform`): ``acceptance: L`` sets
``q[k, 1] = L`` at every position (a near-copy span, or one nothing
matches), ``scale: s`` multiplies the request's own ``q[k, 1]`` (capped at
``row_cap``); lower ranks keep their ratio to rank 1 and are trimmed so the
row stays within ``max(row_cap, q[k, 1])``. Draft level ``k`` of a step
reads the state of the output token it drafts (index ``generated + k - 1``),
so within a step the state mostly persists down the draft, and between steps
it moves on by the tokens the request emitted. Given the state path the
positions are still independent; over it, a chain is accepted whole or
rejected at once far more often than the per-position mean implies. The path
is a function of the request's id and the worker's seed only (not of the
outcome stream), so every policy meets the same spans at the same tokens, and
with the option off nothing is drawn at all.

Profiles (docs/design.md §6):

- ``eagle``: ``α_k = 0.80 * 0.97 ** (k - 1)`` (EAGLE's reported 0-α ≈ 0.79 and
  slowly falling n-α), ``rank_ratio`` 0.1, ``rank_decay`` 0.5 (top-4 covers
  ~0.94 at position 1). A greedy 60-node tree of depth 7 and width 10 then
  accepts ``E[τ + 1] ≈ 4.8`` tokens per step at short context, inside
  EAGLE-2's reported 4-5.5.
- ``medusa``: ``α = 0.60, 0.50, 0.45, 0.40`` for heads 1-4: the Medusa
  paper's head-k top-1 accuracies (0.6, 0.4, 0.3, 0.25) are unconditional; the
  chance that head k is right *given* heads < k were right is higher, so the
  conditional values fall more slowly. ``rank_ratio`` 0.2, ``rank_decay``
  0.5 (heads' top-k is flatter than EAGLE's): a 64-node tree accepts
  ``E[τ + 1] ≈ 2.8``, a depth-4 chain ≈ 2.1 (Medusa-1: 2.2-3.6x).

>>> model = AcceptanceTruth(PROFILES["eagle"], trained_context_len=8192)
>>> q = model.true_rank_probs(1000, "chat", 0.0)
>>> q.shape, round(float(q[0, 0]), 3)
((8, 8), 0.792)
>>> bool(model.true_rank_probs(64000, "chat", 0.0)[0, 0] < q[0, 0])
True
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AcceptanceProfile(BaseModel):
    """Short-context acceptance of one drafter kind, and how it decays."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["eagle", "medusa"]
    alpha: tuple[float, ...] = Field(min_length=1, description="rank-1 conditional acceptance per position")
    rank_ratio: float = Field(ge=0, le=1, description="q[k, 2] / q[k, 1]")
    rank_decay: float = Field(ge=0, lt=1, description="q[k, r + 1] / q[k, r] for r >= 2")
    within_drop: float = Field(0.08, ge=0, lt=1, description="fractional drop at the trained context length")
    beyond_exponent: float = Field(0.25, ge=0, description="power-law decay beyond the trained length")
    depth_sensitivity: float = Field(0.1, ge=0, description="extra context decay per deeper position")
    row_cap: float = Field(0.98, gt=0, le=1, description="largest Σ_r q[k, r]")

    @field_validator("alpha")
    @classmethod
    def _alpha_in_range(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        bad = [a for a in v if not 0.0 < a < 1.0]
        if bad:
            raise ValueError(f"alpha values must lie in (0, 1), got {bad}")
        return v

    def base_rank_probs(self, depth: int, width: int) -> np.ndarray:
        """Short-context ``q`` [depth, width] (positions past ``len(alpha)`` repeat the last value)."""
        a = np.array([self.alpha[min(k, len(self.alpha) - 1)] for k in range(depth)])
        shape = np.ones(width)
        if width > 1:
            shape[1:] = self.rank_ratio * self.rank_decay ** np.arange(width - 1)
        return a[:, None] * shape[None, :]


PROFILES: dict[str, AcceptanceProfile] = {
    "eagle": AcceptanceProfile(
        kind="eagle", alpha=tuple(round(0.80 * 0.97**k, 4) for k in range(8)), rank_ratio=0.1, rank_decay=0.5
    ),
    "medusa": AcceptanceProfile(kind="medusa", alpha=(0.60, 0.50, 0.45, 0.40), rank_ratio=0.2, rank_decay=0.5),
}


def context_factor(
    context_len: np.ndarray | float, trained_context_len: int, profile: AcceptanceProfile, depth: int
) -> np.ndarray:
    """Context decay per position: shape ``context_len.shape + (depth,)``."""
    ctx = np.asarray(context_len, dtype=np.float64)
    if trained_context_len <= 0:
        return np.ones(ctx.shape + (depth,))
    x = ctx / float(trained_context_len)
    inside = 1.0 - profile.within_drop * x
    beyond = (1.0 - profile.within_drop) * np.maximum(x, 1.0) ** (-profile.beyond_exponent)
    base = np.where(x <= 1.0, inside, beyond)
    exponent = 1.0 + profile.depth_sensitivity * np.arange(depth)
    return base[..., None] ** exponent


@dataclass(frozen=True, slots=True)
class Setpoint:
    """From ``at_s``, move linearly to ``value`` over ``over_s`` seconds (0 = a step)."""

    at_s: float
    value: float
    over_s: float = 0.0


class Ramp:
    """Piecewise-linear schedule of a scalar: ``initial`` until the first setpoint.

    A setpoint that starts while an earlier one is still ramping starts from
    the value reached at that moment.

    >>> r = Ramp(1.0, [Setpoint(10, 0.8, over_s=10), Setpoint(30, 1.0)])
    >>> [round(r.value(t), 2) for t in (0, 15, 20, 29, 30)]
    [1.0, 0.9, 0.8, 0.8, 1.0]
    """

    def __init__(self, initial: float, setpoints: Iterable[Setpoint] = ()) -> None:
        self.initial = float(initial)
        self.setpoints = sorted(setpoints, key=lambda s: s.at_s)

    def value(self, t: float) -> float:
        v = self.initial
        pts = self.setpoints
        for i, sp in enumerate(pts):
            if t < sp.at_s:
                break
            end = t if i + 1 >= len(pts) or pts[i + 1].at_s > t else pts[i + 1].at_s
            frac = 1.0 if sp.over_s <= 0 else min(1.0, (end - sp.at_s) / sp.over_s)
            v = v + (sp.value - v) * frac
        return v

    def max_value(self) -> float:
        """Largest value the schedule reaches (ramps are linear, so a setpoint or the start)."""
        return max([self.initial] + [sp.value for sp in self.setpoints])


class AcceptanceTruth:
    """Ground truth ``q`` for one worker's drafter: what the simulated target
    really accepts (the controller's estimate of it is
    ``controller.models.acceptance.AcceptanceModel``, which never sees this).

    Parameters
    ----------
    profile
        Drafter acceptance profile (``PROFILES["eagle"]`` ...).
    trained_context_len
        Context length the drafter was trained on (0 = no context decay).
    domain_base
        Base acceptance factor per domain (missing domains: 1.0).
    drift
        Scheduled drift factor per domain (``Ramp`` of the factor; missing: 1.0).
    max_depth, max_width
        Shape of the matrices returned.
    """

    def __init__(
        self,
        profile: AcceptanceProfile,
        trained_context_len: int,
        domain_base: Mapping[str, float] | None = None,
        drift: Mapping[str, Ramp] | None = None,
        max_depth: int | None = None,
        max_width: int = 8,
    ) -> None:
        self.profile = profile
        self.trained_context_len = int(trained_context_len)
        self.domain_base = dict(domain_base or {})
        self.drift = dict(drift or {})
        self.max_depth = int(max_depth or len(profile.alpha))
        self.max_width = int(max_width)
        self.base = profile.base_rank_probs(self.max_depth, self.max_width)

    def domain_factor(self, domain: str, t: float) -> float:
        """Base factor of ``domain`` times its drift factor at time ``t``."""
        ramp = self.drift.get(domain)
        return self.domain_base.get(domain, 1.0) * (ramp.value(t) if ramp is not None else 1.0)

    def rank_probs_batch(
        self, context_len: Sequence[float], domain_factor: Sequence[float], multiplier: Sequence[float]
    ) -> np.ndarray:
        """``q`` for a batch: [batch, max_depth, max_width]."""
        ctx = np.asarray(context_len, dtype=np.float64)
        row = context_factor(ctx, self.trained_context_len, self.profile, self.max_depth)
        row = row * (np.asarray(domain_factor, dtype=np.float64) * np.asarray(multiplier, dtype=np.float64))[:, None]
        q = self.base[None, :, :] * row[:, :, None]
        total = q.sum(axis=2, keepdims=True)
        cap = self.profile.row_cap
        return q * np.minimum(1.0, cap / np.maximum(total, 1e-12))

    def true_rank_probs(self, context_len: int, domain: str, t: float, multiplier: float = 1.0) -> np.ndarray:
        """Ground-truth ``q`` [max_depth, max_width] of a request at time ``t``.

        Parameters
        ----------
        context_len
            Tokens in the KV cache before the step.
        domain
            Content domain of the request.
        t
            Scenario time in seconds (drift schedule).
        multiplier
            The request's predictability (1.0 = a typical request).
        """
        return self.rank_probs_batch([context_len], [self.domain_factor(domain, t)], [multiplier])[0]

    def chain_alpha(self, context_len: int, domain: str, t: float, multiplier: float = 1.0) -> np.ndarray:
        """Per-position chain acceptance ``α_k`` = ``q[k, 1]``."""
        return self.true_rank_probs(context_len, domain, t, multiplier)[:, 0]


# -- correlated acceptance ---------------------------------------------------
class SpanState(BaseModel):
    """One hidden state of :class:`CorrelatedAcceptance`: its acceptance and how long its spans last.

    Exactly one of ``acceptance`` (the rank-1 acceptance at every position
    while in the state, whatever the request's context, domain or
    predictability) and ``scale`` (a multiplier of the request's own rank-1
    acceptance, capped at the profile's ``row_cap``; 1.0 = the request as
    it would be without the option).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_.-]+$")
    acceptance: float | None = Field(None, ge=0, lt=1, description="rank-1 acceptance at every position in the state")
    scale: float | None = Field(None, ge=0, le=10, description="multiplier of the request's own rank-1 acceptance")
    mean_span: float = Field(ge=1, le=1e6, description="mean span length in output tokens (geometric)")
    next: dict[str, float] | None = Field(
        None, description="relative weights of the states entered when a span ends (default: every other one alike)"
    )

    @model_validator(mode="after")
    def _one_level(self):
        if (self.acceptance is None) == (self.scale is None):
            raise ValueError(f"give exactly one of acceptance / scale, got acceptance={self.acceptance} "
                             f"scale={self.scale}")
        return self


class CorrelatedAcceptance(BaseModel):
    """Acceptance correlated within a request: a hidden Markov state per request over its output tokens.

    ``states``: two or more :class:`SpanState`; a span of state ``i`` lasts
    a geometric number of tokens with mean ``mean_span`` and is followed by
    a span of another state drawn by ``next`` (never the same one: a longer
    span is a larger ``mean_span``). A request starts in the stationary mix,
    so every output token is in state ``i`` with probability
    :attr:`SpanModel.stationary`. ``domains``: only requests of these
    domains carry a state (default: all); the others keep independent
    positions.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    states: tuple[SpanState, ...]
    domains: tuple[str, ...] | None = Field(None, min_length=1, description="domains that carry a state (default: all)")

    @field_validator("states")
    @classmethod
    def _count(cls, v: tuple[SpanState, ...]) -> tuple[SpanState, ...]:
        if not 2 <= len(v) <= 8:
            raise ValueError(f"give 2 to 8 states, got {len(v)}: {[s.name for s in v]}")
        return v

    @model_validator(mode="after")
    def _transitions(self):
        names = [s.name for s in self.states]
        problems = []
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            problems.append(f"states: duplicate state names {dup}")
        for i, s in enumerate(self.states):
            if s.next is None:
                continue
            where = f"states.{i}.next"
            unknown = [k for k in s.next if k not in names]
            if unknown:
                problems.append(f"{where}: unknown states {unknown} (known: {names})")
            if s.name in s.next:
                problems.append(f"{where}: {s.name!r} cannot follow itself (make its mean_span longer instead)")
            bad = {k: w for k, w in s.next.items() if not (math.isfinite(w) and w >= 0)}
            if bad:
                problems.append(f"{where}: weights must be finite and >= 0, got {bad}")
            elif sum(s.next.values()) <= 0:
                problems.append(f"{where}: weights must not all be 0, got {s.next}")
        if not problems:
            p = self.transition_matrix()
            reach = (p > 0) | np.eye(len(names), dtype=bool)
            for _ in range(len(names)):
                reach = reach | ((reach.astype(int) @ reach.astype(int)) > 0)
            cut = [(names[a], names[b]) for a in range(len(names)) for b in range(len(names)) if not reach[a, b]]
            if cut:
                a, b = cut[0]
                problems.append(f"states: {b!r} is never entered from {a!r} (every state must be reachable "
                                f"from every other; check next)")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def transition_matrix(self) -> np.ndarray:
        """``P[i, j]``: the chance that a span of state ``i`` is followed by one of state ``j``."""
        names = [s.name for s in self.states]
        n = len(names)
        p = np.zeros((n, n))
        for i, s in enumerate(self.states):
            if s.next is None:
                p[i] = 1.0
                p[i, i] = 0.0
            else:
                for name, w in s.next.items():
                    p[i, names.index(name)] = w
            p[i] /= p[i].sum()
        return p


class SpanModel:
    """A :class:`CorrelatedAcceptance` compiled for one worker's drafter.

    Parameters
    ----------
    config
        The scenario's configuration.
    row_cap
        The drafter profile's ``row_cap`` (the most a ``scale`` state lifts rank 1 to).
    """

    def __init__(self, config: CorrelatedAcceptance, row_cap: float) -> None:
        self.config = config
        self.row_cap = float(row_cap)
        self.names = [s.name for s in config.states]
        self.mean_span = np.array([s.mean_span for s in config.states], dtype=np.float64)
        self.transitions = config.transition_matrix()
        self._next_cum = np.cumsum(self.transitions, axis=1)
        self.domains = None if config.domains is None else frozenset(config.domains)
        # Stationary mix of tokens: ν P = ν for the span-to-span chain, tokens ∝ ν_i · mean_span_i.
        n = len(self.names)
        a = np.vstack([self.transitions.T - np.eye(n), np.ones(n)])
        nu = np.linalg.lstsq(a, np.r_[np.zeros(n), 1.0], rcond=None)[0]
        nu = np.clip(nu, 0.0, None)
        pi = nu * self.mean_span
        self.stationary = pi / pi.sum()
        self._start_cum = np.cumsum(self.stationary)

    def applies_to(self, domain: str) -> bool:
        return self.domains is None or domain in self.domains

    # -- paths ---------------------------------------------------------------
    def path(self, seed: int | np.random.SeedSequence) -> "SpanPath":
        """A request's state path, drawn lazily from its own seed."""
        return SpanPath(self, np.random.default_rng(seed))

    def _pick(self, cum: np.ndarray, rng: np.random.Generator) -> int:
        return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(cum) - 1)

    def _span(self, state: int, rng: np.random.Generator) -> int:
        return int(rng.geometric(1.0 / self.mean_span[state]))

    # -- acceptance ----------------------------------------------------------
    def transform(self, q: np.ndarray, state: int) -> np.ndarray:
        """Rows ``q`` [..., ranks] as they are in ``state`` (see the module docstring)."""
        s = self.config.states[state]
        a = q[..., 0]
        if s.acceptance is not None:
            top = np.full_like(a, s.acceptance)
        else:
            top = np.minimum(a * s.scale, np.maximum(self.row_cap, a))
        ratio = np.divide(top, a, out=np.zeros_like(a), where=a > 0)
        tail = q[..., 1:] * ratio[..., None]
        total = tail.sum(axis=-1)
        budget = np.maximum(np.maximum(self.row_cap, top) - top, 0.0)
        trim = np.divide(budget, total, out=np.ones_like(total), where=total > budget)
        out = np.empty_like(q)
        out[..., 0] = top
        out[..., 1:] = tail * np.minimum(trim, 1.0)[..., None]
        return out

    def apply(self, q: np.ndarray, states: np.ndarray) -> np.ndarray:
        """``q`` [batch, depth, ranks] with each position in its state (``states`` [batch, depth], -1 = none)."""
        out = q.copy()
        for s in np.unique(states):
            if s < 0:
                continue
            mask = states == s
            out[mask] = self.transform(q[mask], int(s))
        return out

    def marginal_rank1(self, alpha: np.ndarray | float) -> np.ndarray:
        """Per-token mean rank-1 acceptance over the stationary mix, for a request whose own is ``alpha``."""
        a = np.asarray(alpha, dtype=np.float64)
        rows = np.stack([a, np.zeros_like(a)], axis=-1)
        per_state = np.stack([self.transform(rows, i)[..., 0] for i in range(len(self.names))], axis=-1)
        return per_state @ self.stationary


class SpanPath:
    """The hidden states of one request's output tokens, drawn lazily span by span."""

    __slots__ = ("model", "rng", "starts", "ends", "states")

    def __init__(self, model: SpanModel, rng: np.random.Generator) -> None:
        self.model = model
        self.rng = rng
        state = model._pick(model._start_cum, rng)
        self.starts = [0]
        self.ends = [model._span(state, rng)]  # exclusive
        self.states = [state]

    def grow(self, until: int) -> None:
        """Draw spans until token ``until - 1`` has a state."""
        m, rng = self.model, self.rng
        while self.ends[-1] < until:
            state = m._pick(m._next_cum[self.states[-1]], rng)
            self.starts.append(self.ends[-1])
            self.ends.append(self.ends[-1] + m._span(state, rng))
            self.states.append(state)

    def window(self, start: int, n: int) -> list[int]:
        """States of output tokens ``start .. start + n - 1``."""
        self.grow(start + n)
        ends = self.ends
        i = bisect_right(ends, start)
        if ends[i] >= start + n:
            return [self.states[i]] * n
        out = []
        for t in range(start, start + n):
            while ends[i] <= t:
                i += 1
            out.append(self.states[i])
        return out

    def spans(self) -> list[tuple[int, int, int]]:
        """(start, end, state) of every span drawn so far (``end`` exclusive)."""
        return list(zip(self.starts, self.ends, self.states))
