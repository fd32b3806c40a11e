"""The one best-first tree builder (``policies/tree.py``): its invariants, and
that the goodput policy, the simulator and the drafters all grow their trees
with it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies.allocation as allocation
import policies.goodput as goodput
import worker.reference.drafters.base as drafters_base
import worker.reference.drafters.ngram as ngram
import worker.sim.tree as sim_tree
from policies.table import Decision
from policies.tree import BestFirstTree, grow_best_first
from worker.reference.drafters.base import DraftContext

# ---------------------------------------------------------------- invariants


def _candidates(seed: int, ties: bool):
    """Per-node candidates (0-5 of them, scores in [0, 1], best first) that
    depend on the node's path: a node's children differ from its cousins'."""

    def candidates(level: int, path: tuple[int, ...]) -> list[tuple[float, tuple[int, ...]]]:
        rng = np.random.default_rng([seed, level, *path])
        scores = rng.uniform(0, 1, int(rng.integers(0, 6)))
        if ties:
            scores = np.round(scores * 4) / 4
        return [(float(s), path + (r,)) for r, s in enumerate(sorted(scores, reverse=True))]

    return candidates


def _check_invariants(tree: BestFirstTree, candidates, max_depth: int, max_width: int, max_nodes: int,
                      min_value: float) -> None:
    n = len(tree)
    assert n <= max_nodes
    assert len(tree.levels) == len(tree.ranks) == len(tree.values) == len(tree.payloads) == n
    children = Counter(tree.parents)
    assert max(children.values(), default=0) <= max_width
    taken = {p: i for i, p in enumerate(tree.payloads)}
    for i, (parent, level, rank, value, path) in enumerate(zip(tree.parents, tree.levels, tree.ranks, tree.values,
                                                                 tree.payloads)):
        assert 1 <= level <= max_depth and value > min_value
        assert parent < i  # topological
        assert level == (tree.levels[parent] + 1 if parent >= 0 else 1)
        assert value <= (tree.values[parent] if parent >= 0 else 1.0)  # a child never beats its parent
        assert path == (tree.payloads[parent] if parent >= 0 else ()) + (rank,)
    assert all(a >= b for a, b in zip(tree.values, tree.values[1:]))  # taken in value order
    # Best first: no candidate left out (a child of the root or of a taken node, within the
    # limits) beats a taken node; when the tree is not full, none worth more than min_value is left out.
    worst = min(tree.values, default=np.inf)
    for level, path, value in [(0, (), 1.0)] + list(zip(tree.levels, tree.payloads, tree.values)):
        if level >= max_depth:
            continue
        for score, child in candidates(level, path)[:max_width]:
            if child not in taken:
                assert value * score <= min_value or (n == max_nodes and value * score <= worst), (child, worst)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ties=st.booleans(), max_depth=st.integers(0, 7),
       max_width=st.integers(0, 5), max_nodes=st.integers(0, 40), siblings=st.sampled_from(["in_turn", "together"]),
       min_value=st.sampled_from([-np.inf, 0.0, 0.05]))
def test_builder_invariants(seed, ties, max_depth, max_width, max_nodes, siblings, min_value):
    candidates = _candidates(seed, ties)
    tree = grow_best_first(candidates, max_depth, max_width, max_nodes, root=(), siblings=siblings,
                           min_value=min_value)
    _check_invariants(tree, candidates, max(max_depth, 0), max_width, max(max_nodes, 0), min_value)
    if max_depth <= 0 or max_width <= 0 or max_nodes <= 0:
        assert len(tree) == 0


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_depth=st.integers(1, 7), max_width=st.integers(1, 5),
       max_nodes=st.integers(1, 40))
def test_sibling_rules_agree_without_ties(seed, max_depth, max_width, max_nodes):
    """``siblings`` only decides ties: with distinct values both rules give the same tree."""
    candidates = _candidates(seed, ties=False)
    in_turn = grow_best_first(candidates, max_depth, max_width, max_nodes, root=())
    together = grow_best_first(candidates, max_depth, max_width, max_nodes, root=(), siblings="together")
    assert in_turn == together


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ties=st.booleans(), max_depth=st.integers(1, 7), max_width=st.integers(1, 5),
       max_nodes=st.integers(1, 40), siblings=st.sampled_from(["in_turn", "together"]))
