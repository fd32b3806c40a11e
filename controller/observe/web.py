"""The controller's read-only web view: ``/`` (status page), ``/status.json``, ``/metrics``.

``render_page`` turns a ``StatusHistory.snapshot`` into one HTML page with
inline SVG charts (``controller.observe.charts``): no script, no external request,
refreshed by the browser every ``REFRESH_S`` seconds. Per worker and drafter
version it shows the three things an operator watches together — the plan
in force (a heat-map of depth × width per batch and context bucket),
acceptance per draft position and the accepted-length distribution over
time, and the estimated end-to-end speedup over time — with drafter
roll-outs and drift alerts marked on the same time axis, and a fleet-wide
timeline of those head-retraining events. Its request classes get a table
(share, TPOT p50 / p99 against the target, τ, speculation share, acceptance
rule) and, when the policy has more than one, TPOT p99 per class over time.

``StatusSite`` owns the history and the HTTP server. Snapshots are taken on
the event loop (cheap copies, in slices that yield to the loop between
workers); the metrics text, the page and the JSON are rendered in a worker
thread.
"""

from __future__ import annotations

import asyncio
import json
import math
from html import escape
from typing import TYPE_CHECKING, Any, Sequence

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from controller.observe.charts import Bar, Marker, Point, Series, Span, clock_label, heatmap, line_chart, stacked_chart, timeline
from controller.observe.history import MIN_TRIALS, StatusHistory
from controller.observe.http import HttpServer, Request, Response
from controller.observe.metrics import render_metrics, take_snapshot
from policies.table import bucket_index

if TYPE_CHECKING:
    from controller.alerts.alerting import DriftAlerting
    from controller.core import Controller

REFRESH_S = 10
MAX_WORKER_SECTIONS = 16  # workers with charts on the page; any other: /?worker=ID
SAMPLE_CPU_FRACTION = 0.1  # share of a housekeeping tick the history sampling may use

# Series colours, chosen to be distinct from one another and from every other
# colour on the page (the browser test finds the plotted series by them).
POSITION_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                   "#bcbd22", "#7f7f7f")
TAU_COLORS = ("#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#a0da39", "#fde725",
              "#f0a0a0", "#c0c0ff")
