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

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator


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