def test_given_values_equal_path_products(seed, ties, max_depth, max_width, max_nodes, siblings):
    """``products=False`` takes the scores as values: handed the path products, it grows the same tree."""
    candidates = _candidates(seed, ties)

    def value_of(path: tuple[int, ...]) -> float:
        value = 1.0
        for level in range(len(path)):
            value *= candidates(level, path[:level])[path[level]][0]
        return value

    def given_values(level: int, path: tuple[int, ...]) -> list[tuple[float, tuple[int, ...]]]:
        return [(value_of(path) * score, child) for score, child in candidates(level, path)]

    products = grow_best_first(candidates, max_depth, max_width, max_nodes, root=(), siblings=siblings)
    given_ = grow_best_first(given_values, max_depth, max_width, max_nodes, root=(), siblings=siblings,
                             products=False)
    assert given_ == products


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ties=st.booleans(), max_depth=st.integers(1, 7), max_width=st.integers(1, 5),
       max_nodes=st.integers(1, 30), min_value=st.sampled_from([0.0, 1e-3]))
def test_every_cap_is_the_union_of_each_caps_tree(seed, ties, max_depth, max_width, max_nodes, min_value):
    """Restricted to levels <= L, the shared expansion's first ``max_nodes`` nodes are the tree of cap L."""
    candidates = _candidates(seed, ties)
    shared = grow_best_first(candidates, max_depth, max_width, max_nodes, root=(), min_value=min_value,
                             every_cap=True)
    assert len(shared) <= max_depth * max_nodes
    needed: set[int] = set()
    for cap in range(1, max_depth + 1):
        alone = grow_best_first(candidates, cap, max_width, max_nodes, root=(), min_value=min_value)
        keep = [i for i, level in enumerate(shared.levels) if level <= cap][:max_nodes]
        assert [shared.payloads[i] for i in keep] == alone.payloads
        assert [shared.values[i] for i in keep] == alone.values
        needed.update(keep)
    assert needed == set(range(len(shared)))  # and nothing else: each node is in some cap's tree


def test_scores_as_values_and_the_root_payload():
    """``products=False``: the scores are the values (the n-gram trie's path shares)."""
    shares = {(): [(0.6, "a"), (0.4, "b")], "a": [(0.5, "aa"), (0.1, "ab")], "b": [(0.4, "ba")]}
    tree = grow_best_first(lambda level, key: shares.get(key, []), 3, 2, 4, root=(), products=False)
    assert tree.payloads == ["a", "aa", "b", "ba"] and tree.values == [0.6, 0.5, 0.4, 0.4]
    assert tree.parents == [-1, 0, -1, 2] and tree.ranks == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="siblings"):
        grow_best_first(lambda level, key: [], 1, 1, 1, siblings="eager")


def test_sibling_rules_differ_on_ties():
    """Three grandchildren worth 0.25. ``in_turn``: a's second child enters when
    its first is taken, after b's child, which goes first; ``together``: both of
    a's children entered when a was taken, before b's child."""
    rows = {(): [(0.5, "a"), (0.5, "b")], "a": [(0.5, "aa"), (0.5, "ab")], "b": [(0.5, "ba")]}

    def grow(siblings: str) -> list[str]:
        return grow_best_first(lambda level, key: rows.get(key, []), 2, 2, 5, root=(), siblings=siblings).payloads

    assert grow("in_turn") == ["a", "b", "aa", "ba", "ab"]
    assert grow("together") == ["a", "b", "aa", "ab", "ba"]


# ---------------------------------------------------------------- the callers use it


@pytest.fixture
def spy(monkeypatch):
    """Record every tree the builder returns, wherever it is called from."""
    grown: list[BestFirstTree] = []

    def recording(*args, **kwargs):
        tree = grow_best_first(*args, **kwargs)
        grown.append(tree)
        return tree

    for module in (allocation, sim_tree, drafters_base, ngram):  # allocation: the goodput policy's tree values
        monkeypatch.setattr(module, "grow_best_first", recording)
    return grown


def _per_level(rng, depth: int, width: int) -> np.ndarray:
    if rng.random() < 0.5:
        return -np.sort(-rng.integers(0, 5, (depth, width)) / 4.0, axis=1)  # ties and zeros
    return -np.sort(-rng.uniform(0, 1, (depth, width)), axis=1)


