"""Baselines: policies that behave exactly like today's engines (docs/design.md §4).

Each policy mirrors one engine's run-time adaptation rule, read from the
engine's source, so a benchmark compares the controller against what an
operator can switch on today:

======================  =========================================================
preset name             engine setting mirrored
======================  =========================================================
``static``              fixed depth/width (vLLM ``num_speculative_tokens``,
                        SGLang ``--speculative-num-steps``, TRT-LLM ``max_draft_len``)
``vllm-batch-table``    vLLM V1 ``num_speculative_tokens_per_batch_size`` (PR 32374)
``trtllm-concurrency``  TensorRT-LLM ``max_concurrency`` / ``draft_len_schedule``
``trtllm-gate``         TensorRT-LLM ``acceptance_rate_window_size`` +
                        ``acceptance_rate_threshold`` (permanent off-gate)
``sglang-adaptive``     SGLang ``--speculative-adaptive`` (PR 21599)
``hf-heuristic``        HF transformers ``num_assistant_tokens_schedule="heuristic"``
``bandit-ucb``          BanditSpec (ICML'25) UCB over the draft length γ
======================  =========================================================

Words as in :mod:`policies.table`: depth ``d`` = draft tokens along a chain
(0 = speculation off), width ``w`` = candidates per level (1 = chain),
accepted ``τ`` = draft tokens accepted in a step, bonus token excluded.
All engine baselines draft chains except ``static``, which may set a width.

Policy state is a frozen dataclass (or a tuple of them) holding only tuples,
so ``decide`` cannot change the state it is given; it returns a new one.
Constants derived from a config (e.g. SGLang's resolved slots) may live on
the policy object; run-time memory never does.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from typing import Annotated, Callable, Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.base import FinishedRequest, Observation, PlanDraft, Policy, per_batch_plan, uniform_plan
from policies.presets import register_policy
from policies.table import Decision, DecisionTable

MAX_DRAFT = 64  # no engine drafts deeper; bounds every depth/K field
MAX_BATCH = 1 << 20

# Strict ints: YAML ``true`` or ``2.5`` is refused rather than read as 1 or 2.
BatchSize = Annotated[int, Field(strict=True, ge=1, le=MAX_BATCH)]
DraftLen = Annotated[int, Field(strict=True, ge=0, le=MAX_DRAFT)]
PositiveDraftLen = Annotated[int, Field(strict=True, ge=1, le=MAX_DRAFT)]
# Mapping keys stay lax: engines' JSON configs spell batch-size keys as strings ("8").
BatchKey = Annotated[int, Field(ge=1, le=MAX_BATCH)]


class StrictConfig(BaseModel):
    """Base of the baseline configs: unknown keys refused, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def chain_table(
    obs: Observation, depth_for_batch: Callable[[int], int], breakpoints: Iterable[int] = ()
) -> DecisionTable:
    """A table whose rows are chains of ``depth_for_batch(batch_size)``.

    ``breakpoints`` must hold every batch size where the depth may change, so
    each bucket gets exactly the engine's answer for all of its batch sizes.
    """
    return per_batch_plan(lambda b: Decision.chain(depth_for_batch(b)), obs, tuple(breakpoints))


# =============================================================================== static


class StaticConfig(StrictConfig):
    """A fixed decision for every request and step."""

    depth: DraftLen = Field(3, description="draft depth d; 0 = speculation off")
    width: PositiveDraftLen = Field(1, description="candidates per level; 1 = chain")
    max_nodes: int | None = Field(
        None, strict=True, ge=1, le=MAX_DRAFT * MAX_DRAFT, description="tree node budget; default depth x width"
    )

    @model_validator(mode="after")
    def _nodes_fit_tree(self) -> "StaticConfig":
        if self.depth and self.max_nodes is not None and not self.depth <= self.max_nodes <= self.depth * self.width:
            raise ValueError(
                f"max_nodes={self.max_nodes} must lie in [depth, depth x width] = "
                f"[{self.depth}, {self.depth * self.width}]"
            )
        return self

    def decision(self) -> Decision:
        if self.depth == 0:
            return Decision.off()
        return Decision(self.depth, self.width, self.max_nodes or self.depth * self.width)


