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
(:mod:`controller.fleet.acceptance_sync`). The fleet rolls the replicas'
evidence with this module's own arithmetic (:func:`roll_cells`: the carry,
the decay and the cap of one tick, ported to the merge script), so the
fleet's settled posterior is what one model fed every replica's steps holds.
A shared posterior then carries a :class:`ShareLedger` (this replica's
evidence not yet pushed) and, while the fleet answers, a *fleet view*: the
settled fleet posterior it plans from (:meth:`StratumPosterior.install_fleet`).
Its own arrays stay the local model — the fleet's state plus this replica's
unmerged evidence — which it plans from only when the view has gone stale
(the fleet store unreachable). Without a ledger nothing of this runs.
"""

from __future__ import annotations


from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

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
    """What one stratum's posterior holds beyond the fleet state it last installed.

    Every array is flat (``depth × width``) and decayed to the posterior's
    ``updated_at``, like its own evidence.

    Attributes
    ----------
    pending_succ, pending_fail, pending_asked, pending_offered : np.ndarray
        Evidence this replica's workers added since the last
        :meth:`take_pending` (the delta the next merge pushes). Never
        capped: the fleet's roll caps the sum of every replica's deltas.
    external_succ, external_fail : np.ndarray
        Fleet evidence an install put among the fresh evidence since the last
        decay (the fleet's open tick and this replica's pending delta): not
        this replica's to push again.
    old_asked, old_offered : np.ndarray
        Offer counts right after the last decay or install, so that the
        next decay can tell the offers added since.
    """

    __slots__ = ("pending_succ", "pending_fail", "pending_asked", "pending_offered", "external_succ",
                 "external_fail", "old_asked", "old_offered")

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


@dataclass(frozen=True)
class CellRoll:
    """One tick of a stratum's cells (:func:`roll_cells`); arrays flat."""

    succ: np.ndarray
    fail: np.ndarray
    asked: np.ndarray
    offered: np.ndarray
    anchor: np.ndarray  # reference stick mean when each cell last had data (NaN: never)
    carried: float  # reference stick mean at the last carry
    scale: np.ndarray  # what the cap multiplied succ and fail by, per cell (1: not binding)
    scale_asked: np.ndarray  # the same for asked and offered


def roll_cells(old_s: np.ndarray, old_f: np.ndarray, new_s: np.ndarray, new_f: np.ndarray, asked: np.ndarray,
               offered: np.ndarray, factor: float, prior_a: np.ndarray, prior_b: np.ndarray, anchor: np.ndarray,
               carried: float, max_evidence: float) -> CellRoll:
    """One tick: the carry moves mostly-old cells (module docstring), then
    everything decays by ``factor`` and each cell is capped at ``max_evidence``.

    Parameters
    ----------
    old_s, old_f : np.ndarray
        Evidence after the last tick (flat).
    new_s, new_f : np.ndarray
        Evidence added since, undecayed.
    asked, offered : np.ndarray
        Offer counts (old and new together).
    factor : float
        Decay since the last tick.
    prior_a, prior_b : np.ndarray
        The Beta prior (flat).
    anchor, carried
        Carry state of the last tick (not modified).
    max_evidence : float

    Notes
    -----
    The single source of a tick's arithmetic: :meth:`StratumPosterior.decay`
    calls it, and the fleet's merge script
    (:data:`controller.fleet.acceptance_sync.MERGE_LUA`, ``roll``) is a line
    by line port, checked against it by the tests.
    """
    anchor = anchor.copy()
    a, b = prior_a, prior_b
    succ0, fail0 = old_s[0] + new_s[0], old_f[0] + new_f[0]
    reference = (a[0] + succ0) / (a[0] + b[0] + succ0 + fail0)
    fresh = new_s + new_f
    anchor[fresh > 0] = reference
    if not carried == carried:  # NaN: first tick
        carried = reference
    ratio = reference / carried
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
            drifted = np.abs(reference / anchor - 1.0) > STALE_CHANGE
        stale = (fresh == 0) & (old_n > STALE_EVIDENCE) & drifted
        # The reference cell moves only with its own data in one model; a model whose evidence is
        # replaced from outside (a replica installing fleet totals) must never take it for stale.
        stale[0] = False
        shrink = np.where(stale, STALE_EVIDENCE / np.maximum(old_n, 1e-12), 1.0)
        old_s, old_f = old_s * shrink, old_f * shrink
        carried = reference
    succ, fail = (old_s + new_s) * factor, (old_f + new_f) * factor
    asked, offered = asked * factor, offered * factor
    scale_asked = np.where(asked > max_evidence, max_evidence / np.maximum(asked, 1e-12), 1.0)
    total = succ + fail
    scale = np.where(total > max_evidence, max_evidence / np.maximum(total, 1e-12), 1.0)
    return CellRoll(succ * scale, fail * scale, asked * scale_asked, offered * scale_asked, anchor, float(carried),
                    scale, scale_asked)