def _direct(q: np.ndarray, depth: int, width: int, nodes: int, **kwargs) -> BestFirstTree:
    rows = q.tolist()
    return grow_best_first(lambda level, _: [(p, r) for r, p in enumerate(rows[level])], min(depth, len(rows)),
                           width, nodes, **kwargs)


def test_goodput_values_trees_with_the_builder(spy):
    rng = np.random.default_rng(0)
    for _ in range(200):
        q = _per_level(rng, int(rng.integers(1, 8)), int(rng.integers(1, 6)))
        depth, width, nodes = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 30))
        spy.clear()
        got = goodput.best_first_nodes(q, depth, width, nodes)
        want = _direct(q, depth, width, nodes, min_value=0.0)
        assert len(spy) == 1 and spy[0].values == want.values and spy[0].parents == want.parents
        assert got.values.tolist() == want.values
        for m in range(len(want) + 1):  # each prefix's shape is the builder's
            assert got.depth[m] == max(want.levels[:m], default=0)
            assert got.width[m] == max(Counter(want.parents[:m]).values(), default=0)
        spy.clear()
        lists = goodput.capped_node_lists(q, depth, width, nodes)
        shared = _direct(q, depth, width, nodes, min_value=goodput.MIN_NODE_VALUE, every_cap=True,
                         max_total=goodput.MAX_EXPANSION)
        assert len(spy) == 1 and spy[0].values == shared.values
        for cap, nl in enumerate(lists[: min(depth, len(q))], start=1):
            keep = [i for i, level in enumerate(shared.levels) if level <= cap][:nodes]
            assert nl.values.tolist() == [shared.values[i] for i in keep]


def test_simulator_builds_its_shapes_with_the_builder(spy):
    rng = np.random.default_rng(1)
    for _ in range(200):
        q = _per_level(rng, int(rng.integers(1, 8)), int(rng.integers(1, 6)))
        depth, width, nodes = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 30))
        spy.clear()
        shape = sim_tree.build_tree(q, depth, width, nodes)
        want = _direct(q, depth, width, nodes)
        assert len(spy) == 1 and spy[0].values == want.values and spy[0].parents == want.parents
        assert shape.nodes == len(want) and shape.depth == max(want.levels)
        assert shape.level_sizes == tuple(Counter(want.levels)[k] for k in range(1, shape.depth + 1))
        assert shape.child_count[0] == Counter(want.parents)[-1]
        assert sorted(shape.child_count.tolist()) == sorted(Counter(want.parents)[i] for i in range(-1, len(want)))


def test_medusa_trees_come_from_the_builder(spy):
    rng = np.random.default_rng(2)
    for _ in range(200):
        levels = [[(int(rng.integers(0, 1000)), float(p)) for p in row]
                  for row in _per_level(rng, int(rng.integers(1, 7)), int(rng.integers(1, 6)))]
        depth = int(rng.integers(1, 8))
        d = Decision(depth, int(rng.integers(1, 6)), int(rng.integers(depth, 4 * depth + 1)))
        spy.clear()
        tree = drafters_base.best_first_tree(levels, d)
        want = _direct(np.array([[p for _, p in row] for row in levels]), d.depth, d.width, d.max_nodes)
        assert len(spy) == 1 and tree.parents == want.parents == spy[0].parents
        assert tree.tokens == [levels[lv - 1][r][0] for lv, r in zip(want.levels, want.ranks)]
        assert tree.confidences == [levels[lv - 1][r][1] for lv, r in zip(want.levels, want.ranks)]


def test_ngram_trees_come_from_the_builder(spy):
    rng = np.random.default_rng(3)
    drafter = ngram.NgramDrafter()
    seen = 0
    for case in range(50):
        tokens = rng.integers(0, 6, 120).tolist()
        d = Decision(int(rng.integers(1, 7)), int(rng.integers(2, 5)), 16)
        spy.clear()
        (tree,) = drafter.propose([DraftContext(f"r{case}", tokens)], [d])
        if not spy:
            assert tree.num_nodes == 0
            continue
        (grown,) = spy
        seen += tree.num_nodes > 0
        assert tree.parents == grown.parents and tree.tokens == [key[-1] for key in grown.payloads]
        assert len(grown) <= d.max_nodes and max(grown.levels, default=0) <= d.depth
        assert max(Counter(grown.parents).values(), default=0) <= d.width
    assert seen > 40
