"""What a detected change calls for: the alert action, its severity and the alert that says so.

A detector only says "this stratum no longer matches its baseline". Whether
that means "retrain the draft heads" is decided here, from how much the
expected accepted length ``E[τ]`` moved and where the stratum sits
(docs/design.md §5):

* ``RETRAIN_HEADS`` — acceptance fell within a stratum inside the trained
  context length by at least ``retrain_threshold`` (relative ``E[τ]``): the
  content moved;
* ``EXTEND_TRAINING_CONTEXT`` — the change is in a bucket past the drafter's
  trained context length, or a share of the version's traffic runs there
  (the context-share finding, :func:`extend_alert`): acceptance is expected
  to fall there, and no retrain on current traffic fixes it;
* ``INVESTIGATE`` — the distribution changed without such a loss (a change of
  shape, or a rise): look before acting.

:func:`stratum_alert` and :func:`extend_alert` build the
:class:`~controller.drift.alerts.DriftAlert` with the histograms, stick
probabilities and message an operator reads; the monitor
(:mod:`controller.drift.monitor`) numbers, opens and resolves them.

Examples
--------
>>> choose_action(-0.08, retrain_threshold=-0.03).value
'RETRAIN_HEADS'
>>> choose_action(-0.01, retrain_threshold=-0.03).value
'INVESTIGATE'
>>> choose_action(-0.30, retrain_threshold=-0.03, beyond=True).value   # past the trained context length
'EXTEND_TRAINING_CONTEXT'
>>> [severity(choose_action(d, -0.03), d, -0.03).value for d in (-0.25, -0.08, -0.01, 0.05)]
['CRITICAL', 'WARNING', 'WARNING', 'INFO']
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from controller.drift.alerts import Action, DriftAlert, Severity
from controller.drift.cells import key_bins, sticks, tau_histogram
from controller.drift.strata import Stratum, Version
from policies.chain import expected_chain_accepted


def choose_action(delta: float, retrain_threshold: float, beyond: bool = False) -> Action:
    """The action for a relative ``E[τ]`` change ``delta`` of a stratum (``beyond``: past the trained length)."""
    if beyond:
        return Action.EXTEND_TRAINING_CONTEXT
    return Action.RETRAIN_HEADS if delta <= retrain_threshold else Action.INVESTIGATE


def severity(action: Action, delta: float, retrain_threshold: float) -> Severity:
    """How urgent a stratum's alert is: a loss of a fifth of ``E[τ]`` or more is critical.

    An ``INVESTIGATE`` alert (the distribution changed, ``E[τ]`` fell by less
    than ``|retrain_threshold|``) is a warning, and only informational when
    ``E[τ]`` rose by more than ``|retrain_threshold|``: acceptance got better.
    """
    if action is Action.INVESTIGATE:
        return Severity.INFO if delta > -retrain_threshold else Severity.WARNING
    return Severity.CRITICAL if delta <= -0.2 else Severity.WARNING


def tau_change(s: Stratum, counts: Counter) -> float:
    """Relative change of E[τ] at the reference depth (recent vs baseline, rank-1 chain)."""
    v = s.version
    base = s.chi2.baseline_bins
    cur = s.chi2.window_bins(counts)
    c = v.max_depth * v.max_width
    base_trials = (base[:c] + base[c:]).reshape(v.max_depth, v.max_width)[:, 0]
    cur_trials = (cur[:c] + cur[c:]).reshape(v.max_depth, v.max_width)[:, 0]
    n_base = max(sum(s.chi2.baseline_counts.values()), 1)
    reached = np.nonzero(base_trials >= 0.05 * n_base)[0]
    depth = int(reached[-1]) + 1 if reached.size else 1
    a_base = sticks(base, v.max_depth, v.max_width)[:, 0]
    a_cur = np.where(cur_trials >= 20, sticks(cur, v.max_depth, v.max_width)[:, 0], a_base)
    e_base = expected_chain_accepted(a_base, depth)
    return expected_chain_accepted(a_cur, depth) / e_base - 1.0 if e_base > 0 else 0.0


def stratum_alert(alert_id: str, s: Stratum, detector: str, statistic: float, p_value: float | None,
                  p_adj: float | None, score: float, counts: Counter, delta: float, action: Action,
                  first_seen: float, now: float, extra: dict[str, Any], retrain_threshold: float) -> DriftAlert:
    """The alert of a change in stratum ``s`` (``counts``: the outcomes since the change)."""
    v = s.version
    base_bins = s.chi2.baseline_bins
    cur_bins = s.chi2.window_bins(counts)
    what = {Action.RETRAIN_HEADS: "acceptance fell within the stratum: retrain the draft heads on current traffic",
            Action.EXTEND_TRAINING_CONTEXT: "acceptance moved beyond the trained context length",
            Action.INVESTIGATE: "the accept-length distribution changed without a loss"}[action]
    return DriftAlert(
        id=alert_id, drafter_kind=v.kind, drafter_version=v.version, stratum=s.label,
        context_len_min=s.lo, context_len_max=s.hi, domain=s.domain, detector=detector,
        statistic=float(statistic), p_value=p_value, p_adjusted=p_adj, score=float(score),
        baseline_hist=tau_histogram(s.chi2.baseline_counts, v.max_depth),
        current_hist=tau_histogram(counts, v.max_depth),
        baseline_alpha=_alpha(base_bins, v), current_alpha=_alpha(cur_bins, v),
        expected_tau_change=round(float(delta), 4), first_seen=float(first_seen), opened_at=float(now),
        severity=severity(action, delta, retrain_threshold), action=action,
        message=f"{v.kind}/{v.version} {s.label}: {what} (E[τ] {delta:+.1%}, {detector})",
        n_baseline=sum(s.chi2.baseline_counts.values()), n_current=sum(counts.values()), extra=extra)


def extend_alert(alert_id: str, v: Version, share: float, counts: Counter, now: float,
                 beyond_share: float) -> DriftAlert:
    """The ``EXTEND_TRAINING_CONTEXT`` alert of a version whose traffic runs past its trained length.

    ``share`` is the measured share of request-steps past the trained
    context length and ``counts`` their outcomes, compared with the
    baselines of the version's strata inside it.
    """
    inside = [s for s in v.strata.values() if s.weights is not None and not s.beyond]
    base_counts: Counter = Counter()
    for s in inside:
        base_counts.update(s.chi2.baseline_counts)
    c2 = 2 * v.max_depth * v.max_width
    base_bins = sum((n * key_bins(k, v.max_depth, v.max_width) for k, n in base_counts.items()), np.zeros(c2))
    cur_bins = sum((n * key_bins(k, v.max_depth, v.max_width) for k, n in counts.items()), np.zeros(c2))
    a_base = sticks(base_bins, v.max_depth, v.max_width)[:, 0]
    a_cur = sticks(cur_bins, v.max_depth, v.max_width)[:, 0]
    e_base = expected_chain_accepted(a_base, v.max_depth)
    delta = expected_chain_accepted(a_cur, v.max_depth) / e_base - 1.0 if base_counts and e_base > 0 else 0.0
    L = v.trained_context_len
    # Traffic may run past L from the start: then nothing inside L has a baseline to compare with.
    compared = (f"E[τ] there {delta:+.1%} vs within" if base_counts
                else "no baseline within the trained length yet to compare with")
    return DriftAlert(
        id=alert_id, drafter_kind=v.kind, drafter_version=v.version, stratum=f"ctx>{L}",
        context_len_min=L, context_len_max=0, domain="", detector="context_share", statistic=round(share, 4),
        p_value=None, p_adjusted=None, score=share / beyond_share,
        baseline_hist=tau_histogram(base_counts, v.max_depth), current_hist=tau_histogram(counts, v.max_depth),
        baseline_alpha=[round(float(a), 4) for a in a_base], current_alpha=[round(float(a), 4) for a in a_cur],
        expected_tau_change=round(float(delta), 4), first_seen=float(now), opened_at=float(now),
        severity=Severity.CRITICAL if share >= 0.25 else Severity.WARNING,
        action=Action.EXTEND_TRAINING_CONTEXT,
        message=(f"{v.kind}/{v.version}: {share:.0%} of request-steps run past the trained context length "
                 f"{L} ({compared}): extend the training context"),
        n_baseline=sum(base_counts.values()), n_current=sum(counts.values()))


def _alpha(bins: np.ndarray, v: Version) -> list[float]:
    return [round(float(a), 4) for a in sticks(bins, v.max_depth, v.max_width)[:, 0]]
