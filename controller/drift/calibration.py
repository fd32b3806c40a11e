"""Thresholds calibrated to a false-alarm budget by bootstrap simulation.

The budget is an *expected run time* (ERT): the expected number of
observations (request-steps) between false alarms while nothing drifts —
alibi-detect's ``ert``. Calibration simulates the detector on streams
resampled from the baseline and picks the threshold whose simulated run time
matches. It has to be cheap because the monitor calibrates once per stratum
when the stratum's baseline completes:

* everything is vectorised numpy over ``paths × steps``;
* a CUSUM's run length is read off the cumulative-sum identity
  ``S_t = C_t − min(0, min_{s≤t} C_s)`` instead of a Python loop;
* long ERTs are reached by extrapolation: the CUSUM's log run length is
  linear in its threshold (``ARL ≈ A·e^{θh}``), with ``θ`` the
  Cramér–Lundberg root of the increments (``θ = 1`` for likelihood-ratio
  increments) and ``A`` fitted where the simulation sees enough alarms;
* results are cached by a digest of their inputs.

The bootstrap is "double" where a detector compares against an estimated
baseline: each simulated path draws its own baseline from the empirical one
(and so its own estimation error) as well as its own stream.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from controller.drift.base import check_float, check_int

_CACHE: OrderedDict[str, Any] = OrderedDict()
_CACHE_SIZE = 512


def cached(key_parts: tuple, compute: Callable[[], Any]) -> Any:
    """Memoise ``compute()`` under a digest of ``key_parts`` (arrays hashed by content).

    >>> calls = []
    >>> f = lambda: calls.append(1) or 42
    >>> cached(("doc", np.arange(3)), f), cached(("doc", np.arange(3)), f), len(calls)
    (42, 42, 1)
    """
    h = hashlib.blake2b(digest_size=16)
    for part in key_parts:
        if isinstance(part, np.ndarray):
            h.update(str(part.dtype).encode() + str(part.shape).encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    key = h.hexdigest()
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    value = compute()
    _CACHE[key] = value
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


@dataclass(frozen=True)
class CusumCalibration:
    """Result of :func:`cusum_threshold`.

    Attributes
    ----------
    threshold : float
        ``h`` for the requested ERT.
    ert : float
        The ERT asked for.
    slope, intercept : float
        Fit ``ln ARL ≈ intercept + slope · h`` over the simulated points.
    extrapolated : bool
        Whether the ERT lay beyond the simulated range.
    points : tuple
        ``(h, ARL, paths that fired)`` per simulated threshold.
    """

    threshold: float
    ert: float
    slope: float
    intercept: float
    extrapolated: bool
    points: tuple[tuple[float, float, int], ...]

    def arl(self, h: float) -> float:
        """Fitted run length at threshold ``h``."""
        return float(np.exp(self.intercept + self.slope * h))


def cusum_paths_stats(increments: np.ndarray) -> np.ndarray:
    """Running maximum of the one-sided CUSUM ``S_t = max(0, S_{t−1} + x_t)`` per path.

    Parameters
    ----------
    increments
        ``[paths, steps]`` CUSUM increments.

    Returns
    -------
    ndarray
        ``[paths, steps]``: ``max_{s≤t} S_s`` (non-decreasing along each path).

    Examples
    --------
    >>> cusum_paths_stats(np.array([[1.0, -3.0, 2.0, 0.5]])).tolist()
    [[1.0, 1.0, 2.0, 2.5]]
    """
    c = np.cumsum(increments, axis=1)
    s = c - np.minimum(np.minimum.accumulate(c, axis=1), 0.0)
    return np.maximum.accumulate(s, axis=1)


def cusum_threshold(increments: np.ndarray, ert: float, min_fired: int = 8, grid: int = 24,
                    path_laws: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                    solve_laws: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> CusumCalibration:
    """Threshold ``h`` whose expected run length without drift is ``ert``.

    Each path is run until its first alarm (censored at its end). For a grid
    of thresholds the run length is estimated as time at risk over alarms
    (the exponential MLE). ``ln ARL`` is linear in ``h`` in the tail: the
    slope is the Cramér–Lundberg exponent of the increments
    (:func:`lundberg_exponent`; fitted when it has no root), the constant is
    fitted on the points at or above a quarter of the target, and the line is
    solved for ``ert`` — inside the simulated range or beyond it.

    When the paths do not share one distribution (a double bootstrap: each
    path has its own baseline estimate, hence its own drift), give each
    path's law in ``path_laws`` (:func:`path_laws`). The alarm rate is then
    the average of the paths' rates, each from Siegmund's approximation
    ``ARL_b = (e^{θ_b h'} − θ_b h' − 1) / (θ_b |μ_b|)`` with ``h' = h + c``
    (``c``, the overshoot, fitted on the simulated points): the paths whose
    baseline came out worst dominate it at high thresholds, which one pooled
    exponent would miss. This calibrates the false-alarm rate averaged over
    the baseline's estimation error.

    Parameters
    ----------
    increments
        ``[paths, steps]`` increments simulated without drift.
    ert
        Expected observations between false alarms wanted (> 1).
    min_fired
        Fewest paths that must alarm for a grid point to be used.
    grid
        Number of thresholds simulated.
    path_laws
        ``(θ, μ, σ²)``, each ``[paths]``: Cramér–Lundberg exponent, mean and
        variance of each path's increment law.
    solve_laws
        Laws of more bootstrap replicates (no simulation needed) over which
        the rate is averaged when solving for ``h``; ``path_laws`` by default.
        The overshoot ``c`` is fitted on the simulated paths either way.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(-0.5, 1.0, size=(64, 4000))   # LLR of N(0,1) vs N(1,1) under N(0,1)
    >>> cal = cusum_threshold(x, ert=1e4)
    >>> 6.5 < cal.threshold < 8.5, 0.7 < cal.slope < 1.3   # Siegmund: h ≈ 7.4, slope 1
    (True, True)
    """
    ert = check_float("ert", ert, 1.0, low_open=True)
    min_fired = check_int("min_fired", min_fired, 1)
    x = np.asarray(increments, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2 * min_fired:
        raise ValueError(f"increments must be [paths >= {2 * min_fired}, steps], got shape {x.shape!r}")
    paths, steps = x.shape
    runmax = cusum_paths_stats(x)
    final = runmax[:, -1]
    top = 1.0 - min_fired / paths
    hs = np.unique(np.quantile(final, np.linspace(min(0.02, top), top, grid)))
    hs = hs[hs > 0]
    if hs.size < 2:
        raise ValueError("increments never drift upwards: no threshold can be calibrated (is the score centred?)")
    pts = []
    for h in hs:
        first = (runmax <= h).sum(axis=1)  # steps before the first alarm
        fired = first < steps
        at_risk = np.where(fired, first + 1, steps).sum()
        n_fired = int(fired.sum())
        if n_fired >= min_fired:
            pts.append((float(h), float(at_risk / n_fired), n_fired))
    if len(pts) < 2:
        raise ValueError("too few alarms in the simulation to calibrate; simulate longer paths")
    h_arr = np.array([p[0] for p in pts])
    log_arl = np.log([p[1] for p in pts])
    weight = np.array([p[2] for p in pts], dtype=np.float64)
    target = np.log(ert)
    # Fit around and above the target (the small-h regime is not exponential yet): the
    # points whose run length is at least a quarter of min(ert, longest simulated).
    sel = log_arl >= min(target, log_arl.max()) - np.log(4.0)
    if sel.sum() < 2:
        sel = np.argsort(log_arl)[-2:]
    extrapolated = bool(target > log_arl.max() or target < log_arl.min())
    if path_laws is not None:
        theta, mu, var = (np.asarray(a, dtype=np.float64).ravel() for a in path_laws)
        if not theta.size == mu.size == var.size == paths:
            raise ValueError(f"path_laws must hold one law per path ({paths}), got {theta.size}")
        c_grid = np.linspace(0.0, 4.0, 41)
        fit_h = h_arr[sel]
        errs = [np.average((log_arl[sel] + np.log(_mean_rate(fit_h + c, theta, mu, var))) ** 2, weights=weight[sel])
                for c in c_grid]
        c = float(c_grid[int(np.argmin(errs))])
        if solve_laws is not None:
            theta, mu, var = (np.asarray(a, dtype=np.float64).ravel() for a in solve_laws)
        lo, hi = 0.0, 1.0
        while _mean_rate(np.array([hi + c]), theta, mu, var)[0] > 1.0 / ert and hi < 1e4:
            hi *= 2.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _mean_rate(np.array([mid + c]), theta, mu, var)[0] > 1.0 / ert else (lo, mid)
        rate = _mean_rate(np.array([hi + c, hi + c + 0.01]), theta, mu, var)
        slope = float((np.log(rate[0]) - np.log(rate[1])) / 0.01)
        return CusumCalibration(hi, ert, slope, -float(np.log(rate[0])) - slope * hi, extrapolated, tuple(pts))
    slope = lundberg_exponent(x)
    if slope is None:
        slope, intercept = np.polyfit(h_arr[sel], log_arl[sel], 1, w=np.sqrt(weight[sel]))
        slope = float(max(slope, 1e-3))
    else:  # the tail's exponent is known exactly; only the constant is estimated
        intercept = float(np.average(log_arl[sel] - slope * h_arr[sel], weights=weight[sel]))
    h = float((target - intercept) / slope)
    return CusumCalibration(max(h, 0.0), ert, slope, float(intercept), extrapolated, tuple(pts))


def lundberg_exponent(increments: np.ndarray) -> float | None:
    """Root ``θ > 0`` of ``E[e^{θX}] = 1`` (Cramér–Lundberg), ``None`` if there is none.

    A CUSUM with increments ``X`` (negative mean) crosses a high threshold
    ``h`` with probability ``∝ e^{−θh}`` per excursion, so its run length
    grows as ``e^{θh}``; for log-likelihood-ratio increments ``θ = 1``.

    >>> x = np.random.default_rng(0).normal(-0.5, 1.0, 100_000)   # θ = 2·0.5/1² = 1
    >>> round(lundberg_exponent(x), 2)
    1.0
    """
    x = np.asarray(increments, dtype=np.float64).ravel()
    if x.size > 131072:  # the root only needs the distribution: a strided subsample is plenty
        x = x[:: -(-x.size // 131072)]
    if x.size == 0 or x.mean() >= 0 or x.max() <= 0:
        return None
    # g(θ) = log E[e^{θX}] is convex with g(0) = 0, g'(0) < 0: bracket the positive root.
    top = float(x.max())

    def g(theta: float) -> float:
        z = theta * x
        m = z.max()
        return float(m + np.log(np.mean(np.exp(z - m))))

    hi = 1.0
    while g(hi) < 0:
        hi *= 2.0
        if hi * top > 700:
            return None
    lo = 0.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if g(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _mean_rate(h: np.ndarray, theta: np.ndarray, mu: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Mean over paths of 1 / ARL_b(h) (Siegmund; Brownian limits where θ_b is 0)."""
    h = np.asarray(h, dtype=np.float64)[:, None]
    th = theta[None, :]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x = np.minimum(th * h, 700.0)
        down = (np.expm1(x) - x) / (th * np.abs(mu)[None, :])
        flat = h * h / np.maximum(var[None, :] + 2.0 * np.maximum(mu, 0.0)[None, :] * h, 1e-300)
        arl = np.where(np.isinf(th), np.inf, np.where(th > 0, down, flat))
    return np.mean(1.0 / np.maximum(arl, 1.0), axis=1)


def path_laws(values: np.ndarray, probs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(θ, μ, σ²)`` per row of ``values`` (see :func:`lundberg_exponents`), for ``cusum_threshold``."""
    v = np.asarray(values, dtype=np.float64)
    p = np.full(v.shape[1], 1.0 / v.shape[1]) if probs is None else np.asarray(probs, dtype=np.float64)
    mu = v @ p
    var = (v * v) @ p - mu * mu
    return lundberg_exponents(v, p), mu, np.maximum(var, 0.0)


def lundberg_exponents(values: np.ndarray, probs: np.ndarray | None = None) -> np.ndarray:
    """Per-row Cramér–Lundberg exponents: root ``θ_b > 0`` of ``Σ_u p_u e^{θ v_{b,u}} = 1``.

    Row ``b`` of ``values`` holds the increments a path can take (with
    probabilities ``probs``, uniform when ``None``). A row that does not drift
    down gets 0 (its CUSUM alarms in linear time), one that never rises ``inf``.

    >>> v = np.array([[-1.0, 0.5], [-1.0, 1.0], [-1.0, -0.5]])
    >>> lundberg_exponents(v, np.array([0.5, 0.5])).round(3).tolist()
    [0.962, 0.0, inf]
    """
    v = np.asarray(values, dtype=np.float64)
    p = np.full(v.shape[1], 1.0 / v.shape[1]) if probs is None else np.asarray(probs, dtype=np.float64)
    logp = np.log(np.maximum(p, 1e-300))
    out = np.zeros(v.shape[0])
    mean = v @ p
    top = v.max(axis=1)
    down = (mean < 0) & (top > 0)
    out[top <= 0] = np.inf
    if not down.any():
        return out
    vd = v[down]

    def g(theta: np.ndarray) -> np.ndarray:  # log Σ p e^{θ v}, per row
        z = theta[:, None] * vd + logp
        m = z.max(axis=1, keepdims=True)
        return (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]

    lo = np.zeros(vd.shape[0])
    hi = np.ones(vd.shape[0])
    for _ in range(64):
        grow = g(hi) < 0
        if not grow.any():
            break
        hi = np.where(grow, hi * 2.0, hi)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        below = g(mid) < 0
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    out[down] = 0.5 * (lo + hi)
    return out


def bootstrap_indices(rng: np.random.Generator, n_source: int, shape: tuple[int, ...], block: int = 1) -> np.ndarray:
    """Indices into a baseline of ``n_source`` samples: iid (``block=1``) or moving blocks.

    A moving-block bootstrap (blocks of consecutive baseline samples) keeps
    short-range dependence, e.g. the steps of one request interleaved in a
    batch.

    >>> idx = bootstrap_indices(np.random.default_rng(0), 10, (2, 6), block=3)
    >>> idx.shape, bool(((idx[:, 1] - idx[:, 0]) == 1).all())
    ((2, 6), True)
    """
    n_source = check_int("n_source", n_source, 1)
    block = check_int("block", block, 1)
    if block == 1 or n_source <= block:
        return rng.integers(0, n_source, size=shape)
    *lead, steps = shape
    n_blocks = -(-steps // block)
    starts = rng.integers(0, n_source - block + 1, size=tuple(lead) + (n_blocks,))
    idx = (starts[..., :, None] + np.arange(block)).reshape(tuple(lead) + (n_blocks * block,))
    return idx[..., :steps]
