"""Controller configuration (``specctl serve --config FILE``), validated with pydantic.

Unknown keys and out-of-range values are refused with a message naming the
field and the value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from controller.fleet.settings import StateSettings, redact_url
from controller.observe.http import parse_host_port
from policies.table import DEFAULT_BATCH_EDGES, DEFAULT_CONTEXT_EDGES, validate_edges


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names field and value."""


def describe_validation_error(err: ValidationError, source: str) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "<root>"
        # A value under security.auth may be a token pasted where its digest belongs: never echo it.
        value = "<redacted>" if tuple(e["loc"][:2]) == ("security", "auth") else repr(_without_password(e.get("input")))
        parts.append(f"{field}={value}: {e['msg']}")
    return f"{source}: " + "; ".join(parts)


def _without_password(value):
    """``value`` with the password of any URL in it masked (``state.url`` may carry one).

    >>> _without_password({"backend": "redis", "url": "redis://u:secret@h:6379/0"})
    {'backend': 'redis', 'url': 'redis://u:***@h:6379/0'}
    """
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: _without_password(v) for k, v in value.items()}
    return value


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


class GcSettings(BaseModel):
    """The controller process's cyclic garbage collector (``gc:`` in the config).

    A collection stops the event loop: young generations for about a
    millisecond, a full one for tens to hundreds of milliseconds on a
    controller with a few hundred workers' state. See docs/operations.md,
    "Garbage collection".
    """

    model_config = ConfigDict(extra="forbid")

    hold_during_plan_push: bool = Field(
        True, description="no automatic collection from a plan push's policy run until gRPC has taken the plan "
                          "(the collection runs right after)")
    freeze_after_start: bool = Field(
        True, description="after start-up and after each policy reload, collect once and move every object "
                          "then alive out of the collector's reach (gc.freeze)")
    thresholds: tuple[int, int, int] | None = Field(
        None, description="gc.set_threshold(gen0, gen1, gen2); unset keeps Python's (700, 10, 10)")

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, v: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if v is None:
            return v
        if v[0] < 1 or v[1] < 1 or v[2] < 1:
            raise ValueError(f"each threshold must be >= 1, got {list(v)} (gen0 = 0 would turn automatic "
                             "collection off; gc stays on in a long-running controller)")
        return v


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _readable_pem(value: str, info: ValidationInfo) -> str:
    """Resolve ``value`` against the config file's folder and check it is a readable PEM file."""
    if not value:
        return value
    path = Path(_relative_to_config(value, info)).expanduser()
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{path} is not a PEM file (no -----BEGIN line)")
    return str(path)


class TlsSettings(BaseModel):
    """TLS on the gRPC port; mutual TLS with ``client_ca_file`` + ``require_client_cert``.
    Relative paths are taken from the config file's folder."""

    model_config = ConfigDict(extra="forbid")

    cert_file: str = Field(min_length=1, description="PEM certificate chain the controller presents")
    key_file: str = Field(min_length=1, description="PEM private key of cert_file")
    client_ca_file: str = Field("", description="PEM CA bundle that client certificates must chain to")
    require_client_cert: bool = Field(False, description="refuse clients without a certificate from client_ca_file")

    @field_validator("cert_file", "key_file", "client_ca_file")
    @classmethod
    def _files(cls, v: str, info: ValidationInfo) -> str:
        return _readable_pem(v, info)

    @model_validator(mode="after")
    def _client_ca_with_requirement(self) -> "TlsSettings":
        if self.require_client_cert and not self.client_ca_file:
            raise ValueError("require_client_cert: true needs client_ca_file (the CA that signs client certificates)")
        if self.client_ca_file and not self.require_client_cert:
            raise ValueError("client_ca_file is only used with require_client_cert: true (grpc does not ask "
                             "clients for a certificate otherwise)")
        return self


def _digests(value: str | list[str]) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else list(value)
    if not values:
        raise ValueError("needs at least one token digest")
    for v in values:
        if not _DIGEST.fullmatch(v):
            raise ValueError("must be 'sha256:' and 64 lowercase hex digits, as `specctl token new` prints "
                             "(the value is not shown: it may be a token)")
    return tuple(values)


