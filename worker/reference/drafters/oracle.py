"""``oracle``: replays the target's own greedy continuation (a benchmark
ceiling: every draft is accepted, so a step costs verification only).

``truth`` maps a prompt (tuple of token ids) to the target's greedy output
for it; requests whose prompt is unknown get no draft.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.table import Decision
from worker.reference.drafters.base import DraftContext, DrafterLimits, DraftTree

__all__ = ["OracleDrafter"]


class OracleDrafter:
    kind = "oracle"
    needs_hidden = False
    version = "oracle"

    def __init__(self, truth: Mapping[tuple[int, ...], Sequence[int]], max_depth: int = 8) -> None:
        self.truth = {tuple(k): list(v) for k, v in truth.items()}
        self.limits = DrafterLimits(self.kind, self.version, max_depth, 1, max_depth)

    def propose(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> list[DraftTree]:
        out = []
        for ctx, d in zip(contexts, decisions):
            future = self.truth.get(tuple(ctx.tokens[: ctx.prompt_len]))
            if d.depth == 0 or future is None:
                out.append(DraftTree())
                continue
            done = len(ctx.tokens) - ctx.prompt_len  # tokens generated so far (the root is the last of them)
            out.append(DraftTree.chain(future[done : done + min(d.depth, d.max_nodes)]))
        return out

    def release(self, request_id: str) -> None:
        pass
