"""The goodput policy's tables per request state (issue #28).

The pooled acceptance model gives every request the depth that suits the mix
of spans requests are in. Under correlated acceptance a request's own recent
outcomes (:mod:`policies.outcome`) tell which span it is likely in: after a
miss (``τ = 0``) the next draft is accepted far less often than the pool's,
after a full accept far more often, while resting after a miss in between.
The controller keeps, beside the pooled strict model, one acceptance model
per state (the default state's too), fed by the request-steps taken in that
state (``Observation.acceptance_by_state``), and the share of request-steps
in each state (``LoadProfile.state_share``).

**Plan.table stays the single-class plan.** The plan's ``table`` is solved
exactly as without states (pooled acceptance, every request): it is what
every request of a worker that tracks no outcomes gets, and what
``UNSPECIFIED`` means on the wire. A worker that tracks outcomes decides its
default-state requests by the table keyed :data:`~policies.outcome.OTHER`
instead, the default state's own best response like every other state's.
An earlier version re-solved ``table`` itself with a default-state model and
lost (correlated-mixed 0.94 → 0.90 of the oracle): with three states, the
default state at a burst held mostly requests a miss had just turned off
(one plain step resets a request), that model said 0.5 where the pooled one
said 0.7, and every request, tracked or not, went off and stayed off. Now
those requests rest in a state of their own, and a default-state table that
says off is no trap for the workers that do not track.

**Each state's table is a best response to it**, row by row: on the row's
representative batch (each state its share of the requests), every prefix
of the states' groups' (state, context bucket) merged best-first ranking
under every depth cap is priced with one step time for the whole batch, and
so is the baseline (every state drafting the default row). The best beats
the baseline only by ``min_gain``, and only if it still does with
``cost_caution`` standard errors on drafting batches; else the row keeps
the default decisions.

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
(With the states below, per-step pricing measured 0.963 of the oracle on
correlated-mixed against 0.967, three seeds each: no better.)

**A draft is worth the state it leads to** (:func:`chain_values`,
``_probe_pass``). Priced by its tokens, a first draft token from the default
state at a burst of 128 requests is accepted about as often as it costs, so
the default state stayed off; a request copying text then never reached
after-hit, whose table drafts, for the whole burst (on correlated-mixed the
requests inside near-copy spans drafted on 42 % of their burst steps, the
oracle's on all). The request states form a chain (a draft leads to
after-hit, after-miss or the default state; a miss rests), so each row's
decisions give every state a relative value (average-reward policy
evaluation: its tokens less the price of its nodes, against the chain's
mean), and a group the row leaves off takes its first node where that
node's tokens and the value of the state it leads to beat its price on the
whole batch (by ``min_gain``, with ``cost_caution``).

**When.** Per state and served context bucket, the state is valued with its
own acceptance only where its evidence says it differs from the pooled one:
at least :data:`MIN_STATE_EVIDENCE` request-steps behind the first position
in both, first-position acceptance apart by at least :data:`MIN_STATE_EFFECT`
and by :data:`STATE_Z` standard errors; elsewhere with the pooled
acceptance. With no state distinct anywhere (independent acceptance: a
test) nothing of this runs, and a plan whose state tables equal the default
table carries none: the plan is byte-identical to the plan without states.

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
    best_first_nodes,  # noqa: F401 (the doctests')
    decision_nodes,
    marginal_node_ms,
    observed_mix,
    prefix_step_ms,
    representative_batch_size,
    table_goodput,
)
from policies.outcome import AFTER_HIT, AFTER_MISS, DEFAULT, REST_STEPS, RESTING, STATES, table_key
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
    states, shares, estimates, distinct = [], [], [], False
    for s in STATES:
        own = by_state.get(s)
        if own is None or raw[s] <= 0:
            continue
        buckets = frozenset(c for c in served if distinct_bucket(own, obs.acceptance, c))
        distinct = distinct or bool(buckets)
        states.append(s)
        shares.append(float(raw[s]) / float(sum(raw)))
        estimates.append(StateAcceptance(own, obs.acceptance, buckets))
    if not distinct:
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
    _candidates: tuple[np.ndarray, ...] | None = field(default=None, repr=False)

    def candidates(self, n_default: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(taken, depths, gained) of every prefix and one row more (the baseline's),
        ``n_default`` columns in front for the default state's fixed groups: one
        buffer for every row, which fills those columns and the last row in place."""
        if self._candidates is None or self._candidates[0].shape[1] != n_default + len(self.groups):
            out = []
            for table, dtype in ((self.prefixes.taken, np.int64), (self.prefixes.depths, np.int64),
                                 (self.prefixes.gained, np.float64)):
                full = np.zeros((len(table) + 1, n_default + table.shape[1]), dtype=dtype)
                full[:-1, n_default:] = table
                out.append(full)
            self._candidates = tuple(out)
        return self._candidates

    def baseline(self, k: int, c: int, decision: Decision) -> NodeList:
        """State ``k``'s nodes in bucket ``c`` under the default table's ``decision``."""
        key = (k, c, decision)
        if key not in self._baseline:
            self._baseline[key] = decision_nodes(self.split.estimates[k], c, decision)
        return self._baseline[key]