class StaticPolicy(Policy[StaticConfig]):
    """Fixed speculation, as every engine runs by default.

    Mirrors vLLM ``num_speculative_tokens`` (plus a static
    ``speculative_token_tree`` when ``width > 1``), SGLang
    ``--speculative-num-steps`` / ``--speculative-eagle-topk`` /
    ``--speculative-num-draft-tokens`` and TensorRT-LLM ``max_draft_len``.

    Rule: every request in every step gets ``Decision(depth, width, max_nodes)``
    (cut to the drafter's limits); ``depth: 0`` turns speculation off.
    """

    name = "static"

    def initial_state(self, seed: int = 0) -> None:
        return None

    def decide(self, state: None, obs: Observation) -> tuple[PlanDraft, None]:
        return PlanDraft(uniform_plan(self.config.decision(), obs)), state


# ===================================================================== vLLM batch table

BatchRange = tuple[BatchSize, BatchSize, DraftLen]


class VllmBatchTableConfig(StrictConfig):
    """vLLM ``speculative_config`` fields of dynamic speculative decoding.

    >>> cfg = VllmBatchTableConfig(num_speculative_tokens=3,
    ...     num_speculative_tokens_per_batch_size=[(1, 16, 3), (64, 128, 2)])
    >>> [cfg.k_for_batch(b) for b in (1, 16, 17, 63, 64, 128, 129, 4096)]
    [3, 3, 3, 3, 2, 2, 2, 2]
    """

    num_speculative_tokens: PositiveDraftLen = Field(
        3, description="start-up maximum K; every scheduled K is clamped to it"
    )
    num_speculative_tokens_per_batch_size: tuple[BatchRange, ...] | None = Field(
        None, description="inclusive (start, end, K) batch-size ranges; K=0 = plain decode; None = static K"
    )

    @field_validator("num_speculative_tokens_per_batch_size")
    @classmethod
    def _normalise_ranges(cls, ranges: tuple[BatchRange, ...] | None) -> tuple[BatchRange, ...] | None:
        # Same checks as vLLM's validate_and_normalize_dynamic_sd_schedule.
        if ranges is None:
            return None
        if not ranges:
            raise ValueError("must list at least one (start, end, K) range")
        for start, end, k in ranges:
            if start > end:
                raise ValueError(f"range ({start}, {end}, {k}) has start > end")
        ordered = tuple(sorted(ranges))
        previous_end = 0
        for start, end, k in ordered:
            if start <= previous_end:
                raise ValueError(f"range ({start}, {end}, {k}) overlaps a range ending at {previous_end}")
            previous_end = end
        if ordered[0][0] != 1:
            raise ValueError(f"the first range must start at batch size 1 (as vLLM requires), got {ordered[0][0]}")
        return ordered

    def k_for_batch(self, batch_size: int) -> int:
        """K vLLM schedules for a step of ``batch_size`` requests."""
        ranges = self.num_speculative_tokens_per_batch_size
        if ranges is None:
            return self.num_speculative_tokens
        # The range with the largest start <= batch size: inside it that is its
        # own K, in a gap or past the last end it is the carried-forward K.
        i = bisect_right([start for start, _, _ in ranges], batch_size) - 1
        return min(self.num_speculative_tokens, ranges[max(i, 0)][2])

    def breakpoints(self) -> tuple[int, ...]:
        ranges = self.num_speculative_tokens_per_batch_size or ()
        return tuple(start for start, _, _ in ranges)


