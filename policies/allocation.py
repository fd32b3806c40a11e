"""Tree values, batch allocation and step pricing: the goodput policy's building blocks.

Best-first node lists (EAGLE-2 tree values, :func:`best_first_nodes`,
:func:`decision_nodes`, :func:`capped_node_lists`), the TETRIS ranking of several groups' nodes
(:class:`PrefixTable`, :func:`allocate`), the price of a batch of groups
(:func:`prefix_step_ms`, :func:`prefix_goodput`, :func:`step_goodput`) and of
a decision table at the observed load (:func:`table_goodput`). Split out of
:mod:`policies.goodput` (which re-exports every name) so that solvers built
on them, like :mod:`policies.state_tables`, can be called by the policy
without an import cycle. The model behind them is in that module's docstring.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from policies.base import AcceptanceEstimate, Observation
from policies.table import Decision, DecisionTable
from policies.tree import grow_best_first


@dataclass(frozen=True)
class NodeList:
    """Best-first draft nodes of one request: ``values[j]`` is the j-th best
    node's acceptance probability; a prefix of ``m`` nodes forms a tree of
    depth ``depth[m]`` and width ``width[m]``; ``levels[j]`` is the j-th
    node's own level (1: a child of the root)."""

    values: np.ndarray  # [nodes]
    depth: np.ndarray  # [nodes + 1]
    width: np.ndarray  # [nodes + 1]
    levels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [nodes]

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


def decision_nodes(acceptance: AcceptanceEstimate, context_bucket: int, decision: Decision) -> NodeList:
    """The nodes ``decision`` drafts for a request in ``context_bucket``, best first, each
    valued with ``acceptance`` there (its offer probabilities included): what pricing a
    table's cell needs. An off decision drafts none.

    >>> from types import SimpleNamespace as NS
    >>> est = NS(rank_probs=lambda c: np.array([[0.6, 0.3], [0.5, 0.2]]), offer_probs=lambda c: np.ones((2, 2)))
    >>> [round(float(v), 2) for v in decision_nodes(est, 0, Decision(2, 2, 3)).values]
    [0.6, 0.3, 0.3]
    >>> len(decision_nodes(est, 0, Decision.off()).values)
    0
    """
    return best_first_nodes(acceptance.rank_probs(context_bucket), decision.depth, decision.width,
                            decision.max_nodes, acceptance.offer_probs(context_bucket))


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
    return NodeList(np.asarray(values, dtype=np.float64), depth, width, np.asarray(levels, dtype=np.int64))


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
    step_ms = prefix_step_ms(counts, contexts, depths, taken, cost, offer, padded, caution, switch_ms)
    return (float(counts.sum()) + gained) / np.maximum(step_ms, 1e-9) * 1000.0


def prefix_step_ms(counts: np.ndarray, contexts: np.ndarray, depths: np.ndarray, taken: np.ndarray, cost,
                   offer: np.ndarray | None = None, padded: bool = False, caution: float = 0.0,
                   switch_ms: np.ndarray | None = None) -> np.ndarray:
    """The step time (ms) :func:`prefix_goodput` divides by: one forward and the
    draft levels of the whole batch, whatever each group gains from it (the
    request classes' objective weighs the tokens, never the time)."""
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
        step_ms = step_ms + caution * some * whole_batch_sd_ms(cost, tokens, batch) * (np.asarray(tokens) > batch + 1e-9)
    if switch_ms is not None:
        step_ms = step_ms + (taken > 0) @ np.asarray(switch_ms, dtype=np.float64)
    return step_ms


def whole_batch_sd_ms(cost, tokens, batch: float):
    """The cost model's standard error (``cost.verify_sd_ms``) of a forward of
    ``tokens`` batch tokens for ``batch`` requests, when ``batch`` may be a
    fractional mean: a worker runs whole requests, so a mean of 7.6 is steps
    of 7 and of 8, and the price is as sure as theirs (weighted 0.4 / 0.6),
    their tokens ``tokens · 7 / 7.6`` and ``tokens · 8 / 7.6`` (per-request
    blocks do not depend on the batch). Read at 15.2 tokens, a shape no step
    has, a price interpolated between two well-measured ones (14 and 16) was
    as unsure as one never measured: the reference worker's controller at a
    mean of 7.2-7.99 requests (a batch of 8 filling up) charged a depth-1
    chain a whole RMSE (12.7 ms, 9 % of the step) and kept it off.

    >>> class Cost:  # any cost model with verify_sd_ms: sure at 14 and 16 tokens, unsure between
    ...     def verify_sd_ms(self, tokens):
    ...         return np.where(np.isin(np.round(tokens, 6), (14.0, 16.0)), 1.0, 10.0)
    >>> cost = Cost()
    >>> [round(float(x), 2) for x in (cost.verify_sd_ms(15.2), whole_batch_sd_ms(cost, 15.2, 7.6),
    ...                                 whole_batch_sd_ms(cost, 16.0, 8.0))]
    [10.0, 1.0, 1.0]
    """
    tokens = np.asarray(tokens, dtype=np.float64)
    lower = max(math.floor(batch), 1)
    upper = max(math.ceil(batch), 1)
    if lower == upper:
        return cost.verify_sd_ms(tokens)
    f = (batch - lower) / (upper - lower)
    return ((1.0 - f) * np.asarray(cost.verify_sd_ms(tokens * lower / batch))
            + f * np.asarray(cost.verify_sd_ms(tokens * upper / batch)))