def _tracked(policy: Planner, obs: Observation, split: StateSplit, served: list[int],
             pooled_lists: Sequence[Sequence[NodeList]]) -> _Tracked:
    share_c, mean_c = observed_mix(obs)
    lists = []
    for est in split.estimates:
        # Only the served buckets form groups, and where a state is valued with the pooled
        # acceptance its lists are the pooled ones (``pooled_lists[cap - 1][bucket]``).
        own = [c in served and c in est.own_buckets for c in range(len(obs.context_edges))]
        mine = policy.node_lists(obs, [est.rank_probs(c) if o else None for c, o in enumerate(own)], est)
        lists.append([[mine[cap][c] if own[c] else pooled_lists[cap][c] for c in range(len(own))]
                      for cap in range(len(mine))])
    groups = [(k, c) for k in range(len(split.states)) for c in served]
    depth = len(lists[0])
    distinct = [cap for cap in range(depth)
                if cap == 0 or any(per[cap][c] is not per[cap - 1][c] for per in lists for c in served)]
    prefixes = PrefixTable([[lists[k][cap][c] for k, c in groups] for cap in distinct])
    offer = np.array([split.estimates[k].offer_rate(c) for k, c in groups])
    return _Tracked(split, served, share_c, mean_c, groups, lists, distinct, prefixes, offer)


@dataclass
class _Row:
    """The allocation one row settled on, as :func:`prefix_step_ms` prices it: the
    default state's fixed groups first (``n_default`` of them), then the tracked groups."""

    counts: np.ndarray
    contexts: np.ndarray
    depths: np.ndarray
    taken: np.ndarray
    gained: np.ndarray
    offer: np.ndarray
    switch: np.ndarray | None
    n_default: int
    goodput_tok_s: float

    def step_ms(self, obs: Observation, caution: float, depths: np.ndarray | None = None,
                taken: np.ndarray | None = None) -> np.ndarray:
        return prefix_step_ms(self.counts, self.contexts, self.depths if depths is None else depths,
                              self.taken if taken is None else taken, obs.cost, self.offer, obs.padded_verify,
                              caution, self.switch)


