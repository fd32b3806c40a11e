"""``specctl status``: the controller's view of its fleet, from GetStatus."""

from __future__ import annotations

import grpc
from rich.console import Console
from rich.table import Table

from controller.cost import CostParams
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2
from worker.security import ClientSecurity


def fetch_status(target: str, worker_id: str = "", timeout: float = 5.0,
                 security: ClientSecurity = ClientSecurity()) -> controller_pb2.GetStatusResponse:
    with security.channel(target) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        return stub.GetStatus(controller_pb2.GetStatusRequest(worker_id=worker_id), timeout=timeout,
                              metadata=security.metadata())


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


def cost_params(c: controller_pb2.CostModel) -> CostParams:
    """The fitted cost model of a ``GetStatus`` answer, as the controller holds it."""
    return CostParams(mem_ms=c.mem_ms, mem_ms_per_kv_token=c.mem_ms_per_kv_token, compute_ms=c.compute_ms,
                      compute_ms_per_token=c.compute_ms_per_token, compute_ms_per_pair=c.compute_ms_per_pair,
                      compute_knots=tuple(c.compute_knots), compute_rise_ms=tuple(c.compute_rise_ms),
                      draft_fixed_ms=c.draft_fixed_ms, draft_ms_per_level=c.draft_ms_per_level,
                      draft_ms_per_node=c.draft_ms_per_node, draft_ms_per_level_kv_token=c.draft_ms_per_level_kv_token,
                      catch_up_ms_per_token=c.catch_up_ms_per_token)


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


def render_status(status: controller_pb2.GetStatusResponse) -> list[Table]:
    workers = Table(title=f"workers (policy {status.policy}, reloads {status.policy_reloads}, "
                          f"refused reloads {status.policy_reload_failures})")
    for col in ("worker", "drafter", "connected", "plan v (acked)", "plan at this context: depth(×width) by batch",
                "steps", "batch", "ctx", "goodput tok/s", "est. speedup", "verify ms = max(mem, compute)",
                "fit rmse ms"):
        workers.add_column(col)
    acceptance = Table(title="acceptance per stratum (chain α per position, posterior mean)")
    for col in ("drafter version", "context", "α_1..α_k", "E[τ] chain", "samples α_1"):
        acceptance.add_column(col)
    seen = set()
    for w in status.workers:
        h, c = w.hello, w.cost_model
        kind = worker_pb2.DrafterKind.Name(h.drafter.kind).removeprefix("DRAFTER_KIND_").lower()
        speedup = estimated_speedup(w)
        workers.add_row(
            h.worker_id, f"{kind} {h.drafter.version}", "yes" if w.connected else "no",
            f"{w.plan_version} ({w.acked_plan_version})",
            plan_summary(w.plan, w.mean_context_len) if w.HasField("plan") else "–",
            str(w.steps_ingested), f"{w.mean_batch_size:.1f}",
            f"{w.mean_context_len:,.0f}", f"{w.observed_goodput_tok_s:,.0f}",
            f"{speedup:.2f}×" if speedup is not None else "–",
            f"max({c.mem_ms:.2f} + {c.mem_ms_per_kv_token:.2e}·kv, {compute_plane(c)})",
            f"{c.rmse_ms:.2f}",
        )
        for a in w.acceptance:
            key = (a.drafter_version, a.context_len_min)
            if key in seen or not a.effective_samples or a.effective_samples[0] < 1:
                continue
            seen.add(key)
            upper = f"{a.context_len_max:,}" if a.context_len_max else "∞"
            acceptance.add_row(a.drafter_version, f"[{a.context_len_min:,}, {upper})",
                               " ".join(f"{x:.2f}" for x in a.alpha), f"{a.expected_accepted_chain:.2f}",
                               f"{a.effective_samples[0]:.0f}")
    rejected = Table(title="rejected messages")
    rejected.add_column("reason")
    rejected.add_column("count", justify="right")
    for r in status.rejections:
        rejected.add_row(plan_pb2.RejectReason.Name(r.reason), str(r.count))
    return [workers, acceptance, rejected]


def print_status(target: str, worker_id: str = "", security: ClientSecurity = ClientSecurity()) -> int:
    console = Console()
    try:
        status = fetch_status(target, worker_id, security=security)
    except grpc.RpcError as err:
        console.print(f"[red]specctl status: {target}: {err.code().name}: {err.details()}[/]")
        return 1
    for table in render_status(status):
        console.print(table)
    return 0
