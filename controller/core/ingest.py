"""Applying one validated step to a worker's state.

A step feeds four things: the worker's cost model (what the forward
computed and how long it took), its load (batch, context mix, tokens per
step), its requests in flight, and the acceptance model of its drafter
version. Acceptance evidence of a whole ``StepReports`` message is gathered
in an :class:`AcceptanceBatch` and applied once, so a 64-step message costs
one pass over the posteriors, not 64.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from controller.core.state import WorkerState
from controller.models.acceptance import AcceptanceModel, offer_slots
from controller.protocol import RequestRow
from policies.base import RequestOutcome, StepOutcome
from protos.speculation.v1 import worker_pb2


@dataclass
class AcceptanceBatch:
    """Acceptance evidence of one message, applied in bulk."""

    chains: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (bucket, depth, τ) -> request-steps
    # (bucket, level, rank) -> [asked, offered]
    offers: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)

    def apply(self, state: WorkerState, acceptance: AcceptanceModel, now: float) -> None:
        if not self.chains and not self.offers:
            return
        limits = state.limits
        posteriors = acceptance.strata(state.drafter_key, limits.max_depth, limits.max_width, now)
        tally = state.accept_counts
        for key, count in self.chains.items():
            bucket, depth, accepted = key
            posteriors[bucket].observe_chain(depth, accepted, count)
            tally[key] = tally.get(key, 0) + count
        for (bucket, level, rank), (asked, offered) in self.offers.items():
            posteriors[bucket].observe_offers(asked, offered, level, rank)


def apply_step(state: WorkerState, step: worker_pb2.StepReport, rows: list[RequestRow], batch: AcceptanceBatch,
               acceptance: AcceptanceModel, context_edges: tuple[int, ...], keep_requests: bool, max_active: int,
               now: float) -> None:
    """Fold one validated step into ``state`` (acceptance chains into ``batch``)."""
    load, requests = state.load, state.requests
    counts, sums = load.context_counts, load.context_sums
    active, drafted_through = requests.active, requests.drafted_through
    chains, offers = batch.chains, batch.offers
    outcomes = []
    unreported = step.batch_size - len(rows)  # requests not reported decode one token each
    batch_tokens = tokens = unreported
    kv_tokens = max_depth = total_nodes = level_kv = attn_pairs = caught_up = 0
    posteriors = None
    for row in rows:
        (rid, ctx, depth, width, nodes, accepted, ranks, cands, requested, requested_width, requested_nodes,
         caught) = row
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
        if requested:
            tally = offers.get((c, 0, 0))
            if tally is None:
                tally = offers[(c, 0, 0)] = [0, 0]
            tally[0] += 1
            tally[1] += depth > 0
            if requested_width * requested > 1:  # slots past a draft at all
                for level, rank, offered in offer_slots(depth, accepted, nodes, ranks, cands, requested,
                                                        requested_width, requested_nodes):
                    tally = offers.setdefault((c, level, rank), [0, 0])
                    tally[0] += 1
                    tally[1] += offered
        if depth:
            level_kv += depth * ctx
            if depth > max_depth:
                max_depth = depth
            if ranks is None:
                key = (c, depth, accepted)
                chains[key] = chains.get(key, 0) + 1
            else:
                if posteriors is None:
                    limits = state.limits
                    posteriors = acceptance.strata(state.drafter_key, limits.max_depth, limits.max_width, now)
                posteriors[c].observe(ranks, cands)
                key = (c, depth, accepted)
                state.accept_counts[key] = state.accept_counts.get(key, 0) + 1
        if rid in active:
            active.move_to_end(rid)
        active[rid] = ctx
        if keep_requests:
            outcomes.append(RequestOutcome(rid, ctx, depth, width, nodes, accepted))
    while len(active) > max_active:
        drafted_through.pop(active.popitem(last=False)[0], None)
    draft_ms, verify_ms, size = step.draft_ms, step.verify_ms, step.batch_size
    catch_up_ms = step.catch_up_ms
    if caught_up:
        state.cost.observe_catch_up(caught_up, catch_up_ms)
    if state.hello.verify_layout == worker_pb2.VERIFY_LAYOUT_PADDED:  # what the forward really computed
        widest = 1 + max((row.nodes for row in rows), default=0)
        batch_tokens, attn_pairs = size * widest, kv_tokens * widest
    state.cost.observe_step(batch_tokens, kv_tokens, max_depth, total_nodes, level_kv, draft_ms, verify_ms,
                            attn_pairs)
    requests.recent_steps.append(
        StepOutcome(step.step_id, step.timestamp, size, draft_ms, verify_ms, tuple(outcomes), tokens, catch_up_ms))
    step_ms = draft_ms + verify_ms + catch_up_ms
    load.observe_step(size, tokens, step_ms, first=state.steps_ingested == 0)
    state.session.last_step_id = step.step_id
    state.session.last_report_at = now
    state.steps_ingested += 1
    counters = state.counters
    counters.steps_total += 1
    counters.tokens_total += tokens
    counters.step_ms_total += step_ms
    state.plans.new_steps += 1
