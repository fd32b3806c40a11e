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
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from controller.drift.accept_chi2 import AcceptLengthChiSquare
from controller.drift.alerts import Action, DriftAlert, Severity, Status
from controller.drift.base import check_choice, check_float, check_int
from controller.drift.calibration import cached, cusum_threshold, path_laws
from controller.drift.cells import OutcomeKey, chain_key, key_bins, keys_matrix, sticks, tau_histogram
from controller.drift.cusum import CUSUM
from controller.drift.multitest import adjust
from policies.chain import expected_chain_accepted

log = logging.getLogger("specctl.drift")

DEFAULT_CONTEXT_EDGES: tuple[int, ...] = (0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class MonitorConfig:
    """Settings of :class:`AcceptanceDriftMonitor` (validated on construction).

    Attributes
    ----------
    context_edges : tuple of int
        Lower edges of the context buckets (first 0), as the controller's.
    baseline_steps : int
        Request-steps per stratum that form its first baseline.
    baseline_max : int
        The baseline keeps growing with windows that match it (each absorbed
        one window late, so the start of a drift is not), up to this many
        request-steps: a larger baseline means less estimation noise, hence a
        lower calibrated threshold and a sharper likelihood ratio. Equal to
        ``baseline_steps`` freezes it.
    absorb_p : float
        A window is absorbed only if its p-value is at least this and the
        version's CUSUMs are below half their thresholds (a criterion on the
        window's own direction would bias the baseline).
    window : int
        Request-steps per chi-square window of a stratum.
    ert : float
        Request-steps between false alarms without drift, whole monitor.
    cusum_share : float
        Part of the false-alarm rate given to the CUSUM (the rest goes to the
        chi-square rounds): the CUSUM is the fast detector of falls, the
        chi-square windows see shape changes that are large by nature. The
        chi-square calibration is close to exact; the CUSUM's bounds the alarm
        rate averaged over the baseline's estimation error and lands 5-7x
        below its share at 10^5-10^6 request-steps (measured on long
        no-change streams, ``specctl bench drift``), hence the large share.
    round_steps : int
        Request-steps between two multiple-testing rounds.
    correction : str
        ``"bh"`` (Benjamini–Hochberg) or ``"holm"``.
    drops : tuple of float
        Relative drops of the stick probabilities the CUSUM bank is tuned to
        (one CUSUM each, sharing ``cusum_share``). A CUSUM tuned to ``d``
        reacts to drops from about ``d / 2`` and is fastest at ``d``; the
        smallest entry sets what the monitor tolerates (e.g. a context shift
        within a bucket).
    resolve_windows : int
        Consecutive matching windows that resolve an alert.
    resolve_p : float
        A window "matches" when its p-value is at least this.
    localize_llr : float
        Log-likelihood-ratio (nats) a stratum must have gathered to be named
        in a CUSUM alert (the largest contributor always is).
    precision_z : float
        A stratum joins the CUSUM for a drop only when its baseline is precise
        enough: the CUSUM's drift without drift stays negative ``precision_z``
        bootstrap standard deviations out.
    retrain_threshold : float
        Relative change of the expected accepted length at or below which
        the action is ``RETRAIN_HEADS`` (otherwise ``INVESTIGATE``).
    beyond_share : float
        Share of a version's request-steps past its trained context length
        that raises ``EXTEND_TRAINING_CONTEXT``.
    share_window, share_windows : int
        Request-steps per share measurement; consecutive measurements needed
        to open (at or above ``beyond_share``) or resolve (below half of it).
    n_bootstrap : int
        Null draws per stratum for the chi-square calibration.
    cusum_paths, cusum_horizon : int
        Bootstrap paths and their length for the CUSUM calibration.
    max_versions : int
        Drafter versions tracked (least recently seen dropped).
    max_history : int
        Resolved alerts kept.
    seed : int
        Seed of every bootstrap.
    """

    context_edges: tuple[int, ...] = DEFAULT_CONTEXT_EDGES
    baseline_steps: int = 2000
    baseline_max: int = 10_000
    absorb_p: float = 0.01
    window: int = 400
    ert: float = 1e8
    cusum_share: float = 0.9
    round_steps: int = 500
    correction: str = "bh"
    drops: tuple[float, ...] = (0.10, 0.035)
    resolve_windows: int = 3
    resolve_p: float = 0.05
    localize_llr: float = 2.0
    precision_z: float = 2.5
    retrain_threshold: float = -0.03
    beyond_share: float = 0.05
    share_window: int = 2000
    share_windows: int = 2
    n_bootstrap: int = 2048
    cusum_paths: int = 128
    cusum_horizon: int = 2048
    max_versions: int = 16
    max_history: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.context_edges)
        if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"context_edges must start at 0 and increase strictly, got {self.context_edges!r}")
        object.__setattr__(self, "context_edges", edges)

        def number(name: str, *bounds: float, **open_ends: bool) -> None:
            # stored as checked: "1.0e8" from a YAML file is a string until here
            object.__setattr__(self, name, check_float(name, getattr(self, name), *bounds, **open_ends))

        check_int("baseline_steps", self.baseline_steps, 50)
        check_int("baseline_max", self.baseline_max, self.baseline_steps)
        number("absorb_p", 0.0, 1.0, high_open=True)
        check_int("window", self.window, 20)
        number("ert", 2.0 * self.round_steps, low_open=True)
        check_int("round_steps", self.round_steps, 1)
        number("cusum_share", 0.0, 1.0, low_open=True, high_open=True)
        check_choice("correction", self.correction, ("bh", "holm"))
        drops = tuple(float(check_float("drops", d, 0.0, 0.9, low_open=True)) for d in self.drops)
        if not drops:
            raise ValueError(f"drops must name at least one relative drop, got {self.drops!r}")
        object.__setattr__(self, "drops", drops)
        check_int("resolve_windows", self.resolve_windows, 1)
        number("resolve_p", 0.0, 1.0, low_open=True, high_open=True)
        number("localize_llr", 0.0)
        number("precision_z", 0.0)
        number("retrain_threshold", -1.0, 0.0)
        number("beyond_share", 0.0, 1.0, low_open=True)
        check_int("share_window", self.share_window, 10)
        check_int("share_windows", self.share_windows, 1)
        check_int("n_bootstrap", self.n_bootstrap, 64)
        check_int("cusum_paths", self.cusum_paths, 16)
        check_int("cusum_horizon", self.cusum_horizon, 100)
        check_int("max_versions", self.max_versions, 1)
        check_int("max_history", self.max_history, 0)
        check_int("seed", self.seed, 0)


