"""Scenario files: a simulated fleet, its traffic and what changes when.

A scenario is YAML validated by pydantic models that forbid unknown keys;
:func:`load_scenario` turns every validation error into a
:class:`ScenarioError` line naming the field path and the offending value.

Schema (see ``worker/sim/scenarios/*.yaml`` for complete files)::

    name: demo
    duration_s: 300          # simulated seconds
    seed: 7
    domain_acceptance: {chat: 1.0, code: 1.08}   # base acceptance factor per domain
    traffic:                 # per worker replica; workers may override any field
      arrivals: {kind: poisson, rate: 4.0}        # requests/s
      #   or {kind: bursty, rate_on: 20, rate_off: 2, mean_on_s: 10, mean_off_s: 30}
      #   or {kind: closed, users: 8, think_s: 0}   # closed-loop users (vLLM --max-concurrency)
      #      (+ burst_users: 200, mean_on_s: 8, mean_off_s: 20 for on/off bursts of users)
      prompt_len: {kind: lognormal, median: 800, sigma: 0.8, max: 8000}
      #   or {kind: uniform, min: 16000, max: 128000} | {kind: fixed, value: 512}
      #   or {kind: mixture, components: [{weight: 0.8, kind: lognormal, ...}, ...]}
      output_len: {kind: lognormal, median: 256, sigma: 0.6, max: 2048}
      domain_mix: {chat: 0.7, code: 0.3}
      class_mix: {interactive: 1, batch: 3}   # optional: request classes (names from ``classes:``)
      predictability: {a: 8, b: 8, low: 0.7, high: 1.3}   # per-request acceptance multiplier
      correlated_acceptance:    # optional (default off): acceptance in spans, a hidden state per request
        states:                 # 2-8 states; each: acceptance (rank-1, absolute) or scale (x the request's own)
          - {name: copy, acceptance: 0.97, mean_span: 120}   # mean span in output tokens (geometric)
          - {name: prose, scale: 1.0, mean_span: 200, next: {copy: 1, novel: 2}}  # next: weights (default: alike)
          - {name: novel, acceptance: 0.05, mean_span: 60}
        domains: [code]         # optional: only these domains' requests (default: all)
    workers:
      - id: h100-eagle
        count: 2                        # replicas h100-eagle-0, h100-eagle-1
        hardware: H100-SXM              # registry name or an inline HardwareProfile;
                                        # H200-measured: a measured H200 table (llama-3-8b, one GPU)
        gpus: 1                         # tensor-parallel GPUs per replica
        model: llama-3-8b
        # cost_table: FILE              # optional: a step-cost table (specctl calibrate) prices the steps;
                                        # model then defaults to the table's, hardware gives HBM and hints
        drafter: {kind: eagle, version: v1, max_depth: 8, max_width: 8,
                  max_nodes: 64, trained_context_len: 8192}
        max_batch_size: 256
    changes:                            # all optional ``workers: [ids]`` to scope them
      - {at_s: 60, kind: rate, rate: 12, over_s: 60}         # or scale: 3.0; closed loop: users: 40
      - {at_s: 100, kind: context, prompt_len: {...}, over_s: 20}
      - {at_s: 150, kind: drift, domain: code, factor: 0.8}  # domain omitted = all
      - {at_s: 240, kind: drift, domain: code, factor: 1.0}  # retrained: back to 1
      - {at_s: 200, kind: domain_mix, domain_mix: {chat: 0.3, code: 0.7}}
    preset_config:                      # optional, for ``specctl bench policies`` only
      vllm-batch-table: {num_speculative_tokens: 2,
                         num_speculative_tokens_per_batch_size: [[1, 4, 2], [5, 512, 0]]}
    classes:                            # optional: the policy file's request classes (policies/classes.py)
      interactive: {weight: 4, tpot_target_ms: 40, tpot_quantile: p99}
      batch: {weight: 1}
    default_class: batch

``correlated_acceptance`` (:class:`worker.sim.acceptance.CorrelatedAcceptance`)
makes acceptance within a request correlated: spans of output tokens where
(nearly) every draft position is accepted alternate with spans where (nearly)
none is, so a whole chain is accepted or rejected at once far more often than
independent positions with the same mean would give. A worker's ``traffic``
may give its own (it cannot switch a scenario-wide one off).

A ``rate`` change sets the mean arrival rate (``rate``), the number of
closed-loop users (``users``) or scales the base process (``scale``),
linearly over ``over_s``; for a bursty process both on and off levels scale.

Open-loop arrivals (``poisson``, ``bursty``) come at their own pace whatever
the engine does: below saturation every policy emits the same tokens, so
tokens per second tell policies apart only in overload. Closed-loop users
(``closed``) send their next request when the last one is answered, as
vLLM's benchmark does with ``--max-concurrency``: a better decision emits
more tokens in the same time.

Request classes (issue #29). ``classes:`` / ``default_class:`` are the
``classes:`` section of a policy file (:func:`policies.classes.parse_classes`
validates them, with the same messages): the policy benchmark lays them over
every preset it runs on the scenario (a ``preset_config`` entry that gives its
own ``classes`` keeps those), and reports TPOT and goodput per class. A
traffic's ``class_mix`` says which class each request is in: open-loop
arrivals draw their class from the mix (from a stream of their own, so
every other attribute and arrival time stays what it is without classes), while
closed-loop users each belong to one class for good: users are given classes
in an interleaved order (user ``u`` joins the class furthest below its share
among users ``0..u``), so any number of active users splits as the mix does.
Every name in a ``class_mix`` must be one of ``classes``; a scenario with
``classes`` but no ``class_mix`` sends every request without a class (the
default class). Without either nothing changes: requests have no class and
every seeded result is the same as before classes existed.

``preset_config`` maps a shipped policy preset's name (a file stem in
``policies/presets/``) to fields laid over that preset's own for this
scenario only: the policy benchmark runs the preset configured as an
operator would have configured that engine here. The merged fields are
validated as the preset file is (unknown key, out-of-range value, changing
``policy:``, unknown preset name: refused, naming the field and value).
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from policies.classes import ClassSet, parse_classes
from worker.sim.acceptance import PROFILES as ACCEPTANCE_PROFILES
from worker.sim.acceptance import AcceptanceProfile, CorrelatedAcceptance
from worker.sim.hardware import (
    DRAFT_COST_PROFILES,
    HARDWARE_PROFILES,
    MODEL_PROFILES,
    CostModel,
    DraftCostProfile,
    HardwareProfile,
    ModelProfile,
)
from worker.sim.measured import (
    MEASURED_HARDWARE,
    build_cost_model,
    check_model,
    hardware_names,
    load_table,
    table_hardware,
)

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
_CLASSES_SOURCE = "<scenario>"  # parse_classes' source, cut from its messages (the scenario names the file)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- length distributions ----------------------------------------------------
class LogNormalLength(Strict):
    """Log-normal token count with the given median, clipped to [min, max]."""

    kind: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)
    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _bounds(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    def sample(self, rng: np.random.Generator) -> int:
        v = int(round(self.median * math.exp(self.sigma * rng.standard_normal())))
        return max(self.min, min(v, self.max) if self.max is not None else v)


class UniformLength(Strict):
    """Uniform integer token count in [min, max]."""

    kind: Literal["uniform"]
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _bounds(self):
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.min, self.max + 1))


class FixedLength(Strict):
    kind: Literal["fixed"]
    value: int = Field(ge=1)

    def sample(self, rng: np.random.Generator) -> int:
        return self.value


class LogNormalComponent(LogNormalLength):
    weight: float = Field(gt=0)


class UniformComponent(UniformLength):
    weight: float = Field(gt=0)


class FixedComponent(FixedLength):
    weight: float = Field(gt=0)


Component = Annotated[Union[LogNormalComponent, UniformComponent, FixedComponent], Field(discriminator="kind")]


class MixtureLength(Strict):
    """Mixture of the simple distributions, each with a ``weight``."""

    kind: Literal["mixture"]
    components: list[Component] = Field(min_length=1)

    def sample(self, rng: np.random.Generator) -> int:
        w = np.array([c.weight for c in self.components])
        i = int(np.searchsorted(np.cumsum(w) / w.sum(), rng.random(), side="right"))
        return self.components[min(i, len(self.components) - 1)].sample(rng)


LengthDist = Annotated[
    Union[LogNormalLength, UniformLength, FixedLength, MixtureLength], Field(discriminator="kind")
]


# -- arrivals ----------------------------------------------------------------
class PoissonArrivals(Strict):
    kind: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")

    @property
    def mean_rate(self) -> float:
        return self.rate


class BurstyArrivals(Strict):
    """Markov-modulated Poisson: on/off states with exponential dwell times."""

    kind: Literal["bursty"]
    rate_on: float = Field(ge=0)
    rate_off: float = Field(ge=0)
    mean_on_s: float = Field(gt=0)
    mean_off_s: float = Field(gt=0)
    start_on: bool = False

    @model_validator(mode="after")
    def _some_rate(self):
        if self.rate_on <= 0 and self.rate_off <= 0:
            raise ValueError(f"rate_on ({self.rate_on}) or rate_off ({self.rate_off}) must be > 0")
        return self

    @property
    def mean_rate(self) -> float:
        return (self.rate_on * self.mean_on_s + self.rate_off * self.mean_off_s) / (self.mean_on_s + self.mean_off_s)


class ClosedLoopArrivals(Strict):
    """Closed-loop users, as vLLM's serving benchmark with ``--max-concurrency``.

    Each of ``users`` sends a request, waits for the whole reply, thinks
    (exponential, mean ``think_s``; 0 = not at all) and sends the next. A
    faster engine therefore serves more requests, so tokens per second
    measure how well it decodes, not how fast requests happen to arrive.
    With ``burst_users`` the number of users alternates between ``users``
    (off) and ``burst_users`` (on) with exponential dwell times, like
    :class:`BurstyArrivals`. Users beyond the current count finish their
    request and then wait until they are counted again.
    """

    kind: Literal["closed"]
    users: int = Field(ge=0, description="users sending requests (the off state when bursty)")
    think_s: float = Field(0.0, ge=0, description="mean think time between a reply and the next request, seconds")
    burst_users: int | None = Field(None, ge=0, description="users during bursts")
    mean_on_s: float | None = Field(None, gt=0)
    mean_off_s: float | None = Field(None, gt=0)
    start_on: bool = False

    @model_validator(mode="after")
    def _burst(self):
        given = [self.burst_users is not None, self.mean_on_s is not None, self.mean_off_s is not None]
        if any(given) and not all(given):
            raise ValueError(f"burst_users, mean_on_s and mean_off_s go together, got burst_users={self.burst_users} "
                             f"mean_on_s={self.mean_on_s} mean_off_s={self.mean_off_s}")
        if self.users <= 0 and not self.burst_users:
            raise ValueError(f"users ({self.users}) or burst_users ({self.burst_users}) must be > 0")
        return self

    @property
    def bursty(self) -> bool:
        return self.burst_users is not None

    @property
    def peak_users(self) -> int:
        return max(self.users, self.burst_users or 0)


ArrivalSpec = Annotated[Union[PoissonArrivals, BurstyArrivals, ClosedLoopArrivals], Field(discriminator="kind")]


class Predictability(Strict):
    """Per-request acceptance multiplier ``low + (high - low) * Beta(a, b)``."""

    a: float = Field(8.0, gt=0)
    b: float = Field(8.0, gt=0)
    low: float = Field(0.7, gt=0)
    high: float = Field(1.3, gt=0)

    @model_validator(mode="after")
    def _order(self):
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: np.random.Generator) -> float:
        return self.low + (self.high - self.low) * float(rng.beta(self.a, self.b))


def _check_mix(v: dict[str, float], what: str = "domain") -> dict[str, float]:
    bad = {k: w for k, w in v.items() if not (w >= 0 and math.isfinite(w))}
    if bad:
        raise ValueError(f"{what} weights must be finite and >= 0, got {bad}")
    if v and sum(v.values()) <= 0:
        raise ValueError(f"{what} weights must not all be 0, got {v}")
    return v


class Traffic(Strict):
    """What arrives at one worker replica."""

    arrivals: ArrivalSpec
    prompt_len: LengthDist
    output_len: LengthDist
    domain_mix: dict[str, float] = Field(default_factory=lambda: {"chat": 1.0}, min_length=1)
    predictability: Predictability = Field(default_factory=Predictability)
    correlated_acceptance: CorrelatedAcceptance | None = Field(
        None, description="acceptance in spans, a hidden Markov state per request (default: off)"
    )
    class_mix: dict[str, float] | None = Field(
        None, min_length=1, description="request classes (names from the scenario's classes:) and their shares"
    )

    @field_validator("domain_mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_mix(v)

    @field_validator("class_mix")
    @classmethod
    def _classes(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return None if v is None else _check_mix(v, "class")


class TrafficOverride(Strict):
    arrivals: ArrivalSpec | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    domain_mix: dict[str, float] | None = None
    predictability: Predictability | None = None
    correlated_acceptance: CorrelatedAcceptance | None = None
    class_mix: dict[str, float] | None = Field(None, min_length=1)

    @field_validator("domain_mix")
    @classmethod
    def _mix(cls, v):
        return None if v is None else _check_mix(v)

    @field_validator("class_mix")
    @classmethod
    def _classes(cls, v):
        return None if v is None else _check_mix(v, "class")


# -- workers -----------------------------------------------------------------
DEFAULT_MAX_DEPTH = {"eagle": 8, "medusa": 4}


class DrafterSpec(Strict):
    """Drafter of a worker; ``acceptance`` / ``cost`` override fields of the kind's profiles."""

    kind: Literal["eagle", "medusa"]
    version: str = "v1"
    max_depth: int | None = Field(None, ge=1, le=16)
    max_width: int = Field(8, ge=1, le=16)
    max_nodes: int = Field(64, ge=1, le=256)
    trained_context_len: int = Field(8192, ge=0)
    acceptance: dict[str, Any] = Field(default_factory=dict)
    cost: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _limits(self):
        if self.max_depth is None:
            self.max_depth = DEFAULT_MAX_DEPTH[self.kind]
        if self.max_nodes < self.max_depth:
            raise ValueError(f"max_nodes ({self.max_nodes}) must be >= max_depth ({self.max_depth})")
        self.acceptance_profile()
        self.cost_profile()
        return self

    def acceptance_profile(self) -> AcceptanceProfile:
        base = ACCEPTANCE_PROFILES[self.kind].model_dump()
        try:
            return AcceptanceProfile.model_validate({**base, **self.acceptance, "kind": self.kind})
        except ValidationError as exc:
            raise ValueError(f"acceptance: {_flat(exc)}") from None

    def cost_profile(self) -> DraftCostProfile:
        base = DRAFT_COST_PROFILES[self.kind].model_dump()
        try:
            return DraftCostProfile.model_validate({**base, **self.cost, "kind": self.kind})
        except ValidationError as exc:
            raise ValueError(f"cost: {_flat(exc)}") from None


