"""``specctl status``: the controller's view of its fleet, from GetStatus."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from controller.client import cost_params, fetch_status
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2
from worker.sdk.security import ClientSecurity


def plan_summary(plan: plan_pb2.Plan, context_len: float) -> str:
    """The plan's decisions by batch size in the context bucket of ``context_len``,
    runs of equal decisions merged: ``"b1-12: 5 · b16+: 2×2"`` (depth×width, "off")."""
    edges, contexts = list(plan.batch_size_edges), list(plan.context_len_edges)
    if not edges or not contexts or len(plan.table) != len(edges) * len(contexts):
        return "–"
    c = max(i for i, lo in enumerate(contexts) if context_len >= lo or i == 0)
    cells = []
    for b in range(len(edges)):
        d = plan.table[b * len(contexts) + c]
        cells.append("off" if d.depth == 0 else str(d.depth) if d.width <= 1 else f"{d.depth}×{d.width}")
    runs, start = [], 0
    for b in range(1, len(edges) + 1):
        if b == len(edges) or cells[b] != cells[start]:
            upper = f"-{edges[b] - 1}" if b < len(edges) and edges[b] - 1 > edges[start] else (
                "+" if b == len(edges) else "")
            runs.append(f"b{edges[start]}{upper}: {cells[start]}")
            start = b
    return " · ".join(runs)


def compute_plane(c: controller_pb2.CostModel) -> str:
    """``compute_ms + compute_ms_per_token·tok``, or for a fitted curve its value at a few batch sizes."""
    if not c.compute_knots:
        return f"{c.compute_ms:.2f} + {c.compute_ms_per_token:.2e}·tok"
    params = cost_params(c)
    points = [n for n in (1, 4, 16, 64, 256) if n >= c.compute_knots[0]]
    return "compute " + " ".join(f"{n}:{c.compute_ms + float(params.compute_curve_ms(n)):.1f}" for n in points)


def estimated_speedup(w: controller_pb2.WorkerStatus) -> float | None:
    """Goodput the plan was expected to give over plain decoding at the worker's
    mean batch and context, plain decoding priced by the fitted cost model."""
    b = max(w.mean_batch_size, 1.0)
    if not w.HasField("plan") or w.plan.expected_goodput_tok_s <= 0:
        return None
    kv = b * w.mean_context_len
    plain_ms = cost_params(w.cost_model).verify_ms(b, kv, kv)
    return w.plan.expected_goodput_tok_s / (1000.0 * b / plain_ms) if plain_ms > 0 else None


@dataclass
class Section:
    """One table of ``specctl status``: its title, column names and rows of text."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    right: tuple[str, ...] = ()  # columns justified right


def status_sections(status: controller_pb2.GetStatusResponse) -> list[Section]:
    workers = Section(f"workers (policy {status.policy}, reloads {status.policy_reloads}, "
                      f"refused reloads {status.policy_reload_failures})",
                      ("worker", "drafter", "connected", "plan v (acked)",
                       "plan at this context: depth(×width) by batch", "steps", "batch", "ctx", "goodput tok/s",
                       "est. speedup", "verify ms = max(mem, compute)", "fit rmse ms"))
    acceptance = Section("acceptance per stratum (chain α per position, posterior mean)",
                         ("drafter version", "context", "α_1..α_k", "E[τ] chain", "samples α_1"))
    seen = set()
    for w in status.workers:
        h, c = w.hello, w.cost_model
        kind = worker_pb2.DrafterKind.Name(h.drafter.kind).removeprefix("DRAFTER_KIND_").lower()
        speedup = estimated_speedup(w)
        workers.rows.append((
            h.worker_id, f"{kind} {h.drafter.version}", "yes" if w.connected else "no",
            f"{w.plan_version} ({w.acked_plan_version})",
            plan_summary(w.plan, w.mean_context_len) if w.HasField("plan") else "–",
            str(w.steps_ingested), f"{w.mean_batch_size:.1f}",
            f"{w.mean_context_len:,.0f}", f"{w.observed_goodput_tok_s:,.0f}",
            f"{speedup:.2f}×" if speedup is not None else "–",
            f"max({c.mem_ms:.2f} + {c.mem_ms_per_kv_token:.2e}·kv, {compute_plane(c)})",
            f"{c.rmse_ms:.2f}",
        ))
        for a in w.acceptance:
            key = (a.drafter_version, a.context_len_min)
            if key in seen or not a.effective_samples or a.effective_samples[0] < 1:
                continue
            seen.add(key)
            upper = f"{a.context_len_max:,}" if a.context_len_max else "∞"
            acceptance.rows.append((a.drafter_version, f"[{a.context_len_min:,}, {upper})",
                                    " ".join(f"{x:.2f}" for x in a.alpha), f"{a.expected_accepted_chain:.2f}",
                                    f"{a.effective_samples[0]:.0f}"))
    rejected = Section("rejected messages", ("reason", "count"), right=("count",))
    for r in status.rejections:
        rejected.rows.append((plan_pb2.RejectReason.Name(r.reason), str(r.count)))
    classes = class_section(status)
    replicas = replica_section(status)
    extra = [x for x in (classes, replicas) if x is not None]
    return [workers, acceptance, *extra, rejected]


