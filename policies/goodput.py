"""The goodput policy: per-request depth, width and on/off that maximise
tokens emitted per second of step time.

Objective (SmartSpec): for a batch of requests ``i`` choose draft trees to
maximise

    G = Σ_i E[τ_i + 1] / (T_verify(batch_tokens, kv_tokens) + T_draft)

Tree value (EAGLE-2, OPT-Tree): a draft node's value is the probability that
the target accepts it, i.e. the product of the acceptance probabilities of
the ranks along its path, and ``E[τ]`` of a tree is the sum of its nodes'
values. Under a node budget, taking nodes best-first by value maximises
``E[τ]`` (a child never beats its parent, so best-first yields valid trees;
the expansion is :func:`policies.tree.grow_best_first`, shared with the
simulator and the drafters).

Batch allocation (TETRIS): rank every candidate node of every request in the
batch by value and keep the best prefix — the one with the highest ``G``
under the worker's fitted cost model. When the batch is memory-bound extra
nodes are almost free and the prefix runs long; when it is compute-bound each
node costs ``compute_ms_per_token`` and only high-value nodes survive, often
none: speculation off. Context length enters twice: acceptance is estimated
per context bucket, and KV tokens lift the memory plane at long context.

Drafters that may not offer what they are asked for (prompt lookup without a
match, or with one continuation where the tree has room for four) scale each
node's value by the learned probability that its slot is offered, along its
path: it counts only the drafts that really hold it. Its price does not
shrink with it: a request that gets a draft is charged every node asked for,
because a trie that has a second continuation usually has several and fills
the budget (priced by expected presence, the reference worker's n-gram trees
of 24 nodes ran at 1.14× plain against its d4 chain's 1.27×: the step cost
is convex in tokens and the siblings come together). On a worker whose
forward pads every request's block to the largest
(``Observation.padded_verify``) a batch costs ``batch · (1 + widest block)``
tokens: one request's deep tree is paid by every row, and a rare context
bucket takes only the nodes that fit in the padding already paid for.

Depth caps: a draft level is one drafter forward for the whole batch, so a
value-ordered prefix can buy one deep node with a whole level's draft time.
Every row is solved under each depth cap ``L`` (each request's best-first
list restricted to levels ``<= L``, all caps from one expansion) and the
best cap wins, as the benchmark's oracle does.

The table has one row per batch-size bucket, each solved on a
representative batch whose context mix is the worker's observed mix; the
row holding the current mean batch is solved at that batch itself. Context
buckets with too little traffic take the nodes that beat the batch's
marginal price. Exploration is
Thompson sampling on a deterministic slice of requests: their decisions come
from a posterior sample instead of the mean, so an option that looks bad —
speculation that was switched off — keeps being re-tested, and forgetting in
the acceptance model widens the posterior while it is not observed.

Cost caution: the fitted verify time is exact only where the worker has run.
Before a worker's first minute at batch 8 its price for 8 requests × 2
tokens is interpolated between batches it has run, and an interpolation a
few percent off turns a predicted +7 % into a measured −10 % (seen on the
reference worker). Whether to speculate is judged with every batch that
drafts priced ``cost_caution`` standard errors (``cost.verify_sd_ms``)
above its fitted time, which is nothing where the worker runs all day and
one RMSE where it has never run; which tree to draft is still chosen by the
expected goodput, so caution does not pin a worker to the shapes it has
already measured. Probes draw the shift from the normal distribution
instead, so untried batch sizes still get measured.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from policies.base import Observation, PlanDraft, Policy
from policies.table import Decision, DecisionTable, bucket_index
from policies.tree import grow_best_first


class GoodputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_depth: int = Field(0, ge=0, le=64, description="cap on depth; 0 = the drafter's max_depth")
    max_width: int = Field(0, ge=0, le=64, description="cap on width; 0 = the drafter's max_width")
    max_nodes: int = Field(0, ge=0, le=1024, description="cap on nodes per request; 0 = the drafter's max_tree_nodes")
    probe_fraction: float = Field(0.05, ge=0.0, le=1.0, description="share of requests decided from a posterior sample")
    min_share: float = Field(
        0.01, ge=0.0, le=1.0,
        description="context buckets below this share of traffic are decided by the batch's marginal node price",
    )
    min_gain: float = Field(0.01, ge=0.0, le=1.0, description="relative goodput gain speculation must bring over off")
    cost_caution: float = Field(
        1.0, ge=0.0, le=10.0,
        description="standard errors of the fitted verify time added to every batch that drafts (probes draw it)",
    )
    catch_up_horizon_steps: float = Field(
        16.0, gt=0.0, le=4096.0,
        description="steps over which switching a request on pays back its drafter's catch-up on the context "
                    "it was off for (a one-off cost, spread over this many steps)",
    )
    seed: int = Field(0, ge=0)


@dataclass(frozen=True)
class NodeList:
    """Best-first draft nodes of one request: ``values[j]`` is the j-th best
    node's acceptance probability; a prefix of ``m`` nodes forms a tree of
    depth ``depth[m]`` and width ``width[m]``."""

    values: np.ndarray  # [nodes]
    depth: np.ndarray  # [nodes + 1]
    width: np.ndarray  # [nodes + 1]

    def decision(self, m: int) -> Decision:
        return Decision(int(self.depth[m]), int(self.width[m]), m) if m > 0 else Decision.off()

    def expected_accepted(self, m: int) -> float:
        return float(self.values[:m].sum())


def best_first_nodes(rank_probs: np.ndarray, max_depth: int, max_width: int, max_nodes: int,
                     offer_probs: np.ndarray | None = None) -> NodeList:
    """Expand the draft tree best-first by path acceptance probability.

    ``rank_probs[k, r]``: probability that the rank-``r`` candidate at
    position ``k`` is accepted given the path so far was and the candidate
    is offered (conditional independence across positions, as in EAGLE-2's
    value estimate). ``offer_probs[k, r]``: probability that the drafter
    offers that candidate when asked (default: always). A node's value is
    the product of ``offer · rank`` probabilities along its path: a sibling a
    prompt-lookup drafter seldom has is worth little however well it would
    do when it is there.

    >>> nodes = best_first_nodes(np.array([[0.6, 0.3], [0.5, 0.2]]), 2, 2, 4)
    >>> [round(float(v), 2) for v in nodes.values], nodes.decision(2)
    ([0.6, 0.3, 0.3, 0.15], Decision(depth=1, width=2, max_nodes=2))
    >>> rare = best_first_nodes(np.array([[0.6, 0.3], [0.5, 0.2]]), 2, 2, 4, np.array([[1.0, 0.1], [1.0, 0.1]]))
    >>> [round(float(v), 3) for v in rare.values], rare.decision(2)
    ([0.6, 0.3, 0.03, 0.015], Decision(depth=2, width=1, max_nodes=2))
    """
    values, levels, parents = _expand(_offered(rank_probs, offer_probs), max_depth, max_width, max_nodes,
                                      single_cap=True)
    return _node_list(values, levels, parents)


def _offered(rank_probs: np.ndarray, offer_probs: np.ndarray | None) -> np.ndarray:  # [depth, width]
    """P(offered and accepted) per slot."""
    if offer_probs is None:
        return rank_probs
    depth, width = rank_probs.shape
    return rank_probs * offer_probs[:depth, :width]


def capped_node_lists(rank_probs: np.ndarray, max_depth: int, max_width: int, max_nodes: int,
                      offer_probs: np.ndarray | None = None) -> list[NodeList]:
    """``[best_first_nodes(rank_probs, cap, max_width, max_nodes, offer_probs) for cap in 1..max_depth]``
    from one expansion.

    Best-first expansion emits nodes in non-increasing value order, and a
    node within a depth cap has all its ancestors within it, so a capped
    list is the uncapped order restricted to levels ``<= cap``. The shared
    expansion stops opening a level once every cap that includes it holds
    ``max_nodes`` nodes, and skips nodes worth less than
    :data:`MIN_NODE_VALUE` (accepted too rarely to pay for their
    verification), so the lists are exact above that value.
    """
    depth = min(max_depth, rank_probs.shape[0])
    if depth <= 0 or max_nodes <= 0:
        return [_node_list([], [], [])] * max(max_depth, 1)
    values, levels, parents = _expand(_offered(rank_probs, offer_probs), depth, max_width, max_nodes,
                                      single_cap=False)
    levels_a = np.asarray(levels, dtype=np.int64)
    out: list[NodeList] = []
    for cap in range(1, depth + 1):
        keep = np.flatnonzero(levels_a <= cap)[:max_nodes]
        if out and int(levels_a[keep].max(initial=0)) < cap:
            out.append(out[-1])  # nothing at this level: the same list as the cap above
            continue
        renumber = {int(old): new for new, old in enumerate(keep)}
        out.append(_node_list([values[i] for i in keep], levels_a[keep], [renumber.get(parents[i], -1) for i in keep]))
    return out + [out[-1]] * (max_depth - depth)


MIN_NODE_VALUE = 1e-3  # a node accepted less often than this never pays for its verification
MAX_EXPANSION = 4096  # nodes one shared expansion may emit (a bound; the lists need far fewer)


def _expand(rank_probs: np.ndarray, max_depth: int, max_width: int, max_nodes: int,
            single_cap: bool) -> tuple[list[float], list[int], list[int]]:
    """(values, levels 1.., parent index or -1) of best-first nodes, in the order taken
    (:func:`policies.tree.grow_best_first` over per-level rank probabilities).

    ``single_cap``: the first ``max_nodes`` nodes within ``max_depth``; nodes
    worth nothing are never taken. Otherwise every cap ``1..max_depth`` needs
    its first ``max_nodes`` nodes worth more than :data:`MIN_NODE_VALUE`
    (``every_cap``), at most :data:`MAX_EXPANSION` in all.
    """
    rows = [[(p, None) for p in row] for row in rank_probs.tolist()]
    tree = grow_best_first(lambda level, _: rows[level], min(max_depth, len(rows)), max_width, max_nodes,
                           min_value=0.0 if single_cap else MIN_NODE_VALUE, every_cap=not single_cap,
                           max_total=MAX_EXPANSION)
    return tree.values, tree.levels, tree.parents


def _node_list(values, levels, parents) -> NodeList:
    """Prefix shapes of a best-first node sequence."""
    n = len(values)
    depth = np.zeros(n + 1, dtype=np.int64)
    width = np.zeros(n + 1, dtype=np.int64)
    children: dict[int, int] = {}
    d = w = 0
    for i in range(n):
        d = max(d, int(levels[i]))
        c = children[parents[i]] = children.get(parents[i], 0) + 1
        w = max(w, c)
        depth[i + 1], width[i + 1] = d, w
    return NodeList(np.asarray(values, dtype=np.float64), depth, width)


@dataclass(frozen=True)
class BatchGroup:
    """Requests of a representative batch that share a context bucket."""

    count: float  # requests (fractional: a share of the batch)
    context_len: float  # tokens each
    nodes: NodeList


@dataclass(frozen=True)
class Allocation:
    nodes_per_group: tuple[int, ...]
    goodput_tok_s: float
    goodput_off_tok_s: float


def expected_max_depth(depths: np.ndarray, shares: np.ndarray, batch: float) -> np.ndarray:
    """E[deepest draft in a batch] when ``batch`` requests are drawn from
    groups with these ``shares`` and per-group ``depths`` (``[..., groups]``).

    Drafting runs level by level for the whole batch, so a step pays draft
    levels up to its deepest request: one request pays its own depth, a large
    batch pays the deepest group's. ``E[max] = Σ_d 1 − P(all depths < d)``.

    >>> expected_max_depth(np.array([4, 0]), np.array([0.5, 0.5]), 1.0).item()
    2.0
    >>> round(expected_max_depth(np.array([4, 0]), np.array([0.5, 0.5]), 16.0).item(), 3)
    4.0
    """
    depths = np.asarray(depths)
    n = max(batch, 1.0)
    out = np.zeros(depths.shape[:-1])
    for d in range(1, int(depths.max(initial=0)) + 1):
        below = (depths < d) @ shares  # P(one request drafts fewer than d levels)
        out += 1.0 - below**n
    return out


def prefix_goodput(counts: np.ndarray, contexts: np.ndarray, gained: np.ndarray, depths: np.ndarray,
                   taken: np.ndarray, cost, offer: np.ndarray | None = None, padded: bool = False,
                   caution: float = 0.0, switch_ms: np.ndarray | None = None) -> np.ndarray:
    """Expected tokens per second of a batch of groups (``counts`` requests of
    ``contexts`` tokens each) that accept ``gained`` draft tokens in expectation
    and whose requests draft ``taken[..., g]`` nodes in ``depths[..., g]`` levels:
    ``Σ E[τ + 1] / (T_verify + T_draft)`` under ``cost``.

    ``offer[g]``: the share of group ``g``'s requests the drafter really drafts
    for (``gained`` already counts it); each of them pays every node it asked
    for. A step where no request gets a draft is a plain forward, so the
    verify time is the mixture ``P(none) · T(plain) + P(some) · T(the
    drafts given some)``: a step's cost is convex in its tokens (flat up to
    a tile, then rising), and pricing the mean tokens instead made a batch-1
    prompt-lookup worker that drafts on 40 % of its steps buy 10-node trees
    whose steps cost 1.3× a plain one. ``padded``: the worker's forward pads
    every request's block to the largest, so it computes ``batch · (1 + w)``
    tokens with ``w`` the largest block any request brings — about
    ``max_g taken_g · P(some request of g gets a draft)``. ``caution``: the
    verify time of every batch that drafts is raised by this many of the cost
    model's standard errors at its batch tokens (``cost.verify_sd_ms``);
    negative values are optimistic. ``switch_ms[g]``: ms added to every step
    in which group ``g`` drafts (its drafter's catch-up, spread over the
    steps it will draft for).
    """
    batch = float(counts.sum())
    offer = np.ones_like(counts) if offer is None else np.asarray(offer, dtype=np.float64)
    kv_per_group = counts * contexts
    drafted = taken @ (counts * offer)  # draft nodes the drafters produce
    levels = expected_max_depth(depths, counts / batch, batch)
    level_kv = depths @ kv_per_group
    kv = float(kv_per_group.sum())
    none = float(np.prod((1.0 - offer) ** counts))  # P(no request of the step gets a draft)
    some = max(1.0 - none, 1e-12)
    if padded:
        width = np.max(taken * (1.0 - (1.0 - offer) ** counts), axis=-1) / some  # [...]: the block every row carries
        tokens, pairs = batch * (1.0 + width), kv * (1.0 + width)
    else:
        tokens = batch + drafted / some
        pairs = kv + taken @ (kv_per_group * offer) / some  # Σ (1 + nodes) · context: attention's query-key pairs
    verify_ms = cost.verify_ms(tokens, kv, pairs)
    if none > 0.0:
        verify_ms = some * verify_ms + none * cost.verify_ms(batch, kv, kv)
    step_ms = verify_ms + cost.draft_ms(levels, drafted, batch, level_kv)
    if caution:
        # Only batches that draft pay it: off is what the worker falls back to, and
        # whether a tree pays is what the model may have wrong.
        step_ms = step_ms + caution * some * cost.verify_sd_ms(tokens) * (np.asarray(tokens) > batch + 1e-9)
    if switch_ms is not None:
        step_ms = step_ms + (taken > 0) @ np.asarray(switch_ms, dtype=np.float64)
    return (batch + gained) / np.maximum(step_ms, 1e-9) * 1000.0


def step_goodput(groups: Sequence[BatchGroup], taken: np.ndarray, cost, offer: np.ndarray | None = None,
                 padded: bool = False) -> np.ndarray:
    """:func:`prefix_goodput` when group ``g`` drafts the first ``taken[..., g]`` nodes
    of its list (``[..., groups]`` in, ``[...]`` out)."""
    counts = np.array([g.count for g in groups], dtype=np.float64)
    contexts = np.array([g.context_len for g in groups], dtype=np.float64)
    taken = np.asarray(taken, dtype=np.int64)
    gained = np.zeros(taken.shape[:-1])
    depths = np.zeros(taken.shape, dtype=np.int64)
    for i, g in enumerate(groups):
        cumulative = np.concatenate([[0.0], np.cumsum(g.nodes.values)])
        gained = gained + counts[i] * cumulative[taken[..., i]]
        depths[..., i] = g.nodes.depth[taken[..., i]]
    return prefix_goodput(counts, contexts, gained, depths, taken, cost, offer, padded)


def allocate(groups: Sequence[BatchGroup], cost, min_gain: float = 0.0) -> Allocation:
    """TETRIS-style allocation: best prefix of all nodes ranked by value.

    Every group's node list is non-increasing, so a prefix of the merged
    ranking takes a prefix of each group's list — a valid tree per request.
    Groups with no requests take no nodes.
    """
    prefixes = PrefixTable([[g.nodes for g in groups]])
    _, allocation = prefixes.best([g.count for g in groups], [g.context_len for g in groups], cost, min_gain)
    return allocation


class PrefixTable:
    """Every prefix of the merged best-first ranking of some groups' node lists,
    under each of several depth caps (``lists_by_cap[k][g]``: group ``g``'s list
    under the ``k``-th cap).

    The prefixes depend only on the lists; a batch (how many requests each
    group has, and their context) only prices them, so one table serves every
    batch size of a plan.
    """

    def __init__(self, lists_by_cap: Sequence[Sequence[NodeList]]) -> None:
        n_groups = len(lists_by_cap[0])
        takens, caps, gains, depths = [], [], [], []
        group_ix = np.arange(n_groups)[None, :]
        for k, lists in enumerate(lists_by_cap):
            values = np.concatenate([nodes.values for nodes in lists])
            group_of = np.concatenate([np.full(len(nodes.values), g) for g, nodes in enumerate(lists)]).astype(np.int64)
            order = np.lexsort((np.arange(len(values)), -values))  # by value, stable within a group
            # taken[p, g]: nodes group g holds in prefix p.  # [candidates + 1, groups]
            onehot = np.zeros((len(order) + 1, n_groups), dtype=np.int64)
            onehot[np.arange(1, len(order) + 1), group_of[order]] = 1
            taken = np.cumsum(onehot, axis=0)
            longest = max(len(nodes.values) for nodes in lists)
            cumulative = np.zeros((n_groups, longest + 1))
            depth_of = np.zeros((n_groups, longest + 1), dtype=np.int64)
            for g, nodes in enumerate(lists):
                m = len(nodes.values)
                cumulative[g, 1 : m + 1] = np.cumsum(nodes.values)
                depth_of[g, : m + 1] = nodes.depth
            takens.append(taken)
            caps.append(np.full(len(taken), k))
            gains.append(cumulative[group_ix, taken])
            depths.append(depth_of[group_ix, taken])
        self.taken = np.concatenate(takens)  # [prefixes, groups]
        self.cap_of = np.concatenate(caps)  # [prefixes]
        self.gained = np.concatenate(gains)  # [prefixes, groups]: expected accepted tokens per request
        self.depths = np.concatenate(depths)  # [prefixes, groups]

    def best(self, counts: Sequence[float], contexts: Sequence[float], cost, min_gain: float = 0.0,
             offer: Sequence[float] | None = None, padded: bool = False,
             caution: float = 0.0, switch_ms: Sequence[float] | None = None) -> tuple[int, Allocation]:
        """The best cap's index and its allocation for a batch of ``counts``
        requests per group; speculation must beat off by ``min_gain``
        (``offer``, ``padded``, ``caution``, ``switch_ms``: as in
        :func:`prefix_goodput`).
        The prefix with the best expected goodput wins if its cautious goodput
        beats off; else the best cautious one does, if any beats off; else off.
        The allocation reports the expected goodput."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.sum() <= 0:
            return 0, Allocation((0,) * len(counts), 0.0, 0.0)
        offer_rates = None if offer is None else np.asarray(offer, dtype=np.float64)
        contexts = np.asarray(contexts, dtype=np.float64)
        gained = self.gained @ counts

        def judged(rows=slice(None)) -> np.ndarray:  # cautious goodput of some prefixes
            return prefix_goodput(counts, contexts, gained[rows], self.depths[rows], self.taken[rows], cost,
                                  offer_rates, padded, caution, switch_ms)

        goodput = prefix_goodput(counts, contexts, gained, self.depths, self.taken, cost, offer_rates, padded,
                                 switch_ms=switch_ms)
        # The expected goodput picks the tree; caution only decides whether to
        # speculate at all (a well-measured smaller tree may still beat off).
        best = int(np.argmax(goodput))
        off = float(goodput[0])  # the first prefix of the first cap: no nodes at all
        bar = off * (1.0 + min_gain)
        if best and (judged([best])[0] if caution else goodput[best]) < bar:
            cautious = judged() if caution else goodput
            safest = int(np.argmax(cautious))
            best = safest if cautious[safest] >= bar else 0
        nodes = tuple(int(n) if c > 0 else 0 for n, c in zip(self.taken[best], counts))
        return int(self.cap_of[best]), Allocation(nodes, float(goodput[best]), off)


