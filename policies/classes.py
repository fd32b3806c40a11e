"""Request classes: who gets how much verification (issue #29).

A policy file may sort requests into classes, each with a weight in the
objective, an optional latency target and the acceptance rule its requests
may be verified with::

    policy: goodput
    classes:
      interactive: {weight: 4, tpot_target_ms: 30, tpot_quantile: p99}
      batch:       {weight: 1}
      bulk:        {weight: 1, acceptance: typical, typical_epsilon: 0.09, typical_delta: 0.3}
    default_class: batch

- ``weight``: how much one of the class's tokens counts in the goodput the
  policy maximises (weighted tokens per second of step time).
- ``tpot_target_ms`` / ``tpot_quantile``: time per output token the class
  should stay under, at its median (``p50``) or 99th percentile (``p99``)
  over its requests. A class without a target is best-effort: it gives way
  first when verification gets expensive.
- ``tpot_margin``: the share of the target held back for what a prediction
  from telemetry cannot see (default :data:`DEFAULT_TPOT_MARGIN`): the
  policy plans for ``tpot_target_ms / (1 + tpot_margin)``. The quantile the
  target bounds is read from a few dozen requests at a time, and at a
  target the fleet can just reach it lands over as often as under when the
  plan aims at the target itself.
- ``acceptance``: ``strict`` (lossless, the default) or ``typical``
  (Medusa-2's typical acceptance: a drafted token is accepted when its
  target probability exceeds ``min(typical_epsilon, typical_delta ·
  exp(-H))``, ``H`` the entropy of the target's distribution there).

A request names its class in telemetry (``RequestStep.request_class``) and
in ``agent.decide(...)``; one that names none, or a name the policy does not
know, is in ``default_class`` (counted, never refused). A file without
``classes:`` has one class, ``default``, strict and unweighted: the policy
behaves as it did before classes existed.

>>> cs = parse_classes({"interactive": {"weight": 4, "tpot_target_ms": 30}, "batch": {}}, "batch", "inline")
>>> cs.names, cs.default
(('interactive', 'batch'), 'batch')
>>> cs.index("interactive"), cs.index(""), cs.index("nope")
(0, 1, 1)
>>> cs.known("nope")
False
>>> try:
...     parse_classes({"bulk": {"acceptance": "loose"}}, None, "inline")
... except ValueError as err:
...     print(err)
inline: classes.bulk.acceptance = 'loose': must be 'strict' or 'typical'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_CLASS = "default"
ACCEPTANCE_RULES = ("strict", "typical")
TPOT_QUANTILES = ("p50", "p99")
# Medusa-2's defaults for typical acceptance (posterior threshold 0.09, alpha 0.3).
DEFAULT_TYPICAL_EPSILON = 0.09
DEFAULT_TYPICAL_DELTA = 0.3
# Share of a TPOT target kept in reserve. On priority-classes the p99 of the
# interactive requests finishing in a 1.7-s bin spreads ~2.5 % (one standard
# deviation) around its mean at a steady plan; 3 % covers about one of those.
DEFAULT_TPOT_MARGIN = 0.03
MAX_TPOT_MARGIN = 0.5
MAX_CLASSES = 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RequestClassConfig(BaseModel):
    """One entry under ``classes:`` (validated; unknown keys refused)."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0.0, le=1000.0, description="weight of the class's tokens in the objective")
    tpot_target_ms: float | None = Field(None, gt=0.0, le=60_000.0,
                                         description="time per output token to stay under (ms); none: best effort")
    tpot_quantile: Literal["p50", "p99"] = Field("p99", description="the quantile over requests the target bounds")
    tpot_margin: float = Field(DEFAULT_TPOT_MARGIN, ge=0.0, le=MAX_TPOT_MARGIN,
                               description="share of the target held back: the policy plans for target / (1 + margin)")
    acceptance: Literal["strict", "typical"] = Field("strict", description="the rule its drafts are verified with")
    typical_epsilon: float = Field(DEFAULT_TYPICAL_EPSILON, gt=0.0, le=1.0,
                                   description="typical acceptance: probability threshold")
    typical_delta: float = Field(DEFAULT_TYPICAL_DELTA, gt=0.0, le=1.0,
                                 description="typical acceptance: entropy-scaled threshold")


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A validated class."""

    name: str
    weight: float = 1.0
    tpot_target_ms: float | None = None
    tpot_quantile: str = "p99"
    acceptance: str = "strict"
    typical_epsilon: float = DEFAULT_TYPICAL_EPSILON
    typical_delta: float = DEFAULT_TYPICAL_DELTA
    tpot_margin: float = DEFAULT_TPOT_MARGIN

    @property
    def relaxed(self) -> bool:
        """Whether its requests may be verified with a lossy rule."""
        return self.acceptance != "strict"

    @property
    def has_target(self) -> bool:
        return self.tpot_target_ms is not None

    @property
    def tpot_aim_ms(self) -> float | None:
        """What the policy plans the class's TPOT for: the target less its margin.

        >>> RequestClass("interactive", tpot_target_ms=8.24, tpot_margin=0.03).tpot_aim_ms
        8.0
        """
        if self.tpot_target_ms is None:
            return None
        return self.tpot_target_ms / (1.0 + self.tpot_margin)


@dataclass(frozen=True)
class ClassSet:
    """The classes of one policy file, in file order, and its default class."""

    classes: tuple[RequestClass, ...] = (RequestClass(DEFAULT_CLASS),)
    default: str = DEFAULT_CLASS
    _index: Mapping[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("a class set needs at least one class")
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")
        if self.default not in names:
            raise ValueError(f"default_class = {self.default!r} is not one of the classes {names}")
        object.__setattr__(self, "_index", {n: i for i, n in enumerate(names)})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def single(self) -> bool:
        """One class only: plans carry no class section, policies decide as before classes."""
        return len(self.classes) == 1

    @property
    def default_index(self) -> int:
        return self._index[self.default]

    def known(self, name: str) -> bool:
        return name in self._index

    def index(self, name: str) -> int:
        """The class a request naming ``name`` is in (the default for empty or unknown names)."""
        return self._index.get(name, self._index[self.default])

    def get(self, name: str) -> RequestClass:
        return self.classes[self.index(name)]

    def __len__(self) -> int:
        return len(self.classes)

    def __iter__(self):
        return iter(self.classes)


SINGLE = ClassSet()


def parse_classes(data: Any, default_class: Any, source: str) -> ClassSet:
    """The ``classes:`` and ``default_class:`` of a policy file as a :class:`ClassSet`.

    ``ValueError`` names ``source``, the field and the value. Without
    ``classes`` (``None``) the set is the single ``default`` class, and
    ``default_class`` must then be absent. ``default_class`` may be left out
    when there is one class; with several it must name one of them.
    """
    if data is None:
        if default_class is not None:
            raise ValueError(f"{source}: default_class = {default_class!r} needs a 'classes:' section to name")
        return SINGLE
    if not isinstance(data, Mapping) or not data:
        raise ValueError(f"{source}: classes must be a mapping of class name to its settings, got {data!r}")
    if len(data) > MAX_CLASSES:
        raise ValueError(f"{source}: classes has {len(data)} entries; at most {MAX_CLASSES}")
    out = []
    for name, entry in data.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{source}: classes: name {name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                             "(starting with a letter or digit)")
        if entry is None:
            entry = {}
        if not isinstance(entry, Mapping):
            raise ValueError(f"{source}: classes.{name} must be a mapping of settings, got {entry!r}")
        try:
            cfg = RequestClassConfig(**entry)
        except ValidationError as exc:
            raise ValueError(_class_error(exc, name, entry, source)) from None
        out.append(RequestClass(name, cfg.weight, cfg.tpot_target_ms, cfg.tpot_quantile, cfg.acceptance,
                                cfg.typical_epsilon, cfg.typical_delta, cfg.tpot_margin))
    if default_class is None:
        if len(out) > 1:
            raise ValueError(f"{source}: default_class is missing; with several classes it must name one of "
                             f"{[c.name for c in out]}")
        default_class = out[0].name
    if not isinstance(default_class, str) or default_class not in {c.name for c in out}:
        raise ValueError(f"{source}: default_class = {default_class!r} is not one of the classes "
                         f"{[c.name for c in out]}")
    return ClassSet(tuple(out), default_class)


def _class_error(exc: ValidationError, name: str, entry: Mapping, source: str) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        allowed = ", ".join(RequestClassConfig.model_fields)
        return (f"{source}: classes.{name}: unknown key {key!r} (value {entry.get(key)!r}); "
                f"allowed keys: {allowed}")
    value = entry.get(key, err.get("input"))
    if key == "acceptance":
        return f"{source}: classes.{name}.acceptance = {value!r}: must be 'strict' or 'typical'"
    if key == "tpot_quantile":
        return f"{source}: classes.{name}.tpot_quantile = {value!r}: must be 'p50' or 'p99'"
    msg = err.get("msg", "invalid")
    if isinstance(value, float) and not math.isfinite(value):
        msg = "must be a finite number"
    return f"{source}: classes.{name}.{key} = {value!r}: {msg}"
