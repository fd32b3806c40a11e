"""Acceptance model: Beta posteriors per stratum, position and candidate rank.

A stratum is (drafter kind, drafter version, context-length bucket); the model
never pools across strata. Within one, candidate acceptance at position ``k``
is modelled by stick-breaking: the rank-``r`` candidate is accepted with
probability ``s[k, r]`` given that position ``k`` was reached and ranks
``< r`` were not accepted, so

    q[k, r] = s[k, r] · Π_{r' < r} (1 − s[k, r'])

is the probability that rank ``r`` is the accepted one and a chain's
``α_k = s[k, 1]``. Each ``s[k, r]`` has a Beta posterior. Censoring is
handled by construction: a step only updates the (position, rank) cells it
actually offered, so positions past a rejection, depths beyond the one used
and ranks beyond the candidates offered stay untouched.

Forgetting keeps the model following change: the data part of every
posterior decays with a half-life in seconds of the caller's clock, and each
cell's evidence is capped, so a busy stratum still moves within a bounded
number of observations. Memory is fixed per stratum (two ``depth × width``
arrays), and the number of drafter versions kept is bounded (LRU).
"""

from __future__ import annotations


from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class AcceptancePrior:
    """Beta prior on the stick probability of each rank: mean and strength."""

    rank1_mean: float = 0.6
    deeper_rank_mean: float = 0.25
    strength: float = 2.0


class StratumPosterior:
    """Posterior of one stratum: ``depth × width`` stick-breaking Beta cells."""

    __slots__ = ("prior_a", "prior_b", "succ", "fail", "max_depth", "max_width", "updated_at", "observations")

    def __init__(self, max_depth: int, max_width: int, prior: AcceptancePrior, now: float) -> None:
        self.max_depth = max_depth
        self.max_width = max_width
        mean = np.full((max_depth, max_width), prior.deeper_rank_mean)
        mean[:, 0] = prior.rank1_mean
        self.prior_a = mean * prior.strength
        self.prior_b = (1.0 - mean) * prior.strength
        # Flat Python lists: ingest touches a few cells per request and list
        # arithmetic is far cheaper than numpy scalar indexing on that path.
        self.succ = [0.0] * (max_depth * max_width)
        self.fail = [0.0] * (max_depth * max_width)
        self.updated_at = now
        self.observations = 0

    def observe(self, accepted_rank: Sequence[int], level_candidates: Sequence[int]) -> None:
        """Add one request-step's per-position outcome (validated upstream)."""
        width = self.max_width
        succ, fail = self.succ, self.fail
        for level, (rank, offered) in enumerate(zip(accepted_rank, level_candidates)):
            if level >= self.max_depth:
                break
            base = level * width
            # Ranks before the accepted one were offered and refused; ranks
            # after it were never tested (censored) and stay untouched.
            tested = min(offered, width) if rank == 0 else min(rank, width)
            for r in range(tested):
                if r + 1 == rank:
                    succ[base + r] += 1.0
                else:
                    fail[base + r] += 1.0
        self.observations += 1

    def observe_chain(self, depth: int, accepted: int, count: float = 1.0) -> None:
        """``count`` chain steps of ``depth`` that accepted ``accepted`` tokens:
        positions 1..τ succeeded at rank 1, position τ+1 failed, the rest are
        censored."""
        width = self.max_width
        succ = self.succ
        for level in range(min(accepted, self.max_depth)):
            succ[level * width] += count
        if accepted < depth and accepted < self.max_depth:
            self.fail[accepted * width] += count
        self.observations += count

    def decay(self, now: float, half_life_s: float, max_evidence: float) -> None:
        """Forget old evidence: exponential in time, then cap each cell."""
        dt = now - self.updated_at
        factor = 0.5 ** (dt / half_life_s) if dt > 0 and half_life_s > 0 else 1.0
        self.updated_at = max(self.updated_at, now)
        succ, fail = self.succ, self.fail
        for i in range(len(succ)):
            s, f = succ[i] * factor, fail[i] * factor
            total = s + f
            if total > max_evidence:
                scale = max_evidence / total
                s, f = s * scale, f * scale
            succ[i], fail[i] = s, f

    def beta_params(self) -> tuple[np.ndarray, np.ndarray]:  # each [depth, width]
        shape = (self.max_depth, self.max_width)
        a = self.prior_a + np.asarray(self.succ).reshape(shape)
        b = self.prior_b + np.asarray(self.fail).reshape(shape)
        return a, b

    def stick_mean(self) -> np.ndarray:  # [depth, width]
        a, b = self.beta_params()
        return a / (a + b)

    def effective_samples(self) -> np.ndarray:  # [depth]: evidence behind each rank-1 cell
        shape = (self.max_depth, self.max_width)
        s = np.asarray(self.succ).reshape(shape)[:, 0]
        f = np.asarray(self.fail).reshape(shape)[:, 0]
        return s + f


def sticks_to_rank_probs(sticks: np.ndarray) -> np.ndarray:
    """q[k, r] = s[k, r] · Π_{r'<r} (1 − s[k, r']).  # [depth, width] -> [depth, width]

    >>> sticks_to_rank_probs(np.array([[0.5, 0.5]])).tolist()
    [[0.5, 0.25]]
    """
    survive = np.cumprod(1.0 - sticks, axis=1)
    before = np.concatenate([np.ones_like(sticks[:, :1]), survive[:, :-1]], axis=1)
    return sticks * before


