"""Validation of worker messages and construction of controller messages.

Every check names the field path and the offending value, so a rejection
tells an engine team exactly what their integration sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.base import DrafterLimits
from policies.table import Decision, DecisionTable
from protos.speculation.v1 import plan_pb2, worker_pb2

R = plan_pb2.RejectReason

DRAFTER_KIND_NAMES = {
    worker_pb2.DRAFTER_KIND_MEDUSA: "medusa",
    worker_pb2.DRAFTER_KIND_EAGLE: "eagle",
    worker_pb2.DRAFTER_KIND_NGRAM: "ngram",
    worker_pb2.DRAFTER_KIND_DRAFT_MODEL: "draft_model",
    worker_pb2.DRAFTER_KIND_MTP: "mtp",
}
MAX_CONTEXT_LEN = 1 << 24  # tokens; far beyond any served context
MAX_BATCH_SIZE = 1 << 16


@dataclass(frozen=True)
class Invalid(Exception):
    """A message part that cannot be applied."""

    reason: int
    field: str
    detail: str
    step_id: int = 0

    def to_proto(self) -> plan_pb2.Rejection:
        return plan_pb2.Rejection(reason=self.reason, field=self.field, detail=self.detail, step_id=self.step_id)


def _need(ok: bool, field: str, detail: str, step_id: int = 0, reason: int = R.REJECT_REASON_INVALID_FIELD) -> None:
    if not ok:
        raise Invalid(reason, field, detail, step_id)


def drafter_limits(hello: worker_pb2.Hello) -> DrafterLimits:
    d = hello.drafter
    return DrafterLimits(
        kind=DRAFTER_KIND_NAMES.get(d.kind, "unspecified"),
        version=d.version,
        max_depth=d.max_depth,
        max_width=d.max_width,
        max_tree_nodes=d.max_tree_nodes,
        trained_context_len=d.trained_context_len,
    )


def validate_hello(hello: worker_pb2.Hello) -> None:
    _need(bool(hello.worker_id), "hello.worker_id", "must be a non-empty string")
    _need(len(hello.worker_id) <= 256, "hello.worker_id", f"length {len(hello.worker_id)} exceeds 256")
    d = hello.drafter
    _need(d.kind in DRAFTER_KIND_NAMES, "hello.drafter.kind", f"{d.kind} is not a known DrafterKind")
    _need(1 <= d.max_depth <= 64, "hello.drafter.max_depth", f"{d.max_depth} must be in 1..64")
    _need(1 <= d.max_width <= 64, "hello.drafter.max_width", f"{d.max_width} must be in 1..64")
    _need(
        d.max_depth <= d.max_tree_nodes <= 4096,
        "hello.drafter.max_tree_nodes",
        f"{d.max_tree_nodes} must be in max_depth ({d.max_depth})..4096",
    )


def validate_request_step(r: worker_pb2.RequestStep, limits: DrafterLimits, path: str, step_id: int) -> None:
    def need(ok: bool, name: str, detail: str) -> None:
        _need(ok, f"{path}.{name}", detail, step_id)

    need(bool(r.request_id), "request_id", "must be a non-empty string")
    need(0 <= r.context_len <= MAX_CONTEXT_LEN, "context_len", f"{r.context_len} must be in 0..{MAX_CONTEXT_LEN}")
    need(0 <= r.depth <= limits.max_depth, "depth", f"{r.depth} must be in 0..{limits.max_depth} (drafter max_depth)")
    need(0 <= r.accepted <= r.depth, "accepted", f"{r.accepted} must be in 0..depth ({r.depth})")
    if r.depth == 0:
        need(r.width == 0 and r.nodes == 0, "nodes", f"width={r.width}, nodes={r.nodes} must be 0 when depth is 0")
        need(not r.accepted_rank, "accepted_rank", f"{list(r.accepted_rank)} must be empty when depth is 0")
        return
    need(1 <= r.width <= limits.max_width, "width", f"{r.width} must be in 1..{limits.max_width} (drafter max_width)")
    need(
        r.depth <= r.nodes <= limits.max_tree_nodes,
        "nodes",
        f"{r.nodes} must be in depth ({r.depth})..{limits.max_tree_nodes} (drafter max_tree_nodes)",
    )
    ranks, cands = r.accepted_rank, r.level_candidates
    if not ranks:
        need(r.width == 1, "accepted_rank", "may be omitted only for a chain (width 1)")
        need(not cands, "level_candidates", "must be empty when accepted_rank is")
        return
    need(len(cands) == len(ranks), "level_candidates", f"has {len(cands)} entries, accepted_rank has {len(ranks)}")
    reached = r.accepted + 1 if r.accepted < r.depth else r.depth
    # A path may end at a leaf shallower than depth: then every entry is an acceptance.
    need(
        len(ranks) == reached or (len(ranks) == r.accepted and r.accepted < r.depth),
        "accepted_rank",
        f"has {len(ranks)} entries, expected {reached} for accepted={r.accepted}, depth={r.depth}",
    )
    for i, (rank, offered) in enumerate(zip(ranks, cands)):
        need(1 <= offered <= r.width, f"level_candidates[{i}]", f"{offered} must be in 1..width ({r.width})")
        if i < r.accepted:
            need(1 <= rank <= offered, f"accepted_rank[{i}]", f"{rank} must be in 1..{offered} (position accepted)")
        else:
            need(rank == 0, f"accepted_rank[{i}]", f"{rank} must be 0 (position rejected: accepted={r.accepted})")
    if r.draft_confidence:
        need(len(r.draft_confidence) == len(ranks), "draft_confidence",
             f"has {len(r.draft_confidence)} entries, expected 0 or {len(ranks)}")
        for i, c in enumerate(r.draft_confidence):
            need(0.0 <= c <= 1.0, f"draft_confidence[{i}]", f"{c} must be in [0, 1]")


def validate_step(step: worker_pb2.StepReport, limits: DrafterLimits, path: str, last_step_id: int) -> None:
    sid = step.step_id

    def need(ok: bool, name: str, detail: str) -> None:
        _need(ok, f"{path}.{name}", detail, sid)

    _need(sid > last_step_id, f"{path}.step_id", f"{sid} must exceed the last step id {last_step_id}", sid,
          R.REJECT_REASON_STALE_STEP)
    need(math.isfinite(step.timestamp) and step.timestamp >= 0, "timestamp", f"{step.timestamp} must be finite and >= 0")
    need(1 <= step.batch_size <= MAX_BATCH_SIZE, "batch_size", f"{step.batch_size} must be in 1..{MAX_BATCH_SIZE}")
    need(len(step.requests) <= step.batch_size, "requests",
         f"{len(step.requests)} entries exceed batch_size {step.batch_size}")
    for name in ("draft_ms", "verify_ms"):
        value = getattr(step, name)
        need(math.isfinite(value) and 0.0 <= value < 3.6e6, name, f"{value} must be finite, >= 0 and < 1 h")
    need(step.verify_ms > 0.0, "verify_ms", f"{step.verify_ms} must be > 0")
    for i, r in enumerate(step.requests):
        validate_request_step(r, limits, f"{path}.requests[{i}]", sid)


def validate_finished(f: worker_pb2.RequestFinished) -> None:
    _need(bool(f.request_id), "finished.request_id", "must be a non-empty string")
    for name in ("generated_tokens", "steps", "accepted_tokens"):
        value = getattr(f, name)
        _need(value >= 0, f"finished.{name}", f"{value} must be >= 0")
    _need(f.accepted_tokens <= f.generated_tokens, "finished.accepted_tokens",
          f"{f.accepted_tokens} exceeds generated_tokens {f.generated_tokens}")


def decision_to_proto(d: Decision) -> plan_pb2.Decision:
    return plan_pb2.Decision(depth=d.depth, width=d.width, max_nodes=d.max_nodes)


def plan_to_proto(table: DecisionTable, version: int, nonce: str, policy: str, created_at: float,
                  expected_goodput: float) -> plan_pb2.Plan:
    return plan_pb2.Plan(
        version=version,
        nonce=nonce,
        batch_size_edges=table.batch_edges,
        context_len_edges=table.context_edges,
        table=[decision_to_proto(d) for d in table.decisions],
        policy=policy,
        created_at=created_at,
        expected_goodput_tok_s=expected_goodput,
    )