def llr_weights(bins: np.ndarray, drop: float, min_trials: float = 5.0) -> np.ndarray:
    """Per-bin log-likelihood-ratio weights of "every stick × (1 − drop)" vs the baseline sticks.

    ``bins`` are summed baseline trials ``[..., 2 * cells]``; the returned
    weights have the same shape: a success in a cell scores ``ln(1 − drop)``, a
    failure ``ln((1 − (1 − drop)·s) / (1 − s))``. Cells with fewer than
    ``min_trials`` baseline trials score 0 (nothing known about them).

    >>> w = llr_weights(np.array([80.0, 20.0]), drop=0.1)   # one cell, s ≈ 0.8
    >>> [round(float(v), 3) for v in w]
    [-0.105, 0.331]
    """
    c = bins.shape[-1] // 2
    succ, fail = bins[..., :c], bins[..., c:]
    n = succ + fail
    s = np.clip((succ + 0.5) / (n + 1.0), 0.02, 0.98)
    w_s = np.full_like(s, math.log1p(-drop))
    w_f = np.log((1.0 - (1.0 - drop) * s) / (1.0 - s))
    known = n >= min_trials
    return np.concatenate([np.where(known, w_s, 0.0), np.where(known, w_f, 0.0)], axis=-1)


@dataclass
class _Pending:
    stratum: "_Stratum"
    statistic: float
    df: float
    p_value: float
    counts: Counter
    started: float