class VllmBatchTablePolicy(Policy[VllmBatchTableConfig]):
    """vLLM V1 dynamic speculative decoding (PR 32374).

    Mirrors ``speculative_config.num_speculative_tokens_per_batch_size``: a
    list of inclusive ``(start, end, K)`` batch-size ranges, ``K = 0`` = plain
    decode, each K clamped to ``num_speculative_tokens``.

    Rule, exactly as vLLM's ``build_dynamic_sd_schedule_lookup`` expands it:
    ranges must not overlap and the first must start at 1; a batch size
    inside a range gets that range's K; a batch size in a gap between ranges,
    or above the last range's end, gets the K of the nearest range below it
    (vLLM carries the previous K forward; it never turns speculation off
    there). Without a table (``None``) every step drafts
    ``num_speculative_tokens``. Chains only; the batch size is the number of
    requests in the step, context length is ignored.
    """

    name = "vllm-batch-table"

    def initial_state(self, seed: int = 0) -> None:
        return None

    def decide(self, state: None, obs: Observation) -> tuple[PlanDraft, None]:
        table = chain_table(obs, self.config.k_for_batch, self.config.breakpoints())
        return PlanDraft(table), state


# ============================================================ TensorRT-LLM concurrency


class TrtllmConcurrencyConfig(StrictConfig):
    """TensorRT-LLM ``DecodingBaseConfig`` batch-size fields.

    >>> cfg = TrtllmConcurrencyConfig(max_draft_len=4, draft_len_schedule={4: 4, 8: 2, 32: 1})
    >>> [cfg.draft_len_for_batch(b) for b in (1, 4, 5, 8, 9, 32, 33)]
    [4, 4, 2, 2, 1, 1, 0]
    """

    max_draft_len: PositiveDraftLen = Field(4, description="draft length with no schedule, and its maximum")
    max_concurrency: BatchSize | None = Field(None, description="speculation off above this many requests")
    draft_len_schedule: dict[BatchKey, DraftLen] | None = Field(
        None, description="{batch size: K}; K of the smallest key >= batch size, 0 above the last key"
    )

    @field_validator("draft_len_schedule")
    @classmethod
    def _sort_schedule(cls, schedule: dict[int, int] | None) -> dict[int, int] | None:
        if schedule is not None and not schedule:
            raise ValueError("must map at least one batch size to a draft length")
        return None if schedule is None else dict(sorted(schedule.items()))

    @model_validator(mode="after")
    def _check_like_trtllm(self) -> "TrtllmConcurrencyConfig":
        # The checks TensorRT-LLM's config validators make.
        schedule = self.draft_len_schedule
        if schedule is not None and self.max_concurrency is not None:
            raise ValueError(
                "max_concurrency and draft_len_schedule are mutually exclusive (as in TensorRT-LLM); "
                "max_concurrency=N is the schedule {N: max_draft_len}"
            )
        if schedule is not None:
            smallest = next(iter(schedule))
            if schedule[smallest] != self.max_draft_len:
                raise ValueError(
                    f"draft_len_schedule[{smallest}]={schedule[smallest]} must equal "
                    f"max_draft_len={self.max_draft_len} (its smallest batch-size key)"
                )
            too_long = {b: k for b, k in schedule.items() if k > self.max_draft_len}
            if too_long:
                raise ValueError(f"draft_len_schedule values {too_long} exceed max_draft_len={self.max_draft_len}")
        return self

    def draft_len_for_batch(self, batch_size: int) -> int:
        """Draft length TensorRT-LLM uses for a step of ``batch_size`` requests."""
        if self.max_concurrency is not None:
            return self.max_draft_len if batch_size <= self.max_concurrency else 0
        if self.draft_len_schedule is None:
            return self.max_draft_len
        keys = list(self.draft_len_schedule)
        i = bisect_left(keys, batch_size)  # smallest key >= batch size
        return self.draft_len_schedule[keys[i]] if i < len(keys) else 0

    def breakpoints(self) -> tuple[int, ...]:
        # Keys are inclusive upper ends, so the draft length changes just above each.
        if self.max_concurrency is not None:
            return (self.max_concurrency + 1,)
        return tuple(key + 1 for key in self.draft_len_schedule or ())


