"""Per-stratum state of the drift monitor: baselines, windows and the version's CUSUM bank.

The monitor (:mod:`controller.drift.monitor`) never pools: a stratum is one
context bucket (× domain tag) of one drafter version, and everything it
compares lives here, beside the data it is computed from:

* :class:`Stratum` — the stratum's baseline and tumbling windows (its
  :class:`~controller.drift.accept_chi2.AcceptLengthChiSquare`), the
  likelihood-ratio weights fitted to that baseline and which CUSUMs of the
  bank it is precise enough to join, its share of the CUSUM evidence, its
  open alert, and how the baseline grows with windows that match it;
* :class:`Version` — one drafter version (kind, version, depth and width
  limits, trained context length): its strata, its bank of stratified
  CUSUMs and their calibration on the strata's baselines, the workers that
  run it, and the context-share counters of the ``EXTEND_TRAINING_CONTEXT``
  finding;
* :class:`PendingTest` — a window's chi-square result waiting for the next
  multiple-testing round.

Which alert a change calls for is :mod:`controller.drift.actions`; when the
detectors run and alerts open or resolve is the monitor's.

Examples
--------
>>> from controller.drift.cells import chain_key
>>> from controller.drift.config import MonitorConfig
>>> cfg = MonitorConfig(baseline_steps=200, window=100, n_bootstrap=128)
>>> v = Version("eagle", "v1", max_depth=4, max_width=1, trained_context_len=2048, n_drops=len(cfg.drops))
>>> s = Stratum(v, bucket=1, domain="code", config=cfg, seed=cfg.seed)
>>> s.label, s.beyond, Stratum(v, bucket=2, domain="", config=cfg, seed=0).beyond
('ctx[1024,2048)/code', False, True)
>>> rng = np.random.default_rng(0)
>>> for _ in range(200):
...     tau = 0
...     while tau < 4 and rng.random() < 0.8:
...         tau += 1
...     _ = s.chi2.update_key(chain_key(tau, 4))
>>> s.chi2.baseline_ready
True
>>> s.fit_weights(cfg)
>>> s.weights.shape, s.joins                   # two drops, 2 × 4 cells; too few steps for either CUSUM
((2, 8), [False, False])
>>> [round(u, 3) for u in s.score(chain_key(0, 4))]   # a first-position rejection is evidence of a drop
[0.309, 0.119]
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from controller.drift.accept_chi2 import AcceptLengthChiSquare
from controller.drift.alerts import DriftAlert
from controller.drift.calibration import cached
from controller.drift.cells import OutcomeKey, key_bins, keys_matrix
from controller.drift.config import MonitorConfig
from controller.drift.cusum import CUSUM
from controller.drift.llr import calibrate_llr_cusum, llr_weights, precise_enough

log = logging.getLogger("specctl.drift")


@dataclass
class PendingTest:
    """A stratum's window test, held until the next multiple-testing round."""

    stratum: "Stratum"
    statistic: float
    df: float
    p_value: float
    counts: Counter
    started: float


