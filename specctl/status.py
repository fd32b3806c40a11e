"""``specctl status``: the controller's view of its fleet, from GetStatus."""

from __future__ import annotations

import grpc
from rich.console import Console
from rich.table import Table

from protos.speculation.v1 import controller_pb2, controller_pb2_grpc, plan_pb2, worker_pb2


def fetch_status(target: str, worker_id: str = "", timeout: float = 5.0) -> controller_pb2.GetStatusResponse:
    with grpc.insecure_channel(target) as channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        return stub.GetStatus(controller_pb2.GetStatusRequest(worker_id=worker_id), timeout=timeout)


def render_status(status: controller_pb2.GetStatusResponse) -> list[Table]:
    workers = Table(title=f"workers (policy {status.policy}, reloads {status.policy_reloads}, "
                          f"refused reloads {status.policy_reload_failures})")
    for col in ("worker", "drafter", "connected", "plan v (acked)", "steps", "batch", "ctx",
                "goodput tok/s", "verify ms = max(mem, compute)", "fit rmse ms"):
        workers.add_column(col)
    acceptance = Table(title="acceptance per stratum (chain α per position, posterior mean)")
    for col in ("drafter version", "context", "α_1..α_k", "E[τ] chain", "samples α_1"):
        acceptance.add_column(col)
    seen = set()
    for w in status.workers:
        h, c = w.hello, w.cost_model
        kind = worker_pb2.DrafterKind.Name(h.drafter.kind).removeprefix("DRAFTER_KIND_").lower()
        workers.add_row(
            h.worker_id, f"{kind} {h.drafter.version}", "yes" if w.connected else "no",
            f"{w.plan_version} ({w.acked_plan_version})", str(w.steps_ingested), f"{w.mean_batch_size:.1f}",
            f"{w.mean_context_len:,.0f}", f"{w.observed_goodput_tok_s:,.0f}",
            f"max({c.mem_ms:.2f} + {c.mem_ms_per_kv_token:.2e}·kv, {c.compute_ms:.2f} + {c.compute_ms_per_token:.2e}·tok)",
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


def print_status(target: str, worker_id: str = "") -> int:
    console = Console()
    try:
        status = fetch_status(target, worker_id)
    except grpc.RpcError as err:
        console.print(f"[red]specctl status: {target}: {err.code().name}: {err.details()}[/]")
        return 1
    for table in render_status(status):
        console.print(table)
    return 0