class TrtllmConcurrencyPolicy(Policy[TrtllmConcurrencyConfig]):
    """TensorRT-LLM batch-size cut-offs (PyTorch backend).

    Mirrors ``max_concurrency`` and ``draft_len_schedule`` of the speculative
    config, which TensorRT-LLM refuses together.

    Rule: with ``max_concurrency: N`` a step of ``b`` requests drafts
    ``max_draft_len`` if ``b <= N`` and nothing above. With
    ``draft_len_schedule`` a step drafts the K of the smallest key ``>= b``
    (keys are inclusive upper ends: ``{4: 4, 8: 2, 32: 1}`` gives 4 up to 4
    requests, 2 for 5-8, 1 for 9-32) and 0 above the last key. The smallest
    key's K must equal ``max_draft_len``. With neither, every step drafts
    ``max_draft_len``. Chains only. TensorRT-LLM also caps the request count
    by ``max_num_tokens // (1 + max_draft_len)`` before comparing with
    ``max_concurrency``; that token cap is not modelled here.
    """

    name = "trtllm-concurrency"

    def initial_state(self, seed: int = 0) -> object:
        return None

    def decide(self, state: object, obs: Observation) -> tuple[PlanDraft, object]:
        return PlanDraft(self.schedule_table(obs)), state

    def schedule_table(self, obs: Observation) -> DecisionTable:
        return chain_table(obs, self.config.draft_len_for_batch, self.config.breakpoints())


# ================================================================= TensorRT-LLM gate


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


# ==================================================================== SGLang adaptive


class SglangSlotConfig(StrictConfig):
    """One batch-size slot of SGLang's adaptive config; unset fields inherit."""

    candidate_steps: tuple[DraftLen, ...] = Field(min_length=1, description="num_steps candidates (0 = off)")
    ema_alpha: float | None = Field(None, gt=0.0, le=1.0)
    update_interval: BatchSize | None = None
    warmup_batches: int | None = Field(None, strict=True, ge=0, le=MAX_BATCH)
    down_hysteresis: float | None = Field(None, ge=-MAX_DRAFT, le=MAX_DRAFT)
    up_hysteresis: float | None = Field(None, ge=-MAX_DRAFT, le=MAX_DRAFT)

    @field_validator("candidate_steps")
    @classmethod
    def _sorted_unique(cls, steps: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(steps)))


def _default_sglang_slots() -> dict[int, SglangSlotConfig]:
    # SGLang's DEFAULT_ADAPTIVE_CONFIG: per-slot candidates and hysteresis.
    return {
        1: SglangSlotConfig(candidate_steps=(1, 3, 5, 7), down_hysteresis=-0.25, up_hysteresis=0.0),
        8: SglangSlotConfig(candidate_steps=(0, 1, 3), down_hysteresis=0.0, up_hysteresis=0.0),
        32: SglangSlotConfig(candidate_steps=(0, 1), down_hysteresis=0.0, up_hysteresis=0.0),
        64: SglangSlotConfig(candidate_steps=(0,), down_hysteresis=0.0, up_hysteresis=0.0),
    }