@dataclass(frozen=True)
class FleetSnapshot:
    """One stratum as the fleet store holds it (``controller.fleet.acceptance_sync``); arrays flat,
    ``depth × width``.

    The *settled* part is every replica's evidence through fleet tick
    ``settled_tick``, rolled (:func:`roll_cells`) to ``settled_at``; the
    *open* part is the deltas pushed for a later tick, summed and decayed to
    ``open_at``, not rolled yet.
    """

    depth: int
    width: int
    settled_at: float | None  # None: nothing rolled yet
    settled_tick: int | None
    succ: np.ndarray
    fail: np.ndarray
    asked: np.ndarray
    offered: np.ndarray
    scale: np.ndarray  # the last roll's cap factors (a late delta joins through them)
    scale_asked: np.ndarray
    anchor: np.ndarray  # NaN: the cell never had data
    carried: float  # NaN: no tick yet
    open_at: float | None  # None: nothing open
    open_tick: int | None
    open_succ: np.ndarray
    open_fail: np.ndarray
    open_asked: np.ndarray
    open_offered: np.ndarray


class StratumPosterior:
    """Posterior of one stratum: ``depth × width`` stick-breaking Beta cells."""

    __slots__ = ("prior_a", "prior_b", "succ", "fail", "max_depth", "max_width", "updated_at", "observations",
                 "_old_succ", "_old_fail", "_anchor", "_carried", "asked", "offered", "ledger", "view", "view_until")

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
        # The fleet's settled posterior (flat succ, fail, asked, offered at updated_at) this posterior plans
        # from while the fleet answers (install_fleet), and the time after which it is stale.
        self.view: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.view_until = float("-inf")

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
        _, _, asked, offered = self.planning_arrays()
        return float((offered[0] + 1.0) / (asked[0] + 1.0))

    def offer_probs(self) -> np.ndarray:  # [depth, width]
        """P(the drafter offers a rank-``r`` candidate at level ``k`` | the
        level is reached and the decision asks for it), i.e. P(at least
        ``r`` candidates there): one pseudo-success per cell, so a cell never
        asked about (and every cell past level 1 rank 1 of a worker that
        does not report the width it asked for) stays at 1, but no rank is
        offered more often than the rank above it."""
        _, _, asked, offered = self.planning_arrays()
        asked, offered = asked.reshape(self.max_depth, self.max_width), offered.reshape(self.max_depth, self.max_width)
        return np.minimum.accumulate((offered + 1.0) / (asked + 1.0), axis=1)

    def decay(self, now: float, half_life_s: float, max_evidence: float) -> None:
        """Forget old evidence: mostly-old cells follow the reference (module
        docstring), then everything decays exponentially in time and each
        cell is capped (:func:`roll_cells`)."""
        dt = 0.0 if self.updated_at is None else now - self.updated_at
        factor = 0.5 ** (dt / half_life_s) if dt > 0 and half_life_s > 0 else 1.0
        self.updated_at = now if self.updated_at is None else max(self.updated_at, now)
        old_s, old_f = self._old_succ, self._old_fail
        new_s = np.maximum(np.asarray(self.succ) - old_s, 0.0)
        new_f = np.maximum(np.asarray(self.fail) - old_f, 0.0)
        raw_asked, raw_offered = np.asarray(self.asked), np.asarray(self.offered)
        ledger = self.ledger
        if ledger is not None:
            self._fold_ledger(ledger, new_s, new_f, raw_asked, raw_offered, factor)
            if self.view is not None:
                if self.updated_at > self.view_until:  # the fleet has not answered for a while: plan locally
                    self.view = None
                else:
                    self.view = tuple(x * factor for x in self.view)
        rolled = roll_cells(old_s, old_f, new_s, new_f, raw_asked, raw_offered, factor, self.prior_a.ravel(),
                            self.prior_b.ravel(), self._anchor, self._carried, max_evidence)
        self._anchor, self._carried = rolled.anchor, rolled.carried
        self.asked, self.offered = rolled.asked.tolist(), rolled.offered.tolist()
        if ledger is not None:
            ledger.old_asked, ledger.old_offered = rolled.asked, rolled.offered
        self._old_succ, self._old_fail = rolled.succ, rolled.fail
        self.succ, self.fail = rolled.succ.tolist(), rolled.fail.tolist()

    @staticmethod
    def _fold_ledger(ledger: ShareLedger, new_s: np.ndarray, new_f: np.ndarray, asked: np.ndarray,
                     offered: np.ndarray, factor: float) -> None:
        """At a decay: this replica's fresh evidence joins the pending delta
        (fleet evidence an install marked fresh is not its to push), and it
        decays as the posterior does."""
        own_s = np.maximum(new_s - ledger.external_succ, 0.0)
        own_f = np.maximum(new_f - ledger.external_fail, 0.0)
        ledger.pending_succ = (ledger.pending_succ + own_s) * factor
        ledger.pending_fail = (ledger.pending_fail + own_f) * factor
        ledger.pending_asked = (ledger.pending_asked + np.maximum(asked - ledger.old_asked, 0.0)) * factor
        ledger.pending_offered = (ledger.pending_offered + np.maximum(offered - ledger.old_offered, 0.0)) * factor
        ledger.external_succ = np.zeros_like(new_s)
        ledger.external_fail = np.zeros_like(new_f)

    def install_fleet(self, fleet: FleetSnapshot, half_life_s: float, max_evidence: float,
                      view_ttl_s: float) -> None:
        """Plan from the fleet's settled posterior; keep the local model at the fleet's state plus this
        replica's unmerged evidence.

        Parameters
        ----------
        fleet : FleetSnapshot
            The stratum as the fleet holds it (cut or padded with zeros to
            this posterior's grid). Its times are brought to this
            posterior's ``updated_at`` (after decaying the posterior there
            when the fleet is more than :data:`IDLE_CATCH_UP_S` ahead).
        half_life_s, max_evidence : float
            The model's.
        view_ttl_s : float
            The view is dropped (the posterior plans from its local model)
            at the first decay more than this after now without another
            install.

        Notes
        -----
        *The view* (what policies read) is the settled posterior alone: the
        same numbers on every replica, what one model fed every replica's
        steps held at the fleet's last tick. Not this replica's unsettled
        evidence on top: without the other replicas' evidence of the same
        moments it would weigh this replica's workers above their share
        (``controller.fleet.acceptance_sync``, "What a replica plans from").

        *The local model* (these arrays) becomes settled + open + this
        replica's pending delta + what its workers added since its last
        decay; settled is its old evidence and the rest fresh, so its next
        decay rolls them as the fleet will, and pushes only the part its
        own workers added. It is what the replica plans from once the view
        is stale, and its carry state is the fleet's.
        """
        ledger = self.ledger
        if ledger is None:
            raise RuntimeError("install_fleet needs a ShareLedger (AcceptanceModel.share_with_fleet)")
        times = [t for t in (fleet.settled_at, fleet.open_at) if t is not None]
        if not times:
            return
        if self.updated_at is None:
            self.updated_at = max(times)
        elif max(times) - self.updated_at > IDLE_CATCH_UP_S:
            # An idle replica (no steps, no tick) meets totals from far later: decay it there first,
            # or its next tick would decay the fresh totals a second time over the gap.
            self.decay(max(times), half_life_s, max_evidence)
        depth, width = self.max_depth, self.max_width

        def fit(x: np.ndarray, at: float | None) -> np.ndarray:
            # Totals a little ahead of this posterior (another replica ticked later) are moved back
            # to its time, exactly (the decay is exponential), so its next decay brings them forward once.
            if at is None:
                return np.zeros(depth * width)
            grid = fit_grid(x.reshape(fleet.depth, fleet.width), depth, width)
            return grid * 0.5 ** ((self.updated_at - at) / half_life_s)

        ss, sf, sa, so = (fit(x, fleet.settled_at) for x in (fleet.succ, fleet.fail, fleet.asked, fleet.offered))
        us, uf, ua, uo = (fit(x, fleet.open_at) for x in (fleet.open_succ, fleet.open_fail, fleet.open_asked,
                                                          fleet.open_offered))
        if fleet.settled_at is not None:
            self.view = (ss, sf, sa, so)
            self.view_until = self.updated_at + view_ttl_s
            anchor = fit_grid(fleet.anchor.reshape(fleet.depth, fleet.width), depth, width)
            anchor[anchor == 0.0] = np.nan  # padded cells never had data
            self._anchor, self._carried = anchor, fleet.carried
        own_s = np.maximum(np.asarray(self.succ) - self._old_succ - ledger.external_succ, 0.0)
        own_f = np.maximum(np.asarray(self.fail) - self._old_fail - ledger.external_fail, 0.0)
        own_a = np.maximum(np.asarray(self.asked) - ledger.old_asked, 0.0)
        own_o = np.maximum(np.asarray(self.offered) - ledger.old_offered, 0.0)
        ledger.external_succ, ledger.external_fail = us + ledger.pending_succ, uf + ledger.pending_fail
        self._old_succ, self._old_fail = ss, sf
        self.succ = (ss + ledger.external_succ + own_s).tolist()
        self.fail = (sf + ledger.external_fail + own_f).tolist()
        ledger.old_asked = sa + ua + ledger.pending_asked
        ledger.old_offered = so + uo + ledger.pending_offered
        self.asked, self.offered = (ledger.old_asked + own_a).tolist(), (ledger.old_offered + own_o).tolist()

    def shared_baseline(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This replica's evidence without its own unpushed part, at ``updated_at``
        (flat ``succ, fail, asked, offered``): what a replica that never read the
        fleet seeds an empty fleet store with (:mod:`controller.fleet.acceptance_sync`)."""
        ledger = self.ledger
        if ledger is None:
            raise RuntimeError("shared_baseline needs a ShareLedger (AcceptanceModel.share_with_fleet)")
        s = np.maximum(self._old_succ + ledger.external_succ - ledger.pending_succ, 0.0)
        f = np.maximum(self._old_fail + ledger.external_fail - ledger.pending_fail, 0.0)
        a = np.maximum(ledger.old_asked - ledger.pending_asked, 0.0)
        o = np.maximum(ledger.old_offered - ledger.pending_offered, 0.0)
        return s, f, a, o

    def planning_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What policies read (flat ``succ, fail, asked, offered``): the fleet view while there is one, else
        this model's own evidence."""
        if self.view is not None:
            return self.view
        return np.asarray(self.succ), np.asarray(self.fail), np.asarray(self.asked), np.asarray(self.offered)

    def beta_params(self) -> tuple[np.ndarray, np.ndarray]:  # each [depth, width]
        shape = (self.max_depth, self.max_width)
        succ, fail, _, _ = self.planning_arrays()
        return self.prior_a + succ.reshape(shape), self.prior_b + fail.reshape(shape)

    def stick_mean(self) -> np.ndarray:  # [depth, width]
        a, b = self.beta_params()
        return a / (a + b)

    def effective_samples(self) -> np.ndarray:  # [depth]: evidence behind each rank-1 cell
        shape = (self.max_depth, self.max_width)
        succ, fail, _, _ = self.planning_arrays()
        return succ.reshape(shape)[:, 0] + fail.reshape(shape)[:, 0]


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
        # Called before every read of the posteriors and every tick: folds evidence buffered elsewhere
        # (the controller's, controller.core.ingest.fold_evidence), so no read sees the model without it.
        # It may call back into this model (strata, peek): it must empty its buffer first.
        self.fold_pending: Callable[[], None] | None = None

    def share_with_fleet(self) -> None:
        """Give every posterior, now and later, a :class:`ShareLedger`, so
        that :mod:`controller.fleet.acceptance_sync` can push its deltas and
        install the fleet's totals. Evidence already held is not pushed as
        a delta (a replica joining with history would add it to a fleet that
        may already hold it): the first install of a stratum replaces it by
        the fleet's totals, or it seeds a fleet store that has none."""
        if self.fold_pending is not None:  # evidence ingested before sharing is not a delta either
            self.fold_pending()
        self.shared = True
        for buckets in self._strata.values():
            for posterior in buckets:
                if posterior.ledger is None:
                    posterior.ledger = ShareLedger(posterior.max_depth * posterior.max_width)

    def items(self) -> tuple[tuple[DrafterKey, list[StratumPosterior]], ...]:
        """Every drafter version's posteriors, without touching the LRU order."""
        if self.fold_pending is not None:
            self.fold_pending()
        return tuple(self._strata.items())

    def peek(self, key: DrafterKey) -> list[StratumPosterior] | None:
        """A version's posteriors if held, without creating or refreshing them."""
        if self.fold_pending is not None:
            self.fold_pending()
        return self._strata.get(key)

    def context_bucket(self, context_len: int) -> int:
        return max(bisect_right(self.context_edges, context_len) - 1, 0)

    def strata(self, key: DrafterKey, max_depth: int, max_width: int,
               now: float | None = None) -> list[StratumPosterior]:
        if self.fold_pending is not None:
            self.fold_pending()
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
        if self.fold_pending is not None:
            self.fold_pending()
        for buckets in self._strata.values():
            for posterior in buckets:
                posterior.decay(now, self.half_life_s, self.max_evidence)

    def view(self, key: DrafterKey, max_depth: int, max_width: int) -> "AcceptanceView":
        return AcceptanceView(self.context_edges, self.strata(key, max_depth, max_width), max_depth, max_width)

    def keys(self) -> Iterable[DrafterKey]:
        if self.fold_pending is not None:
            self.fold_pending()
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