def expected_chain_accepted(alpha: np.ndarray) -> float:
    """E[τ | chain of depth len(alpha)] = Σ_k Π_{j≤k} α_j.

    >>> round(expected_chain_accepted(np.array([0.8, 0.8, 0.8])), 3)
    1.952
    """
    return float(np.cumprod(alpha).sum())


DrafterKey = tuple[str, str]  # (kind, version)


class AcceptanceModel:
    """Posteriors for every drafter version seen, per context bucket.

    Parameters
    ----------
    context_edges : lower edges of the context-length buckets (first is 0).
    half_life_s : evidence half-life in seconds.
    max_evidence : cap on successes + failures per cell after decay.
    max_versions : drafter versions kept (least recently used dropped).

    Examples
    --------
    >>> model = AcceptanceModel(context_edges=(0, 4096), half_life_s=60.0)
    >>> for _ in range(200):
    ...     model.observe(("eagle", "v1"), 4, 2, 100, accepted_rank=[1, 1, 0], level_candidates=[1, 1, 1], now=0.0)
    >>> view = model.view(("eagle", "v1"), 4, 2)
    >>> [round(float(x), 2) for x in view.chain_alpha(0)]  # position 4 never tested: prior
    [1.0, 1.0, 0.01, 0.6]
    """

    def __init__(
        self,
        context_edges: Sequence[int],
        half_life_s: float = 300.0,
        max_evidence: float = 2000.0,
        prior: AcceptancePrior = AcceptancePrior(),
        max_versions: int = 64,
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if max_evidence <= 0:
            raise ValueError(f"max_evidence must be > 0, got {max_evidence}")
        self.context_edges = tuple(context_edges)
        self.half_life_s = half_life_s
        self.max_evidence = max_evidence
        self.prior = prior
        self.max_versions = max_versions
        self._strata: OrderedDict[DrafterKey, list[StratumPosterior]] = OrderedDict()

    def context_bucket(self, context_len: int) -> int:
        return max(bisect_right(self.context_edges, context_len) - 1, 0)

    def strata(self, key: DrafterKey, max_depth: int, max_width: int, now: float = 0.0) -> list[StratumPosterior]:
        buckets = self._strata.get(key)
        if buckets is None or buckets[0].max_depth < max_depth or buckets[0].max_width < max_width:
            depth = max(max_depth, buckets[0].max_depth if buckets else 0)
            width = max(max_width, buckets[0].max_width if buckets else 0)
            buckets = [StratumPosterior(depth, width, self.prior, now) for _ in self.context_edges]
            self._strata[key] = buckets
            while len(self._strata) > self.max_versions:
                self._strata.popitem(last=False)
        else:
            self._strata.move_to_end(key)
        return buckets

    def observe(
        self,
        key: DrafterKey,
        max_depth: int,
        max_width: int,
        context_len: int,
        accepted_rank: Sequence[int],
        level_candidates: Sequence[int],
        now: float,
    ) -> None:
        self.strata(key, max_depth, max_width, now)[self.context_bucket(context_len)].observe(
            accepted_rank, level_candidates
        )

    def tick(self, now: float) -> None:
        """Apply forgetting to every stratum (call every second or so)."""
        for buckets in self._strata.values():
            for posterior in buckets:
                posterior.decay(now, self.half_life_s, self.max_evidence)

    def view(self, key: DrafterKey, max_depth: int, max_width: int) -> "AcceptanceView":
        return AcceptanceView(self.context_edges, self.strata(key, max_depth, max_width), max_depth, max_width)

    def keys(self) -> Iterable[DrafterKey]:
        return tuple(self._strata.keys())


class AcceptanceView:
    """Read-only snapshot for one drafter version, cut to its limits
    (implements ``policies.base.AcceptanceEstimate``)."""

    def __init__(
        self, context_edges: tuple[int, ...], buckets: list[StratumPosterior], max_depth: int, max_width: int
    ) -> None:
        self.context_edges = context_edges
        self.max_depth = max_depth
        self.max_width = max_width
        # Snapshot the parameters: policies may run after more telemetry lands.
        self._params = [p.beta_params() for p in buckets]
        self._effective = [p.effective_samples() for p in buckets]

    def _cut(self, x: np.ndarray) -> np.ndarray:
        return x[: self.max_depth, : self.max_width]

    def rank_probs(self, context_bucket: int) -> np.ndarray:  # [depth, width]
        a, b = self._params[context_bucket]
        return sticks_to_rank_probs(self._cut(a / (a + b)))

    def sample_rank_probs(self, context_bucket: int, rng: np.random.Generator) -> np.ndarray:  # [depth, width]
        a, b = self._params[context_bucket]
        return sticks_to_rank_probs(rng.beta(self._cut(a), self._cut(b)))

    def effective_samples(self, context_bucket: int) -> np.ndarray:  # [depth]
        return self._effective[context_bucket][: self.max_depth]

    def chain_alpha(self, context_bucket: int) -> np.ndarray:  # [depth]
        return self.rank_probs(context_bucket)[:, 0]
