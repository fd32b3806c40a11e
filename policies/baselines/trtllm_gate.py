"""``trtllm-gate``: TensorRT-LLM's permanent acceptance gate (``SpeculationGate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field

from policies.base import FinishedRequest, Observation, PlanDraft, uniform_plan
from policies.baselines.base import MAX_DRAFT, BatchSize
from policies.baselines.trtllm_concurrency import TrtllmConcurrencyConfig, TrtllmConcurrencyPolicy
from policies.table import Decision


class TrtllmGateConfig(TrtllmConcurrencyConfig):
    """TensorRT-LLM acceptance gate fields (on top of the batch-size fields)."""

    acceptance_rate_window_size: BatchSize = Field(description="N: finished requests in the rolling window")
    acceptance_rate_threshold: float = Field(
        ge=0.0, le=MAX_DRAFT, description="off for good once the window mean of accepted/iteration is below this"
    )


@dataclass(frozen=True, slots=True)
class GateState:
    """Rolling window of the gate: last N per-request accepted-per-iteration values."""

    window: tuple[float, ...] = ()
    recorded: int = 0  # requests recorded since start (the window is full once >= N)
    disabled: bool = False
    mean_at_disable: float | None = None


def gate_record(state: GateState, accepted_per_iteration: float, window: int, threshold: float) -> GateState:
    """TensorRT-LLM ``SpeculationGate.record_avg_decoded`` for one finished request."""
    if state.disabled:
        return state
    values = (state.window + (max(0.0, accepted_per_iteration),))[-window:]
    recorded = state.recorded + 1
    if recorded >= window:
        mean = math.fsum(values) / len(values)
        if mean < threshold:
            return GateState(values, recorded, True, mean)
    return GateState(values, recorded)


class TrtllmGatePolicy(TrtllmConcurrencyPolicy):
    """TensorRT-LLM permanent acceptance gate (``SpeculationGate``).

    Mirrors ``acceptance_rate_window_size`` + ``acceptance_rate_threshold``
    with the semantics in docs/design.md §4: the value recorded per finished
    request is its accepted draft tokens per decoding iteration
    (``avg_decoded_tokens_per_iter - 1``, here
    :attr:`~policies.base.FinishedRequest.accepted_per_step`), in finish order.

    Rule: keep the last N values; after every finished request, once at
    least N requests have been recorded, if their mean is below the
    threshold speculation is switched off **for good**: the table is off
    everywhere from then on and nothing ever turns it back on, however well
    the drafter would do later (that is the engine's behaviour the
    controller must beat). Requests with zero decoding iterations are not
    recorded (the engine skips a missing average). Until then the table is
    the batch-size table of :class:`TrtllmConcurrencyPolicy` (by default a
    fixed ``max_draft_len``); requests finished during its K=0 phases count
    as accepting 0, as in the engine.

    Newer TensorRT-LLM releases record the per-iteration acceptance *rate*
    (accepted / drafted, in [0, 1]) instead; this policy keeps the accepted
    length the design brief names.
    """

    name = "trtllm-gate"

    def initial_state(self, seed: int = 0) -> GateState:
        return GateState()

    def decide(self, state: GateState, obs: Observation) -> tuple[PlanDraft, GateState]:
        for request in obs.finished:
            state = self.record(state, request)
        if state.disabled:
            return PlanDraft(uniform_plan(Decision.off(), obs)), state
        return PlanDraft(self.schedule_table(obs)), state

    def record(self, state: GateState, request: FinishedRequest) -> GateState:
        if request.steps <= 0:
            return state
        cfg = self.config
        return gate_record(
            state, request.accepted_per_step, cfg.acceptance_rate_window_size, cfg.acceptance_rate_threshold
        )
