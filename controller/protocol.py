"""Validation of worker messages and construction of controller messages.

Every check names the field path and the offending value, so a rejection
tells an engine team exactly what their integration sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, NamedTuple, Sequence

from policies.base import DrafterLimits, PlanDraft
from policies.classes import ClassSet
from policies.outcome import split_first_states
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
MAX_CATCH_UP_WINDOW = MAX_CONTEXT_LEN
MAX_BATCH_SIZE = 1 << 16
MAX_BATCH_TOKENS = 1 << 20  # tokens one forward computes
MAX_STEP_MS = 3.6e6  # one hour
MAX_CALIBRATION = 256  # calibration samples in a Hello
TYPICAL = plan_pb2.ACCEPTANCE_RULE_TYPICAL
# RequestStep.acceptance_rule values a worker may report (UNSPECIFIED = strict).
ACCEPTANCE_RULES = frozenset(plan_pb2.AcceptanceRule.values())


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
        catch_up_window=d.catch_up_window,
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
    _need(d.catch_up_window <= MAX_CATCH_UP_WINDOW, "hello.drafter.catch_up_window",
          f"{d.catch_up_window} must be in 0..{MAX_CATCH_UP_WINDOW} tokens (0 = unbounded)")
    _need(hello.max_batch_size <= MAX_BATCH_SIZE, "hello.max_batch_size",
          f"{hello.max_batch_size} must be in 0..{MAX_BATCH_SIZE} (0 = unknown)")
    _need(hello.verify_layout in worker_pb2.VerifyLayout.values(), "hello.verify_layout",
          f"{hello.verify_layout} is not a known VerifyLayout")
    _need(len(hello.calibration) <= MAX_CALIBRATION, "hello.calibration",
          f"{len(hello.calibration)} samples exceed {MAX_CALIBRATION}")
    for i, c in enumerate(hello.calibration):
        path = f"hello.calibration[{i}]"
        _need(1 <= c.batch_size <= MAX_BATCH_SIZE, f"{path}.batch_size", f"{c.batch_size} must be in 1..{MAX_BATCH_SIZE}")
        _need(c.batch_size <= c.batch_tokens <= MAX_BATCH_TOKENS, f"{path}.batch_tokens",
              f"{c.batch_tokens} must be in batch_size ({c.batch_size})..{MAX_BATCH_TOKENS}")
        _need(0 <= c.kv_tokens <= c.batch_size * MAX_CONTEXT_LEN, f"{path}.kv_tokens",
              f"{c.kv_tokens} must be in 0..batch_size x {MAX_CONTEXT_LEN}")
        _need(math.isfinite(c.verify_ms) and 0 < c.verify_ms <= MAX_STEP_MS, f"{path}.verify_ms",
              f"{c.verify_ms} must be in (0, {MAX_STEP_MS}]")
        _need(1 <= c.repeats <= 64, f"{path}.repeats", f"{c.repeats} must be in 1..64")


def _bad(path: str, name: str, detail: str, step_id: int) -> Invalid:
    return Invalid(R.REJECT_REASON_INVALID_FIELD, f"{path}.{name}", detail, step_id)


def validate_request_step(r: worker_pb2.RequestStep, limits: DrafterLimits, path: str, step_id: int) -> None:
    # Plain `if` checks: this runs for every request of every step, so the
    # messages are only formatted when something is wrong.
    depth, accepted = r.depth, r.accepted
    if not r.request_id:
        raise _bad(path, "request_id", "must be a non-empty string", step_id)
    if not 0 <= r.context_len <= MAX_CONTEXT_LEN:
        raise _bad(path, "context_len", f"{r.context_len} must be in 0..{MAX_CONTEXT_LEN}", step_id)
    if not 0 <= depth <= limits.max_depth:
        raise _bad(path, "depth", f"{depth} must be in 0..{limits.max_depth} (drafter max_depth)", step_id)
    if not 0 <= accepted <= depth:
        raise _bad(path, "accepted", f"{accepted} must be in 0..depth ({depth})", step_id)
    requested = r.requested_depth
    if not (requested == 0 or depth <= requested <= limits.max_depth):
        raise _bad(path, "requested_depth", f"{requested} must be 0 or in depth ({depth})..{limits.max_depth} "
                   "(drafter max_depth)", step_id)
    if r.acceptance_rule not in ACCEPTANCE_RULES:
        raise _bad(path, "acceptance_rule", f"{r.acceptance_rule} is not a known AcceptanceRule", step_id)
    _check_shadows(r.shadows, r.context_len, limits, path, step_id)
    caught = r.caught_up_tokens
    if not 0 <= caught <= r.context_len:
        raise _bad(path, "caught_up_tokens", f"{caught} must be in 0..context_len ({r.context_len})", step_id)
    if caught and not (requested or depth):
        raise _bad(path, "caught_up_tokens", f"{caught} must be 0 when the request did not ask for a draft "
                   "(requested_depth and depth 0)", step_id)
    if depth == 0:
        if r.width or r.nodes:
            raise _bad(path, "nodes", f"width={r.width}, nodes={r.nodes} must be 0 when depth is 0", step_id)
        for name in ("accepted_rank", "level_candidates", "draft_confidence"):
            if getattr(r, name):
                raise _bad(path, name, f"{list(getattr(r, name))[:8]} must be empty when depth is 0", step_id)
        _check_requested_shape(r, limits, path, step_id)
        return
    width = r.width
    if not 1 <= width <= limits.max_width:
        raise _bad(path, "width", f"{width} must be in 1..{limits.max_width} (drafter max_width)", step_id)
    if not depth <= r.nodes <= limits.max_tree_nodes:
        raise _bad(path, "nodes", f"{r.nodes} must be in depth ({depth})..{limits.max_tree_nodes} "
                   "(drafter max_tree_nodes)", step_id)
    _check_requested_shape(r, limits, path, step_id)
    ranks, cands = r.accepted_rank, r.level_candidates
    if not ranks:
        if width != 1:
            raise _bad(path, "accepted_rank", "may be omitted only for a chain (width 1)", step_id)
        if cands:
            raise _bad(path, "level_candidates", "must be empty when accepted_rank is", step_id)
        _check_confidence(r.draft_confidence, accepted + 1 if accepted < depth else depth, path, step_id)
        return
    if len(cands) != len(ranks):
        raise _bad(path, "level_candidates", f"has {len(cands)} entries, accepted_rank has {len(ranks)}", step_id)
    reached = accepted + 1 if accepted < depth else depth
    # A path may end at a leaf shallower than depth: then every entry is an acceptance.
    if not (len(ranks) == reached or (len(ranks) == accepted and accepted < depth)):
        raise _bad(path, "accepted_rank",
                   f"has {len(ranks)} entries, expected {reached} for accepted={accepted}, depth={depth}", step_id)
    for i, (rank, offered) in enumerate(zip(ranks, cands)):
        if not 1 <= offered <= width:
            raise _bad(path, f"level_candidates[{i}]", f"{offered} must be in 1..width ({width})", step_id)
        if i < accepted:
            if not 1 <= rank <= offered:
                raise _bad(path, f"accepted_rank[{i}]", f"{rank} must be in 1..{offered} (position accepted)", step_id)
        elif rank != 0:
            raise _bad(path, f"accepted_rank[{i}]", f"{rank} must be 0 (position rejected: accepted={accepted})",
                       step_id)
    _check_confidence(r.draft_confidence, len(ranks), path, step_id)


def _check_shadows(shadows, context_len: int, limits: DrafterLimits, path: str, step_id: int) -> None:
    # The rules keep one open per request. Even a worker proposing one at every off step has at most
    # max_depth open (each resolves within max_depth emitted tokens, a step emits one or more), so
    # more resolved in one step is an engine bug or a forged report.
    if len(shadows) > limits.max_depth:
        raise _bad(path, "shadows", f"has {len(shadows)} entries, at most max_depth ({limits.max_depth}) "
                   "resolve in one step", step_id)
    for i, shadow in enumerate(shadows):
        _check_shadow(shadow, context_len, limits, f"{path}.shadows[{i}]", step_id)


def _shadow_rows(shadows, context_len: int, limits: DrafterLimits, path: str,
                 step_id: int) -> tuple[tuple[int, int, int, int], ...]:
    """``RequestStep.shadows`` as (context_len, requested_depth, depth, accepted), each field read
    once (the ingest path); anything out of range goes to :func:`_check_shadows`, which names it."""
    max_depth = limits.max_depth
    out = []
    for s in shadows:
        row = (s.context_len, s.requested_depth, s.depth, s.accepted)
        if not (0 <= row[0] <= context_len and 1 <= row[1] <= max_depth and 0 <= row[3] <= row[2] <= row[1]):
            _check_shadows(shadows, context_len, limits, path, step_id)
        out.append(row)
    if len(out) > max_depth:
        _check_shadows(shadows, context_len, limits, path, step_id)
    return tuple(out)


def _check_shadow(shadow: worker_pb2.ShadowDraft, context_len: int, limits: DrafterLimits, path: str,
                  step_id: int) -> None:
    if not 0 <= shadow.context_len <= context_len:
        raise _bad(path, "context_len", f"{shadow.context_len} must be in 0..the step's context_len ({context_len})",
                   step_id)
    if not 1 <= shadow.requested_depth <= limits.max_depth:
        raise _bad(path, "requested_depth", f"{shadow.requested_depth} must be in 1..{limits.max_depth} "
                   "(drafter max_depth)", step_id)
    if not 0 <= shadow.depth <= shadow.requested_depth:
        raise _bad(path, "depth", f"{shadow.depth} must be in 0..requested_depth ({shadow.requested_depth})", step_id)
    if not 0 <= shadow.accepted <= shadow.depth:
        raise _bad(path, "accepted", f"{shadow.accepted} must be in 0..depth ({shadow.depth})", step_id)


def _check_requested_shape(r: worker_pb2.RequestStep, limits: DrafterLimits, path: str, step_id: int) -> None:
    for name, used, limit, what in (("requested_width", r.width, limits.max_width, "max_width"),
                                    ("requested_nodes", r.nodes, limits.max_tree_nodes, "max_tree_nodes")):
        value = getattr(r, name)
        if value and not r.requested_depth:
            raise _bad(path, name, f"{value} must be 0 when requested_depth is 0", step_id)
        if not (value == 0 or max(used, 1) <= value <= limit):
            raise _bad(path, name, f"{value} must be 0 or in {used or 1}..{limit} (drafter {what})", step_id)


def _check_confidence(confidence, levels: int, path: str, step_id: int) -> None:
    if not confidence:
        return
    if len(confidence) != levels:
        raise _bad(path, "draft_confidence", f"has {len(confidence)} entries, expected 0 or {levels}", step_id)
    for i, c in enumerate(confidence):
        if not 0.0 <= c <= 1.0:
            raise _bad(path, f"draft_confidence[{i}]", f"{c} must be in [0, 1]", step_id)


class RequestRow(NamedTuple):
    """One validated request of a step, fields read from the proto once.
    ``accepted_rank`` and ``level_candidates`` are None for a chain or an off
    request (the per-position outcome follows from ``accepted``)."""

    request_id: str
    context_len: int
    depth: int
    width: int
    nodes: int
    accepted: int
    accepted_rank: tuple[int, ...] | None
    level_candidates: tuple[int, ...] | None
    requested_depth: int
    requested_width: int
    requested_nodes: int
    caught_up_tokens: int
    request_class: str = ""  # as reported (empty: the default class)
    acceptance_rule: int = 0  # AcceptanceRule the step verified this request with (0 = strict)
    domain: str = ""  # as reported: the drift monitor's stratum label (empty: none)
    # RequestStep.shadows, each as (context_len, requested_depth, depth, accepted)
    shadows: tuple[tuple[int, int, int, int], ...] = ()


_new_row = tuple.__new__  # RequestRow without NamedTuple's Python-level __new__: ~0.2 µs a row, 8 rows a step


def validate_step(step: worker_pb2.StepReport, limits: DrafterLimits, path: str,
                  last_step_id: int, max_batch_size: int = MAX_BATCH_SIZE,
                  finished: Collection[str] = ()) -> list[RequestRow]:
    """Check a step and return its requests as plain rows (fields read once).

    ``max_batch_size``: the worker's Hello limit (a step above it is an
    engine bug or a forged report, and one such step would dominate the
    worker's cost fit). ``finished``: ids of requests the worker already
    finished (``RequestTracker.finished_ids``); a step naming one is refused
    with ``REJECT_REASON_UNKNOWN_REQUEST``."""
    sid = step.step_id
    if sid <= last_step_id:
        raise Invalid(R.REJECT_REASON_STALE_STEP, f"{path}.step_id",
                      f"{sid} must exceed the last step id {last_step_id}", sid)
    # A comparison with NaN is false, so the ranges below also refuse NaN and infinities.
    timestamp = step.timestamp
    if not 0.0 <= timestamp < math.inf:
        raise _bad(path, "timestamp", f"{timestamp} must be finite and >= 0", sid)
    batch_size = step.batch_size
    if not 1 <= batch_size <= max_batch_size:
        raise _bad(path, "batch_size", f"{batch_size} must be in 1..{max_batch_size} (hello.max_batch_size)", sid)
    requests = step.requests
    if len(requests) > batch_size:
        raise _bad(path, "requests", f"{len(requests)} entries exceed batch_size {batch_size} (batch_size "
                   "counts every request in the step, reported or not)", sid)
    draft_ms, verify_ms, catch_up_ms = step.draft_ms, step.verify_ms, step.catch_up_ms
    if not (0.0 <= draft_ms < MAX_STEP_MS and 0.0 < verify_ms < MAX_STEP_MS and 0.0 <= catch_up_ms < MAX_STEP_MS):
        for name, value in (("draft_ms", draft_ms), ("verify_ms", verify_ms), ("catch_up_ms", catch_up_ms)):
            if not 0.0 <= value < MAX_STEP_MS:
                raise _bad(path, name, f"{value} must be finite, >= 0 and < 1 h", sid)
        raise _bad(path, "verify_ms", f"{verify_ms} must be > 0", sid)
    max_depth, max_width, max_nodes = limits.max_depth, limits.max_width, limits.max_tree_nodes
    rows: list[RequestRow] = []
    ids: list[str] = []
    for r in requests:
        rid, ctx, depth, width, nodes, accepted = r.request_id, r.context_len, r.depth, r.width, r.nodes, r.accepted
        ranks, requested = r.accepted_rank, r.requested_depth
        requested_width, requested_nodes, caught = r.requested_width, r.requested_nodes, r.caught_up_tokens
        ids.append(rid)
        # Fast path for the common shapes (off, or a chain with the τ shorthand);
        # anything else gets the full field-by-field check and its message.
        # Scalars first: reading a repeated field costs three times a scalar.
        if rid and 0 <= ctx <= MAX_CONTEXT_LEN and 0 <= accepted <= depth <= max_depth and (
            (depth == 0 and width == 0 and nodes == 0) or (depth > 0 and width == 1 and depth <= nodes <= max_nodes)
        ) and (
            (requested == 0 and requested_width == 0 and requested_nodes == 0) or (
                depth <= requested <= max_depth and (requested_width == 0 or 1 <= requested_width <= max_width)
                and (requested_nodes == 0 or max(nodes, 1) <= requested_nodes <= max_nodes))
        ) and (caught == 0 or (requested and 0 < caught <= ctx)) and 0 <= (rule := r.acceptance_rule) <= TYPICAL \
                and not ranks and not r.level_candidates and not r.draft_confidence:
            shadows = r.shadows  # a prompt-lookup worker's off rows carry one every step or two
            shadows = _shadow_rows(shadows, ctx, limits, f"{path}.requests[{len(rows)}]", sid) if shadows else ()
            rows.append(_new_row(RequestRow, (rid, ctx, depth, width, nodes, accepted, None, None, requested,
                                              requested_width, requested_nodes, caught, r.request_class, rule,
                                              r.domain, shadows)))
            continue
        validate_request_step(r, limits, f"{path}.requests[{len(rows)}]", sid)  # rows: one per request before it
        shadows = _shadow_rows(r.shadows, ctx, limits, path, sid) if r.shadows else ()  # checked above
        if depth and ranks:
            rows.append(RequestRow(rid, ctx, depth, width, nodes, accepted, tuple(ranks), tuple(r.level_candidates),
                                   requested, requested_width, requested_nodes, caught, r.request_class,
                                   r.acceptance_rule, r.domain, shadows))
        else:
            rows.append(RequestRow(rid, ctx, depth, width, nodes, accepted, None, None, requested, requested_width,
                                   requested_nodes, caught, r.request_class, r.acceptance_rule, r.domain, shadows))
    if len(ids) > 1 and len(set(ids)) < len(ids):
        seen: set[str] = set()
        for j, rid in enumerate(ids):
            if rid in seen:
                raise _bad(path, f"requests[{j}].request_id", f"{rid!r} appears twice in the step", sid)
            seen.add(rid)
    if finished:
        for j, rid in enumerate(ids):
            if rid in finished:
                raise Invalid(R.REJECT_REASON_UNKNOWN_REQUEST, f"{path}.requests[{j}].request_id",
                              f"{rid!r} already finished", sid)
    return rows


def validate_finished(f: worker_pb2.RequestFinished) -> None:
    _need(bool(f.request_id), "finished.request_id", "must be a non-empty string")
    for name in ("generated_tokens", "steps", "accepted_tokens"):
        value = getattr(f, name)
        _need(value >= 0, f"finished.{name}", f"{value} must be >= 0")
    _need(f.accepted_tokens <= f.generated_tokens, "finished.accepted_tokens",
          f"{f.accepted_tokens} exceeds generated_tokens {f.generated_tokens}")
    _need(math.isfinite(f.timestamp) and f.timestamp >= 0, "finished.timestamp",
          f"{f.timestamp} must be finite and >= 0")


def decision_to_proto(d: Decision) -> plan_pb2.Decision:
    return plan_pb2.Decision(depth=d.depth, width=d.width, max_nodes=d.max_nodes)


ACCEPTANCE_RULE_OF = {"strict": plan_pb2.ACCEPTANCE_RULE_STRICT, "typical": plan_pb2.ACCEPTANCE_RULE_TYPICAL}


def class_plans(classes: ClassSet, draft: PlanDraft) -> list[plan_pb2.ClassPlan]:
    """``Plan.classes`` of ``draft`` under ``classes``: empty for a single class
    (a plan without classes is byte-identical to one made before classes existed).

    A class whose table is the plan's own table goes out with an empty
    ``table`` (the proto's "empty = Plan.table"): a policy that treats every
    class alike sends its table once.
    """
    if classes.single:
        return []
    out = []
    for c in classes:
        table = draft.table_for(c.name)
        if (table.batch_edges, table.context_edges) != (draft.table.batch_edges, draft.table.context_edges):
            raise ValueError(f"class {c.name!r}: its table's edges differ from the plan table's")
        typical = c.acceptance == "typical"
        out.append(plan_pb2.ClassPlan(
            name=c.name,
            table=[] if table == draft.table else [decision_to_proto(d) for d in table.decisions],
            acceptance_rule=ACCEPTANCE_RULE_OF[c.acceptance],
            typical_epsilon=c.typical_epsilon if typical else 0.0,
            typical_delta=c.typical_delta if typical else 0.0,
        ))
    return out


def state_plans(draft: PlanDraft) -> list[plan_pb2.StatePlan]:
    """``Plan.state_tables`` of ``draft``: one entry per request state with a table of its
    own (``PlanDraft.state_tables``; none: the plan is byte-identical to one without states)."""
    out = []
    for state, table in sorted(draft.state_tables.items()):
        if (table.batch_edges, table.context_edges) != (draft.table.batch_edges, draft.table.context_edges):
            raise ValueError(f"state {state}: its table's edges differ from the plan table's")
        out.append(plan_pb2.StatePlan(state=state, table=[decision_to_proto(d) for d in table.decisions]))
    return out


def plan_to_proto(table: DecisionTable, version: int, nonce: str, policy: str, created_at: float,
                  expected_goodput: float, classes: Sequence[plan_pb2.ClassPlan] = (),
                  default_class: str = "", state_tables: Sequence[plan_pb2.StatePlan] = ()) -> plan_pb2.Plan:
    """A Plan message; ``classes`` / ``default_class`` as :func:`class_plans` makes them (none: one class),
    ``state_tables`` as :func:`state_plans` does: the states every tracking worker knows go
    in ``Plan.state_tables``, those added since in ``Plan.later_state_tables`` (a worker
    that does not know one skips it there; ``policies.outcome.FIRST_STATES``)."""
    first_states, later_states = split_first_states(state_tables, lambda sp: sp.state)
    return plan_pb2.Plan(
        version=version,
        nonce=nonce,
        batch_size_edges=table.batch_edges,
        context_len_edges=table.context_edges,
        table=[decision_to_proto(d) for d in table.decisions],
        policy=policy,
        created_at=created_at,
        expected_goodput_tok_s=expected_goodput,
        classes=classes,
        default_class=default_class if classes else "",
        state_tables=first_states,
        later_state_tables=later_states,
    )
