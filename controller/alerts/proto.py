"""``DriftAlert`` (the monitor's dataclass) ↔ ``speculation.v1.DriftAlert`` (the wire).

The dataclass carries ``None`` for "no p-value", "not resolved" and "not
acknowledged"; the message has ``has_p_value`` and zeros instead. The
dataclass's ``extra`` (detector details) has no field on the wire and comes
back empty.
"""

from __future__ import annotations

from controller.drift.alerts import Action, DriftAlert, Severity, Status
from controller.protocol import DRAFTER_KIND_NAMES
from protos.speculation.v1 import controller_pb2, worker_pb2

EVENTS = ("existing", "opened", "resolved", "acknowledged")
# WatchAlerts initial metadata: how many EXISTING alerts come before the live events
# (so a client listing alerts knows when the list is complete).
EXISTING_ALERTS_METADATA = "specctl-existing-alerts"
_KIND_NUMBERS = {name: number for number, name in DRAFTER_KIND_NAMES.items()}


def event_number(event: str) -> int:
    """``"opened"`` → ``ALERT_EVENT_OPENED``; raises ``ValueError`` naming an unknown event."""
    if event not in EVENTS:
        raise ValueError(f"event must be one of {', '.join(EVENTS)}, got {event!r}")
    return controller_pb2.AlertEvent.Value(f"ALERT_EVENT_{event.upper()}")


def event_name(number: int) -> str:
    """``ALERT_EVENT_OPENED`` → ``"opened"`` (``"unspecified"`` for 0)."""
    return controller_pb2.AlertEvent.Name(number).removeprefix("ALERT_EVENT_").lower()


def alert_to_proto(alert: DriftAlert, event: str = "existing") -> controller_pb2.DriftAlert:
    """The wire form of ``alert``, sent because of ``event``.

    >>> from controller.drift.alerts import Action, Severity
    >>> a = DriftAlert("drift-000007", "eagle", "v1", "ctx[0,1024)", 0, 1024, "", "chi2", 31.5, 1e-6, 4e-6, 2.0,
    ...                [5, 3], [7, 1], [0.6], [0.4], -0.2, 10.0, 12.0, Severity.CRITICAL, Action.RETRAIN_HEADS)
    >>> m = alert_to_proto(a, "opened")
    >>> controller_pb2.AlertAction.Name(m.action), m.has_p_value, event_name(m.event)
    ('ALERT_ACTION_RETRAIN_HEADS', True, 'opened')
    >>> alert_from_proto(m) == a
    True
    """
    has_p = alert.p_value is not None
    return controller_pb2.DriftAlert(
        id=alert.id,
        drafter_kind=_KIND_NUMBERS.get(alert.drafter_kind, worker_pb2.DRAFTER_KIND_UNSPECIFIED),
        drafter_version=alert.drafter_version,
        stratum=alert.stratum,
        context_len_min=alert.context_len_min,
        context_len_max=alert.context_len_max,
        domain=alert.domain,
        detector=alert.detector,
        statistic=alert.statistic,
        has_p_value=has_p,
        p_value=alert.p_value if has_p else 0.0,
        p_adjusted=alert.p_adjusted if alert.p_adjusted is not None else 0.0,
        score=alert.score,
        baseline_hist=alert.baseline_hist,
        current_hist=alert.current_hist,
        baseline_alpha=alert.baseline_alpha,
        current_alpha=alert.current_alpha,
        expected_tau_change=alert.expected_tau_change,
        first_seen=alert.first_seen,
        opened_at=alert.opened_at,
        severity=controller_pb2.AlertSeverity.Value(f"ALERT_SEVERITY_{alert.severity.value}"),
        action=controller_pb2.AlertAction.Value(f"ALERT_ACTION_{alert.action.value}"),
        message=alert.message,
        status=controller_pb2.AlertStatus.Value(f"ALERT_STATUS_{alert.status.value}"),
        resolved_at=alert.resolved_at or 0.0,
        resolution=alert.resolution,
        n_baseline=alert.n_baseline,
        n_current=alert.n_current,
        event=event_number(event),
        acked_at=alert.acked_at or 0.0,
        acked_by=alert.acked_by,
    )


def alert_from_proto(msg: controller_pb2.DriftAlert) -> DriftAlert:
    """The dataclass back from the wire (``extra`` empty); raises ``ValueError`` on unset enums."""
    def enum(cls, proto_enum, prefix: str, number: int, name: str):
        if number == 0:
            raise ValueError(f"{name} is unspecified in alert {msg.id!r}")
        return cls(proto_enum.Name(number).removeprefix(prefix))

    return DriftAlert(
        id=msg.id,
        drafter_kind=DRAFTER_KIND_NAMES.get(msg.drafter_kind, "unspecified"),
        drafter_version=msg.drafter_version,
        stratum=msg.stratum,
        context_len_min=msg.context_len_min,
        context_len_max=msg.context_len_max,
        domain=msg.domain,
        detector=msg.detector,
        statistic=msg.statistic,
        p_value=msg.p_value if msg.has_p_value else None,
        p_adjusted=msg.p_adjusted if msg.has_p_value else None,
        score=msg.score,
        baseline_hist=list(msg.baseline_hist),
        current_hist=list(msg.current_hist),
        baseline_alpha=list(msg.baseline_alpha),
        current_alpha=list(msg.current_alpha),
        expected_tau_change=msg.expected_tau_change,
        first_seen=msg.first_seen,
        opened_at=msg.opened_at,
        severity=enum(Severity, controller_pb2.AlertSeverity, "ALERT_SEVERITY_", msg.severity, "severity"),
        action=enum(Action, controller_pb2.AlertAction, "ALERT_ACTION_", msg.action, "action"),
        message=msg.message,
        status=enum(Status, controller_pb2.AlertStatus, "ALERT_STATUS_", msg.status, "status"),
        resolved_at=msg.resolved_at or None,
        resolution=msg.resolution,
        n_baseline=msg.n_baseline,
        n_current=msg.n_current,
        acked_at=msg.acked_at or None,
        acked_by=msg.acked_by,
    )
