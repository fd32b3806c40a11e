"""Request arrivals of one simulated worker.

Open loop (``poisson``, ``bursty``): arrival times and request attributes
are a pure function of the seed and the scenario, drawn lazily in arrival
order from generators nothing else touches, so every policy sees the same
requests at the same times whatever it decides. Times come from thinning a
Poisson process of rate ``λ_max``: a candidate at ``t`` is kept with
probability ``λ(t) / λ_max``, where ``λ(t) = state_rate(t) * scale(t)``
(``state_rate`` is the Poisson rate or the current on/off rate of a bursty
process; ``scale`` the scheduled ramp).

Closed loop (``closed``): user ``u`` sends its next request when the worker
reports its last one finished (:meth:`TrafficGenerator.finished`) plus a
think time. Users are numbered; user ``u`` is active while
``u < round(users(t) * scale(t))``. Each user draws its requests and think
times from its own seed stream, so its ``k``-th request is the same under
every policy in distribution and, while the schedule does not change the
distributions, exactly; a faster policy simply gets further down each
user's list.

Request classes (``traffic.class_mix``): an open-loop arrival draws its
class from the mix, from a stream of its own (a fourth child of the
arrivals' seed, made only when there is a mix), so every other attribute
and time is what it is without classes; a closed-loop user belongs to one
class for good (:func:`interleave_classes`). Without a ``class_mix``
nothing is drawn and requests carry no class (``request_class == ""``), so
the streams are exactly those of before.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from worker.sim.acceptance import Ramp, Setpoint
from worker.sim.scenario import (
    BurstyArrivals,
    Change,
    ClosedLoopArrivals,
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
    request_class: str = ""  # "" = none (the policy's default class)


def interleave_classes(mix: dict[str, float], n: int) -> list[str]:
    """The classes of users ``0..n-1``: user ``u`` joins the class furthest below its
    share among users ``0..u`` (ties: the first in the mix), so every prefix of the
    users splits as ``mix`` does, within one user per class.

    >>> interleave_classes({"interactive": 1, "batch": 3}, 8)
    ['batch', 'interactive', 'batch', 'batch', 'batch', 'interactive', 'batch', 'batch']
    """
    names = list(mix)
    w = np.array([mix[c] for c in names], dtype=np.float64)
    share = w / w.sum()
    counts = np.zeros(len(names))
    out = []
    for u in range(n):
        k = int(np.argmax(share * (u + 1) - counts))
        counts[k] += 1
        out.append(names[k])
    return out


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
        self.closed = isinstance(arr, ClosedLoopArrivals)
        base = arr.users if self.closed else arr.mean_rate

        def level(c: RateChange) -> float:
            if c.scale is not None:
                return c.scale
            return (c.users if self.closed else c.rate) / base

        self.scale = Ramp(1.0, [Setpoint(c.at_s, level(c), c.over_s) for c in changes if isinstance(c, RateChange)])
        if self.closed:
            peak = 0.0
        elif isinstance(arr, BurstyArrivals):
            peak = max(arr.rate_on, arr.rate_off)
        else:
            peak = arr.rate
        self._lambda_max = peak * self.scale.max_value()
        last = max((sp.at_s + sp.over_s for sp in self.scale.setpoints), default=0.0)
        self._dead_after = last if self.scale.value(last) <= 0 else math.inf

        ctx = [c for c in changes if isinstance(c, ContextChange)]
        self.prompt = _LengthSchedule(traffic.prompt_len, [(c.at_s, c.over_s, c.prompt_len) for c in ctx if c.prompt_len])
        self.output = _LengthSchedule(traffic.output_len, [(c.at_s, c.over_s, c.output_len) for c in ctx if c.output_len])

        self._classes: tuple[list[str], np.ndarray, np.random.Generator] | None = None
        if traffic.class_mix is not None:  # (names, cumulative shares, the class stream)
            w = np.array(list(traffic.class_mix.values()), dtype=np.float64)
            self._classes = (list(traffic.class_mix), np.cumsum(w) / w.sum(), np.random.default_rng(ss.spawn(1)[0]))

        mixes = [c for c in changes if isinstance(c, DomainMixChange)]
        self.domains = sorted(set(traffic.domain_mix).union(*(c.domain_mix for c in mixes)))
        self._mix = [
            Ramp(traffic.domain_mix.get(d, 0.0), [Setpoint(c.at_s, c.domain_mix.get(d, 0.0), c.over_s) for c in mixes])
            for d in self.domains
        ]

        # Bursty state: on/off with the next switch time.
        on_off = isinstance(arr, BurstyArrivals) or (self.closed and arr.bursty)
        self._on = on_off and arr.start_on
        self._switch_at = self._dwell() if on_off else math.inf
        self._t = 0.0
        self._count = 0
        self._next: Arrival | None = None
        self.users = _Users(self, arr, attr_ss) if self.closed else None

    # -- rates -----------------------------------------------------------------
    def _dwell(self) -> float:
        arr = self.traffic.arrivals
        return float(self._state_rng.exponential(arr.mean_on_s if self._on else arr.mean_off_s))

    def _advance_state(self, t: float) -> bool:
        """Whether the on/off process is on at ``t`` (call with increasing ``t``)."""
        while t >= self._switch_at:
            self._on = not self._on
            self._switch_at += self._dwell()
        return self._on

    def _state_rate(self, t: float) -> float:
        arr = self.traffic.arrivals
        if not isinstance(arr, BurstyArrivals):
            return arr.rate
        return arr.rate_on if self._advance_state(t) else arr.rate_off

    def active_users(self, t: float) -> int:
        """Closed loop: users sending requests at ``t`` (call with increasing ``t``)."""
        arr = self.traffic.arrivals
        users = arr.burst_users if arr.bursty and self._advance_state(t) else arr.users
        return int(round(users * self.scale.value(t)))

    def rate(self, t: float) -> float:
        """Instantaneous arrival rate at ``t`` (advances the bursty state: call with increasing ``t``)."""
        return self._state_rate(t) * self.scale.value(t)

    def domain_weights(self, t: float) -> dict[str, float]:
        w = np.array([max(r.value(t), 0.0) for r in self._mix])
        total = w.sum()
        w = w / total if total > 0 else np.full(len(w), 1.0 / len(w))
        return dict(zip(self.domains, w.tolist()))

    # -- arrivals --------------------------------------------------------------
    def draw(self, request_id: str, t: float, rng: np.random.Generator, request_class: str | None = None) -> Arrival:
        """A request arriving at ``t``, its attributes drawn from ``rng``; its class
        ``request_class`` when given (a closed-loop user's), else drawn from the
        traffic's ``class_mix`` (none without one)."""
        weights = self.domain_weights(t)
        cum = np.cumsum(list(weights.values()))
        k = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        domain = self.domains[min(k, len(self.domains) - 1)]
        prompt = self.prompt.sample(t, rng)
        output = self.output.sample(t, rng)
        mult = self.traffic.predictability.sample(rng)
        if request_class is None and self._classes is not None:
            # From the class stream: the attribute stream stays what it is without classes.
            names, cum, class_rng = self._classes
            request_class = names[min(int(np.searchsorted(cum, class_rng.random(), side="right")), len(names) - 1)]
        return Arrival(request_id, t, prompt, output, domain, mult, request_class or "")

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
        arrival = self.draw(f"{self.id_prefix}/{self._count}", t, self._attrs)
        self._count += 1
        return arrival

    def peek_time(self, now: float = -math.inf) -> float:
        """Time of the next arrival (``inf`` if none will come).

        Closed loop: the earliest time a user may send, after ``now`` (the
        caller has popped everything up to ``now``); a user who is not
        counted yet is looked for again :data:`IDLE_POLL_S` later.
        """
        if self.users is not None:
            return self.users.peek(now)
        if self._next is None:
            self._next = self._generate()
        return self._next.arrival_s if self._next is not None else math.inf

    def pop_until(self, t: float) -> list[Arrival]:
        """Every arrival at or before ``t`` not returned yet, in order."""
        if self.users is not None:
            return self.users.pop_until(t)
        out = []
        while self.peek_time() <= t:
            out.append(self._next)
            self._next = None
        return out

    def finished(self, request_id: str, t: float) -> None:
        """The worker is done with ``request_id`` at ``t`` (closed loop: its user thinks, then sends again)."""
        if self.users is not None:
            self.users.finished(request_id, t)


IDLE_POLL_S = 0.05  # how often an idle closed-loop worker looks for users joining


class _Users:
    """Closed-loop users of one worker: who is thinking until when, who waits for a reply."""

    def __init__(self, gen: TrafficGenerator, arr: ClosedLoopArrivals, seed: np.random.SeedSequence) -> None:
        self.gen = gen
        self.think_s = arr.think_s
        n = int(math.ceil(arr.peak_users * gen.scale.max_value()))
        self.streams = [np.random.default_rng(ss) for ss in seed.spawn(n)]
        self.sent = [0] * n
        # Every user is ready at 0 (after a first think time, so thinking users do not start in lockstep).
        self.ready: list[tuple[float, int]] = [(self._think(u), u) for u in range(n)]
        heapq.heapify(self.ready)
        self.waiting_turn: list[int] = []  # ready but not counted among the active users (a heap)
        self.owner: dict[str, int] = {}
        mix = gen.traffic.class_mix
        self.classes = interleave_classes(mix, n) if mix is not None else None  # each user's class for good
        self.can_grow = bool(gen.scale.setpoints) or arr.bursty

    def _think(self, u: int) -> float:
        return float(self.streams[u].exponential(self.think_s)) if self.think_s > 0 else 0.0

    def pop_until(self, t: float) -> list[Arrival]:
        active = self.gen.active_users(t)
        out: list[Arrival] = []
        while self.waiting_turn and self.waiting_turn[0] < active:
            out.append(self._send(heapq.heappop(self.waiting_turn), t))
        while self.ready and self.ready[0][0] <= t:
            at, u = heapq.heappop(self.ready)
            if u < active:
                out.append(self._send(u, at))
            else:
                heapq.heappush(self.waiting_turn, u)
        out.sort(key=lambda a: a.arrival_s)
        return out

    def _send(self, u: int, t: float) -> Arrival:
        rid = f"{self.gen.id_prefix}/u{u}.{self.sent[u]}"
        self.sent[u] += 1
        self.owner[rid] = u
        return self.gen.draw(rid, t, self.streams[u], self.classes[u] if self.classes is not None else None)

    def finished(self, request_id: str, t: float) -> None:
        u = self.owner.pop(request_id, None)
        if u is not None:
            heapq.heappush(self.ready, (t + self._think(u), u))

    def peek(self, now: float) -> float:
        nxt = self.ready[0][0] if self.ready else math.inf
        if self.waiting_turn and self.can_grow:
            nxt = min(nxt, now + IDLE_POLL_S)
        return nxt
