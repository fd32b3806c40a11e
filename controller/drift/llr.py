"""Likelihood-ratio scores of "acceptance fell by ``drop``", and their calibration.

The monitor's CUSUMs (:mod:`controller.drift.monitor`) sum, request-step by
request-step, the log-likelihood ratio of the step's cells under "every stick
probability ``(1 − drop)`` times its baseline value" against the baseline of
the step's own stratum. This module holds the arithmetic of that score and the
two bootstraps built on it, kept apart from the strata that use them so they
can be read (and tested) as plain functions of arrays:

* :func:`llr_weights` — the per-cell weights of the score, from a baseline;
* :func:`precise_enough` — is a stratum's baseline precise enough for the score
  to drift down without drift (else it may not join the CUSUM for ``drop``);
* :func:`calibrate_llr_cusum` — the threshold of the stratified CUSUM for a
  false-alarm budget, by a double bootstrap over the strata's baselines.
"""

from __future__ import annotations

import math

import numpy as np

from controller.drift.calibration import cusum_threshold, path_laws


def llr_weights(bins: np.ndarray, drop: float, min_trials: float = 5.0) -> np.ndarray:
    """Per-bin log-likelihood-ratio weights of "every stick × (1 − drop)" vs the baseline sticks.

    ``bins`` are summed baseline trials ``[..., 2 * cells]``; the returned
    weights have the same shape: a success in a cell scores ``ln(1 − drop)``, a
    failure ``ln((1 − (1 − drop)·s) / (1 − s))``. Cells with fewer than
    ``min_trials`` baseline trials score 0 (nothing known about them).

    >>> w = llr_weights(np.array([80.0, 20.0]), drop=0.1)   # one cell, s ≈ 0.8
    >>> [round(float(v), 3) for v in w]
    [-0.105, 0.331]
    """
    c = bins.shape[-1] // 2
    succ, fail = bins[..., :c], bins[..., c:]
    n = succ + fail
    s = np.clip((succ + 0.5) / (n + 1.0), 0.02, 0.98)
    w_s = np.full_like(s, math.log1p(-drop))
    w_f = np.log((1.0 - (1.0 - drop) * s) / (1.0 - s))
    known = n >= min_trials
    return np.concatenate([np.where(known, w_s, 0.0), np.where(known, w_f, 0.0)], axis=-1)


def precise_enough(matrix: np.ndarray, freq: np.ndarray, drop: float, z: float, seed: int, n_boot: int = 64) -> bool:
    """Does the LLR for ``drop`` drift down under the baseline's own sampling error?

    ``matrix`` is the baseline's outcome keys as cell bins (``[keys, bins]``,
    :func:`~controller.drift.cells.keys_matrix`) and ``freq`` their counts.
    Over ``n_boot`` multinomial replicates of the baseline, the weights are
    refitted and the mean increment under the empirical distribution is
    taken; the baseline is precise enough when their mean plus ``z``
    standard deviations is still negative (see
    :meth:`~controller.drift.strata.Stratum.fit_weights`): the smaller the
    drop, the larger the baseline this needs.

    >>> from controller.drift.cells import chain_key, keys_matrix
    >>> matrix = keys_matrix([chain_key(t, 3) for t in range(4)], 3, 1)
    >>> shares = np.array([0.2, 0.16, 0.128, 0.512])      # sticks 0.8 at every depth
    >>> [precise_enough(matrix, np.round(shares * n), drop=0.1, z=2.5, seed=0) for n in (40, 400)]
    [False, True]
    >>> precise_enough(matrix, np.round(shares * 400), drop=0.035, z=2.5, seed=0)
    False
    """
    rng = np.random.default_rng(seed)
    n = int(freq.sum())
    p = freq / n
    boot = rng.multinomial(n, p, size=n_boot).astype(np.float64) @ matrix
    drift = (llr_weights(boot, drop) @ matrix.T) @ p  # mean increment per step, one per replicate
    return bool(drift.mean() + z * drift.std() < 0.0)


def calibrate_llr_cusum(parts: list[tuple[np.ndarray, np.ndarray]], shares: np.ndarray, drop: float, ert: float,
                        paths: int, horizon: int, seed: int, idle: float = 0.0):
    """Double bootstrap of the stratified LLR CUSUM: per path, each stratum's baseline is
    resampled (its own estimation error, hence its own weights) and the stream
    is drawn from the empirical baselines in the traffic shares; a share
    ``idle`` of the steps (strata not taking part) adds nothing.

    ``parts`` holds one ``(keys_matrix, counts)`` pair per stratum taking part
    and ``shares`` their traffic shares (summing to 1). Returns the
    :class:`~controller.drift.calibration.CusumCalibration` of
    :func:`~controller.drift.calibration.cusum_threshold` for an expected run
    time of ``ert`` request-steps without drift.
    """
    rng = np.random.default_rng(seed)
    probs = np.concatenate([share * f / f.sum() for (m, f), share in zip(parts, shares)] + [np.array([0.0])])
    probs *= (1.0 - idle) / probs.sum()
    probs[-1] = idle
    probs /= probs.sum()
    replicates = max(paths, 1024)  # baseline replicates: the first ``paths`` are also simulated
    scores = np.zeros((replicates, probs.size))
    off = 0
    for m, f in parts:
        boot = rng.multinomial(int(f.sum()), f / f.sum(), size=replicates).astype(np.float64) @ m  # [reps, bins]
        scores[:, off:off + f.size] = llr_weights(boot, drop) @ m.T
        off += f.size
    laws = path_laws(scores, probs)
    cdf = np.cumsum(probs)
    idx = np.minimum(np.searchsorted(cdf, rng.random((paths, horizon)) * cdf[-1], side="right"), probs.size - 1)
    inc = np.take_along_axis(scores[:paths], idx, axis=1)
    return cusum_threshold(inc, ert, path_laws=tuple(a[:paths] for a in laws), solve_laws=laws)
