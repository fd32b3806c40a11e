"""``medusa``: K residual heads on the target's last hidden state (Cai et al. 2024).

Head k (1-based) on the feature of the last token before the root guesses
the token k positions after the root. Each head's top-``width`` candidates
(scored with the draft LM head: the target's LM head rows of a reduced draft
vocabulary) form independent per-level candidate lists; the sparse tree is
taken best-first by the product of the candidates' probabilities along each
path (``best_first_tree``) within the decision's depth, width and node budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policies.table import Decision
from worker.reference.drafters.base import DraftContext, DrafterLimits, DraftTree, best_first_tree, draft_lm_head
from worker.reference.heads.store import HeadsBundle

__all__ = ["MedusaDrafter"]


class MedusaDrafter:
    kind = "medusa"
    needs_hidden = True

    def __init__(self, bundle: HeadsBundle, model, max_width: int = 4, max_tree_nodes: int = 32) -> None:
        if bundle.kind != "medusa":
            raise ValueError(f"MedusaDrafter needs medusa heads, got {bundle.kind}")
        # Where the target is: the heads read its features there (``bundle.module`` moves with them).
        self.device = next(model.parameters()).device
        self.heads = bundle.module.to(self.device).eval()
        self.vocab_map = bundle.vocab_map.to(self.device)
        # Every torch layer that drafting runs (``worker.reference.engine.kernels.tune_model`` may swap
        # their linears, so they are always reached through this dict).
        self.layers = torch.nn.ModuleDict({"heads": self.heads, "lm_head": draft_lm_head(model, bundle.vocab_map)})
        self.version = bundle.version
        k = bundle.module.num_heads
        self.limits = DrafterLimits(self.kind, self.version, k, max_width, max(k, max_tree_nodes),
                                    int(bundle.meta.get("trained_context_len", 0)))
        self._last: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def propose(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> list[DraftTree]:
        for ctx in contexts:
            if ctx.hidden is not None and ctx.hidden.shape[0]:
                self._last[ctx.request_id] = ctx.hidden[-1].to(torch.float32)
        rows = [i for i, (c, d) in enumerate(zip(contexts, decisions)) if d.depth > 0 and c.request_id in self._last]
        out = [DraftTree() for _ in contexts]
        if not rows:
            return out
        depth = max(decisions[i].depth for i in rows)
        width = max(decisions[i].width for i in rows)
        feats = torch.stack([self._last[contexts[i].request_id] for i in rows])  # [n, d]
        h = self.heads(feats)[:depth]  # [D, n, d]
        probs = torch.softmax(self.layers["lm_head"](h), -1)  # [D, n, V]
        p, idx = probs.topk(width, -1)  # [D, n, w]
        tokens = self.vocab_map[idx].tolist()
        p = p.tolist()
        for r, i in enumerate(rows):
            d = decisions[i]
            levels = [list(zip(tokens[lvl][r][: d.width], p[lvl][r][: d.width])) for lvl in range(d.depth)]
            out[i] = best_first_tree(levels, d)
        return out

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)