class SglangAdaptiveConfig(StrictConfig):
    """SGLang ``--speculative-num-steps`` plus ``--speculative-adaptive-config``.

    Top-level tuning fields are the defaults every slot inherits unless the
    slot sets its own (SGLang merges ``{**cfg, **slot}`` the same way).
    ``down_hysteresis`` keeps SGLang's sign: it is *added* to the drop
    threshold, so the default ``-0.25`` gives ``ema <= prev - 0.5 - 0.25``.
    """

    initial_steps: DraftLen = Field(3, description="--speculative-num-steps; a slot without it starts mid-list")
    ema_alpha: float = Field(0.2, gt=0.0, le=1.0)
    update_interval: BatchSize = Field(5, description="re-decide every this many batches of a slot")
    warmup_batches: int = Field(10, strict=True, ge=0, le=MAX_BATCH, description="batches before the first re-decide")
    down_hysteresis: float = Field(-0.25, ge=-MAX_DRAFT, le=MAX_DRAFT)
    up_hysteresis: float = Field(0.0, ge=-MAX_DRAFT, le=MAX_DRAFT)
    slots: dict[BatchKey, SglangSlotConfig] = Field(default_factory=_default_sglang_slots, min_length=1)

    @field_validator("slots")
    @classmethod
    def _sort_slots(cls, slots: dict[int, SglangSlotConfig]) -> dict[int, SglangSlotConfig]:
        return dict(sorted(slots.items()))

    def resolved_slots(self) -> tuple["SlotParams", ...]:
        """Each slot's parameters with the inherited defaults filled in, by batch size."""

        def pick(own, default):
            return default if own is None else own

        return tuple(
            SlotParams(
                batch_size=bs,
                candidates=slot.candidate_steps,
                ema_alpha=pick(slot.ema_alpha, self.ema_alpha),
                update_interval=pick(slot.update_interval, self.update_interval),
                warmup_batches=pick(slot.warmup_batches, self.warmup_batches),
                down_hysteresis=pick(slot.down_hysteresis, self.down_hysteresis),
                up_hysteresis=pick(slot.up_hysteresis, self.up_hysteresis),
            )
            for bs, slot in self.slots.items()
        )


@dataclass(frozen=True, slots=True)
class SlotParams:
    """One slot's resolved tuning: its batch-size key, candidates and thresholds."""

    batch_size: int
    candidates: tuple[int, ...]
    ema_alpha: float
    update_interval: int
    warmup_batches: int
    down_hysteresis: float
    up_hysteresis: float


@dataclass(frozen=True, slots=True)
class SlotState:
    """One slot's run-time memory: current K, EMA of accepted drafts, batches seen."""

    steps: int
    ema: float
    batches: int = 0


