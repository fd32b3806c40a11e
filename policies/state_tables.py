"""The goodput policy's tables per request state (issue #28).

The pooled acceptance model gives every request the depth that suits the mix
of spans requests are in. Under correlated acceptance a request's own last
outcome (:mod:`policies.outcome`) tells which span it is likely in: after a
miss (``τ = 0``) the next draft is accepted far less often than the pool's,
after a full accept far more often. The controller keeps, beside the pooled
strict model, one acceptance model per tracked state, fed by the
request-steps taken in that state (``Observation.acceptance_by_state``), and
the share of request-steps in each state (``LoadProfile.state_share``).

**The default table stays the single-class plan.** The plan's ``table`` is
solved exactly as without states (pooled acceptance, every request). It is
what a request in the default state gets, and what every request gets from a
worker that tracks no outcomes. An earlier version re-solved it with its own
default-state model, and lost: at a burst (3 to 128 requests) the requests
in the default state were mostly those a miss had just turned off, that
model said 0.5 where the pooled one said 0.7, the default table went off and
stayed off (a request that does not draft stays in the default state), and
correlated-mixed fell from 0.94 to 0.90 of the oracle.

**Each tracked state's table is a best response to it**, row by row: on the
row's representative batch (the default state's share drafting the default
row, each tracked state its share), every prefix of the tracked groups'
(state, context bucket) merged best-first ranking under every depth cap is
priced with one step time for the whole batch, and so is the baseline (every
tracked state drafting the default row). The best beats the baseline only by
``min_gain``, and only if it still does with ``cost_caution`` standard
errors on drafting batches; else the row keeps the default decisions.

**Priced per token, not per step** (:func:`renewal_goodput`). A state stands
for a kind of text (near-copy after a full accept, text the drafter cannot
follow after a miss), whose share of a request's output the plan does not
change; how many steps it takes does. Drafting deeper for the requests after
a hit finishes their near-copy spans in fewer steps, so fewer of the batch's
steps are theirs, while the draft levels it adds are paid by every step. The
per-step goodput (``Σ (1 + τ) / step_ms`` with the request-step mix held)
counted their gain at today's share of steps: on correlated-copy it sent
depth-8 trees after a hit, steps took 9 % longer for 5 % more tokens, and
the policy fell from 0.96 to 0.92 of the oracle. Holding each group's share
of tokens instead, the goodput is ``B / (step_ms · Σ_g w_g / (1 + τ_g))``:
the same number for today's allocation, a smaller gain for the groups that
already emit many tokens a step and a larger one for those that emit few.

**When.** Per tracked state and served context bucket, the state is valued
with its own acceptance only where its evidence says it differs from the
pooled one: at least :data:`MIN_STATE_EVIDENCE` request-steps behind the
first position in both, first-position acceptance apart by at least
:data:`MIN_STATE_EFFECT` and by :data:`STATE_Z` standard errors; elsewhere
with the pooled acceptance. With no state distinct anywhere (independent
acceptance: a test) nothing of this runs, and a plan whose state tables
equal the default table carries none: the plan is byte-identical to the
plan without states.

**Request classes.** State tables are planned for a policy without request
classes only; with several classes the plan carries none (documented in
``docs/policies.md``). The protocol lets state tables refine the default
class's table (``Plan.state_tables``), so a later version may plan them per
class without a wire change.

:func:`plan_goodputs` prices two plans on the same footing, per state
when either has state tables (the controller's push hysteresis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from policies.base import AcceptanceEstimate, Observation, PlanDraft
from policies.allocation import (
    NodeList,
    PrefixTable,
    best_first_nodes,
    observed_mix,
    prefix_step_ms,
    representative_batch_size,
    table_goodput,
)
from policies.outcome import STATES, TRACKED_STATES
from policies.table import Decision, DecisionTable, bucket_index



class Planner(Protocol):
    """What the solve needs of the goodput policy (:class:`policies.goodput.GoodputPolicy`)."""

    config: Any  # GoodputConfig: min_share, min_gain, cost_caution

    def node_lists(self, obs: Observation, rank_probs: Sequence[np.ndarray | None],
                   acceptance: AcceptanceEstimate | None = None) -> list[list[NodeList]]: ...

# A state's own acceptance is used in a context bucket only when the first position has at
# least this much evidence (decayed request-steps) in the state and in the pooled model, ...
MIN_STATE_EVIDENCE = 200.0
# ... differs from the pooled one by at least this much (absolute) ...
MIN_STATE_EFFECT = 0.05
# ... and by this many standard errors of the difference.
STATE_Z = 3.0


class StateAcceptance:
    """A state's acceptance where it is distinct (``own_buckets``), the default state's elsewhere
    (implements ``policies.base.AcceptanceEstimate``)."""

    def __init__(self, own: AcceptanceEstimate, fallback: AcceptanceEstimate, own_buckets: frozenset[int]) -> None:
        self.own, self.fallback, self.own_buckets = own, fallback, own_buckets
        self.context_edges = fallback.context_edges
        self.max_depth = min(own.max_depth, fallback.max_depth)
        self.max_width = min(own.max_width, fallback.max_width)

    def _pick(self, c: int) -> AcceptanceEstimate:
        return self.own if c in self.own_buckets else self.fallback

    def rank_probs(self, context_bucket: int) -> np.ndarray:
        return self._pick(context_bucket).rank_probs(context_bucket)

    def sample_rank_probs(self, context_bucket: int, rng: np.random.Generator) -> np.ndarray:
        return self._pick(context_bucket).sample_rank_probs(context_bucket, rng)

    def effective_samples(self, context_bucket: int) -> np.ndarray:
        return self._pick(context_bucket).effective_samples(context_bucket)

    def offer_rate(self, context_bucket: int) -> float:
        return self._pick(context_bucket).offer_rate(context_bucket)

    def offer_probs(self, context_bucket: int) -> np.ndarray:
        return self._pick(context_bucket).offer_probs(context_bucket)


def first_position(est: AcceptanceEstimate, context_bucket: int) -> tuple[float, float]:
    """(mean rank-1 acceptance at position 1, evidence behind it) of one bucket."""
    return float(est.rank_probs(context_bucket)[0, 0]), float(est.effective_samples(context_bucket)[0])


def distinct_bucket(state: AcceptanceEstimate, default: AcceptanceEstimate, context_bucket: int,
                    min_evidence: float = MIN_STATE_EVIDENCE, min_effect: float = MIN_STATE_EFFECT,
                    z: float = STATE_Z) -> bool:
    """Whether ``state``'s first-position acceptance in ``context_bucket`` differs from
    ``default``'s: enough evidence in both, apart by ``min_effect`` and by ``z``
    standard errors (each a Beta mean's, ``m(1 - m) / (n + 1)``).

    >>> from types import SimpleNamespace as NS
    >>> est = lambda a, n: NS(rank_probs=lambda c: np.array([[a]]), effective_samples=lambda c: np.array([n]))
    >>> distinct_bucket(est(0.3, 500), est(0.75, 2000), 0), distinct_bucket(est(0.3, 50), est(0.75, 2000), 0)
    (True, False)
    >>> distinct_bucket(est(0.72, 2000), est(0.75, 2000), 0)  # significant, but too small to matter
    False
    """
    m_s, n_s = first_position(state, context_bucket)
    m_d, n_d = first_position(default, context_bucket)
    if n_s < min_evidence or n_d < min_evidence:
        return False
    gap = abs(m_s - m_d)
    se = math.sqrt(m_s * (1.0 - m_s) / (n_s + 1.0) + m_d * (1.0 - m_d) / (n_d + 1.0))
    return gap >= min_effect and gap >= z * se


@dataclass(frozen=True)
class StateSplit:
    """The tracked states that are distinct somewhere, each with its share of
    the batch (the default state has the rest) and the acceptance it is valued with."""

    states: tuple[int, ...]
    share: np.ndarray  # [states]: its share of request-steps
    estimates: tuple[AcceptanceEstimate, ...]

    @property
    def default_share(self) -> float:
        return max(1.0 - float(self.share.sum()), 0.0)


def state_split(obs: Observation, served: Sequence[int]) -> StateSplit | None:
    """The :class:`StateSplit` of ``obs`` over the ``served`` context buckets, or None
    when no tracked state is distinct from the pooled acceptance in any of them (or
    the controller keeps no states)."""
    by_state = obs.acceptance_by_state
    raw = obs.load.state_share
    if not by_state or len(raw) != len(STATES) or sum(raw) <= 0:
        return None
    states, shares, estimates = [], [], []
    for s in TRACKED_STATES:
        own = by_state.get(s)
        if own is None or raw[s] <= 0:
            continue
        buckets = frozenset(c for c in served if distinct_bucket(own, obs.acceptance, c))
        if buckets:
            states.append(s)
            shares.append(float(raw[s]) / float(sum(raw)))
            estimates.append(StateAcceptance(own, obs.acceptance, buckets))
    if not states:
        return None
    return StateSplit(tuple(states), np.asarray(shares), tuple(estimates))


@dataclass(frozen=True)
class StatePlan:
    """Tables of the tracked states that differ from the default table, and the
    expected goodput of the plan with them at the current batch."""

    state_tables: dict[int, DecisionTable]
    goodput_tok_s: float


@dataclass
class _Tracked:
    """What every row's best response is priced from: the tracked states' groups
    (state, served bucket), their node lists and the prefixes of their merged ranking."""

    split: StateSplit
    served: list[int]
    share_c: np.ndarray
    mean_c: np.ndarray
    groups: list[tuple[int, int]]  # (index into split.states, context bucket)
    lists: list[list[list[NodeList]]]  # [state][cap - 1][bucket]
    distinct: list[int]  # caps (0-based) at which some tracked list changes
    prefixes: PrefixTable
    offer: np.ndarray  # [groups]
    _baseline: dict = field(default_factory=dict, repr=False)

    def baseline(self, k: int, c: int, decision: Decision) -> NodeList:
        """State ``k``'s nodes in bucket ``c`` under the default table's ``decision``."""
        key = (k, c, decision)
        if key not in self._baseline:
            est = self.split.estimates[k]
            self._baseline[key] = best_first_nodes(est.rank_probs(c), decision.depth, decision.width,
                                                   decision.max_nodes if decision.depth else 0, est.offer_probs(c))
        return self._baseline[key]


def _tracked(policy: Planner, obs: Observation, split: StateSplit, served: list[int]) -> _Tracked:
    share_c, mean_c = observed_mix(obs)
    buckets = range(len(obs.context_edges))
    lists = [policy.node_lists(obs, [est.rank_probs(c) for c in buckets], est) for est in split.estimates]
    groups = [(k, c) for k in range(len(split.states)) for c in served]
    depth = len(lists[0])
    distinct = [cap for cap in range(depth) if cap == 0 or any(per[cap] is not per[cap - 1] for per in lists)]
    prefixes = PrefixTable([[lists[k][cap][c] for k, c in groups] for cap in distinct])
    offer = np.array([split.estimates[k].offer_rate(c) for k, c in groups])
    return _Tracked(split, served, share_c, mean_c, groups, lists, distinct, prefixes, offer)


def _best_response(policy: Planner, obs: Observation, tr: _Tracked, batch: float,
                   default_lists: Sequence[NodeList], default_nodes: Sequence[int],
                   switch_ms: Sequence[float] | None) -> tuple[list[Decision | None], float]:
    """One row: the tracked states' decisions (per group; None: the default table's)
    given the default state's row, and the expected goodput of the row.

    Candidates are every prefix of the tracked groups' merged ranking under every
    depth cap, and the baseline (each tracked group drafting the default row's
    decision); all are priced on the whole batch with the default groups' nodes
    fixed, by :func:`renewal_goodput`. The best wins if it beats the baseline by
    ``min_gain`` and, with ``cost_caution`` standard errors on drafting batches,
    is still no worse than the baseline; else the baseline (no state table here)."""
    cfg = policy.config
    served, share_c, mean_c, split = tr.served, tr.share_c, tr.mean_c, tr.split
    d_share = split.default_share
    # The default state's groups, fixed at the default row.
    d_counts = np.array([batch * d_share * share_c[c] for c in served])
    d_taken = np.array([default_nodes[c] for c in served], dtype=np.int64)
    d_depths = np.array([default_lists[c].depth[default_nodes[c]] for c in served], dtype=np.int64)
    d_gained = np.array([default_lists[c].values[:m].sum() for c, m in zip(served, d_taken)])
    d_offer = np.array([obs.acceptance.offer_rate(c) for c in served])
    # The tracked groups: every prefix, and the baseline appended as the last candidate.
    t_counts = np.array([batch * split.share[k] * share_c[c] for k, c in tr.groups])
    default_decisions = [default_lists[c].decision(default_nodes[c]) for c in range(len(default_lists))]
    base = [tr.baseline(k, c, default_decisions[c]) for k, c in tr.groups]
    t_taken = np.vstack([tr.prefixes.taken, [len(n.values) for n in base]])
    t_depths = np.vstack([tr.prefixes.depths, [n.depth[len(n.values)] for n in base]])
    t_gained = np.vstack([tr.prefixes.gained, [n.values.sum() for n in base]])
    rows = len(t_taken)
    baseline = rows - 1
    counts = np.concatenate([d_counts, t_counts])
    contexts = np.concatenate([[mean_c[c] for c in served], [mean_c[c] for _, c in tr.groups]])
    taken = np.hstack([np.tile(d_taken, (rows, 1)), t_taken])
    depths = np.hstack([np.tile(d_depths, (rows, 1)), t_depths])
    gained = np.hstack([np.tile(d_gained, (rows, 1)), t_gained])  # [candidates, groups] per request
    offer = np.concatenate([d_offer, tr.offer])
    switch = None
    if switch_ms is not None:
        switch = np.concatenate([[switch_ms[c] * d_share for c in served],
                                 [switch_ms[c] * split.share[k] for k, c in tr.groups]])

    def priced(rows_: slice | list[int], caution: float) -> np.ndarray:
        step = prefix_step_ms(counts, contexts, depths[rows_], taken[rows_], obs.cost, offer, obs.padded_verify,
                              caution, switch)
        return renewal_goodput(counts, gained[rows_], step, gained[baseline])

    goodput = priced(slice(None), 0.0)
    best = int(np.argmax(goodput))
    if best != baseline:
        if goodput[best] < goodput[baseline] * (1.0 + cfg.min_gain):
            best = baseline
        elif cfg.cost_caution:
            cautious = priced([best, baseline], cfg.cost_caution)
            if cautious[0] < cautious[1]:
                best = baseline
    if best == baseline:
        return [None] * len(tr.groups), float(goodput[baseline])
    cap = tr.distinct[int(tr.prefixes.cap_of[best])] + 1
    out = [tr.lists[k][cap - 1][c].decision(int(m)) if n > 0 else None
           for (k, c), m, n in zip(tr.groups, t_taken[best], t_counts)]
    return out, float(goodput[best])


def renewal_goodput(counts: np.ndarray, gained: np.ndarray, step_ms: np.ndarray,
                    gained_now: np.ndarray) -> np.ndarray:
    """Tokens per second of allocations that give group ``g`` (``counts[g]``
    requests) ``gained[..., g]`` accepted tokens per request-step at steps of
    ``step_ms[...]``, with each group's share of the *tokens* held at what it
    is under ``gained_now`` (module docstring: a state stands for a kind of
    text, whose share of the output the plan does not change).

    A group of token share ``w_g`` emitting ``1 + τ_g`` tokens per step holds
    ``w_g / (1 + τ_g)`` of the request-steps per token, so the goodput is
    ``B / (step_ms · Σ_g w_g / (1 + τ_g))`` with ``B = Σ counts``; at
    ``gained_now`` it is the per-step goodput ``Σ n_g (1 + τ_g) / step_ms``.

    Two more tokens for a request already at five a step are worth less than
    one more for a request at one (per step the first looks better, 8 against
    7 tokens): the fast one's text is over in fewer steps either way.

    >>> n, now = np.array([1.0, 1.0]), np.array([4.0, 0.0])  # a request at 5 tokens a step, one at 1
    >>> [round(float(x)) for x in renewal_goodput(n, np.array([now, [6.0, 0.0], [4.0, 1.0]]), np.ones(3), now)]
    [6000, 7000, 8000]
    """
    tokens = counts * (1.0 + gained_now)
    share = tokens / max(float(tokens.sum()), 1e-12)
    per_token_steps = (share / (1.0 + gained)).sum(axis=-1)
    return float(counts.sum()) / (np.maximum(step_ms, 1e-9) * np.maximum(per_token_steps, 1e-12)) * 1000.0


def plan_state_tables(policy: Planner, obs: Observation, lists_by_cap: Sequence[Sequence[NodeList]],
                      solved: Sequence[tuple[int, Sequence[int]]], table: DecisionTable,
                      switch_ms: Sequence[float] | None = None) -> StatePlan | None:
    """The tracked states' tables given the single-class plan ``table`` (module docstring).

    ``lists_by_cap`` and ``solved`` are what the single-class solve used and
    found: the pooled node lists ``[cap - 1][bucket]`` and per batch row its
    depth cap and nodes per bucket (``table``'s rows). None when no state is
    distinct or no state's table differs from ``table``."""
    share_c, _ = observed_mix(obs)
    served = [c for c in range(len(share_c)) if share_c[c] >= policy.config.min_share]
    split = state_split(obs, served)
    if split is None:
        return None
    tr = _tracked(policy, obs, split, served)
    current = bucket_index(obs.batch_edges, max(1, round(obs.load.mean_batch_size)))
    rows: list[list[tuple[Decision, ...]]] = [[] for _ in split.states]
    goodput = 0.0
    for b, (cap, nodes) in enumerate(solved):
        batch, row_switch = ((max(1.0, obs.load.mean_batch_size), switch_ms) if b == current
                             else (representative_batch_size(obs.batch_edges, b), None))
        decisions, row_goodput = _best_response(policy, obs, tr, batch, lists_by_cap[cap - 1], nodes, row_switch)
        default_row = table.row(b)
        for k in range(len(split.states)):
            row = list(default_row)
            for (kk, c), d in zip(tr.groups, decisions):
                if kk == k and d is not None:
                    row[c] = d
            rows[k].append(tuple(row))
        if b == current:
            goodput = row_goodput
    differing = {}
    for s, r in zip(split.states, rows):
        t = DecisionTable.from_rows(r, obs.batch_edges, obs.context_edges)
        if t != table:
            differing[s] = t
    return StatePlan(differing, goodput) if differing else None


# --- pricing a plan with state tables --------------------------------------------------------
@dataclass(frozen=True)
class _PlanGroups:
    """A plan's groups (state, context bucket) on one batch: what :func:`prefix_step_ms` prices."""

    counts: np.ndarray
    contexts: np.ndarray
    gained: np.ndarray  # expected accepted tokens per request-step
    depths: np.ndarray
    taken: np.ndarray
    offer: np.ndarray

    def step_ms(self, obs: Observation) -> float:
        return float(prefix_step_ms(self.counts, self.contexts, self.depths, self.taken, obs.cost, self.offer,
                                    obs.padded_verify))


def _plan_groups(draft: PlanDraft, obs: Observation, batch: float) -> _PlanGroups:
    """``draft`` on a batch of ``batch`` requests split by the observed state shares and
    context mix, each state drafting what its table says, valued with its own
    acceptance (the pooled model for the default state and where none is kept)."""
    raw = obs.load.state_share
    share_c, means = observed_mix(obs)
    rows = []
    for s in STATES:
        share_s = raw[s] / float(sum(raw))
        if share_s <= 0:
            continue
        est = obs.acceptance_by_state.get(s, obs.acceptance) if s else obs.acceptance
        table = draft.table_for_state(s)
        for c in np.flatnonzero(share_c):
            d = table.lookup(max(1, round(batch)), obs.context_edges[c])
            nodes = best_first_nodes(est.rank_probs(c), d.depth, d.width, d.max_nodes if d.depth else 0,
                                     est.offer_probs(c))
            m = len(nodes.values)
            rows.append((batch * share_s * share_c[c], means[c], float(nodes.values.sum()), int(nodes.depth[m]), m,
                         est.offer_rate(c)))
    cols = list(zip(*rows))
    return _PlanGroups(*(np.asarray(col, dtype=np.float64 if i != 3 and i != 4 else np.int64)
                         for i, col in enumerate(cols)))


def plan_goodputs(new: PlanDraft, old: PlanDraft, obs: Observation, batch: float | None = None) -> tuple[float, float]:
    """Estimated goodput of two single-class plans on the same footing, at ``batch``
    requests (default the mean): by their tables alone
    (:func:`~policies.goodput.table_goodput`, as without states) when neither has
    state tables; else both per request state and context bucket, priced as the
    state solve prices (:func:`renewal_goodput`, token shares held at ``old``'s),
    an old plan without state tables giving every state its one table."""
    raw = obs.load.state_share
    if (not new.state_tables and not old.state_tables) or len(raw) != len(STATES) or sum(raw) <= 0:
        return table_goodput(new.table, obs, batch), table_goodput(old.table, obs, batch)
    batch = max(1.0, obs.load.mean_batch_size if batch is None else batch)
    g_new, g_old = _plan_groups(new, obs, batch), _plan_groups(old, obs, batch)
    now = g_old.gained
    return (float(renewal_goodput(g_new.counts, g_new.gained, np.asarray(g_new.step_ms(obs)), now)),
            float(renewal_goodput(g_old.counts, g_old.gained, np.asarray(g_old.step_ms(obs)), now)))