class _Stratum:
    __slots__ = ("version", "bucket", "domain", "lo", "hi", "beyond", "chi2", "weights", "scores", "cum_llr",
                 "anchor", "anchor_epoch", "alert", "quiet", "window_llr", "n_seen", "win_start", "label",
                 "recent", "held", "fitted", "joins")

    def __init__(self, version: "_Version", bucket: int, domain: str, config: MonitorConfig, seed: int) -> None:
        edges = config.context_edges
        self.version = version
        self.bucket = bucket
        self.domain = domain
        self.lo = edges[bucket]
        self.hi = edges[bucket + 1] if bucket + 1 < len(edges) else 0
        L = version.trained_context_len
        # A bucket that starts past the trained length is "beyond": its acceptance
        # is expected to fall, and that is the EXTEND_TRAINING_CONTEXT finding's
        # business. A bucket that merely reaches past L (heads trained on short
        # answers, say 300 tokens, and the [0, 1024) bucket) is still watched for
        # content drift; its traffic past L is counted by the context-share detector.
        self.beyond = L > 0 and self.lo >= L
        self.chi2 = AcceptLengthChiSquare(version.max_depth, version.max_width, n_baseline=config.baseline_steps,
                                          window=config.window, n_bootstrap=config.n_bootstrap, seed=seed)
        self.weights: np.ndarray | None = None  # [drops, bins]
        self.scores: dict[OutcomeKey, tuple[float, ...]] = {}
        n = len(config.drops)
        self.cum_llr = [0.0] * n
        self.anchor = [0.0] * n
        self.anchor_epoch = [-1] * n
        self.alert: DriftAlert | None = None
        self.quiet = 0
        self.window_llr = 0.0
        self.n_seen = 0
        self.win_start = 0.0
        self.recent: deque[tuple[float, OutcomeKey]] = deque(maxlen=config.window)
        self.held: Counter | None = None  # a matching window waiting one window before it joins the baseline
        self.fitted = 0  # baseline size at the last fit
        self.joins = [False] * n  # per CUSUM of the bank: is the baseline precise enough to take part
        hi = str(self.hi) if self.hi else "inf"
        self.label = f"ctx[{self.lo},{hi})" + (f"/{domain}" if domain else "")

    def score(self, key: OutcomeKey) -> tuple[float, ...]:
        s = self.scores.get(key)
        if s is None:
            s = tuple((self.weights @ key_bins(key, self.version.max_depth, self.version.max_width)).tolist())
            self.scores[key] = s
        return s


class _Version:
    def __init__(self, kind: str, version: str, max_depth: int, max_width: int, trained_context_len: int,
                 n_drops: int) -> None:
        self.kind = kind
        self.version = version
        self.max_depth = max(int(max_depth), 1)
        self.max_width = max(int(max_width), 1)
        self.trained_context_len = int(trained_context_len)
        self.strata: dict[tuple[int, str], _Stratum] = {}
        self.cusums: list[CUSUM | None] = [None] * n_drops  # built at the first calibration
        self.dirty = False
        self.calibrated_size = 0  # in-range baseline request-steps at the last calibration
        self.calibrated_at = 0  # version steps at the last calibration
        self.epoch = [0] * n_drops
        self.anchor_time = [0.0] * n_drops
        self.workers: set[str] = set()
        self.steps = 0
        self.share_n = 0
        self.share_beyond = 0
        self.share_counts: Counter = Counter()
        self.hot = 0
        self.cool = 0
        self.extend_alert: DriftAlert | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.version)


