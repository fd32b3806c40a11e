"""Applying one validated step to a worker's state.

A step feeds five things: the worker's cost model (what the forward
computed and how long it took), its load (batch, context mix, tokens per
step), its requests in flight, its traffic per request class
(:mod:`controller.core.classes`) and the acceptance model of its drafter
version. Acceptance evidence is counted in the
:class:`~controller.core.state.EvidenceBuffer` of the worker's drafter version
(one dict update per request-step; every worker of the version shares it) and
folded into the models by :func:`fold_evidence`: before anything reads the
models (``AcceptanceModel.fold_pending``, so no plan nor status is built from
stale evidence) and at each acceptance tick (so the decay never runs over
unfolded evidence). Between two folds the models lack the buffered
request-steps (at most a tick, 1 s, of them while steps arrive), and no
reader sees that. The counts of every message and worker since the last fold
reach a posterior cell once. ``accept_counts`` (the strict rule's (bucket,
depth, τ) counts per worker) is counted per request-step, never buffered.

Acceptance rules: a request-step verified with the typical rule
(``ACCEPTANCE_RULE_TYPICAL``) accepts more than the strict rule would, so its
outcome goes to a second model (``typical``: same strata, same drafter key)
and never to the strict one, nor to ``accept_counts`` (the strict per-position
counts the status page and metrics show). One reported for a class the
policy keeps strict is a violation: counted, and its acceptance not used.

Shadow drafts (``RequestStep.shadows``): the chain a worker would have
proposed at a step where a request did not draft, compared with the tokens
the target emitted after it. It is the same evidence as a verified chain (the proto says why),
so it goes where a verified chain of the row's sink goes: one ask of the
drafter and, when it offered one, a chain (at the context bucket where it
was proposed). It does not move the request's state, nor ``accept_counts``
(verified drafts only). One on a relaxed row is counted and not used.

Request states (:mod:`policies.outcome`, issue #28): each request-step is in
the state its request's previous steps left it in (after a miss, after a full
accept, resting, default), kept in the request's record
(``ActiveRequest.state``) as one int (:func:`policies.outcome.pack_state`:
the state, and how long a resting request has rested).
A strict request-step's acceptance evidence goes to the pooled strict model
exactly as without states and, in addition, to its state's model
(the buffer's sink is the state; one model per state, the default state's
too, the same strata and drafter key; :mod:`controller.core.outcomes`);
``accept_counts`` and everything else see nothing new. Every request-step counts towards its
state's share of the load (``LoadTracker.state_counts``).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Mapping

from controller.core.classes import ClassStats
from controller.core.state import SINKS, TYPICAL_SINK, ActiveRequest, EvidenceBuffer, WorkerState
from controller.models.acceptance import AcceptanceModel, DrafterKey, offer_slots
from controller.protocol import TYPICAL, RequestRow
from policies.base import RequestOutcome, StepOutcome
from policies.outcome import AFTER_HIT, AFTER_MISS, DEFAULT, REST_STEPS, RESTING, STATE_MASK, pack_state
from protos.speculation.v1 import worker_pb2

# The packed states a rest runs through (policies.outcome.pack_state): its first, the step between two, its last.
REST_1 = pack_state(RESTING, 1)
REST_STEP = pack_state(RESTING, 2) - REST_1
REST_LAST = pack_state(RESTING, REST_STEPS)
VIOLATION = -2  # the sink of a request-step whose acceptance is not used (typical rule, strict class)


def fold_evidence(states: Iterable[WorkerState], pooled: AcceptanceModel, typical: AcceptanceModel,
                  by_state: Mapping[int, AcceptanceModel]) -> None:
    """Fold the evidence buffered by ``states`` (their drafter versions'
    :class:`~controller.core.state.EvidenceBuffer`) into the models, and empty
    the buffers: a strict sink into ``pooled`` and ``by_state[sink]`` (when
    held), :data:`~controller.core.state.TYPICAL_SINK` into ``typical``.
    ``states``: the workers that ingested since the last fold, each with its
    ``evidence_since``.

    A stratum made here starts at the clock of the ingest that first buffered
    evidence for it (``EvidenceBuffer.first``), as one that ingest made did.
    One difference from folding every message: when the workers of one
    drafter version have different drafter limits, a wider one widens the
    version's strata (a widened stratum starts empty) at its first ingest
    since the last fold, and the evidence the others buffered before it is
    kept, where folding every message dropped it.
    """
    # Buffer id -> (drafter key, buffer, {(max_depth, max_width): clock of the first ingest of a
    # worker with those limits since the last fold}).
    buffers: dict[int, tuple[DrafterKey, EvidenceBuffer, dict]] = {}
    for state in states:  # in the order of their first ingest since the last fold
        since, state.evidence_since = state.evidence_since, None
        if since is None:
            continue
        limits = state.limits
        held = buffers.get(id(state.evidence))
        if held is None:
            held = buffers[id(state.evidence)] = (state.drafter_key, state.evidence, {})
        held[2].setdefault((limits.max_depth, limits.max_width), since)
    for key, evidence, shapes in buffers.values():
        first = evidence.first
        if not first:
            continue
        # Make or widen its strata as its ingests did: each model's at the first evidence for it.
        strict = [at for sink, at in first.items() if sink != TYPICAL_SINK]
        made = [(typical, first[TYPICAL_SINK])] if TYPICAL_SINK in first else []
        if strict:
            made.append((pooled, min(strict)))
        made.extend((by_state[sink], at) for sink, at in first.items() if sink in by_state)
        for model, at in made:
            for (depth, width), since in shapes.items():
                model.strata(key, depth, width, max(since, at))
        _observe(evidence, pooled.peek(key), typical.peek(key), {s: m.peek(key) for s, m in by_state.items()})
        evidence.clear()


def _observe(evidence: EvidenceBuffer, pooled: list | None, typical: list | None,
             by_state: dict[int, list | None]) -> None:
    """One version's buffered evidence into its posteriors (lists per context bucket; None: not held),
    trees, chains, then offers, as a message's evidence went; the pooled model gets every strict sink's."""
    chains: dict[tuple, int] = {}  # strict sinks summed: the pooled model's
    offers: dict[tuple, list[int]] = {}
    for sink in range(SINKS):
        strict = sink != TYPICAL_SINK
        target = by_state.get(sink) if strict else typical
        for bucket, ranks, cands in evidence.trees[sink]:
            if target is not None:
                target[bucket].observe(ranks, cands)
            if strict and pooled is not None:
                pooled[bucket].observe(ranks, cands)
        for key, count in evidence.chains[sink].items():
            if target is not None:
                target[key[0]].observe_chain(key[1], key[2], count)
            if strict:
                chains[key] = chains.get(key, 0) + count
        for key, (asked, offered) in evidence.offers[sink].items():
            if target is not None:
                target[key[0]].observe_offers(asked, offered, key[1], key[2])
            if strict:
                total = offers.get(key)
                if total is None:
                    offers[key] = [asked, offered]
                else:
                    total[0] += asked
                    total[1] += offered
    if pooled is not None:
        for (bucket, depth, accepted), count in chains.items():
            pooled[bucket].observe_chain(depth, accepted, count)
        for (bucket, level, rank), (asked, offered) in offers.items():
            pooled[bucket].observe_offers(asked, offered, level, rank)


def _add_shadow(evidence: EvidenceBuffer, sink: int, bucket: int, depth: int, accepted: int, now: float) -> None:
    """A shadow draft (``RequestStep.shadows``) into ``sink``'s buffered evidence: one ask of the
    drafter (offered when ``depth`` > 0) and, when it offered, a chain of ``depth`` with τ =
    ``accepted``, at context bucket ``bucket`` (where it was proposed); what a verified chain adds."""
    if sink not in evidence.first:
        evidence.first[sink] = now
    tally = evidence.offers[sink].setdefault((bucket, 0, 0), [0, 0])
    tally[0] += 1
    tally[1] += depth > 0
    if depth:
        chains = evidence.chains[sink]
        key = (bucket, depth, accepted)
        chains[key] = chains.get(key, 0) + 1


def _add_class_run(cs: ClassStats, rows: int, tokens: int, drafted: int, step_ms: float) -> None:
    """A run of ``rows`` request-steps of one class in one step: ``tokens`` emitted, ``drafted`` of
    them drafted (τ is 0 without a draft, so the accepted tokens are ``tokens - rows``)."""
    cs.steps += rows
    cs.tokens += tokens
    cs.step_ms += step_ms * rows  # every request of the step waits for all of it
    cs.drafted += drafted
    cs.accepted += tokens - rows


def apply_step(state: WorkerState, step: worker_pb2.StepReport, rows: list[RequestRow],
               context_edges: tuple[int, ...], keep_requests: bool, max_active: int, now: float) -> None:
    """Fold one validated step into ``state``; its acceptance evidence goes to
    ``state.evidence`` (:func:`fold_evidence` takes it to the models): a
    strict request-step's under its request state, a typical one's (relaxed
    classes) under :data:`~controller.core.state.TYPICAL_SINK`."""
    load, requests = state.load, state.requests
    counts, sums = load.context_counts, load.context_sums
    state_counts = load.state_counts
    active = requests.active
    resolve = state.classes.resolve
    counters = state.counters
    evidence = state.evidence
    chains_by_sink, offers_by_sink, trees_by_sink = evidence.chains, evidence.offers, evidence.trees
    first = evidence.first
    accept_counts = state.accept_counts
    outcomes = []
    unreported = step.batch_size - len(rows)  # requests not reported decode one token each
    batch_tokens = tokens = unreported
    kv_tokens = max_depth = total_nodes = level_kv = attn_pairs = caught_up = drafted = 0
    # The current run of rows of one class (see below); no row has the name None.
    run_name = run_class = None
    run_unknown, run_rows, run_tokens, run_drafted = False, 0, 0, 0
    draft_ms, verify_ms, size = step.draft_ms, step.verify_ms, step.batch_size
    catch_up_ms = step.catch_up_ms
    step_ms = draft_ms + verify_ms + catch_up_ms  # every request of the step waits for all of it
    for row in rows:
        (rid, ctx, depth, width, nodes, accepted, ranks, cands, requested, requested_width, requested_nodes,
         caught, name, rule, _, shadows) = row  # _: its domain (the drift monitor's)
        # Its record, most recently reported now (a new request goes in at the end).
        request = active.get(rid)
        if request is None:
            request = active[rid] = ActiveRequest(ctx, "")
        else:
            active.move_to_end(rid)
            request.context_len = ctx
        caught_up += caught
        if requested or depth:
            request.drafted_through = ctx + accepted + 1
        batch_tokens += 1 + nodes
        kv_tokens += ctx
        attn_pairs += (1 + nodes) * ctx
        total_nodes += nodes
        c = bisect_right(context_edges, ctx) - 1  # edges start at 0, so c >= 0
        counts[c] += 1.0
        sums[c] += ctx
        # Its class: load, step means and its TPOT so far. The rows of a step mostly share one class:
        # its sums are added once per run of rows of the same class (from the step's own totals).
        if name != run_name:
            if run_class is not None:
                _add_class_run(run_class, run_rows, tokens - run_tokens, drafted - run_drafted, step_ms)
                if run_unknown:
                    counters.unknown_class_request_steps += run_rows
            run_name, run_rows, run_tokens, run_drafted = name, 0, tokens, drafted
            cs = resolve.get(name)
            run_unknown = cs is None
            if run_unknown:
                cs = state.classes.unknown(name)
            run_class, class_name, ctx_counts, ctx_sums, class_requests = (cs, cs.name, cs.ctx_counts, cs.ctx_sums,
                                                                           cs.requests)
        run_rows += 1
        tokens += 1 + accepted  # after the run's start: the run's tokens are a difference of this sum
        ctx_counts[c] += 1.0
        ctx_sums[c] += ctx
        latency = class_requests.get(rid)
        if latency is None:
            cs.admit(rid, now)
            latency = class_requests[rid]
        latency[0] += step_ms
        latency[1] += 1 + accepted
        latency[2] = now
        latency[3] += 1
        request.class_name = class_name
        # Its request state: what its previous steps left it in, packed (pack_state).
        code = request.state
        outcome = code & STATE_MASK
        state_counts[outcome] += 1.0
        # policies.outcome.next_state, inline: a plain step after a miss rests, a rest runs
        # REST_STEPS plain steps, any other plain step is the default.
        request.state = ((AFTER_MISS if not accepted else AFTER_HIT if accepted >= depth else DEFAULT) if depth
                         else REST_1 if outcome == AFTER_MISS
                         else code + REST_STEP if outcome == RESTING and code < REST_LAST else DEFAULT)
        # Its acceptance evidence, buffered under its sink: its request state (the strict rule),
        # the typical model, or (a violation) none.
        sink = outcome
        if rule == TYPICAL:
            cs.typical += 1.0
            if cs.relaxed:
                sink = TYPICAL_SINK
                counters.typical_request_steps += 1
            else:
                sink = VIOLATION
                counters.typical_violations += 1
        if sink != VIOLATION and (requested or depth):
            if requested:
                offers = offers_by_sink[sink]
                key = (c, 0, 0)
                tally = offers.get(key)
                if tally is None:
                    tally = offers[key] = [0, 0]
                    if sink not in first:
                        first[sink] = now
                tally[0] += 1
                tally[1] += depth > 0
                if requested_width * requested > 1:  # slots past a draft at all
                    for level, rank, offered in offer_slots(depth, accepted, nodes, ranks, cands, requested,
                                                            requested_width, requested_nodes):
                        tally = offers.setdefault((c, level, rank), [0, 0])
                        tally[0] += 1
                        tally[1] += offered
            if depth:
                key = (c, depth, accepted)
                if ranks is None:
                    chains = chains_by_sink[sink]
                    count = chains.get(key)
                    if count is None:
                        chains[key] = 1
                        if sink not in first:
                            first[sink] = now
                    else:
                        chains[key] = count + 1
                else:
                    trees_by_sink[sink].append((c, ranks, cands))
                    if sink not in first:
                        first[sink] = now
                if sink != TYPICAL_SINK:  # the strict rule's per-position counts (status page, metrics)
                    accept_counts[key] = accept_counts.get(key, 0) + 1
        if shadows:
            if sink < 0 or sink == TYPICAL_SINK:  # strict evidence from a relaxed row: counted, not used
                counters.shadow_drafts_ignored += len(shadows)
            else:
                for s_ctx, _, s_depth, s_accepted in shadows:
                    _add_shadow(evidence, sink, bisect_right(context_edges, s_ctx) - 1, s_depth, s_accepted, now)
                counters.shadow_drafts += len(shadows)
        if depth:
            drafted += 1
            level_kv += depth * ctx
            if depth > max_depth:
                max_depth = depth
        if keep_requests:
            outcomes.append(RequestOutcome(rid, ctx, depth, width, nodes, accepted, name))
    if run_class is not None:
        _add_class_run(run_class, run_rows, tokens - run_tokens, drafted - run_drafted, step_ms)
        if run_unknown:
            counters.unknown_class_request_steps += run_rows
    while len(active) > max_active:
        active.popitem(last=False)
    if caught_up:
        state.cost.observe_catch_up(caught_up, catch_up_ms)
    if state.hello.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED:  # what the forward really computed
        widest = 1 + max((row.nodes for row in rows), default=0)
        batch_tokens, attn_pairs = size * widest, kv_tokens * widest
    state.cost.observe_step(batch_tokens, kv_tokens, max_depth, total_nodes, level_kv, draft_ms, verify_ms,
                            attn_pairs)
    requests.recent_steps.append(
        StepOutcome(step.step_id, step.timestamp, size, draft_ms, verify_ms, tuple(outcomes), tokens, catch_up_ms))
    load.observe_step(size, tokens, step_ms, first=state.steps_ingested == 0)
    state.session.last_step_id = step.step_id
    state.session.last_report_at = now
    state.steps_ingested += 1
    counters.steps_total += 1
    counters.tokens_total += tokens
    counters.step_ms_total += step_ms
    state.plans.new_steps += 1
