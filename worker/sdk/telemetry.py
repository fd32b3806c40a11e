"""What an engine hands the agent after each step.

Plain dataclasses so an engine's step loop does no protobuf work: the agent's
background task turns them into ``speculation.v1`` messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from worker.sdk.shadow import ShadowOutcome


@dataclass(slots=True)
class RequestTelemetry:
    """One request's part of one step.

    ``accepted_rank`` / ``level_candidates`` give the per-position outcome,
    one entry per level reached (``min(accepted + 1, depth)`` entries): the
    1-based rank of the accepted candidate (0 = none) and how many candidates
    were offered there. Left empty for a chain, they are derived from
    ``accepted`` and ``depth``. ``requested_depth``, ``requested_width``,
    ``requested_nodes``: the decision's shape (0 = off or unknown); with
    ``depth`` 0 they say the drafter offered nothing, with a smaller tree
    which candidates it did not have. ``request_class``: the request's class
    (a name from the plan's classes; empty = the default class);
    ``acceptance_rule``: the rule this step verified it with, ``"strict"``
    (also ``""``) or ``"typical"`` — only where ``agent.acceptance_rule``
    allowed it for the class (the controller counts any other as a violation).
    ``shadows``: the shadow drafts of this request that this step's tokens
    resolved (:mod:`worker.sdk.shadow`; proposed at steps where it did not
    draft, strict rule only).
    """

    request_id: str
    context_len: int
    depth: int = 0
    width: int = 0
    nodes: int = 0
    accepted: int = 0
    accepted_rank: Sequence[int] = ()
    level_candidates: Sequence[int] = ()
    draft_confidence: Sequence[float] = ()
    domain: str = ""
    requested_depth: int = 0
    requested_width: int = 0
    requested_nodes: int = 0
    caught_up_tokens: int = 0  # the drafter caught up on these before the draft (``CatchUp``)
    request_class: str = ""
    acceptance_rule: str = ""  # "" or "strict": lossless; "typical": relaxed
    shadows: Sequence[ShadowOutcome] = ()

    def __post_init__(self) -> None:
        if self.acceptance_rule not in ("", "strict", "typical"):
            raise ValueError(f"acceptance_rule = {self.acceptance_rule!r}: must be '', 'strict' or 'typical'")

    def position_outcomes(self) -> tuple[list[int], list[int]]:
        """(accepted_rank, level_candidates), derived for chains when not given."""
        if self.accepted_rank or self.depth == 0:
            return list(self.accepted_rank), list(self.level_candidates)
        reached = min(self.accepted + 1, self.depth)
        ranks = [1] * min(self.accepted, reached) + [0] * (reached - min(self.accepted, reached))
        return ranks, [1] * reached


@dataclass(slots=True)
class StepTelemetry:
    """One engine step: one target forward over the whole batch."""

    step_id: int
    timestamp: float
    batch_size: int
    draft_ms: float
    verify_ms: float
    requests: list[RequestTelemetry] = field(default_factory=list)
    catch_up_ms: float = 0.0  # drafter catch-ups before the draft, not in draft_ms


@dataclass(slots=True)
class RequestSummary:
    """Sent once when a request leaves the batch."""

    request_id: str
    generated_tokens: int
    steps: int
    accepted_tokens: int
    timestamp: float
