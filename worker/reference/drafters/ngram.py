"""``ngram``: prompt lookup decoding (Saxena 2023), no weights.

The last ``n`` committed tokens (``n`` from ``max_ngram`` down to
``min_ngram``) are looked up earlier in the request's own tokens (prompt and
output); what followed each earlier occurrence is a candidate continuation.
A chain takes the most recent occurrence of the longest matching n-gram.
A tree (width > 1) merges the continuations of several occurrences into a
trie: siblings are the distinct next tokens, a node's confidence is the
share of the (n-gram-length weighted) continuations through its parent that
go through it, and nodes are kept best-first by that path share
(:func:`policies.tree.grow_best_first`).

Lookups are O(1): each request keeps a dict from every n-gram it has seen
to the positions that followed it, extended as tokens are committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.table import Decision
from policies.tree import grow_best_first
from worker.reference.drafters.base import DraftContext, DrafterLimits, DraftTree

__all__ = ["NgramDrafter"]


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    # n -> n-gram -> positions right after each occurrence, oldest first
    grams: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)


class NgramDrafter:
    """Prompt lookup over the request's own tokens."""

    kind = "ngram"
    needs_hidden = False
    # A lookup is a few dict reads and its chain is fixed by the context: the engine may propose
    # shadow drafts for requests that do not draft (worker.sdk.shadow), at no cost worth timing.
    shadows = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_depth: int = 8, max_width: int = 4,
                 max_tree_nodes: int = 32, max_matches: int = 16) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.version = f"ngram-{min_ngram}-{max_ngram}"
        self.limits = DrafterLimits(self.kind, self.version, max_depth, max_width, max_tree_nodes)
        self._state: dict[str, _Index] = {}

    # ------------------------------------------------------------ index
    def _sync(self, rid: str, tokens: list[int]) -> _Index:
        st = self._state.get(rid)
        if st is None or tokens[: len(st.tokens)] != st.tokens[: len(tokens)] or len(tokens) < len(st.tokens):
            st = self._state[rid] = _Index([], {n: {} for n in range(self.min_ngram, self.max_ngram + 1)})
        seen = st.tokens
        start = len(seen)
        seen.extend(tokens[start:])
        # Register every n-gram that ends at position e-1 and is followed by
        # a token, i.e. e < len(tokens): an occurrence is useful only once
        # something follows it.
        for e in range(max(start, 1), len(seen)):
            for n, table in st.grams.items():
                if e - n < 0:
                    continue
                table.setdefault(tuple(seen[e - n : e]), []).append(e)
        return st

    # ------------------------------------------------------------ propose
    def propose(self, contexts: Sequence[DraftContext], decisions: Sequence[Decision]) -> list[DraftTree]:
        out = []
        for ctx, d in zip(contexts, decisions):
            st = self._sync(ctx.request_id, ctx.tokens)
            out.append(self._tree(st.tokens, st.grams, d) if d.depth > 0 else DraftTree())
        return out

    def _continuations(self, tokens: list[int], grams, depth: int, want: int) -> list[tuple[int, list[int]]]:
        """(weight, continuation) from the most recent occurrences, longest n-gram first."""
        found: list[tuple[int, list[int]]] = []
        used: set[int] = set()
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n > len(tokens):
                continue
            positions = grams[n].get(tuple(tokens[-n:]))
            if not positions:
                continue
            for pos in reversed(positions):
                if pos in used or pos >= len(tokens):
                    continue
                used.add(pos)
                found.append((n, tokens[pos : pos + depth]))
                if len(found) >= want:
                    return found
            if found and want == 1:
                return found
        return found

    def _tree(self, tokens: list[int], grams, d: Decision) -> DraftTree:
        conts = self._continuations(tokens, grams, d.depth, 1 if d.width == 1 else self.max_matches)
        if not conts:
            return DraftTree()
        if d.width == 1:
            n, cont = conts[0]
            cont = cont[: d.max_nodes]
            return DraftTree.chain(cont, [min(1.0, 0.3 + 0.2 * n)] * len(cont))
        # trie: node key = path tuple
        weight: dict[tuple[int, ...], float] = {}
        for n, cont in conts:
            for k in range(1, len(cont) + 1):
                key = tuple(cont[:k])
                weight[key] = weight.get(key, 0.0) + n
        kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for key in weight:
            kids.setdefault(key[:-1], []).append(key)
        for parent, ks in kids.items():
            ks.sort(key=lambda k: -weight[k])
            del ks[d.width :]
        total = sum(weight[k] for k in kids.get((), []))
        # Best first by path share; all of a node's children enter the frontier
        # when it is taken ("together"): with the integer weights' many ties
        # that order is this drafter's, and "in_turn" would reorder ties.
        grown = grow_best_first(lambda level, key: [(weight[k] / total, k) for k in kids.get(key, ())],
                                d.depth, d.width, d.max_nodes, root=(), siblings="together", products=False)
        keys = grown.payloads
        conf = [weight[k] / (weight[k[:-1]] if len(k) > 1 else total) for k in keys]
        return DraftTree(grown.parents, [k[-1] for k in keys], conf)

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)
