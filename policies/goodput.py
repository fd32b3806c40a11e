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
instead, so untried batch sizes still get measured. Price probes
(:meth:`GoodputPolicy.price_probe`) go further: while a shape that could
win at an optimistic price has not been run live, a share of the decisions
runs it, so a calibration that prices it wrong is corrected by steps.

Request classes (``obs.classes``, issue #29): with several, every row is
solved on one batch holding each class's share of the requests, in groups
(class, context bucket) that share one step time, and the objective is the
weighted goodput ``Σ_c weight_c · tokens_c / step_ms``: in the ranking a
node of class ``c`` is worth ``weight_c · value``. A class with a TPOT
target keeps ``step_ms / (1 + E[τ_c]) · κ_c`` under the target less its
margin (``tpot_margin``; ``E[τ_c]``: what the requests the target bounds
accept, for a p99 the slowest bucket's tail at each node's worth to it,
:func:`tail_scale`, :func:`target_tokens`; ``κ_c``: its observed quantile
over that model at the step time just reported): its weight is raised, a
Lagrange multiplier found on a small grid, until the weighted optimum
meets the target, so its nodes rank ahead of the best-effort classes' and
theirs drop out first as verification gets dearer. A ``typical`` class is valued
with the relaxed rule's acceptance once observed. The plan carries one
table per class (``PlanDraft.class_tables``, the default class's as
``table``). With one class nothing of this runs: the plan is the one above.

Request states (issue #28, :mod:`policies.state_tables`): with one class,
where the controller's acceptance after a miss or after a full accept
differs from the pooled one, each such state gets a table of its own, the
best response to the plan's table (``PlanDraft.state_tables``); the table
itself is the one above. ``request_states: false`` turns it off.

The building blocks (tree values, the TETRIS ranking, step pricing) are in
:mod:`policies.allocation`, re-exported here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

# The building blocks (tree values, TETRIS allocation, step pricing) live in policies.allocation;
# every name is re-exported here, where callers have always found them.
from policies.allocation import (  # noqa: F401
    MAX_EXPANSION,
    MIN_NODE_VALUE,
    Allocation,
    BatchGroup,
    NodeList,
    PrefixTable,
    UnmeasuredDoubt,
    allocate,
    best_first_nodes,
    capped_node_lists,
    decision_nodes,
    expected_max_depth,
    marginal_node_ms,
    observed_mix,
    prefix_goodput,
    prefix_step_ms,
    probe_requests,
    representative_batch_size,
    representative_context,
    step_goodput,
    table_goodput,
)
from policies.base import AcceptanceEstimate, ClassLoad, Observation, PlanDraft, Policy
from policies.classes import RequestClass
from policies.state_tables import plan_state_tables
from policies.table import Decision, DecisionTable, bucket_index


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
    price_probe_fraction: float = Field(
        0.25, ge=0.0, le=1.0,
        description="share of decisions that run the batch's optimistic decision while it drafts a shape the "
                    "worker has not measured live (a price probe; 0 turns them off)",
    )
    price_optimism: float = Field(
        2.0, ge=0.0, le=10.0,
        description="standard errors of the fitted verify time a price probe takes off the price of a shape "
                    "with fewer than price_probe_steps live steps",
    )
    price_probe_steps: float = Field(
        16.0, ge=0.0, le=10_000.0,
        description="live steps in a batch-token segment past which its price counts as measured (no more "
                    "price probes there)",
    )
    catch_up_horizon_steps: float = Field(
        16.0, gt=0.0, le=4096.0,
        description="steps over which switching a request on pays back its drafter's catch-up on the context "
                    "it was off for (a one-off cost, spread over this many steps)",
    )
    request_states: bool = Field(
        True,
        description="plan a table per request state (the request's last outcome: after a miss, after a full "
                    "accept) where the controller's per-state acceptance differs from the default state's "
                    "(policies.state_tables); single-class policies only",
    )
    seed: int = Field(0, ge=0)


# --- Request classes (issue #29) ---------------------------------------------
#
# With several classes a row is solved on one representative batch holding
# every class's requests: groups are (class, context bucket), the step time is
# the whole batch's (one forward, one draft level per level), and the objective
# is the weighted goodput Σ_c weight_c · tokens_c / step_ms. A class with a TPOT
# target must keep step_ms / (1 + E[τ_c]) · κ_c under its aim (the target less its
# margin, RequestClass.tpot_aim_ms); its weight is raised
# by a multiplier (a Lagrange multiplier of that constraint: raising it is
# exactly what Σ λ_c (tokens_c / (n_c · step)) adds to the objective) until the
# weighted optimum meets the target.

# Factors (1 + m) on a targeted class's weight, tried in order until the
# weighted optimum meets its target. At the last one every node of the class
# (values above MIN_NODE_VALUE) ranks before any node of a class of equal weight.
TARGET_MULTIPLIERS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 32.0, 1024.0)
# Worst TPOT / target ratios within this of the smallest count as equal when no
# allocation meets every target: among them the best weighted goodput wins (a
# best-effort class is not turned off to shave a tenth of a percent off a miss).
RATIO_TOLERANCE = 0.01
UNSEEN_CLASS_SHARE = 0.05  # share of a batch a class without traffic yet is solved with
TIE_BREAK = 1e-9  # relative edge of a targeted class's nodes over equal ones in the ranking
MAX_TPOT_SPREAD = 3.0  # bound on κ: one slow observation window must not demand the impossible
MIN_TAIL_GAIN = 0.05  # a class drafting less than this per step tells nothing about its tail


def class_acceptance(obs: Observation, rc: RequestClass) -> AcceptanceEstimate:
    """The acceptance a class's nodes are valued with: the relaxed rule's for a
    ``typical`` class once it has been observed, else the strict rule's (a
    lower bound: typical acceptance accepts whatever strict sampling would)."""
    if rc.relaxed and obs.acceptance_typical is not None:
        return obs.acceptance_typical
    return obs.acceptance


def recent_step_ms(obs: Observation) -> float:
    """Mean time of the steps since the last decision (draft, verify and catch-up: what every
    request of a step waits for); 0 when none was reported."""
    if not obs.steps:
        return 0.0
    return float(np.mean([s.draft_ms + s.verify_ms + s.catch_up_ms for s in obs.steps]))


def tpot_spread(rc: RequestClass, load: ClassLoad | None, step_ms: float = 0.0) -> float:
    """κ ≥ 1: the class's observed TPOT at its target's quantile over the TPOT the policy's model
    gives those requests at the step time they run at now, in [1, 3].

    The model is the step time over the tokens per step of the requests the target bounds: the
    tail's (``tail_tokens_per_step``) for a p99 target, the window's mean for a p50 one. The step
    time is ``step_ms``, the mean of the steps just reported (:func:`recent_step_ms`), else the
    class's decayed ``step_ms_mean``. κ holds what the model leaves out (steps that differ
    within a request's life, a catch-up); against the decayed mean, which lags a rising load by
    its half-life, it read 1.15-1.38 from the middle of priority-classes' ramp to its end, where
    the requests' p99 was within 5 % of the model at the current step, and the policy took a
    reachable target for one it could not reach. 1 until the class has been measured.

    >>> rc = RequestClass("interactive", tpot_target_ms=30.0, tpot_quantile="p99")
    >>> tpot_spread(rc, ClassLoad(share=0.2, tpot_ms_p50=9.0, tpot_ms_p99=15.0, tokens_per_step=2.0, step_ms_mean=20.0))
    1.5
    >>> tpot_spread(rc, ClassLoad(tpot_ms_p99=15.0, tokens_per_step=2.0, step_ms_mean=20.0), step_ms=25.0)
    1.2
    >>> tpot_spread(rc, None), tpot_spread(rc, ClassLoad(tpot_ms_p99=400.0, tokens_per_step=2.0, step_ms_mean=20.0))
    (1.0, 3.0)
    """
    if load is None or load.tokens_per_step <= 0:
        return 1.0
    step = step_ms if step_ms > 0 else load.step_ms_mean
    observed = load.tpot_ms_p99 if rc.tpot_quantile == "p99" else load.tpot_ms_p50
    if observed <= 0 or step <= 0:
        return 1.0
    if rc.tpot_quantile == "p99" and load.tail_tokens_per_step > 0:
        tokens = load.tail_tokens_per_step  # a p99 target's requests emit the tail's tokens (tail_scale)
    else:
        tokens = load.window_tokens_per_step if load.window_tokens_per_step > 0 else load.tokens_per_step
    return float(min(MAX_TPOT_SPREAD, max(1.0, observed * tokens / step)))


def tail_scale(rc: RequestClass, load: ClassLoad | None, nodes: NodeList) -> float:
    """For a p99 target: ``m`` in [0, 1], the per-position acceptance of the class's slowest
    requests over the class's mean; 1 for a p50 target, a class without drafts or until measured.

    A p99 target bounds the requests the drafter follows worst: they accept every position
    less often than the mean request, and a node ``ℓ`` levels deep needs ``ℓ`` of their
    acceptances in a row, so it is worth ``m^ℓ`` of its value to them. ``m`` is fitted so
    that the nodes the class's mean accepted (the first of ``nodes``, the class's best-first
    list, whose values add up to ``window_tokens_per_step - 1``: the same requests as the
    tail's, under the same plans; the decayed ``tokens_per_step`` until there is a window)
    are worth to the tail what it accepted, ``tail_tokens_per_step - 1``. A deeper node then pays the tail less than a
    shallow one: priced by the mean, or by one ratio for every node, a third chain node
    looked to shorten the tail's TPOT (priority-classes: 2.4-2.8-node drafts that made every
    step 15 % longer, where 2 nodes held the p99 at its target).

    >>> rc = RequestClass("interactive", tpot_target_ms=8.0)
    >>> chain = best_first_nodes(np.array([[0.8], [0.8], [0.8]]), 3, 1, 3)  # values 0.8, 0.64, 0.512
    >>> m = tail_scale(rc, ClassLoad(tokens_per_step=2.44, tail_tokens_per_step=2.0), chain)
    >>> round(m, 3), round(0.8 * m + 0.64 * m ** 2, 3)  # its two nodes give the tail its 1.0 token
    (0.773, 1.0)
    >>> tail_scale(rc, ClassLoad(tokens_per_step=1.0, tail_tokens_per_step=1.0), chain), tail_scale(rc, None, chain)
    (1.0, 1.0)
    """
    if rc.tpot_quantile != "p99" or load is None or load.tail_tokens_per_step <= 0 \
            or max(load.tokens_per_step, load.window_tokens_per_step) <= 1.0 + MIN_TAIL_GAIN \
            or not len(nodes.values):
        return 1.0
    # The window's mean where measured: the tail's requests are among its, under the same plans.
    mean = load.window_tokens_per_step if load.window_tokens_per_step > 0 else load.tokens_per_step
    mean_gain, tail_gain = mean - 1.0, load.tail_tokens_per_step - 1.0
    if tail_gain >= mean_gain:
        return 1.0
    if tail_gain <= 0.0:
        return 0.0
    values, levels = nodes.values, nodes.levels
    before = np.concatenate(([0.0], np.cumsum(values)[:-1]))
    used = np.clip(mean_gain - before, 0.0, values)  # what of each node the mean accepted
    if used.sum() < mean_gain:  # the estimate sits below what the class accepts: read the ratio on all of it
        used = values
    share = tail_gain / mean_gain
    lo, hi = 0.0, 1.0
    for _ in range(40):  # Σ used · m^ℓ / Σ used rises from 0 to 1 with m
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if float(used @ mid ** levels) < share * float(used.sum()) else (lo, mid)
    return 0.5 * (lo + hi)


def tail_values(nodes: NodeList, scale: float) -> np.ndarray:
    """``[nodes + 1]``: what the first ``m`` of ``nodes`` are worth to requests that accept each
    position ``scale`` times as often (:func:`tail_scale`), ``Σ_{j<m} scale^ℓ_j · values[j]``.

    >>> chain = best_first_nodes(np.array([[0.8], [0.8]]), 2, 1, 2)
    >>> [round(float(x), 3) for x in tail_values(chain, 0.5)]
    [0.0, 0.4, 0.56]
    """
    weighted = nodes.values * scale ** nodes.levels if scale != 1.0 else nodes.values
    return np.concatenate(([0.0], np.cumsum(weighted)))


P99_GROUP_SHARE = 0.01  # a context bucket with less of a class's requests cannot hold its p99 by itself


def target_tokens(rc: RequestClass, counts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Tokens per step of the requests a class's target bounds, from its groups (context
    buckets): ``counts[g]`` requests each emitting ``tokens[..., g]`` a step (at their worth to
    the target's requests, :func:`tail_values`).

    A p50 target: the requests' mean. A p99 target: the fewest of any group holding at least
    :data:`P99_GROUP_SHARE` of the class's requests (and its largest): every request of a
    bucket shares the bucket's tree, so a bucket of 1 % given a tree too small for the target
    is the p99 by itself, however well the mean does (priority-classes, seed 1: the 4-8k-token
    interactive requests, 1.3 % of them, left with one node while the rest had two, were every
    request over 8.8 ms and set the class's p99 at 8.7 ms).

    >>> rc = RequestClass("interactive", tpot_target_ms=8.0)
    >>> counts, tokens = np.array([60.0, 39.0, 1.0]), np.array([2.4, 2.2, 1.5])
    >>> float(target_tokens(rc, counts, tokens)), float(target_tokens(rc, counts, tokens[:2].tolist() + [3.0]))
    (1.5, 2.2)
    >>> round(float(target_tokens(RequestClass("i", tpot_target_ms=8.0, tpot_quantile="p50"), counts, tokens)), 3)
    2.313
    """
    counts = np.asarray(counts, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return np.ones(tokens.shape[:-1])
    if rc.tpot_quantile != "p99":
        return tokens @ counts / total
    bounding = counts >= P99_GROUP_SHARE * total
    bounding[int(np.argmax(counts))] = True
    return np.where(bounding, tokens, np.inf).min(axis=-1)


def class_tail_scale(obs: Observation, rc: RequestClass, k: int, context_share: np.ndarray) -> float:
    """:func:`tail_scale` of class ``rc`` (index ``k``) fitted on its best-first node list in its
    main context bucket within the drafter's limits, valued with its acceptance."""
    load = obs.class_load.get(rc.name)
    if rc.tpot_quantile != "p99" or load is None or load.tail_tokens_per_step <= 0:
        return 1.0
    acceptance, main = class_acceptance(obs, rc), int(np.argmax(context_share[k]))
    d = obs.drafter
    nodes = best_first_nodes(acceptance.rank_probs(main), d.max_depth, d.max_width, d.max_tree_nodes,
                             acceptance.offer_probs(main))
    return tail_scale(rc, load, nodes)


# Each live observation's class tail scales (:func:`class_tail_scales`), by ``id``: one
# observation is read by the policy's solve (``class_batch``, for its plan and again for its
# probes) and by the controller's plan judge (``class_plan_estimate``, two plans at up to two
# batches), and each scale expands the drafter's whole tree. An entry goes with its observation.
_TAIL_SCALES: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def class_tail_scales(obs: Observation) -> np.ndarray:
    """``[classes]``: :func:`class_tail_scale` of every class of ``obs`` (in its
    :func:`class_mix`), computed once per observation (an observation is a snapshot, never
    changed once made) and returned read-only."""
    key = id(obs)
    held = _TAIL_SCALES.get(key)
    if held is not None and held[0]() is obs:
        return held[1]
    _, context_share, _ = class_mix(obs)
    scales = np.array([class_tail_scale(obs, rc, k, context_share) for k, rc in enumerate(obs.classes)])
    scales.flags.writeable = False
    try:
        _TAIL_SCALES[key] = (weakref.ref(obs, lambda _gone, key=key: _TAIL_SCALES.pop(key, None)), scales)
    except TypeError:  # a stand-in that takes no weak reference is not kept
        pass
    return scales


def class_mix(obs: Observation) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(share ``[classes]``, context share and mean context ``[classes, buckets]``).

    A class's share of request-steps from ``obs.class_load``; a class without
    traffic yet gets :data:`UNSEEN_CLASS_SHARE` of the batch (so its row is
    solved with it present, not empty), and with no class traffic at all
    they share alike. A class's context mix is its own where it has one,
    else the worker's (:func:`observed_mix`), bucket by bucket for the means.
    """
    n_classes, n = len(obs.classes), len(obs.context_edges)
    base_share, base_mean = observed_mix(obs)
    raw = np.zeros(n_classes)
    share = np.tile(base_share, (n_classes, 1))
    means = np.tile(base_mean, (n_classes, 1))
    for k, rc in enumerate(obs.classes):
        load = obs.class_load.get(rc.name)
        if load is None:
            continue
        raw[k] = max(float(load.share), 0.0)
        own = np.asarray(load.context_share, dtype=float)
        if own.shape == (n,) and own.sum() > 0:
            share[k] = own / own.sum()
        observed = np.asarray(load.context_mean, dtype=float)
        if observed.shape == (n,):
            means[k] = np.where(observed > 0, observed, base_mean)
    if raw.sum() <= 0:
        return np.full(n_classes, 1.0 / n_classes), share, means
    raw = np.where(raw > 0, raw / raw.sum(), UNSEEN_CLASS_SHARE)
    return raw / raw.sum(), share, means


@dataclass
class ClassBatch:
    """What every multi-class row is solved from, whatever its batch size.

    ``lists[k][cap - 1][b]``: class ``k``'s best-first nodes in context bucket
    ``b`` (classes valued with the same acceptance share the lists);
    ``groups``: the (class, bucket) pairs a representative batch holds (each
    class's buckets with at least ``min_share`` of its traffic, and always its
    largest); ``distinct``: the caps (0-based) at which some list changes.
    Prefix tables are built once per set of weight multipliers and shared by
    every row.
    """

    classes: tuple[RequestClass, ...]
    weights: np.ndarray  # [classes]
    targets: np.ndarray  # [classes] ms the policy aims at (target less margin, tpot_aim_ms); inf: best effort
    spread: np.ndarray  # [classes] κ
    tail: np.ndarray  # [classes] per-position acceptance of the target's requests over the class's (tail_scale)
    share: np.ndarray  # [classes]
    context_share: np.ndarray  # [classes, buckets]
    context_mean: np.ndarray  # [classes, buckets]
    offer: np.ndarray  # [classes, buckets] P(a draft is offered at all)
    lists: list[list[list[NodeList]]]
    groups: list[tuple[int, int]]
    distinct: list[int]
    # From ``groups``, for every row's pricing: each group's class ``[groups]``, the one-hot
    # ``member[g, k]`` ``[groups, classes]``, and per class the mask of its groups.
    class_of: np.ndarray = field(init=False, repr=False)
    member: np.ndarray = field(init=False, repr=False)
    class_masks: tuple[np.ndarray, ...] = field(init=False, repr=False)
    _tables: dict[tuple[int, ...], PrefixTable] = field(default_factory=dict, repr=False)
    _tail_gains: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.class_of = np.array([k for k, _ in self.groups])
        self.member = np.zeros((len(self.groups), len(self.classes)))
        self.member[np.arange(len(self.groups)), self.class_of] = 1.0
        self.class_masks = tuple(self.class_of == k for k in range(len(self.classes)))

    def tail_gains(self) -> np.ndarray:
        """``[distinct caps, groups, nodes + 1]``: what a group's first nodes under each cap are
        worth to its class's target requests (:func:`tail_values`; plain values for a class
        whose scale is 1), indexed like a prefix table's ``cap_of`` and ``taken``."""
        if self._tail_gains is None:
            lists = [[self.lists[k][cap][b] for k, b in self.groups] for cap in self.distinct]
            longest = max((len(nodes.values) for per_cap in lists for nodes in per_cap), default=0)
            out = np.zeros((len(self.distinct), len(self.groups), longest + 1))
            for ci, per_cap in enumerate(lists):
                for g, ((k, _), nodes) in enumerate(zip(self.groups, per_cap)):
                    gains = tail_values(nodes, float(self.tail[k]))
                    out[ci, g, : len(gains)] = gains
                    out[ci, g, len(gains):] = gains[-1]
            self._tail_gains = out
        return self._tail_gains

    def effective_weights(self, levels: Sequence[int]) -> np.ndarray:
        """Each class's weight times ``1 + TARGET_MULTIPLIERS[level]``."""
        return self.weights * (1.0 + np.asarray([TARGET_MULTIPLIERS[i] for i in levels]))

    def table(self, levels: tuple[int, ...]) -> PrefixTable:
        """The prefix table ranking nodes by effective weight · value; of equal
        ones, a class with a target's first (a best-effort class gives way)."""
        if levels not in self._tables:
            weights = self.effective_weights(levels) * np.where(np.isfinite(self.targets), 1.0 + TIE_BREAK, 1.0)
            lists = [[self.lists[k][cap][b] for k, b in self.groups] for cap in self.distinct]
            self._tables[levels] = PrefixTable(lists, weights=[weights[k] for k, _ in self.groups], whole_ties=True)
        return self._tables[levels]


@dataclass(frozen=True)
class ClassAllocation:
    """One multi-class row: the depth cap every class shares, nodes per class
    and context bucket, and what the policy predicts for them."""

    cap: int
    nodes: tuple[tuple[int, ...], ...]  # [class][bucket]
    goodput_tok_s: float  # every class's tokens per second of step time
    weighted_goodput: float  # Σ weight_c · tokens_c per second
    tpot_ms: tuple[float, ...]  # per class, at its target's quantile (κ · step time / tokens per step)
    step_ms: float
    multipliers: tuple[float, ...]  # the weight factors (1 + m) the allocation was ranked with

    def meets_targets(self, classes: Sequence[RequestClass]) -> bool:
        """Whether every class's predicted TPOT is within what the policy aims at (its target
        less its margin, :attr:`RequestClass.tpot_aim_ms`)."""
        return all(rc.tpot_aim_ms is None or t <= rc.tpot_aim_ms for rc, t in zip(classes, self.tpot_ms))


@dataclass(frozen=True)
class _Scores:
    """Every prefix of one prefix table priced on one batch."""

    step_ms: np.ndarray  # [prefixes]
    tokens: np.ndarray  # [prefixes, classes] tokens a step emits per class
    weighted: np.ndarray  # [prefixes] Σ weight · tokens per second
    tpot_ms: np.ndarray  # [prefixes, classes] κ · step / tokens per request
    worst: np.ndarray  # [prefixes] max over targeted classes of TPOT / target (0: none)


def _pick(scores: Sequence[_Scores], allowed: Sequence[np.ndarray] | None = None) -> tuple[int, int] | None:
    """(table, prefix) of the best allowed prefix: the best weighted goodput
    among those that meet every target, else the smallest worst TPOT/target
    (within :data:`RATIO_TOLERANCE`, then the best weighted goodput). The
    first wins ties; None if none is allowed."""
    masks = [np.ones(len(s.weighted), dtype=bool) if allowed is None else allowed[i] for i, s in enumerate(scores)]
    feasible = [m & (s.worst <= 1.0) for s, m in zip(scores, masks)]
    if any(f.any() for f in feasible):
        best, key = None, -np.inf
        for i, (s, f) in enumerate(zip(scores, feasible)):
            if f.any():
                p = int(np.argmax(np.where(f, s.weighted, -np.inf)))
                if s.weighted[p] > key:
                    best, key = (i, p), float(s.weighted[p])
        return best
    if not any(m.any() for m in masks):
        return None
    lowest = min(float(s.worst[m].min()) for s, m in zip(scores, masks) if m.any())
    best, key = None, -np.inf
    for i, (s, m) in enumerate(zip(scores, masks)):
        near = m & (s.worst <= lowest * (1.0 + RATIO_TOLERANCE))
        if near.any():
            p = int(np.argmax(np.where(near, s.weighted, -np.inf)))
            if s.weighted[p] > key:
                best, key = (i, p), float(s.weighted[p])
    return best


@dataclass(frozen=True)
class ClassPlanEstimate:
    """What a plan's class tables are estimated to do at one batch size."""

    goodput_tok_s: float  # every class's tokens per second
    weighted_goodput_tok_s: float  # Σ weight_c · tokens_c per second
    tpot_ms: tuple[float, ...]  # per class, κ applied
    worst_ratio: float  # max over classes with a target of TPOT / target (0: none)

    def better_than(self, other: "ClassPlanEstimate", margin: float = 1.0) -> bool:
        """The solver's order, with hysteresis ``margin`` (≥ 1): meeting every
        target beats missing one; between two that meet them (or two without
        targets) the weighted goodput must be ``margin`` times higher; between
        two that miss, the worst ratio ``margin`` times lower."""
        if (self.worst_ratio <= 1.0) != (other.worst_ratio <= 1.0):
            return self.worst_ratio <= 1.0
        if self.worst_ratio > 1.0:
            return self.worst_ratio * margin < other.worst_ratio
        return self.weighted_goodput_tok_s > other.weighted_goodput_tok_s * margin


def class_plan_estimate(draft: PlanDraft, obs: Observation, batch: float | None = None) -> ClassPlanEstimate:
    """:func:`table_goodput` for a plan with class tables: a batch of ``batch``
    requests (default the mean batch size) split by :func:`class_mix`, each
    class drafting what its table says, each valued with its acceptance
    (:func:`class_acceptance`), one step time for all. With one class its
    ``goodput_tok_s`` is ``table_goodput(draft.table, obs, batch)``; the
    controller can judge whether a new plan is worth pushing with
    :meth:`ClassPlanEstimate.better_than`, which a plan that only changes a
    non-default class's table needs."""
    batch = max(1.0, obs.load.mean_batch_size if batch is None else batch)
    share, context_share, means = class_mix(obs)
    groups, offer, class_of = [], [], []
    for k, rc in enumerate(obs.classes):
        acceptance, table = class_acceptance(obs, rc), draft.table_for(rc.name)
        for c in np.flatnonzero(context_share[k]):
            d = table.lookup(max(1, round(batch)), obs.context_edges[c])
            nodes = decision_nodes(acceptance, c, d)
            groups.append(BatchGroup(batch * share[k] * context_share[k, c], means[k, c], nodes))
            offer.append(acceptance.offer_rate(c))
            class_of.append(k)
    taken = np.array([len(g.nodes.values) for g in groups])
    goodput = float(step_goodput(groups, taken, obs.cost, np.array(offer), obs.padded_verify))
    tokens = np.zeros(len(obs.classes))
    for g, k in zip(groups, class_of):
        tokens[k] += g.count * (1.0 + g.nodes.values.sum())
    step_ms = tokens.sum() / max(goodput, 1e-12) * 1000.0
    loads = [obs.class_load.get(rc.name) for rc in obs.classes]
    step_now = recent_step_ms(obs)
    spread = np.array([tpot_spread(rc, load, step_now) for rc, load in zip(obs.classes, loads)])
    scale = class_tail_scales(obs)
    class_of_a = np.array(class_of, dtype=np.int64)
    counts = np.array([g.count for g in groups])
    tail_tokens = np.array([1.0 + tail_values(g.nodes, scale[k])[-1] for g, k in zip(groups, class_of)])
    masks = [class_of_a == k for k in range(len(obs.classes))]
    per_request = np.array([float(target_tokens(rc, counts[mask], tail_tokens[mask])) if mask.any() else 1.0
                            for mask, rc in zip(masks, obs.classes)])
    tpot = step_ms / np.maximum(per_request, 1e-12) * spread
    ratios = [t / rc.tpot_aim_ms for t, rc in zip(tpot, obs.classes) if rc.has_target]
    weights = np.array([rc.weight for rc in obs.classes])
    return ClassPlanEstimate(goodput, float(tokens @ weights / step_ms * 1000.0), tuple(float(t) for t in tpot),
                             float(max(ratios, default=0.0)))


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
            batch = representative_batch_size(obs.batch_edges, batch_bucket, obs.max_batch_size)
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
        node_ms = marginal_node_ms(obs.cost, batch, counts, contexts, [nodes[c] for c in served])
        price = allocation.goodput_tok_s / 1000.0 * node_ms * (1.0 + self.config.min_gain)
        for c in range(len(chosen)):
            if c not in nodes:
                nodes[c] = int(np.count_nonzero(chosen[c].values > price))
        return cap, [nodes[c] for c in range(len(chosen))], allocation.goodput_tok_s

    def catch_up_charge(self, obs: Observation, by_class: bool = False) -> list | None:
        """Per context bucket, the ms a step pays when that bucket's active
        requests draft: the drafter's catch-up on what they owe
        (``obs.catch_up_owed``), spread over ``catch_up_horizon_steps``.

        Switching a request on after it was off costs one head forward over
        everything it missed (EAGLE: its whole context on the first draft),
        then nothing while it keeps drafting; charged per step, the cost sets
        a bar that turning on must clear and that staying on does not pay.
        None when nothing is owed or the worker never reported a catch-up.
        ``by_class``: ``[class][bucket]`` (the request's class from
        ``obs.active_classes``), for the multi-class solve."""
        owed = np.zeros((len(obs.classes) if by_class else 1, len(obs.context_edges)))
        for rid, tokens in obs.catch_up_owed.items():
            ctx = obs.active_requests.get(rid)
            if tokens and ctx is not None:
                k = obs.classes.index(obs.active_classes.get(rid, "")) if by_class else 0
                owed[k, bucket_index(obs.context_edges, ctx)] += tokens
        if not owed.any():
            return None
        per_step = np.asarray(obs.cost.catch_up_ms(owed)) / self.config.catch_up_horizon_steps
        if not per_step.any():
            return None
        return per_step.tolist() if by_class else per_step[0].tolist()

    def prefix_table(self, obs: Observation,
                     lists_by_cap: Sequence[Sequence[NodeList]]) -> tuple[list[int], list[int], PrefixTable]:
        """(served buckets, distinct caps (0-based), their :class:`PrefixTable`) for ``solve_row``."""
        share, _ = observed_mix(obs)
        served = [c for c in range(len(share)) if share[c] >= self.config.min_share]
        distinct = [k for k in range(len(lists_by_cap)) if k == 0 or lists_by_cap[k] is not lists_by_cap[k - 1]]
        return served, distinct, PrefixTable([[lists_by_cap[k][c] for c in served] for k in distinct])

    def node_lists(self, obs: Observation, rank_probs: Sequence[np.ndarray | None],
                   acceptance: AcceptanceEstimate | None = None) -> list[list[NodeList]]:
        """``[cap - 1][bucket]`` best-first node lists within the limits, one expansion per
        distinct ``q`` and offer probabilities (buckets never observed share the prior's);
        a cap whose lists equal the one above is that same list object. A ``None`` bucket
        gets no nodes. ``acceptance``: the estimate the offer probabilities come from
        (default ``obs.acceptance``; a relaxed class's is ``obs.acceptance_typical``)."""
        acceptance = obs.acceptance if acceptance is None else acceptance
        depth, width, nodes = self.limits(obs)
        empty = capped_node_lists(np.zeros((0, 0)), depth, width, nodes)
        by_q: dict[bytes, list[NodeList]] = {}
        per_bucket = []
        for c, q in enumerate(rank_probs):
            if q is None:
                per_bucket.append(empty)
                continue
            offer = acceptance.offer_probs(c)
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
        if not obs.classes.single:
            return self.decide_classes(state, obs)
        seed, calls = state
        switch = self.catch_up_charge(obs)
        contexts = range(len(obs.context_edges))
        lists_by_cap = self.node_lists(obs, [obs.acceptance.rank_probs(c) for c in contexts])
        # The row holding today's mean batch is solved at that batch itself: it is
        # where the worker runs, and a bucket's representative size may sit on the
        # other side of the roofline's kink.
        current = bucket_index(obs.batch_edges, max(1, round(obs.load.mean_batch_size)))
        prefixes = self.prefix_table(obs, lists_by_cap)
        rows, goodputs, solved = [], [], []
        for b in range(len(obs.batch_edges)):
            # Only the row the worker runs now pays its requests' catch-up.
            batch, row_switch = (max(1.0, obs.load.mean_batch_size), switch) if b == current else (None, None)
            cap, nodes_per_bucket, goodput = self.solve_row(obs, lists_by_cap, b, batch, prefixes,
                                                            switch_ms=row_switch)
            rows.append([lists_by_cap[cap - 1][c].decision(m) for c, m in enumerate(nodes_per_bucket)])
            goodputs.append(goodput)
            solved.append((cap, nodes_per_bucket))
        table = DecisionTable.from_rows(rows, obs.batch_edges, obs.context_edges)
        rng = np.random.default_rng([seed, calls])
        overrides, reasons = self.explore(obs, table, rng, switch)
        if not overrides:  # one experiment at a time: a Thompson probe's steps would not price the shape
            overrides, reasons = self.price_probe(obs, table, lists_by_cap, prefixes, rng, switch)
        expected, state_tables = goodputs[current], {}
        if self.config.request_states and obs.acceptance_by_state:
            # The tracked request states' best response to this table (policies.state_tables).
            # None: no state differs, and the plan stays as it is.
            planned = plan_state_tables(self, obs, lists_by_cap, solved, table, switch)
            if planned is not None:
                expected, state_tables = planned.goodput_tok_s, planned.state_tables
        plan = PlanDraft(table, overrides, expected, reasons, state_tables=state_tables)
        return plan, (seed, calls + 1)

    def explore(self, obs: Observation, table: DecisionTable, rng: np.random.Generator,
                switch_ms: Sequence[float] | None = None) -> tuple[dict[str, Decision], dict[str, str]]:
        """Thompson sampling on the probes of the active requests (:func:`probe_requests`:
        a slice of them, or on a padded worker now and then all of them)
        (``switch_ms``: the active requests' :meth:`catch_up_charge`)."""
        probes = probe_requests(list(obs.active_requests), obs.padded_verify, self.config.probe_fraction, rng)
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

    def price_probe_due(self, obs: Observation, rng: np.random.Generator) -> bool:
        """Whether this decision may price-probe: probes on, a batch to probe, and the draw."""
        cfg = self.config
        return (bool(cfg.price_probe_fraction and cfg.price_optimism and obs.active_requests)
                and rng.random() < cfg.price_probe_fraction)

    def price_probe(self, obs: Observation, table: DecisionTable, lists_by_cap: Sequence[Sequence[NodeList]],
                    prefixes: tuple[list[int], list[int], PrefixTable] | None, rng: np.random.Generator,
                    switch_ms: Sequence[float] | None = None) -> tuple[dict[str, Decision], dict[str, str]]:
        """The active batch's decision with the prices of its unmeasured shapes
        lowered by ``price_optimism`` standard errors (:class:`UnmeasuredDoubt`),
        on ``price_probe_fraction`` of the decisions where it differs from the
        table's: every active request takes it (reason ``"price-probe"``).

        The mean decisions price a shape the worker has never run from the
        calibration and the curve, add ``cost_caution`` errors, and so never
        run it; nothing then measures it. The start-up calibration is timed
        on a quiet machine at short contexts and misses live steps by 3-10 %
        at some shapes after scaling: on the reference worker it priced 8
        tokens at batch 4 at 1.22-1.27 of 4 where live steps cost 1.08-1.16,
        and n-gram drafting stayed off where a static depth-1 chain beat plain
        by 3-7 %. A probe runs the optimistic shape until the fit has
        ``price_probe_steps`` live steps in its segment; then the price is
        measured, its doubt is the live noise, and the mean decides. The loss
        is bounded: probes run only while a shape within ``price_optimism``
        errors of winning is unmeasured."""
        if not self.price_probe_due(obs, rng):
            return {}, {}
        batch = len(obs.active_requests)
        batch_bucket = bucket_index(obs.batch_edges, batch)
        doubt = UnmeasuredDoubt(obs.cost, self.config.price_probe_steps)
        optimistic = replace(obs, cost=doubt)
        cap, nodes_per_bucket, _ = self.solve_row(optimistic, lists_by_cap, batch_bucket, float(batch), prefixes,
                                                  caution=-self.config.price_optimism, switch_ms=switch_ms)
        decisions = {rid: lists_by_cap[cap - 1][c].decision(nodes_per_bucket[c])
                     for rid, c in ((rid, bucket_index(obs.context_edges, ctx))
                                    for rid, ctx in obs.active_requests.items())}
        if not _drafts_unmeasured(decisions.values(), batch, obs.padded_verify, doubt):
            return {}, {}  # off, or a shape already measured: the mean decisions judge it
        overrides = {rid: d for rid, d in decisions.items()
                     if d != table.cell(batch_bucket, bucket_index(obs.context_edges, obs.active_requests[rid]))}
        return overrides, {rid: "price-probe" for rid in overrides}

    # --- request classes ------------------------------------------------------

    def class_batch(self, obs: Observation,
                    rank_probs: Sequence[Sequence[np.ndarray | None]] | None = None) -> ClassBatch:
        """The multi-class setup of :meth:`solve_class_row`: mix, κ, node lists.

        ``rank_probs``: per acceptance estimate (0 strict, 1 relaxed) and
        bucket, the probabilities to expand (Thompson samples for probes);
        default each estimate's mean."""
        classes = tuple(obs.classes)
        estimates = [obs.acceptance, obs.acceptance_typical]
        which = [1 if class_acceptance(obs, rc) is not obs.acceptance else 0 for rc in classes]
        buckets = range(len(obs.context_edges))
        lists_by_estimate: dict[int, list[list[NodeList]]] = {}
        for e in sorted(set(which)):
            qs = rank_probs[e] if rank_probs is not None else [estimates[e].rank_probs(c) for c in buckets]
            lists_by_estimate[e] = self.node_lists(obs, qs, estimates[e])
        share, context_share, context_mean = class_mix(obs)
        step_now = recent_step_ms(obs)
        groups = []
        for k in range(len(classes)):
            served = set(np.flatnonzero(context_share[k] >= self.config.min_share).tolist())
            served.add(int(np.argmax(context_share[k])))
            groups += [(k, b) for b in sorted(served)]
        lists = [lists_by_estimate[e] for e in which]
        depth = len(lists[0])
        distinct = [cap for cap in range(depth)
                    if cap == 0 or any(per[cap] is not per[cap - 1] for per in lists_by_estimate.values())]
        return ClassBatch(
            classes=classes,
            weights=np.array([rc.weight for rc in classes]),
            targets=np.array([rc.tpot_aim_ms if rc.has_target else np.inf for rc in classes]),
            spread=np.array([tpot_spread(rc, obs.class_load.get(rc.name), step_now) for rc in classes]),
            tail=class_tail_scales(obs),
            share=share, context_share=context_share, context_mean=context_mean,
            offer=np.array([[estimates[e].offer_rate(c) for c in buckets] for e in which]),
            lists=lists, groups=groups, distinct=distinct,
        )

    def solve_class_row(self, obs: Observation, cb: ClassBatch, batch: float, caution: float | None = None,
                        switch_ms: Sequence[Sequence[float]] | None = None) -> ClassAllocation:
        """Depth cap and nodes per class and context bucket at one batch size.

        The batch holds ``batch · share_c · context_share_c[b]`` requests of
        each group (class ``c``, bucket ``b``); every prefix of the ranking
        by weight · value is priced with one step time for all of them.
        Without targets the best weighted goodput wins. With targets, the
        classes the weighted optimum leaves over their targets have their
        weights raised by the smallest factor of :data:`TARGET_MULTIPLIERS`
        at which the optimum of the raised weights (the Lagrangian's) meets
        every target, found by bisection (monotone: a raised class ranks
        ahead of more of the others' nodes); the allocation is the best
        weighted goodput among all the prefixes priced on the way that meet
        every target, or, when none does, the smallest worst TPOT / target
        (within :data:`RATIO_TOLERANCE`, then the best weighted goodput). A
        raised weight ranks the class's nodes ahead of the others', so the
        others' drop out first as the step gets dearer: best-effort classes
        give way. Speculation must then beat off
        as in the single-class path (``min_gain``, ``caution`` standard errors
        on drafting batches): by ``min_gain`` in weighted goodput when off
        meets every target, else by meeting them, or by a ``min_gain``
        smaller worst ratio. Buckets outside the batch take the nodes whose
        effective weight · value beats the batch's marginal price, or
        (padded) fill the padding. ``switch_ms[c][b]``: per-step catch-up of
        class ``c``'s bucket ``b`` (:meth:`catch_up_charge` ``by_class``).
        """
        cfg = self.config
        caution = cfg.cost_caution if caution is None else caution
        n_classes, groups = len(cb.classes), cb.groups
        member, masks = cb.member, cb.class_masks
        counts = np.array([batch * cb.share[k] * cb.context_share[k, b] for k, b in groups])
        contexts = np.array([cb.context_mean[k, b] for k, b in groups])
        offer = np.array([cb.offer[k, b] for k, b in groups])
        switch = None if switch_ms is None else np.array([switch_ms[k][b] for k, b in groups])
        targeted = np.isfinite(cb.targets)
        tail_gains, group_ix = cb.tail_gains(), np.arange(len(groups))[None, :]

        def score(table: PrefixTable, shift: float = 0.0, rows=slice(None)) -> _Scores:
            step = np.maximum(prefix_step_ms(counts, contexts, table.depths[rows], table.taken[rows], obs.cost,
                                             offer, obs.padded_verify, shift, switch), 1e-9)
            tokens = (counts * (1.0 + table.gained[rows])) @ member
            # What the target's requests emit per step: each node at its worth to them (tail_scale),
            # in the bucket that bounds the target (target_tokens).
            tail_tokens = 1.0 + tail_gains[table.cap_of[rows][:, None], group_ix, table.taken[rows]]
            per_request = np.stack([target_tokens(rc, counts[mask], tail_tokens[:, mask])
                                    for mask, rc in zip(masks, cb.classes)], axis=1)
            tpot = step[:, None] / np.maximum(per_request, 1e-12) * cb.spread
            worst = (np.where(targeted, tpot / np.where(targeted, cb.targets, 1.0), 0.0).max(axis=1)
                     if targeted.any() else np.zeros(len(step)))
            return _Scores(step, tokens, tokens @ cb.weights / step * 1000.0, tpot, worst)

        tried: list[tuple[tuple[int, ...], PrefixTable, _Scores]] = []

        def over(raised: set[int], level: int) -> set[int]:
            """Price the ranking with the ``raised`` classes' weights at ``level``;
            the targeted classes its Lagrangian optimum (the best effective-weighted
            goodput) leaves over their targets."""
            key = tuple(level if k in raised else 0 for k in range(n_classes))
            table = cb.table(key)
            scores = score(table)
            tried.append((key, table, scores))
            star = int(np.argmax(scores.tokens @ cb.effective_weights(key) / scores.step_ms))
            return set(np.flatnonzero(scores.tpot_ms[star] > cb.targets).tolist())  # best effort: target inf

        # The smallest multiplier that meets the targets, by bisection on the grid:
        # raised classes ranked ahead of the rest make it true if anything does.
        raised = over(set(), 0)
        top = len(TARGET_MULTIPLIERS) - 1
        if raised:
            while not (still := over(raised, top)) <= raised:  # raising some may leave others over theirs
                raised |= still
            if not still:
                lo, hi = 0, top
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if over(raised, mid) else (lo, mid)

        tried.sort(key=lambda t: max(t[0]))  # ties go to the smallest multipliers (off stays first)
        expected = [s for _, _, s in tried]
        i, p = _pick(expected)
        off = expected[0]  # the first prefix of every table drafts nothing
        margin = 1.0 + cfg.min_gain

        def beats_off(s: _Scores) -> np.ndarray:
            if off.worst[0] > 1.0:
                return (s.worst <= 1.0) | (s.worst * margin <= off.worst[0])
            return (s.worst <= 1.0) & (s.weighted >= off.weighted[0] * margin)

        if caution < 0:  # a draw below the mean, or an optimistic bound: every prefix priced at it
            drawn = [score(t, caution) for _, t, _ in tried]
            picked = _pick(drawn, [beats_off(s) for s in drawn])
            i, p = picked if picked is not None else (0, 0)
        elif tried[i][1].taken[p].any():
            ok = beats_off(score(tried[i][1], caution, [p]))[0] if caution else beats_off(expected[i])[p]
            if not ok:
                cautious = [score(t, caution) for _, t, _ in tried] if caution else expected
                picked = _pick(cautious, [beats_off(s) for s in cautious])
                i, p = picked if picked is not None else (0, 0)
        key, table, scores = tried[i]
        cap = cb.distinct[int(table.cap_of[p])] + 1
        taken = [int(m) if n > 0 else 0 for m, n in zip(table.taken[p], counts)]
        nodes = {g: m for g, m in zip(groups, taken)}
        weights = cb.effective_weights(key)
        if obs.padded_verify:  # the rest fill the padding the batch already pays for, and no more
            width = max(taken, default=0)
            fill = lambda k, b, values: min(width, len(values))  # noqa: E731
        else:
            node_ms = marginal_node_ms(obs.cost, batch, counts, contexts, taken)
            rate = float(scores.tokens[p] @ weights / scores.step_ms[p])  # effective-weighted tokens per ms
            price = rate * node_ms * margin
            fill = lambda k, b, values: int(np.count_nonzero(weights[k] * values > price))  # noqa: E731
        per_class = tuple(
            tuple(nodes[(k, b)] if (k, b) in nodes else fill(k, b, cb.lists[k][cap - 1][b].values)
                  for b in range(cb.context_share.shape[1]))
            for k in range(n_classes))
        return ClassAllocation(
            cap=cap, nodes=per_class,
            goodput_tok_s=float(scores.tokens[p].sum() / scores.step_ms[p] * 1000.0),
            weighted_goodput=float(scores.weighted[p]),
            tpot_ms=tuple(float(t) for t in scores.tpot_ms[p]),
            step_ms=float(scores.step_ms[p]),
            multipliers=tuple(float(1.0 + TARGET_MULTIPLIERS[level]) for level in key),
        )

    def decide_classes(self, state: tuple[int, int], obs: Observation) -> tuple[PlanDraft, tuple[int, int]]:
        """:meth:`decide` with several request classes: one table per class
        (same edges, one shared depth cap per batch row), the default class's
        as ``table``; probes get their own class's decision."""
        seed, calls = state
        cb = self.class_batch(obs)
        current = bucket_index(obs.batch_edges, max(1, round(obs.load.mean_batch_size)))
        switch = self.catch_up_charge(obs, by_class=True)
        rows: list[list[list[Decision]]] = [[] for _ in cb.classes]
        goodput = 0.0
        for b in range(len(obs.batch_edges)):
            batch, row_switch = ((max(1.0, obs.load.mean_batch_size), switch) if b == current
                                 else (representative_batch_size(obs.batch_edges, b, obs.max_batch_size), None))
            alloc = self.solve_class_row(obs, cb, batch, switch_ms=row_switch)
            for k, per_bucket in enumerate(alloc.nodes):
                rows[k].append([cb.lists[k][alloc.cap - 1][c].decision(m) for c, m in enumerate(per_bucket)])
            if b == current:
                goodput = alloc.goodput_tok_s
        tables = {rc.name: DecisionTable.from_rows(rows[k], obs.batch_edges, obs.context_edges)
                  for k, rc in enumerate(cb.classes)}
        rng = np.random.default_rng([seed, calls])
        overrides, reasons = self.explore_classes(obs, tables, rng, switch)
        if not overrides:
            overrides, reasons = self.price_probe_classes(obs, cb, tables, rng, switch)
        plan = PlanDraft(tables[obs.classes.default], overrides, goodput, reasons, class_tables=tables)
        return plan, (seed, calls + 1)

    def explore_classes(self, obs: Observation, tables: dict[str, DecisionTable], rng: np.random.Generator,
                        switch_ms: Sequence[Sequence[float]] | None = None
                        ) -> tuple[dict[str, Decision], dict[str, str]]:
        """:meth:`explore` with classes: one posterior sample per acceptance
        estimate and bucket, one multi-class row at the current batch, and
        each probe gets its class's decision (compared with its class's table)."""
        probes = probe_requests(list(obs.active_requests), obs.padded_verify, self.config.probe_fraction, rng)
        if not probes:
            return {}, {}
        batch = max(1, len(obs.active_requests))
        batch_bucket = bucket_index(obs.batch_edges, batch)
        n = len(obs.context_edges)
        _, context_share, _ = class_mix(obs)
        estimates = [obs.acceptance, obs.acceptance_typical]
        wanted: list[set[int]] = [set(), set()]
        for k, rc in enumerate(obs.classes):
            e = 1 if class_acceptance(obs, rc) is not obs.acceptance else 0
            wanted[e] |= set(np.flatnonzero(context_share[k] >= self.config.min_share).tolist())
            wanted[e].add(int(np.argmax(context_share[k])))
        for rid in probes:
            rc = obs.classes.get(obs.active_classes.get(rid, ""))
            e = 1 if class_acceptance(obs, rc) is not obs.acceptance else 0
            wanted[e].add(bucket_index(obs.context_edges, obs.active_requests[rid]))
        sampled = [[estimates[e].sample_rank_probs(c, rng) if c in wanted[e] else None for c in range(n)]
                   if wanted[e] else [None] * n for e in range(2)]
        cb = self.class_batch(obs, sampled)
        cost_draw = float(rng.standard_normal())
        alloc = self.solve_class_row(obs, cb, float(batch), caution=cost_draw, switch_ms=switch_ms)
        overrides, reasons = {}, {}
        for rid in probes:
            k = obs.classes.index(obs.active_classes.get(rid, ""))
            c = bucket_index(obs.context_edges, obs.active_requests[rid])
            decision = cb.lists[k][alloc.cap - 1][c].decision(alloc.nodes[k][c])
            if decision != tables[cb.classes[k].name].cell(batch_bucket, c):
                overrides[rid] = decision
                reasons[rid] = "explore"
        return overrides, reasons

    def price_probe_classes(self, obs: Observation, cb: ClassBatch, tables: dict[str, DecisionTable],
                            rng: np.random.Generator, switch_ms: Sequence[Sequence[float]] | None = None
                            ) -> tuple[dict[str, Decision], dict[str, str]]:
        """:meth:`price_probe` with classes: the active batch's optimistic
        allocation over every class, each request its own class's decision."""
        if not self.price_probe_due(obs, rng):
            return {}, {}
        batch = len(obs.active_requests)
        batch_bucket = bucket_index(obs.batch_edges, batch)
        doubt = UnmeasuredDoubt(obs.cost, self.config.price_probe_steps)
        alloc = self.solve_class_row(replace(obs, cost=doubt), cb, float(batch),
                                     caution=-self.config.price_optimism, switch_ms=switch_ms)
        decisions, tabled = {}, {}
        for rid, context_len in obs.active_requests.items():
            k = obs.classes.index(obs.active_classes.get(rid, ""))
            c = bucket_index(obs.context_edges, context_len)
            decisions[rid] = cb.lists[k][alloc.cap - 1][c].decision(alloc.nodes[k][c])
            tabled[rid] = tables[cb.classes[k].name].cell(batch_bucket, c)
        if not _drafts_unmeasured(decisions.values(), batch, obs.padded_verify, doubt):
            return {}, {}
        overrides = {rid: d for rid, d in decisions.items() if d != tabled[rid]}
        return overrides, {rid: "price-probe" for rid in overrides}


def _drafts_unmeasured(decisions, batch: int, padded: bool, doubt: UnmeasuredDoubt) -> bool:
    """Whether a batch of ``batch`` requests taking ``decisions`` drafts, in a
    forward whose batch tokens the worker has not measured live."""
    blocks = [d.max_nodes if d.depth else 0 for d in decisions]
    tokens = batch * (1 + max(blocks, default=0)) if padded else batch + sum(blocks)
    return tokens > batch and doubt.any_unmeasured(float(tokens))


def _register() -> None:
    from policies.presets import register_policy

    register_policy("goodput", GoodputConfig, GoodputPolicy)


_register()
