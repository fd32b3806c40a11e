"""The one best-first draft-tree builder (EAGLE-2, OPT-Tree).

A draft node's value is the probability that the target accepts it: the
product of acceptance probabilities along its path (or any value that never
exceeds its parent's). Under a node budget, taking nodes best first by value
maximises the expected accepted tokens, and because a child never beats its
parent the nodes taken always form a tree (EAGLE-2, OPT-Tree).

:func:`grow_best_first` is that expansion, shared by everyone who builds or
values such trees: the goodput policy pricing candidate trees
(``policies/goodput.py``), the simulator's drafter (``worker/sim/tree.py``)
and the reference drafters (Medusa's per-level candidates and the n-gram
trie, ``worker/reference/drafters/``). Each caller supplies a node's child
candidates; the limits are a :class:`~policies.table.Decision`'s: at most
``max_depth`` levels, at most ``max_width`` children *per node* and at most
``max_nodes`` nodes in the tree (root excluded).

The expansion returns :class:`BestFirstTree`, the nodes in the order taken.
Callers turn it into their own tree types, which hold different things:
the drafters' ``DraftTree`` (tokens in node order, for the engine's verify
pass) and the simulator's ``TreeShape`` (no tokens; breadth-first child
ranges, for sampling acceptance walks).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Generic, Literal, Sequence, TypeVar

__all__ = ["BestFirstTree", "Candidates", "grow_best_first"]

T = TypeVar("T")

#: ``candidates(level, payload)``: the children a node may have, as
#: ``(score, payload)`` pairs best first; ``level`` is the node's depth (0 for
#: the root), ``payload`` what the caller attached to it (``root`` for the root).
Candidates = Callable[[int, T], Sequence[tuple[float, T]]]


@dataclass(frozen=True, slots=True)
class BestFirstTree(Generic[T]):
    """Nodes of a best-first expansion, in the order they were taken.

    Node ``i`` hangs under node ``parents[i]`` (-1: under the root, which is
    not a node) at depth ``levels[i]`` (1..), is candidate ``ranks[i]``
    (0-based) of its parent, is worth ``values[i]`` and carries the
    caller's ``payloads[i]`` (a token, a trie key; ``None`` if unused).
    Parents come before their children (the order is topological).
    """

    parents: list[int]
    levels: list[int]
    ranks: list[int]
    values: list[float]
    payloads: list[T]

    def __len__(self) -> int:
        return len(self.parents)


def grow_best_first(
    candidates: Candidates[T],
    max_depth: int,
    max_width: int,
    max_nodes: int,
    *,
    root: T | None = None,
    products: bool = True,
    min_value: float = -math.inf,
    siblings: Literal["in_turn", "together"] = "in_turn",
    every_cap: bool = False,
    max_total: int | None = None,
) -> BestFirstTree[T]:
    """Grow a draft tree best first: always take the most valuable candidate.

    The root's candidates are its children; taking a node at depth
    ``< max_depth`` asks ``candidates`` for its own. A node's value is the
    product of the scores along its path (EAGLE-2: scores are acceptance
    probabilities), or with ``products=False`` its own score. Of each
    node's candidates only the first ``max_width`` count, cut at the first
    one not worth more than ``min_value``. Growth stops at ``max_nodes``
    nodes or when no candidate is left.

    Ties (equal values) go to the candidate that entered the frontier
    first; when a node's candidates enter is the one thing callers differ
    on (``siblings``), and with distinct values both give the same tree.

    Parameters
    ----------
    candidates
        ``candidates(level, payload)`` -> ``[(score, payload), ...]``: the
        children of a node at depth ``level`` (0 = the root) that carries
        ``payload``, best first. Called once per taken node that may have
        children, in the order taken. The result is best first (values
        non-increasing in the order taken, no candidate left out beats a
        node taken) when siblings' values do not increase with rank and no
        child is worth more than its parent (scores in [0, 1] with
        ``products``).
    max_depth, max_width, max_nodes
        Limits: levels, children per node, nodes (root excluded). A limit
        ``<= 0`` gives the empty tree.
    root
        The root's payload.
    products
        Values are path products of the scores (default), or the scores
        themselves (the n-gram trie scores a node by its path share).
    min_value
        Candidates worth ``<= min_value`` are dropped, with every later
        sibling (default: keep all, zeros included).
    siblings
        ``"in_turn"`` (EAGLE-2; the policy, the simulator, Medusa): a
        node's candidate ``r + 1`` enters the frontier when candidate
        ``r`` is taken, so siblings are taken in rank order and the
        frontier stays small. ``"together"`` (the n-gram trie): all of a
        node's candidates enter when the node is taken. On ties the two
        orders differ: ``"in_turn"`` lets an equal candidate of another
        node that entered in between go first.
    every_cap
        Instead of one tree, grow until every depth cap ``L = 1..max_depth``
        holds its first ``max_nodes`` nodes within levels ``<= L`` (the
        goodput policy's depth-cap search): a node is taken only while its
        level's cap is short, so the result is the union of the best-first
        trees of every cap, each its prefix restricted to levels ``<= L``.
    max_total
        With ``every_cap``: stop after this many nodes (default: no bound
        beyond ``max_depth * max_nodes``).

    Returns
    -------
    BestFirstTree
        The nodes in the order taken.

    Examples
    --------
    Acceptance probabilities per level and rank (Medusa's independent heads,
    the policy's acceptance model); each candidate carries its rank:

    >>> import numpy as np
    >>> probs = (-np.sort(-np.random.default_rng(1).uniform(0.1, 0.9, (3, 2)).round(2))).tolist()
    >>> probs
    [[0.86, 0.51], [0.86, 0.22], [0.44, 0.35]]
    >>> tree = grow_best_first(lambda level, _: [(p, r) for r, p in enumerate(probs[level])], 3, 2, 5)
    >>> tree.parents, tree.levels, tree.payloads
    ([-1, 0, -1, 2, 1], [1, 2, 1, 2, 3], [0, 0, 1, 0, 0])
    >>> [round(v, 4) for v in tree.values]
    [0.86, 0.7396, 0.51, 0.4386, 0.3254]

    The best node's best child (0.86 * 0.86) comes before the second
    root candidate (0.51); the depth-3 node (0.86 * 0.86 * 0.44) beats the
    best node's second child (0.86 * 0.22), left out at five nodes.
    """
    if max_depth <= 0 or max_width <= 0 or max_nodes <= 0:
        return BestFirstTree([], [], [], [], [])
    together = siblings == "together"
    if not together and siblings != "in_turn":
        raise ValueError(f"siblings must be 'in_turn' or 'together', got {siblings!r}")
    parents: list[int] = []
    levels: list[int] = []
    ranks: list[int] = []
    values: list[float] = []
    payloads: list[T] = []
    kids: list[Sequence[tuple[float, T]]] = []  # kids[i + 1]: node i's candidates (the root's at 0)
    # Frontier: (-value, entry order, parent, rank, level); the entry order is
    # unique, so ties go first in first out and the rest is never compared.
    heap: list[tuple[float, int, int, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    entered = 0
    open_to = max_depth  # deepest level that may still take nodes (every_cap lowers it)
    within = [0] * (max_depth + 1)  # within[L]: nodes taken at levels <= L (every_cap)
    limit = (max_total if max_total is not None else max_depth * max_nodes) if every_cap else max_nodes

    def enter(node: int, level: int, value: float, payload: T) -> None:
        """``node`` (-1: the root) was taken: its first candidate (``"together"``: all) enters the frontier."""
        nonlocal entered
        row = candidates(level, payload) if level < open_to else ()
        kids.append(row)
        for rank in range(min(len(row), max_width if together else 1)):
            child = value * row[rank][0] if products else row[rank][0]
            if not child > min_value:
                break
            push(heap, (-child, entered, node, rank, level + 1))
            entered += 1

    enter(-1, 0, 1.0, root)
    while heap and len(values) < limit and open_to > 0:
        neg, _, parent, rank, level = pop(heap)
        if level > open_to:
            continue  # every cap this node belongs to is full
        row = kids[parent + 1]
        node, value, payload = len(values), -neg, row[rank][1]
        parents.append(parent)
        levels.append(level)
        ranks.append(rank)
        values.append(value)
        payloads.append(payload)
        if not together and rank + 1 < min(len(row), max_width):  # the next sibling
            score = row[rank + 1][0]
            sibling = (values[parent] if parent >= 0 else 1.0) * score if products else score
            if sibling > min_value:
                push(heap, (-sibling, entered, parent, rank + 1, level))
                entered += 1
        enter(node, level, value, payload)
        if every_cap:
            for cap in range(level, max_depth + 1):
                within[cap] += 1
            while open_to > 0 and within[open_to] >= max_nodes:
                open_to -= 1
    return BestFirstTree(parents, levels, ranks, values, payloads)