class AuthSettings(BaseModel):
    """Bearer tokens, stored as SHA-256 digests: per worker id (a token acts as
    that worker only) and per admin name (admin calls). Several digests per
    name let a token be rotated."""

    model_config = ConfigDict(extra="forbid")

    workers: dict[str, str | list[str]] = Field(default_factory=dict, description="worker id -> token digest(s)")
    admins: dict[str, str | list[str]] = Field(default_factory=dict, description="admin name -> token digest(s)")
    bind_client_cert: bool = Field(
        False, description="a worker's client certificate must name its worker id (CN or SAN); needs mutual TLS")

    @field_validator("workers", "admins")
    @classmethod
    def _check_digests(cls, v: dict) -> dict[str, tuple[str, ...]]:
        out = {}
        for name, value in v.items():
            if not name:
                raise ValueError("names must be non-empty")
            try:
                out[name] = _digests(value)
            except ValueError as err:
                raise ValueError(f"{name!r}: {err}") from None
        return out

    @model_validator(mode="after")
    def _distinct(self) -> "AuthSettings":
        owners: dict[str, str] = {}
        for kind, table in (("worker", self.workers), ("admin", self.admins)):
            for name, digests in table.items():
                for d in digests:
                    if d in owners:
                        raise ValueError(f"{kind} {name!r} shares a token digest with {owners[d]}: "
                                         "each token must identify one caller")
                    owners[d] = f"{kind} {name!r}"
        if not owners:
            raise ValueError("lists no workers and no admins: every call would be refused")
        return self


class SecuritySettings(BaseModel):
    """Both parts are off when absent: no section keeps the port plaintext and open."""

    model_config = ConfigDict(extra="forbid")

    tls: TlsSettings | None = None
    auth: AuthSettings | None = None

    @model_validator(mode="after")
    def _binding_needs_mtls(self) -> "SecuritySettings":
        if self.auth is not None and self.auth.bind_client_cert and not (self.tls and self.tls.require_client_cert):
            raise ValueError("auth.bind_client_cert needs tls.require_client_cert: true")
        return self


ALERT_EVENT_NAMES = ("opened", "resolved", "acknowledged")
ALERT_ACTION_NAMES = ("RETRAIN_HEADS", "EXTEND_TRAINING_CONTEXT", "INVESTIGATE")


def _relative_to_config(value: str, info: ValidationInfo) -> str:
    """A relative path given in a config file is taken from the file's folder."""
    path = Path(value).expanduser()
    if value and not path.is_absolute() and info.context and "config_dir" in info.context:
        return str(Path(info.context["config_dir"]) / path)
    return value


class DriftSettings(BaseModel):
    """The acceptance drift monitor (controller/drift) as the server runs it."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="run the drift monitor (WatchAlerts answers UNAVAILABLE when off)")
    sample_fraction: float = Field(
        1.0, gt=0, le=1, description="largest share of requests monitored (a fixed subset by hash of request id)")
    cpu_fraction: float = Field(
        0.02, gt=0, le=1,
        description="share of each housekeeping tick the monitor may use; beyond it the subset shrinks "
                    "(its cache footprint slows ingest by about as much again)")
    max_buffered: int = Field(10_000, ge=100, description="request-steps waiting for the monitor (oldest dropped)")
    monitor: dict = Field(default_factory=dict,
                          description="MonitorConfig overrides (baseline_steps, window, ert, ...); "
                                      "context buckets are the controller's context_len_edges")

    @field_validator("monitor")
    @classmethod
    def _monitor_fields(cls, v: dict) -> dict:
        from controller.drift.config import MonitorConfig

        if "context_edges" in v:
            raise ValueError("context_edges is not set here: the monitor uses the controller's context_len_edges")
        known = [f for f in MonitorConfig.__dataclass_fields__ if f != "context_edges"]
        unknown = sorted(set(v) - set(known))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
        MonitorConfig(**v)  # its ValueError names the field and the value
        return v


# Where a controller without a `store.path` keeps its drift state (the working
# directory); read when a config is made, so the test suite can point it elsewhere.
DEFAULT_STORE_PATH = "specctl-state.sqlite3"


class StoreSettings(BaseModel):
    """Where baselines, alert history and acknowledgements survive restarts."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(default_factory=lambda: DEFAULT_STORE_PATH,
                      description="SQLite file (relative: the working directory, or the config file's folder "
                                  "when set in one); empty = in memory, lost at exit")
    save_interval_s: float = Field(60.0, gt=0, description="how often drift baselines are saved (and at shutdown)")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str, info: ValidationInfo) -> str:
        return _relative_to_config(v, info)


class WebhookSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    urls: list[str] = Field(default_factory=list, description="endpoints POSTed the alert JSON; empty = off")
    timeout_s: float = Field(5.0, gt=0, le=300, description="per attempt")
    retries: int = Field(2, ge=0, le=10, description="extra attempts after a failure (0.5 s, 1 s, ... apart)")
    events: list[str] = Field(default_factory=lambda: list(ALERT_EVENT_NAMES), description="events sent")
    max_pending: int = Field(1000, ge=1, description="deliveries queued at most (newer ones dropped)")

    @field_validator("urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
                raise ValueError(f"{url!r} is not an http:// or https:// URL")
        return v

    @field_validator("events")
    @classmethod
    def _events(cls, v: list[str]) -> list[str]:
        return _subset(v, ALERT_EVENT_NAMES, "event")


class CommandSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    argv: list[str] = Field(default_factory=list,
                            description="command and arguments, run with the alert JSON on stdin; empty = off")
    timeout_s: float = Field(60.0, gt=0, description="a run past this is killed (start long jobs, do not wait)")
    events: list[str] = Field(default_factory=lambda: ["opened"], description="events that run the command")
    actions: list[str] = Field(default_factory=lambda: list(ALERT_ACTION_NAMES),
                               description="recommended actions that run the command")
    max_concurrent: int = Field(2, ge=1, le=64)

    @field_validator("events")
    @classmethod
    def _events(cls, v: list[str]) -> list[str]:
        return _subset(v, ALERT_EVENT_NAMES, "event")

    @field_validator("actions")
    @classmethod
    def _actions(cls, v: list[str]) -> list[str]:
        return _subset(v, ALERT_ACTION_NAMES, "action")


class AlertSettings(BaseModel):
    """Alert delivery: WatchAlerts streams, webhooks, a command (a JSON log line always)."""

    model_config = ConfigDict(extra="forbid")

    watch_queue_size: int = Field(1000, ge=1, description="events a WatchAlerts stream may fall behind before "
                                                          "it is ended with RESOURCE_EXHAUSTED")
    webhook: WebhookSettings = WebhookSettings()
    command: CommandSettings = CommandSettings()


def _subset(values: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    for value in values:
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r} (one of {', '.join(allowed)})")
    return values


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
    worker_idle_ttl_s: float = Field(
        120.0, gt=0, description="a worker that sends nothing (no step, heartbeat or Decide) this long is taken for "
                                 "gone: its stream is ended, a Decide-only worker shows as disconnected")
    receipt_interval_s: float = Field(1.0, gt=0, le=60, description="least time between two TelemetryReceipts "
                                                                      "on a stream")
    forget_worker_after_s: float = Field(
        3600.0, gt=0, description="a worker disconnected this long is forgotten (its state, not its drafter's "
                                  "acceptance, which is shared per drafter version)")
    record: str = Field("", description="path of a compressed JSONL telemetry recording; empty = off")
    metrics_listen: str = Field("", description="HOST:PORT of /metrics and the status page; empty = off")
    status_sample_interval_s: float = Field(5.0, gt=0, description="how often the status page's history is sampled")
    status_history_samples: int = Field(720, ge=2, le=100_000, description="history samples kept per worker")
    metrics_plan_cells: bool = Field(
        True, description="export every plan cell (batch x context bucket) per worker; off for very large fleets")
    security: SecuritySettings = SecuritySettings()
    drift: DriftSettings = DriftSettings()
    store: StoreSettings = Field(default_factory=StoreSettings)
    alerts: AlertSettings = AlertSettings()
    # Shared state of several replicas (Redis); the default, embedded, shares nothing and starts nothing.
    state: StateSettings = StateSettings()
    gc: GcSettings = GcSettings()

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, v: str) -> str:
        if v:
            parse_host_port(v, "metrics_listen")
        return v

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
        return ServerConfig.model_validate(data, context={"config_dir": path.parent})
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, str(path))) from err