def _best_response(policy: Planner, obs: Observation, tr: _Tracked, batch: float,
                   default_lists: Sequence[NodeList], default_nodes: Sequence[int],
                   switch_ms: Sequence[float] | None) -> tuple[list[Decision | None], _Row]:
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
    # The default state's groups, fixed at the default row (none when every state is tracked).
    served_d = served if d_share > 0 else []
    d_counts = np.array([batch * d_share * share_c[c] for c in served_d])
    d_taken = np.array([default_nodes[c] for c in served_d], dtype=np.int64)
    d_depths = np.array([default_lists[c].depth[default_nodes[c]] for c in served_d], dtype=np.int64)
    d_gained = np.array([default_lists[c].values[:m].sum() for c, m in zip(served_d, d_taken)])
    d_offer = np.array([obs.acceptance.offer_rate(c) for c in served_d])
    # The tracked groups: every prefix, and the baseline appended as the last candidate.
    t_counts = np.array([batch * split.share[k] * share_c[c] for k, c in tr.groups])
    default_decisions = [default_lists[c].decision(default_nodes[c]) for c in range(len(default_lists))]
    base = [tr.baseline(k, c, default_decisions[c]) for k, c in tr.groups]
    base_row = (np.array([len(n.values) for n in base]), np.array([n.depth[len(n.values)] for n in base]),
                np.array([n.values.sum() for n in base]))
    baseline = len(tr.prefixes.taken)  # the candidate after the last prefix
    counts = np.concatenate([d_counts, t_counts])
    contexts = np.concatenate([[mean_c[c] for c in served_d], [mean_c[c] for _, c in tr.groups]])
    offer = np.concatenate([d_offer, tr.offer])
    switch = None
    if switch_ms is not None:
        switch = np.concatenate([[switch_ms[c] * d_share for c in served_d],
                                 [switch_ms[c] * split.share[k] for k, c in tr.groups]])

    n_d = len(d_counts)
    taken, depths, gained = tr.candidates(n_d)  # [candidates, groups]: the default groups' columns first
    for full, fixed, base_values in zip((taken, depths, gained), (d_taken, d_depths, d_gained), base_row):
        full[:, :n_d] = fixed
        full[baseline, n_d:] = base_values

    gained_now = gained[baseline].copy()

    def priced(index: slice | list[int], caution: float) -> np.ndarray:
        step = prefix_step_ms(counts, contexts, depths[index], taken[index], obs.cost, offer, obs.padded_verify,
                              caution, switch)
        return renewal_goodput(counts, gained[index], step, gained_now)

    goodput = priced(slice(None), 0.0)
    best = int(np.argmax(goodput))
    if best != baseline:
        if goodput[best] < goodput[baseline] * (1.0 + cfg.min_gain):
            best = baseline
        elif cfg.cost_caution:
            cautious = priced([best, baseline], cfg.cost_caution)
            if cautious[0] < cautious[1]:
                best = baseline
    row = _Row(counts, contexts, depths[best].copy(), taken[best].copy(), gained[best].copy(), offer, switch, n_d,
               float(goodput[best]))
    if best == baseline:
        return [None] * len(tr.groups), row
    cap = tr.distinct[int(tr.prefixes.cap_of[best])] + 1
    out = [tr.lists[k][cap - 1][c].decision(int(m)) if n > 0 else None
           for (k, c), m, n in zip(tr.groups, row.taken[n_d:], t_counts)]
    return out, row


# --- the value of the state a decision leads to -------------------------------------------
CHAIN = (DEFAULT, AFTER_MISS, AFTER_HIT) + (RESTING,) * REST_STEPS  # chain state -> request state
REPLY_TOKENS = 256.0  # a typical reply's length: how often a request ends and a new one starts (chain_values)
_REST_FIRST = 3  # chain index of RESTING after its first plain step


@dataclass(frozen=True)
class StateStep:
    """What a request-step in one state does under its decision: ``tokens`` emitted
    (``1 + E[τ]``), the chances that it accepts every drafted level (``full``: the
    request goes to after-hit) and none (``none``: after-miss), whether it drafts
    at all, and its ``price`` in tokens (its draft nodes' share of the step time,
    times the goodput)."""

    tokens: float
    full: float
    none: float
    drafts: bool
    price: float


def step_of(nodes: NodeList, price_per_node: float) -> StateStep:
    """:class:`StateStep` of a request drafting ``nodes`` (a best-first list, every node
    taken; empty: plain) at ``price_per_node`` tokens per node.

    >>> chain = best_first_nodes(np.array([[0.9], [0.8]]), 2, 1, 2)  # values 0.9, 0.72
    >>> s = step_of(chain, 0.5)
    >>> round(s.tokens, 2), round(s.full, 2), round(s.none, 2), s.drafts, s.price
    (2.62, 0.72, 0.1, True, 1.0)
    """
    m = len(nodes.values)
    if m == 0:
        return StateStep(1.0, 0.0, 0.0, False, 0.0)
    levels = nodes.levels if len(nodes.levels) == m else np.arange(1, m + 1)
    values = nodes.values
    full = float(values[levels == levels.max()].sum())
    none = max(1.0 - float(values[levels == 1].sum()), 0.0)
    return StateStep(1.0 + float(values.sum()), min(full, 1.0), none, True, price_per_node * m)