def representative_batch_size(edges: Sequence[int], bucket: int) -> float:
    """Geometric middle of a batch bucket (its lower edge for the last one)."""
    lo = edges[bucket]
    if bucket + 1 >= len(edges):
        return float(lo)
    return math.sqrt(lo * (edges[bucket + 1] - 1))


def representative_context(edges: Sequence[int], bucket: int) -> float:
    lo = edges[bucket]
    hi = edges[bucket + 1] if bucket + 1 < len(edges) else 2 * max(lo, 1)
    return (lo + hi) / 2.0


def observed_mix(obs: Observation) -> tuple[np.ndarray, np.ndarray]:
    """(share, mean context) per context bucket from the worker's load profile.

    A worker with no traffic yet is assumed to serve the first bucket;
    buckets never observed get their midpoint as mean context.
    """
    n = len(obs.context_edges)
    share = np.asarray(obs.load.context_share, dtype=float)
    if share.shape != (n,) or share.sum() <= 0:
        share = np.eye(n)[0]
    means = np.array([representative_context(obs.context_edges, c) for c in range(n)])
    observed = np.asarray(obs.load.context_mean, dtype=float)
    if observed.shape == (n,):
        means = np.where(observed > 0, observed, means)
    return share / share.sum(), means


def table_goodput(table: DecisionTable, obs: Observation, batch: float | None = None) -> float:
    """Estimated tokens per second of ``table`` at the worker's current load
    (a batch of ``batch`` requests, default the mean batch size, drawn from
    the observed context mix)."""
    batch = max(1.0, obs.load.mean_batch_size if batch is None else batch)
    share, means = observed_mix(obs)
    groups, offer = [], []
    for c in np.flatnonzero(share):
        d = table.lookup(max(1, round(batch)), obs.context_edges[c])
        nodes = best_first_nodes(obs.acceptance.rank_probs(c), d.depth, d.width, d.max_nodes if d.depth else 0,
                                 obs.acceptance.offer_probs(c))
        groups.append(BatchGroup(batch * share[c], means[c], nodes))
        offer.append(obs.acceptance.offer_rate(c))
    taken = np.array([len(g.nodes.values) for g in groups])
    return float(step_goodput(groups, taken, obs.cost, np.array(offer), obs.padded_verify))