class AcceptanceDriftMonitor:
    """Drift monitor of acceptance per drafter version × context bucket (× domain).

    Parameters
    ----------
    config
        :class:`MonitorConfig` (defaults when ``None``).
    clock
        Time source for steps that carry no timestamp.
    **overrides
        Fields of :class:`MonitorConfig` to override.

    Attributes
    ----------
    alerts : OrderedDict of str to DriftAlert
        Every alert kept (open ones, then up to ``max_history`` resolved).
    listeners : list of callables
        Called as ``listener(event, alert)`` with event ``"opened"`` or
        ``"resolved"`` (the hook for WatchAlerts streams, logs and sinks).

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
                 **overrides: Any) -> None:
        config = config or MonitorConfig()
        if overrides:
            unknown = set(overrides) - set(MonitorConfig.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown MonitorConfig field(s): {', '.join(sorted(unknown))}")
            config = MonitorConfig(**{**asdict(config), **overrides})
        self.config = config
        self.clock = clock
        self._versions: OrderedDict[tuple[str, str], _Version] = OrderedDict()
        self._workers: dict[str, tuple[str, str]] = {}
        self._pending: list[_Pending] = []
        self._steps = 0
        self._next_id = 1
        self.alerts: OrderedDict[str, DriftAlert] = OrderedDict()
        self.listeners: list[Callable[[str, DriftAlert], None]] = []
        self.ert_cusum = config.ert / config.cusum_share
        self.ert_chi2 = config.ert / (1.0 - config.cusum_share)
        self.round_level = min(0.5, config.round_steps / self.ert_chi2)
        self._small = int(np.argmin(config.drops))

    # ------------------------------------------------------------------ input
    def observe_step(self, state: Any, step: Any) -> None:
        """Controller ``on_step`` hook: ``(WorkerState, StepReport)`` → every request of the step.

        ``state`` needs ``limits`` (kind, version, max_depth, max_width,
        trained_context_len) and may have ``worker_id``; ``step`` needs
        ``timestamp`` and ``requests`` (``RequestStep``-like).
        """
        limits = state.limits
        now = float(getattr(step, "timestamp", 0.0) or 0.0) or self.clock()
        worker = getattr(state, "worker_id", "") or ""
        for r in step.requests:
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

    def _observe(self, v: _Version, context_len: int, key: OutcomeKey, domain: str, now: float) -> None:
        bucket = max(bisect_right(self.config.context_edges, context_len) - 1, 0)
        s = v.strata.get((bucket, domain))
        if s is None:
            s = v.strata[(bucket, domain)] = _Stratum(v, bucket, domain, self.config, self.config.seed)
        s.n_seen += 1
        chi2 = s.chi2
        if s.weights is None:
            chi2.update_key(key)
            if chi2.baseline_ready:
                self._baseline_done(s)
            return
        if not chi2.window_counts:
            s.win_start = now
        chi2.update_key(key)
        us = s.score(key)
        s.window_llr += us[self._small]  # resolution listens to the most sensitive CUSUM's evidence
        s.recent.append((now, key))
        if not s.beyond and s.alert is None:
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
            self._calibrate(v)  # at most once per window of the version's steps: completions batch up

    # ------------------------------------------------------------- baselines
    def _baseline_done(self, s: _Stratum) -> None:
        self._fit_weights(s)
        s.version.dirty = True

    def _fit_weights(self, s: _Stratum) -> None:
        """Likelihood-ratio weights per drop, and which CUSUMs of the bank the stratum may join.

        A stratum joins the CUSUM for ``drop`` only when its baseline is
        precise enough that the sum still drifts down without drift: over
        bootstrap replicates of the baseline, the mean increment under the
        empirical distribution plus ``precision_z`` standard deviations must
        stay below zero. Otherwise a baseline that happened to come out a
        little high would read as a small drop (the smaller the drop a CUSUM
        is tuned to, the larger the baseline it needs).
        """
        chi2 = s.chi2
        s.fitted = sum(chi2.baseline_counts.values())
        s.weights = np.stack([llr_weights(chi2.baseline_bins, d) for d in self.config.drops])
        s.scores = {}
        keys = sorted(chi2.baseline_counts)
        matrix = keys_matrix(keys, s.version.max_depth, s.version.max_width)
        freq = np.array([chi2.baseline_counts[k] for k in keys], dtype=np.float64)
        cfg = self.config
        # Sticky: the baseline only grows, so a stratum that was precise enough stays in.
        s.joins = [joined or bool(cached(("precise", matrix, freq, d, cfg.precision_z, cfg.seed),
                                         lambda: _precise_enough(matrix, freq, d, cfg.precision_z, cfg.seed)))
                   for joined, d in zip(s.joins, cfg.drops)]

    def _calibrate(self, v: _Version) -> None:
        """(Re)calibrate the version's CUSUM on its in-range strata with a baseline."""
        v.dirty = False
        strata = sorted((s for s in v.strata.values() if s.weights is not None and not s.beyond),
                        key=lambda s: (s.bucket, s.domain))
        if not strata:
            return
        v.calibrated_size = sum(sum(s.chi2.baseline_counts.values()) for s in strata)
        v.calibrated_at = v.steps
        seen = np.array([float(s.n_seen) for s in strata])
        shares = np.round(seen / seen.sum(), 2) + 1e-3
        shares = shares / shares.sum()
        cfg = self.config
        active = [j for j in range(len(cfg.drops)) if any(s.joins[j] for s in strata)]
        ert = self.ert_cusum * max(len(active), 1)  # the active CUSUMs share the CUSUM budget equally
        for j, drop in enumerate(cfg.drops):
            if j not in active:
                v.cusums[j] = None
                continue
            parts, part_shares = [], []
            for s, share in zip(strata, shares):
                if s.joins[j]:
                    counts = s.chi2.baseline_counts
                    keys = sorted(counts)
                    parts.append((keys_matrix(keys, v.max_depth, v.max_width),
                                  np.array([counts[k] for k in keys], dtype=np.float64)))
                    part_shares.append(share)
            idle = round(1.0 - float(sum(part_shares)), 2)  # steps of strata not taking part add nothing
            part_shares = np.array(part_shares) / sum(part_shares)
            mats = tuple(x for m, f in parts for x in (m, f))
            cal = cached(("version-cusum",) + mats + (part_shares, idle, drop, ert, cfg.cusum_paths,
                                                      cfg.cusum_horizon, cfg.seed),
                         lambda: _calibrate_llr_cusum(parts, part_shares, drop, ert, cfg.cusum_paths,
                                                      cfg.cusum_horizon, cfg.seed, idle))
            h = max(cal.threshold, 1e-6)
            if v.cusums[j] is None:
                v.cusums[j] = CUSUM(direction="up", target=0.0, slack=0.0, threshold=h)
                v.epoch[j] += 1
            else:
                v.cusums[j].threshold = h
            log.debug("drift: %s/%s CUSUM(drop=%g) h=%.2f over %d strata", v.kind, v.version, drop, h, len(parts))

    # ---------------------------------------------------------------- alarms
    def _cusum_alarm(self, v: _Version, j: int, now: float) -> None:
        cusum = v.cusums[j]
        contributions = []
        for s in v.strata.values():
            if s.weights is None or s.beyond or s.alert is not None or not s.joins[j]:
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
            delta = self._tau_change(s, counts)
            action = Action.RETRAIN_HEADS if delta <= self.config.retrain_threshold else Action.INVESTIGATE
            evidence = next(c for c, t in contributions if t is s)
            self._open(s, "cusum", stat, None, None, stat / cusum.threshold, counts, delta, action,
                       first_seen, now, {"stratum_llr": round(evidence, 3), "threshold": cusum.threshold,
                                         "drop": self.config.drops[j], "event": event})
        for i, other in enumerate(v.cusums):  # the bank restarts: its sums were made of the same evidence
            if other is not None:
                other.reset()
            v.epoch[i] += 1
            v.anchor_time[i] = now

    def _window_done(self, s: _Stratum, now: float) -> None:
        chi2 = s.chi2
        if s.alert is not None:
            matches = chi2.p_value >= self.config.resolve_p and s.window_llr <= 0.0
            s.quiet = s.quiet + 1 if matches else 0
            if s.quiet >= self.config.resolve_windows:
                self._resolve(s.alert, now, "matches baseline again")
                s.alert = None
                s.quiet = 0
                s.anchor_epoch = [-1] * len(s.anchor_epoch)
        else:
            self._pending.append(_Pending(s, chi2.statistic, chi2.df, chi2.p_value, chi2.last_window, s.win_start))
            # Not "no evidence of a drop in this window": that would keep the high windows
            # only and bias the baseline up. The CUSUMs look at the whole version instead.
            quiet = all(c is None or c.statistic < 0.5 * c.threshold for c in s.version.cusums)
            self._grow_baseline(s, chi2.p_value >= self.config.absorb_p and quiet)
        s.window_llr = 0.0

    def _grow_baseline(self, s: _Stratum, matches: bool) -> None:
        """Absorb the window held back if this one matches too; refit on doubling."""
        chi2 = s.chi2
        size = sum(chi2.baseline_counts.values())
        if matches and s.held is not None and size < self.config.baseline_max:
            chi2.baseline_counts.update(s.held)
            size += sum(s.held.values())
        s.held = chi2.last_window if matches else None
        if size >= min(1.25 * s.fitted, self.config.baseline_max) > s.fitted:
            chi2.fit(chi2.baseline_counts)
            joined = list(s.joins)
            self._fit_weights(s)
            v = s.version
            inside = sum(sum(t.chi2.baseline_counts.values()) for t in v.strata.values()
                         if t.weights is not None and not t.beyond)
            if not s.beyond and (s.joins != joined or inside >= 2.0 * v.calibrated_size):
                v.dirty = True  # a lower threshold is now justified; the old one stays conservative meanwhile

    def _round(self, now: float) -> None:
        pending = [p for p in self._pending if p.stratum.alert is None and p.stratum.version.key in self._versions]
        self._pending = []
        if not pending:
            return
        reject, adjusted = adjust([p.p_value for p in pending], self.round_level, self.config.correction)
        event = f"drift-{self._next_id:06d}"
        for p, rej, adj in zip(pending, reject, adjusted):
            s = p.stratum
            if not rej or s.alert is not None:
                continue
            delta = self._tau_change(s, p.counts)
            if s.beyond:
                action = Action.EXTEND_TRAINING_CONTEXT
            elif delta <= self.config.retrain_threshold:
                action = Action.RETRAIN_HEADS
            else:
                action = Action.INVESTIGATE
            score = -math.log10(max(float(adj), 1e-300)) / -math.log10(self.round_level)
            self._open(s, "chi2", p.statistic, p.p_value, float(adj), score, p.counts, delta, action, p.started, now,
                       {"df": p.df, "level": self.round_level, "tested": len(pending), "event": event})

    def _open(self, s: _Stratum, detector: str, statistic: float, p_value: float | None, p_adj: float | None,
              score: float, counts: Counter, delta: float, action: Action, first_seen: float, now: float,
              extra: dict[str, Any]) -> None:
        v = s.version
        base_bins = s.chi2.baseline_bins
        cur_bins = s.chi2.window_bins(counts)
        if action is Action.RETRAIN_HEADS:
            severity = Severity.CRITICAL if delta <= -0.2 else Severity.WARNING
        elif action is Action.EXTEND_TRAINING_CONTEXT:
            severity = Severity.CRITICAL if delta <= -0.2 else Severity.WARNING
        else:
            severity = Severity.INFO if delta > -self.config.retrain_threshold else Severity.WARNING
        what = {Action.RETRAIN_HEADS: "acceptance fell within the stratum: retrain the draft heads on current traffic",
                Action.EXTEND_TRAINING_CONTEXT: "acceptance moved beyond the trained context length",
                Action.INVESTIGATE: "the accept-length distribution changed without a loss"}[action]
        alert = DriftAlert(
            id=self._new_id(), drafter_kind=v.kind, drafter_version=v.version, stratum=s.label,
            context_len_min=s.lo, context_len_max=s.hi, domain=s.domain, detector=detector,
            statistic=float(statistic), p_value=p_value, p_adjusted=p_adj, score=float(score),
            baseline_hist=tau_histogram(s.chi2.baseline_counts, v.max_depth),
            current_hist=tau_histogram(counts, v.max_depth),
            baseline_alpha=_alpha(base_bins, v), current_alpha=_alpha(cur_bins, v),
            expected_tau_change=round(float(delta), 4), first_seen=float(first_seen), opened_at=float(now),
            severity=severity, action=action,
            message=f"{v.kind}/{v.version} {s.label}: {what} (E[τ] {delta:+.1%}, {detector})",
            n_baseline=sum(s.chi2.baseline_counts.values()), n_current=sum(counts.values()), extra=extra)
        s.alert = alert
        s.quiet = 0
        self._publish("opened", alert)

    def _resolve(self, alert: DriftAlert, now: float, why: str) -> None:
        alert.status = Status.RESOLVED
        alert.resolved_at = float(now)
        alert.resolution = why
        self._publish("resolved", alert)
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

    def _tau_change(self, s: _Stratum, counts: Counter) -> float:
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

    # ------------------------------------------------- beyond trained context
    def _count_share(self, v: _Version, context_len: int, accepted: int, depth: int, ranks: Sequence[int],
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
        elif v.extend_alert is not None and v.cool >= cfg.share_windows:
            self._resolve(v.extend_alert, now, "traffic back within the trained context length")
            v.extend_alert = None

    def _open_extend(self, v: _Version, share: float, counts: Counter, now: float) -> None:
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
        alert = DriftAlert(
            id=self._new_id(), drafter_kind=v.kind, drafter_version=v.version, stratum=f"ctx>{L}",
            context_len_min=L, context_len_max=0, domain="", detector="context_share", statistic=round(share, 4),
            p_value=None, p_adjusted=None, score=share / self.config.beyond_share,
            baseline_hist=tau_histogram(base_counts, v.max_depth), current_hist=tau_histogram(counts, v.max_depth),
            baseline_alpha=[round(float(a), 4) for a in a_base], current_alpha=[round(float(a), 4) for a in a_cur],
            expected_tau_change=round(float(delta), 4), first_seen=float(now), opened_at=float(now),
            severity=Severity.CRITICAL if share >= 0.25 else Severity.WARNING,
            action=Action.EXTEND_TRAINING_CONTEXT,
            message=(f"{v.kind}/{v.version}: {share:.0%} of request-steps run past the trained context length "
                     f"{L} ({compared}): extend the training context"),
            n_baseline=sum(base_counts.values()), n_current=sum(counts.values()))
        v.extend_alert = alert
        self._publish("opened", alert)

    # -------------------------------------------------------------- versions
    def _version(self, limits: Any, worker_id: str, now: float) -> _Version:
        key = (str(limits.kind), str(limits.version))
        v = self._versions.get(key)
        if v is None:
            v = _Version(key[0], key[1], limits.max_depth, limits.max_width,
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

    def _retire(self, v: _Version, now: float, why: str) -> None:
        for s in v.strata.values():
            if s.alert is not None:
                self._resolve(s.alert, now, why)
                s.alert = None
        if v.extend_alert is not None:
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
            s.quiet = 0
        self.alerts[alert.id] = alert
        number = alert.id.rpartition("-")[2]
        if number.isdigit():
            self._next_id = max(self._next_id, int(number) + 1)
        return True

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
        JSON-ready data (live windows are not kept)."""
        versions = []
        for v in self._versions.values():
            strata = []
            for s in v.strata.values():
                if s.weights is None:
                    continue
                strata.append({"bucket": s.bucket, "domain": s.domain, "steps": s.n_seen,
                               "alert": s.alert.id if s.alert else None,
                               "baseline": [[list(k[0]), list(k[1]), n]
                                            for k, n in sorted(s.chi2.baseline_counts.items())]})
            versions.append({"kind": v.kind, "version": v.version, "max_depth": v.max_depth,
                             "max_width": v.max_width, "trained_context_len": v.trained_context_len,
                             "workers": sorted(v.workers), "strata": strata,
                             "extend_alert": v.extend_alert.id if v.extend_alert else None})
        cfg = asdict(self.config)
        cfg["context_edges"] = list(cfg["context_edges"])
        cfg["drops"] = list(cfg["drops"])
        return {"format": 1, "config": cfg, "next_id": self._next_id, "versions": versions,
                "alerts": [a.to_dict() for a in self.alerts.values()] if alerts else []}

    @classmethod
    def from_dict(cls, data: dict[str, Any], clock: Callable[[], float] = time.time) -> "AcceptanceDriftMonitor":
        """Rebuild a monitor from :meth:`to_dict` output (baselines recalibrate, cached)."""
        if data.get("format") != 1:
            raise ValueError(f"format must be 1, got {data.get('format')!r}")
        cfg = dict(data["config"])
        cfg["context_edges"] = tuple(cfg["context_edges"])
        cfg["drops"] = tuple(cfg["drops"])
        mon = cls(MonitorConfig(**cfg), clock=clock)
        mon._next_id = int(data.get("next_id", 1))
        for d in data.get("alerts", []):
            alert = DriftAlert.from_dict(d)
            mon.alerts[alert.id] = alert
        for vd in data.get("versions", []):
            v = _Version(vd["kind"], vd["version"], vd["max_depth"], vd["max_width"], vd["trained_context_len"],
                         len(mon.config.drops))
            mon._versions[v.key] = v
            for w in vd.get("workers", []):
                v.workers.add(w)
                mon._workers[w] = v.key
            if vd.get("extend_alert"):
                v.extend_alert = mon.alerts.get(vd["extend_alert"])
            for sd in vd["strata"]:
                s = _Stratum(v, int(sd["bucket"]), sd["domain"], mon.config, mon.config.seed)
                s.n_seen = int(sd.get("steps", 0))
                s.chi2.fit({(tuple(r), tuple(c)): int(n) for r, c, n in sd["baseline"]})
                mon._fit_weights(s)
                if sd.get("alert"):
                    s.alert = mon.alerts.get(sd["alert"])
                v.strata[(s.bucket, s.domain)] = s
            mon._calibrate(v)
        return mon


def _alpha(bins: np.ndarray, v: _Version) -> list[float]:
    return [round(float(a), 4) for a in sticks(bins, v.max_depth, v.max_width)[:, 0]]


def _precise_enough(matrix: np.ndarray, freq: np.ndarray, drop: float, z: float, seed: int, n_boot: int = 64) -> bool:
    """Does the LLR for ``drop`` drift down under the baseline's own sampling error (see ``_fit_weights``)?"""
    rng = np.random.default_rng(seed)
    n = int(freq.sum())
    p = freq / n
    boot = rng.multinomial(n, p, size=n_boot).astype(np.float64) @ matrix
    drift = (llr_weights(boot, drop) @ matrix.T) @ p  # mean increment per step, one per replicate
    return bool(drift.mean() + z * drift.std() < 0.0)


def _calibrate_llr_cusum(parts: list[tuple[np.ndarray, np.ndarray]], shares: np.ndarray, drop: float, ert: float,
                         paths: int, horizon: int, seed: int, idle: float = 0.0):
    """Double bootstrap of the stratified LLR CUSUM: per path, each stratum's baseline is
    resampled (its own estimation error, hence its own weights) and the stream
    is drawn from the empirical baselines in the traffic shares; a share
    ``idle`` of the steps (strata not taking part) adds nothing."""
    rng = np.random.default_rng(seed)
    probs = np.concatenate([share * f / f.sum() for (m, f), share in zip(parts, shares)] + [np.array([0.0])])
    probs *= (1.0 - idle) / probs.sum()
    probs[-1] = idle
    probs /= probs.sum()
    replicates = max(paths, 1024)  # baseline replicates: the first ``paths`` are also simulated
    scores = np.zeros((replicates, probs.size))
    off = 0
    for m, f in parts:
        boot = rng.multinomial(int(f.sum()), f / f.sum(), size=replicates).astype(np.float64) @ m  # [reps, bins]
        scores[:, off:off + f.size] = llr_weights(boot, drop) @ m.T
        off += f.size
    laws = path_laws(scores, probs)
    cdf = np.cumsum(probs)
    idx = np.minimum(np.searchsorted(cdf, rng.random((paths, horizon)) * cdf[-1], side="right"), probs.size - 1)
    inc = np.take_along_axis(scores[:paths], idx, axis=1)
    return cusum_threshold(inc, ert, path_laws=tuple(a[:paths] for a in laws), solve_laws=laws)