SPEEDUP_COLOR = "#c51b8a"
EXPECTED_COLOR = "#9e9ac8"
ESTIMATED_COLOR = "#54278f"
REALISED_COLOR = "#006d2c"
ROLLOUT_COLOR = "#08519c"
DEPTH_COLORS = ("#f2f2f2", "#ffffb2", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#800026")
CLASS_COLORS = ("#e7298a", "#1b9e77", "#d95f02", "#7570b3", "#66a61e", "#e6ab02", "#a6761d", "#666666")
SEVERITY_COLORS = {"CRITICAL": "#99000d", "WARNING": "#e6550d", "INFO": "#fdae6b"}

CSS = """
body { font-family: DejaVu Sans, Liberation Sans, Arial, sans-serif; margin: 16px; color: #222; background: #f6f6f6; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 18px 0 6px 0; }
.meta { color: #555; font-size: 13px; margin-bottom: 8px; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 4px; padding: 8px 10px; margin: 10px 0; }
.row { display: flex; flex-wrap: wrap; gap: 8px; }
.chart { border: 1px solid #e6e6e6; }
table { border-collapse: collapse; font-size: 12px; background: #fff; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; }
th { background: #eee; }
.off { color: #999; } .bad { color: #a50f15; font-weight: bold; }
"""


def _short(n: int) -> str:
    """Token counts as 1k, 128k."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "–" if v is None else format(v, spec)


def _time_range(snapshot: dict[str, Any]) -> tuple[float, float]:
    """From the oldest sample kept (of any worker) to now, stretched by at most
    a tenth to show the events just before it (a worker's first Hello)."""
    now = snapshot["now"]
    starts = [w["history"]["t"][0] for w in snapshot["workers"] if w["detail"] and w["history"]["t"]]
    start = min(min(starts) if starts else now - 60.0, now - 1.0)
    earliest = start - 0.1 * (now - start)
    events = [r["t"] for r in snapshot["rollouts"]] + [a["opened_at"] for a in snapshot["alerts"]]
    return (min([start] + [t for t in events if t >= earliest]), now)


def _alert_end(alert: dict[str, Any], now: float) -> float:
    return alert["resolved_at"] if alert.get("resolved_at") is not None else now


def _depth_color(depth: float) -> str:
    return DEPTH_COLORS[min(int(depth), len(DEPTH_COLORS) - 1)]


def _cell_text(depth: int, width: int) -> str:
    if depth == 0:
        return "off"
    return str(depth) if width <= 1 else f"{depth}×{width}"


# ------------------------------------------------------------------ charts
def _decision_heatmap(worker: dict[str, Any], title: str, chart_id: str, depth: Sequence[Sequence[int]],
                      width: Sequence[Sequence[int]], legend: Sequence[tuple[str, str]] = ()) -> str:
    """One decision table of the worker's plan in force (``depth``, ``width``: its cells by
    batch row and context column) as a heat-map coloured by depth, the worker's current load
    outlined."""
    plan = worker["plan"]
    highlight = (bucket_index(plan["batch_edges"], round(worker["mean_batch_size"])),
                 bucket_index(plan["context_edges"], int(worker["mean_context_len"])))
    texts = [[_cell_text(d, w) for d, w in zip(drow, wrow)] for drow, wrow in zip(depth, width)]
    return heatmap(title, chart_id, [str(b) for b in plan["batch_edges"]],
                   [_short(c) for c in plan["context_edges"]], depth, texts, _depth_color,
                   x_label="context length (bucket from)", y_label="batch size (bucket from)", highlight=highlight,
                   legend=legend, width=400, height=320)


def plan_heatmap(worker: dict[str, Any]) -> str:
    wid = worker["worker_id"]
    plan = worker["plan"]
    title = f"Plan v{worker['acked_plan_version']} in force: draft depth×width"
    if plan is None:
        return heatmap(title, f"plan-{wid}", [], [], [], [], _depth_color, width=400, height=320)
    deepest = max(max(row) for row in plan["depth"])
    legend = [("off", DEPTH_COLORS[0])] + [(f"d{d}", _depth_color(d)) for d in range(1, max(deepest, 1) + 1)]
    return _decision_heatmap(worker, title, f"plan-{wid}", plan["depth"], plan["width"], legend)


def state_heatmaps(worker: dict[str, Any]) -> list[str]:
    """One heat-map per request-state table of the plan in force: ``state_tables``
    (AFTER_MISS, AFTER_HIT), then ``later_state_tables`` (RESTING, OTHER)."""
    plan, wid = worker["plan"], worker["worker_id"]
    if plan is None:
        return []
    return [_decision_heatmap(worker, f"Request state {st['name']} ({field}): draft depth×width",
                              f"state-{st['name']}-{wid}", st["depth"], st["width"])
            for field in ("state_tables", "later_state_tables") for st in plan.get(field) or []]


def _events_for(worker: dict[str, Any], snapshot: dict[str, Any]) -> tuple[list[Marker], list[Span]]:
    """Roll-outs of this worker and alerts on any drafter version it ran."""
    wid = worker["worker_id"]
    markers = [Marker(r["t"], r["drafter_version"], ROLLOUT_COLOR)
               for r in snapshot["rollouts"] if r["worker_id"] == wid and r["previous_version"] is not None]
    versions = set(worker["history"]["drafter_version"]) | {worker["drafter_version"]}
    spans = [Span(a["opened_at"], _alert_end(a, snapshot["now"]), f"{a['id']} {a['action']} {a['stratum']}",
                  SEVERITY_COLORS.get(a["severity"], "#e6550d"))
             for a in snapshot["alerts"] if a["drafter_version"] in versions]
    return markers, spans


def worker_charts(worker: dict[str, Any], snapshot: dict[str, Any], x_range: tuple[float, float]) -> list[str]:
    h, wid = worker["history"], worker["worker_id"]
    markers, spans = _events_for(worker, snapshot)
    positions = max((len(a) for a in h["alpha"]), default=0)
    alpha = [Series(f"α{k + 1}", POSITION_COLORS[k % len(POSITION_COLORS)], h["t"],
                    [a[k] if k < len(a) else None for a in h["alpha"]])
             for k in range(positions)]
    alpha = [s for s in alpha if any(y is not None for y in s.ys)]
    depth = max((len(s) for s in h["tau_share"] if s), default=0)
    layers = [(f"τ={t}", TAU_COLORS[t % len(TAU_COLORS)]) for t in range(depth)]
    return [
        plan_heatmap(worker),
        *state_heatmaps(worker),
        line_chart("Acceptance per draft position", f"alpha-{wid}", alpha, x_range, y_range=(0.0, 1.0),
                   y_label="α (accepted / drafted)", markers=markers, spans=spans, width=390, height=320,
                   bridge_gaps=True),
        stacked_chart("Accepted length τ distribution", f"tau-{wid}", h["t"], layers, h["tau_share"], x_range,
                      markers=markers, spans=spans, width=390, height=320),
        line_chart("Estimated end-to-end speedup (plan vs speculation off)", f"speedup-{wid}",
                   [Series("speedup", SPEEDUP_COLOR, h["t"], h["speedup"])], x_range, y_label="×", reference=1.0,
                   markers=markers, spans=spans, width=600, height=240),
        line_chart("Goodput (tokens/s)", f"goodput-{wid}",
                   [Series("expected at push", EXPECTED_COLOR, h["t"], h["expected_goodput"]),
                    Series("estimated now", ESTIMATED_COLOR, h["t"], h["estimated_goodput"]),
                    Series("realised", REALISED_COLOR, h["t"], h["realised_goodput"])],
                   x_range, y_label="tok/s", markers=markers, spans=spans, width=600, height=240),
    ]


def class_tpot_chart(worker: dict[str, Any], snapshot: dict[str, Any], x_range: tuple[float, float]) -> str:
    """TPOT p99 of each request class over time (ms per output token)."""
    h, wid = worker["history"], worker["worker_id"]
    markers, spans = _events_for(worker, snapshot)
    samples = h.get("class_tpot") or []
    series = []
    for i, c in enumerate(worker.get("classes") or []):
        name = c["name"]
        target = f" (target {c['tpot_target_ms']:g} {c['tpot_quantile']})" if c.get("tpot_target_ms") else ""
        ys = [s[name][1] if s and s.get(name) else None for s in samples]
        series.append(Series(f"{name} p99{target}", CLASS_COLORS[i % len(CLASS_COLORS)], h["t"][:len(ys)], ys))
    return line_chart("TPOT p99 per request class", f"tpot-{wid}", series, x_range, y_label="ms / token",
                      markers=markers, spans=spans, width=600, height=240)


def classes_table(worker: dict[str, Any]) -> str:
    """One row per request class of the worker."""
    rows = []
    for c in worker.get("classes") or []:
        target = c.get("tpot_target_ms")
        p50, p99 = c.get("tpot_ms_p50"), c.get("tpot_ms_p99")
        measured = p50 if c.get("tpot_quantile") == "p50" else p99
        over = target is not None and measured is not None and measured > target
        rows.append([
            escape(c["name"]) + (" (default)" if c.get("is_default") else ""),
            f"{c['weight']:g}", f"{c['share']:.1%}",
            _fmt(p50, ".1f"), (f'<span class="bad">{_fmt(p99, ".1f")}</span>' if over and c["tpot_quantile"] == "p99"
                              else _fmt(p99, ".1f")),
            "–" if target is None else f"{target:g} ({escape(c['tpot_quantile'])})"
            + (' <span class="bad">missed</span>' if over else ""),
            str(c.get("tpot_requests", 0)), f"{c['tau']:.2f}", f"{c['spec_fraction']:.0%}",
            f"{c['tokens_per_step']:.2f}", escape(c.get("acceptance", "strict")), f"{c.get('request_steps', 0):,}",
            _cell_text(*c["decision_now"]) if c.get("decision_now") else "–",
        ])
    unknown = worker.get("unknown_class_request_steps", 0) + worker.get("unknown_class_queries", 0)
    violations = worker.get("typical_violations", 0)
    note = ""
    if unknown or violations:
        note = (f'<p class="meta"><span class="bad">{unknown:,} request-step(s) and quer(ies) named an unknown '
                f"class (served as the default) · {violations:,} typical-rule step(s) of a strict class "
                "(acceptance not used)</span></p>")
    return _table(["class", "weight", "share", "TPOT p50 ms", "TPOT p99 ms", "target ms", "requests", "τ",
                   "drafting", "tokens/step", "acceptance", "request-steps", "plan now"], rows,
                  f"classes-{escape(worker['worker_id'])}") + note


def events_timeline(snapshot: dict[str, Any], x_range: tuple[float, float]) -> str:
    """One lane per drafter version: roll-outs (diamonds) and drift alerts (bars)."""
    lanes: list[str] = []
    lane_of: dict[tuple[str, str], int] = {}

    def lane(kind: str, version: str) -> int:
        key = (kind, version)
        if key not in lane_of:
            lane_of[key] = len(lanes)
            lanes.append(f"{kind} {version}")
        return lane_of[key]

    for w in snapshot["workers"]:
        lane(w["drafter_kind"], w["drafter_version"])
    points = [Point(lane(r["drafter_kind"], r["drafter_version"]), r["t"], ROLLOUT_COLOR,
                    f"{r['worker_id']}" + (f" from {r['previous_version']}" if r["previous_version"] else " joined"))
              for r in snapshot["rollouts"]]
    bars = [Bar(lane(a["drafter_kind"], a["drafter_version"]), a["opened_at"], _alert_end(a, snapshot["now"]),
                SEVERITY_COLORS.get(a["severity"], "#e6550d"), f"{a['action']} {a['stratum']}")
            for a in snapshot["alerts"]]
    legend = [("roll-out", ROLLOUT_COLOR)] + [(f"alert {s.lower()}", c) for s, c in SEVERITY_COLORS.items()]
    return timeline("Head retraining events: drafter roll-outs and drift alerts per drafter version", "events",
                    lanes, bars, points, x_range, legend=legend)


# ------------------------------------------------------------------ tables
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], table_id: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _link_text(w: dict[str, Any]) -> str:
    """Connected or not, how (stream or Decide only), and why not."""
    how = w.get("session", "stream")
    if w["connected"]:
        return f"yes ({how})"
    why = f", silent {w.get('idle_s', 0.0):,.0f} s" if w.get("expired") else ""
    return f'<span class="off">no{escape(why)}</span>'


def _loss_text(w: dict[str, Any]) -> str:
    """The worker's own count of telemetry it lost (Hello.telemetry_loss)."""
    loss = w.get("telemetry_loss") or {}
    dropped, unconfirmed = loss.get("steps_dropped", 0), loss.get("steps_unconfirmed", 0)
    if not dropped and not unconfirmed:
        return "0"
    return f'<span class="bad">{dropped:,} dropped · {unconfirmed:,} unconfirmed</span>'


def fleet_table(snapshot: dict[str, Any]) -> str:
    rows = []
    for w in snapshot["workers"]:
        rows.append([
            f'<a href="?worker={escape(w["worker_id"])}">{escape(w["worker_id"])}</a>',
            escape(f"{w['drafter_kind']} {w['drafter_version']}"),
            _link_text(w),
            f"{w['plan_version']} ({w['acked_plan_version']})",
            f"{w['nacks']}" if not w["nacks"] else f'<span class="bad">{w["nacks"]}</span>',
            f"{w['steps']:,}", _loss_text(w), f"{w['mean_batch_size']:.1f}", f"{w['mean_context_len']:,.0f}",
            _fmt(w["realised_goodput_tok_s"]), _fmt(w["estimated_speedup"], ".2f") + "×",
        ])
    return _table(["worker", "drafter", "connected", "plan v (acked)", "nacks", "steps", "steps lost (worker's count)",
                   "batch", "context", "realised tok/s", "est. speedup"], rows, "fleet")


def alerts_table(snapshot: dict[str, Any]) -> str:
    alerts = [a for a in snapshot["alerts"] if a["status"] == "OPEN"]
    if not snapshot["drift_monitor"]:
        return '<p class="meta">No drift monitor is running on this controller.</p>'
    if not alerts:
        return '<p class="meta">No open drift alerts.</p>'
    rows = [[escape(a["id"]), escape(f"{a['drafter_kind']} {a['drafter_version']}"), escape(a["stratum"]),
             f'<span class="bad">{escape(a["action"])}</span>', escape(a["severity"]), clock_label(a["opened_at"]),
             f"{a['score']:.2f}", f"{a['expected_tau_change']:+.1%}" if a["expected_tau_change"] is not None else "–",
             escape(a["message"])]
            for a in alerts]
    return _table(["alert", "drafter", "stratum", "action", "severity", "opened", "score", "Δ E[τ]", "message"],
                  rows, "alerts")


def rejections_table(snapshot: dict[str, Any]) -> str:
    if not snapshot["rejections"]:
        return '<p class="meta">No message rejected.</p>'
    return _table(["reason", "count"], [[escape(r), f"{n:,}"] for r, n in snapshot["rejections"].items()],
                  "rejections")


# -------------------------------------------------------------------- page
def render_page(snapshot: dict[str, Any]) -> str:
    """The whole status page for ``snapshot`` (``StatusHistory.snapshot``)."""
    x_range = _time_range(snapshot)
    workers = snapshot["workers"]
    open_alerts = sum(1 for a in snapshot["alerts"] if a["status"] == "OPEN")
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">',
        f"<title>specctl status</title><style>{CSS}</style></head><body>",
        "<h1>specctl controller status</h1>",
        f'<div class="meta">policy <b>{escape(snapshot["policy"])}</b> · {len(workers)} worker(s) · '
        f'{open_alerts} open drift alert(s) · {sum(snapshot["rejections"].values()):,} rejected message(s) · '
        f'policy reloads {snapshot["policy_reloads"]} (refused {snapshot["policy_reload_failures"]}) · '
        f'as of {clock_label(snapshot["now"])} · <a href="status.json">status.json</a> · '
        f'<a href="metrics">metrics</a></div>',
        '<div class="card">', fleet_table(snapshot), "</div>",
        '<div class="card">', events_timeline(snapshot, x_range), "<h2>Open drift alerts</h2>",
        alerts_table(snapshot), "<h2>Rejected messages</h2>", rejections_table(snapshot), "</div>",
    ]
    detailed = [w for w in workers if w["detail"]]
    for w in detailed:
        versions = sorted(set(w["history"]["drafter_version"]) - {w["drafter_version"]})
        parts += [
            f'<div class="card worker" id="worker-{escape(w["worker_id"])}">',
            f'<h2>worker {escape(w["worker_id"])} · drafter {escape(w["drafter_kind"])} '
            f'{escape(w["drafter_version"])}</h2>',
            f'<div class="meta">{escape(w["engine"])} · {escape(w["model"])} · {escape(w["accelerator"])} · '
            f'{"connected" if w["connected"] else "disconnected"} · plan v{w["plan_version"]} '
            f'(acked {w["acked_plan_version"]}) · batch {w["mean_batch_size"]:.1f} · '
            f'context {w["mean_context_len"]:,.0f} · realised {_fmt(w["realised_goodput_tok_s"])} tok/s · '
            f'telemetry lost: {_loss_text(w)}'
            + (f' · earlier versions in view: {escape(", ".join(versions))}' if versions else "") + "</div>",
            '<div class="row">', *worker_charts(w, snapshot, x_range),
            *([class_tpot_chart(w, snapshot, x_range)] if len(w.get("classes") or []) > 1 else []), "</div>",
            *(["<h2>Request classes</h2>", classes_table(w)] if w.get("classes") else []), "</div>",
        ]
    if len(workers) > len(detailed):
        parts.append(f'<p class="meta">{len(workers) - len(detailed)} more worker(s): pick one in the table '
                     f"above.</p>")
    parts.append('<p class="meta">Read-only view. α of a position: accepted over reached (the positions before it '
                 f"accepted); α and τ shares are measured since their previous value, over at least {MIN_TRIALS} "
                 "request-steps. Speedup and estimated goodput use the controller's current cost and acceptance "
                 "models at the worker's current load. Dashed lines: drafter roll-outs; shaded: drift alerts. "
                 "TPOT of a request: its steps' draft, verify and catch-up time over the tokens they emitted; a "
                 "class's p50 / p99 are over its requests seen in the last 30 s.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _json_safe(value: Any) -> Any:
    """Non-finite floats become ``None`` (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def render_json(snapshot: dict[str, Any]) -> bytes:
    return json.dumps(_json_safe(snapshot), allow_nan=False, separators=(",", ":")).encode()


class StatusSite:
    """History, metrics and HTTP listener of one controller.

    Parameters
    ----------
    controller
        The controller to show.
    history_samples
        Samples kept per worker (``status_history_samples``).
    alerting
        The server's drift alerting (``None`` when the monitor is off).
    sample_interval_s
        Time between two samples of a worker (``status_sample_interval_s``).
    plan_cells
        Export every plan cell as a metric (``metrics_plan_cells``).
    """

    def __init__(self, controller: "Controller", history_samples: int = 720, alerting: "DriftAlerting | None" = None,
                 sample_interval_s: float = 5.0, plan_cells: bool = True) -> None:
        self.controller = controller
        self.alerting = alerting
        self.sample_interval_s = sample_interval_s
        self.plan_cells = plan_cells
        self.history = StatusHistory(controller, capacity=history_samples, alerting=alerting)
        self.fleet = None  # controller.fleet.replica.FleetReplica (state.backend: redis): its metrics too
        self.http = HttpServer({"/": self.page, "/status.json": self.status_json, "/metrics": self.metrics})

    async def start(self, listen: str) -> int:
        """Listen on ``listen`` (``HOST:0`` picks a free port); returns the port."""
        return await self.http.start(listen)

    async def stop(self) -> None:
        await self.http.stop()

    def tick(self, tick_s: float) -> None:
        """Housekeeping: sample the workers that are due, within ``SAMPLE_CPU_FRACTION`` of the tick."""
        self.history.sample_due(self.sample_interval_s, tick_s * SAMPLE_CPU_FRACTION)

    async def metrics(self, request: Request) -> Response:
        snapshot = take_snapshot(self.controller, self.history, self.alerting, self.plan_cells, self.fleet)
        body = await asyncio.to_thread(render_metrics, snapshot)
        return Response(200, body, CONTENT_TYPE_PLAIN_0_0_4)

    async def page(self, request: Request) -> Response:
        snapshot = await self.history.snapshot_async(request.query.get("worker", ""), detailed=MAX_WORKER_SECTIONS)
        html = await asyncio.to_thread(render_page, snapshot)
        return Response(200, html.encode(), "text/html; charset=utf-8")

    async def status_json(self, request: Request) -> Response:
        snapshot = await self.history.snapshot_async(request.query.get("worker", ""), detailed=MAX_WORKER_SECTIONS)
        return Response(200, await asyncio.to_thread(render_json, snapshot), "application/json")