def replica_section(status: controller_pb2.GetStatusResponse) -> Section | None:
    """Several replicas (``state.backend: redis``): each replica, whether it
    heartbeats, which workers it serves, and the shared store as the answering
    replica sees it. None with one controller."""
    if not status.replica_id:
        return None
    store = status.fleet_store
    health = ("up" if store.up else f"DOWN for {store.down_for_s:.0f} s ({store.last_error})") + \
        f", failed merges {store.failed_merges:,}, unmerged evidence {store.unmerged_evidence:,.0f}"
    section = Section(f"replicas (answered by {status.replica_id}; store {store.url}: {health})",
                      ("replica", "address", "live", "workers", "serving here"), right=("workers",))
    serving: dict[str, list[str]] = {}
    for p in status.placements:
        serving.setdefault(p.replica_id, []).append(p.worker_id)
    for r in status.replicas:
        names = sorted(serving.get(r.replica_id, ()))
        shown = ", ".join(names[:6]) + (f" … (+{len(names) - 6})" if len(names) > 6 else "")
        section.rows.append((r.replica_id + (" (this)" if r.replica_id == status.replica_id else ""), r.address,
                             "yes" if r.live else "NO", str(r.workers), shown or "–"))
    return section


def class_section(status: controller_pb2.GetStatusResponse) -> Section | None:
    """Request classes per worker: load, TPOT against the target, τ, drafting
    share, rule. None when no worker has classes (one class, ``default``, and
    no unknown name or typical-rule violation reported): the workers table
    then says it all."""
    if not any(len(w.classes) > 1 or w.unknown_class_request_steps or w.unknown_class_queries
               or w.typical_violations for w in status.workers):
        return None
    section = Section("request classes (recent; TPOT = step ms per emitted token, over requests of the last 30 s)",
                      ("worker", "class", "share", "TPOT p50 / p99 ms", "target ms", "τ", "drafting",
                       "acceptance", "request-steps", "unknown / violations"),
                      right=("share", "τ", "drafting", "request-steps"))
    for w in status.workers:
        for i, c in enumerate(w.classes):
            measured = c.tpot_ms_p50 if c.tpot_quantile == "p50" else c.tpot_ms_p99
            target = "–"
            if c.tpot_target_ms > 0:
                target = f"{c.tpot_target_ms:g} {c.tpot_quantile}"
                if c.tpot_requests and measured > c.tpot_target_ms:
                    target += " MISSED"
            rule = plan_pb2.AcceptanceRule.Name(c.acceptance_rule).removeprefix("ACCEPTANCE_RULE_").lower()
            section.rows.append((
                w.hello.worker_id if i == 0 else "", c.name + (" (default)" if c.is_default else ""),
                f"{c.share:.0%}",
                f"{c.tpot_ms_p50:.1f} / {c.tpot_ms_p99:.1f} ({c.tpot_requests})" if c.tpot_requests else "–",
                target, f"{c.tau:.2f}", f"{c.spec_fraction:.0%}", rule, f"{c.request_steps:,}",
                f"{w.unknown_class_request_steps + w.unknown_class_queries:,} / {w.typical_violations:,}"
                if i == 0 else "",
            ))
    return section


def section_table(section: Section) -> Table:
    """The section as one row per entry (what a wide terminal shows)."""
    table = Table(title=section.title)
    for col in section.columns:
        table.add_column(col, justify="right" if col in section.right else "left")
    for row in section.rows:
        table.add_row(*row)
    return table


def section_records(section: Section) -> Table:
    """The section as a ``field  value`` block per entry: fits a narrow terminal or a pipe."""
    table = Table(title=section.title, show_header=False, show_lines=False)
    table.add_column("field", no_wrap=True, style="bold")
    table.add_column("value", overflow="fold")
    for row in section.rows:
        for i, (col, value) in enumerate(zip(section.columns, row)):
            table.add_row(col, value, end_section=i == len(row) - 1)
    if not section.rows:
        table.add_row("(none)", "")
    return table


def render_status(status: controller_pb2.GetStatusResponse) -> list[Table]:
    return [section_table(s) for s in status_sections(status)]


def fitted(console: Console, section: Section) -> Table:
    """The section's table when it fits the console's width unwrapped, else its records."""
    table = section_table(section)
    # Measured without the console's bound, which would clamp the answer to the width itself.
    unbounded = console.options.update(width=10**6, min_width=1, max_width=10**6)
    if Measurement.get(console, unbounded, table).maximum <= console.width:
        return table
    return section_records(section)


def status_json(status: controller_pb2.GetStatusResponse) -> str:
    """The ``GetStatus`` answer as one JSON document (proto field names, zero values included)."""
    return json.dumps(json_format.MessageToDict(status, preserving_proto_field_name=True,
                                                always_print_fields_with_no_presence=True),
                      indent=1, ensure_ascii=False)


def print_status(target: str, worker_id: str = "", security: ClientSecurity = ClientSecurity(),
                 as_json: bool = False) -> int:
    """Print the controller's status: tables sized to the terminal (or ``COLUMNS``; 80 when piped),
    or with ``as_json`` one JSON document. Errors go to stderr."""
    try:
        status = fetch_status(target, worker_id, security=security)
    except grpc.RpcError as err:
        print(f"specctl status: {target}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if as_json:
        print(status_json(status))
        return 0
    console = Console()
    for section in status_sections(status):
        console.print(fitted(console, section))
    return 0
