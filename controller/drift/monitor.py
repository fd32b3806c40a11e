"""``AcceptanceDriftMonitor``: tell "context got longer" from "the content moved".

Acceptance falls for three reasons (docs/design.md §5) and only one of them means
"retrain the draft heads":

1. the context-length mix moved — acceptance decays with context (position
   extrapolation, draft KV error), so long-context traffic accepts less;
2. the batch moved — acceptance does not depend on batch size, but the policy
   drafts shallower at large batches, so raw accept lengths get shorter;
3. the content moved — within a stratum the accept-length distribution
   shifts: retrain.

The monitor therefore never pools. A stratum is (drafter kind+version,
context bucket, domain tag when workers send one); each stratum learns its
own baseline from its first ``baseline_steps`` request-steps (or gets it from
:meth:`AcceptanceDriftMonitor.from_dict`), and every test compares a stratum
with its own baseline, which removes (1). Outcomes are read as censored
per-position trials (:mod:`controller.drift.cells`), so a shallower draft is
fewer trials rather than a shorter accept length, which removes (2).
Traffic beyond the drafter's trained context length is its own finding,
``EXTEND_TRAINING_CONTEXT``, and its strata never vote for a retrain.

Two detectors watch the strata, each calibrated by bootstrap from the
baselines to its share of the false-alarm budget ``ert`` (request-steps
between false alarms, monitor-wide; ``cusum_share`` of the rate to the CUSUM):

* **stratified likelihood-ratio CUSUMs** per drafter version, one per
  entry of ``drops`` (a bank: a large drop is caught fast, a small one
  still caught): every request-step adds ``log L(drop) / L(baseline)`` of its
  own stratum's cells — the alternative being every stick probability
  ``(1 − drop)`` times its baseline value. Scoring each step against its own
  stratum keeps the sum blind to the context and depth mix while using all
  of the version's traffic, so a content drift that hits every bucket is
  caught at the speed of a pooled detector. When one fires, the strata
  whose log-likelihood ratio grew since the sum last left zero are the ones
  alerted, and the bank restarts.
* a **chi-square test of the whole accept-length distribution** per stratum
  on tumbling windows (:class:`~controller.drift.accept_chi2.AcceptLengthChiSquare`),
  which also catches a change of shape with the mean unchanged. Every
  ``round_steps`` request-steps the fresh p-values of all strata go through
  Benjamini–Hochberg (or Holm) at level ``round_steps / ert_chi2`` — under no
  drift a round rejects anything with probability at most that level, so the
  rate stays within budget however many strata there are.

Baselines keep growing (up to ``baseline_max``) with windows that match them,
each absorbed one window late and only while the CUSUMs are quiet, so the
likelihood ratios sharpen and thresholds fall as traffic accumulates. A
stratum joins the CUSUM for a given drop only once its baseline is precise
enough for it (``precision_z``), and every threshold is calibrated for the
false-alarm rate averaged over the baseline's own estimation error.

An alert stays open (one per stratum, no storm) until ``resolve_windows``
consecutive windows of the stratum match the baseline again (p-value above
``resolve_p`` and no likelihood-ratio evidence of a drop), or until the
drafter version is superseded: a worker that ran it announces another one and
no worker runs it any more (or :meth:`AcceptanceDriftMonitor.retire_version`).

Wiring: ``controller.on_step.append(monitor.observe_step)`` feeds every
applied step; the server feeds a hashed subset of requests instead, off the
ingest path (:mod:`controller.alerts.alerting`).

This module is the orchestration: routing request-steps to strata, running
the CUSUM bank and the chi-square rounds, opening and resolving alerts, the
drafter versions' lifecycle. The parts it drives live beside it:

* :mod:`controller.drift.config` — :class:`MonitorConfig`;
* :mod:`controller.drift.strata` — per-stratum baselines, windows and
  likelihood-ratio weights, and each version's CUSUM bank and its calibration;
* :mod:`controller.drift.llr` — the likelihood-ratio score and its bootstraps;
* :mod:`controller.drift.actions` — what a change calls for (``RETRAIN_HEADS``,
  ``EXTEND_TRAINING_CONTEXT`` or ``INVESTIGATE``) and the alert saying so;
* :mod:`controller.drift.persistence` — :meth:`AcceptanceDriftMonitor.to_dict`
  and :meth:`~AcceptanceDriftMonitor.from_dict` for the alert store.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from collections import Counter, OrderedDict
from dataclasses import asdict
from typing import Any, Callable, Sequence

import numpy as np

from controller.drift.actions import choose_action, extend_alert, stratum_alert, tau_change
from controller.drift.alerts import Action, DriftAlert, Status
from controller.drift.cells import OutcomeKey, chain_key
from controller.drift.config import DEFAULT_CONTEXT_EDGES, MonitorConfig
from controller.drift.llr import llr_weights
from controller.drift.multitest import adjust
from controller.drift.persistence import monitor_from_dict, monitor_to_dict
from controller.drift.strata import PendingTest, Stratum, Version

# speculation.v1 AcceptanceRule.ACCEPTANCE_RULE_TYPICAL (this package reads messages duck-typed, without the protos)
ACCEPTANCE_RULE_TYPICAL = 2

# MonitorConfig, DEFAULT_CONTEXT_EDGES and llr_weights have their own modules; they stay importable from here.
__all__ = ["DEFAULT_CONTEXT_EDGES", "AcceptanceDriftMonitor", "MonitorConfig", "llr_weights"]

log = logging.getLogger("specctl.drift")


class AcceptanceDriftMonitor:
    """Drift monitor of acceptance per drafter version × context bucket (× domain).

    Parameters
    ----------
    config
        :class:`MonitorConfig` (defaults when ``None``).
    clock
        Time source for steps that carry no timestamp.
    cpu_clock
        The clock :attr:`calibration_s` is measured on: the thread's CPU time, the clock the feed's budget
        (:class:`controller.alerts.alerting.MonitorFeed`) is measured on too, so a calibration is taken out
        of the feed's cost per request-step in the same seconds it was charged in. A test injects a clock
        that advances only by the work charged to it.
    **overrides
        Fields of :class:`MonitorConfig` to override.

    Attributes
    ----------
    alerts : OrderedDict of str to DriftAlert
        Every alert kept (open ones, then up to ``max_history`` resolved).
    listeners : list of callables
        Called as ``listener(event, alert)`` with event ``"opened"`` or
        ``"resolved"`` (the hook for WatchAlerts streams, logs and sinks).
    arbiter : object or None
        Several controller replicas watching the same drafter versions open
        one alert per stratum between them, not one each. With an arbiter
        (:class:`controller.fleet.replica.FleetAlerts`) a finding is first
        offered to ``arbiter.claim(alert)``, which returns the alert to
        attach to the stratum (the same one, perhaps renamed with a
        fleet-wide id: announced as opened; another replica's open alert on
        that stratum: attached quietly) or None (not now: the stratum waits,
        out of the CUSUMs and chi-square rounds as if alerted, until the
        arbiter hands the finding back through :meth:`open_claimed`, attaches
        another alert through :meth:`adopt`, or drops it through
        :meth:`withdraw`); and an alert is resolved only when
        ``arbiter.may_resolve(alert)`` (the replica that owns it), else kept
        and asked again at the stratum's next window. ``None``: one
        controller decides alone.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> rng = np.random.default_rng(0)
    >>> limits = SimpleNamespace(kind="eagle", version="v1", max_depth=6, max_width=1, trained_context_len=8192)
    >>> mon = AcceptanceDriftMonitor(baseline_steps=300, window=200, round_steps=400, ert=200_000,
    ...                              n_bootstrap=256, cusum_horizon=2048)
    >>> def step(t, alpha):
    ...     ctx = int(rng.choice([500, 3000]))
    ...     a = alpha * (1.0 - 0.08 * ctx / 8192)          # acceptance decays with context
    ...     tau = 0
    ...     while tau < 6 and rng.random() < a:
    ...         tau += 1
    ...     mon.observe_request(limits, ctx, tau, 6, now=float(t))
    >>> for t in range(3000):
    ...     step(t, 0.8)
    >>> mon.open_alerts()
    []
    >>> for t in range(3000, 4500):
    ...     step(t, 0.8 * 0.9)                              # the content moved: acceptance 10 % lower
    >>> [(a.action.value, a.stratum, a.detector) for a in mon.open_alerts()]
    [('RETRAIN_HEADS', 'ctx[0,1024)', 'cusum'), ('RETRAIN_HEADS', 'ctx[2048,4096)', 'cusum')]
    """

    def __init__(self, config: MonitorConfig | None = None, clock: Callable[[], float] = time.time,
                 cpu_clock: Callable[[], float] = time.thread_time, **overrides: Any) -> None:
        config = config or MonitorConfig()
        if overrides:
            unknown = set(overrides) - set(MonitorConfig.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown MonitorConfig field(s): {', '.join(sorted(unknown))}")
            config = MonitorConfig(**{**asdict(config), **overrides})
        self.config = config
        self.clock = clock
        self.cpu_clock = cpu_clock
        self._versions: OrderedDict[tuple[str, str], Version] = OrderedDict()
        self._workers: dict[str, tuple[str, str]] = {}
        self._pending: list[PendingTest] = []
        self._steps = 0
        self._next_id = 1
        # CPU seconds spent calibrating CUSUM banks (bootstrap, when baselines complete): a one-off cost
        # that the feed charges to its budget but keeps out of its cost per request-step.
        self.calibration_s = 0.0
        self.alerts: OrderedDict[str, DriftAlert] = OrderedDict()
        self.listeners: list[Callable[[str, DriftAlert], None]] = []
        self.arbiter: Any = None
        self.ert_cusum = config.ert / config.cusum_share
        self.ert_chi2 = config.ert / (1.0 - config.cusum_share)
        self.round_level = min(0.5, config.round_steps / self.ert_chi2)
        self._small = int(np.argmin(config.drops))

    # ------------------------------------------------------------------ input
    def observe_step(self, state: Any, step: Any) -> None:
        """Controller ``on_step`` hook: ``(WorkerState, StepReport)`` → every request of the step.

        ``state`` needs ``limits`` (kind, version, max_depth, max_width,
        trained_context_len) and may have ``worker_id``; ``step`` needs
        ``timestamp`` and ``requests`` (``RequestStep``-like). Requests verified
        with the typical rule (``acceptance_rule``) are skipped.
        """
        limits = state.limits
        now = float(getattr(step, "timestamp", 0.0) or 0.0) or self.clock()
        worker = getattr(state, "worker_id", "") or ""
        for r in step.requests:
            if getattr(r, "acceptance_rule", 0) == ACCEPTANCE_RULE_TYPICAL:
                continue  # relaxed acceptance is not the drafter's: a class's rule is no drift
            self.observe_request(limits, r.context_len, r.accepted, r.depth, r.accepted_rank, r.level_candidates,
                                 getattr(r, "domain", ""), now, worker)

    def observe_request(
        self,
        limits: Any,
        context_len: int,
        accepted: int,
        depth: int,
        accepted_rank: Sequence[int] = (),
        level_candidates: Sequence[int] = (),
        domain: str = "",
        now: float | None = None,
        worker_id: str = "",
    ) -> None:
        """One request's part of one step (``accepted`` = τ, bonus excluded; ``depth`` 0 = no speculation)."""
        now = self.clock() if now is None else now
        v = self._version(limits, worker_id, now)
        v.steps += 1
        self._steps += 1
        if v.trained_context_len > 0:
            self._count_share(v, context_len, accepted, depth, accepted_rank, level_candidates, now)
        if depth > 0:
            key = chain_key(accepted, depth) if not accepted_rank else (tuple(accepted_rank), tuple(level_candidates))
            self._observe(v, context_len, key, domain, now)
        if self._steps % self.config.round_steps == 0:
            self._round(now)

    def _observe(self, v: Version, context_len: int, key: OutcomeKey, domain: str, now: float) -> None:
        bucket = max(bisect_right(self.config.context_edges, context_len) - 1, 0)
        s = v.strata.get((bucket, domain))
        if s is None:
            s = v.strata[(bucket, domain)] = Stratum(v, bucket, domain, self.config, self.config.seed)
        s.n_seen += 1
        chi2 = s.chi2
        if s.weights is None:
            chi2.update_key(key)
            if chi2.baseline_ready:
                s.fit_weights(self.config)
                v.dirty = True
            return
        if not chi2.window_counts:
            s.win_start = now
        chi2.update_key(key)
        us = s.score(key)
        s.window_llr += us[self._small]  # resolution listens to the most sensitive CUSUM's evidence
        s.recent.append((now, key))
        if not s.beyond and s.alert is None and s.deferred is None:
            joins = s.joins
            for j, cusum in enumerate(v.cusums):
                if cusum is None or not joins[j]:
                    continue
                u = us[j]
                if s.anchor_epoch[j] != v.epoch[j]:
                    s.anchor[j], s.anchor_epoch[j] = s.cum_llr[j], v.epoch[j]
                s.cum_llr[j] += u
                cusum.update(u)
                if cusum.drift_detected:
                    self._cusum_alarm(v, j, now)
                    break
                if cusum.s_up == 0.0:
                    v.epoch[j] += 1
                    v.anchor_time[j] = now
        if chi2.tested:
            self._window_done(s, now)
        if v.dirty and (not any(v.cusums) or v.steps - v.calibrated_at >= self.config.window):
            # at most once per window of the version's steps: completions batch up
            started = self.cpu_clock()
            v.calibrate(self.config, self.ert_cusum)
            self.calibration_s += self.cpu_clock() - started

    # ---------------------------------------------------------------- alarms
    def _cusum_alarm(self, v: Version, j: int, now: float) -> None:
        cusum = v.cusums[j]
        contributions = []
        for s in v.strata.values():
            if s.weights is None or s.beyond or s.alert is not None or s.deferred is not None or not s.joins[j]:
                continue
            c = s.cum_llr[j] - s.anchor[j] if s.anchor_epoch[j] == v.epoch[j] else 0.0
            contributions.append((c, s))
        if not contributions:
            return
        contributions.sort(key=lambda cs: -cs[0])
        named = [s for i, (c, s) in enumerate(contributions) if i == 0 or c >= self.config.localize_llr]
        stat = cusum.statistic
        first_seen = v.anchor_time[j]
        event = f"drift-{self._next_id:06d}"  # alerts raised together share the id of the first
        for s in named:
            # The stratum's steps since the CUSUM left zero (the change-point estimate).
            counts = Counter(k for t, k in s.recent if t >= first_seen)
            if sum(counts.values()) < 50:
                counts = Counter(k for _, k in s.recent)
            delta = tau_change(s, counts)
            action = choose_action(delta, self.config.retrain_threshold, s.beyond)
            evidence = next(c for c, t in contributions if t is s)
            self._open(s, "cusum", stat, None, None, stat / cusum.threshold, counts, delta, action,
                       first_seen, now, {"stratum_llr": round(evidence, 3), "threshold": cusum.threshold,
                                         "drop": self.config.drops[j], "event": event})
        for i, other in enumerate(v.cusums):  # the bank restarts: its sums were made of the same evidence
            if other is not None:
                other.reset()
            v.epoch[i] += 1
            v.anchor_time[i] = now

    def _window_done(self, s: Stratum, now: float) -> None:
        chi2 = s.chi2
        if s.alert is not None:
            matches = chi2.p_value >= self.config.resolve_p and s.window_llr <= 0.0
            s.quiet = s.quiet + 1 if matches else 0
            if s.quiet >= self.config.resolve_windows and self._may_resolve(s.alert):
                self._resolve(s.alert, now, "matches baseline again")
                s.alert = None
                s.quiet = 0
                s.anchor_epoch = [-1] * len(s.anchor_epoch)
        elif s.deferred is not None:
            s.held = None  # its finding awaits the arbiter: a window suspected of drift never joins the baseline
        else:
            self._pending.append(PendingTest(s, chi2.statistic, chi2.df, chi2.p_value, chi2.last_window, s.win_start))
            # Not "no evidence of a drop in this window": that would keep the high windows
            # only and bias the baseline up. The CUSUMs look at the whole version instead.
            quiet = all(c is None or c.statistic < 0.5 * c.threshold for c in s.version.cusums)
            s.grow_baseline(chi2.p_value >= self.config.absorb_p and quiet, self.config)
        s.window_llr = 0.0

    def _round(self, now: float) -> None:
        pending = [p for p in self._pending if p.stratum.alert is None and p.stratum.deferred is None
                   and p.stratum.version.key in self._versions]
        self._pending = []
        if not pending:
            return
        reject, adjusted = adjust([p.p_value for p in pending], self.round_level, self.config.correction)
        event = f"drift-{self._next_id:06d}"
        for p, rej, adj in zip(pending, reject, adjusted):
            s = p.stratum
            if not rej or s.alert is not None or s.deferred is not None:
                continue
            delta = tau_change(s, p.counts)
            action = choose_action(delta, self.config.retrain_threshold, s.beyond)
            score = -math.log10(max(float(adj), 1e-300)) / -math.log10(self.round_level)
            self._open(s, "chi2", p.statistic, p.p_value, float(adj), score, p.counts, delta, action, p.started, now,
                       {"df": p.df, "level": self.round_level, "tested": len(pending), "event": event})

    def _open(self, s: Stratum, detector: str, statistic: float, p_value: float | None, p_adj: float | None,
              score: float, counts: Counter, delta: float, action: Action, first_seen: float, now: float,
              extra: dict[str, Any]) -> None:
        alert = stratum_alert(self._new_id(), s, detector, statistic, p_value, p_adj, score, counts, delta, action,
                              first_seen, now, extra, self.config.retrain_threshold)
        claimed = self._claim(alert)
        if claimed is None:
            # Not granted yet: the stratum leaves the CUSUMs as if alerted. Left in, its drift would fire the
            # bank again at every step until the arbiter answers, and each firing would name, by noise, the
            # quiet strata whose evidence crosses ``localize_llr`` in one of those many tries.
            s.deferred = alert
            return
        s.alert = claimed
        s.quiet = 0
        self._announce(alert, claimed)

    def _claim(self, alert: DriftAlert) -> DriftAlert | None:
        """The alert a finding attaches to its stratum (see ``arbiter``): itself without an arbiter."""
        return alert if self.arbiter is None else self.arbiter.claim(alert)

    def _announce(self, alert: DriftAlert, claimed: DriftAlert) -> None:
        if claimed is alert:
            self._publish("opened", alert)
        else:  # another replica's alert on this stratum: tracked here, announced by its owner
            self.alerts[claimed.id] = claimed

    def _may_resolve(self, alert: DriftAlert) -> bool:
        return self.arbiter is None or self.arbiter.may_resolve(alert)

    def _resolve(self, alert: DriftAlert, now: float, why: str) -> None:
        alert.status = Status.RESOLVED
        alert.resolved_at = float(now)
        alert.resolution = why
        self._publish("resolved", alert)
        self._trim_history()

    def _trim_history(self) -> None:
        resolved = [k for k, a in self.alerts.items() if not a.is_open]
        for k in resolved[: max(0, len(resolved) - self.config.max_history)]:
            del self.alerts[k]

    def _publish(self, event: str, alert: DriftAlert) -> None:
        self.alerts[alert.id] = alert
        log.info("drift alert %s %s: %s", alert.id, event, alert.message)
        for listener in list(self.listeners):
            listener(event, alert)

    def _new_id(self) -> str:
        i = self._next_id
        self._next_id += 1
        return f"drift-{i:06d}"

    # ------------------------------------------------- beyond trained context
    def _count_share(self, v: Version, context_len: int, accepted: int, depth: int, ranks: Sequence[int],
                     cands: Sequence[int], now: float) -> None:
        cfg = self.config
        v.share_n += 1
        if context_len > v.trained_context_len:
            v.share_beyond += 1
            if depth > 0:
                key = chain_key(accepted, depth) if not ranks else (tuple(ranks), tuple(cands))
                v.share_counts[key] += 1
        if v.share_n < cfg.share_window:
            return
        share = v.share_beyond / v.share_n
        counts = v.share_counts
        v.share_n = v.share_beyond = 0
        v.share_counts = Counter()
        if share >= cfg.beyond_share:
            v.hot, v.cool = v.hot + 1, 0
        elif share < cfg.beyond_share / 2:
            v.hot, v.cool = 0, v.cool + 1
        else:
            v.hot = v.cool = 0
        if v.extend_alert is None and v.hot >= cfg.share_windows:
            self._open_extend(v, share, counts, now)
        elif v.extend_alert is not None and v.cool >= cfg.share_windows and self._may_resolve(v.extend_alert):
            self._resolve(v.extend_alert, now, "traffic back within the trained context length")
            v.extend_alert = None

    def _open_extend(self, v: Version, share: float, counts: Counter, now: float) -> None:
        alert = extend_alert(self._new_id(), v, share, counts, now, self.config.beyond_share)
        claimed = self._claim(alert)
        if claimed is None:
            return
        v.extend_alert = claimed
        self._announce(alert, claimed)

    # -------------------------------------------------------------- versions
    def _version(self, limits: Any, worker_id: str, now: float) -> Version:
        key = (str(limits.kind), str(limits.version))
        v = self._versions.get(key)
        if v is None:
            v = Version(key[0], key[1], limits.max_depth, limits.max_width,
                        getattr(limits, "trained_context_len", 0) or 0, len(self.config.drops))
            self._versions[key] = v
            while len(self._versions) > self.config.max_versions:
                _, old = self._versions.popitem(last=False)
                self._retire(old, now, "evicted (drafter version not seen for long)")
        elif next(reversed(self._versions)) != key:
            self._versions.move_to_end(key)
        if worker_id:
            prev = self._workers.get(worker_id)
            if prev != key:
                self._workers[worker_id] = key
                v.workers.add(worker_id)
                old = self._versions.get(prev) if prev is not None else None
                if old is not None:
                    old.workers.discard(worker_id)
                    if not old.workers:
                        self._retire(old, now, f"superseded by {key[0]}/{key[1]}")
                        del self._versions[old.key]
        return v

    def retire_version(self, kind: str, version: str, now: float | None = None, why: str = "retired") -> None:
        """Forget a drafter version; its open alerts resolve with ``why``."""
        v = self._versions.pop((kind, version), None)
        if v is not None:
            self._retire(v, self.clock() if now is None else now, why)

    def worker_left(self, worker_id: str, kind: str, version: str, successor: str, now: float | None = None) -> None:
        """``worker_id`` ran ``kind/version`` and now runs ``successor`` (``kind/version``), whose outcomes this
        monitor may never see (several replicas: another one watches it). As when :meth:`observe_request`
        sees a worker change versions, the old version retires once no worker runs it."""
        key = (kind, version)
        if self._workers.get(worker_id) == key:
            del self._workers[worker_id]
        v = self._versions.get(key)
        if v is None or worker_id not in v.workers:
            return
        v.workers.discard(worker_id)
        if not v.workers:
            self._retire(v, self.clock() if now is None else now, f"superseded by {successor}")
            del self._versions[key]

    def _retire(self, v: Version, now: float, why: str) -> None:
        # With an arbiter, an alert another replica owns is only let go here: the version left this
        # replica's workers, not necessarily the fleet's.
        for s in v.strata.values():
            if s.alert is not None:
                if self._may_resolve(s.alert):
                    self._resolve(s.alert, now, why)
                s.alert = None
        if v.extend_alert is not None:
            if self._may_resolve(v.extend_alert):
                self._resolve(v.extend_alert, now, why)
            v.extend_alert = None
        for w in v.workers:
            if self._workers.get(w) == v.key:
                del self._workers[w]

    def adopt(self, alert: DriftAlert) -> bool:
        """Attach an open alert read back from a store to its stratum, so it is not raised twice.

        Returns False (and keeps nothing) when the alert is not open, or its
        drafter version or stratum is not tracked (e.g. its baseline was not
        restored), or the stratum already has another open alert.
        """
        v = self._versions.get((alert.drafter_kind, alert.drafter_version))
        if v is None or not alert.is_open:
            return False
        if alert.detector == "context_share":
            if v.extend_alert is not None and v.extend_alert.id != alert.id:
                return False
            v.extend_alert = alert
        else:
            bucket = max(bisect_right(self.config.context_edges, alert.context_len_min) - 1, 0)
            s = v.strata.get((bucket, alert.domain))
            if s is None or s.weights is None or (s.alert is not None and s.alert.id != alert.id):
                return False
            s.alert = alert
            s.deferred = None  # the alert stands for the finding that waited
            s.quiet = 0
        self.alerts[alert.id] = alert
        number = alert.id.rpartition("-")[2]
        if number.isdigit():
            self._next_id = max(self._next_id, int(number) + 1)
        return True

    def open_claimed(self, alert: DriftAlert) -> bool:
        """Attach a finding the arbiter deferred and now grants, and announce it opened; False (nothing
        announced) when its stratum is gone or already has an alert."""
        if not alert.is_open or not self.adopt(alert):
            return False
        self._publish("opened", alert)
        return True

    def withdraw(self, finding: DriftAlert) -> bool:
        """The arbiter drops a finding it deferred (not granted in time, or its version moved elsewhere): the
        finding's stratum rejoins the CUSUMs and the chi-square rounds with fresh evidence. True if one waited."""
        v = self._versions.get((finding.drafter_kind, finding.drafter_version))
        if v is None or finding.detector == "context_share":
            return False
        bucket = max(bisect_right(self.config.context_edges, finding.context_len_min) - 1, 0)
        s = v.strata.get((bucket, finding.domain))
        if s is None or s.deferred is None:
            return False
        s.deferred = None
        s.anchor_epoch = [-1] * len(s.anchor_epoch)
        return True

    def detach(self, alert_id: str, resolved: DriftAlert | None = None) -> bool:
        """Let go of an alert another replica resolved: its stratum is watched again from now on, and the
        kept copy takes ``resolved``'s status. True if a stratum held it."""
        found = False
        for v in self._versions.values():
            if v.extend_alert is not None and v.extend_alert.id == alert_id:
                v.extend_alert = None
                v.hot = v.cool = 0
                found = True
            for s in v.strata.values():
                if s.alert is not None and s.alert.id == alert_id:
                    s.alert = None
                    s.quiet = 0
                    s.anchor_epoch = [-1] * len(s.anchor_epoch)
                    found = True
        kept = self.alerts.get(alert_id)
        if kept is not None and resolved is not None:
            kept.status, kept.resolved_at, kept.resolution = resolved.status, resolved.resolved_at, resolved.resolution
            if kept.acked_at is None and resolved.acked_at is not None:
                kept.acked_at, kept.acked_by = resolved.acked_at, resolved.acked_by
            self._trim_history()
        return found

    # ---------------------------------------------------------------- output
    def open_alerts(self) -> list[DriftAlert]:
        """Open alerts, oldest first."""
        return [a for a in self.alerts.values() if a.is_open]

    def snapshot(self) -> dict[str, Any]:
        """Operator view: per version and stratum, baseline progress, last p-value, open alert."""
        out: dict[str, Any] = {"steps": self._steps, "versions": []}
        for v in self._versions.values():
            strata = []
            for s in sorted(v.strata.values(), key=lambda s: (s.bucket, s.domain)):
                strata.append({
                    "stratum": s.label, "beyond_trained_context": s.beyond, "steps": s.n_seen,
                    "baseline": sum(s.chi2.baseline_counts.values()), "baseline_ready": s.weights is not None,
                    "last_p_value": None if math.isnan(s.chi2.p_value) else s.chi2.p_value,
                    "open_alert": s.alert.id if s.alert else None,
                })
            out["versions"].append({
                "drafter_kind": v.kind, "drafter_version": v.version, "steps": v.steps,
                "cusum_thresholds": [c.threshold if c else None for c in v.cusums],
                "cusum_statistics": [c.statistic if c else None for c in v.cusums],
                "workers": sorted(v.workers), "strata": strata,
                "extend_alert": v.extend_alert.id if v.extend_alert else None,
            })
        return out

    # ----------------------------------------------------------- persistence
    def to_dict(self, alerts: bool = True) -> dict[str, Any]:
        """Baselines, alerts (unless ``alerts`` is False: a store keeps them) and bookkeeping as
        JSON-ready data (live windows are not kept; :mod:`controller.drift.persistence`)."""
        return monitor_to_dict(self, alerts)

    @classmethod
    def from_dict(cls, data: dict[str, Any], clock: Callable[[], float] = time.time) -> "AcceptanceDriftMonitor":
        """Rebuild a monitor from :meth:`to_dict` output (baselines recalibrate, cached)."""
        return monitor_from_dict(cls, data, clock)