def chain_values(steps: Sequence[StateStep]) -> np.ndarray:
    """Relative values ``h`` of the chain of request states (:data:`CHAIN`: default,
    after-miss, after-hit, then resting after 1 .. ``REST_STEPS`` plain steps), each
    state's requests doing ``steps[state]`` (indexed by request state), with
    ``h[default] = 0``: average-reward policy evaluation of what a request-step
    gains over the run's mean by being in one state rather than another.

    A drafting step leads to after-hit (every level accepted), after-miss (none)
    or the default state (part-way); a plain one after a miss starts a rest, a
    rest runs its plain steps, any other plain step is the default
    (:func:`policies.outcome.next_state`). And requests end: each token ends
    its request with chance ``1 / REPLY_TOKENS``, and the next one starts in
    the default state (without it a chain whose default state stays plain while
    after-hit and after-miss draft one level would split in two). A step is
    worth its tokens less its price; ``h`` solves ``h = r - ḡ + P h`` (``ḡ``
    the chain's mean reward).

    >>> off = StateStep(1.0, 0.0, 0.0, False, 0.0)
    >>> hit = StateStep(1.9, 0.9, 0.1, True, 0.6)  # after a hit: accepted 9 times in 10
    >>> probe = StateStep(1.6, 0.6, 0.4, True, 0.6)
    >>> h = chain_values([off, off, hit, off])  # nobody in the default state drafts: nobody reaches after-hit
    >>> round(float(h[2]), 2)  # yet a request there would gain 0.3 a step for ~10 steps
    2.81
    >>> h = chain_values([probe, off, hit, off])  # a probe from the default state leads there 6 times in 10
    >>> round(float(h[2] - h[0]), 2)  # so the default state is worth more, and after-hit less above it
    0.85
    """
    n = len(CHAIN)
    p = np.zeros((n, n))
    r = np.empty(n)
    for i, state in enumerate(CHAIN):
        st = steps[state]
        r[i] = st.tokens - st.price
        if st.drafts:
            p[i, 2] += st.full
            p[i, 1] += st.none
            p[i, 0] += max(1.0 - st.full - st.none, 0.0)
        elif state == AFTER_MISS:
            p[i, _REST_FIRST] = 1.0
        elif state == RESTING and i + 1 < n:
            p[i, i + 1] = 1.0
        else:
            p[i, 0] = 1.0
        ends = min(st.tokens / REPLY_TOKENS, 1.0)
        p[i] *= 1.0 - ends
        p[i, 0] += ends
    # Unknowns: the mean reward ḡ (in place of h[default] = 0) and h[1:].
    a = np.eye(n) - p
    a[:, 0] = 1.0
    x = np.linalg.solve(a, r)
    return np.concatenate([[0.0], x[1:]])


def continuation(h: np.ndarray, state: int, step: StateStep, plain_next: float) -> float:
    """What ``step`` taken in ``state`` is worth beyond its tokens: the value of the
    state it leads to over that of the state a plain step leads to (``plain_next``)."""
    after = step.full * h[2] + step.none * h[1] + max(1.0 - step.full - step.none, 0.0) * h[0]
    return float(after - plain_next)


