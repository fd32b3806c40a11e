from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_AFTER_MISS: _ClassVar[RequestState]
    REQUEST_STATE_AFTER_HIT: _ClassVar[RequestState]
    REQUEST_STATE_RESTING: _ClassVar[RequestState]
    REQUEST_STATE_OTHER: _ClassVar[RequestState]

class AcceptanceRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCEPTANCE_RULE_UNSPECIFIED: _ClassVar[AcceptanceRule]
    ACCEPTANCE_RULE_STRICT: _ClassVar[AcceptanceRule]
    ACCEPTANCE_RULE_TYPICAL: _ClassVar[AcceptanceRule]

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_REASON_MALFORMED: _ClassVar[RejectReason]
    REJECT_REASON_NO_HELLO: _ClassVar[RejectReason]
    REJECT_REASON_INVALID_FIELD: _ClassVar[RejectReason]
    REJECT_REASON_UNKNOWN_REQUEST: _ClassVar[RejectReason]
    REJECT_REASON_STALE_STEP: _ClassVar[RejectReason]
    REJECT_REASON_UNKNOWN_PLAN: _ClassVar[RejectReason]
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_AFTER_MISS: RequestState
REQUEST_STATE_AFTER_HIT: RequestState
REQUEST_STATE_RESTING: RequestState
REQUEST_STATE_OTHER: RequestState
ACCEPTANCE_RULE_UNSPECIFIED: AcceptanceRule
ACCEPTANCE_RULE_STRICT: AcceptanceRule
ACCEPTANCE_RULE_TYPICAL: AcceptanceRule
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_REASON_MALFORMED: RejectReason
REJECT_REASON_NO_HELLO: RejectReason
REJECT_REASON_INVALID_FIELD: RejectReason
REJECT_REASON_UNKNOWN_REQUEST: RejectReason
REJECT_REASON_STALE_STEP: RejectReason
REJECT_REASON_UNKNOWN_PLAN: RejectReason

class Decision(_message.Message):
    __slots__ = ("depth", "width", "max_nodes")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    depth: int
    width: int
    max_nodes: int
    def __init__(self, depth: _Optional[int] = ..., width: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("version", "nonce", "batch_size_edges", "context_len_edges", "table", "policy", "created_at", "expected_goodput_tok_s", "classes", "default_class", "state_tables", "later_state_tables")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_EDGES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_EDGES_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GOODPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CLASS_FIELD_NUMBER: _ClassVar[int]
    STATE_TABLES_FIELD_NUMBER: _ClassVar[int]
    LATER_STATE_TABLES_FIELD_NUMBER: _ClassVar[int]
    version: int
    nonce: str
    batch_size_edges: _containers.RepeatedScalarFieldContainer[int]
    context_len_edges: _containers.RepeatedScalarFieldContainer[int]
    table: _containers.RepeatedCompositeFieldContainer[Decision]
    policy: str
    created_at: float
    expected_goodput_tok_s: float
    classes: _containers.RepeatedCompositeFieldContainer[ClassPlan]
    default_class: str
    state_tables: _containers.RepeatedCompositeFieldContainer[StatePlan]
    later_state_tables: _containers.RepeatedCompositeFieldContainer[StatePlan]
    def __init__(self, version: _Optional[int] = ..., nonce: _Optional[str] = ..., batch_size_edges: _Optional[_Iterable[int]] = ..., context_len_edges: _Optional[_Iterable[int]] = ..., table: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., policy: _Optional[str] = ..., created_at: _Optional[float] = ..., expected_goodput_tok_s: _Optional[float] = ..., classes: _Optional[_Iterable[_Union[ClassPlan, _Mapping]]] = ..., default_class: _Optional[str] = ..., state_tables: _Optional[_Iterable[_Union[StatePlan, _Mapping]]] = ..., later_state_tables: _Optional[_Iterable[_Union[StatePlan, _Mapping]]] = ...) -> None: ...

class StatePlan(_message.Message):
    __slots__ = ("state", "table")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    state: RequestState
    table: _containers.RepeatedCompositeFieldContainer[Decision]
    def __init__(self, state: _Optional[_Union[RequestState, str]] = ..., table: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ...) -> None: ...

class ClassPlan(_message.Message):
    __slots__ = ("name", "table", "acceptance_rule", "typical_epsilon", "typical_delta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RULE_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_EPSILON_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_DELTA_FIELD_NUMBER: _ClassVar[int]
    name: str
    table: _containers.RepeatedCompositeFieldContainer[Decision]
    acceptance_rule: AcceptanceRule
    typical_epsilon: float
    typical_delta: float
    def __init__(self, name: _Optional[str] = ..., table: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., acceptance_rule: _Optional[_Union[AcceptanceRule, str]] = ..., typical_epsilon: _Optional[float] = ..., typical_delta: _Optional[float] = ...) -> None: ...

class RequestDecision(_message.Message):
    __slots__ = ("request_id", "decision", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decision: Decision
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class RequestDecisions(_message.Message):
    __slots__ = ("version", "nonce", "decisions", "cleared")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    version: int
    nonce: str
    decisions: _containers.RepeatedCompositeFieldContainer[RequestDecision]
    cleared: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., nonce: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[RequestDecision, _Mapping]]] = ..., cleared: _Optional[_Iterable[str]] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("reason", "field", "detail", "step_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    reason: RejectReason
    field: str
    detail: str
    step_id: int
    def __init__(self, reason: _Optional[_Union[RejectReason, str]] = ..., field: _Optional[str] = ..., detail: _Optional[str] = ..., step_id: _Optional[int] = ...) -> None: ...

class TelemetryReceipt(_message.Message):
    __slots__ = ("last_step_id", "steps_received")
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    last_step_id: int
    steps_received: int
    def __init__(self, last_step_id: _Optional[int] = ..., steps_received: _Optional[int] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("plan", "request_decisions", "rejection", "receipt")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    request_decisions: RequestDecisions
    rejection: Rejection
    receipt: TelemetryReceipt
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., request_decisions: _Optional[_Union[RequestDecisions, _Mapping]] = ..., rejection: _Optional[_Union[Rejection, _Mapping]] = ..., receipt: _Optional[_Union[TelemetryReceipt, _Mapping]] = ...) -> None: ...