def slot_start(params: SlotParams, initial_steps: int) -> SlotState:
    """SGLang ``AdaptiveStepSlot.__init__``: the slot's starting K and EMA.

    K is ``initial_steps`` if it is a candidate, else the middle candidate;
    the EMA starts at ``K - 1`` (so -1 for a slot that starts off).
    """
    steps = initial_steps if initial_steps in params.candidates else params.candidates[len(params.candidates) // 2]
    return SlotState(steps, float(steps - 1))


def slot_observe(params: SlotParams, state: SlotState, accepted: Sequence[int]) -> SlotState:
    """SGLang ``AdaptiveStepSlot.update`` for one batch's per-request accepted drafts."""
    if not accepted:
        return state
    ema = state.ema
    if state.steps > 0:  # at K=0 nothing was drafted, so there is nothing to average
        ema = (1 - params.ema_alpha) * ema + params.ema_alpha * (sum(accepted) / len(accepted))
    observed = replace(state, ema=ema, batches=state.batches + 1)
    since_warmup = observed.batches - params.warmup_batches
    if since_warmup <= 0 or since_warmup % params.update_interval:
        return observed
    return slot_redecide(params, observed)


def slot_redecide(params: SlotParams, state: SlotState) -> SlotState:
    """SGLang ``AdaptiveStepSlot._recompute_params`` (``ceiling_coeff`` 0, its default)."""
    steps = params.candidates
    i = steps.index(state.steps)
    if state.steps == 0:
        # Probe: K=0 yields no acceptance data, so every re-decide at 0 tries
        # the next candidate up; a slot that never drafted starts that probe
        # from the neutral EMA (K - 1) instead of its initial -1.
        target = steps[min(i + 1, len(steps) - 1)]
        ema = float(target - 1) if target > 0 and state.ema < 0 else state.ema
        return replace(state, steps=target, ema=ema)
    start = i
    while i > 0:  # step down while even the next lower K would be under-used
        lower = steps[i - 1]
        drop = (0.5 if lower == 0 else lower - 0.5) + params.down_hysteresis
        if state.ema > drop:
            break
        i -= 1
    if i == start:  # step up while the current K is (nearly) fully accepted
        while i < len(steps) - 1 and state.ema > steps[i] - 0.5 + params.up_hysteresis:
            i += 1
    return replace(state, steps=steps[i])


class SglangAdaptivePolicy(Policy[SglangAdaptiveConfig]):
    """SGLang ``--speculative-adaptive`` (PR 21599, ``AdaptiveSpeculativeParams``).

    Mirrors SGLang's per-batch-size slots, each with its own candidate list
    of ``num_steps`` (defaults bs1 [1, 3, 5, 7], bs8 [0, 1, 3], bs32 [0, 1],
    bs64 [0]), current K, EMA and batch counter. Chains only (EAGLE topk 1);
    the width is never adapted.

    Rule, per step of ``obs.steps`` in order (one step = one batch):

    * routing: a batch of size ``b`` belongs to the slot with the largest key
      ``<= b`` (below the smallest key: the smallest slot). SGLang first pads
      ``b`` to its CUDA-graph batch size; no padding is modelled here.
    * if the slot's K > 0: ``ema <- (1 - 0.2) ema + 0.2 * mean accepted drafts
      over the batch's requests``; at K = 0 the EMA is left alone.
    * the slot's batch counter advances; after ``warmup_batches`` (10) and then
      every ``update_interval`` (5) batches of that slot, it re-decides:
      at K > 0 it steps down while ``ema <= lower - 0.5 + down_hysteresis``
      (``lower`` = the next candidate below; ``0.5 + down_hysteresis`` when
      that candidate is 0), and only if it did not step down it steps up
      while ``ema > K - 0.5 + up_hysteresis``; at K = 0 it probes the next
      candidate up (the EMA, if never fed, restarts at ``probe - 1``), and the
      probe drops back to 0 at the next re-decide unless acceptance holds.

    The table's rows follow each slot's current K, with the slot keys as
    exact bucket edges.
    """

    name = "sglang-adaptive"

    def __init__(self, config: SglangAdaptiveConfig) -> None:
        super().__init__(config)
        # Derived from the config only; run-time memory lives in the state.
        self.slot_params: tuple[SlotParams, ...] = config.resolved_slots()
        self.slot_keys: tuple[int, ...] = tuple(p.batch_size for p in self.slot_params)

    def slot_index(self, batch_size: int) -> int:
        return max(bisect_right(self.slot_keys, batch_size) - 1, 0)

    def initial_state(self, seed: int = 0) -> tuple[SlotState, ...]:
        return tuple(slot_start(p, self.config.initial_steps) for p in self.slot_params)

    def decide(self, state: tuple[SlotState, ...], obs: Observation) -> tuple[PlanDraft, tuple[SlotState, ...]]:
        slots = list(state)
        for step in obs.steps:
            i = self.slot_index(step.batch_size)
            slots[i] = slot_observe(self.slot_params[i], slots[i], [r.accepted for r in step.requests])
        new_state = tuple(slots)
        table = chain_table(obs, lambda b: new_state[self.slot_index(b)].steps, self.slot_keys)
        return PlanDraft(table), new_state


# =========================================================================== HF heuristic


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


# ============================================================================ bandit UCB


class BanditUcbConfig(StrictConfig):
    """Arms and exploration constant of the UCB bandit."""

    arms: tuple[PositiveDraftLen, ...] = Field(
        (1, 2, 3, 4), min_length=1, description="draft lengths γ to choose from"
    )
    exploration: float = Field(1.0, ge=0.0, le=100.0, description="c in mean + c sqrt(2 ln N / n_a)")

    @field_validator("arms")
    @classmethod
    def _unique(cls, arms: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(arms)) != len(arms):
            raise ValueError(f"arms must be distinct, got {list(arms)}")
        return arms


@dataclass(frozen=True, slots=True)
class BanditState:
    """Pull counts and raw reward sums per arm, the largest reward seen, and the arm in force."""

    counts: tuple[int, ...]
    sums: tuple[float, ...]
    max_reward: float = 0.0
    current: int | None = None  # index into arms; None before the first decide


def round_reward(obs: Observation) -> float | None:
    """Tokens per second of the round: Σ emitted tokens / Σ step seconds (None if no time)."""
    seconds = sum(step.step_ms for step in obs.steps) / 1000.0
    if seconds <= 0.0:
        return None
    return sum(step.tokens for step in obs.steps) / seconds


def ucb_choose(state: BanditState, exploration: float) -> int:
    """Index of the next arm: unplayed arms first in order, then UCB1 (ties: lowest index)."""
    for i, n in enumerate(state.counts):
        if n == 0:
            return i
    total = sum(state.counts)
    scale = state.max_reward or 1.0

    def index(i: int) -> float:
        mean = state.sums[i] / state.counts[i] / scale
        return mean + exploration * math.sqrt(2.0 * math.log(total) / state.counts[i])

    return max(range(len(state.counts)), key=lambda i: (index(i), -i))


class BanditUcbPolicy(Policy[BanditUcbConfig]):
    """BanditSpec (ICML'25) UCB over the draft length γ ∈ {1, 2, 3, 4}.

    Rule: a round is the steps of one ``decide`` call (``obs.steps``); its
    reward is the tokens per second they achieved, Σ(τ + 1) / Σ step seconds,
    credited to the arm chosen at the previous call (a round without steps
    or time credits nothing). Warm-up plays every arm once, round-robin in
    the configured order; afterwards the arm maximising
    ``mean_a / r_max + c * sqrt(2 ln N / n_a)`` is played (UCB1 with
    ``c = 1``), where ``r_max`` is the largest round reward seen so far.
    Dividing by that running maximum puts the means in [0, 1], the range
    UCB1's exploration term is calibrated for, whatever the model's speed;
    raw sums are kept so the normalisation always uses the latest maximum.
    The chosen γ applies worker-wide: a uniform chain table, no overrides.
    Steps run under a plan the worker had not yet applied are credited to
    the new arm all the same, as in the paper's round model.
    """

    name = "bandit-ucb"

    def initial_state(self, seed: int = 0) -> BanditState:
        n = len(self.config.arms)
        return BanditState((0,) * n, (0.0,) * n)

    def decide(self, state: BanditState, obs: Observation) -> tuple[PlanDraft, BanditState]:
        reward = round_reward(obs) if state.current is not None else None
        if reward is not None:
            i = state.current
            state = replace(
                state,
                counts=_bump(state.counts, i, 1),
                sums=_bump(state.sums, i, reward),
                max_reward=max(state.max_reward, reward),
            )
        arm = ucb_choose(state, self.config.exploration)
        table = uniform_plan(Decision.chain(self.config.arms[arm]), obs)
        return PlanDraft(table), replace(state, current=arm)


def _bump(values: tuple, i: int, amount: float) -> tuple:
    return values[:i] + (values[i] + amount,) + values[i + 1 :]


# ============================================================================ registration

BASELINES: Mapping[str, tuple[type[StrictConfig], type[Policy]]] = {
    StaticPolicy.name: (StaticConfig, StaticPolicy),
    VllmBatchTablePolicy.name: (VllmBatchTableConfig, VllmBatchTablePolicy),
    TrtllmConcurrencyPolicy.name: (TrtllmConcurrencyConfig, TrtllmConcurrencyPolicy),
    TrtllmGatePolicy.name: (TrtllmGateConfig, TrtllmGatePolicy),
    SglangAdaptivePolicy.name: (SglangAdaptiveConfig, SglangAdaptivePolicy),
    HfHeuristicPolicy.name: (HfHeuristicConfig, HfHeuristicPolicy),
    BanditUcbPolicy.name: (BanditUcbConfig, BanditUcbPolicy),
}

for _name, (_config, _policy) in BASELINES.items():
    register_policy(_name, _config, _policy)
