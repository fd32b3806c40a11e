"""Page's CUSUM with its threshold calibrated to an expected run time."""

from __future__ import annotations

from typing import Any

import numpy as np

from controller.drift.base import DriftDetector, check_choice, check_float, check_int
from controller.drift.calibration import CusumCalibration, bootstrap_indices, cached, cusum_threshold, path_laws


class CUSUM(DriftDetector):
    """Cumulative sum change detector on a scalar stream (Page 1954).

    ``S⁻ ← max(0, S⁻ + (target − x) − slack)`` detects a fall of the mean,
    ``S⁺ ← max(0, S⁺ + (x − target) − slack)`` a rise; an alarm is raised when
    the watched side passes ``threshold``, and the sums restart on the next
    update. ``slack`` is half the shift worth detecting (in units of ``x``).
    Feeding log-likelihood-ratio increments with ``direction="up"``,
    ``target=0`` and ``slack=0`` gives the optimal (Lorden) CUSUM for that
    alternative — the monitor does this.

    When ``target`` or ``threshold`` is not given, the first ``n_baseline``
    observations are the baseline: ``target`` is their mean, and
    ``threshold`` is calibrated so that without drift the expected number of
    observations between false alarms is ``ert`` (bootstrap paths from the
    baseline, each with its own resampled target; see
    :mod:`controller.drift.calibration`). With ``direction="both"`` each side
    gets ``2 · ert`` so their alarms together keep the budget.

    Parameters
    ----------
    direction
        ``"down"``, ``"up"`` or ``"both"``.
    target
        In-control mean; ``None`` learns it from the baseline.
    slack
        Allowance per observation (>= 0).
    threshold
        Alarm threshold ``h`` (> 0); ``None`` calibrates it for ``ert``.
    ert
        Expected observations between false alarms without drift (> 1);
        needed when ``threshold`` is ``None``.
    n_baseline
        Baseline observations (>= 20) when something must be learned.
    n_paths, horizon
        Bootstrap paths and their length for the calibration.
    block
        Block length of the bootstrap (1 = iid observations).
    seed
        Seed of the bootstrap.

    Attributes
    ----------
    statistic : float
        Current value of the larger watched sum.
    calibration : CusumCalibration or None
        Diagnostics of the calibration (per side for ``"both"``: the down side).

    Examples
    --------
    >>> rng = np.random.default_rng(7)
    >>> stream = np.concatenate([rng.normal(0.0, 1.0, 3000), rng.normal(-1.0, 1.0, 500)])
    >>> cusum = CUSUM(direction="down", slack=0.5, ert=20_000, n_baseline=1000, seed=0)
    >>> alarms = [i for i, x in enumerate(stream) if cusum.update(x).drift_detected]
    >>> alarms[0] >= 3000, alarms[0] - 3000 < 40
    (True, True)
    >>> round(cusum.target, 2), round(cusum.threshold, 1)
    (-0.07, 7.0)
    >>> CUSUM(direction="sideways", threshold=5.0, target=0.0)
    Traceback (most recent call last):
    ...
    ValueError: direction must be one of 'down', 'up', 'both', got 'sideways'
    """

    def __init__(
        self,
        direction: str = "down",
        target: float | None = None,
        slack: float = 0.0,
        threshold: float | None = None,
        ert: float | None = None,
        n_baseline: int = 500,
        n_paths: int = 256,
        horizon: int = 2048,
        block: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.direction = check_choice("direction", direction, ("down", "up", "both"))
        self.target = None if target is None else check_float("target", target)
        self.slack = check_float("slack", slack, 0.0)
        self.threshold = None if threshold is None else check_float("threshold", threshold, 0.0, low_open=True)
        self.ert = None if ert is None else check_float("ert", ert, 1.0, low_open=True)
        if self.threshold is None and self.ert is None:
            raise ValueError("threshold is None and ert is None: give a threshold or an ert to calibrate one")
        self.n_baseline = check_int("n_baseline", n_baseline, 20)
        self.n_paths = check_int("n_paths", n_paths, 16)
        self.horizon = check_int("horizon", horizon, 100)
        self.block = check_int("block", block, 1)
        self.seed = check_int("seed", seed, 0)
        self.calibration: CusumCalibration | None = None
        self._threshold_up: float | None = self.threshold
        self._baseline: list[float] = []
        self._ready = self.target is not None and self.threshold is not None
        self.s_down = 0.0
        self.s_up = 0.0
        self.n = 0

    def _params(self) -> dict[str, Any]:
        return {"direction": self.direction, "target": self.target, "slack": self.slack,
                "threshold": self.threshold, "ert": self.ert}

    @property
    def ready(self) -> bool:
        """Whether target and threshold are known (baseline complete)."""
        return self._ready

    @property
    def statistic(self) -> float:
        if self.direction == "down":
            return self.s_down
        if self.direction == "up":
            return self.s_up
        return max(self.s_down, self.s_up)

    def reset(self) -> None:
        """Restart the sums (keeps target and threshold)."""
        self.s_down = self.s_up = 0.0

    def update(self, x: float) -> "CUSUM":
        """Add one observation; ``drift_detected`` tells whether it raised an alarm."""
        if self._drift_detected:
            self.reset()
            self._drift_detected = False
        self.n += 1
        if not self._ready:
            self._baseline.append(float(x))
            if len(self._baseline) >= self.n_baseline:
                self.fit(np.asarray(self._baseline))
                self._baseline = []
            return self
        x = float(x)
        alarm = False
        if self.direction != "up":
            self.s_down = max(0.0, self.s_down + (self.target - x) - self.slack)
            alarm = self.s_down > self.threshold
        if self.direction != "down":
            self.s_up = max(0.0, self.s_up + (x - self.target) - self.slack)
            alarm = alarm or self.s_up > self._threshold_up
        self._drift_detected = alarm
        return self

    def fit(self, baseline: np.ndarray) -> "CUSUM":
        """Learn the target (if not given) and calibrate the threshold (if not given) from ``baseline``."""
        baseline = np.asarray(baseline, dtype=np.float64).ravel()
        if baseline.size < 20:
            raise ValueError(f"baseline must hold >= 20 observations, got {baseline.size}")
        learn_target = self.target is None
        if learn_target:
            self.target = float(baseline.mean())
        if self.threshold is None or self._threshold_up is None:
            side_ert = self.ert * (2.0 if self.direction == "both" else 1.0)
            if self.direction != "up":
                self.calibration = self._calibrate(baseline, -1.0, side_ert, learn_target)
                self.threshold = self.calibration.threshold
            if self.direction != "down":
                cal = self._calibrate(baseline, 1.0, side_ert, learn_target)
                self._threshold_up = cal.threshold
                if self.direction == "up":
                    self.calibration, self.threshold = cal, cal.threshold
        self._ready = True
        return self

    def _calibrate(self, baseline: np.ndarray, sign: float, ert: float, learn_target: bool) -> CusumCalibration:
        def compute() -> CusumCalibration:
            rng = np.random.default_rng(self.seed)
            idx = bootstrap_indices(rng, baseline.size, (self.n_paths, self.horizon), self.block)
            if learn_target:  # each path carries its own estimation error of the target
                targets = baseline[rng.integers(0, baseline.size, (self.n_paths, baseline.size))].mean(axis=1)
            else:
                targets = np.full(self.n_paths, self.target)
            inc = sign * (baseline[idx] - targets[:, None]) - self.slack
            values = baseline[:: -(-baseline.size // 2048)]  # each path's increment law, subsampled
            laws = path_laws(sign * (values[None, :] - targets[:, None]) - self.slack)
            return cusum_threshold(inc, ert, path_laws=laws)

        return cached(("cusum", baseline, sign, ert, learn_target, self.target, self.slack, self.n_paths,
                       self.horizon, self.block, self.seed), compute)
