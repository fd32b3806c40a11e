"""The benchmark's ceiling: per-step goodput-optimal decisions from the truth.

:class:`OracleDecider` sits where a worker's agent sits (``decide(request_id,
context_len, batch_size)``), but instead of a plan it reads the simulator
itself:

- the **true acceptance** of every running request at the step's start time
  (``worker.rank_probs`` — the same ``q[k, r]`` the simulator samples
  outcomes from: context decay, domain drift, the request's own
  predictability multiplier and, when the scenario makes acceptance
  correlated (``traffic.correlated_acceptance``), the request's current
  hidden span state at each draft level: its tree values are the expected
  values *given the state*, a deep tree for a request inside a near-copy
  span and none for one inside a span nothing matches — what no causal
  policy can see, it only has the outcomes of past steps), and
- the **true step cost** (``worker.cost``, what the simulator charges: the
  roofline — verify with attention pairs, EAGLE's per-level draft forwards
  or Medusa's single pass — or a measured GPU table,
  :class:`worker.sim.measured.MeasuredCostModel`), noise-free.

Every step it maximises the step's expected goodput ``Σ_i E[τ_i + 1] /
(T_draft + T_verify)`` — the SmartSpec objective the goodput policy also
pursues — over the batch's draft trees: each request's best-first node list
comes from :func:`policies.goodput.capped_node_lists` on its true ``q`` (the
EAGLE-2 tree values, built from the same 1/256-rounded confidences the
simulator builds its trees from), and the batch takes the TETRIS rule of
:func:`policies.goodput.allocate` — the best prefix of all candidate nodes
ranked by value — for every batch-wide depth cap ``L = 1..max_depth`` (a
draft level is one forward for the whole batch, so opening a level at all is
a decision a value-ordered prefix alone gets wrong), each prefix priced
exactly by the simulator's own cost model for *this* batch (its real
context lengths, deepest level, tree widths, attention pairs). Beside the
prefixes it prices every uniform allocation a static configuration of the
policy benchmark's grid would make (every request the same best-first tree
of ``(depth, width, depth · width nodes)``): a value-ordered prefix mixes
widths across requests, and the per-level draft cost can favour the plain
uniform tree. The best candidate of all wins; it is reused while the batch
and its requests' tree values stay the same (:data:`REUSE_STEPS`).

On the roofline the prefixes are pruned exactly by its structure (nodes past
the kink cost at least ``token_ms`` each); any other truth has no such
structure, so every prefix of the :data:`MAX_CANDIDATES` best nodes is priced.

Why nothing causal can beat it (up to sampling noise): it chooses from the
same action space as every policy — per-request depth, width, node budget,
on/off, any step — but with information no causal policy has: the exact
acceptance probability of each request *now*, its span state included (a
causal policy only has estimates learned from past, censored outcomes,
pooled per context bucket, lagging behind drift, and so under correlated
acceptance only the mix of states, not which one a request is in) and the exact cost of each candidate batch shape (a
causal policy has a fitted model); it decides every step with no plan
delivery delay; and each step it weighs every static grid configuration's
allocation too. Given the batch, its choice maximises the step's expected
goodput. What could still let a policy edge past it on one run: luckier
outcome draws, and queueing feedback the per-step optimum ignores (how this
step's speed reshapes later batches). The per-step ratio is used rather than
a fleet-wide ``E[tokens] − λ·time`` (Dinkelbach) for that reason: with λ the
run's average, bursts would overspend on speculation while the queue grows.
(On the measured H200 table, where the best allocation is nearly always the
plain depth-3 chain, the static depth-3 chain lands 0.1-0.3 % above the
oracle on a saturated one-worker scenario, with short or long outputs alike:
most likely the few steps where the per-step optimum goes deeper do not pay
over the run.)
The benchmark reports the ratio to the oracle, so a policy above 1.0 would show.

Request classes (issue #29): on a scenario whose requests carry classes the
benchmark runs :class:`ClassOracleDecider` instead, the same truth and
pricing with the classes' objective: weighted goodput subject to each
class's TPOT target, per step. This single-class oracle is unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from policies.classes import ClassSet
from policies.goodput import best_first_nodes, capped_node_lists
from policies.table import Decision
from worker.sim.tree import CONF_SCALE, quantize
from worker.sim.worker import SimWorker

MAX_CANDIDATES = 4096  # nodes considered per step (the best by value); far more than any batch can use
# An allocation is reused while the batch and every request's node list stay the same
# (the lists are keyed by the 1/256-quantised q), for at most this many steps: in
# between only the KV read grows, by a few tokens per request per step, which moves
# a step's price by far less than its 3 % timing noise.
REUSE_STEPS = 32
# Tree widths of the static grid when none is given: the policy benchmark's
# (bench.policies.GRID_WIDTHS), at every depth 0..max_depth.
DEFAULT_STATIC_WIDTHS = (1, 2, 4)


class PrefixPrices(NamedTuple):
    """What :func:`prefix_step_ms` gives: each taken node's request ``i`` and
    the nodes ``m`` that request then holds (``[cap, P]``), the step time after
    each prefix (``[cap, P + 1]``, row 0: nothing taken) and, per prefix, how
    many requests hold more nodes than depth × width of their tree (no
    Decision builds such a tree: ``Decision.clamp`` cuts it)."""

    i: np.ndarray
    m: np.ndarray
    step_ms: np.ndarray
    overfull: np.ndarray


def prefix_step_ms(cost, order: np.ndarray, n: int, depth_all: np.ndarray, width_all: np.ndarray, ctx: np.ndarray,
                   kv: float, b: int) -> PrefixPrices:
    """True step time of every prefix of a node order, under every depth cap.

    ``order[cap, P]``: flat node indices (request ``i`` = index // ``n``, its
    ``m``-th best node = index % ``n`` + 1) in the order taken;
    ``depth_all`` / ``width_all[request, cap, m]``: the tree a request holds
    with ``m`` nodes; ``ctx[request]`` its context, ``kv`` the batch's. Returns
    :class:`PrefixPrices`. Draft time is priced per level from the levels
    each prefix opens (its requests' count, width and context per level).
    """
    caps = order.shape[0]
    i, m = np.divmod(order, n)
    m = m + 1  # nodes the request holds once this candidate is taken
    c = np.arange(caps)[:, None]
    d_new, d_old = depth_all[i, c, m], depth_all[i, c, m - 1]  # [cap, P]
    w_new, w_old = width_all[i, c, m], width_all[i, c, m - 1]
    levels = np.arange(1, caps + 1)
    on_new = (d_new[..., None] >= levels).astype(float)  # [cap, P, level]
    on_old = (d_old[..., None] >= levels).astype(float)
    delta = on_new - on_old
    n_cand = order.shape[1]
    # Prefix sums with a leading zero row (nothing taken): [cap, P + 1, level].
    count = np.zeros((caps, n_cand + 1, caps))
    np.cumsum(delta, axis=1, out=count[:, 1:])
    width_sum = np.zeros_like(count)
    np.cumsum(w_new[..., None] * on_new - w_old[..., None] * on_old, axis=1, out=width_sum[:, 1:])
    ctx_i = ctx[i]
    kv_l = np.zeros_like(count)
    np.cumsum(ctx_i[..., None] * delta, axis=1, out=kv_l[:, 1:])
    taken = np.arange(n_cand + 1, dtype=np.float64)
    attn = np.full((caps, n_cand + 1), kv)
    np.cumsum(ctx_i, axis=1, out=attn[:, 1:])
    attn[:, 1:] += kv
    step_ms = cost.verify_ms(b + taken, kv, attn, batch=b) + cost.draft_levels_ms(count, width_sum, kv_l)
    overfull = np.zeros((caps, n_cand + 1))
    np.cumsum((m > d_new * w_new).astype(float) - ((m - 1) > d_old * w_old), axis=1, out=overfull[:, 1:])
    return PrefixPrices(i, m, step_ms, overfull)


@dataclass(frozen=True)
class RequestOptions:
    """What one request could draft, from its 1/256-quantised ``q``.

    ``lists``: best-first node lists under every depth cap, packed as
    :meth:`OracleDecider.node_lists` describes; ``statics``: ``[S, 4]`` rows
    ``(expected accepted, nodes, depth, width)`` of the tree each static
    decision builds for it.
    """

    lists: np.ndarray
    statics: np.ndarray


class OracleDecider:
    """``decide`` callable for one :class:`SimWorker` that knows the truth.

    Call :meth:`begin_step` with the step's start time before each
    ``worker.step``; the first ``decide`` of the step allocates the whole
    batch, the others read the answer.

    Parameters
    ----------
    worker
        The simulated worker whose truth it reads.
    static_grid
        ``(depth, width)`` points of the static configurations whose uniform
        allocations are candidates too (``Decision(depth, width, depth · width)``,
        as the policy benchmark runs them); default: every depth
        ``0..max_depth`` × :data:`DEFAULT_STATIC_WIDTHS`.
    """

    def __init__(self, worker: SimWorker, static_grid: Sequence[tuple[int, int]] | None = None) -> None:
        self.worker = worker
        self.cost = worker.cost  # the simulator's own cost truth, priced noise-free
        self.max_depth, self.max_width, self.max_nodes = worker.max_depth, worker.max_width, worker.max_nodes
        if static_grid is None:
            static_grid = [(d, w) for d in range(self.max_depth + 1) for w in DEFAULT_STATIC_WIDTHS]
        # Clamped as the simulator clamps them; "off" is already the empty prefix.
        clamped = (Decision(d, w, d * w).clamp(self.max_depth, self.max_width, self.max_nodes)
                   for d, w in static_grid if d > 0)
        self.static_decisions: list[Decision] = list(dict.fromkeys(clamped))
        self.now = 0.0
        self.fresh = True
        self.decisions: dict[str, Decision] = {}
        self._cache: dict[bytes, RequestOptions] = {}
        # (request id, its draft levels' span states) -> (q, its options)
        self._memo: dict[tuple[str, bytes], tuple[np.ndarray, RequestOptions]] = {}
        self._last: tuple[list[RequestOptions], dict[str, Decision], int] | None = None  # options, answer, steps used
        self.alpha1_sum = 0.0  # Σ over decided request-steps of the true q[1, 1] (for plots)
        self.alpha1_n = 0

    def begin_step(self, now: float) -> None:
        self.now = now
        self.fresh = True

    def __call__(self, request_id: str, context_len: int, batch_size: int, request_class: str = "") -> Decision:
        if self.fresh:
            self.fresh = False
            self.decisions = self.allocate()
        return self.decisions.get(request_id, Decision.off())

    # -- per request ---------------------------------------------------------
    def node_lists(self, q: np.ndarray) -> np.ndarray:
        """Best-first node lists of one request under every depth cap ``L = 1..max_depth``,
        packed as ``[L, 3N + 3]`` rows: ``values [N]`` (0 past the list), ``depth [N + 1]``
        and ``width [N + 1]`` (the tree shape a prefix of ``m`` nodes has), ``count``.

        All caps come from one expansion (:func:`policies.goodput.capped_node_lists`,
        which leaves out nodes worth less than ``MIN_NODE_VALUE``). Cached by the
        1/256-quantised ``q`` — the simulator's own tree key.
        """
        return self.options(q).lists

    def options(self, q: np.ndarray) -> RequestOptions:
        """:meth:`node_lists` and the static trees of one request, cached by its quantised ``q``."""
        qconf = quantize(q)
        key = qconf.tobytes()
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 20_000:
                self._cache.clear()
            conf = qconf / CONF_SCALE  # the simulator builds its trees from these confidences
            n = self.max_nodes
            lists = np.zeros((self.max_depth, 3 * n + 3))
            for cap, nodes in enumerate(capped_node_lists(conf, self.max_depth, self.max_width, n)):
                k = len(nodes.values)
                row = lists[cap]
                row[:k] = nodes.values
                row[n : n + k + 1] = nodes.depth
                row[2 * n + 1 : 2 * n + k + 2] = nodes.width
                row[3 * n + 2] = k
            hit = self._cache[key] = RequestOptions(lists, self.static_trees(conf))
        return hit

    def static_trees(self, conf: np.ndarray) -> np.ndarray:
        """``[S, 4]``: ``(expected accepted, nodes, depth, width)`` of the tree the simulator
        builds for each static decision from confidences ``conf`` (as
        :meth:`worker.sim.tree.TreeCache.get` does: a chain for width 1, else the
        best-first tree within the decision's limits, every node kept)."""
        out = np.zeros((len(self.static_decisions), 4))
        for s, d in enumerate(self.static_decisions):
            if d.width == 1 or d.max_nodes == 1:
                m = min(d.depth, d.max_nodes, conf.shape[0])
                out[s] = (float(np.cumprod(conf[:m, 0]).sum()), m, m, 1 if m else 0)
            else:
                nodes = best_first_nodes(conf, d.depth, d.width, d.max_nodes)
                k = len(nodes.values)
                out[s] = (float(nodes.values.sum()), k, nodes.depth[k], nodes.width[k])
        return out

    def batch_lists(self, q: np.ndarray) -> list[RequestOptions]:
        """:meth:`options` of every running request (``q``: [batch, depth, width]),
        each reused while its ``q`` stays within half a confidence quantum of the one
        its options were built for (context grows a few tokens a step; ``q`` moves far
        slower than that). Under correlated acceptance a request's options are kept
        per window of span states its draft levels fall in, so a request that
        comes back to a state it was in reuses them under the same rule."""
        running = self.worker.running
        memo = self._memo
        if self.worker.spans is None:
            keys = [(r.request_id, b"") for r in running]
        else:
            keys = [(r.request_id, row.tobytes()) for r, row in zip(running, self.worker.span_states(running))]
        refs = [memo.get(k) for k in keys]
        known = [i for i, ref in enumerate(refs) if ref is not None]
        fresh = np.ones(len(running), dtype=bool)
        if known:
            drift = np.abs(np.stack([refs[i][0] for i in known]) - q[known]).reshape(len(known), -1).max(axis=1)
            fresh[known] = drift >= 0.5 / CONF_SCALE
        out = []
        for i, r in enumerate(running):
            if fresh[i]:
                options = self.options(q[i])
                memo[keys[i]] = (q[i], options)
                out.append(options)
            else:
                out.append(refs[i][1])
        if len(memo) > 4096:
            live = {r.request_id for r in running}
            self._memo = {k: v for k, v in memo.items() if k[0] in live}
        return out

    # -- per batch -----------------------------------------------------------
    def allocate(self) -> dict[str, Decision]:
        """The step's decisions: :meth:`_allocate` on the batch's true options,
        or its last answer while the batch and its options are unchanged."""
        w = self.worker
        running = w.running
        b = len(running)
        if b == 0:
            return {}
        ctx = np.array([r.prompt_len + r.generated for r in running], dtype=np.float64)
        q = w.rank_probs(running, self.now)  # exactly what the step samples from, hidden span states included
        self.alpha1_sum += float(q[:, 0, 0].sum())
        self.alpha1_n += b
        options = self.batch_lists(q)
        last = self._last
        if (last is not None and last[2] < REUSE_STEPS and len(last[0]) == b
                and all(x is y for x, y in zip(last[0], options))):
            self._last = (last[0], last[1], last[2] + 1)
            return last[1]
        out = self._allocate(options, ctx)
        self._last = (options, out, 1)
        return out

    def _allocate(self, options: list[RequestOptions], ctx: np.ndarray) -> dict[str, Decision]:
        """Best (depth cap, TETRIS prefix) or uniform static allocation for the batch, priced exactly.

        For each batch-wide depth cap ``L`` — a draft level is one forward for
        the whole batch, so whether a level is opened at all is the decision
        that matters — every request's node list is its best-first tree capped
        at ``L``; the lists are merged by value and every prefix is priced with
        the true cost. Each static grid decision given to every request is
        priced the same way. The best of all wins (a static one only when it
        scores strictly higher).
        """
        running = self.worker.running
        b = len(running)
        packed = np.stack([o.lists for o in options])  # [B, L, 3N + 3]
        n = self.max_nodes
        values_all = packed[:, :, :n]  # [B, L, N]
        depth_all = packed[:, :, n : 2 * n + 1].astype(np.int64)  # [B, L, N + 1]
        width_all = packed[:, :, 2 * n + 1 : 3 * n + 2]
        count_all = packed[:, :, 3 * n + 2].astype(np.int64)  # [B, L]
        kv = float(ctx.sum())
        # Caps above the deepest list in the batch repeat the deepest one.
        caps = max(1, int(depth_all[np.arange(b)[:, None], np.arange(self.max_depth)[None, :], count_all].max()))
        values_all, depth_all = values_all[:, :caps], depth_all[:, :caps]
        width_all, count_all = width_all[:, :caps], count_all[:, :caps]
        # All caps at once: [cap, candidate] arrays, candidates of each cap in
        # merged order (stable within a request, whose values do not increase).
        vals = values_all.transpose(1, 0, 2).reshape(caps, b * n)  # [cap, B·N]
        valid = (np.arange(n)[None, None, :] < count_all.T[:, :, None]).reshape(caps, b * n)
        if self.cost.roofline:
            # Exact pruning: past the roofline's kink a node costs at least one
            # token of verify compute (``token_ms``), and the best ratio is at
            # least the ratio with no speculation, ``r_off``; a node worth less than
            # ``r_off · token_ms`` there would lower the ratio, so it is never in
            # the best prefix. Below the kink nodes are free to verify: all stay.
            r_off = b / float(self.cost.verify_ms(float(b), kv, kv, batch=b))
            below_kink = max(0, int(self.cost.memory_ms(kv) / self.cost.token_ms) - b + 1)
            worth = valid & (vals >= r_off * self.cost.token_ms)
            if below_kink == 0:
                valid = worth
            n_keep = max(1, min(MAX_CANDIDATES, below_kink + int(worth.sum(axis=1).max())))
        else:
            # A measured truth has no kink and no per-token floor: every prefix
            # of the best MAX_CANDIDATES nodes is priced.
            n_keep = max(1, min(MAX_CANDIDATES, int(valid.sum(axis=1).max())))
        # Sort key: value, then position (a request's nodes keep their order, so
        # every prefix of the merged ranking holds a prefix of each request's list).
        keys = np.where(valid, -vals, np.inf) + np.arange(b * n) * 1e-12
        if n_keep < b * n:
            top = np.argpartition(keys, n_keep - 1, axis=1)[:, :n_keep]
            order = np.take_along_axis(top, np.argsort(np.take_along_axis(keys, top, axis=1), axis=1), axis=1)
        else:
            order = np.argsort(keys, axis=1)  # [cap, P]
        n_valid = np.minimum(valid.sum(axis=1), order.shape[1])  # [cap]
        i, m, step_ms, _ = prefix_step_ms(self.cost, order, n, depth_all, width_all, ctx, kv, b)
        n_cand = order.shape[1]
        taken = np.arange(n_cand + 1)
        in_list = np.arange(n_cand)[None, :] < n_valid[:, None]
        tokens = np.full((caps, n_cand + 1), float(b))
        np.cumsum(np.take_along_axis(vals, order, axis=1) * in_list, axis=1, out=tokens[:, 1:])
        tokens[:, 1:] += b
        score = tokens / step_ms
        score[taken[None, :] > n_valid[:, None]] = -np.inf
        flat = int(np.argmax(score))
        cap_index, p = divmod(flat, score.shape[1])
        best = float(score.flat[flat])
        static = self._best_static(options, ctx, kv)
        if static is not None and static[1] > best:
            decision = self.static_decisions[static[0]]
            return {r.request_id: decision for r in running}
        if not np.isfinite(best):
            return {}
        cap, chosen = cap_index + 1, i[cap_index, :p]
        held = np.bincount(chosen, minlength=b)
        out = {}
        for k, r in enumerate(running):
            m = int(held[k])
            if m:
                out[r.request_id] = Decision(int(depth_all[k, cap - 1, m]), int(width_all[k, cap - 1, m]), m)
        return out

    def _best_static(self, options: list[RequestOptions], ctx: np.ndarray, kv: float) -> tuple[int, float] | None:
        """(index, expected goodput) of the best static decision given to every request
        (``None`` without a static grid)."""
        if not self.static_decisions:
            return None
        tokens, step_ms = self.static_prices(options, ctx, kv)
        score = tokens / step_ms
        s = int(np.argmax(score))
        return s, float(score[s])

    def static_prices(self, options: list[RequestOptions], ctx: np.ndarray, kv: float) -> tuple[np.ndarray, np.ndarray]:
        """Per static decision given to every request: the step's expected tokens and its
        noise-free ms, as the simulator will charge the trees it builds."""
        b = len(options)
        st = np.stack([o.statics for o in options], axis=1)  # [S, B, 4]
        value, nodes, depth, width = st[..., 0], st[..., 1], st[..., 2], st[..., 3]
        verify = self.cost.verify_ms(b + nodes.sum(axis=1), kv, kv + (nodes * ctx).sum(axis=1), batch=b)
        on = depth[..., None] >= np.arange(1, max(1, int(depth.max())) + 1)  # [S, B, level]
        draft = self.cost.draft_levels_ms(on.sum(axis=1), (width[..., None] * on).sum(axis=1),
                                          (ctx[None, :, None] * on).sum(axis=1))
        return b + value.sum(axis=1), verify + draft

    @property
    def mean_true_alpha1(self) -> float:
        return self.alpha1_sum / self.alpha1_n if self.alpha1_n else float("nan")


# Ranking boosts a class with a TPOT target gets in the class oracle's node order (np.inf: all
# its nodes before any other class's); classes without a target keep 1. See ClassOracleDecider.
DEFAULT_TARGET_BOOSTS = (1.0, 3.0, 10.0, np.inf)
MAX_BOOST_VECTORS = 64  # boost combinations searched per step (several target classes)
MAX_STATIC_COMBOS = 50_000  # per-class static allocations priced per step, at most
QUANTILES = {"p50": 0.5, "p99": 0.99}
# Candidate nodes per depth cap in the class oracle's prefixes (the best by boosted weighted
# value). Past a few hundred batch tokens a GPU is compute-bound and every node costs a
# token's compute: 512 draft nodes on top of the batch's own tokens cost an 8B model on an
# H200 ~24 ms, more than the plain step of its largest batch.
MAX_CLASS_CANDIDATES = 512


def inverse_quantile(tok: np.ndarray, q: float) -> np.ndarray:
    """``np.quantile(1 / tok, q, axis=-1)`` (linear interpolation), from two order statistics.

    ``1 / x`` reverses the order, so the ``q`` quantile of ``1 / tok`` sits
    between the ``m - 1 - lo`` and ``m - 2 - lo`` smallest ``tok`` (``lo =
    floor((m - 1) q)``): a partition instead of a sort, the class oracle's
    hottest line.

    >>> x = np.array([[1.0, 2.0, 4.0, 3.0], [1.5, 1.2, 9.0, 2.0]])
    >>> bool(np.allclose(inverse_quantile(x, 0.99), np.quantile(1 / x, 0.99, axis=-1)))
    True
    >>> bool(np.allclose(inverse_quantile(x, 0.5), np.quantile(1 / x, 0.5, axis=-1)))
    True
    """
    m = tok.shape[-1]
    h = (m - 1) * q
    lo = int(math.floor(h))
    frac = h - lo
    hi_rank = m - 1 - lo  # the tok whose inverse is the lo-th largest... (ascending order statistic)
    if frac <= 0 or lo + 1 > m - 1:
        return 1.0 / np.partition(tok, hi_rank, axis=-1)[..., hi_rank]
    part = np.partition(tok, (hi_rank - 1, hi_rank), axis=-1)
    y_lo = 1.0 / part[..., hi_rank]
    y_hi = 1.0 / part[..., hi_rank - 1]
    return y_lo + frac * (y_hi - y_lo)


@dataclass(frozen=True)
class ClassChoice:
    """What the class oracle chose for one step (for diagnostics and tests).

    ``score``: expected weighted tokens per ms of step time; ``step_ms``:
    the noise-free step time; ``tpot_ms``: per class with a target, the
    class's quantile over its running requests of ``step_ms / (1 + E[τ_i])``;
    ``feasible``: every such class under its target; ``kind``: ``prefix`` or
    ``static``.
    """

    score: float
    step_ms: float
    tpot_ms: dict[str, float]
    feasible: bool
    kind: str


class ClassOracleDecider(OracleDecider):
    """The oracle with request classes: maximise weighted goodput subject to TPOT targets, per step.

    Objective, per step: ``Σ_i w_c(i) · E[τ_i + 1] / step_ms`` (the classes'
    weights), subject to, for every class ``c`` with a TPOT target, the
    class's target quantile (p50 / p99) over its running requests of their
    expected time per token this step, ``step_ms / E[τ_i + 1]``, staying at or
    under ``tpot_target_ms``. A request's TPOT is its step times over its
    tokens, so a request whose every step meets that bound meets it over its
    life (``Σ a / Σ b <= max a / b``), up to sampling noise: the per-step
    bound is the class's target made causal. The truth is the single-class
    oracle's: each request's exact ``q`` (span states included) and the noise-
    free cost of every candidate batch shape.

    Candidates, every one priced exactly for this batch:

    - **weighted prefixes**: for each vector of ranking boosts (a class with a
      target is boosted by each of :data:`DEFAULT_TARGET_BOOSTS`, ``inf`` =
      all its nodes first; one vector per combination) and each batch-wide
      depth cap, every request's best-first node list merged by
      ``boost_c · w_c · value`` and every prefix of the merged order (a
      request). Boost 1 is plain weighted TETRIS, the unconstrained optimum's
      order; larger boosts let a class under a target buy depth first while
      the others give way, down to speculation off for them. A prefix in
      which some request holds more nodes than its tree's depth × width is
      left out: no ``Decision`` builds that tree (``Decision.clamp`` cuts
      ``max_nodes`` to depth × width, and the simulator clamps), so it is
      not an action;
    - **per-class static allocations**: every combination of one static grid
      decision (or off) per class, each class's requests all given it.

    The best feasible candidate by weighted score wins; when no candidate
    meets every target (a step whose plain decode is already slower than a
    target), the one with the smallest worst ratio of a class's TPOT to its
    target, then the highest score. The single-class oracle's candidates
    (value-ordered prefixes, uniform static trees) are the boost-1 prefixes of
    a one-weight class set and the static combinations with every class
    alike, so with one class this reduces to it (the benchmark keeps the
    single-class :class:`OracleDecider` for scenarios without classes).

    Ceiling: among allocations that meet the per-step targets it is the best
    of a family that holds every per-class uniform allocation of the static
    grid and the Lagrangian family of per-request allocations (a multiplier
    on a class's tokens is a boost of its nodes' value), with the exact
    acceptance and cost and no plan delay. A per-request allocation outside
    that family (a policy's probes, or a cap per class rather than per
    batch) could in principle score higher on a step; the benchmark reports
    the ratio, so a policy above 1.0 would show.

    Parameters
    ----------
    worker
        The simulated worker whose truth it reads (its requests carry classes).
    classes
        The policy file's classes (:class:`policies.classes.ClassSet`).
    static_grid
        As :class:`OracleDecider`'s.
    boosts
        Ranking boosts of a class with a target (see above).
    """

    def __init__(self, worker: SimWorker, classes: ClassSet, static_grid: Sequence[tuple[int, int]] | None = None,
                 boosts: Sequence[float] = DEFAULT_TARGET_BOOSTS) -> None:
        super().__init__(worker, static_grid)
        self.classes = classes
        self.weights = np.array([c.weight for c in classes], dtype=np.float64)
        self.targets = np.array([c.tpot_target_ms if c.has_target else np.inf for c in classes], dtype=np.float64)
        self.quantiles = np.array([QUANTILES[c.tpot_quantile] for c in classes], dtype=np.float64)
        targeted = [k for k, c in enumerate(classes) if c.has_target]
        vectors = []
        for combo in itertools.product(tuple(boosts), repeat=len(targeted)):
            v = np.ones(len(classes))
            v[targeted] = combo
            vectors.append(v)
        self.boost_vectors = vectors[:MAX_BOOST_VECTORS]
        self.last_choice: ClassChoice | None = None
        self.steps = 0  # steps allocated (not reused) ...
        self.steps_feasible = 0  # ... and of those, steps whose choice met every target

    def _allocate(self, options: list[RequestOptions], ctx: np.ndarray) -> dict[str, Decision]:
        running = self.worker.running
        cls = np.array([self.classes.index(r.request_class) for r in running], dtype=np.int64)
        best: list = [None]  # (feasible, -violation or score, score, payload)

        def offer(viol: np.ndarray, score: np.ndarray, payload) -> None:
            """Keep the best of these candidates (``payload(flat index)`` builds its answer)."""
            viol = viol.ravel()
            score = score.ravel()
            ok = viol <= 1.0 + 1e-12
            if ok.any():
                k = int(np.argmax(np.where(ok, score, -np.inf)))
                key = (1, float(score[k]), 0.0)
            else:
                worst = float(viol.min())
                k = int(np.argmax(np.where(viol <= worst * (1 + 1e-12), score, -np.inf)))
                key = (0, -worst, float(score[k]))
            if not np.isfinite(score[k]):
                return
            if best[0] is None or key > best[0][0]:
                best[0] = (key, k, payload)

        base = self._prefix_base(options, ctx, cls)
        for boost in self.boost_vectors:
            self._prefix_candidates(base, boost, offer)
        self._static_candidates(options, ctx, cls, offer)
        if best[0] is None:
            return {}
        _, k, payload = best[0]
        decisions, choice = payload(k)
        self.last_choice = choice
        self.steps += 1
        self.steps_feasible += choice.feasible
        return decisions

    def _violation(self, step_ms: np.ndarray, tok: np.ndarray, cls: np.ndarray,
                   tpot: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Worst ratio over classes with a target of the class's TPOT quantile to its target.

        ``step_ms`` [...], ``tok`` [..., B'] expected tokens of the requests in
        classes with a target (``cls`` their classes, in column order).
        """
        viol = np.zeros(np.shape(step_ms))
        for k, c in enumerate(self.classes):
            cols = np.flatnonzero(cls == k)
            if not c.has_target or not cols.size:
                continue
            t = step_ms * inverse_quantile(tok[..., cols], self.quantiles[k])  # per-token time = step_ms / tok
            if tpot is not None:
                tpot[c.name] = t
            viol = np.maximum(viol, t / self.targets[k])
        return viol

    def _prefix_base(self, options: list[RequestOptions], ctx: np.ndarray, cls: np.ndarray) -> dict:
        """The batch's node lists as arrays, shared by every boost vector's prefixes."""
        b = len(options)
        packed = np.stack([o.lists for o in options])  # [B, L, 3N + 3]
        n = self.max_nodes
        depth_all = packed[:, :, n : 2 * n + 1].astype(np.int64)
        count_all = packed[:, :, 3 * n + 2].astype(np.int64)
        caps = max(1, int(depth_all[np.arange(b)[:, None], np.arange(self.max_depth)[None, :], count_all].max()))
        vals = packed[:, :caps, :n].transpose(1, 0, 2).reshape(caps, b * n)  # raw E[accepted] per node
        valid = (np.arange(n)[None, None, :] < count_all[:, :caps].T[:, :, None]).reshape(caps, b * n)
        return {"b": b, "n": n, "caps": caps, "vals": vals, "valid": valid, "owner": np.repeat(np.arange(b), n),
                "depth_all": depth_all[:, :caps], "width_all": packed[:, :caps, 2 * n + 1 : 3 * n + 2],
                "count_all": count_all[:, :caps], "ctx": ctx, "kv": float(ctx.sum()), "cls": cls,
                "tracked": np.flatnonzero(np.isfinite(self.targets[cls]))}

    def _order(self, base: dict, boost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([cap, P] candidate indices in merged order, [cap] how many are real nodes) for one boost vector.

        Order: boosted-first classes (``inf``), then ``boost · weight · value``
        descending, then list position. Only the best :data:`MAX_CLASS_CANDIDATES`
        per cap are sorted: picked by a partition, then widened to whole prefixes
        of each request's list (a tie at the cut could leave a request's later
        node in and an equal earlier one out; its first ``k`` nodes are worth at
        least as much), then sorted exactly.
        """
        b, n, caps = base["b"], base["n"], base["caps"]
        vals, valid, owner, cls = base["vals"], base["valid"], base["owner"], base["cls"]
        bst = boost[cls]
        first = np.isinf(bst)
        rank = vals * (self.weights[cls] * np.where(first, 1.0, bst))[owner]
        tier = np.where(first, 1.0, 0.0)[owner]
        span = float(rank.max(initial=0.0)) + 1.0
        key = np.where(valid, rank + tier * span, -1.0)  # a real node's key > 0 >= an empty slot's
        n_valid = valid.sum(axis=1)
        n_keep = max(1, min(MAX_CLASS_CANDIDATES, int(n_valid.max())))
        if n_keep < b * n:
            top = np.argpartition(-key, n_keep - 1, axis=1)[:, :n_keep]
            rows = np.arange(caps)[:, None]
            keep = np.zeros((caps, b * n), dtype=bool)
            keep[rows, top] = True
            keep &= valid
            held = keep.reshape(caps, b, n).sum(axis=2)  # nodes of each request among the best
            keep = (np.arange(n)[None, None, :] < held[:, :, None]).reshape(caps, b * n)
            # The kept nodes (at most n_keep per cap) gathered, padded with others, then sorted exactly.
            cand = np.argpartition(~keep, n_keep - 1, axis=1)[:, :n_keep]
        else:
            keep = valid
            cand = np.broadcast_to(np.arange(b * n), (caps, b * n))
        ck = np.take_along_axis(key, cand, axis=1)
        cv = np.take_along_axis(keep, cand, axis=1)
        order = np.take_along_axis(cand, np.lexsort((cand, -ck, ~cv), axis=-1), axis=1)
        return order, keep.sum(axis=1)

    def _prefix_candidates(self, base: dict, boost: np.ndarray, offer) -> None:
        """Every prefix of the boosted, weighted node order under every depth cap (see the class docstring)."""
        running = self.worker.running
        b, n, caps, ctx, kv, cls = base["b"], base["n"], base["caps"], base["ctx"], base["kv"], base["cls"]
        depth_all, width_all, vals, tracked = base["depth_all"], base["width_all"], base["vals"], base["tracked"]
        w = self.weights[cls]
        order, n_valid = self._order(base, boost)
        i, m, step_ms, overfull = prefix_step_ms(self.cost, order, n, depth_all, width_all, ctx, kv, b)
        p_n = order.shape[1]
        taken = np.arange(p_n + 1)
        in_list = np.arange(p_n)[None, :] < n_valid[:, None]
        picked = np.take_along_axis(vals, order, axis=1) * in_list  # [cap, P] raw value of each taken node
        weighted = np.full((caps, p_n + 1), float(w.sum()))
        np.cumsum(picked * w[i], axis=1, out=weighted[:, 1:])
        weighted[:, 1:] += w.sum()
        score = weighted / step_ms
        score[taken[None, :] > n_valid[:, None]] = -np.inf
        # A request holding more nodes than depth x width of its tree has no Decision that builds
        # that tree (Decision.clamp cuts max_nodes to depth x width): such prefixes are not actions.
        score[overfull > 0.5] = -np.inf
        # Expected tokens per request of a class with a target, after each prefix: [cap, P + 1, B'].
        tok = None
        if tracked.size:
            column = np.full(b, -1)
            column[tracked] = np.arange(tracked.size)
            col = column[i]  # [cap, P]
            add = np.zeros((caps, p_n, tracked.size))
            hit = (col >= 0) & in_list
            cc, pp = np.nonzero(hit)
            add[cc, pp, col[hit]] = picked[hit]
            tok = np.ones((caps, p_n + 1, tracked.size))
            np.cumsum(add, axis=1, out=tok[:, 1:])
            tok[:, 1:] += 1.0
            viol = self._violation(step_ms, tok, cls[tracked])
        else:
            viol = np.zeros_like(step_ms)
        viol = np.where(np.isfinite(score), viol, np.inf)

        def payload(k: int):
            cap_index, p = divmod(k, p_n + 1)
            cap, chosen = cap_index + 1, i[cap_index, :p]
            held = np.bincount(chosen, minlength=b)
            out = {}
            for j, r in enumerate(running):
                mj = int(held[j])
                if mj:
                    out[r.request_id] = Decision(int(depth_all[j, cap - 1, mj]), int(width_all[j, cap - 1, mj]), mj)
            tpot: dict[str, np.ndarray] = {}
            v = 0.0
            if tok is not None:
                v = float(self._violation(step_ms[cap_index, p], tok[cap_index, p], cls[tracked], tpot))
            return out, ClassChoice(float(score[cap_index, p]), float(step_ms[cap_index, p]),
                                    {k2: float(t) for k2, t in tpot.items()}, v <= 1.0 + 1e-12, "prefix")

        offer(viol, score, payload)

    def _static_candidates(self, options, ctx, cls, offer) -> None:
        """Every combination of one static decision (or off) per class present in the batch."""
        if not self.static_decisions:
            return
        running = self.worker.running
        b = len(running)
        kv = float(ctx.sum())
        st = np.stack([o.statics for o in options], axis=1)  # [S, B, 4]
        st = np.concatenate([np.zeros((1, b, 4)), st], axis=0)  # row 0: off
        value, nodes, depth, width = st[..., 0], st[..., 1], st[..., 2], st[..., 3]
        n_levels = max(1, int(depth.max()))
        on = depth[..., None] >= np.arange(1, n_levels + 1)  # [S', B, level]
        present = [k for k in range(len(self.classes)) if (cls == k).any()]
        n_s = value.shape[0]
        if n_s ** len(present) > MAX_STATIC_COMBOS:
            return
        shape = [n_s] * len(present)
        nodes_sum = np.zeros(shape)
        attn_sum = np.zeros(shape)
        weighted = np.zeros(shape)
        count = np.zeros(shape + [n_levels])
        width_sum = np.zeros_like(count)
        kv_l = np.zeros_like(count)
        per_class = []  # (class index, axis, [S', members] expected tokens)
        for axis, k in enumerate(present):
            members = cls == k
            view = [1] * len(present)
            view[axis] = n_s
            nodes_sum = nodes_sum + nodes[:, members].sum(axis=1).reshape(view)
            attn_sum = attn_sum + (nodes[:, members] * ctx[members]).sum(axis=1).reshape(view)
            tok = 1.0 + value[:, members]
            weighted = weighted + (self.weights[k] * tok.sum(axis=1)).reshape(view)
            lv = view + [n_levels]
            count = count + on[:, members].sum(axis=1).reshape(lv)
            width_sum = width_sum + (width[:, members, None] * on[:, members]).sum(axis=1).reshape(lv)
            kv_l = kv_l + (ctx[members][None, :, None] * on[:, members]).sum(axis=1).reshape(lv)
            per_class.append((k, axis, tok))
        step_ms = (self.cost.verify_ms(b + nodes_sum, kv, kv + attn_sum, batch=b)
                   + self.cost.draft_levels_ms(count, width_sum, kv_l))
        score = weighted / step_ms
        viol = np.zeros(shape)
        factors = {}
        for k, axis, tok in per_class:
            c = self.classes.classes[k]
            if not c.has_target:
                continue
            view = [1] * len(present)
            view[axis] = n_s
            inv = inverse_quantile(tok, self.quantiles[k])  # [S']
            factors[c.name] = (axis, inv)
            viol = np.maximum(viol, step_ms * inv.reshape(view) / self.targets[k])

        def payload(flat: int):
            idx = np.unravel_index(flat, shape)
            pick = {k: int(idx[axis]) for k, axis, _ in per_class}
            out = {}
            for j, r in enumerate(running):
                s = pick[int(cls[j])]
                if s:
                    out[r.request_id] = self.static_decisions[s - 1]
            ms = float(step_ms[idx])
            tpot = {name: ms * float(inv[idx[axis]]) for name, (axis, inv) in factors.items()}
            return out, ClassChoice(float(score[idx]), ms, tpot, float(viol[idx]) <= 1.0 + 1e-12, "static")

        offer(viol, score, payload)


def oracle_factory() -> Callable[[SimWorker], OracleDecider]:
    return OracleDecider
