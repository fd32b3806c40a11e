"""The small base every baseline policy shares: field bounds, the strict config, chain tables."""

from __future__ import annotations

from typing import Annotated, Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from policies.base import Observation, per_batch_plan
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
