"""Chi-square test of accept-length distributions, censoring-aware."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

import numpy as np

from controller.drift.base import DriftDetector, check_float, check_int
from controller.drift.calibration import cached
from controller.drift.cells import OutcomeKey, chain_key, key_bins, keys_matrix
from controller.drift.stats import censored_chi2, scaled_chi2_fit, scaled_chi2_sf


class AcceptLengthChiSquare(DriftDetector):
    """Accept lengths of each window of ``window`` request-steps vs a baseline.

    Each observation is one request-step's accepted length ``τ`` together
    with the shape that was drafted (depth; for trees the per-level accepted
    rank and candidates offered). The statistic is the two-sample chi-square
    of the accept-length histogram written as per-position (and per-rank)
    conditional binomials (:mod:`controller.drift.cells`,
    :func:`controller.drift.stats.censored_chi2`), so steps drafted at other
    depths or widths enter as censored trials instead of a different
    histogram: a change of the depth mix (e.g. a batch-size shift the policy
    answers with shallower drafts) is not drift, a change of any part of the
    accept-length distribution is — its mean, but also its spread (a mix of
    all-accept and all-reject steps with the mean unchanged).

    The first ``n_baseline`` observations form the baseline (or call
    :meth:`fit`). Windows are tumbling, so under no drift successive tests are
    independent and a per-test level ``alpha`` gives an expected run time of
    ``window / alpha`` observations; ``ert`` sets ``alpha = window / ert``.
    p-values come from the baseline's own null distribution: a double
    bootstrap (a fresh baseline and a fresh window per draw, both resampled
    from the empirical baseline) fitted by a scaled chi-square, which corrects
    the asymptotic law where counts are small or trials within a step are
    dependent.

    Parameters
    ----------
    max_depth, max_width
        Largest depth and width the drafter produces (cells tracked).
    n_baseline
        Observations in the baseline (>= 50).
    window
        Observations per test (>= 20).
    alpha
        Per-test significance level in (0, 1); ``None`` with ``ert`` ``None``
        computes p-values without raising alarms.
    ert
        Expected observations between false alarms without drift (> window).
    min_expected
        Smallest expected count for a cell to enter a test (> 0).
    n_bootstrap
        Null draws for the p-value calibration (>= 64).
    seed
        Seed of the bootstrap.

    Attributes
    ----------
    p_value, statistic, df : float
        Result of the last completed window (``nan`` before the first).
    tested : bool
        Whether the last ``update`` completed a window.

    Examples
    --------
    >>> rng = np.random.default_rng(3)
    >>> def chain(alpha, depth):               # τ of one chain step
    ...     tau = 0
    ...     while tau < depth and rng.random() < alpha:
    ...         tau += 1
    ...     return tau, depth
    >>> det = AcceptLengthChiSquare(max_depth=6, n_baseline=2000, window=300, ert=100_000, seed=0)
    >>> for _ in range(2000):
    ...     _ = det.update(chain(0.75, 6))
    >>> # Depth mix moves to 2 (a batch shift): acceptance per position unchanged.
    >>> any(det.update(chain(0.75, 2)).drift_detected for _ in range(3000))
    False
    >>> # Same mean τ, different spread: steps are either near all-accept or near all-reject.
    >>> mixed = lambda: chain(0.97, 6) if rng.random() < 0.4 else chain(0.35, 6)
    >>> hits = [i for i in range(1500) if det.update(mixed()).drift_detected]
    >>> hits[0] < 300, det.p_value < det.alpha
    (True, True)
    """

    def __init__(
        self,
        max_depth: int = 8,
        max_width: int = 1,
        n_baseline: int = 1000,
        window: int = 400,
        alpha: float | None = None,
        ert: float | None = None,
        min_expected: float = 5.0,
        n_bootstrap: int = 2048,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.max_depth = check_int("max_depth", max_depth, 1, 64)
        self.max_width = check_int("max_width", max_width, 1, 64)
        self.n_baseline = check_int("n_baseline", n_baseline, 50)
        self.window = check_int("window", window, 20)
        if alpha is not None and ert is not None:
            raise ValueError(f"give alpha or ert, not both (alpha={alpha!r}, ert={ert!r})")
        self.ert = None if ert is None else check_float("ert", ert, float(self.window), low_open=True)
        self.alpha = (None if alpha is None else check_float("alpha", alpha, 0.0, 1.0, low_open=True, high_open=True))
        if self.ert is not None:
            self.alpha = self.window / self.ert
        self.min_expected = check_float("min_expected", min_expected, 0.0, low_open=True)
        self.n_bootstrap = check_int("n_bootstrap", n_bootstrap, 64)
        self.seed = check_int("seed", seed, 0)
        self.baseline_counts: Counter[OutcomeKey] = Counter()
        self.baseline_bins: np.ndarray | None = None
        self.null_scale: tuple[float, float] = (1.0, 1.0)
        self.window_counts: Counter[OutcomeKey] = Counter()
        self.last_window: Counter[OutcomeKey] = Counter()
        self._n_base = 0
        self._n_win = 0
        self.n_windows = 0
        self.tested = False
        self.p_value = float("nan")
        self.statistic = float("nan")
        self.df = float("nan")

    def _params(self) -> dict[str, Any]:
        return {"max_depth": self.max_depth, "max_width": self.max_width, "n_baseline": self.n_baseline,
                "window": self.window, "alpha": self.alpha}

    @property
    def baseline_ready(self) -> bool:
        return self.baseline_bins is not None

    def key(self, x: Any) -> OutcomeKey:
        """Outcome key of ``x``: ``τ`` (chain at ``max_depth``), ``(τ, depth)``, or ``(ranks, candidates)``."""
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple):
            return x
        if isinstance(x, tuple) and len(x) == 2:
            tau, depth = int(x[0]), int(x[1])
        else:
            tau, depth = int(x), self.max_depth
        if not 0 <= tau <= depth or depth < 1:
            raise ValueError(f"x must be an accepted length 0 <= tau <= depth with depth >= 1, got {x!r}")
        return chain_key(tau, depth)

    def update(self, x: Any) -> "AcceptLengthChiSquare":
        """Add one request-step outcome (see :meth:`key`)."""
        return self.update_key(self.key(x))

    def update_key(self, key: OutcomeKey) -> "AcceptLengthChiSquare":
        """:meth:`update` for an outcome key already built."""
        self._drift_detected = False
        self.tested = False
        if self.baseline_bins is None:
            self.baseline_counts[key] += 1
            self._n_base += 1
            if self._n_base >= self.n_baseline:
                self.fit(self.baseline_counts)
            return self
        self.window_counts[key] += 1
        self._n_win += 1
        if self._n_win >= self.window:
            self._test()
        return self

    def fit(self, outcomes: Mapping[OutcomeKey, int] | Iterable[Any]) -> "AcceptLengthChiSquare":
        """Set the baseline: outcome counts (key → count) or an iterable of observations."""
        if isinstance(outcomes, Mapping):
            counts = Counter({k: int(n) for k, n in outcomes.items() if int(n) > 0})
        else:
            counts = Counter(self.key(x) for x in outcomes)
        total = sum(counts.values())
        if total < 50:
            raise ValueError(f"baseline must hold >= 50 outcomes, got {total}")
        self.baseline_counts = counts
        self._n_base = total
        keys = sorted(counts)
        matrix = keys_matrix(keys, self.max_depth, self.max_width)
        freq = np.array([counts[k] for k in keys], dtype=np.float64)
        self.baseline_bins = freq @ matrix
        self.null_scale = cached(
            ("accept-chi2-null", matrix, freq, self.window, self.min_expected, self.n_bootstrap, self.seed),
            lambda: _null_scale(matrix, freq, self.window, self.min_expected, self.n_bootstrap, self.seed),
        )
        self.window_counts = Counter()
        self._n_win = 0
        return self

    def window_bins(self, counts: Mapping[OutcomeKey, int] | None = None) -> np.ndarray:
        """Summed cell trials of ``counts`` (default: the window being filled)."""
        counts = self.window_counts if counts is None else counts
        out = np.zeros(2 * self.max_depth * self.max_width)
        for k, n in counts.items():
            out += n * key_bins(k, self.max_depth, self.max_width)
        return out

    def test(self, counts: Mapping[OutcomeKey, int]) -> tuple[float, float, float]:
        """``(statistic, df, p-value)`` of ``counts`` against the baseline."""
        if self.baseline_bins is None:
            raise ValueError("no baseline yet: feed n_baseline observations or call fit()")
        stat, kept = censored_chi2(self.baseline_bins, self.window_bins(counts), self.min_expected)
        a, nu1 = self.null_scale
        return float(stat), float(kept), float(scaled_chi2_sf(float(stat), float(kept), a, nu1))

    def _test(self) -> None:
        self.statistic, self.df, self.p_value = self.test(self.window_counts)
        self.tested = True
        self.n_windows += 1
        self.last_window = self.window_counts
        self.window_counts = Counter()
        self._n_win = 0
        self._drift_detected = self.alpha is not None and self.p_value <= self.alpha


def _null_scale(matrix: np.ndarray, freq: np.ndarray, window: int, min_expected: float, n_bootstrap: int,
                seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    p = freq / freq.sum()
    n_base = 32
    per = max(2, n_bootstrap // n_base)
    base = rng.multinomial(int(freq.sum()), p, size=n_base).astype(np.float64) @ matrix  # [n_base, bins]
    win = rng.multinomial(window, p, size=(n_base, per)).astype(np.float64) @ matrix  # [n_base, per, bins]
    stat, kept = censored_chi2(base[:, None, :], win, min_expected)
    return scaled_chi2_fit(stat.ravel(), kept.ravel())
