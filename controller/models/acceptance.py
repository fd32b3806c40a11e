"""Acceptance model: Beta posteriors per stratum, position and candidate rank.

A stratum is (drafter kind, drafter version, context-length bucket); the model
never pools across strata. Within one, candidate acceptance at position ``k``
is modelled by stick-breaking: the rank-``r`` candidate is accepted with
probability ``s[k, r]`` given that position ``k`` was reached and ranks
``< r`` were not accepted, so

    q[k, r] = s[k, r] · Π_{r' < r} (1 − s[k, r'])

is the probability that rank ``r`` is the accepted one and a chain's
``α_k = s[k, 1]``. Each ``s[k, r]`` has a Beta posterior. Censoring is
handled by construction: a step only updates the (position, rank) cells it
actually offered, so positions past a rejection, depths beyond the one used
and ranks beyond the candidates offered stay untouched (the rule is
:func:`controller.drift.cells.key_trials`, shared with the drift detectors).

Forgetting keeps the model following change: the data part of every
posterior decays with a half-life in seconds of the caller's clock, and each
cell's evidence is capped, so a busy stratum still moves within a bounded
number of observations. Memory is fixed per stratum (a few ``depth × width``
arrays), and the number of drafter versions kept is bounded (LRU).

Cells a policy stops testing would otherwise keep what they knew when it
stopped: after acceptance drops the policy drafts shallower, the deep
positions keep the drop, and when acceptance recovers nothing tells them —
depth would come back only as their evidence decays, over many half-lives.
So at every :meth:`AcceptanceModel.tick` a stratum compares its reference
cell (position 1, rank 1: tested by every speculating step) with its value
at the last carry. Once it has moved by more than :data:`CARRY_CHANGE`, the
old evidence of every cell that is mostly old (new data this tick below
:data:`CARRY_FRESH` of what it held) moves its mean by the same ratio — a
change of content or mix shifts acceptance at every position of the drafter
alike — and cells with no data since the reference moved by more than
:data:`STALE_CHANGE` keep at most :data:`STALE_EVIDENCE`, so Thompson
probes re-test them soon. Well-tested cells follow their own data.

Several controller replicas share one fleet posterior per stratum
(:mod:`controller.fleet.acceptance_sync`). A posterior then carries a
:class:`ShareLedger`: at every :meth:`StratumPosterior.decay` the evidence
this replica added since the last one is folded into the ledger's pending
delta (decayed like everything else), the carry's move of old evidence is
kept apart as a local adjustment, and :meth:`StratumPosterior.install_shared`
replaces the posterior by the fleet totals plus what is still only local.
Without a ledger nothing of this runs.
"""

from __future__ import annotations


from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from controller.drift.cells import chain_key, key_trials, outcome_key

@dataclass(frozen=True)
class AcceptancePrior:
    """Beta prior on the stick probability of each rank: mean and strength."""

    rank1_mean: float = 0.6
    deeper_rank_mean: float = 0.25
    strength: float = 2.0


CARRY_CHANGE = 0.02  # relative move of the reference that mostly-old cells follow
CARRY_FRESH = 0.05  # new evidence per tick, as a share of a cell's old evidence, below which it follows
STALE_CHANGE = 0.05  # relative move since an untested cell's last data that makes it uncertain again
STALE_EVIDENCE = 50.0  # evidence (successes + failures) left in a cell made uncertain
IDLE_CATCH_UP_S = 5.0  # fleet totals this far ahead of a posterior's last decay decay it there first


