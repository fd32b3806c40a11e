"""``trtllm-concurrency``: TensorRT-LLM ``max_concurrency`` / ``draft_len_schedule``."""

from __future__ import annotations

from bisect import bisect_left

from pydantic import Field, field_validator, model_validator

from policies.base import Observation, PlanDraft, Policy
from policies.baselines.base import BatchKey, BatchSize, DraftLen, PositiveDraftLen, StrictConfig, chain_table
from policies.table import DecisionTable


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
