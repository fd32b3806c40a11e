from protos.speculation.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_MEDUSA: _ClassVar[DrafterKind]
    DRAFTER_KIND_EAGLE: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_DRAFT_MODEL: _ClassVar[DrafterKind]
    DRAFTER_KIND_MTP: _ClassVar[DrafterKind]

class VerifyLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_LAYOUT_UNSPECIFIED: _ClassVar[VerifyLayout]
    VERIFY_LAYOUT_PACKED: _ClassVar[VerifyLayout]
    VERIFY_LAYOUT_PADDED: _ClassVar[VerifyLayout]
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_MEDUSA: DrafterKind
DRAFTER_KIND_EAGLE: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_DRAFT_MODEL: DrafterKind
DRAFTER_KIND_MTP: DrafterKind
VERIFY_LAYOUT_UNSPECIFIED: VerifyLayout
VERIFY_LAYOUT_PACKED: VerifyLayout
VERIFY_LAYOUT_PADDED: VerifyLayout

class Drafter(_message.Message):
    __slots__ = ("kind", "version", "max_depth", "max_width", "max_tree_nodes", "trained_context_len", "catch_up_window")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_WINDOW_FIELD_NUMBER: _ClassVar[int]
    kind: DrafterKind
    version: str
    max_depth: int
    max_width: int
    max_tree_nodes: int
    trained_context_len: int
    catch_up_window: int
    def __init__(self, kind: _Optional[_Union[DrafterKind, str]] = ..., version: _Optional[str] = ..., max_depth: _Optional[int] = ..., max_width: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., trained_context_len: _Optional[int] = ..., catch_up_window: _Optional[int] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("accelerator", "count", "memory_bandwidth_gb_s", "peak_tflops", "weight_bytes", "kv_bytes_per_token", "params")
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_GB_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    accelerator: str
    count: int
    memory_bandwidth_gb_s: float
    peak_tflops: float
    weight_bytes: float
    kv_bytes_per_token: float
    params: float
    def __init__(self, accelerator: _Optional[str] = ..., count: _Optional[int] = ..., memory_bandwidth_gb_s: _Optional[float] = ..., peak_tflops: _Optional[float] = ..., weight_bytes: _Optional[float] = ..., kv_bytes_per_token: _Optional[float] = ..., params: _Optional[float] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "engine", "model", "hardware", "drafter", "max_batch_size", "current_plan_version", "verify_layout", "calibration", "telemetry_loss")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERIFY_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_LOSS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    engine: str
    model: str
    hardware: Hardware
    drafter: Drafter
    max_batch_size: int
    current_plan_version: int
    verify_layout: VerifyLayout
    calibration: _containers.RepeatedCompositeFieldContainer[VerifySample]
    telemetry_loss: TelemetryLoss
    def __init__(self, worker_id: _Optional[str] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., drafter: _Optional[_Union[Drafter, _Mapping]] = ..., max_batch_size: _Optional[int] = ..., current_plan_version: _Optional[int] = ..., verify_layout: _Optional[_Union[VerifyLayout, str]] = ..., calibration: _Optional[_Iterable[_Union[VerifySample, _Mapping]]] = ..., telemetry_loss: _Optional[_Union[TelemetryLoss, _Mapping]] = ...) -> None: ...

class TelemetryLoss(_message.Message):
    __slots__ = ("steps_dropped", "steps_unconfirmed", "finished_dropped")
    STEPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEPS_UNCONFIRMED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_DROPPED_FIELD_NUMBER: _ClassVar[int]
    steps_dropped: int
    steps_unconfirmed: int
    finished_dropped: int
    def __init__(self, steps_dropped: _Optional[int] = ..., steps_unconfirmed: _Optional[int] = ..., finished_dropped: _Optional[int] = ...) -> None: ...

class VerifySample(_message.Message):
    __slots__ = ("batch_size", "batch_tokens", "kv_tokens", "verify_ms", "repeats")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    batch_tokens: int
    kv_tokens: int
    verify_ms: float
    repeats: int
    def __init__(self, batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., verify_ms: _Optional[float] = ..., repeats: _Optional[int] = ...) -> None: ...

class RequestStep(_message.Message):
    __slots__ = ("request_id", "context_len", "depth", "width", "nodes", "accepted", "accepted_rank", "level_candidates", "draft_confidence", "domain", "requested_depth", "requested_width", "requested_nodes", "caught_up_tokens", "request_class", "acceptance_rule", "shadows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_RANK_FIELD_NUMBER: _ClassVar[int]
    LEVEL_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_NODES_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RULE_FIELD_NUMBER: _ClassVar[int]
    SHADOWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_len: int
    depth: int
    width: int
    nodes: int
    accepted: int
    accepted_rank: _containers.RepeatedScalarFieldContainer[int]
    level_candidates: _containers.RepeatedScalarFieldContainer[int]
    draft_confidence: _containers.RepeatedScalarFieldContainer[float]
    domain: str
    requested_depth: int
    requested_width: int
    requested_nodes: int
    caught_up_tokens: int
    request_class: str
    acceptance_rule: _plan_pb2.AcceptanceRule
    shadows: _containers.RepeatedCompositeFieldContainer[ShadowDraft]
    def __init__(self, request_id: _Optional[str] = ..., context_len: _Optional[int] = ..., depth: _Optional[int] = ..., width: _Optional[int] = ..., nodes: _Optional[int] = ..., accepted: _Optional[int] = ..., accepted_rank: _Optional[_Iterable[int]] = ..., level_candidates: _Optional[_Iterable[int]] = ..., draft_confidence: _Optional[_Iterable[float]] = ..., domain: _Optional[str] = ..., requested_depth: _Optional[int] = ..., requested_width: _Optional[int] = ..., requested_nodes: _Optional[int] = ..., caught_up_tokens: _Optional[int] = ..., request_class: _Optional[str] = ..., acceptance_rule: _Optional[_Union[_plan_pb2.AcceptanceRule, str]] = ..., shadows: _Optional[_Iterable[_Union[ShadowDraft, _Mapping]]] = ...) -> None: ...

class ShadowDraft(_message.Message):
    __slots__ = ("context_len", "requested_depth", "depth", "accepted")
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    context_len: int
    requested_depth: int
    depth: int
    accepted: int
    def __init__(self, context_len: _Optional[int] = ..., requested_depth: _Optional[int] = ..., depth: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step_id", "timestamp", "batch_size", "draft_ms", "verify_ms", "requests", "catch_up_ms")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_MS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    timestamp: float
    batch_size: int
    draft_ms: float
    verify_ms: float
    requests: _containers.RepeatedCompositeFieldContainer[RequestStep]
    catch_up_ms: float
    def __init__(self, step_id: _Optional[int] = ..., timestamp: _Optional[float] = ..., batch_size: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., requests: _Optional[_Iterable[_Union[RequestStep, _Mapping]]] = ..., catch_up_ms: _Optional[float] = ...) -> None: ...

class StepReports(_message.Message):
    __slots__ = ("steps", "dropped_steps")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepReport]
    dropped_steps: int
    def __init__(self, steps: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ..., dropped_steps: _Optional[int] = ...) -> None: ...

class RequestFinished(_message.Message):
    __slots__ = ("request_id", "generated_tokens", "steps", "accepted_tokens", "timestamp")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_tokens: int
    steps: int
    accepted_tokens: int
    timestamp: float
    def __init__(self, request_id: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., timestamp: _Optional[float] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("version", "nonce")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    nonce: str
    def __init__(self, version: _Optional[int] = ..., nonce: _Optional[str] = ...) -> None: ...

class Nack(_message.Message):
    __slots__ = ("version", "nonce", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    nonce: str
    reason: str
    def __init__(self, version: _Optional[int] = ..., nonce: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "reports", "finished", "ack", "nack")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    reports: StepReports
    finished: RequestFinished
    ack: Ack
    nack: Nack
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., reports: _Optional[_Union[StepReports, _Mapping]] = ..., finished: _Optional[_Union[RequestFinished, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., nack: _Optional[_Union[Nack, _Mapping]] = ...) -> None: ...
