"""The one small Protocol every drafter implements, and the draft tree it returns.

A drafter is asked once per engine step for **every** active request (with
``Decision.off()`` for requests that do not speculate this step, so that it
can still ingest their new hidden states) and returns one ``DraftTree`` per
request. Trees follow ``worker/reference/engine/tree.py``: nodes in topological order,
``parents[i] == -1`` for a child of the root (the last committed token,
whose KV the target has not computed yet).

Hidden states: ``DraftContext.hidden`` carries the target's last hidden
state (after the final norm: the LM head's input) for the tokens committed
since the previous call, *excluding* the root, i.e. rows
``tokens[-1 - m : -1]`` for ``m = hidden.shape[0]``. The prefill emits a
request's first token, so on its first call the root is that token and
``hidden`` covers the whole prompt, unless the drafter took the prompt at
admission (``CatchUp``). Drafters that do not need them
(``needs_hidden = False``) get ``None``.

A drafter may also say ``shadows = True``: its proposals cost nothing worth
timing and are fixed by the context (prompt lookup), so the engine may
propose shadow drafts for requests that do not draft (``worker.sdk.shadow``);
without the attribute it proposes none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from policies.base import DrafterLimits
from policies.table import Decision
from policies.tree import grow_best_first

__all__ = ["CatchUp", "DraftContext", "DraftTree", "Drafter", "DrafterLimits", "EMPTY_TREE", "best_first_tree",
           "draft_lm_head"]


@dataclass(slots=True)
class DraftContext:
    """What a drafter sees of one request at one step."""

    request_id: str
    tokens: list[int]  # committed tokens: prompt (no pads) + generated; the root last
    hidden: torch.Tensor | None = None  # [m, hidden] target features of tokens[-1-m:-1]
    prompt_len: int = 0


@dataclass(slots=True)
class DraftTree:
    """A draft tree: ``parents`` (-1 = root), ``tokens`` and ``confidences``
    (the drafter's probability of each node given its parent, in [0, 1];
    siblings are ranked by it for the per-position telemetry).

    What the engine verifies: tokens in the drafter's node order. The
    simulator's ``worker.sim.tree.TreeShape`` is a different thing (no
    tokens; children as breadth-first rank ranges, for acceptance walks).
    Medusa's and the n-gram drafter's trees, like the simulator's shapes,
    are grown by :func:`policies.tree.grow_best_first`.

    ``proposal`` matters only to sampled verification (engine temperature
    > 0): ``None`` says the tokens are deterministic given the context
    (top-k, lookup); a ``[n, vocab]`` tensor says the drafter *sampled*
    them: row i is the law node i's parent drew its children from, one
    after the other without replacement in node order
    (``worker/reference/engine/sampling.py``)."""

    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    proposal: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not (len(self.parents) == len(self.tokens) == len(self.confidences)):
            raise ValueError(
                f"draft tree lists differ in length: parents {len(self.parents)}, tokens {len(self.tokens)}, "
                f"confidences {len(self.confidences)}"
            )
        if self.proposal is not None and self.proposal.shape[0] != len(self.parents):
            raise ValueError(f"draft tree proposal has {self.proposal.shape[0]} rows for {len(self.parents)} nodes")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def depth(self) -> int:
        depth = [0] * len(self.parents)
        for i, p in enumerate(self.parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return max(depth, default=0)

    def max_children(self) -> int:
        counts: dict[int, int] = {}
        for p in self.parents:
            counts[p] = counts.get(p, 0) + 1
        return max(counts.values(), default=0)

    @classmethod
    def chain(cls, tokens: Sequence[int], confidences: Sequence[float] | None = None) -> "DraftTree":
        tokens = [int(t) for t in tokens]
        conf = [float(c) for c in confidences] if confidences is not None else [1.0] * len(tokens)
        return cls([i - 1 for i in range(len(tokens))], tokens, conf)


EMPTY_TREE = DraftTree()


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter."""

    kind: str  # "ngram" | "medusa" | "eagle" | "oracle"
    version: str  # opaque id (hash of weights + training data for trained heads)
    limits: DrafterLimits  # the largest tree it builds (policies' type: what its Hello reports)
    needs_hidden: bool

    def propose(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> list[DraftTree]:
        """One tree per context, within its decision (depth/width/max_nodes);
        an off decision gets an empty tree."""
        ...

    def release(self, request_id: str) -> None:
        """The request left the batch: drop its state."""
        ...


@runtime_checkable
class CatchUp(Protocol):
    """A drafter whose per-request state follows the target's features and may
    fall behind while the request does not draft (EAGLE's head cache).

    Such a drafter only *queues* features for a request that is off: the
    prompt's, handed over at admission (``ingest_prompts``), and every
    step's while its decision is off, so speculation that is off costs no
    head forward at all. Before the timed draft of a step the engine calls
    ``catch_up`` with the requests about to draft: they run the head over
    everything queued for them, so the draft time a step reports is what
    drafting costs at that step, whatever the request's history (a request
    switched on after its whole prompt and fifty off steps would otherwise
    report a draft time the cost model reads as a far deeper tree). The
    engine times catch-ups apart (``EngineStats.catch_up_s``) and reports
    them with the step (``catch_up_ms``, per request ``caught_up_tokens``)."""

    def ingest_prompts(self, contexts: Sequence[DraftContext]) -> None:
        """Queue each admitted request's prompt features: ``tokens`` = the
        prompt and the first token the prefill emitted (the first root),
        ``hidden`` = the features of every prompt token."""
        ...

    def catch_up(self, contexts: Sequence[DraftContext]) -> dict[str, int]:
        """Run the head over what is queued for these requests (one batched
        forward; requests with nothing queued are skipped). ``tokens`` are
        the committed tokens, the root last; ``hidden`` is not read.
        Returns the tokens caught up on per request (those with none left out)."""
        ...


def draft_lm_head(model, vocab_map: torch.Tensor) -> torch.nn.Linear:
    """The target's LM head restricted to the draft vocabulary (frozen copies of
    its rows): what Medusa and EAGLE heads score their guesses with. A layer, not
    a bare matrix, so the engine's kernel tuning reaches it too."""
    weight = model.get_output_embeddings().weight.detach()
    rows = weight[vocab_map.to(weight.device)].to(torch.float32)  # on the target's device, as its features
    head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device)
    head.weight = torch.nn.Parameter(rows, requires_grad=False)
    return head.eval()