class ShareLedger:
    """What one stratum's posterior holds beyond the fleet totals it last installed.

    Every array is flat (``depth × width``) and decayed to the posterior's
    ``updated_at``, like its own evidence.

    Attributes
    ----------
    pending_succ, pending_fail, pending_asked, pending_offered : np.ndarray
        Evidence this replica's workers added since the last
        :meth:`take_pending` (the delta the next merge pushes). Never
        capped: the cap applies once, to the fleet totals.
    carry_succ, carry_fail : np.ndarray
        Signed sum of the carry's moves of old evidence (module docstring).
        Each replica computes the carry from the same fleet view, so it is
        kept local, never pushed (pushed, it would count once per replica),
        and laid over the fleet totals at every install.
    external_succ, external_fail : np.ndarray
        Fleet evidence an install put among the fresh evidence since the last
        decay: fresh to the carry's rules (other replicas just tested those
        cells) but not this replica's to push.
    old_asked, old_offered : np.ndarray
        Offer counts right after the last decay or install, so that the
        next decay can tell the offers added since.
    """

    __slots__ = ("pending_succ", "pending_fail", "pending_asked", "pending_offered", "carry_succ", "carry_fail",
                 "external_succ", "external_fail", "old_asked", "old_offered")

    def __init__(self, cells: int) -> None:
        for name in self.__slots__:
            setattr(self, name, np.zeros(cells))

    def has_pending(self) -> bool:
        """True if any evidence waits to be pushed."""
        return bool(self.pending_succ.any() or self.pending_fail.any() or self.pending_asked.any())

    def take_pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The pending delta ``(succ, fail, asked, offered)``; the ledger starts a new one."""
        cells = len(self.pending_succ)
        out = (self.pending_succ, self.pending_fail, self.pending_asked, self.pending_offered)
        self.pending_succ, self.pending_fail = np.zeros(cells), np.zeros(cells)
        self.pending_asked, self.pending_offered = np.zeros(cells), np.zeros(cells)
        return out


class StratumPosterior:
    """Posterior of one stratum: ``depth × width`` stick-breaking Beta cells."""

    __slots__ = ("prior_a", "prior_b", "succ", "fail", "max_depth", "max_width", "updated_at", "observations",
                 "_old_succ", "_old_fail", "_anchor", "_carried", "asked", "offered", "ledger")

    def __init__(self, max_depth: int, max_width: int, prior: AcceptancePrior, now: float | None) -> None:
        self.max_depth = max_depth
        self.max_width = max_width
        mean = np.full((max_depth, max_width), prior.deeper_rank_mean)
        mean[:, 0] = prior.rank1_mean
        self.prior_a = mean * prior.strength
        self.prior_b = (1.0 - mean) * prior.strength
        # Flat Python lists: ingest touches a few cells per request and list
        # arithmetic is far cheaper than numpy scalar indexing on that path.
        self.succ = [0.0] * (max_depth * max_width)
        self.fail = [0.0] * (max_depth * max_width)
        self.updated_at = now  # None: no clock reading yet (created by a read), the first decay sets it
        self.observations = 0
        cells = max_depth * max_width
        self._old_succ = np.zeros(cells)  # each cell's evidence right after the last decay
        self._old_fail = np.zeros(cells)
        self._anchor = np.full(cells, np.nan)  # reference stick mean when the cell last had data
        self._carried = float("nan")  # reference stick mean at the last carry
        # Offer cells, one per (level, rank): how often a step reached the level
        # with the decision asking for that rank, and how often the drafter had
        # it (a prompt-lookup drafter offers only what its matches continue
        # with). Cell (1, 1) counts request-steps that asked for a draft at all.
        self.asked = [0.0] * cells
        self.offered = [0.0] * cells
        self.ledger: ShareLedger | None = None  # set when the model is shared with a fleet

    def observe(self, accepted_rank: Sequence[int], level_candidates: Sequence[int]) -> None:
        """Add one request-step's per-position outcome (validated upstream):
        the cells :func:`~controller.drift.cells.key_trials` says it tested."""
        self._add(key_trials((tuple(accepted_rank), tuple(level_candidates)), self.max_depth, self.max_width), 1.0)
        self.observations += 1

    def observe_chain(self, depth: int, accepted: int, count: float = 1.0) -> None:
        """``count`` chain steps of ``depth`` that accepted ``accepted`` tokens:
        positions 1..τ succeeded at rank 1, position τ+1 failed, the rest are
        censored."""
        self._add(key_trials(chain_key(accepted, depth), self.max_depth, self.max_width), count)
        self.observations += count

    def _add(self, trials: tuple[tuple[int, ...], tuple[int, ...]], count: float) -> None:
        won, lost = trials
        succ, fail = self.succ, self.fail
        for cell in won:
            succ[cell] += count
        for cell in lost:
            fail[cell] += count

    def observe_offers(self, asked: float, offered: float, level: int = 0, rank: int = 0) -> None:
        """``asked`` times the step reached ``level`` (0-based) with the
        decision asking for ``rank`` (0-based) there; ``offered`` of them the
        drafter had it. Level 0, rank 0: request-steps that asked for a draft,
        and those that got one."""
        if level < self.max_depth and rank < self.max_width:
            cell = level * self.max_width + rank
            self.asked[cell] += asked
            self.offered[cell] += offered

    def offer_rate(self) -> float:
        """P(the drafter offers a draft | the decision asks for one)."""
        return (self.offered[0] + 1.0) / (self.asked[0] + 1.0)

    def offer_probs(self) -> np.ndarray:  # [depth, width]
        """P(the drafter offers a rank-``r`` candidate at level ``k`` | the
        level is reached and the decision asks for it), i.e. P(at least
        ``r`` candidates there): one pseudo-success per cell, so a cell never
        asked about (and every cell past level 1 rank 1 of a worker that
        does not report the width it asked for) stays at 1, but no rank is
        offered more often than the rank above it."""
        asked = np.asarray(self.asked).reshape(self.max_depth, self.max_width)
        offered = np.asarray(self.offered).reshape(self.max_depth, self.max_width)
        return np.minimum.accumulate((offered + 1.0) / (asked + 1.0), axis=1)

    def decay(self, now: float, half_life_s: float, max_evidence: float) -> None:
        """Forget old evidence: mostly-old cells follow the reference (module
        docstring), then everything decays exponentially in time and each
        cell is capped."""
        dt = 0.0 if self.updated_at is None else now - self.updated_at
        factor = 0.5 ** (dt / half_life_s) if dt > 0 and half_life_s > 0 else 1.0
        self.updated_at = now if self.updated_at is None else max(self.updated_at, now)
        old_s, old_f = self._old_succ, self._old_fail
        new_s = np.maximum(np.asarray(self.succ) - old_s, 0.0)
        new_f = np.maximum(np.asarray(self.fail) - old_f, 0.0)
        a, b = self.prior_a.ravel(), self.prior_b.ravel()
        succ0, fail0 = old_s[0] + new_s[0], old_f[0] + new_f[0]
        reference = (a[0] + succ0) / (a[0] + b[0] + succ0 + fail0)
        fresh = new_s + new_f
        self._anchor[fresh > 0] = reference
        if not self._carried == self._carried:  # NaN: first tick
            self._carried = reference
        before_s, before_f = old_s, old_f  # the carry below may move old evidence: the ledger keeps the move
        ratio = reference / self._carried
        if abs(ratio - 1.0) > CARRY_CHANGE:
            old_n = old_s + old_f
            follow = (old_n > 0) & (fresh < CARRY_FRESH * old_n)
            follow[0] = False  # the reference itself
            n = a + b + old_n
            target = np.clip((a + old_s) / n * ratio, 0.005, 0.995)
            moved = np.clip(target * n - a, 0.0, old_n)  # same evidence, mean moved: (a + s') / n = target
            old_s = np.where(follow, moved, old_s)
            old_f = np.where(follow, old_n - moved, old_f)
            with np.errstate(invalid="ignore"):  # NaN anchor: a cell that never had data keeps its prior
                drifted = np.abs(reference / self._anchor - 1.0) > STALE_CHANGE
                stale = (fresh == 0) & (old_n > STALE_EVIDENCE) & drifted
            shrink = np.where(stale, STALE_EVIDENCE / np.maximum(old_n, 1e-12), 1.0)
            old_s, old_f = old_s * shrink, old_f * shrink
            self._carried = reference
        succ, fail = (old_s + new_s) * factor, (old_f + new_f) * factor
        raw_asked, raw_offered = np.asarray(self.asked), np.asarray(self.offered)
        ledger = self.ledger
        if ledger is not None:
            self._fold_ledger(ledger, new_s, new_f, old_s - before_s, old_f - before_f, raw_asked, raw_offered,
                              factor)
        asked, offered = raw_asked * factor, raw_offered * factor
        cap = np.where(asked > max_evidence, max_evidence / np.maximum(asked, 1e-12), 1.0)
        asked, offered = asked * cap, offered * cap
        self.asked, self.offered = asked.tolist(), offered.tolist()
        if ledger is not None:
            ledger.old_asked, ledger.old_offered = asked, offered
        total = succ + fail
        cap = np.where(total > max_evidence, max_evidence / np.maximum(total, 1e-12), 1.0)
        succ, fail = succ * cap, fail * cap
        if ledger is not None:
            # Carried evidence is old evidence: the cap thins it like the rest of the cell.
            ledger.carry_succ, ledger.carry_fail = ledger.carry_succ * cap, ledger.carry_fail * cap
        self._old_succ, self._old_fail = succ, fail
        self.succ, self.fail = succ.tolist(), fail.tolist()

    @staticmethod
    def _fold_ledger(ledger: ShareLedger, new_s: np.ndarray, new_f: np.ndarray, moved_s: np.ndarray,
                     moved_f: np.ndarray, asked: np.ndarray, offered: np.ndarray, factor: float) -> None:
        """At a decay: this replica's fresh evidence joins the pending delta
        (fleet evidence an install marked fresh is not its to push), the
        carry's move joins the local adjustment, and both decay as the
        posterior does."""
        own_s = np.maximum(new_s - ledger.external_succ, 0.0)
        own_f = np.maximum(new_f - ledger.external_fail, 0.0)
        ledger.pending_succ = (ledger.pending_succ + own_s) * factor
        ledger.pending_fail = (ledger.pending_fail + own_f) * factor
        ledger.pending_asked = (ledger.pending_asked + np.maximum(asked - ledger.old_asked, 0.0)) * factor
        ledger.pending_offered = (ledger.pending_offered + np.maximum(offered - ledger.old_offered, 0.0)) * factor
        ledger.carry_succ = (ledger.carry_succ + moved_s) * factor
        ledger.carry_fail = (ledger.carry_fail + moved_f) * factor
        ledger.external_succ = np.zeros_like(new_s)
        ledger.external_fail = np.zeros_like(new_f)

    def install_shared(self, succ: np.ndarray, fail: np.ndarray, asked: np.ndarray, offered: np.ndarray,
                       at: float, half_life_s: float, max_evidence: float) -> None:
        """Plan from the fleet: fleet totals plus this replica's evidence not yet in them.

        Parameters
        ----------
        succ, fail, asked, offered : np.ndarray
            The fleet totals, ``[depth, width]`` of the fleet's shape (cut
            or padded with zeros to this posterior's).
        at : float
            The time the totals are decayed to; they are brought to this
            posterior's ``updated_at`` (after decaying the posterior to
            ``at`` when it lags by more than :data:`IDLE_CATCH_UP_S`).
        half_life_s, max_evidence : float
            The model's; the cap applies to the sum as at a decay.

        Notes
        -----
        The target is ``T = cap(fleet + pending + carry)``. The evidence this
        replica added since its last decay stays fresh on top of ``T``. Of
        the old evidence, what the fleet adds (other replicas' workers) is
        placed among the fresh evidence, marked external, and what it takes
        away (decay and cap differences) comes off the old evidence: the
        next decay's carry then sees other replicas' tests as fresh, exactly
        as one model fed every step would.
        """
        ledger = self.ledger
        if ledger is None:
            raise RuntimeError("install_shared needs a ShareLedger (AcceptanceModel.share_with_fleet)")
        if self.updated_at is None:
            self.updated_at = at
        elif at - self.updated_at > IDLE_CATCH_UP_S:
            # An idle replica (no steps, no tick) meets totals from far later: decay it there first,
            # or its next tick would decay the fresh totals a second time over the gap.
            self.decay(at, half_life_s, max_evidence)
        # Totals a little ahead of this posterior (another replica ticked later) are moved back
        # to its time, exactly (the decay is exponential), so its next decay brings them forward once.
        g = 0.5 ** ((self.updated_at - at) / half_life_s)
        fs, ff, fa, fo = (fit_grid(x, self.max_depth, self.max_width) * g for x in (succ, fail, asked, offered))
        ts = np.maximum(fs + ledger.pending_succ + ledger.carry_succ, 0.0)
        tf = np.maximum(ff + ledger.pending_fail + ledger.carry_fail, 0.0)
        total = ts + tf
        cap = np.where(total > max_evidence, max_evidence / np.maximum(total, 1e-12), 1.0)
        ts, tf = ts * cap, tf * cap
        ta, to = fa + ledger.pending_asked, fo + ledger.pending_offered
        cap = np.where(ta > max_evidence, max_evidence / np.maximum(ta, 1e-12), 1.0)
        ta, to = ta * cap, to * cap
        old_s, old_f = self._old_succ, self._old_fail
        own_s = np.maximum(np.asarray(self.succ) - old_s - ledger.external_succ, 0.0)
        own_f = np.maximum(np.asarray(self.fail) - old_f - ledger.external_fail, 0.0)
        self._old_succ, self._old_fail = np.minimum(ts, old_s), np.minimum(tf, old_f)
        ledger.external_succ, ledger.external_fail = ts - self._old_succ, tf - self._old_fail
        self.succ, self.fail = (ts + own_s).tolist(), (tf + own_f).tolist()
        own_a = np.maximum(np.asarray(self.asked) - ledger.old_asked, 0.0)
        own_o = np.maximum(np.asarray(self.offered) - ledger.old_offered, 0.0)
        self.asked, self.offered = (ta + own_a).tolist(), (to + own_o).tolist()
        ledger.old_asked, ledger.old_offered = ta, to

    def shared_baseline(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What this replica believes the fleet totals are, at ``updated_at``:
        its posterior without its own unpushed evidence and its local carry
        (flat ``succ, fail, asked, offered``). A replica re-seeds a fleet
        store that lost its data with it (:mod:`controller.fleet.acceptance_sync`)."""
        ledger = self.ledger
        if ledger is None:
            raise RuntimeError("shared_baseline needs a ShareLedger (AcceptanceModel.share_with_fleet)")
        s = np.maximum(self._old_succ + ledger.external_succ - ledger.pending_succ - ledger.carry_succ, 0.0)
        f = np.maximum(self._old_fail + ledger.external_fail - ledger.pending_fail - ledger.carry_fail, 0.0)
        a = np.maximum(ledger.old_asked - ledger.pending_asked, 0.0)
        o = np.maximum(ledger.old_offered - ledger.pending_offered, 0.0)
        return s, f, a, o

    def beta_params(self) -> tuple[np.ndarray, np.ndarray]:  # each [depth, width]
        shape = (self.max_depth, self.max_width)
        a = self.prior_a + np.asarray(self.succ).reshape(shape)
        b = self.prior_b + np.asarray(self.fail).reshape(shape)
        return a, b

    def stick_mean(self) -> np.ndarray:  # [depth, width]
        a, b = self.beta_params()
        return a / (a + b)

    def effective_samples(self) -> np.ndarray:  # [depth]: evidence behind each rank-1 cell
        shape = (self.max_depth, self.max_width)
        s = np.asarray(self.succ).reshape(shape)[:, 0]
        f = np.asarray(self.fail).reshape(shape)[:, 0]
        return s + f


def fit_grid(cells: np.ndarray, depth: int, width: int) -> np.ndarray:
    """A ``[d, w]`` grid cut or zero-padded to ``depth × width``, returned flat.

    >>> fit_grid(np.arange(6.0).reshape(2, 3), 3, 2).tolist()
    [0.0, 1.0, 3.0, 4.0, 0.0, 0.0]
    """
    cells = np.asarray(cells, dtype=float)
    if cells.shape == (depth, width):  # the usual case: every replica runs the same limits
        return cells.ravel()
    out = np.zeros((depth, width))
    d, w = min(depth, cells.shape[0]), min(width, cells.shape[1])
    out[:d, :w] = cells[:d, :w]
    return out.ravel()


def offer_slots(depth: int, accepted: int, nodes: int, accepted_rank: Sequence[int] | None,
                level_candidates: Sequence[int] | None, requested_depth: int, requested_width: int,
                requested_nodes: int) -> list[tuple[int, int, bool]]:
    """(level, rank, offered), both 0-based, for every candidate slot a
    request-step's decision asked for at a level the step reached: the
    drafter had it or not. Level 0 rank 0 (a draft at all) is left to the
    caller, which counts it for every step that asked; so is everything when
    the worker did not report the width it asked for.

    A level is reached when every level above it was accepted; the one under
    a path that ends at a leaf shallower than asked is reached with no
    candidates. A step that used its whole node budget (``nodes ==
    requested_nodes``) says nothing about slots it left out, so only its
    offered slots count (censored like the acceptance cells).

    >>> offer_slots(2, 2, 2, None, None, 4, 2, 8)  # a d2 chain fully accepted, d4 w2 n8 asked
    [(0, 1, False), (1, 0, True), (1, 1, False), (2, 0, False), (2, 1, False)]
    >>> offer_slots(2, 0, 3, [0], [2], 2, 2, 3)  # refused at level 1 with the budget spent
    [(0, 1, True)]
    """
    if requested_width <= 0 or requested_depth <= 0:
        return []
    if depth == 0:
        ranks, cands = (0,), (0,)
    else:
        ranks, cands = outcome_key(accepted, depth, accepted_rank or (), level_candidates or ())
    if ranks[-1] != 0:  # the path's last node was accepted: the level under it had nothing
        ranks, cands = ranks + (0,), cands + (0,)
    spent = 0 < requested_nodes <= nodes
    slots = []
    for level, offered in enumerate(cands[:requested_depth]):
        for rank in range(1 if level == 0 else 0, requested_width):
            if rank < offered or not spent:
                slots.append((level, rank, rank < offered))
    return slots


def sticks_to_rank_probs(sticks: np.ndarray) -> np.ndarray:
    """q[k, r] = s[k, r] · Π_{r'<r} (1 − s[k, r']).  # [depth, width] -> [depth, width]

    >>> sticks_to_rank_probs(np.array([[0.5, 0.5]])).tolist()
    [[0.5, 0.25]]
    """
    survive = np.cumprod(1.0 - sticks, axis=1)
    before = np.concatenate([np.ones_like(sticks[:, :1]), survive[:, :-1]], axis=1)
    return sticks * before


DrafterKey = tuple[str, str]  # (kind, version)


class AcceptanceModel:
    """Posteriors for every drafter version seen, per context bucket.

    Parameters
    ----------
    context_edges : lower edges of the context-length buckets (first is 0).
    half_life_s : evidence half-life in seconds.
    max_evidence : cap on successes + failures per cell after decay.
    max_versions : drafter versions kept (least recently used dropped).

    Examples
    --------
    >>> model = AcceptanceModel(context_edges=(0, 4096), half_life_s=60.0)
    >>> for _ in range(200):
    ...     model.observe(("eagle", "v1"), 4, 2, 100, accepted_rank=[1, 1, 0], level_candidates=[1, 1, 1], now=0.0)
    >>> view = model.view(("eagle", "v1"), 4, 2)
    >>> [round(float(x), 2) for x in view.chain_alpha(0)]  # position 4 never tested: prior
    [1.0, 1.0, 0.01, 0.6]
    """

    def __init__(
        self,
        context_edges: Sequence[int],
        half_life_s: float = 300.0,
        max_evidence: float = 2000.0,
        prior: AcceptancePrior = AcceptancePrior(),
        max_versions: int = 64,
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if max_evidence <= 0:
            raise ValueError(f"max_evidence must be > 0, got {max_evidence}")
        self.context_edges = tuple(context_edges)
        self.half_life_s = half_life_s
        self.max_evidence = max_evidence
        self.prior = prior
        self.max_versions = max_versions
        self._strata: OrderedDict[DrafterKey, list[StratumPosterior]] = OrderedDict()
        self.shared = False  # True: every posterior keeps a ShareLedger (share_with_fleet)

    def share_with_fleet(self) -> None:
        """Give every posterior, now and later, a :class:`ShareLedger`, so
        that :mod:`controller.fleet.acceptance_sync` can push its deltas and
        install the fleet's totals. Evidence already held is not pushed as
        a delta (a replica joining with history would add it to a fleet that
        may already hold it): the first install of a stratum replaces it by
        the fleet's totals, or it seeds a fleet store that has none."""
        self.shared = True
        for buckets in self._strata.values():
            for posterior in buckets:
                if posterior.ledger is None:
                    posterior.ledger = ShareLedger(posterior.max_depth * posterior.max_width)

    def items(self) -> tuple[tuple[DrafterKey, list[StratumPosterior]], ...]:
        """Every drafter version's posteriors, without touching the LRU order."""
        return tuple(self._strata.items())

    def peek(self, key: DrafterKey) -> list[StratumPosterior] | None:
        """A version's posteriors if held, without creating or refreshing them."""
        return self._strata.get(key)

    def context_bucket(self, context_len: int) -> int:
        return max(bisect_right(self.context_edges, context_len) - 1, 0)

    def strata(self, key: DrafterKey, max_depth: int, max_width: int,
               now: float | None = None) -> list[StratumPosterior]:
        buckets = self._strata.get(key)
        if buckets is None or buckets[0].max_depth < max_depth or buckets[0].max_width < max_width:
            depth = max(max_depth, buckets[0].max_depth if buckets else 0)
            width = max(max_width, buckets[0].max_width if buckets else 0)
            buckets = [StratumPosterior(depth, width, self.prior, now) for _ in self.context_edges]
            if self.shared:
                for posterior in buckets:
                    posterior.ledger = ShareLedger(depth * width)
            self._strata[key] = buckets
            while len(self._strata) > self.max_versions:
                self._strata.popitem(last=False)
        else:
            self._strata.move_to_end(key)
        return buckets

    def observe(
        self,
        key: DrafterKey,
        max_depth: int,
        max_width: int,
        context_len: int,
        accepted_rank: Sequence[int],
        level_candidates: Sequence[int],
        now: float,
    ) -> None:
        self.strata(key, max_depth, max_width, now)[self.context_bucket(context_len)].observe(
            accepted_rank, level_candidates
        )

    def tick(self, now: float) -> None:
        """Apply forgetting to every stratum (call every second or so)."""
        for buckets in self._strata.values():
            for posterior in buckets:
                posterior.decay(now, self.half_life_s, self.max_evidence)

    def view(self, key: DrafterKey, max_depth: int, max_width: int) -> "AcceptanceView":
        return AcceptanceView(self.context_edges, self.strata(key, max_depth, max_width), max_depth, max_width)

    def keys(self) -> Iterable[DrafterKey]:
        return tuple(self._strata.keys())


class AcceptanceView:
    """Read-only snapshot for one drafter version, cut to its limits
    (implements ``policies.base.AcceptanceEstimate``)."""

    def __init__(
        self, context_edges: tuple[int, ...], buckets: list[StratumPosterior], max_depth: int, max_width: int
    ) -> None:
        self.context_edges = context_edges
        self.max_depth = max_depth
        self.max_width = max_width
        # Snapshot the parameters: policies may run after more telemetry lands.
        self._params = [p.beta_params() for p in buckets]
        self._effective = [p.effective_samples() for p in buckets]
        self._offer = [p.offer_rate() for p in buckets]
        self._offer_probs = [p.offer_probs() for p in buckets]

    def _cut(self, x: np.ndarray) -> np.ndarray:
        return x[: self.max_depth, : self.max_width]

    def rank_probs(self, context_bucket: int) -> np.ndarray:  # [depth, width]
        a, b = self._params[context_bucket]
        return sticks_to_rank_probs(self._cut(a / (a + b)))

    def sample_rank_probs(self, context_bucket: int, rng: np.random.Generator) -> np.ndarray:  # [depth, width]
        a, b = self._params[context_bucket]
        return sticks_to_rank_probs(rng.beta(self._cut(a), self._cut(b)))

    def effective_samples(self, context_bucket: int) -> np.ndarray:  # [depth]
        return self._effective[context_bucket][: self.max_depth]

    def chain_alpha(self, context_bucket: int) -> np.ndarray:  # [depth]
        return self.rank_probs(context_bucket)[:, 0]

    def offer_rate(self, context_bucket: int) -> float:
        return self._offer[context_bucket]

    def offer_probs(self, context_bucket: int) -> np.ndarray:  # [depth, width]
        return self._cut(self._offer_probs[context_bucket])
