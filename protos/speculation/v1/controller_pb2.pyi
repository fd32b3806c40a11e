from protos.speculation.v1 import worker_pb2 as _worker_pb2
from protos.speculation.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("request_id", "context_len", "batch_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_len: int
    batch_size: int
    def __init__(self, request_id: _Optional[str] = ..., context_len: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("mem_ms", "mem_ms_per_kv_token", "compute_ms", "compute_ms_per_token", "draft_fixed_ms", "draft_ms_per_level", "draft_ms_per_node", "samples", "rmse_ms", "draft_ms_per_level_kv_token")
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
    def __init__(self, mem_ms: _Optional[float] = ..., mem_ms_per_kv_token: _Optional[float] = ..., compute_ms: _Optional[float] = ..., compute_ms_per_token: _Optional[float] = ..., draft_fixed_ms: _Optional[float] = ..., draft_ms_per_level: _Optional[float] = ..., draft_ms_per_node: _Optional[float] = ..., samples: _Optional[int] = ..., rmse_ms: _Optional[float] = ..., draft_ms_per_level_kv_token: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("hello", "connected", "plan_version", "acked_plan_version", "nacks", "steps_ingested", "last_report_at", "cost_model", "acceptance", "mean_batch_size", "mean_context_len", "observed_goodput_tok_s", "plan")
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
    def __init__(self, hello: _Optional[_Union[_worker_pb2.Hello, _Mapping]] = ..., connected: _Optional[bool] = ..., plan_version: _Optional[int] = ..., acked_plan_version: _Optional[int] = ..., nacks: _Optional[int] = ..., steps_ingested: _Optional[int] = ..., last_report_at: _Optional[float] = ..., cost_model: _Optional[_Union[CostModel, _Mapping]] = ..., acceptance: _Optional[_Iterable[_Union[StratumAcceptance, _Mapping]]] = ..., mean_batch_size: _Optional[float] = ..., mean_context_len: _Optional[float] = ..., observed_goodput_tok_s: _Optional[float] = ..., plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ...) -> None: ...

class RejectionCount(_message.Message):
    __slots__ = ("reason", "count")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    reason: _plan_pb2.RejectReason
    count: int
    def __init__(self, reason: _Optional[_Union[_plan_pb2.RejectReason, str]] = ..., count: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("workers", "rejections", "policy", "policy_reloads", "policy_reload_failures")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_RELOADS_FIELD_NUMBER: _ClassVar[int]
    POLICY_RELOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    rejections: _containers.RepeatedCompositeFieldContainer[RejectionCount]
    policy: str
    policy_reloads: int
    policy_reload_failures: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., rejections: _Optional[_Iterable[_Union[RejectionCount, _Mapping]]] = ..., policy: _Optional[str] = ..., policy_reloads: _Optional[int] = ..., policy_reload_failures: _Optional[int] = ...) -> None: ...