def best_first_tree(level_probs: Sequence[Sequence[tuple[int, float]]], decision: Decision) -> DraftTree:
    """Sparse candidate tree from independent per-level candidates (Medusa style).

    ``level_probs[l]`` lists ``(token, prob)`` for depth ``l + 1``, best
    first. A node is a choice of rank at every level down to it; its score is
    the product of its path's probabilities (the heads' independence
    assumption). Nodes are taken best-first (:func:`policies.tree.grow_best_first`,
    siblings in turn), so the tree is prefix-closed, holds at most
    ``max_nodes`` nodes, ``depth`` levels and ``width`` children per node.

    >>> t = best_first_tree([[(5, 0.9), (6, 0.1)], [(7, 0.8), (8, 0.2)]], Decision(2, 2, 3))
    >>> t.parents, t.tokens
    ([-1, 0, 0], [5, 7, 8])
    """
    depth = min(decision.depth, len(level_probs))
    if depth <= 0:
        return DraftTree()
    rows = [[(p, tok) for tok, p in level] for level in level_probs[:depth]]
    grown = grow_best_first(lambda level, _: rows[level], depth, decision.width, decision.max_nodes)
    return DraftTree(grown.parents, [int(tok) for tok in grown.payloads],
                     [float(rows[level - 1][rank][0]) for level, rank in zip(grown.levels, grown.ranks)])