class WorkerSpec(Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    count: int = Field(1, ge=1, le=64, description="replicas")
    hardware: Union[str, HardwareProfile] = "H100-SXM"
    gpus: int | None = Field(None, ge=1, le=16, description="tensor-parallel GPUs (overrides hardware.count)")
    model: Union[str, ModelProfile] = "llama-3-8b"
    drafter: DrafterSpec
    max_batch_size: int = Field(256, ge=1, le=4096)
    kv_capacity_tokens: int | None = Field(None, ge=0, description="None: from HBM; 0: unlimited")
    prefill: bool = Field(False, description="charge prompt prefill to the step that admits a request")
    noise_sigma: float = Field(0.03, ge=0, le=1)
    report_confidence: bool = False
    traffic: TrafficOverride | None = None
    cost_table: str | None = Field(None, description="step-cost table file (specctl calibrate) pricing the steps")

    @field_validator("hardware")
    @classmethod
    def _hardware(cls, v):
        if isinstance(v, str) and v not in HARDWARE_PROFILES and v not in MEASURED_HARDWARE:
            raise ValueError(f"unknown hardware profile {v!r} (known: {', '.join(hardware_names())})")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v, info: ValidationInfo):
        hw = info.data.get("hardware")
        if v not in (None, 1) and isinstance(hw, str) and hw in MEASURED_HARDWARE:
            raise ValueError(f"{v} GPUs: hardware {hw!r} is a table measured on one GPU (gpus: 1)")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v, info: ValidationInfo):
        if isinstance(v, str) and v not in MODEL_PROFILES:
            raise ValueError(f"unknown model profile {v!r} (known: {', '.join(sorted(MODEL_PROFILES))})")
        hw = info.data.get("hardware")
        if isinstance(hw, str) and hw in MEASURED_HARDWARE:
            check_model(hw, v)
        return v

    @field_validator("cost_table")
    @classmethod
    def _cost_table_file(cls, v):
        # A path (from the working directory) or a file name in worker/sim/hardware_tables/; kept resolved.
        return None if v is None else table_hardware(v).table

    @model_validator(mode="after")
    def _cost_table(self):
        if self.cost_table is None:
            return self
        if isinstance(self.hardware, str) and self.hardware in MEASURED_HARDWARE:
            raise ValueError(f"cost_table: hardware {self.hardware!r} has a table of its own; name a roofline "
                             "profile (its HBM and hints) beside a cost_table")
        if self.gpus not in (None, 1):
            raise ValueError(f"cost_table: {self.gpus} GPUs, but the table prices one device (gpus: 1)")
        try:
            if "model" in self.model_fields_set:
                check_model(table_hardware(self.cost_table), self.model)
            else:  # the model the table was measured on
                self.model = load_table(self.cost_table).model_profile()
        except ValueError as exc:
            raise ValueError(f"cost_table: {exc}") from None
        return self

    def hardware_profile(self) -> HardwareProfile:
        """The GPU's roofline profile (for a measured name: the same GPU's, whose HBM and hints it keeps)."""
        measured = isinstance(self.hardware, str) and self.hardware in MEASURED_HARDWARE
        name = MEASURED_HARDWARE[self.hardware].profile if measured else self.hardware
        hw = HARDWARE_PROFILES[name] if isinstance(name, str) else name
        return hw.model_copy(update={"count": self.gpus}) if self.gpus else hw

    def cost_model(self) -> CostModel:
        """The worker's cost truth: its cost_table or the measured table of a measured hardware name, else the
        roofline."""
        hardware = self.hardware if isinstance(self.hardware, str) else self.hardware_profile()
        return build_cost_model(hardware, self.model_profile(), self.drafter.cost_profile(), self.noise_sigma,
                                self.gpus, table=self.cost_table)

    def model_profile(self) -> ModelProfile:
        return MODEL_PROFILES[self.model] if isinstance(self.model, str) else self.model

    def replica_ids(self) -> list[str]:
        return [self.id] if self.count == 1 else [f"{self.id}-{i}" for i in range(self.count)]