def _probe_pass(policy: Planner, obs: Observation, tr: _Tracked, batch: float, row: _Row,
                decisions: list[Decision | None], default_row: Sequence[Decision]) -> list[Decision | None]:
    """Switch on, for the first node only, the tracked groups the row leaves off
    whose draft is worth its price once the state it leads to is counted
    (:func:`chain_values`).

    The row's best response values a draft by the tokens it brings now. A
    request in the default state at a burst that drafts one token is accepted
    about as often as that token costs, so it stays off, and a request copying
    text stays there for the whole burst: only a full accept moves it to
    after-hit, whose table drafts. Counted with the value of that move (the
    relative values of the states in the chain of request states under this
    row's decisions), a first node from the default state pays. Greedy, best
    first, each priced on the whole batch (its draft level included, with
    ``cost_caution``), while one clears ``min_gain`` of the row's tokens.
    """
    cfg = policy.config
    split = tr.split
    group_of = {kc: i for i, kc in enumerate(tr.groups)}
    off = [(k, c) for k, c in tr.groups  # the groups this could switch on
           if row.counts[row.n_default + group_of[(k, c)]] > 0 and row.taken[row.n_default + group_of[(k, c)]] == 0
           and len(tr.lists[k][0][c].values)]
    if not off:
        return decisions
    g_ms = row.goodput_tok_s / 1000.0  # tokens per ms of step
    node_ms = marginal_node_ms(obs.cost, batch, row.counts, row.contexts, row.taken)
    price = g_ms * node_ms
    index = {s: k for k, s in enumerate(split.states)}
    default_decisions = list(default_row)
    candidates = []
    for c in sorted({c for _, c in off}):
        steps = []
        for s in STATES:
            k = index.get(s)
            if k is None:
                nodes = decision_nodes(obs.acceptance, c, default_decisions[c])
            else:
                nodes = tr.baseline(k, c, decisions[group_of[(k, c)]] or default_decisions[c])
            steps.append(step_of(nodes, price))
        h = chain_values(steps)
        for k, cc in off:
            if cc != c:
                continue
            s, g, first = split.states[k], row.n_default + group_of[(k, c)], tr.lists[k][0][c]
            probe = step_of(NodeList(first.values[:1], first.depth[:2], first.width[:2], first.levels[:1]), price)
            if s == RESTING:  # one table for every rest step: weigh them as the chain visits them
                mass = _rest_mass(steps)
                plain_next = float(mass @ np.append(h[_REST_FIRST + 1:], h[0]))
            else:
                plain_next = h[_REST_FIRST] if s == AFTER_MISS else h[0]
            extra = probe.tokens - 1.0 + continuation(h, s, probe, plain_next)
            candidates.append((g, k, c, float(row.counts[g]) * extra, float(first.values[0])))
    if not candidates:
        return decisions
    out = list(decisions)
    taken, depths, gained = row.taken.copy(), row.depths.copy(), row.gained.copy()
    tokens_now = float(row.counts @ (1.0 + gained))
    step_now = float(row.step_ms(obs, cfg.cost_caution, depths, taken))
    while candidates:
        trial_taken = np.tile(taken, (len(candidates), 1))
        trial_depths = np.tile(depths, (len(candidates), 1))
        for j, (g, *_rest) in enumerate(candidates):
            trial_taken[j, g], trial_depths[j, g] = 1, max(int(trial_depths[j, g]), 1)
        steps_ms = row.step_ms(obs, cfg.cost_caution, trial_depths, trial_taken)
        gains = np.array([worth for *_x, worth, _v in candidates]) - g_ms * (steps_ms - step_now)
        j = int(np.argmax(gains))
        if gains[j] <= cfg.min_gain * tokens_now:
            break
        g, k, c, _worth, value = candidates.pop(j)
        taken[g], depths[g] = 1, max(int(depths[g]), 1)
        gained[g] = value
        step_now = float(steps_ms[j])
        tokens_now = float(row.counts @ (1.0 + gained))
        out[group_of[(k, c)]] = tr.lists[k][0][c].decision(1)
    return out


def _rest_mass(steps: Sequence[StateStep]) -> np.ndarray:
    """How the chain's visits to a rest spread over its steps 1 .. ``REST_STEPS``: evenly
    while a resting request stays plain; a drafting one leaves after its first."""
    if steps[RESTING].drafts:
        mass = np.zeros(REST_STEPS)
        mass[0] = 1.0
        return mass
    return np.full(REST_STEPS, 1.0 / REST_STEPS)


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
    tr = _tracked(policy, obs, split, served, lists_by_cap)
    current = bucket_index(obs.batch_edges, max(1, round(obs.load.mean_batch_size)))
    rows: list[list[tuple[Decision, ...]]] = [[] for _ in split.states]
    goodput = 0.0
    for b, (cap, nodes) in enumerate(solved):
        batch, row_switch = ((max(1.0, obs.load.mean_batch_size), switch_ms) if b == current
                             else (representative_batch_size(obs.batch_edges, b, obs.max_batch_size), None))
        decisions, row = _best_response(policy, obs, tr, batch, lists_by_cap[cap - 1], nodes, row_switch)
        default_row = table.row(b)
        decisions = _probe_pass(policy, obs, tr, batch, row, decisions, default_row)
        row_goodput = row.goodput_tok_s
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
            differing[table_key(s)] = t
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
        est = obs.acceptance_by_state.get(s, obs.acceptance)
        table = draft.table_for_state(table_key(s))
        for c in np.flatnonzero(share_c):
            d = table.lookup(max(1, round(batch)), obs.context_edges[c])
            nodes = decision_nodes(est, c, d)
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
