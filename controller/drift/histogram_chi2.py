"""Chi-square test of a categorical histogram (e.g. accept lengths at one depth)."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from controller.drift.base import DriftDetector, check_float, check_int
from controller.drift.calibration import cached
from controller.drift.stats import histogram_chi2, merge_plan, scaled_chi2_fit, scaled_chi2_sf


class HistogramChiSquare(DriftDetector):
    """Histogram of each window of ``window`` observations vs a baseline histogram.

    Observations are categories ``0 .. n_bins − 1`` (accepted lengths of
    steps drafted at one depth, say). Each tumbling window is compared with
    the baseline by the 2×K Pearson homogeneity test after merging adjacent
    bins whose expected count would be under ``min_expected`` (the merge plan
    is fixed by the baseline, so every window has the same degrees of
    freedom). The p-value uses the baseline's own null distribution: a double
    bootstrap (fresh baseline and window resampled from the empirical
    baseline) matched by a scaled chi-square. With ``ert`` the per-test level
    is ``window / ert``: tumbling windows are independent under no drift, so
    the expected run time without drift is ``ert`` observations.

    For steps drafted at different depths use
    :class:`~controller.drift.accept_chi2.AcceptLengthChiSquare`, which treats
    shallower drafts as censored rather than as a different histogram.

    Parameters
    ----------
    n_bins
        Number of categories (>= 2).
    n_baseline
        Observations in the baseline (>= 50).
    window
        Observations per test (>= 20).
    alpha
        Per-test significance level in (0, 1).
    ert
        Expected observations between false alarms without drift (> window).
    min_expected
        Smallest expected count per merged bin (> 0).
    n_bootstrap
        Null draws for the p-value calibration (>= 64).
    seed
        Seed of the bootstrap.

    Examples
    --------
    >>> rng = np.random.default_rng(1)
    >>> before = rng.choice(5, size=3000, p=[0.3, 0.2, 0.2, 0.15, 0.15])
    >>> after = rng.choice(5, size=2000, p=[0.45, 0.1, 0.05, 0.15, 0.25])   # same mean, more spread
    >>> round(float(before.mean()), 2), round(float(after.mean()), 2)   # both 1.65 in expectation
    (1.62, 1.66)
    >>> det = HistogramChiSquare(n_bins=5, n_baseline=1000, window=200, ert=50_000, seed=0)
    >>> alarms = [i for i, x in enumerate(np.concatenate([before, after])) if det.update(int(x)).drift_detected]
    >>> alarms[0]
    3199
    >>> HistogramChiSquare(n_bins=1)
    Traceback (most recent call last):
    ...
    ValueError: n_bins must be >= 2, got 1
    """

    def __init__(
        self,
        n_bins: int,
        n_baseline: int = 1000,
        window: int = 200,
        alpha: float | None = None,
        ert: float | None = None,
        min_expected: float = 5.0,
        n_bootstrap: int = 2048,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.n_bins = check_int("n_bins", n_bins, 2)
        self.n_baseline = check_int("n_baseline", n_baseline, 50)
        self.window = check_int("window", window, 20)
        if alpha is not None and ert is not None:
            raise ValueError(f"give alpha or ert, not both (alpha={alpha!r}, ert={ert!r})")
        self.ert = None if ert is None else check_float("ert", ert, float(self.window), low_open=True)
        self.alpha = None if alpha is None else check_float("alpha", alpha, 0.0, 1.0, low_open=True, high_open=True)
        if self.ert is not None:
            self.alpha = self.window / self.ert
        self.min_expected = check_float("min_expected", min_expected, 0.0, low_open=True)
        self.n_bootstrap = check_int("n_bootstrap", n_bootstrap, 64)
        self.seed = check_int("seed", seed, 0)
        self.baseline = np.zeros(self.n_bins)
        self.groups: np.ndarray | None = None
        self.null_scale = (1.0, 1.0)
        self._win = np.zeros(self.n_bins)
        self._n_win = 0
        self.tested = False
        self.p_value = float("nan")
        self.statistic = float("nan")
        self.df = float("nan")

    def _params(self) -> dict[str, Any]:
        return {"n_bins": self.n_bins, "n_baseline": self.n_baseline, "window": self.window, "alpha": self.alpha}

    @property
    def baseline_ready(self) -> bool:
        return self.groups is not None

    def update(self, x: int) -> "HistogramChiSquare":
        """Add one observation (a category in ``0 .. n_bins − 1``)."""
        i = int(x)
        if not 0 <= i < self.n_bins:
            raise ValueError(f"x must be a category in [0, {self.n_bins}), got {x!r}")
        self._drift_detected = False
        self.tested = False
        if self.groups is None:
            self.baseline[i] += 1
            if self.baseline.sum() >= self.n_baseline:
                self.fit_counts(self.baseline)
            return self
        self._win[i] += 1
        self._n_win += 1
        if self._n_win >= self.window:
            stat, df = histogram_chi2(self.baseline, self._win, self.groups)
            a, nu = self.null_scale
            self.statistic, self.df = float(stat), float(df)
            self.p_value = float(scaled_chi2_sf(self.statistic, self.df, a, nu))
            self.tested = True
            self._win = np.zeros(self.n_bins)
            self._n_win = 0
            self._drift_detected = self.alpha is not None and self.p_value <= self.alpha
        return self

    def fit(self, samples: Iterable[int]) -> "HistogramChiSquare":
        """Baseline from observed categories."""
        return self.fit_counts(np.bincount(np.asarray(list(samples), dtype=np.int64), minlength=self.n_bins))

    def fit_counts(self, counts: np.ndarray) -> "HistogramChiSquare":
        """Baseline from a histogram of counts."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != (self.n_bins,) or counts.min() < 0 or counts.sum() < 50:
            raise ValueError(f"counts must be {self.n_bins} non-negative counts summing to >= 50, got {counts!r}")
        self.baseline = counts.copy()
        n = int(counts.sum())
        self.groups = merge_plan(counts / n, self.window, n, self.min_expected)
        self.null_scale = cached(
            ("hist-chi2-null", counts, self.window, self.min_expected, self.n_bootstrap, self.seed),
            lambda: _null_scale(counts, self.groups, self.window, self.n_bootstrap, self.seed),
        )
        return self


def _null_scale(counts: np.ndarray, groups: np.ndarray, window: int, n_bootstrap: int,
                seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    n = int(counts.sum())
    p = counts / n
    n_base = 32
    per = max(2, n_bootstrap // n_base)
    base = rng.multinomial(n, p, size=n_base).astype(np.float64)
    win = rng.multinomial(window, p, size=(n_base, per)).astype(np.float64)
    stat, df = histogram_chi2(base[:, None, :], win, groups)
    return scaled_chi2_fit(stat.ravel(), df.ravel())