# -- changes -----------------------------------------------------------------
class ChangeBase(Strict):
    at_s: float = Field(ge=0)
    over_s: float = Field(0.0, ge=0, description="linear transition length (0 = a step)")
    workers: list[str] | None = Field(None, description="worker or replica ids (default: all)")

    def applies_to(self, spec_id: str, worker_id: str) -> bool:
        return self.workers is None or spec_id in self.workers or worker_id in self.workers


class RateChange(ChangeBase):
    """A new load level: open-loop ``rate`` (requests/s), closed-loop ``users``,
    or ``scale`` (a multiplier of the base rates or user counts)."""

    kind: Literal["rate"]
    rate: float | None = Field(None, ge=0, description="new mean arrival rate, requests/s (open loop)")
    users: int | None = Field(None, ge=0, description="new number of users (closed loop)")
    scale: float | None = Field(None, ge=0, description="new multiplier of the base arrival rates or user counts")

    @model_validator(mode="after")
    def _one(self):
        if sum(v is not None for v in (self.rate, self.users, self.scale)) != 1:
            raise ValueError(f"give exactly one of rate / users / scale, got rate={self.rate} users={self.users} "
                             f"scale={self.scale}")
        return self


class ContextChange(ChangeBase):
    kind: Literal["context"]
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None

    @model_validator(mode="after")
    def _some(self):
        if self.prompt_len is None and self.output_len is None:
            raise ValueError("a context change needs prompt_len and/or output_len")
        return self


