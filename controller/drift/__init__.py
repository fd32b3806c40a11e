"""Drift detection on acceptance (docs/design.md §5, issue 5).

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
:class:`Action`. The server runs it through :mod:`controller.alerts.alerting`.
The monitor's parts sit beside it: :mod:`~controller.drift.config`
(:class:`MonitorConfig`), :mod:`~controller.drift.strata` (per-stratum
baselines and the CUSUM bank), :mod:`~controller.drift.llr` (the
likelihood-ratio score), :mod:`~controller.drift.actions` (what a change calls
for) and :mod:`~controller.drift.persistence` (saving and restoring).
"""

import importlib
from typing import Any

# Exported names and their modules, imported on first use: a client that only
# needs the alert types (``specctl alerts``) does not pay for scipy.
_EXPORTS = {
    "AcceptLengthChiSquare": "controller.drift.accept_chi2",
    "AcceptanceDriftMonitor": "controller.drift.monitor",
    "Action": "controller.drift.alerts",
    "CUSUM": "controller.drift.cusum",
    "DriftAlert": "controller.drift.alerts",
    "DriftDetector": "controller.drift.base",
    "HistogramChiSquare": "controller.drift.histogram_chi2",
    "MonitorConfig": "controller.drift.config",
    "Severity": "controller.drift.alerts",
    "Status": "controller.drift.alerts",
    "benjamini_hochberg": "controller.drift.multitest",
    "holm": "controller.drift.multitest",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
