"""``hf-heuristic``: HF transformers ``num_assistant_tokens_schedule="heuristic"``."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from policies.base import Observation, PlanDraft, Policy, uniform_plan
from policies.baselines.base import BatchSize, StrictConfig
from policies.table import Decision


class HfHeuristicConfig(StrictConfig):
    """HF ``GenerationConfig`` of the assistant model."""

    num_assistant_tokens: BatchSize = Field(20, description="draft tokens a request starts with (HF default 20)")


@dataclass(frozen=True, slots=True)
class HfState:
    """Per-request draft length ``n``, as sorted (request_id, n) pairs."""

    counters: tuple[tuple[str, int], ...] = ()


def hf_next(n: int, drafted: int, accepted: int, cap: int) -> int:
    """HF's heuristic after one step: +2 if every drafted token was accepted, else -1 (floor 1)."""
    return min(n + 2, cap) if accepted >= drafted else max(1, n - 1)


class HfHeuristicPolicy(Policy[HfHeuristicConfig]):
    """HF transformers assisted generation, ``num_assistant_tokens_schedule="heuristic"``.

    Mirrors ``AssistedCandidateGenerator.update_candidate_strategy``, which
    keeps one draft length per generation: it starts at
    ``num_assistant_tokens`` (default 20), then after each step becomes
    ``n + 2`` if all drafted tokens were accepted (accepted == drafted depth
    of that step) and ``max(1, n - 1)`` otherwise.

    Here each request is one generation, so ``n`` is kept per request and sent
    as per-request ``overrides`` for the requests in ``obs.active_requests``;
    the table holds the starting value for new requests. ``n`` never exceeds
    the drafter's ``max_depth`` (HF's counter is unbounded, but a drafter that
    cannot go deeper should not need many misses to come back down). Steps
    that did not speculate for a request leave its ``n`` unchanged. HF's
    "heuristic" also carries ``n`` over to the next ``generate`` call and its
    ``assistant_confidence_threshold`` early stop acts inside the drafter;
    neither is modelled. Chains only.
    """

    name = "hf-heuristic"

    def initial_state(self, seed: int = 0) -> HfState:
        return HfState()

    def decide(self, state: HfState, obs: Observation) -> tuple[PlanDraft, HfState]:
        cap = max(1, obs.drafter.max_depth)
        start = min(self.config.num_assistant_tokens, cap)
        counters = dict(state.counters)
        for step in obs.steps:
            for r in step.requests:
                if r.depth > 0:
                    counters[r.request_id] = hf_next(counters.get(r.request_id, start), r.depth, r.accepted, cap)
        # Only requests still in flight keep a counter (active excludes finished).
        live = {rid: n for rid, n in counters.items() if rid in obs.active_requests}
        overrides = {rid: obs.drafter.clamp(Decision.chain(n)) for rid, n in live.items()}
        reasons = {rid: f"hf-heuristic n={n}" for rid, n in live.items()}
        plan = PlanDraft(uniform_plan(Decision.chain(start), obs), overrides=overrides, reasons=reasons)
        return plan, HfState(tuple(sorted(live.items())))