class DriftChange(ChangeBase):
    kind: Literal["drift"]
    domain: str | None = Field(None, description="domain whose acceptance moves (None = all)")
    factor: float = Field(gt=0, le=2, description="new drift factor (1 = as trained)")


class DomainMixChange(ChangeBase):
    kind: Literal["domain_mix"]
    domain_mix: dict[str, float] = Field(min_length=1)

    @field_validator("domain_mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_mix(v)


Change = Annotated[Union[RateChange, ContextChange, DriftChange, DomainMixChange], Field(discriminator="kind")]


class Scenario(Strict):
    name: str = Field(min_length=1)
    description: str = ""
    duration_s: float = Field(gt=0)
    seed: int = Field(0, ge=0)
    domain_acceptance: dict[str, float] = Field(default_factory=dict)
    traffic: Traffic
    workers: list[WorkerSpec] = Field(min_length=1)
    changes: list[Change] = Field(default_factory=list)
    preset_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per preset name: fields laid over the preset file's (policy benchmark)"
    )
    classes: dict[str, Any] | None = Field(
        None, description="request classes as a policy file's classes: (policy benchmark: laid over every preset)"
    )
    default_class: str | None = Field(None, description="the class of a request that names none (with classes:)")

    @field_validator("domain_acceptance")
    @classmethod
    def _factors(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: f for k, f in v.items() if not 0 < f <= 2}
        if bad:
            raise ValueError(f"domain acceptance factors must lie in (0, 2], got {bad}")
        return v

    @model_validator(mode="after")
    def _cross_checks(self):
        problems: list[str] = []
        ids: list[str] = []
        for spec in self.workers:
            ids.extend(spec.replica_ids())
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            problems.append(f"workers: duplicate worker ids {dup}")
        known_ids = set(ids) | {s.id for s in self.workers}
        domains = self.domains()
        corr = [("traffic", self.traffic.correlated_acceptance)]
        corr += [(f"workers.{i}.traffic", s.traffic.correlated_acceptance) for i, s in enumerate(self.workers)
                 if s.traffic is not None]
        for where, c in corr:
            unknown = [d for d in (c.domains or ()) if d not in domains] if c is not None else []
            if unknown:
                problems.append(f"{where}.correlated_acceptance.domains: unknown domains {unknown} "
                                f"(known: {sorted(domains)})")
        for i, ch in enumerate(self.changes):
            where = f"changes.{i}"
            if ch.at_s > self.duration_s:
                problems.append(f"{where}.at_s: {ch.at_s:g} is after the end of the scenario (duration_s {self.duration_s:g})")
            if ch.workers is not None:
                unknown = [w for w in ch.workers if w not in known_ids]
                if unknown:
                    problems.append(f"{where}.workers: unknown worker ids {unknown} (known: {sorted(known_ids)})")
            if isinstance(ch, DriftChange) and ch.domain is not None and ch.domain not in domains:
                problems.append(f"{where}.domain: unknown domain {ch.domain!r} (known: {sorted(domains)})")
            if isinstance(ch, RateChange) and (ch.rate is not None or ch.users is not None):
                for wid, spec in self.replicas():
                    if not ch.applies_to(spec.id, wid):
                        continue
                    closed = isinstance(self.traffic_for(spec).arrivals, ClosedLoopArrivals)
                    if closed and ch.rate is not None:
                        problems.append(f"{where}.rate: {ch.rate:g} requests/s for worker {wid!r}, whose users are "
                                        "closed-loop (give users or scale)")
                        break
                    if not closed and ch.users is not None:
                        problems.append(f"{where}.users: {ch.users} for worker {wid!r}, whose arrivals are open-loop "
                                        "(give rate or scale)")
                        break
                    if closed and ch.users is not None and self.traffic_for(spec).arrivals.users <= 0:
                        problems.append(f"{where}.users: {ch.users} for worker {wid!r}, whose base users are 0 "
                                        "(nothing to scale)")
                        break
        problems.extend(self._class_problems())
        problems.extend(_preset_config_problems(self.preset_config, self.policy_classes()))
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _class_problems(self) -> list[str]:
        """``classes`` as a policy file's, and every ``class_mix`` naming only those classes."""
        try:
            cs = self.class_set()
        except ValueError as exc:
            return [str(exc).removeprefix(f"{_CLASSES_SOURCE}: ")]
        names = set(cs.names) if self.classes is not None else set()
        mixes = [("traffic", self.traffic.class_mix)]
        mixes += [(f"workers.{i}.traffic", s.traffic.class_mix) for i, s in enumerate(self.workers)
                  if s.traffic is not None]
        problems = []
        for where, mix in mixes:
            if mix is None:
                continue
            unknown = [c for c in mix if c not in names]
            if unknown:
                known = f"known: {sorted(names)}" if names else "the scenario has no classes: section"
                problems.append(f"{where}.class_mix: unknown classes {unknown} ({known})")
        return problems

    def class_set(self) -> ClassSet:
        """The scenario's request classes (one ``default`` class without ``classes``)."""
        return parse_classes(self.classes, self.default_class, _CLASSES_SOURCE)

    def policy_classes(self) -> dict[str, Any]:
        """The ``classes`` / ``default_class`` fields to lay over a preset (empty without classes)."""
        if self.classes is None:
            return {}
        out: dict[str, Any] = {"classes": self.classes}
        if self.default_class is not None:
            out["default_class"] = self.default_class
        return out

    def preset_fields(self, preset: str) -> dict[str, Any] | None:
        """Fields laid over ``preset``'s file for this scenario: its ``preset_config`` entry over the
        scenario's classes (an entry with its own ``classes`` keeps them); ``None`` when neither is set."""
        own = self.preset_config.get(preset)
        base = self.policy_classes()
        if own is not None and "classes" in own:
            base = {}
        if not base and own is None:
            return None
        return {**base, **(own or {})}

    @property
    def has_classes(self) -> bool:
        """Whether any request carries a class (a ``class_mix`` anywhere)."""
        return self.traffic.class_mix is not None or any(
            s.traffic is not None and s.traffic.class_mix is not None for s in self.workers)

    def domains(self) -> set[str]:
        """Every domain named by a traffic mix, a domain factor or a domain_mix change."""
        out = set(self.traffic.domain_mix) | set(self.domain_acceptance)
        for spec in self.workers:
            if spec.traffic and spec.traffic.domain_mix:
                out |= set(spec.traffic.domain_mix)
        for ch in self.changes:
            if isinstance(ch, DomainMixChange):
                out |= set(ch.domain_mix)
        return out

    def replicas(self) -> list[tuple[str, WorkerSpec]]:
        """(worker id, spec) for every replica, in file order."""
        return [(wid, spec) for spec in self.workers for wid in spec.replica_ids()]

    def traffic_for(self, spec: WorkerSpec) -> Traffic:
        """The scenario traffic with the worker's overrides applied."""
        if spec.traffic is None:
            return self.traffic
        update = {k: v for k, v in spec.traffic if v is not None}
        return self.traffic.model_copy(update=update)

    def changes_for(self, spec: WorkerSpec, worker_id: str) -> list[Change]:
        return [c for c in self.changes if c.applies_to(spec.id, worker_id)]

    def worker_seed(self, worker_id: str) -> np.random.SeedSequence:
        """Seed of one replica: stable under adding or reordering other workers."""
        return np.random.SeedSequence([self.seed, zlib.crc32(worker_id.encode())])