class GoodputPolicy(Policy[GoodputConfig]):
    name = "goodput"
    model_based = True
    wants_request_outcomes = False

    def initial_state(self, seed: int = 0) -> tuple[int, int]:
        # (seed, calls): the generator of each call is derived from both, so
        # decide() stays pure and replays exactly.
        return (self.config.seed + seed, 0)

    def limits(self, obs: Observation) -> tuple[int, int, int]:
        cfg, d = self.config, obs.drafter
        depth = min(cfg.max_depth or d.max_depth, d.max_depth, obs.acceptance.max_depth)
        width = min(cfg.max_width or d.max_width, d.max_width, obs.acceptance.max_width)
        nodes = min(cfg.max_nodes or d.max_tree_nodes, d.max_tree_nodes)
        return depth, width, nodes

    def solve_row(self, obs: Observation, lists_by_cap: Sequence[Sequence[NodeList]], batch_bucket: int,
                  batch: float | None = None, prefixes: tuple[list[int], list[int], PrefixTable] | None = None,
                  caution: float | None = None,
                  switch_ms: Sequence[float] | None = None) -> tuple[int, list[int], float]:
        """Depth cap and nodes per request for every context bucket at one batch size
        (``batch``; default: the bucket's representative size).

        ``lists_by_cap[L - 1][c]``: bucket ``c``'s best-first nodes within depth
        ``L``. For every cap, buckets carrying traffic share one TETRIS
        allocation on a representative batch; the cap with the best goodput
        wins. A draft level is one forward for the whole batch, so whether to
        open it is decided per cap: a value-ordered prefix would otherwise buy
        one deep node with a whole level's draft time. The other buckets
        would join that batch as a few requests, so they take every node of
        the winning cap whose value beats the batch's marginal price: a node
        of value ``v`` costing ``δ`` ms raises the goodput ``G = tokens / T``
        iff ``v > G · δ``. ``prefixes``: :meth:`prefix_table` of these lists,
        when the caller solves many rows. ``caution``: standard errors of the
        cost model added to drafting batches (default ``cost_caution``: a
        batch size the worker has not run must win by the model's error).
        ``switch_ms[c]``: per-step ms a step pays when bucket ``c`` drafts
        (:meth:`catch_up_charge`; none by default). Returns (cap, nodes per bucket, expected goodput).
        """
        share, means = observed_mix(obs)
        if batch is None:
            batch = representative_batch_size(obs.batch_edges, batch_bucket)
        served, distinct, table = prefixes or self.prefix_table(obs, lists_by_cap)
        counts = [batch * share[c] for c in served]
        contexts = [means[c] for c in served]
        caution = self.config.cost_caution if caution is None else caution
        index, allocation = table.best(counts, contexts, obs.cost, self.config.min_gain,
                                       [obs.acceptance.offer_rate(c) for c in served], obs.padded_verify, caution,
                                       None if switch_ms is None else [switch_ms[c] for c in served])
        cap = distinct[index] + 1
        nodes = dict(zip(served, allocation.nodes_per_group))
        chosen = lists_by_cap[cap - 1]
        if obs.padded_verify:  # rare buckets fill the padding the batch already pays for, and no more
            width = max(nodes.values(), default=0)
            for c in range(len(chosen)):
                nodes.setdefault(c, min(width, len(chosen[c].values)))
            return cap, [nodes[c] for c in range(len(chosen))], allocation.goodput_tok_s
        batch_tokens = batch + sum(n * nodes[c] for n, c in zip(counts, served))
        kv = sum(n * ctx for n, ctx in zip(counts, contexts))
        pairs = kv + sum(n * nodes[c] * ctx for n, c, ctx in zip(counts, served, contexts))
        # Price a node by the cost of a tenth of the batch adding one each, not
        # by the slope at a point: the optimum often sits right at the roofline's kink.
        span = max(1.0, 0.1 * batch)
        mean_ctx = kv / max(batch, 1e-9)
        verify_step = float(obs.cost.verify_ms(batch_tokens + span, kv, pairs + span * mean_ctx)
                            - obs.cost.verify_ms(batch_tokens, kv, pairs)) / span
        node_ms = verify_step + float(obs.cost.draft_ms(0, 1, batch) - obs.cost.draft_ms(0, 0, batch))
        price = allocation.goodput_tok_s / 1000.0 * node_ms * (1.0 + self.config.min_gain)
        for c in range(len(chosen)):
            if c not in nodes:
                nodes[c] = int(np.count_nonzero(chosen[c].values > price))
        return cap, [nodes[c] for c in range(len(chosen))], allocation.goodput_tok_s

    def catch_up_charge(self, obs: Observation) -> list[float] | None:
        """Per context bucket, the ms a step pays when that bucket's active
        requests draft: the drafter's catch-up on what they owe
        (``obs.catch_up_owed``), spread over ``catch_up_horizon_steps``.

        Switching a request on after it was off costs one head forward over
        everything it missed (EAGLE: its whole context on the first draft),
        then nothing while it keeps drafting; charged per step, the cost sets
        a bar that turning on must clear and that staying on does not pay.
        None when nothing is owed or the worker never reported a catch-up."""
        owed = [0.0] * len(obs.context_edges)
        for rid, tokens in obs.catch_up_owed.items():
            ctx = obs.active_requests.get(rid)
            if tokens and ctx is not None:
                owed[bucket_index(obs.context_edges, ctx)] += tokens
        if not any(owed):
            return None
        per_step = np.asarray(obs.cost.catch_up_ms(np.asarray(owed))) / self.config.catch_up_horizon_steps
        return per_step.tolist() if per_step.any() else None

    def prefix_table(self, obs: Observation,
                     lists_by_cap: Sequence[Sequence[NodeList]]) -> tuple[list[int], list[int], PrefixTable]:
        """(served buckets, distinct caps (0-based), their :class:`PrefixTable`) for ``solve_row``."""
        share, _ = observed_mix(obs)
        served = [c for c in range(len(share)) if share[c] >= self.config.min_share]
        distinct = [k for k in range(len(lists_by_cap)) if k == 0 or lists_by_cap[k] is not lists_by_cap[k - 1]]
        return served, distinct, PrefixTable([[lists_by_cap[k][c] for c in served] for k in distinct])

    def node_lists(self, obs: Observation, rank_probs: Sequence[np.ndarray | None]) -> list[list[NodeList]]:
        """``[cap - 1][bucket]`` best-first node lists within the limits, one expansion per
        distinct ``q`` and offer probabilities (buckets never observed share the prior's);
        a cap whose lists equal the one above is that same list object. A ``None`` bucket
        gets no nodes."""
        depth, width, nodes = self.limits(obs)
        empty = capped_node_lists(np.zeros((0, 0)), depth, width, nodes)
        by_q: dict[bytes, list[NodeList]] = {}
        per_bucket = []
        for c, q in enumerate(rank_probs):
            if q is None:
                per_bucket.append(empty)
                continue
            offer = obs.acceptance.offer_probs(c)
            key = q.tobytes() + offer.tobytes()
            if key not in by_q:
                by_q[key] = capped_node_lists(q, depth, width, nodes, offer)
            per_bucket.append(by_q[key])
        out: list[list[NodeList]] = []
        for cap in range(depth):
            lists = [b[cap] for b in per_bucket]
            same = out and all(x is y for x, y in zip(lists, out[-1]))
            out.append(out[-1] if same else lists)
        return out

    def decide(self, state: tuple[int, int], obs: Observation) -> tuple[PlanDraft, tuple[int, int]]:
        seed, calls = state
        contexts = range(len(obs.context_edges))
        lists_by_cap = self.node_lists(obs, [obs.acceptance.rank_probs(c) for c in contexts])
        # The row holding today's mean batch is solved at that batch itself: it is
        # where the worker runs, and a bucket's representative size may sit on the
        # other side of the roofline's kink.
        current = bucket_index(obs.batch_edges, max(1, round(obs.load.mean_batch_size)))
        prefixes = self.prefix_table(obs, lists_by_cap)
        switch = self.catch_up_charge(obs)
        rows, goodputs = [], []
        for b in range(len(obs.batch_edges)):
            # Only the row the worker runs now pays its requests' catch-up.
            batch, row_switch = (max(1.0, obs.load.mean_batch_size), switch) if b == current else (None, None)
            cap, nodes_per_bucket, goodput = self.solve_row(obs, lists_by_cap, b, batch, prefixes,
                                                            switch_ms=row_switch)
            rows.append([lists_by_cap[cap - 1][c].decision(m) for c, m in enumerate(nodes_per_bucket)])
            goodputs.append(goodput)
        table = DecisionTable.from_rows(rows, obs.batch_edges, obs.context_edges)
        overrides, reasons = self.explore(obs, table, np.random.default_rng([seed, calls]), switch)
        plan = PlanDraft(table, overrides, goodputs[current], reasons)
        return plan, (seed, calls + 1)

    def explore(self, obs: Observation, table: DecisionTable, rng: np.random.Generator,
                switch_ms: Sequence[float] | None = None) -> tuple[dict[str, Decision], dict[str, str]]:
        """Thompson sampling on the probe slice of the active requests
        (``switch_ms``: the active requests' :meth:`catch_up_charge`)."""
        threshold = int(self.config.probe_fraction * 10_000)
        probes = [rid for rid in obs.active_requests if zlib.crc32(rid.encode()) % 10_000 < threshold]
        if not probes:
            return {}, {}
        batch = max(1, len(obs.active_requests))
        batch_bucket = bucket_index(obs.batch_edges, batch)
        share, _ = observed_mix(obs)
        # Only the buckets that shape the batch (served) and those of the probes matter here.
        wanted = {c for c in range(len(share)) if share[c] >= self.config.min_share}
        wanted |= {bucket_index(obs.context_edges, obs.active_requests[rid]) for rid in probes}
        sampled = [obs.acceptance.sample_rank_probs(c, rng) if c in wanted else None
                   for c in range(len(obs.context_edges))]
        lists_by_cap = self.node_lists(obs, sampled)
        # The cost model's error is sampled too: a probe may take a batch size the
        # mean decisions avoid because nobody has measured it yet.
        cost_draw = float(rng.standard_normal())
        cap, nodes_per_bucket, _ = self.solve_row(obs, lists_by_cap, batch_bucket, float(batch), caution=cost_draw,
                                                  switch_ms=switch_ms)
        overrides, reasons = {}, {}
        for rid in probes:
            c = bucket_index(obs.context_edges, obs.active_requests[rid])
            decision = lists_by_cap[cap - 1][c].decision(nodes_per_bucket[c])
            if decision != table.cell(batch_bucket, c):
                overrides[rid] = decision
                reasons[rid] = "explore"
        return overrides, reasons


def _register() -> None:
    from policies.presets import register_policy

    register_policy("goodput", GoodputConfig, GoodputPolicy)


_register()