class UnmeasuredDoubt:
    """``cost`` with its doubt kept only at batch tokens the worker has run
    fewer than ``min_steps`` live steps at (``cost.verify_live_steps``): the
    prices a price probe may take optimistically. Where live steps have run
    the price is what they measured, and a probe there would only repeat
    them; a shape known from the start-up calibration or interpolation alone
    may be off by the calibration's error, which only running it reveals.
    A cost model that does not count live steps has none unmeasured.

    >>> class Fit:  # sure at 4 tokens (400 live steps), unsure at 8 (none)
    ...     def verify_sd_ms(self, tokens):
    ...         return np.where(np.asarray(tokens) > 4, 4.0, 0.2)
    ...     def verify_live_steps(self, tokens):
    ...         return np.where(np.asarray(tokens) > 4, 0.0, 400.0)
    >>> doubt = UnmeasuredDoubt(Fit(), min_steps=16)
    >>> [float(x) for x in doubt.verify_sd_ms(np.array([4.0, 8.0]))], bool(doubt.any_unmeasured([4.0, 8.0]))
    ([0.0, 4.0], True)
    """

    def __init__(self, cost, min_steps: float) -> None:
        self.cost = cost
        self.min_steps = min_steps

    def __getattr__(self, name: str):  # verify_ms, draft_ms, catch_up_ms: the model's own
        return getattr(self.cost, name)

    def unmeasured(self, tokens) -> np.ndarray:
        live_steps = getattr(self.cost, "verify_live_steps", None)
        if live_steps is None:
            return np.zeros(np.shape(tokens), dtype=bool)
        return np.asarray(live_steps(np.asarray(tokens, dtype=np.float64))) < self.min_steps

    def any_unmeasured(self, tokens) -> bool:
        return bool(np.any(self.unmeasured(tokens)))

    def verify_sd_ms(self, tokens):
        tokens = np.asarray(tokens, dtype=np.float64)
        return np.where(self.unmeasured(tokens), self.cost.verify_sd_ms(tokens), 0.0)


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

    ``weights[g]``: what one of group ``g``'s tokens is worth (request
    classes); the ranking is by ``weight · value``. Each list is still taken
    as a prefix (a positive weight keeps its order), so every prefix is a
    valid tree per request. Default: every token alike. ``whole_ties``:
    no prefix ends inside a run of equal (weighted) values, so groups that
    are alike (two classes of one weight valued with one acceptance) get
    alike trees instead of one node more for whichever is listed first.

    >>> a, b = best_first_nodes(np.array([[0.5]]), 1, 1, 1), best_first_nodes(np.array([[0.8]]), 1, 1, 1)
    >>> PrefixTable([[a, b]]).taken.tolist(), PrefixTable([[a, b]], weights=[4.0, 1.0]).taken.tolist()
    ([[0, 0], [0, 1], [1, 1]], [[0, 0], [1, 0], [1, 1]])
    >>> PrefixTable([[a, a]]).taken.tolist(), PrefixTable([[a, a]], whole_ties=True).taken.tolist()
    ([[0, 0], [1, 0], [1, 1]], [[0, 0], [1, 1]])
    """

    def __init__(self, lists_by_cap: Sequence[Sequence[NodeList]], weights: Sequence[float] | None = None,
                 whole_ties: bool = False) -> None:
        n_groups = len(lists_by_cap[0])
        takens, caps, gains, depths = [], [], [], []
        group_ix = np.arange(n_groups)[None, :]
        for k, lists in enumerate(lists_by_cap):
            values = np.concatenate([nodes.values for nodes in lists])
            group_of = np.concatenate([np.full(len(nodes.values), g) for g, nodes in enumerate(lists)]).astype(np.int64)
            if weights is not None:
                values = values * np.asarray(weights, dtype=np.float64)[group_of]
            order = np.lexsort((np.arange(len(values)), -values))  # by value, stable within a group
            # taken[p, g]: nodes group g holds in prefix p.  # [candidates + 1, groups]
            onehot = np.zeros((len(order) + 1, n_groups), dtype=np.int64)
            onehot[np.arange(1, len(order) + 1), group_of[order]] = 1
            taken = np.cumsum(onehot, axis=0)
            if whole_ties and len(order):
                ranked = values[order]
                taken = taken[np.r_[True, ranked[1:] != ranked[:-1], True]]  # prefix 0, tie ends, all
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
        A negative ``caution`` (a probe's draw of the prices below the mean, or
        an optimistic bound) prices every prefix at it, so a cheaper draw can
        turn drafting on where the mean keeps it off (taken as a caution, it
        could only ever turn it off).
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
        off = float(goodput[0])  # the first prefix of the first cap: no nodes at all
        bar = off * (1.0 + min_gain)
        if caution < 0:
            drawn = judged()
            best = int(np.argmax(drawn))
            best = best if drawn[best] >= bar else 0
        else:
            # The expected goodput picks the tree; caution only decides whether to
            # speculate at all (a well-measured smaller tree may still beat off).
            best = int(np.argmax(goodput))
            if best and (judged([best])[0] if caution else goodput[best]) < bar:
                cautious = judged() if caution else goodput
                safest = int(np.argmax(cautious))
                best = safest if cautious[safest] >= bar else 0
        nodes = tuple(int(n) if c > 0 else 0 for n, c in zip(self.taken[best], counts))
        return int(self.cap_of[best]), Allocation(nodes, float(goodput[best]), off)


def marginal_node_ms(cost, batch: float, counts: Sequence[float], contexts: Sequence[float],
                     taken: Sequence[int]) -> float:
    """What one more draft node costs a batch of groups (``counts`` requests of
    ``contexts`` tokens drafting ``taken`` nodes each), in ms of step time.

    Priced by a tenth of the batch adding one node each, not by the slope at
    a point: the optimum often sits right at the roofline's kink."""
    batch_tokens = batch + sum(n * m for n, m in zip(counts, taken))
    kv = sum(n * ctx for n, ctx in zip(counts, contexts))
    pairs = kv + sum(n * m * ctx for n, m, ctx in zip(counts, taken, contexts))
    span = max(1.0, 0.1 * batch)
    mean_ctx = kv / max(batch, 1e-9)
    verify_step = float(cost.verify_ms(batch_tokens + span, kv, pairs + span * mean_ctx)
                        - cost.verify_ms(batch_tokens, kv, pairs)) / span
    return verify_step + float(cost.draft_ms(0, 1, batch) - cost.draft_ms(0, 0, batch))


