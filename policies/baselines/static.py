"""``static``: fixed depth and width, as every engine runs by default."""

from __future__ import annotations

from pydantic import Field, model_validator

from policies.base import Observation, PlanDraft, Policy, uniform_plan
from policies.baselines.base import MAX_DRAFT, DraftLen, PositiveDraftLen, StrictConfig
from policies.table import Decision


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
