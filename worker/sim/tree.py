"""Draft trees and their verification outcomes.

A tree is built the way EAGLE-2 does: the value of a node is the product of
the drafter's confidences along its path, and nodes are added greedily, best
value first, with at most ``width`` children per node, depth at most
``depth`` and at most ``max_nodes`` nodes (root excluded). Children of a node
are its candidates ranked by confidence, so a node always has ranks
``1..c`` and never a gap. The expansion is the one the goodput policy values
trees with and the reference drafters build them with
(:func:`policies.tree.grow_best_first`); :class:`TreeShape` keeps what the
simulator needs of its result.

The drafter's confidence used to build the tree is the true ``q`` rounded to
1/256 (EAGLE-2 found draft confidence well calibrated; rounding lets trees be
cached). Outcomes are sampled from the exact ``q``: from the root, at each
level the target accepts the rank-``R`` candidate with probability
``q[level, R]`` (or none), and the walk moves on only if that rank is among
the current node's children; it stops at a rejection or at a leaf.

Outcome fields follow ``worker/sdk/telemetry.py``: ``accepted`` (τ), and per
level reached — a level whose parent node had children — the accepted rank
(0 = none) and the candidates offered. A walk that ends by rejection has
``τ + 1`` entries; one that ends at a leaf has ``τ`` (the leaf's depth), so
entries = ``min(τ + 1, depth)`` for a full tree and fewer for a shallow leaf.

>>> q = np.array([[0.8, 0.1], [0.7, 0.1], [0.6, 0.1]])
>>> tree = build_tree(q, depth=3, width=2, max_nodes=4)
>>> tree.nodes, tree.depth, tree.child_count.tolist()
(4, 3, [2, 1, 0, 1, 0])
>>> sample_outcome(tree, q, np.array([0.1, 0.5, 0.9]))
TreeOutcome(accepted=2, accepted_rank=(1, 1, 0), level_candidates=(2, 1, 1))
>>> sample_outcome(tree, q, np.array([0.85, 0.0, 0.0]))  # rank 2 at level 1: a leaf
TreeOutcome(accepted=1, accepted_rank=(2,), level_candidates=(2,))
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from policies.tree import grow_best_first

CONF_SCALE = 256


@dataclass(frozen=True, slots=True)
class TreeShape:
    """The shape of a draft tree in breadth-first order (node 0 = root, the last accepted token).

    ``child_count[i]`` children of node ``i`` are nodes
    ``first_child[i] .. first_child[i] + child_count[i] - 1`` in rank order.

    A shape, not the drafters' ``DraftTree``: the simulator draws no tokens,
    only which rank the target accepts at each level, so it keeps each
    node's children as a contiguous rank-ordered range for the acceptance
    walk of :func:`sample_outcomes` (the drafters' tree holds tokens and
    confidences in the order the engine verifies them).
    """

    depth: int
    width: int
    nodes: int
    child_count: np.ndarray
    first_child: np.ndarray
    level_sizes: tuple[int, ...]
    children: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)  # (count, first) per node

    def __post_init__(self) -> None:
        # Plain ints for the per-step walk in :func:`sample_outcomes`.
        object.__setattr__(self, "children", tuple(zip(self.child_count.tolist(), self.first_child.tolist())))


EMPTY_TREE = TreeShape(0, 0, 0, np.zeros(1, np.int64), np.zeros(1, np.int64), ())


@dataclass(frozen=True, slots=True)
class TreeOutcome:
    accepted: int
    accepted_rank: tuple[int, ...]
    level_candidates: tuple[int, ...]


def build_tree(conf: np.ndarray, depth: int, width: int, max_nodes: int) -> TreeShape:
    """Greedy best-first tree from confidences ``conf`` [levels, ranks]
    (:func:`policies.tree.grow_best_first`, siblings in turn, zero values kept).

    Parameters
    ----------
    conf
        Drafter confidence of the rank-``r`` candidate at level ``k``
        (non-increasing in ``r``); rows past ``conf.shape[0]`` are not drafted.
    depth, width, max_nodes
        Limits of the decision (depth 0 gives the empty tree).
    """
    depth = min(depth, conf.shape[0])
    width = min(width, conf.shape[1])
    if depth <= 0 or width <= 0 or max_nodes <= 0:
        return EMPTY_TREE
    rows = [[(c, None) for c in row] for row in conf[:depth].tolist()]
    grown = grow_best_first(lambda level, _: rows[level], depth, width, max_nodes)
    n = len(grown) + 1  # node 0 is the root
    children: list[list[int]] = [[] for _ in range(n)]
    for i, parent in enumerate(grown.parents):
        children[parent + 1].append(i + 1)
    rank_of = [0] + grown.ranks
    # Renumber breadth-first so that siblings are contiguous, in rank order.
    order = [0]
    for i in order:
        order.extend(sorted(children[i], key=rank_of.__getitem__))
    new_id = {old: new for new, old in enumerate(order)}
    child_count = np.zeros(n, np.int64)
    first_child = np.zeros(n, np.int64)
    for old in order:
        kids = children[old]
        if kids:
            child_count[new_id[old]] = len(kids)
            first_child[new_id[old]] = min(new_id[k] for k in kids)
    max_level = max(grown.levels, default=0)
    sizes = tuple(sum(1 for lv in grown.levels if lv == k) for k in range(1, max_level + 1))
    return TreeShape(max_level, int(child_count.max()), n - 1, child_count, first_child, sizes)


def chain_tree(depth: int) -> TreeShape:
    """The width-1 tree of ``depth`` nodes (what any confidence gives for width 1)."""
    tree = _CHAINS.get(depth)
    if tree is None:
        if depth <= 0:
            return EMPTY_TREE
        cc = np.array([1] * depth + [0], np.int64)
        fc = np.array(list(range(1, depth + 1)) + [0], np.int64)
        tree = _CHAINS[depth] = TreeShape(depth, 1, depth, cc, fc, (1,) * depth)
    return tree


_CHAINS: dict[int, TreeShape] = {}


def quantize(q: np.ndarray) -> np.ndarray:
    """Drafter confidence: ``q`` rounded to 1/256 (at least 1/256, keeps rank order)."""
    return np.maximum(np.round(q * CONF_SCALE), 1).astype(np.int16)


class TreeCache:
    """LRU cache of trees keyed by (depth, width, max_nodes, quantized confidence)."""

    def __init__(self, maxsize: int = 8192) -> None:
        self.maxsize = maxsize
        self._trees: OrderedDict[tuple, TreeShape] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, qconf: np.ndarray, depth: int, width: int, max_nodes: int, key: bytes | None = None) -> TreeShape:
        """Tree for quantized confidences ``qconf`` [levels, ranks] (see :func:`quantize`).

        ``key`` may stand in for the confidences (e.g. ``qconf.tobytes()`` computed in bulk).
        """
        if depth <= 0:
            return EMPTY_TREE
        if width == 1 or max_nodes == 1:
            return chain_tree(min(depth, max_nodes, qconf.shape[0]))
        key = (depth, width, max_nodes, qconf[:depth, :width].tobytes() if key is None else key)
        tree = self._trees.get(key)
        if tree is not None:
            self.hits += 1
            self._trees.move_to_end(key)
            return tree
        self.misses += 1
        tree = build_tree(qconf.astype(np.float64) / CONF_SCALE, depth, width, max_nodes)
        self._trees[key] = tree
        if len(self._trees) > self.maxsize:
            self._trees.popitem(last=False)
        return tree


def sample_ranks(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Rank the target accepts at each level given uniforms ``u``: ``width + 1`` = none.

    ``q`` is [..., levels, ranks] and ``u`` [..., levels].
    """
    cum = np.cumsum(q, axis=-1)
    return (cum <= u[..., None]).sum(axis=-1) + 1


