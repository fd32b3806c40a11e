"""The benchmark's ceiling: per-step goodput-optimal decisions from the truth.

:class:`OracleDecider` sits where a worker's agent sits (``decide(request_id,
context_len, batch_size)``), but instead of a plan it reads the simulator
itself:

- the **true acceptance** of every running request at the step's start time
  (``worker.acceptance.rank_probs_batch`` — the same ``q[k, r]`` the
  simulator samples outcomes from: context decay, domain drift, the
  request's own predictability multiplier), and
- the **true step cost** (``worker.cost``, the roofline the simulator charges:
  verify with attention pairs, EAGLE's per-level draft forwards or Medusa's
  single pass), noise-free.

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
exactly by the simulator's own :class:`worker.sim.hardware.CostModel` for
*this* batch (its real context lengths, deepest level, tree widths,
attention pairs). The best (cap, prefix) wins; it is reused while the batch
and its requests' tree values stay the same (:data:`REUSE_STEPS`).

Why nothing causal can beat it (up to sampling noise): it chooses from the
same action space as every policy — per-request depth, width, node budget,
on/off, any step — but with information no causal policy has: the exact
acceptance probability of each request *now* (a causal policy only has
estimates learned from past, censored outcomes, pooled per context bucket,
lagging behind drift) and the exact cost of each candidate batch shape (a
causal policy has a fitted model); and it decides every step with no plan
delivery delay. Given the batch, its choice maximises the step's expected
goodput. What could still let a policy edge past it on one run: luckier
outcome draws, and queueing feedback the per-step optimum ignores (how this
step's speed reshapes later batches). The per-step ratio is used rather than
a fleet-wide ``E[tokens] − λ·time`` (Dinkelbach) for that reason: with λ the
run's average, bursts would overspend on speculation while the queue grows.
The benchmark reports the ratio to the oracle, so a policy above 1.0 would show.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from policies.goodput import capped_node_lists
from policies.table import Decision
from worker.sim.tree import CONF_SCALE, quantize
from worker.sim.worker import SimWorker

MAX_CANDIDATES = 4096  # nodes considered per step (the best by value); far more than any batch can use
# An allocation is reused while the batch and every request's node list stay the same
# (the lists are keyed by the 1/256-quantised q), for at most this many steps: in
# between only the KV read grows, by a few tokens per request per step, which moves
# a step's price by far less than its 3 % timing noise.
REUSE_STEPS = 32


class OracleDecider:
    """``decide`` callable for one :class:`SimWorker` that knows the truth.

    Call :meth:`begin_step` with the step's start time before each
    ``worker.step``; the first ``decide`` of the step allocates the whole
    batch, the others read the answer.
    """

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.cost = worker.cost  # the simulator's own roofline, priced noise-free
        self.max_depth, self.max_width, self.max_nodes = worker.max_depth, worker.max_width, worker.max_nodes
        self.now = 0.0
        self.fresh = True
        self.decisions: dict[str, Decision] = {}
        self._cache: dict[bytes, np.ndarray] = {}
        self._memo: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[list[np.ndarray], dict[str, Decision], int] | None = None  # lists, answer, steps used
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
        qconf = quantize(q)
        key = qconf.tobytes()
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 20_000:
                self._cache.clear()
            conf = qconf / CONF_SCALE  # the simulator builds its trees from these confidences
            n = self.max_nodes
            hit = np.zeros((self.max_depth, 3 * n + 3))
            for cap, nodes in enumerate(capped_node_lists(conf, self.max_depth, self.max_width, n)):
                k = len(nodes.values)
                row = hit[cap]
                row[:k] = nodes.values
                row[n : n + k + 1] = nodes.depth
                row[2 * n + 1 : 2 * n + k + 2] = nodes.width
                row[3 * n + 2] = k
            self._cache[key] = hit
        return hit

    def batch_lists(self, q: np.ndarray) -> list[np.ndarray]:
        """:meth:`node_lists` of every running request (``q``: [batch, depth, width]),
        each reused while its ``q`` stays within half a confidence quantum of the one
        its lists were built for (context grows a few tokens a step; ``q`` moves far
        slower than that)."""
        running = self.worker.running
        memo = self._memo
        refs = [memo.get(r.request_id) for r in running]
        known = [i for i, ref in enumerate(refs) if ref is not None]
        fresh = np.ones(len(running), dtype=bool)
        if known:
            drift = np.abs(np.stack([refs[i][0] for i in known]) - q[known]).reshape(len(known), -1).max(axis=1)
            fresh[known] = drift >= 0.5 / CONF_SCALE
        out = []
        for i, r in enumerate(running):
            if fresh[i]:
                lists = self.node_lists(q[i])
                memo[r.request_id] = (q[i], lists)
                out.append(lists)
            else:
                out.append(refs[i][1])
        if len(memo) > 4096:
            live = {r.request_id for r in running}
            self._memo = {k: v for k, v in memo.items() if k in live}
        return out

    # -- per batch -----------------------------------------------------------
    def allocate(self) -> dict[str, Decision]:
        """The step's decisions: :meth:`_allocate` on the batch's true node lists,
        or its last answer while the batch and its lists are unchanged."""
        w = self.worker
        running = w.running
        b = len(running)
        if b == 0:
            return {}
        ctx = np.array([r.prompt_len + r.generated for r in running], dtype=np.float64)
        factors: dict[str, float] = {}
        dom = np.array([factors.setdefault(r.domain, w.acceptance.domain_factor(r.domain, self.now)) for r in running])
        q = w.acceptance.rank_probs_batch(ctx, dom, np.array([r.multiplier for r in running]))
        self.alpha1_sum += float(q[:, 0, 0].sum())
        self.alpha1_n += b
        lists = self.batch_lists(q)
        last = self._last
        if (last is not None and last[2] < REUSE_STEPS and len(last[0]) == b
                and all(x is y for x, y in zip(last[0], lists))):
            self._last = (last[0], last[1], last[2] + 1)
            return last[1]
        out = self._allocate(lists, ctx)
        self._last = (lists, out, 1)
        return out

    def _allocate(self, lists: list[np.ndarray], ctx: np.ndarray) -> dict[str, Decision]:
        """Best (depth cap, TETRIS prefix) for the batch, priced exactly.

        For each batch-wide depth cap ``L`` — a draft level is one forward for
        the whole batch, so whether a level is opened at all is the decision
        that matters — every request's node list is its best-first tree capped
        at ``L``; the lists are merged by value and every prefix is priced with
        the true cost. The best prefix over all caps wins.
        """
        running = self.worker.running
        b = len(running)
        packed = np.stack(lists)  # [B, L, 3N + 3]
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
        # Exact pruning: past the roofline's kink a node costs at least one
        # token of verify compute (``token_ms``), and the best ratio is at
        # least the ratio with no speculation, ``r_off``; a node worth less than
        # ``r_off · token_ms`` there would lower the ratio, so it is never in
        # the best prefix. Below the kink nodes are free to verify: all stay.
        r_off = b / float(self.cost.verify_ms(float(b), kv, kv))
        below_kink = max(0, int(self.cost.memory_ms(kv) / self.cost.token_ms) - b + 1)
        worth = valid & (vals >= r_off * self.cost.token_ms)
        if below_kink == 0:
            valid = worth
        n_keep = max(1, min(MAX_CANDIDATES, below_kink + int(worth.sum(axis=1).max())))
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
        step_ms = self.cost.verify_ms(b + taken, kv, attn) + self.cost.draft_levels_ms(count, width_sum, kv_l)
        in_list = np.arange(n_cand)[None, :] < n_valid[:, None]
        tokens = np.full((caps, n_cand + 1), float(b))
        np.cumsum(np.take_along_axis(vals, order, axis=1) * in_list, axis=1, out=tokens[:, 1:])
        tokens[:, 1:] += b
        score = tokens / step_ms
        score[taken[None, :] > n_valid[:, None]] = -np.inf
        flat = int(np.argmax(score))
        cap_index, p = divmod(flat, score.shape[1])
        best_choice = (cap_index + 1, i[cap_index, :p]) if np.isfinite(score.flat[flat]) else None
        if best_choice is None:
            return {}
        cap, chosen = best_choice
        held = np.bincount(chosen, minlength=b)
        out = {}
        for k, r in enumerate(running):
            m = int(held[k])
            if m:
                out[r.request_id] = Decision(int(depth_all[k, cap - 1, m]), int(width_all[k, cap - 1, m]), m)
        return out

    @property
    def mean_true_alpha1(self) -> float:
        return self.alpha1_sum / self.alpha1_n if self.alpha1_n else float("nan")


def oracle_factory() -> Callable[[SimWorker], OracleDecider]:
    return OracleDecider
