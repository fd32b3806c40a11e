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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

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

    def __call__(self, request_id: str, context_len: int, batch_size: int) -> Decision:
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
        step_ms = self.cost.verify_ms(b + taken, kv, attn, batch=b) + self.cost.draft_levels_ms(count, width_sum, kv_l)
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


def oracle_factory() -> Callable[[SimWorker], OracleDecider]:
    return OracleDecider
