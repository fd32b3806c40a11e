"""The tiny base class every drift detector of this package builds on.

It follows river's ``DriftDetector`` contract so the detectors can be fed and
scored exactly like river's (``drift/evaluate.py``): ``update(x)`` takes one
observation and returns the detector, ``drift_detected`` says whether that
observation raised an alarm, and the detector starts afresh on the next
``update`` after an alarm. Parameters are checked in ``__init__``; a bad one
raises ``ValueError`` naming the parameter and the value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class DriftDetector:
    """Base class: ``update(x) -> self`` and the ``drift_detected`` property.

    Examples
    --------
    >>> class Threshold(DriftDetector):
    ...     def __init__(self, limit: float) -> None:
    ...         super().__init__()
    ...         self.limit = check_float("limit", limit, low=0.0)
    ...     def update(self, x: float) -> "Threshold":
    ...         self._drift_detected = x > self.limit
    ...         return self
    >>> Threshold(1.0).update(3.0).drift_detected
    True
    >>> Threshold(-1.0)
    Traceback (most recent call last):
    ...
    ValueError: limit must be >= 0.0, got -1.0
    """

    def __init__(self) -> None:
        self._drift_detected = False

    @property
    def drift_detected(self) -> bool:
        """Whether the last ``update`` raised an alarm."""
        return self._drift_detected

    def update(self, x: Any) -> "DriftDetector":  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"

    def _params(self) -> dict[str, Any]:
        return {}


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int within ``[low, high]``, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return v


def check_float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite float within the bounds, else ``ValueError`` naming ``name``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (v >= high if high_open else v > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return v


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming ``name``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
