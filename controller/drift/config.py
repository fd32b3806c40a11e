"""``MonitorConfig``: the settings of the acceptance drift monitor, checked once.

They live apart from :mod:`controller.drift.monitor` because they are read
without running anything: the server's configuration file validates its
``drift.monitor`` block against them, and every part of the monitor (the
strata, the alert actions, snapshot and restore) takes its numbers from one
frozen instance. What each setting does to detection is told field by field
below and, for the design as a whole, in :mod:`controller.drift.monitor`.

Examples
--------
>>> cfg = MonitorConfig(baseline_steps=300, ert="1e6")   # a YAML string is checked and stored as a number
>>> cfg.ert, cfg.drops
(1000000.0, (0.1, 0.035))
>>> MonitorConfig(correction="bonferroni")
Traceback (most recent call last):
...
ValueError: correction must be one of 'bh', 'holm', got 'bonferroni'
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.drift.base import check_choice, check_float, check_int

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
