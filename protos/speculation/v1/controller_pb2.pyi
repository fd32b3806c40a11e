from protos.speculation.v1 import worker_pb2 as _worker_pb2
from protos.speculation.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AlertAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALERT_ACTION_UNSPECIFIED: _ClassVar[AlertAction]
    ALERT_ACTION_RETRAIN_HEADS: _ClassVar[AlertAction]
    ALERT_ACTION_EXTEND_TRAINING_CONTEXT: _ClassVar[AlertAction]
    ALERT_ACTION_INVESTIGATE: _ClassVar[AlertAction]

class AlertSeverity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALERT_SEVERITY_UNSPECIFIED: _ClassVar[AlertSeverity]
    ALERT_SEVERITY_INFO: _ClassVar[AlertSeverity]
    ALERT_SEVERITY_WARNING: _ClassVar[AlertSeverity]
    ALERT_SEVERITY_CRITICAL: _ClassVar[AlertSeverity]

class AlertStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALERT_STATUS_UNSPECIFIED: _ClassVar[AlertStatus]
    ALERT_STATUS_OPEN: _ClassVar[AlertStatus]
    ALERT_STATUS_RESOLVED: _ClassVar[AlertStatus]

class AlertEvent(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALERT_EVENT_UNSPECIFIED: _ClassVar[AlertEvent]
    ALERT_EVENT_EXISTING: _ClassVar[AlertEvent]
    ALERT_EVENT_OPENED: _ClassVar[AlertEvent]
    ALERT_EVENT_RESOLVED: _ClassVar[AlertEvent]
    ALERT_EVENT_ACKNOWLEDGED: _ClassVar[AlertEvent]

class WorkerSession(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_SESSION_UNSPECIFIED: _ClassVar[WorkerSession]
    WORKER_SESSION_STREAM: _ClassVar[WorkerSession]
    WORKER_SESSION_UNARY: _ClassVar[WorkerSession]
ALERT_ACTION_UNSPECIFIED: AlertAction
ALERT_ACTION_RETRAIN_HEADS: AlertAction
ALERT_ACTION_EXTEND_TRAINING_CONTEXT: AlertAction
ALERT_ACTION_INVESTIGATE: AlertAction
ALERT_SEVERITY_UNSPECIFIED: AlertSeverity
ALERT_SEVERITY_INFO: AlertSeverity
ALERT_SEVERITY_WARNING: AlertSeverity
ALERT_SEVERITY_CRITICAL: AlertSeverity
ALERT_STATUS_UNSPECIFIED: AlertStatus
ALERT_STATUS_OPEN: AlertStatus
ALERT_STATUS_RESOLVED: AlertStatus
ALERT_EVENT_UNSPECIFIED: AlertEvent
ALERT_EVENT_EXISTING: AlertEvent
ALERT_EVENT_OPENED: AlertEvent
ALERT_EVENT_RESOLVED: AlertEvent
ALERT_EVENT_ACKNOWLEDGED: AlertEvent
WORKER_SESSION_UNSPECIFIED: WorkerSession
WORKER_SESSION_STREAM: WorkerSession
WORKER_SESSION_UNARY: WorkerSession

class DriftAlert(_message.Message):
    __slots__ = ("id", "drafter_kind", "drafter_version", "stratum", "context_len_min", "context_len_max", "domain", "detector", "statistic", "has_p_value", "p_value", "p_adjusted", "score", "baseline_hist", "current_hist", "baseline_alpha", "current_alpha", "expected_tau_change", "first_seen", "opened_at", "severity", "action", "message", "status", "resolved_at", "resolution", "n_baseline", "n_current", "event", "acked_at", "acked_by")
    ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STRATUM_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_MIN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_MAX_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    STATISTIC_FIELD_NUMBER: _ClassVar[int]
    HAS_P_VALUE_FIELD_NUMBER: _ClassVar[int]
    P_VALUE_FIELD_NUMBER: _ClassVar[int]
    P_ADJUSTED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_HIST_FIELD_NUMBER: _ClassVar[int]
    CURRENT_HIST_FIELD_NUMBER: _ClassVar[int]
    BASELINE_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ALPHA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TAU_CHANGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_AT_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_FIELD_NUMBER: _ClassVar[int]
    N_BASELINE_FIELD_NUMBER: _ClassVar[int]
    N_CURRENT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ACKED_AT_FIELD_NUMBER: _ClassVar[int]
    ACKED_BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    drafter_kind: _worker_pb2.DrafterKind
    drafter_version: str
    stratum: str
    context_len_min: int
    context_len_max: int
    domain: str
    detector: str
    statistic: float
    has_p_value: bool
    p_value: float
    p_adjusted: float
    score: float
    baseline_hist: _containers.RepeatedScalarFieldContainer[int]
    current_hist: _containers.RepeatedScalarFieldContainer[int]
    baseline_alpha: _containers.RepeatedScalarFieldContainer[float]
    current_alpha: _containers.RepeatedScalarFieldContainer[float]
    expected_tau_change: float
    first_seen: float
    opened_at: float
    severity: AlertSeverity
    action: AlertAction
    message: str
    status: AlertStatus
    resolved_at: float
    resolution: str
    n_baseline: int
    n_current: int
    event: AlertEvent
    acked_at: float
    acked_by: str
    def __init__(self, id: _Optional[str] = ..., drafter_kind: _Optional[_Union[_worker_pb2.DrafterKind, str]] = ..., drafter_version: _Optional[str] = ..., stratum: _Optional[str] = ..., context_len_min: _Optional[int] = ..., context_len_max: _Optional[int] = ..., domain: _Optional[str] = ..., detector: _Optional[str] = ..., statistic: _Optional[float] = ..., has_p_value: _Optional[bool] = ..., p_value: _Optional[float] = ..., p_adjusted: _Optional[float] = ..., score: _Optional[float] = ..., baseline_hist: _Optional[_Iterable[int]] = ..., current_hist: _Optional[_Iterable[int]] = ..., baseline_alpha: _Optional[_Iterable[float]] = ..., current_alpha: _Optional[_Iterable[float]] = ..., expected_tau_change: _Optional[float] = ..., first_seen: _Optional[float] = ..., opened_at: _Optional[float] = ..., severity: _Optional[_Union[AlertSeverity, str]] = ..., action: _Optional[_Union[AlertAction, str]] = ..., message: _Optional[str] = ..., status: _Optional[_Union[AlertStatus, str]] = ..., resolved_at: _Optional[float] = ..., resolution: _Optional[str] = ..., n_baseline: _Optional[int] = ..., n_current: _Optional[int] = ..., event: _Optional[_Union[AlertEvent, str]] = ..., acked_at: _Optional[float] = ..., acked_by: _Optional[str] = ...) -> None: ...

class WatchAlertsRequest(_message.Message):
    __slots__ = ("include_history", "open_only", "drafter_version")
    INCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    OPEN_ONLY_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    include_history: bool
    open_only: bool
    drafter_version: str
    def __init__(self, include_history: _Optional[bool] = ..., open_only: _Optional[bool] = ..., drafter_version: _Optional[str] = ...) -> None: ...

class AckAlertRequest(_message.Message):
    __slots__ = ("alert_id", "acked_by")
    ALERT_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_BY_FIELD_NUMBER: _ClassVar[int]
    alert_id: str
    acked_by: str
    def __init__(self, alert_id: _Optional[str] = ..., acked_by: _Optional[str] = ...) -> None: ...

class AckAlertResponse(_message.Message):
    __slots__ = ("alert",)
    ALERT_FIELD_NUMBER: _ClassVar[int]
    alert: DriftAlert
    def __init__(self, alert: _Optional[_Union[DriftAlert, _Mapping]] = ...) -> None: ...

class ReloadPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadPolicyResponse(_message.Message):
    __slots__ = ("loaded", "policy", "error")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    loaded: bool
    policy: str
    error: str
    def __init__(self, loaded: _Optional[bool] = ..., policy: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class DecideRequest(_message.Message):
    __slots__ = ("worker_id", "hello", "reports", "queries")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    hello: _worker_pb2.Hello
    reports: _worker_pb2.StepReports
    queries: _containers.RepeatedCompositeFieldContainer[DecideQuery]
    def __init__(self, worker_id: _Optional[str] = ..., hello: _Optional[_Union[_worker_pb2.Hello, _Mapping]] = ..., reports: _Optional[_Union[_worker_pb2.StepReports, _Mapping]] = ..., queries: _Optional[_Iterable[_Union[DecideQuery, _Mapping]]] = ...) -> None: ...

class DecideQuery(_message.Message):
    __slots__ = ("request_id", "context_len", "batch_size", "request_class", "request_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_len: int
    batch_size: int
    request_class: str
    request_state: _plan_pb2.RequestState
    def __init__(self, request_id: _Optional[str] = ..., context_len: _Optional[int] = ..., batch_size: _Optional[int] = ..., request_class: _Optional[str] = ..., request_state: _Optional[_Union[_plan_pb2.RequestState, str]] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ("decisions", "plan_version", "rejections")
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[_plan_pb2.Decision]
    plan_version: int
    rejections: _containers.RepeatedCompositeFieldContainer[_plan_pb2.Rejection]
    def __init__(self, decisions: _Optional[_Iterable[_Union[_plan_pb2.Decision, _Mapping]]] = ..., plan_version: _Optional[int] = ..., rejections: _Optional[_Iterable[_Union[_plan_pb2.Rejection, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("mem_ms", "mem_ms_per_kv_token", "compute_ms", "compute_ms_per_token", "draft_fixed_ms", "draft_ms_per_level", "draft_ms_per_node", "samples", "rmse_ms", "draft_ms_per_level_kv_token", "compute_ms_per_pair", "compute_knots", "compute_rise_ms", "catch_up_ms_per_token", "compute_ms_per_kv_token")
    MEM_MS_FIELD_NUMBER: _ClassVar[int]
    MEM_MS_PER_KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_PER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RMSE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_PER_LEVEL_KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_KNOTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_RISE_MS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_PER_KV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    mem_ms: float
    mem_ms_per_kv_token: float
    compute_ms: float
    compute_ms_per_token: float
    draft_fixed_ms: float
    draft_ms_per_level: float
    draft_ms_per_node: float
    samples: int
    rmse_ms: float
    draft_ms_per_level_kv_token: float
    compute_ms_per_pair: float
    compute_knots: _containers.RepeatedScalarFieldContainer[float]
    compute_rise_ms: _containers.RepeatedScalarFieldContainer[float]
    catch_up_ms_per_token: float
    compute_ms_per_kv_token: float
    def __init__(self, mem_ms: _Optional[float] = ..., mem_ms_per_kv_token: _Optional[float] = ..., compute_ms: _Optional[float] = ..., compute_ms_per_token: _Optional[float] = ..., draft_fixed_ms: _Optional[float] = ..., draft_ms_per_level: _Optional[float] = ..., draft_ms_per_node: _Optional[float] = ..., samples: _Optional[int] = ..., rmse_ms: _Optional[float] = ..., draft_ms_per_level_kv_token: _Optional[float] = ..., compute_ms_per_pair: _Optional[float] = ..., compute_knots: _Optional[_Iterable[float]] = ..., compute_rise_ms: _Optional[_Iterable[float]] = ..., catch_up_ms_per_token: _Optional[float] = ..., compute_ms_per_kv_token: _Optional[float] = ...) -> None: ...

class StratumAcceptance(_message.Message):
    __slots__ = ("drafter_kind", "drafter_version", "context_len_min", "context_len_max", "alpha", "effective_samples", "expected_accepted_chain")
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_MIN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_MAX_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_CHAIN_FIELD_NUMBER: _ClassVar[int]
    drafter_kind: _worker_pb2.DrafterKind
    drafter_version: str
    context_len_min: int
    context_len_max: int
    alpha: _containers.RepeatedScalarFieldContainer[float]
    effective_samples: _containers.RepeatedScalarFieldContainer[float]
    expected_accepted_chain: float
    def __init__(self, drafter_kind: _Optional[_Union[_worker_pb2.DrafterKind, str]] = ..., drafter_version: _Optional[str] = ..., context_len_min: _Optional[int] = ..., context_len_max: _Optional[int] = ..., alpha: _Optional[_Iterable[float]] = ..., effective_samples: _Optional[_Iterable[float]] = ..., expected_accepted_chain: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("hello", "connected", "plan_version", "acked_plan_version", "nacks", "steps_ingested", "last_report_at", "cost_model", "acceptance", "mean_batch_size", "mean_context_len", "observed_goodput_tok_s", "plan", "session", "last_seen_at", "expired", "streams_superseded", "plans_used", "last_nack_reason", "steps_received", "classes", "unknown_class_request_steps", "unknown_class_queries", "typical_violations", "acceptance_typical", "replica_id", "replica_live", "shadow_drafts", "shadow_drafts_ignored")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACKED_PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    NACKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_INGESTED_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AT_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEAN_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_GOODPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    PLANS_USED_FIELD_NUMBER: _ClassVar[int]
    LAST_NACK_REASON_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_CLASS_REQUEST_STEPS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_CLASS_QUERIES_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_TYPICAL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LIVE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_DRAFTS_IGNORED_FIELD_NUMBER: _ClassVar[int]
    hello: _worker_pb2.Hello
    connected: bool
    plan_version: int
    acked_plan_version: int
    nacks: int
    steps_ingested: int
    last_report_at: float
    cost_model: CostModel
    acceptance: _containers.RepeatedCompositeFieldContainer[StratumAcceptance]
    mean_batch_size: float
    mean_context_len: float
    observed_goodput_tok_s: float
    plan: _plan_pb2.Plan
    session: WorkerSession
    last_seen_at: float
    expired: bool
    streams_superseded: int
    plans_used: int
    last_nack_reason: str
    steps_received: int
    classes: _containers.RepeatedCompositeFieldContainer[ClassStatus]
    unknown_class_request_steps: int
    unknown_class_queries: int
    typical_violations: int
    acceptance_typical: _containers.RepeatedCompositeFieldContainer[StratumAcceptance]
    replica_id: str
    replica_live: bool
    shadow_drafts: int
    shadow_drafts_ignored: int
    def __init__(self, hello: _Optional[_Union[_worker_pb2.Hello, _Mapping]] = ..., connected: _Optional[bool] = ..., plan_version: _Optional[int] = ..., acked_plan_version: _Optional[int] = ..., nacks: _Optional[int] = ..., steps_ingested: _Optional[int] = ..., last_report_at: _Optional[float] = ..., cost_model: _Optional[_Union[CostModel, _Mapping]] = ..., acceptance: _Optional[_Iterable[_Union[StratumAcceptance, _Mapping]]] = ..., mean_batch_size: _Optional[float] = ..., mean_context_len: _Optional[float] = ..., observed_goodput_tok_s: _Optional[float] = ..., plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., session: _Optional[_Union[WorkerSession, str]] = ..., last_seen_at: _Optional[float] = ..., expired: _Optional[bool] = ..., streams_superseded: _Optional[int] = ..., plans_used: _Optional[int] = ..., last_nack_reason: _Optional[str] = ..., steps_received: _Optional[int] = ..., classes: _Optional[_Iterable[_Union[ClassStatus, _Mapping]]] = ..., unknown_class_request_steps: _Optional[int] = ..., unknown_class_queries: _Optional[int] = ..., typical_violations: _Optional[int] = ..., acceptance_typical: _Optional[_Iterable[_Union[StratumAcceptance, _Mapping]]] = ..., replica_id: _Optional[str] = ..., replica_live: _Optional[bool] = ..., shadow_drafts: _Optional[int] = ..., shadow_drafts_ignored: _Optional[int] = ...) -> None: ...

class ClassStatus(_message.Message):
    __slots__ = ("name", "is_default", "weight", "tpot_target_ms", "tpot_quantile", "acceptance_rule", "share", "tpot_ms_p50", "tpot_ms_p99", "tpot_requests", "tau", "spec_fraction", "tokens_per_step", "step_ms_mean", "mean_context_len", "request_steps", "tokens", "typical_request_steps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RULE_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_P50_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_P99_FIELD_NUMBER: _ClassVar[int]
    TPOT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    SPEC_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_MEAN_FIELD_NUMBER: _ClassVar[int]
    MEAN_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_REQUEST_STEPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    is_default: bool
    weight: float
    tpot_target_ms: float
    tpot_quantile: str
    acceptance_rule: _plan_pb2.AcceptanceRule
    share: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    tpot_requests: int
    tau: float
    spec_fraction: float
    tokens_per_step: float
    step_ms_mean: float
    mean_context_len: float
    request_steps: int
    tokens: int
    typical_request_steps: int
    def __init__(self, name: _Optional[str] = ..., is_default: _Optional[bool] = ..., weight: _Optional[float] = ..., tpot_target_ms: _Optional[float] = ..., tpot_quantile: _Optional[str] = ..., acceptance_rule: _Optional[_Union[_plan_pb2.AcceptanceRule, str]] = ..., share: _Optional[float] = ..., tpot_ms_p50: _Optional[float] = ..., tpot_ms_p99: _Optional[float] = ..., tpot_requests: _Optional[int] = ..., tau: _Optional[float] = ..., spec_fraction: _Optional[float] = ..., tokens_per_step: _Optional[float] = ..., step_ms_mean: _Optional[float] = ..., mean_context_len: _Optional[float] = ..., request_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., typical_request_steps: _Optional[int] = ...) -> None: ...

class RejectionCount(_message.Message):
    __slots__ = ("reason", "count")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    reason: _plan_pb2.RejectReason
    count: int
    def __init__(self, reason: _Optional[_Union[_plan_pb2.RejectReason, str]] = ..., count: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("workers", "rejections", "policy", "policy_reloads", "policy_reload_failures", "streams_superseded", "workers_expired", "worker_idle_ttl_s", "replica_id", "replicas", "placements", "fleet_store", "drift_monitors")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_RELOADS_FIELD_NUMBER: _ClassVar[int]
    POLICY_RELOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    FLEET_STORE_FIELD_NUMBER: _ClassVar[int]
    DRIFT_MONITORS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    rejections: _containers.RepeatedCompositeFieldContainer[RejectionCount]
    policy: str
    policy_reloads: int
    policy_reload_failures: int
    streams_superseded: int
    workers_expired: int
    worker_idle_ttl_s: float
    replica_id: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    placements: _containers.RepeatedCompositeFieldContainer[WorkerPlacement]
    fleet_store: FleetStoreHealth
    drift_monitors: _containers.RepeatedCompositeFieldContainer[DriftMonitorStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., rejections: _Optional[_Iterable[_Union[RejectionCount, _Mapping]]] = ..., policy: _Optional[str] = ..., policy_reloads: _Optional[int] = ..., policy_reload_failures: _Optional[int] = ..., streams_superseded: _Optional[int] = ..., workers_expired: _Optional[int] = ..., worker_idle_ttl_s: _Optional[float] = ..., replica_id: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., placements: _Optional[_Iterable[_Union[WorkerPlacement, _Mapping]]] = ..., fleet_store: _Optional[_Union[FleetStoreHealth, _Mapping]] = ..., drift_monitors: _Optional[_Iterable[_Union[DriftMonitorStatus, _Mapping]]] = ...) -> None: ...

class DriftMonitorStatus(_message.Message):
    __slots__ = ("drafter_kind", "drafter_version", "owner_replica_id", "owned_here", "evidence_lag", "evidence_queued", "entries_lost", "checkpoint_age_s")
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    OWNED_HERE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_LAG_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_QUEUED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_LOST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    drafter_kind: str
    drafter_version: str
    owner_replica_id: str
    owned_here: bool
    evidence_lag: int
    evidence_queued: int
    entries_lost: int
    checkpoint_age_s: float
    def __init__(self, drafter_kind: _Optional[str] = ..., drafter_version: _Optional[str] = ..., owner_replica_id: _Optional[str] = ..., owned_here: _Optional[bool] = ..., evidence_lag: _Optional[int] = ..., evidence_queued: _Optional[int] = ..., entries_lost: _Optional[int] = ..., checkpoint_age_s: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "live", "workers", "started_at")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    live: bool
    workers: int
    started_at: float
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., live: _Optional[bool] = ..., workers: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class WorkerPlacement(_message.Message):
    __slots__ = ("worker_id", "replica_id", "replica_live", "since")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LIVE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    replica_id: str
    replica_live: bool
    since: float
    def __init__(self, worker_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., replica_live: _Optional[bool] = ..., since: _Optional[float] = ...) -> None: ...

class FleetStoreHealth(_message.Message):
    __slots__ = ("backend", "url", "fleet", "up", "outages", "down_for_s", "last_error", "failed_calls", "failed_merges", "unmerged_evidence", "since_merge_s", "merges", "live_replicas", "leases_held", "alert_events_queued", "first_plans_held", "drift_evidence_dropped")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    OUTAGES_FIELD_NUMBER: _ClassVar[int]
    DOWN_FOR_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_CALLS_FIELD_NUMBER: _ClassVar[int]
    FAILED_MERGES_FIELD_NUMBER: _ClassVar[int]
    UNMERGED_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    SINCE_MERGE_S_FIELD_NUMBER: _ClassVar[int]
    MERGES_FIELD_NUMBER: _ClassVar[int]
    LIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    ALERT_EVENTS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    FIRST_PLANS_HELD_FIELD_NUMBER: _ClassVar[int]
    DRIFT_EVIDENCE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    backend: str
    url: str
    fleet: str
    up: bool
    outages: int
    down_for_s: float
    last_error: str
    failed_calls: int
    failed_merges: int
    unmerged_evidence: float
    since_merge_s: float
    merges: int
    live_replicas: int
    leases_held: int
    alert_events_queued: int
    first_plans_held: int
    drift_evidence_dropped: int
    def __init__(self, backend: _Optional[str] = ..., url: _Optional[str] = ..., fleet: _Optional[str] = ..., up: _Optional[bool] = ..., outages: _Optional[int] = ..., down_for_s: _Optional[float] = ..., last_error: _Optional[str] = ..., failed_calls: _Optional[int] = ..., failed_merges: _Optional[int] = ..., unmerged_evidence: _Optional[float] = ..., since_merge_s: _Optional[float] = ..., merges: _Optional[int] = ..., live_replicas: _Optional[int] = ..., leases_held: _Optional[int] = ..., alert_events_queued: _Optional[int] = ..., first_plans_held: _Optional[int] = ..., drift_evidence_dropped: _Optional[int] = ...) -> None: ...
