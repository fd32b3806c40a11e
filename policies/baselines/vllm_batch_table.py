"""``vllm-batch-table``: vLLM V1 ``num_speculative_tokens_per_batch_size`` (PR 32374)."""

from __future__ import annotations

from bisect import bisect_right

from pydantic import Field, field_validator

from policies.base import Observation, PlanDraft, Policy
from policies.baselines.base import BatchSize, DraftLen, PositiveDraftLen, StrictConfig, chain_table

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
