"""Controller configuration (``specctl serve --config FILE``), validated with pydantic.

Unknown keys and out-of-range values are refused with a message naming the
field and the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.table import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, validate_edges


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names field and value."""


def describe_validation_error(err: ValidationError, source: str) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "<root>"
        value = e.get("input")
        parts.append(f"{field}={value!r}: {e['msg']}")
    return f"{source}: " + "; ".join(parts)


class AcceptanceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    half_life_s: float = Field(120.0, gt=0, description="evidence half-life (seconds)")
    max_evidence: float = Field(2000.0, gt=0, description="cap on observations per (position, rank) cell")
    prior_rank1_mean: float = Field(0.6, gt=0, lt=1)
    prior_strength: float = Field(2.0, gt=0)


class PlanSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recompute_interval_s: float = Field(2.0, ge=0, description="least time between two policy runs per worker")
    min_push_interval_s: float = Field(2.0, ge=0, description="least time between two plans pushed to a worker")
    hysteresis: float = Field(0.02, ge=0, le=1, description="relative goodput gain a model-based plan must bring")
    steps_before_first_plan: int = Field(1, ge=0, description="steps a worker reports before its first fitted plan")
    tick_s: float = Field(0.05, gt=0, le=5, description="how often due policies run and plans are pushed")
    policy_cpu_fraction: float = Field(
        0.3, gt=0, le=1, description="share of each tick the policies may use; beyond it workers wait their turn"
    )


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen: str = Field("127.0.0.1:50051", description="host:port of the gRPC server")
    policy: str = Field("goodput", description="preset name or path of a policy file")
    batch_size_edges: Sequence[int] = DEFAULT_BATCH_EDGES
    context_len_edges: Sequence[int] = DEFAULT_CONTEXT_EDGES
    acceptance: AcceptanceSettings = AcceptanceSettings()
    plan: PlanSettings = PlanSettings()
    policy_poll_interval_s: float = Field(1.0, gt=0, description="how often the policy file is checked for changes")
    send_queue_size: int = Field(16, ge=1, le=10_000, description="bounded per-stream send queue")
    max_active_requests: int = Field(8192, ge=16, description="requests tracked per worker (LRU beyond)")
    record: str = Field("", description="path of a compressed JSONL telemetry recording; empty = off")

    @field_validator("batch_size_edges")
    @classmethod
    def _batch_edges(cls, v: Sequence[int]) -> tuple[int, ...]:
        return validate_edges(v, 1, "batch_size_edges")

    @field_validator("context_len_edges")
    @classmethod
    def _context_edges(cls, v: Sequence[int]) -> tuple[int, ...]:
        return validate_edges(v, 0, "context_len_edges")


def load_config(path: str | Path | None) -> ServerConfig:
    if path is None:
        return ServerConfig()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read config: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, str(path))) from err