class Stratum:
    """One context bucket (× domain) of one drafter version: baseline, windows, CUSUM evidence, alert."""

    __slots__ = ("version", "bucket", "domain", "lo", "hi", "beyond", "chi2", "weights", "scores", "cum_llr",
                 "anchor", "anchor_epoch", "alert", "quiet", "window_llr", "n_seen", "win_start", "label",
                 "recent", "held", "fitted", "joins", "deferred")

    def __init__(self, version: "Version", bucket: int, domain: str, config: MonitorConfig, seed: int) -> None:
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
        # A finding the arbiter (several replicas) has not granted yet: the stratum stays out of the CUSUMs and
        # the chi-square rounds until it is opened, attached to another alert, or withdrawn.
        self.deferred: DriftAlert | None = None
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
        """Log-likelihood ratio of one outcome, one per drop of the bank (memoised per key)."""
        s = self.scores.get(key)
        if s is None:
            s = tuple((self.weights @ key_bins(key, self.version.max_depth, self.version.max_width)).tolist())
            self.scores[key] = s
        return s

    def fit_weights(self, config: MonitorConfig) -> None:
        """Likelihood-ratio weights per drop, and which CUSUMs of the bank the stratum may join.

        A stratum joins the CUSUM for ``drop`` only when its baseline is
        precise enough that the sum still drifts down without drift: over
        bootstrap replicates of the baseline, the mean increment under the
        empirical distribution plus ``precision_z`` standard deviations must
        stay below zero. Otherwise a baseline that happened to come out a
        little high would read as a small drop (the smaller the drop a CUSUM
        is tuned to, the larger the baseline it needs).
        """
        chi2 = self.chi2
        self.fitted = sum(chi2.baseline_counts.values())
        self.weights = np.stack([llr_weights(chi2.baseline_bins, d) for d in config.drops])
        self.scores = {}
        keys = sorted(chi2.baseline_counts)
        matrix = keys_matrix(keys, self.version.max_depth, self.version.max_width)
        freq = np.array([chi2.baseline_counts[k] for k in keys], dtype=np.float64)
        # Sticky: the baseline only grows, so a stratum that was precise enough stays in.
        self.joins = [joined or bool(cached(("precise", matrix, freq, d, config.precision_z, config.seed),
                                            lambda: precise_enough(matrix, freq, d, config.precision_z, config.seed)))
                      for joined, d in zip(self.joins, config.drops)]

    def grow_baseline(self, matches: bool, config: MonitorConfig) -> None:
        """Absorb the window held back if this one matches too; refit on doubling."""
        chi2 = self.chi2
        size = sum(chi2.baseline_counts.values())
        if matches and self.held is not None and size < config.baseline_max:
            chi2.baseline_counts.update(self.held)
            size += sum(self.held.values())
        self.held = chi2.last_window if matches else None
        if size >= min(1.25 * self.fitted, config.baseline_max) > self.fitted:
            chi2.fit(chi2.baseline_counts)
            joined = list(self.joins)
            self.fit_weights(config)
            v = self.version
            inside = sum(sum(t.chi2.baseline_counts.values()) for t in v.strata.values()
                         if t.weights is not None and not t.beyond)
            if not self.beyond and (self.joins != joined or inside >= 2.0 * v.calibrated_size):
                v.dirty = True  # a lower threshold is now justified; the old one stays conservative meanwhile


class Version:
    """One drafter version: its strata, its bank of stratified CUSUMs, its workers, its context share."""

    def __init__(self, kind: str, version: str, max_depth: int, max_width: int, trained_context_len: int,
                 n_drops: int) -> None:
        self.kind = kind
        self.version = version
        self.max_depth = max(int(max_depth), 1)
        self.max_width = max(int(max_width), 1)
        self.trained_context_len = int(trained_context_len)
        self.strata: dict[tuple[int, str], Stratum] = {}
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

    def calibrate(self, config: MonitorConfig, ert_cusum: float) -> None:
        """(Re)calibrate the version's CUSUM on its in-range strata with a baseline.

        ``ert_cusum`` is the CUSUM's part of the false-alarm budget, shared
        equally by the CUSUMs of the bank that have strata to watch.
        """
        self.dirty = False
        strata = sorted((s for s in self.strata.values() if s.weights is not None and not s.beyond),
                        key=lambda s: (s.bucket, s.domain))
        if not strata:
            return
        self.calibrated_size = sum(sum(s.chi2.baseline_counts.values()) for s in strata)
        self.calibrated_at = self.steps
        seen = np.array([float(s.n_seen) for s in strata])
        shares = np.round(seen / seen.sum(), 2) + 1e-3
        shares = shares / shares.sum()
        active = [j for j in range(len(config.drops)) if any(s.joins[j] for s in strata)]
        ert = ert_cusum * max(len(active), 1)  # the active CUSUMs share the CUSUM budget equally
        for j, drop in enumerate(config.drops):
            if j not in active:
                self.cusums[j] = None
                continue
            parts, part_shares = [], []
            for s, share in zip(strata, shares):
                if s.joins[j]:
                    counts = s.chi2.baseline_counts
                    keys = sorted(counts)
                    parts.append((keys_matrix(keys, self.max_depth, self.max_width),
                                  np.array([counts[k] for k in keys], dtype=np.float64)))
                    part_shares.append(share)
            idle = round(1.0 - float(sum(part_shares)), 2)  # steps of strata not taking part add nothing
            part_shares = np.array(part_shares) / sum(part_shares)
            mats = tuple(x for m, f in parts for x in (m, f))
            cal = cached(("version-cusum",) + mats + (part_shares, idle, drop, ert, config.cusum_paths,
                                                      config.cusum_horizon, config.seed),
                         lambda: calibrate_llr_cusum(parts, part_shares, drop, ert, config.cusum_paths,
                                                     config.cusum_horizon, config.seed, idle))
            h = max(cal.threshold, 1e-6)
            if self.cusums[j] is None:
                self.cusums[j] = CUSUM(direction="up", target=0.0, slack=0.0, threshold=h)
                self.epoch[j] += 1
            else:
                self.cusums[j].threshold = h
            log.debug("drift: %s/%s CUSUM(drop=%g) h=%.2f over %d strata", self.kind, self.version, drop, h,
                      len(parts))
