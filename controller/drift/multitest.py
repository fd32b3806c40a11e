"""Multiple-testing control across strata: Benjamini–Hochberg and Holm.

The monitor tests every stratum (drafter version × context bucket × domain)
on its own window; with many strata some would reject by chance. Each round
of fresh p-values goes through one of these procedures before anything is
raised. Under the global null both reject anything with probability at most
``level`` (BH through Simes' inequality for independent or positively
dependent tests), which is what lets the monitor turn a false-alarm budget per
request (ERT) into a per-round level.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from controller.drift.base import check_choice, check_float


def benjamini_hochberg(pvalues: Sequence[float], level: float) -> tuple[np.ndarray, np.ndarray]:
    """Benjamini–Hochberg step-up: which hypotheses to reject, and adjusted p-values.

    Parameters
    ----------
    pvalues
        One p-value per test.
    level
        False discovery rate to control, in (0, 1).

    Returns
    -------
    reject : ndarray of bool
        ``True`` where the hypothesis is rejected.
    adjusted : ndarray of float
        BH-adjusted p-values (reject iff ``adjusted <= level``).

    Examples
    --------
    >>> reject, adj = benjamini_hochberg([0.001, 0.008, 0.039, 0.041, 0.6], level=0.05)
    >>> reject.tolist()
    [True, True, False, False, False]
    >>> [round(float(a), 4) for a in adj]
    [0.005, 0.02, 0.0513, 0.0513, 0.6]
    """
    level = check_float("level", level, 0.0, 1.0, low_open=True, high_open=True)
    p = _as_pvalues(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    ranked = p[order] * m / np.arange(1, m + 1)
    return _unsort(np.minimum.accumulate(ranked[::-1])[::-1], order, level)


def holm(pvalues: Sequence[float], level: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm step-down: family-wise error control, no dependence assumption.

    Parameters
    ----------
    pvalues
        One p-value per test.
    level
        Family-wise error rate to control, in (0, 1).

    Returns
    -------
    reject : ndarray of bool
    adjusted : ndarray of float
        Holm-adjusted p-values (reject iff ``adjusted <= level``).

    Examples
    --------
    >>> reject, adj = holm([0.001, 0.008, 0.039, 0.041, 0.6], level=0.05)
    >>> reject.tolist()
    [True, True, False, False, False]
    >>> [round(float(a), 3) for a in adj]
    [0.005, 0.032, 0.117, 0.117, 0.6]
    """
    level = check_float("level", level, 0.0, 1.0, low_open=True, high_open=True)
    p = _as_pvalues(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    return _unsort(np.maximum.accumulate(p[order] * (m - np.arange(m))), order, level)


def _unsort(adjusted_sorted: np.ndarray, order: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Adjusted p-values (capped at 1) back in input order, and the rejections at ``level``."""
    adjusted = np.empty(order.size)
    adjusted[order] = np.minimum(adjusted_sorted, 1.0)
    return adjusted <= level, adjusted


def adjust(pvalues: Sequence[float], level: float, method: str = "bh") -> tuple[np.ndarray, np.ndarray]:
    """Dispatch to :func:`benjamini_hochberg` (``"bh"``) or :func:`holm` (``"holm"``).

    >>> adjust([0.01, 0.02], 0.05, method="holm")[0].tolist()
    [True, True]
    """
    method = check_choice("method", method, ("bh", "holm"))
    return benjamini_hochberg(pvalues, level) if method == "bh" else holm(pvalues, level)


def _as_pvalues(pvalues: Sequence[float]) -> np.ndarray:
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    if p.size and (np.isnan(p).any() or p.min() < 0.0 or p.max() > 1.0):
        bad = p[np.isnan(p) | (p < 0) | (p > 1)][0]
        raise ValueError(f"pvalues must lie in [0, 1], got {bad!r}")
    return p
