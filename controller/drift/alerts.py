"""What the drift monitor raises: alerts with a recommended action.

An alert is about one stratum (drafter kind+version × context bucket ×
domain tag, or the version's traffic beyond its trained context length) and
stays open until it resolves — the stratum matches its baseline again for a
while, or a new drafter version replaces the one it is about — so a
persisting drift is one alert, not a storm. Its fields are the ones a
``DriftAlert`` message, a JSON log line or a webhook needs; ``to_dict`` /
``from_dict`` carry it through JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Action(str, Enum):
    """What to do about a drift."""

    RETRAIN_HEADS = "RETRAIN_HEADS"  # the content moved: retrain the drafter on current traffic
    EXTEND_TRAINING_CONTEXT = "EXTEND_TRAINING_CONTEXT"  # traffic past the drafter's trained context length
    INVESTIGATE = "INVESTIGATE"  # the distribution changed without a loss (shape or a rise): look first


class Severity(str, Enum):
    INFO = "INFO"
    WARNING = "WARNING"
    CRITICAL = "CRITICAL"


class Status(str, Enum):
    OPEN = "OPEN"
    RESOLVED = "RESOLVED"


@dataclass
class DriftAlert:
    """One finding about one stratum.

    Attributes
    ----------
    id : str
        Stable identifier (``drift-000001``).
    drafter_kind, drafter_version : str
        The drafter the stratum belongs to.
    stratum : str
        Human label, e.g. ``ctx[1024,2048)`` or ``ctx[1024,2048)/code``.
    context_len_min, context_len_max : int
        Bucket bounds in tokens (``context_len_max`` 0 = open-ended).
    domain : str
        Content tag of the stratum ("" when workers send none).
    detector : str
        ``"cusum"`` (stratified likelihood-ratio CUSUM), ``"chi2"`` (window
        chi-square after multiple-testing control) or ``"context_share"``.
    statistic : float
        The detector's statistic (CUSUM nats, chi-square, or a share).
    p_value : float or None
        Calibrated p-value of the window (chi-square), else ``None``.
    p_adjusted : float or None
        Benjamini–Hochberg / Holm adjusted p-value across the round's strata.
    score : float
        Statistic over its alarm threshold (> 1 when raised).
    baseline_hist, current_hist : list of int
        Accepted-length histograms (``τ = 0 .. max_depth``) of the baseline
        and of the recent window.
    baseline_alpha, current_alpha : list of float
        Rank-1 acceptance per draft position, baseline vs recent.
    expected_tau_change : float
        Relative change of the expected accepted length at the reference
        depth (``-0.1`` = 10 % fewer tokens accepted per step).
    first_seen : float
        When the change is estimated to have started (seconds, the
        caller's clock).
    opened_at : float
        When the alert was raised.
    severity : Severity
    action : Action
        ``RETRAIN_HEADS``, ``EXTEND_TRAINING_CONTEXT`` or ``INVESTIGATE``.
    message : str
    status : Status
    resolved_at : float or None
    resolution : str
        Why it resolved (``"matches baseline"``, ``"superseded by …"``).
    n_baseline, n_current : int
        Request-steps behind the two histograms.
    extra : dict
        Detector details (thresholds, the round's level, …).
    acked_at : float or None
        When a person or a pipeline acknowledged the alert (it stays open
        until its stratum resolves).
    acked_by : str
        Who acknowledged it (free text).
    """

    id: str
    drafter_kind: str
    drafter_version: str
    stratum: str
    context_len_min: int
    context_len_max: int
    domain: str
    detector: str
    statistic: float
    p_value: float | None
    p_adjusted: float | None
    score: float
    baseline_hist: list[int]
    current_hist: list[int]
    baseline_alpha: list[float]
    current_alpha: list[float]
    expected_tau_change: float
    first_seen: float
    opened_at: float
    severity: Severity
    action: Action
    message: str = ""
    status: Status = Status.OPEN
    resolved_at: float | None = None
    resolution: str = ""
    n_baseline: int = 0
    n_current: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    acked_at: float | None = None
    acked_by: str = ""

    @property
    def is_open(self) -> bool:
        return self.status is Status.OPEN

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (enums as their names, non-finite floats as ``None``).

        >>> a = DriftAlert("drift-000001", "eagle", "v1", "ctx[0,1024)", 0, 1024, "", "cusum", 14.2, None, None,
        ...                1.1, [1, 2], [2, 1], [0.8], [0.7], -0.12, 10.0, 12.0, Severity.WARNING, Action.RETRAIN_HEADS)
        >>> d = a.to_dict(); d["action"], d["severity"], d["status"]
        ('RETRAIN_HEADS', 'WARNING', 'OPEN')
        >>> DriftAlert.from_dict(d) == a
        True
        """
        d = asdict(self)
        for k in ("severity", "action", "status"):
            d[k] = d[k].value
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DriftAlert":
        d = dict(d)
        d["severity"] = Severity(d["severity"])
        d["action"] = Action(d["action"])
        d["status"] = Status(d.get("status", "OPEN"))
        return cls(**d)
