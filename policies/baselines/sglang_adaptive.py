"""``sglang-adaptive``: SGLang ``--speculative-adaptive`` (PR 21599), per-batch-size slots."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from typing import Sequence

from pydantic import Field, field_validator

from policies.base import Observation, PlanDraft, Policy
from policies.baselines.base import MAX_BATCH, MAX_DRAFT, BatchKey, BatchSize, DraftLen, StrictConfig, chain_table


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