def _preset_config_problems(preset_config: dict[str, dict[str, Any]],
                            classes: dict[str, Any] | None = None) -> list[str]:
    """One line per preset override that the preset's own validation refuses
    (with the scenario's ``classes`` under it, unless the override gives its own)."""
    if not preset_config:
        return []
    # Imported here: the policy registry is only needed by scenarios that configure presets.
    from policies.presets import PresetError, list_presets, load_preset

    shipped = list_presets()
    problems = []
    for name, fields in preset_config.items():
        where = f"preset_config.{name}"
        if name not in shipped:
            problems.append(f"{where}: unknown preset {name!r} (shipped: {', '.join(shipped)})")
            continue
        merged = fields if not classes or "classes" in fields else {**classes, **fields}
        try:
            load_preset(name, merged, overrides_source=where)
        except PresetError as exc:
            problems.append(str(exc))
    return problems


# -- loading -----------------------------------------------------------------
class ScenarioError(ValueError):
    """A scenario file that does not validate; ``errors`` lists one line per problem."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = errors
        super().__init__(f"invalid scenario {source}:\n  " + "\n  ".join(errors))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flat(exc: ValidationError) -> str:
    return "; ".join(_lines(exc))


def _clean_loc(loc: tuple, data: Any) -> str:
    """Dotted path of an error, without the union tags pydantic inserts (``prompt_len.lognormal.sigma``)."""
    parts = []
    for p in loc:
        if isinstance(data, dict) and isinstance(p, str) and p not in data and data.get("kind") == p:
            continue  # a discriminator tag, not a field
        parts.append(str(p))
        if isinstance(data, dict):
            data = data.get(p)
        elif isinstance(data, list) and isinstance(p, int) and 0 <= p < len(data):
            data = data[p]
        else:
            data = None
    return ".".join(parts)


def _lines(exc: ValidationError, data: Any = None) -> list[str]:
    out = []
    for err in exc.errors():
        loc = _clean_loc(err["loc"], data)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] != "value_error" and not isinstance(err.get("input"), (dict, list)):
            msg += f" (got {_show(err.get('input'))})"
        out.extend(f"{loc}: {m}" if loc else m for m in msg.split("\n"))
    return out


def scenario_from_dict(data: Any, source: str = "<dict>") -> Scenario:
    """Validate a parsed scenario; raises :class:`ScenarioError`."""
    if not isinstance(data, dict):
        raise ScenarioError(source, [f"top level must be a mapping, got {type(data).__name__}"])
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(source, _lines(exc, data)) from None


def load_scenario(path_or_name: str | Path) -> Scenario:
    """Load a YAML scenario file, or a shipped one by name (``"demo"``).

    >>> load_scenario("demo").name
    'demo'
    """
    path = Path(path_or_name)
    if not path.exists() and not path.suffix:
        path = SCENARIO_DIR / f"{path_or_name}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not valid YAML: {exc}"]) from None
    return scenario_from_dict(data, str(path))


def shipped_scenarios() -> list[Path]:
    """The scenario files in ``worker/sim/scenarios``."""
    return sorted(SCENARIO_DIR.glob("*.yaml"))
