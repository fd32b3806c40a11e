"""Request arrivals of one simulated worker.

Arrival times and request attributes are a pure function of the seed and the
scenario: they are drawn lazily, in arrival order, from generators that
nothing else touches, so every policy sees the same requests at the same
times whatever it decides.

Times come from thinning a Poisson process of rate ``λ_max``: a candidate at
``t`` is kept with probability ``λ(t) / λ_max``, where
``λ(t) = state_rate(t) * scale(t)`` (``state_rate`` is the Poisson rate or
the current on/off rate of a bursty process; ``scale`` the scheduled ramp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from worker.sim.acceptance import Ramp, Setpoint
from worker.sim.scenario import (
    BurstyArrivals,
    Change,
    ContextChange,
    DomainMixChange,
    LengthDist,
    RateChange,
    Traffic,
)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as it arrives (``multiplier``: its acceptance predictability)."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    domain: str
    multiplier: float


class _LengthSchedule:
    """A length distribution that scheduled changes replace, optionally blending over ``over_s``."""

    def __init__(self, initial: LengthDist, changes: Sequence[tuple[float, float, LengthDist]]) -> None:
        self.initial = initial
        self.changes = sorted(changes, key=lambda c: c[0])

    def sample(self, t: float, rng: np.random.Generator) -> int:
        dist = self.initial
        for at, over, new in self.changes:
            if t < at:
                break
            # One uniform per change reached keeps the draw count a function of t only.
            u = rng.random()
            if over <= 0 or t >= at + over or u < (t - at) / over:
                dist = new
        return dist.sample(rng)


class TrafficGenerator:
    """Lazily generated arrivals for one worker.

    Parameters
    ----------
    traffic
        The worker's traffic (scenario defaults with its overrides).
    changes
        Scheduled changes that apply to this worker (rate, context and
        domain_mix are used here; drift is acceptance's business).
    seed
        Seed of the arrival stream.
    id_prefix
        Request ids are ``f"{id_prefix}/{n}"``.
    """

    def __init__(
        self,
        traffic: Traffic,
        changes: Sequence[Change] = (),
        seed: int | np.random.SeedSequence = 0,
        id_prefix: str = "req",
    ) -> None:
        self.traffic = traffic
        self.id_prefix = id_prefix
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        times_ss, state_ss, attr_ss = ss.spawn(3)
        self._times = np.random.default_rng(times_ss)
        self._state_rng = np.random.default_rng(state_ss)
        self._attrs = np.random.default_rng(attr_ss)

        arr = traffic.arrivals
        base = arr.mean_rate
        self.scale = Ramp(
            1.0,
            [
                Setpoint(c.at_s, c.scale if c.scale is not None else c.rate / base, c.over_s)
                for c in changes
                if isinstance(c, RateChange)
            ],
        )
        peak = max(arr.rate_on, arr.rate_off) if isinstance(arr, BurstyArrivals) else arr.rate
        self._lambda_max = peak * self.scale.max_value()
        last = max((sp.at_s + sp.over_s for sp in self.scale.setpoints), default=0.0)
        self._dead_after = last if self.scale.value(last) <= 0 else math.inf

        ctx = [c for c in changes if isinstance(c, ContextChange)]
        self.prompt = _LengthSchedule(traffic.prompt_len, [(c.at_s, c.over_s, c.prompt_len) for c in ctx if c.prompt_len])
        self.output = _LengthSchedule(traffic.output_len, [(c.at_s, c.over_s, c.output_len) for c in ctx if c.output_len])

        mixes = [c for c in changes if isinstance(c, DomainMixChange)]
        self.domains = sorted(set(traffic.domain_mix).union(*(c.domain_mix for c in mixes)))
        self._mix = [
            Ramp(traffic.domain_mix.get(d, 0.0), [Setpoint(c.at_s, c.domain_mix.get(d, 0.0), c.over_s) for c in mixes])
            for d in self.domains
        ]

        # Bursty state: on/off with the next switch time.
        self._on = isinstance(arr, BurstyArrivals) and arr.start_on
        self._switch_at = self._dwell() if isinstance(arr, BurstyArrivals) else math.inf
        self._t = 0.0
        self._count = 0
        self._next: Arrival | None = None

    # -- rates -----------------------------------------------------------------
    def _dwell(self) -> float:
        arr = self.traffic.arrivals
        return float(self._state_rng.exponential(arr.mean_on_s if self._on else arr.mean_off_s))

    def _state_rate(self, t: float) -> float:
        arr = self.traffic.arrivals
        if not isinstance(arr, BurstyArrivals):
            return arr.rate
        while t >= self._switch_at:
            self._on = not self._on
            self._switch_at += self._dwell()
        return arr.rate_on if self._on else arr.rate_off

    def rate(self, t: float) -> float:
        """Instantaneous arrival rate at ``t`` (advances the bursty state: call with increasing ``t``)."""
        return self._state_rate(t) * self.scale.value(t)

    def domain_weights(self, t: float) -> dict[str, float]:
        w = np.array([max(r.value(t), 0.0) for r in self._mix])
        total = w.sum()
        w = w / total if total > 0 else np.full(len(w), 1.0 / len(w))
        return dict(zip(self.domains, w.tolist()))

    # -- arrivals --------------------------------------------------------------
    def _generate(self) -> Arrival | None:
        if self._lambda_max <= 0:
            return None
        t = self._t
        while True:
            t += float(self._times.exponential(1.0 / self._lambda_max))
            if t > self._dead_after:
                return None
            if self._times.random() * self._lambda_max < self.rate(t):
                break
        self._t = t
        weights = self.domain_weights(t)
        cum = np.cumsum(list(weights.values()))
        k = int(np.searchsorted(cum, self._attrs.random() * cum[-1], side="right"))
        domain = self.domains[min(k, len(self.domains) - 1)]
        prompt = self.prompt.sample(t, self._attrs)
        output = self.output.sample(t, self._attrs)
        mult = self.traffic.predictability.sample(self._attrs)
        rid = f"{self.id_prefix}/{self._count}"
        self._count += 1
        return Arrival(rid, t, prompt, output, domain, mult)

    def peek_time(self) -> float:
        """Time of the next arrival (``inf`` if none will come)."""
        if self._next is None:
            self._next = self._generate()
        return self._next.arrival_s if self._next is not None else math.inf

    def pop_until(self, t: float) -> list[Arrival]:
        """Every arrival at or before ``t`` not returned yet, in order."""
        out = []
        while self.peek_time() <= t:
            out.append(self._next)
            self._next = None
        return out