def sample_outcome(tree: TreeShape, q: np.ndarray, u: np.ndarray) -> TreeOutcome:
    """Walk one tree with uniforms ``u`` (one per level); see the module docstring."""
    ranks = sample_ranks(q[: tree.depth], u[: tree.depth])
    node, accepted = 0, 0
    acc_rank: list[int] = []
    offered: list[int] = []
    for level in range(tree.depth):
        c = int(tree.child_count[node])
        if c == 0:
            break
        r = int(ranks[level])
        offered.append(c)
        if r > c:
            acc_rank.append(0)
            break
        acc_rank.append(r)
        accepted += 1
        node = int(tree.first_child[node]) + r - 1
    return TreeOutcome(accepted, tuple(acc_rank), tuple(offered))


def sample_outcomes(
    trees: list[TreeShape], q: np.ndarray, u: np.ndarray
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """:func:`sample_outcome` over a batch (ranks drawn in one vectorised pass).

    Parameters
    ----------
    trees
        One tree per request (``EMPTY_TREE`` when it does not speculate).
    q
        [batch, levels, ranks] true rank probabilities.
    u
        [batch, levels] uniforms.

    Returns
    -------
    accepted : τ per request.
    ranks : per request, the accepted rank at each level reached (0 = none).
    offered : per request, the candidates offered at each level reached.
    """
    b = len(trees)
    if not any(t.nodes for t in trees):
        return [0] * b, [[] for _ in range(b)], [[] for _ in range(b)]
    drawn = sample_ranks(q, u).tolist()
    accepted: list[int] = []
    ranks: list[list[int]] = []
    offered: list[list[int]] = []
    # A per-request walk in plain Python: trees are a few levels deep, and
    # this beats array operations per level at every batch size we run.
    for tree, row in zip(trees, drawn):
        kids = tree.children
        node = tau = 0
        got: list[int] = []
        seen: list[int] = []
        for level in range(tree.depth):
            count, first = kids[node]
            if count == 0:
                break
            r = row[level]
            seen.append(count)
            if r > count:
                got.append(0)
                break
            got.append(r)
            tau += 1
            node = first + r - 1
        accepted.append(tau)
        ranks.append(got)
        offered.append(seen)
    return accepted, ranks, offered