def probe_requests(active: Sequence[str], padded: bool, probe_fraction: float,
                   rng: np.random.Generator) -> list[str]:
    """Which of the ``active`` request ids a policy run decides from a
    posterior sample (its Thompson-sampling probes).

    On a packed worker, a fixed slice of request ids (``probe_fraction`` of
    them by CRC-32): a probe's nodes cost the step its own tokens only. On a
    ``PADDED`` worker every row carries the widest block, so one request
    drafting where the others do not costs the whole batch its block: on the
    reference worker one probe of eight at batch 8 drafting a depth-1 chain
    while the plan said off made 20 steps cost 1.2x a plain one for one
    row's tokens, and the controller lost 13 % to the best static chain.
    There the probe is the batch (``padded``): on ``probe_fraction`` of the
    runs (a draw of ``rng``) every active request is decided from the
    sample, and on the rest none, so a probe prices and tests the shape the
    table chooses between, at the same share of request-steps. A packed
    worker's slice draws nothing from ``rng``.

    >>> ids = [f"req-{i}" for i in range(400)]
    >>> len(probe_requests(ids, False, 0.05, np.random.default_rng(0))), probe_requests(ids, False, 0.0, None)
    (19, [])
    >>> [len(probe_requests(ids[:8], True, 0.5, np.random.default_rng(s))) for s in range(4)]
    [0, 0, 8, 8]
    """
    if padded:
        return list(active) if active and rng.random() < probe_fraction else []
    threshold = int(probe_fraction * 10_000)
    return [rid for rid in active if zlib.crc32(rid.encode()) % 10_000 < threshold]


def representative_batch_size(edges: Sequence[int], bucket: int, max_batch: float | None = None) -> float:
    """Geometric middle of a batch bucket (its lower edge for the last one),
    at most ``max_batch`` (the worker's ``max_batch_size``).

    The cap matters for the bucket holding the worker's largest batch: a
    worker of at most 8 requests runs bucket [8, 12) at 8 only, and its row
    solved at 9.4 was priced where the worker never runs and the fitted curve
    has no data. On the reference worker that made the batch-8 row of EAGLE
    off while drafting a depth-1 chain measured 1.8 % faster than off: plain
    forwards of 9.4 tokens extrapolated flat from 8 tokens, drafting ones of
    18.8 interpolated between measured 16 and 24.

    >>> edges = (1, 2, 3, 4, 6, 8, 12, 16)
    >>> round(representative_batch_size(edges, 5), 2), representative_batch_size(edges, 5, max_batch=8)
    (9.38, 8.0)
    >>> representative_batch_size(edges, 7), representative_batch_size(edges, 6, max_batch=8)  # past it: the max
    (16.0, 8.0)
    """
    lo = edges[bucket]
    middle = float(lo) if bucket + 1 >= len(edges) else math.sqrt(lo * (edges[bucket + 1] - 1))
    return middle if max_batch is None else min(middle, float(max(max_batch, 1)))


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
        groups.append(BatchGroup(batch * share[c], means[c], decision_nodes(obs.acceptance, c, d)))
        offer.append(obs.acceptance.offer_rate(c))
    taken = np.array([len(g.nodes.values) for g in groups])
    return float(step_goodput(groups, taken, obs.cost, np.array(offer), obs.padded_verify))
