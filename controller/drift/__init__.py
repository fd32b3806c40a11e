"""Drift detection on acceptance (design.md §5, issue 5).

Detectors follow river's contract (``update(x) -> self``, ``drift_detected``)
and calibrate their thresholds to an expected run time without drift (ERT)
by bootstrap from their baseline:

* :class:`CUSUM` — Page's CUSUM on a scalar stream;
* :class:`AcceptLengthChiSquare` — chi-square test of accept-length
  distributions, censoring-aware (steps drafted at other depths count as
  fewer trials);
* :class:`HistogramChiSquare` — chi-square test of a categorical histogram,
  small bins merged;
* :mod:`controller.drift.multitest` — Benjamini–Hochberg and Holm.

:class:`AcceptanceDriftMonitor` runs them per drafter version × context
bucket (× domain) and raises :class:`DriftAlert` objects with a recommended
:class:`Action`. Wire it with ``controller.on_step.append(monitor.observe_step)``.
"""

from controller.drift.accept_chi2 import AcceptLengthChiSquare
from controller.drift.alerts import Action, DriftAlert, Severity, Status
from controller.drift.base import DriftDetector
from controller.drift.cusum import CUSUM
from controller.drift.histogram_chi2 import HistogramChiSquare
from controller.drift.monitor import AcceptanceDriftMonitor, MonitorConfig
from controller.drift.multitest import benjamini_hochberg, holm

__all__ = [
    "AcceptLengthChiSquare",
    "AcceptanceDriftMonitor",
    "Action",
    "CUSUM",
    "DriftAlert",
    "DriftDetector",
    "HistogramChiSquare",
    "MonitorConfig",
    "Severity",
    "Status",
    "benjamini_hochberg",
    "holm",
]
