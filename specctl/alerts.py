"""``specctl alerts``: list, follow and acknowledge the controller's drift alerts.

* ``specctl alerts --controller HOST:PORT [--history] [--open-only]`` — a table of the alerts known now;
* ``specctl alerts --follow ...`` — those, then one line per event as it happens (until Ctrl-C);
* ``specctl alerts ack ID --controller HOST:PORT [--by NAME]`` — acknowledge one.

``--json`` prints one JSON object per alert or event instead, the same
``{"event": ..., "alert": {...}}`` the webhook sink posts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
from contextlib import contextmanager
from typing import Iterator

import grpc
from rich.console import Console
from rich.table import Table
from rich.text import Text

from controller.alerts.proto import EXISTING_ALERTS_METADATA, alert_from_proto, event_name
from controller.protocol import DRAFTER_KIND_NAMES
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc
from worker.sdk.security import ClientSecurity, ClientSecurityError, add_client_security_args


COLUMNS = ("id", "status", "action", "severity", "drafter", "stratum", "E[τ]", "detector", "opened", "resolved")


@contextmanager
def watch(target: str, request: controller_pb2.WatchAlertsRequest, security: ClientSecurity = ClientSecurity()
          ) -> Iterator[tuple[int, Iterator[controller_pb2.DriftAlert]]]:
    """A WatchAlerts stream as ``(existing, messages)``: the first ``existing`` messages are the alerts known
    when it started, the rest arrive as they happen (until the server ends the stream)."""
    with security.channel(target) as channel:
        call = controller_pb2_grpc.SpeculationControllerStub(channel).WatchAlerts(request,
                                                                                  metadata=security.metadata())
        try:
            metadata = dict(call.initial_metadata())
            if EXISTING_ALERTS_METADATA not in metadata:
                if not call.is_active():
                    next(iter(call), None)  # a failed call raises its RpcError here
                raise ValueError(f"{target} did not say how many alerts exist "
                                 f"(no {EXISTING_ALERTS_METADATA} metadata): not a specctl controller?")
            yield int(metadata[EXISTING_ALERTS_METADATA]), iter(call)
        finally:
            call.cancel()


def fetch_alerts(target: str, history: bool = False, open_only: bool = False, drafter_version: str = "",
                 security: ClientSecurity = ClientSecurity()) -> list[controller_pb2.DriftAlert]:
    """The alerts the controller knows now (its store's history too with ``history``)."""
    request = controller_pb2.WatchAlertsRequest(include_history=history, open_only=open_only,
                                                drafter_version=drafter_version)
    with watch(target, request, security) as (existing, messages):
        return [next(messages) for _ in range(existing)]


def ack_alert(target: str, alert_id: str, by: str, security: ClientSecurity = ClientSecurity(),
              timeout: float = 10.0) -> controller_pb2.DriftAlert:
    with security.channel(target) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        return stub.AckAlert(controller_pb2.AckAlertRequest(alert_id=alert_id, acked_by=by), timeout=timeout,
                             metadata=security.metadata()).alert


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else ""


def _name(enum, number: int, prefix: str) -> str:
    return enum.Name(number).removeprefix(prefix)


def describe(msg: controller_pb2.DriftAlert) -> dict[str, str]:
    """The ``COLUMNS`` of an alert."""
    kind = DRAFTER_KIND_NAMES.get(msg.drafter_kind, "unspecified")
    status = _name(controller_pb2.AlertStatus, msg.status, "ALERT_STATUS_")
    return {
        "id": msg.id,
        "status": status + (f" (acked by {msg.acked_by or '?'})" if msg.acked_at else ""),
        "action": _name(controller_pb2.AlertAction, msg.action, "ALERT_ACTION_"),
        "severity": _name(controller_pb2.AlertSeverity, msg.severity, "ALERT_SEVERITY_"),
        "drafter": f"{kind}/{msg.drafter_version}",
        "stratum": msg.stratum,
        "E[τ]": f"{msg.expected_tau_change:+.1%}",
        "detector": msg.detector,
        "opened": _when(msg.opened_at),
        "resolved": f"{_when(msg.resolved_at)} {msg.resolution}".strip(),
    }


def render_alerts(alerts: list[controller_pb2.DriftAlert], title: str) -> Table:
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for msg in alerts:
        table.add_row(*(Text(v) for v in describe(msg).values()))
    return table


def event_line(msg: controller_pb2.DriftAlert) -> str:
    """One line per event for ``--follow``."""
    d = describe(msg)
    at = {controller_pb2.ALERT_EVENT_ACKNOWLEDGED: msg.acked_at,
          controller_pb2.ALERT_EVENT_RESOLVED: msg.resolved_at}.get(msg.event, msg.opened_at)
    return (f"{_when(at)} {event_name(msg.event).upper():<12} {d['id']} {d['status']} {d['action']} "
            f"{d['severity']} {d['drafter']} {d['stratum']} E[τ] {d['E[τ]']}  {msg.message}")


def event_json(msg: controller_pb2.DriftAlert) -> str:
    return json.dumps({"event": event_name(msg.event), "alert": alert_from_proto(msg).to_dict()})


def run_alerts(args: argparse.Namespace) -> int:
    console = Console(highlight=False, markup=False, soft_wrap=True)
    try:
        security = ClientSecurity.from_args(args)
        action = list(args.action)
        if action and (action[0] != "ack" or len(action) != 2):
            raise ValueError(f"unknown arguments {' '.join(action)!r}: the only sub-command is `ack ID`")
        if action and args.follow:
            raise ValueError("--follow lists and follows; it does not go with `ack`")
    except (ClientSecurityError, ValueError) as err:
        console.print(f"specctl alerts: {err}", style="red")
        return 2
    try:
        if action:
            alert = ack_alert(args.controller, action[1], args.by or getpass.getuser(), security)
            console.print(event_json(alert) if args.json else
                          f"{alert.id} acknowledged by {alert.acked_by} at {_when(alert.acked_at)}: "
                          f"{describe(alert)['status']}, {alert.message}")
            return 0
        request = controller_pb2.WatchAlertsRequest(include_history=args.history, open_only=args.open_only,
                                                    drafter_version=args.drafter_version)
        if not args.follow:
            alerts = fetch_alerts(args.controller, args.history, args.open_only, args.drafter_version, security)
            if args.json:
                for msg in alerts:
                    console.print(event_json(msg))
            else:
                console.print(render_alerts(alerts, f"drift alerts at {args.controller}"
                                            + (" (with history)" if args.history else "")))
            return 0
        with watch(args.controller, request, security) as (_, messages):
            for msg in messages:
                console.print(event_json(msg) if args.json else event_line(msg))
                console.file.flush()
        return 0
    except grpc.RpcError as err:
        console.print(f"specctl alerts: {args.controller}: {err.code().name}: {err.details()}", style="red")
        return 1
    except ValueError as err:
        console.print(f"specctl alerts: {err}", style="red")
        return 1
    except KeyboardInterrupt:
        return 0


def add_alerts_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("alerts", help="list, follow (--follow) or acknowledge (ack ID) drift alerts",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="*", metavar="ack ID", help="acknowledge alert ID")
    parser.add_argument("--controller", default="127.0.0.1:50051", help="HOST:PORT of the controller")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing each event as it happens")
    parser.add_argument("--history", action="store_true", help="also resolved alerts from the controller's store")
    parser.add_argument("--open-only", action="store_true", help="only alerts still open")
    parser.add_argument("--drafter-version", default="", help="only this drafter version's alerts")
    parser.add_argument("--by", default="", help="with ack: who acknowledges (default: your user name)")
    parser.add_argument("--json", action="store_true", help="one JSON object per alert or event")
    add_client_security_args(parser)
    parser.set_defaults(func=run_alerts)
