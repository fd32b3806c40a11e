"""Test statistics shared by the detectors (vectorised over leading axes).

* :func:`censored_chi2` — two-sample Pearson chi-square of per-cell trials
  (see :mod:`controller.drift.cells`): one 2×2 table (baseline vs window ×
  success vs failure) per cell, summed. For a chain of fixed depth this is
  the chi-square homogeneity test of the accept-length histogram written as
  conditional binomials; steps truncated at other depths contribute fewer
  trials instead of a different histogram. A cell whose smallest expected
  count is under ``min_expected`` is dropped from that test rather than merged
  with its neighbour: merging positions would mix stick probabilities in
  proportions that follow the depth mix, so a batch shift (shallower drafts)
  would read as drift.
* :func:`merge_plan` / :func:`histogram_chi2` — the classic 2×K homogeneity
  test of a histogram, adjacent small bins merged until every expected count
  reaches ``min_expected``.
* :func:`scaled_chi2_fit` / :func:`scaled_chi2_sf` — a Satterthwaite match of
  a bootstrapped null distribution (``a · χ²(ν k)`` for a test made of ``k``
  cells) so p-values stay smooth down to the small levels multiple-testing
  control needs.
"""

from __future__ import annotations

import numpy as np
from scipy import stats as _st


def censored_chi2(base: np.ndarray, win: np.ndarray, min_expected: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Sum of per-cell 2×2 Pearson statistics and the number of cells kept.

    Parameters
    ----------
    base, win
        Bins ``[..., 2 * cells]`` (successes then failures), broadcastable.
    min_expected
        Smallest expected count a cell needs in all four entries of its table.

    Returns
    -------
    stat : ndarray
        Chi-square statistic (``[...]``).
    kept : ndarray of int
        Cells that entered the statistic (its degrees of freedom).

    Examples
    --------
    >>> base = np.array([80.0, 60.0, 20.0, 40.0])   # 2 cells: 80/100, 60/100
    >>> stat, kept = censored_chi2(base, np.array([80.0, 60.0, 20.0, 40.0]))
    >>> float(stat), int(kept)
    (0.0, 2)
    >>> stat, kept = censored_chi2(base, np.array([60.0, 60.0, 40.0, 40.0]))
    >>> round(float(stat), 3), int(kept)
    (9.524, 2)
    """
    base = np.asarray(base, dtype=np.float64)
    win = np.asarray(win, dtype=np.float64)
    c = base.shape[-1] // 2
    a1, b1 = base[..., :c], base[..., c:]
    a2, b2 = win[..., :c], win[..., c:]
    n1, n2 = a1 + b1, a2 + b2
    s, f = a1 + a2, b1 + b2
    n = n1 + n2
    with np.errstate(divide="ignore", invalid="ignore"):
        emin = np.minimum(n1, n2) * np.minimum(s, f) / n
        keep = emin >= min_expected
        cell = n * (a1 * b2 - a2 * b1) ** 2 / (n1 * n2 * s * f)
    stat = np.where(keep, cell, 0.0).sum(axis=-1)
    return stat, keep.sum(axis=-1)


def merge_plan(probs: np.ndarray, window: int, n_baseline: int, min_expected: float = 5.0) -> np.ndarray:
    """Group index per bin: adjacent bins merged until ``min(window, n_baseline) · p ≥ min_expected``.

    A short last group is folded into the one before it.

    >>> merge_plan(np.array([0.5, 0.3, 0.1, 0.05, 0.05]), window=40, n_baseline=1000).tolist()
    [0, 1, 2, 2, 2]
    """
    probs = np.asarray(probs, dtype=np.float64)
    scale = float(min(window, n_baseline))
    groups = np.zeros(probs.size, dtype=np.int64)
    g, acc = 0, 0.0
    for i, p in enumerate(probs):
        groups[i] = g
        acc += p
        if acc * scale >= min_expected and i + 1 < probs.size:
            g, acc = g + 1, 0.0
    if acc * scale < min_expected and g > 0:
        groups[groups == g] = g - 1
    return groups


def histogram_chi2(base: np.ndarray, win: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """2×G Pearson homogeneity statistic of two histograms after merging bins.

    Parameters
    ----------
    base, win
        Counts per bin ``[..., K]`` (broadcastable).
    groups
        Group of each bin (:func:`merge_plan`).

    Returns
    -------
    stat : ndarray
    df : ndarray of int
        Non-empty groups minus one.

    Examples
    --------
    >>> g = np.array([0, 1, 2])
    >>> stat, df = histogram_chi2(np.array([50.0, 30, 20]), np.array([25.0, 15, 10]), g)
    >>> round(float(stat), 6), int(df)
    (0.0, 2)
    """
    base = np.asarray(base, dtype=np.float64)
    win = np.asarray(win, dtype=np.float64)
    n_groups = int(groups.max()) + 1
    onehot = np.zeros((groups.size, n_groups))
    onehot[np.arange(groups.size), groups] = 1.0
    o1 = base @ onehot
    o2 = win @ onehot
    o1, o2 = np.broadcast_arrays(o1, o2)
    n1 = o1.sum(-1, keepdims=True)
    n2 = o2.sum(-1, keepdims=True)
    col = o1 + o2
    tot = n1 + n2
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = n1 * col / tot
        e2 = n2 * col / tot
        terms = np.where(col > 0, (o1 - e1) ** 2 / e1 + (o2 - e2) ** 2 / e2, 0.0)
    stat = terms.sum(-1)
    df = np.maximum((col > 0).sum(-1) - 1, 0)
    return stat, df


def scaled_chi2_fit(null_stats: np.ndarray, null_df: np.ndarray) -> tuple[float, float]:
    """Fit ``stat ≈ a · χ²(ν₁ · df)`` to bootstrapped null statistics (moments).

    Returns ``(a, ν₁)``; the asymptotic theory says ``(1, 1)``. ``a`` is clipped
    to ``[0.5, 5]`` so a degenerate bootstrap cannot switch the test off.

    >>> rng = np.random.default_rng(0)
    >>> a, nu = scaled_chi2_fit(2.0 * rng.chisquare(10, 4000), np.full(4000, 10))
    >>> round(a, 1), round(nu, 1)
    (2.0, 1.0)
    """
    s = np.asarray(null_stats, dtype=np.float64)
    k = np.asarray(null_df, dtype=np.float64)
    ok = k > 0
    if ok.sum() < 10:
        return 1.0, 1.0
    s, k = s[ok], k[ok]
    m = s.sum() / k.sum()  # a · ν₁
    v = np.mean((s - m * k) ** 2 / k)  # 2 a² ν₁
    if not np.isfinite(v) or v <= 0 or m <= 0:
        return 1.0, 1.0
    a = float(np.clip(v / (2.0 * m), 0.5, 5.0))
    return a, float(m / a)


def scaled_chi2_sf(stat: np.ndarray | float, df: np.ndarray | float, a: float, nu1: float) -> np.ndarray | float:
    """Survival function of ``a · χ²(ν₁ · df)`` (1 where ``df == 0``).

    >>> round(float(scaled_chi2_sf(3.84, 1, 1.0, 1.0)), 3)
    0.05
    """
    stat = np.asarray(stat, dtype=np.float64)
    df = np.asarray(df, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        p = np.where(df > 0, _st.chi2.sf(stat / a, np.maximum(df * nu1, 1e-9)), 1.0)
    return float(p) if p.ndim == 0 else p
