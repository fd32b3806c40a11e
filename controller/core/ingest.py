"""Applying one validated step to a worker's state.

A step feeds five things: the worker's cost model (what the forward
computed and how long it took), its load (batch, context mix, tokens per
step), its requests in flight, its traffic per request class
(:mod:`controller.core.classes`) and the acceptance model of its drafter
version. Acceptance evidence of a whole ``StepReports`` message is gathered
in an :class:`AcceptanceBatch` and applied once, so a 64-step message costs
one pass over the posteriors, not 64.

Acceptance rules: a request-step verified with the typical rule
(``ACCEPTANCE_RULE_TYPICAL``) accepts more than the strict rule would, so its
outcome goes to a second model (``typical``: same strata, same drafter key)
and never to the strict one, nor to ``accept_counts`` (the strict per-position
counts the status page and metrics show). One reported for a class the
policy keeps strict is a violation: counted, and its acceptance not used.

Request states (:mod:`policies.outcome`, issue #28): each request-step is in
the state its request's previous steps left it in (after a miss, after a full
accept, resting, default), kept per active request in
``RequestTracker.last_outcome`` as one int (:func:`policies.outcome.pack_state`:
the state, and how long a resting request has rested).
A strict request-step's acceptance evidence goes to the pooled strict model
exactly as without states and, in addition, to its state's model
(``by_state``: one :class:`AcceptanceBatch` per state, the default state's
too, the same strata and drafter key; :mod:`controller.core.outcomes`);
``accept_counts`` and everything else see nothing new. Every request-step counts towards its
state's share of the load (``LoadTracker.state_counts``).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from controller.core.state import WorkerState
from controller.models.acceptance import AcceptanceModel, offer_slots
from controller.protocol import TYPICAL, RequestRow
from policies.base import RequestOutcome, StepOutcome
from policies.outcome import AFTER_HIT, AFTER_MISS, DEFAULT, REST_STEPS, RESTING, STATE_MASK, pack_state
from protos.speculation.v1 import worker_pb2

# The packed states a rest runs through (policies.outcome.pack_state): its first, the step between two, its last.
REST_1 = pack_state(RESTING, 1)
REST_STEP = pack_state(RESTING, 2) - REST_1
REST_LAST = pack_state(RESTING, REST_STEPS)


@dataclass
class AcceptanceBatch:
    """Acceptance evidence of one message, applied in bulk."""

    chains: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (bucket, depth, τ) -> request-steps
    # (bucket, level, rank) -> [asked, offered]
    offers: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)
    # Tree outcomes (accepted_rank given): (bucket, ranks, candidates), and their (bucket, depth, τ) counts.
    trees: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    tree_counts: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def apply(self, state: WorkerState, acceptance: AcceptanceModel, now: float, tally: dict | None) -> None:
        """Into ``acceptance``'s strata of the worker's drafter; (bucket, depth,
        τ) counts also into ``tally`` (``state.accept_counts`` for the strict
        rule's batch; None for the typical one's)."""
        if not self.chains and not self.offers and not self.trees:
            return
        limits = state.limits
        posteriors = acceptance.strata(state.drafter_key, limits.max_depth, limits.max_width, now)
        for bucket, ranks, cands in self.trees:
            posteriors[bucket].observe(ranks, cands)
        for key, count in self.chains.items():
            bucket, depth, accepted = key
            posteriors[bucket].observe_chain(depth, accepted, count)
        for (bucket, level, rank), (asked, offered) in self.offers.items():
            posteriors[bucket].observe_offers(asked, offered, level, rank)
        if tally is not None:
            for counts in (self.chains, self.tree_counts):
                for key, count in counts.items():
                    tally[key] = tally.get(key, 0) + count


def apply_step(state: WorkerState, step: worker_pb2.StepReport, rows: list[RequestRow], batch: AcceptanceBatch,
               typical: AcceptanceBatch, context_edges: tuple[int, ...], keep_requests: bool, max_active: int,
               now: float, by_state: list[AcceptanceBatch | None] | None = None) -> None:
    """Fold one validated step into ``state``: acceptance evidence into
    ``batch`` (strict rule) or ``typical`` (typical rule, relaxed classes);
    a strict request-step's also into ``by_state[s]``, ``s`` its request
    state (when given and not None; indexed by :data:`policies.outcome.STATES`)."""
    load, requests = state.load, state.requests
    counts, sums = load.context_counts, load.context_sums
    state_counts = load.state_counts
    active, drafted_through, request_class = requests.active, requests.drafted_through, requests.request_class
    last_outcome = requests.last_outcome
    resolve = state.classes.resolve
    counters = state.counters
    outcomes = []
    unreported = step.batch_size - len(rows)  # requests not reported decode one token each
    batch_tokens = tokens = unreported
    kv_tokens = max_depth = total_nodes = level_kv = attn_pairs = caught_up = 0
    draft_ms, verify_ms, size = step.draft_ms, step.verify_ms, step.batch_size
    catch_up_ms = step.catch_up_ms
    step_ms = draft_ms + verify_ms + catch_up_ms  # every request of the step waits for all of it
    for row in rows:
        (rid, ctx, depth, width, nodes, accepted, ranks, cands, requested, requested_width, requested_nodes,
         caught, name, rule) = row
        caught_up += caught
        if requested or depth:
            drafted_through[rid] = ctx + accepted + 1
        batch_tokens += 1 + nodes
        kv_tokens += ctx
        attn_pairs += (1 + nodes) * ctx
        total_nodes += nodes
        tokens += 1 + accepted
        c = bisect_right(context_edges, ctx) - 1  # edges start at 0, so c >= 0
        counts[c] += 1.0
        sums[c] += ctx
        # Its class: load, step means and its TPOT so far.
        cs = resolve.get(name)
        if cs is None:
            cs = state.classes.unknown(name)
            counters.unknown_class_request_steps += 1
        cs.steps += 1.0
        cs.tokens += 1 + accepted
        cs.step_ms += step_ms
        cs.ctx_counts[c] += 1.0
        cs.ctx_sums[c] += ctx
        if depth:
            cs.drafted += 1.0
            cs.accepted += accepted
        latency = cs.requests.get(rid)
        if latency is None:
            cs.admit(rid, now)
            latency = cs.requests[rid]
        latency[0] += step_ms
        latency[1] += 1 + accepted
        latency[2] = now
        latency[3] += 1
        request_class[rid] = cs.name
        # Its request state: what its previous steps left it in, packed (pack_state).
        code = last_outcome.get(rid, DEFAULT)
        outcome = code & STATE_MASK
        state_counts[outcome] += 1.0
        # policies.outcome.next_state, inline: a plain step after a miss rests, a rest runs
        # REST_STEPS plain steps, any other plain step is the default.
        last_outcome[rid] = ((AFTER_MISS if not accepted else AFTER_HIT if accepted >= depth else DEFAULT) if depth
                             else REST_1 if outcome == AFTER_MISS
                             else code + REST_STEP if outcome == RESTING and code < REST_LAST else DEFAULT)
        # Its acceptance: the strict model, the typical one, or (a violation) neither;
        # a strict step's also its state's model.
        extra = by_state[outcome] if by_state is not None else None
        sinks = (batch,) if extra is None else (batch, extra)
        if rule == TYPICAL:
            cs.typical += 1.0
            if cs.relaxed:
                sinks = (typical,)
                counters.typical_request_steps += 1
            else:
                sinks = ()
                counters.typical_violations += 1
        if sinks and (requested or depth):
            slots = (offer_slots(depth, accepted, nodes, ranks, cands, requested, requested_width, requested_nodes)
                     if requested and requested_width * requested > 1 else ())  # slots past a draft at all
            key = (c, depth, accepted)
            for sink in sinks:
                if requested:
                    offers = sink.offers
                    tally = offers.get((c, 0, 0))
                    if tally is None:
                        tally = offers[(c, 0, 0)] = [0, 0]
                    tally[0] += 1
                    tally[1] += depth > 0
                    for level, rank, offered in slots:
                        tally = offers.setdefault((c, level, rank), [0, 0])
                        tally[0] += 1
                        tally[1] += offered
                if depth:
                    if ranks is None:
                        chains = sink.chains
                        chains[key] = chains.get(key, 0) + 1
                    else:
                        sink.trees.append((c, ranks, cands))
                        trees = sink.tree_counts
                        trees[key] = trees.get(key, 0) + 1
        if depth:
            level_kv += depth * ctx
            if depth > max_depth:
                max_depth = depth
        if rid in active:
            active.move_to_end(rid)
        active[rid] = ctx
        if keep_requests:
            outcomes.append(RequestOutcome(rid, ctx, depth, width, nodes, accepted, name))
    while len(active) > max_active:
        gone = active.popitem(last=False)[0]
        drafted_through.pop(gone, None)
        request_class.pop(gone, None)
        last_outcome.pop(gone, None)
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
