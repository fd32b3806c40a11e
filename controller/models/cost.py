"""Step-cost model fitted online from one worker's own step reports.

Verification follows a roofline with two planes:

    verify_ms = max(mem_ms + mem_ms_per_kv_token · kv_tokens,
                    compute_ms + curve(batch_tokens)
                               + compute_ms_per_pair · attn_pairs)

where ``batch_tokens = Σ_i (1 + nodes_i)`` is what the target forward
processes, ``kv_tokens = Σ_i context_len_i`` what it reads from the KV
cache and ``attn_pairs = Σ_i (1 + nodes_i) · context_len_i`` the
query-key pairs attention computes: past ~30k tokens of context a tree's
attention flops outweigh its GEMM flops, so a per-token slope alone would
price the same node wrong at every context length but one. One fit covers
the three regimes of docs/design.md §3: at small batch the memory plane
(weights) dominates and extra draft tokens are free; at large batch with
short context the compute plane dominates and every extra token costs its
slope; at large batch with long context the KV term lifts the memory plane
back above the compute plane and speculation is cheap again.

``curve`` is monotone piecewise linear in batch tokens, on the knots of
``COMPUTE_KNOTS`` (every count up to 8, then four per octave): a roofline's
compute plane is the special case of one slope, and real kernels are not
that. A GEMM runs in tiles of rows, so its time climbs in steps (wave and
tile quantisation on a GPU; on the AMD EPYC the reference worker first ran
on, a forward over 1–6 tokens cost the same and the 7th added 40 %). One slope fitted through
such steps prices some tree sizes far too cheap and others far too dear.
Each segment's slope is fitted (non-negative: more tokens never cost
less), pulled toward its neighbours so that sparse data gives a smooth
curve, and continued past the data at the steeper of the last segment's
slope and the mean slope over the data (``compute_ms_per_token`` holds it;
without knots the plane is the linear ``compute_ms + compute_ms_per_token ·
batch_tokens``, the hardware prior).

Drafting is linear: ``draft_ms = draft_fixed_ms·[any speculation] +
draft_ms_per_level·max_depth + draft_ms_per_node·Σ nodes +
draft_ms_per_level_kv_token·Σ_i depth_i·context_len_i`` — the last term is
an autoregressive drafter reading its own KV cache once per level, which
matters at long context.

The fit also says how sure it is: ``verify_sd_ms(batch_tokens)`` is its
RMSE shrunk by the observations in that batch-token segment. A policy
deciding whether to speculate at a batch the worker has never run (the
first minute at batch 8 after an hour at batch 4) is then told that the
interpolated price there is one RMSE wide, not as exact as the prices it
has measured thousands of times.

A worker may also send a start-up calibration (verify times at a grid of
batch shapes, ``StepCostModel.calibrate``): it shapes the curve where no
traffic has been yet, at the level live traffic sets. It is not live
evidence: one factor brings it to the live level, but what that factor
leaves (``calibration_error``, measured on the live cells inside its range)
no number of repeats removes. So a shape only the calibration prices stays
about that unsure in ``verify_sd_ms`` (the goodput policy's price probes
run such shapes), and where live steps share a sample's segment of the
curve the sample weighs what it is worth next to them.

Memory is bounded: verify observations land in a fixed grid of cells over
(batch-token segment, log2 kv_tokens), each keeping decayed weighted sums;
the draft model keeps 4×4 normal-equation sums. Nothing grows with traffic.

The fit is robust to a single absurd step (``robust_targets``). Least
squares gives a point the pull of its squared error: after 3,000 ordinary
steps at batch 1–8, one report of 60,000 batch tokens at 1,000× its cost
raised the fitted price of shapes already seen by up to 1,474 % (one of 256
tokens in 100 s: 149 %; 1,000× the cost at a shape seen 44 times: 509 %),
and a lone batch of 60,000 set ``compute_ms`` to −2,414 ms. So every cell is
judged against what the rest predicts at its shape without it, in standard
errors that count its own weight (one step cannot outweigh thousands) and
how well the rest knows that shape (well inside the data, hardly far past
it, where a real new regime may begin). A cell more than ``ROBUST_Z`` of
them off is fitted near that prediction instead, the nearer the more absurd
it is, unless it holds several steps whose spread is too narrow to hide an
absurd one (a real kink shows in many steps that agree); a step above the
rest may raise only a plane that can reach it. What it holds to (the
tests check it): after a steady stream, one absurd step (a batch or a KV
length far past the data, any time from 0 to 10⁶ ms, or 1,000× the cost
at a shape seen before) moves the price of no shape seen by more than 2 %
or 0.1 ms, and does not inflate the RMSE; no fitted term is ever negative
(a final guard holds that too); where no cell is judged off the fit is the
plain least-squares one. It cannot judge what nothing else covers (a worker
that has run one shape only), nor a few identical absurd steps in one cell
(they agree with each other). The RMSE and the per-segment evidence leave
the judged cells out; reports that are not times (NaN, negative) are
dropped on arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
from scipy.optimize import nnls

# Knots of the compute curve (batch tokens); the verify sketch's batch cells are
# the intervals between them (the last one open), so no cell straddles a knot.
COMPUTE_KNOTS = (1, 2, 3, 4, 5, 6, 7, 8) + tuple(
    int(base * f) for base in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    for f in (1.25, 1.5, 1.75, 2.0))
_KNOTS = np.asarray(COMPUTE_KNOTS, dtype=float)
PENDING_FOLD = 256  # steps buffered before they are folded into the sketches
MAX_STEP_MS = 1e9  # a reported time past this (11 days), negative or not finite is dropped
KV_BITS = 30  # KV tokens up to 1G per step


@dataclass(frozen=True)
class CostParams:
    mem_ms: float = 10.0
    mem_ms_per_kv_token: float = 0.0
    compute_ms: float = 0.0
    compute_ms_per_token: float = 0.0
    compute_ms_per_pair: float = 0.0
    # KV reads on the compute plane: on a GPU attention streams the cache in its
    # own kernels after the GEMMs, so at compute-bound batches the two add up
    # (the measured H200: a 4-token step at batch 64 and 8k context costs 1.4x
    # one token, where the max of the planes says 2x). 0 in the roofline prior.
    compute_ms_per_kv_token: float = 0.0
    # The compute curve: batch tokens at the knots and the ms it has risen above
    # ``compute_ms`` there (non-decreasing, 0 at the first knot). Empty: linear plane.
    compute_knots: tuple[float, ...] = ()
    compute_rise_ms: tuple[float, ...] = ()
    # How well the fit knows each segment of the curve: the (decayed) number of
    # verify observations whose batch tokens fall in it, and the fit's RMSE.
    # Empty: the parameters are exact (a prior, or a simulator's truth).
    compute_evidence: tuple[float, ...] = ()
    verify_rmse_ms: float = 0.0
    # Of that evidence, what live steps brought (the rest is the start-up
    # calibration's samples), and how far the calibration, scaled to the live
    # level, misses live steps (relative, its systematic error): repeating a
    # calibration shrinks its noise, never that. Empty / 0: no calibration.
    live_evidence: tuple[float, ...] = ()
    calibration_error: float = 0.0
    draft_fixed_ms: float = 0.0
    draft_ms_per_level: float = 0.5
    draft_ms_per_node: float = 0.0
    draft_ms_per_level_kv_token: float = 0.0
    # A drafter that follows the target's features catches a request up on
    # the tokens it was off for before it drafts again (ms per token).
    catch_up_ms_per_token: float = 0.0

    @classmethod
    def from_hardware(
        cls,
        bandwidth_gb_s: float,
        peak_tflops: float,
        weight_bytes: float,
        kv_bytes_per_token: float,
        params: float,
        overhead_ms: float = 1.0,
        flops_efficiency: float = 0.4,
        bandwidth_efficiency: float = 0.85,
        query_groups: float = 4.0,
    ) -> "CostParams":
        """Roofline prior from a worker's hardware hints (zeros = unknown).

        Hints are nominal peaks; a serving engine reaches a fraction of them.
        Decode-shaped GEMMs plus attention, norms and sampling achieve roughly
        30-50 % of dense peak flops (``flops_efficiency``), and weight / KV
        streaming 80-90 % of the HBM bandwidth (``bandwidth_efficiency``).
        With peak flops the compute plane would look ~2.5x too cheap until
        the first compute-bound steps arrive, and the first plans would send
        maximal trees into batches that cannot afford them.

        Attention does 4 flops per query-key pair per layer and query
        dimension; the hints give layers × KV width (``kv_bytes_per_token``
        over 2 tensors × 2 bytes), and grouped-query attention makes the
        query width ``query_groups`` times that (4 for Llama-3, Mistral,
        Qwen2). The fit corrects all three once data arrives.
        """
        if bandwidth_gb_s <= 0 or weight_bytes <= 0:
            return cls()
        if not 0 < flops_efficiency <= 1 or not 0 < bandwidth_efficiency <= 1:
            raise ValueError(f"efficiencies must lie in (0, 1], got flops_efficiency={flops_efficiency} "
                             f"bandwidth_efficiency={bandwidth_efficiency}")
        bytes_per_ms = bandwidth_gb_s * 1e6 * bandwidth_efficiency
        flops_per_ms = peak_tflops * 1e9 * flops_efficiency if peak_tflops > 0 else 0.0
        return cls(
            mem_ms=overhead_ms + weight_bytes / bytes_per_ms,
            mem_ms_per_kv_token=kv_bytes_per_token / bytes_per_ms,
            compute_ms=overhead_ms,
            compute_ms_per_token=(2.0 * params / flops_per_ms) if flops_per_ms and params else 0.0,
            compute_ms_per_pair=(query_groups * kv_bytes_per_token / flops_per_ms) if flops_per_ms else 0.0,
            draft_fixed_ms=overhead_ms * 0.2,
            draft_ms_per_level=0.05 * weight_bytes / bytes_per_ms,
            draft_ms_per_node=0.0,
        )

    @cached_property
    def _curve(self) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.compute_knots:
            return None
        return np.asarray(self.compute_knots, dtype=float), np.asarray(self.compute_rise_ms, dtype=float)

    def segment_slopes(self, knots) -> np.ndarray:
        """ms per batch token of the compute curve on each segment between
        ``knots`` (the last entry: past the last knot)."""
        k = np.asarray(knots, dtype=float)
        if self._curve is None:
            return np.full(len(k), self.compute_ms_per_token)
        inner = np.diff(self.compute_curve_ms(k)) / np.diff(k)
        return np.append(inner, self.compute_ms_per_token)

    def compute_curve_ms(self, batch_tokens):
        """The compute plane's batch-token part: ``curve(batch_tokens)``."""
        n = np.asarray(batch_tokens, dtype=float)
        if self._curve is None:
            return self.compute_ms_per_token * n
        knots, rise = self._curve
        return np.interp(n, knots, rise) + self.compute_ms_per_token * np.maximum(n - knots[-1], 0.0)

    def verify_ms(self, batch_tokens, kv_tokens, attn_pairs=0.0):
        """One target forward (scalars or arrays); ``attn_pairs`` 0 leaves attention flops out."""
        mem = self.mem_ms + self.mem_ms_per_kv_token * np.asarray(kv_tokens, dtype=float)
        comp = (self.compute_ms + self.compute_curve_ms(batch_tokens)
                + self.compute_ms_per_pair * np.asarray(attn_pairs, dtype=float)
                + self.compute_ms_per_kv_token * np.asarray(kv_tokens, dtype=float))
        out = np.maximum(mem, comp)
        return float(out) if out.ndim == 0 else out

    def verify_sd_ms(self, batch_tokens):
        """Standard error (ms) of :meth:`verify_ms` at ``batch_tokens``: the fit's
        RMSE over the root of one plus the observations in that segment of the
        curve. A batch size the worker has never run is priced by interpolation
        and carries a whole RMSE; one it runs all day, almost none. 0 when the
        parameters carry no evidence (exact costs).

        Calibration samples are not live steps: averaging more repeats of one
        shrinks its noise but not its ``calibration_error`` (the quiet
        machine, the short context it was timed at). A segment's live steps
        and what prices it without them (the calibration and the curve) are
        two estimates, the latter's variance ``RMSE² / (1 + samples) +
        (calibration_error · price)²``; the standard error is that of their
        precision-weighted mean, so a segment known from the calibration alone
        stays about ``calibration_error`` unsure until traffic runs it.

        >>> p = CostParams(mem_ms=50.0, compute_knots=(1.0, 8.0, 16.0), compute_rise_ms=(0.0, 10.0, 30.0),
        ...                compute_evidence=(400.0, 25.0, 0.0), live_evidence=(400.0, 0.0, 0.0),
        ...                verify_rmse_ms=5.0, calibration_error=0.05)
        >>> [round(float(x), 2) for x in p.verify_sd_ms(np.array([4.0, 12.0, 20.0]))]
        [0.25, 2.69, 5.59]
        >>> round(float(replace(p, calibration_error=0.0).verify_sd_ms(12.0)), 2)  # repeats as good as steps
        0.98
        """
        n = np.asarray(batch_tokens, dtype=float)
        if not self.compute_evidence or self.verify_rmse_ms <= 0:
            out = np.zeros(n.shape)
        else:
            seg = self._segment(n)
            total = np.asarray(self.compute_evidence)[seg]
            live = np.asarray(self.live_evidence)[seg] if self.live_evidence else total
            calibrated = np.maximum(total - live, 0.0)
            rmse2 = self.verify_rmse_ms ** 2
            level = np.maximum(self.mem_ms, self.compute_ms + self.compute_curve_ms(n))
            # Without live steps a segment is priced from the calibration and the curve through its
            # neighbours (the one RMSE a price no data supports carries): both miss by the calibration's
            # error however often it was repeated.
            unmeasured_var = rmse2 / (1.0 + calibrated) + (self.calibration_error * level) ** 2
            out = 1.0 / np.sqrt(live / rmse2 + 1.0 / unmeasured_var)
        return float(out) if out.ndim == 0 else out

    def _segment(self, batch_tokens: np.ndarray) -> np.ndarray:
        """Index of the curve segment (between knots; the last one open) holding each batch-token count."""
        knots = np.asarray(self.compute_knots, dtype=float)
        return np.clip(np.searchsorted(knots, batch_tokens, side="right") - 1, 0, len(knots) - 1)

    def verify_live_steps(self, batch_tokens):
        """Live steps (decayed) the fit has seen in the segment of ``batch_tokens``;
        ``inf`` for exact parameters (a prior or a simulator's truth: nothing to measure)."""
        n = np.asarray(batch_tokens, dtype=float)
        if not self.compute_evidence:
            out = np.full(n.shape, np.inf)
        else:
            out = np.asarray(self.live_evidence or self.compute_evidence, dtype=float)[self._segment(n)]
        return float(out) if out.ndim == 0 else out

    def draft_ms(self, max_depth, total_nodes, batch_size=None, level_kv_tokens=0.0):
        """Draft time of a step whose deepest request drafts ``max_depth``
        levels, whose requests draft ``total_nodes`` nodes in all, and whose
        Σ depth_i·context_len_i is ``level_kv_tokens``."""
        depth = np.asarray(max_depth, dtype=float)
        out = (
            np.where(depth > 0, self.draft_fixed_ms, 0.0)
            + self.draft_ms_per_level * depth
            + self.draft_ms_per_node * np.asarray(total_nodes, dtype=float)
            + self.draft_ms_per_level_kv_token * np.asarray(level_kv_tokens, dtype=float)
        )
        return float(out) if out.ndim == 0 else out


    def catch_up_ms(self, tokens):
        """Time to catch a drafter up on ``tokens`` queued features."""
        out = self.catch_up_ms_per_token * np.asarray(tokens, dtype=float)
        return float(out) if out.ndim == 0 else out


# Internal scaling keeps the least-squares problems well conditioned.
_KV_SCALE = 1e6
_P_SCALE = 1e7
# Weight (in observations) of the pull between neighbouring segment slopes.
SMOOTHNESS = 1.0
# The robust rule (module docstring, ``robust_targets``). A cell more than ROBUST_Z standard errors from what the rest
# predicts there is fitted ROBUST_Z² / z standard errors off it instead, unless it holds VOUCHED_WEIGHT observations
# and a spread too narrow to hide the steps that would have moved it (< HIDDEN_SPREAD · |d| · sqrt(w - 1)); at most
# ROBUST_ROUNDS rounds. Noise is relative, at least NOISE_FLOOR of the time (simulators report exact times); the
# smoothness and prior rows count with PSEUDO_NOISE times a typical cell's noise (a kink where no step has been is
# plausible), and the planes are allowed MODEL_ERROR of the time (a model misses heavy cells by a little).
ROBUST_Z = 3.0
ROBUST_ROUNDS = 3
VOUCHED_WEIGHT = 3.0
HIDDEN_SPREAD = 0.5
NOISE_FLOOR = 0.01
PSEUDO_NOISE = 10.0
MODEL_ERROR = 0.01
# A start-up calibration's systematic error relative to live steps before live
# cells inside its range measure it (relative; the reference worker's
# calibrations missed live steps by 3-10 % at a shape after scaling), and the
# number of cells that estimate weighs as.
CALIBRATION_ERROR_PRIOR = 0.05
CALIBRATION_PRIOR_CELLS = 4.0
# The compute plane's columns: intercept, pairs, KV tokens, then the curve's segment rises.
_CURVE_COLUMN = 3
# Every scalar term a fit may set; none is ever negative.
_TERMS = ("mem_ms", "mem_ms_per_kv_token", "compute_ms", "compute_ms_per_token", "compute_ms_per_pair",
          "compute_ms_per_kv_token",
          "draft_fixed_ms", "draft_ms_per_level", "draft_ms_per_node", "draft_ms_per_level_kv_token",
          "catch_up_ms_per_token")


def _segments(knots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of every compute-curve segment; the last one (past the
    last knot) is open and gets the last knot as its length scale."""
    return knots, np.append(np.diff(knots), knots[-1])


def _segment_basis(batch_tokens: np.ndarray, start: np.ndarray, length: np.ndarray, open_last: bool) -> np.ndarray:
    """``[points, segments]``: how far into each segment a point's batch reaches,
    as a fraction of the segment (``open_last``: the last one is not clipped at 1)."""
    into = (batch_tokens[:, None] - start[None, :]) / length[None, :]
    clipped = np.clip(into, 0.0, 1.0)
    if open_last and clipped.shape[1]:
        clipped[:, -1] = np.maximum(into[:, -1], 0.0)
    return clipped


def fit_max_planes(
    batch_tokens: np.ndarray,
    kv_tokens: np.ndarray,
    verify_ms: np.ndarray,
    weights: np.ndarray,
    prior: CostParams,
    prior_weight: float,
    iterations: int = 25,
    attn_pairs: np.ndarray | None = None,
    knots: tuple[float, ...] = COMPUTE_KNOTS,
    robust: bool = True,
    spread_ms: np.ndarray | None = None,
) -> CostParams:
    """Fit ``max(mem plane, compute plane)`` by alternating assignment.

    Each point is assigned to the plane that currently predicts the larger
    time, then each plane is refitted by non-negative weighted least squares
    on its points, ridge-pulled toward ``prior`` (which alone decides a plane
    that no point supports). Several starts (every point on the memory
    plane, every point on the compute plane, a split at the median batch
    tokens, the prior's split); the lowest weighted SSE wins.

    The compute plane's unknowns are its intercept, the pairs slope and the
    rise over each segment of the compute curve that the data's batch-token
    range covers (rises ≥ 0: the curve never falls); neighbouring slopes are
    pulled together with the weight of ``SMOOTHNESS`` observations. Segments
    below the data are flat (the intercept holds them); past it the curve
    continues at the last fitted slope. Data only at or below the first knot
    keeps the prior's curve and fits the intercept under it.

    ``robust`` (default): a point the rest of the data contradicts is pulled
    toward what the rest predicts and the fit repeated (:func:`robust_targets`,
    the module docstring). ``spread_ms``: each point's within-cell standard
    deviation where known (a point that averages several steps).
    """
    return _fit_max_planes(batch_tokens, kv_tokens, verify_ms, weights, prior, prior_weight, iterations,
                           attn_pairs, knots, robust, spread_ms)[0]


def _fit_max_planes(batch_tokens, kv_tokens, verify_ms, weights, prior, prior_weight, iterations=25,
                    attn_pairs=None, knots=COMPUTE_KNOTS, robust=True,
                    spread_ms=None, start_excluded=None) -> tuple[CostParams, np.ndarray]:
    """:func:`fit_max_planes` and the targets it fitted (``verify_ms`` where the robust rule left them).
    ``start_excluded``: the points the robust rounds start without (those the last refit judged off; every
    point is still judged, this only saves rounds)."""
    batch_tokens, kv_tokens = np.asarray(batch_tokens, dtype=float), np.asarray(kv_tokens, dtype=float)
    verify_ms, weights = np.asarray(verify_ms, dtype=float), np.asarray(weights, dtype=float)
    ones = np.ones(len(batch_tokens))
    pairs = np.zeros(len(batch_tokens)) if attn_pairs is None else np.asarray(attn_pairs, dtype=float)
    start, length = _segments(np.asarray(knots, dtype=float))
    # The last segment is open: it holds every batch past its start, however far.
    end = np.append(start[:-1] + length[:-1], np.inf)
    active = np.flatnonzero((start < batch_tokens.max()) & (end > batch_tokens.min()))

    def design_rows(n: np.ndarray, kv: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Memory-plane rows [points, 2], compute-plane rows [points, 3 + active segments] (intercept, pairs,
        KV tokens, segment rises) and the compute plane's fixed part (the prior's curve when no segment is
        active)."""
        basis = _segment_basis(n, start[active], length[active],
                               open_last=bool(len(active)) and active[-1] == len(start) - 1)
        return (np.column_stack([np.ones(len(n)), kv / _KV_SCALE]),
                np.column_stack([np.ones(len(n)), p / _P_SCALE, kv / _KV_SCALE, basis]),
                np.zeros(len(n)) if len(active) else prior.compute_curve_ms(n) * np.ones(len(n)))

    mem_x, comp_x, comp_offset = design_rows(batch_tokens, kv_tokens, pairs)
    prior_mem = np.array([prior.mem_ms, prior.mem_ms_per_kv_token * _KV_SCALE])
    if len(active):
        # The intercept is the plane's value where the data starts: at the first active segment.
        anchor = start[active[0]]
        prior_comp = np.concatenate([[prior.compute_ms + float(prior.compute_curve_ms(anchor)),
                                      prior.compute_ms_per_pair * _P_SCALE,
                                      prior.compute_ms_per_kv_token * _KV_SCALE],
                                     prior.segment_slopes(knots)[active] * length[active]])
    else:
        # Every batch at or below the first knot: the curve keeps the prior's shape under a fitted
        # intercept (compute_ms itself, so NNLS keeps it ≥ 0; anchoring it at the data and subtracting
        # the prior's curve there went negative whenever the data lay below that curve).
        prior_comp = np.array([prior.compute_ms, prior.compute_ms_per_pair * _P_SCALE,
                               prior.compute_ms_per_kv_token * _KV_SCALE])
    ridge = math.sqrt(prior_weight)
    # Smoothness rows: (slope_j - slope_{j+1}) times their mean length, for neighbouring active segments.
    smooth = np.zeros((max(len(active) - 1, 0), comp_x.shape[1]))
    for row, (a, b) in enumerate(zip(active[:-1], active[1:])):
        scale = math.sqrt(SMOOTHNESS) * 0.5 * (length[a] + length[b])
        smooth[row, _CURVE_COLUMN + row] = scale / length[a]
        smooth[row, _CURVE_COLUMN + 1 + row] = -scale / length[b]

    def solve(x: np.ndarray, y: np.ndarray, mask: np.ndarray, prior_vec: np.ndarray, sw: np.ndarray,
              extra: np.ndarray | None = None) -> np.ndarray:
        blocks = [x[mask] * sw[mask, None], ridge * np.eye(len(prior_vec))]
        target = [y[mask] * sw[mask], ridge * prior_vec]
        if extra is not None and len(extra):
            blocks.append(extra)
            target.append(np.zeros(len(extra)))
        return nnls(np.vstack(blocks), np.concatenate(target))[0]

    def planes(mem: np.ndarray, comp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return mem_x @ mem, comp_x @ comp + comp_offset

    def fit(y: np.ndarray, w: np.ndarray, force: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Best of the starts; ``force``: per point, the plane it must sit on (0 memory, 1 compute, -1 either)."""
        comp_y, sw = y - comp_offset, np.sqrt(w)

        def split(mask: np.ndarray) -> np.ndarray:
            return mask if force is None else np.where(force >= 0, force == 1, mask)

        # Both extremes (every point on one plane) among the starts: from "all memory" alone, a CPU where each
        # token costs ~7 % settled on one flat memory plane over 1-8 tokens (tests: the Xeon EAGLE cells).
        starts = [np.zeros(len(ones), dtype=bool), np.ones(len(ones), dtype=bool),
                  batch_tokens > np.median(batch_tokens), np.greater(*planes(prior_mem, prior_comp)[::-1])]
        best: tuple[float, np.ndarray, np.ndarray] | None = None
        for mask in starts:
            mem, comp, before, mask = prior_mem, prior_comp, None, split(mask)
            for step in range(iterations):
                mem = solve(mem_x, y, ~mask, prior_mem, sw)
                comp = solve(comp_x, comp_y, mask, prior_comp, sw, smooth)
                mem_pred, comp_pred = planes(mem, comp)
                new_mask = split(comp_pred > mem_pred)
                if np.array_equal(new_mask, mask):
                    break
                if before is not None and np.array_equal(new_mask, before):
                    # A 2-cycle: the remaining iterations alternate; end where they would have ended.
                    if (iterations - 1 - step) % 2:
                        mem = solve(mem_x, y, ~new_mask, prior_mem, sw)
                        comp = solve(comp_x, comp_y, new_mask, prior_comp, sw, smooth)
                    break
                before, mask = mask, new_mask
            err = float(np.sum(w * (np.maximum(*planes(mem, comp)) - y) ** 2))
            if best is None or err < best[0]:
                best = (err, mem, comp)
        return best[1], best[2]

    # The robust rule (robust_targets): judge every point against a fit without the points judged off so far
    # (the last refit's, to start; once off, off for this refit, judged again each round), until no new one is;
    # then fit once more with every point at the value the rule gives it (its own value unless it is still
    # off: continuous in that value, so refits do not flip) and on a plane that can reach it.
    excluded = np.zeros(len(ones), dtype=bool)
    if robust and start_excluded is not None:
        excluded = np.array(start_excluded, dtype=bool)
    targets, force = verify_ms, None
    for round_ in range(ROBUST_ROUNDS + 1 if robust else 1):
        mem, comp = fit(verify_ms, np.where(excluded, 0.0, weights), force)
        if not robust:
            break
        targets, off, force, z = robust_targets(verify_ms, weights, np.where(excluded, 0.0, weights),
                                                (mem_x, comp_x), (mem, comp), (prior_mem, prior_comp),
                                                comp_offset, smooth, prior_weight, spread_ms,
                                                (batch_tokens, kv_tokens, pairs), design_rows)
        if not (off & ~excluded).any() or round_ == ROBUST_ROUNDS:
            break
        excluded |= off
    # (Points ten times past ROBUST_Z would sit within 0.3 standard errors of the fit without them: it stands.)
    if robust and ((force >= 0).any() or (excluded != off).any() or (np.abs(z[off]) < 10 * ROBUST_Z).any()):
        mem, comp = fit(targets, weights, force)
    fitted = replace(prior, mem_ms=float(mem[0]), mem_ms_per_kv_token=float(mem[1] / _KV_SCALE),
                     compute_ms_per_pair=float(comp[1] / _P_SCALE),
                     compute_ms_per_kv_token=float(comp[2] / _KV_SCALE))
    if not len(active):  # the curve keeps the prior's shape
        return _non_negative(replace(fitted, compute_ms=float(comp[0]))), targets
    slopes = np.zeros(len(start))  # flat below the data
    slopes[active] = comp[_CURVE_COLUMN:] / length[active]
    # Past the data the curve continues at the steeper of the last segment's slope
    # and the mean slope over the data: one sparse, noisy last segment must not
    # make every larger batch look free (kernels only get more compute-bound).
    lo, hi = max(start[active[0]], batch_tokens.min()), batch_tokens.max()
    covered = np.clip(np.minimum(start[active] + length[active], hi) - np.maximum(start[active], lo), 0.0, None)
    mean_slope = float(np.sum(slopes[active] * covered) / max(hi - lo, 1e-9))
    slopes[active[-1] + 1:] = max(slopes[active[-1]], mean_slope)
    rise = np.concatenate([[0.0], np.cumsum(slopes[:-1] * length[:-1])])  # 0 up to the anchor
    return _non_negative(replace(fitted, compute_ms=float(comp[0]), compute_ms_per_token=float(slopes[-1]),
                                 compute_knots=tuple(float(k) for k in start),
                                 compute_rise_ms=tuple(float(r) for r in rise))), targets


def robust_targets(verify_ms, weights, fit_weights, designs, params, priors, comp_offset, smooth, prior_weight,
                   spread_ms=None, shapes=None, design_rows=None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The robust rule: what each point's mean should be fitted as, which
    points are off, the plane each must sit on (-1: either) and its z.

    ``fit_weights`` are the weights of the fit in ``params`` (0 for points it
    left out); ``weights`` are each point's own evidence (observations).
    Each point (cell) is compared with what the rest predicts at its shape
    without it: each plane's leave-one-out prediction (regularised least
    squares on that plane's points, through its hat values), ``μ`` the
    larger. The difference is measured in standard errors: the point's own
    noise over its weight, the spread of the rest's prediction there (small
    inside well-observed data, large where only the smoothness pull and the
    prior reach, as past the batches seen) and ``MODEL_ERROR``. Noise is
    relative: ``σ`` × the time, ``σ`` the median within-cell spread where
    the cells report it (else 1.4826 × the median standardised residual),
    at least ``NOISE_FLOOR``. The time is the larger plane, so a point
    above both is judged by the plane likelier to rise to it (where every
    point, on either plane, bounds how far it can), and one below a plane by
    how surely that plane must fall: a compute-bound step past the data is
    not an outlier because the memory plane is sure of itself there.

    Past ``ROBUST_Z`` a point is fitted ``ROBUST_Z² / z`` standard errors
    off that plane's prediction (never below ``μ`` when it was above): the
    more absurd, the less it pulls. A point of ``VOUCHED_WEIGHT``
    observations or more is left alone unless its spread could hide what
    moved it (one absurd step among ``w`` moves the mean by ``d`` and
    spreads the cell by about ``|d|·sqrt(w - 1)``; a real kink of the cost
    curve, or a cell the model misses, moves it with the usual spread).
    Moving the value rather than the weight bounds what a point far out on a
    slope (a KV length 10⁴ times the rest) can do: any weight, however
    small, still tilts that slope to it. A point above the rest that one
    plane cannot reach is put on the other (a far step the unknown compute
    curve may explain must not drag the known memory plane up to it).
    """
    n = len(verify_ms)
    fitted_planes = [x @ p for x, p in zip(designs, params)]
    fitted_planes[1] = fitted_planes[1] + comp_offset
    on_compute = fitted_planes[1] > fitted_planes[0]
    floor = 1e-3 * float(np.median(np.abs(verify_ms))) + 1e-9
    level_fit = np.maximum(np.maximum(*fitted_planes), floor)
    typical = PSEUDO_NOISE * float(np.median(level_fit))  # the noise given to the smoothness and prior rows
    loo, var, bound_var = [], [], []
    for x, prior_vec, offset, sel, extra in ((designs[0], priors[0], 0.0, ~on_compute, None),
                                             (designs[1], priors[1], comp_offset, on_compute, smooth)):
        # Unconstrained least squares on the plane's points (a term an outlier has pinned at 0, a KV slope
        # dragged flat, must not vanish from what the point is judged by): each point's prediction without it.
        pred, spread = _leave_one_out(x, verify_ms - offset, fit_weights, sel, prior_vec, prior_weight, extra,
                                      level_fit, typical)
        loo.append(pred + offset)
        var.append(spread)
        # How far the plane could rise there: every point bounds it (a point the other plane holds sits above
        # it), so a plane the data pins from above is no excuse for a point above the rest.
        bound_var.append(_leave_one_out(x, verify_ms - offset, fit_weights, np.ones(n, dtype=bool), prior_vec,
                                        prior_weight, extra, level_fit, typical)[1])
    loo, var, bound_var = np.array(loo), np.array(var), np.array(bound_var)  # [plane, point]
    mu = loo.max(axis=0)  # what the rest predicts: the larger plane
    level = np.maximum(np.abs(mu), floor)
    # Per plane, the time the point would have on it (its noise is relative to that, not to a far, unsure
    # extrapolation of the other plane) and the SE of (observed - that plane), over σ.
    plane_level = np.maximum(np.abs(loo), floor)
    unit = np.sqrt(plane_level ** 2 / weights + var)  # [plane, point]
    # Relative noise of one observation: from the residuals (1.4826 × their median ratio) or, where cells
    # report their spread, from that (a fit an outlier has dragged inflates the residuals, not the spreads).
    sigma = max(NOISE_FLOOR, 1.4826 * float(np.median(np.abs(verify_ms - mu) / unit[np.argmax(loo, axis=0),
                                                                                      np.arange(n)])))
    vouched = weights >= VOUCHED_WEIGHT
    if spread_ms is not None:
        spread = np.asarray(spread_ms, dtype=float)
        known = np.isfinite(spread) & (weights >= 2)
        if known.any():
            sigma = max(NOISE_FLOOR, min(sigma, float(np.median(spread[known] / level[known]))))
            # One absurd step among w moves the mean by d and spreads the cell by about |d|·sqrt(w - 1); a
            # real kink, or a cell the model misses, moves the mean with the usual spread.
            hidden = HIDDEN_SPREAD * np.abs(verify_ms - mu) * np.sqrt(np.maximum(weights - 1.0, 0.0))
            vouched &= ~known | (spread < hidden)

    def standard_error(centre: np.ndarray, spread: np.ndarray) -> np.ndarray:
        """Of observed minus a plane there: noise over the point's weight, the rest's spread, MODEL_ERROR of
        the time (the planes are a model: a cell of 300 steps it misses by 1 % is not an outlier for it)."""
        level_there = np.maximum(np.abs(centre), floor)
        return np.hypot(sigma * np.sqrt(level_there ** 2 / weights + spread), MODEL_ERROR * level_there)

    # Above a plane, how far it could rise there (every point bounds it); below, how surely it must fall.
    centre = loo
    se = standard_error(loo, np.where(verify_ms > loo, bound_var, var))
    z_planes = (verify_ms - loo) / se
    if shapes is not None and design_rows is not None:
        # Past the data the planes only rise (with batch tokens, KV tokens and pairs): no plane is below its
        # value at the edge of the data, which the data knows even where its extrapolation does not.
        edge, edge_var = _edges(verify_ms, fit_weights, shapes, design_rows, on_compute, priors, prior_weight,
                                smooth, level_fit, typical)
        bounded = verify_ms < edge  # only points past the data have an edge (elsewhere -inf)
        edge_se = standard_error(np.where(bounded, edge, loo), np.where(bounded, edge_var, var))
        z_edge = np.full(edge.shape, np.inf)
        z_edge[bounded] = (np.broadcast_to(verify_ms, edge.shape)[bounded] - edge[bounded]) / edge_se[bounded]
        use = z_edge < z_planes
        centre, se, z_planes = np.where(use, edge, loo), np.where(use, edge_se, se), np.minimum(z_planes, z_edge)
    # The time is the larger plane plus noise: above both, either plane may rise to it (the likelier one
    # judges: a compute-bound step past the data is no outlier because the memory plane is sure of itself
    # there); below one, that plane must fall to it (the surer one judges). Either way: the smaller z.
    judge = np.argmin(z_planes, axis=0)
    at = (judge, np.arange(n))
    z = z_planes[at]
    off = ~vouched & (np.abs(z) > ROBUST_Z)
    if weights[off].sum() > 0.5 * weights.sum():  # a rule for the few: never set most of the evidence aside
        off[:] = False
    # Past ROBUST_Z a point counts as ROBUST_Z² / z standard errors off the plane that judged it (the more
    # absurd, the less it pulls), and never as less than the rest predicts when it was above it.
    moved = centre[at] + ROBUST_Z ** 2 / np.where(off, z, 1.0) * se[at]
    out = verify_ms.copy()
    out[off] = np.where(z[off] > 0, np.maximum(moved[off], mu[off]), moved[off])
    # A point above what the rest predicts may raise only a plane that can reach it: a far step that the
    # compute curve (unknown out there) may explain must not drag the memory plane (known) up to it.
    reach = (out - loo) / se <= ROBUST_Z  # [plane, point]
    force = np.full(n, -1)
    suspect = off | (weights < VOUCHED_WEIGHT)  # a cell of many steps that sits where the fit put it stays there
    stray = suspect & (out > mu) & (reach.sum(axis=0) == 1) & ~reach[on_compute.astype(int), np.arange(n)]
    force[stray] = np.argmax(reach[:, stray], axis=0)
    return out, off, force, z


def _leave_one_out(x, y, weights, members, prior_vec, prior_weight, extra, noise, typical, query=None):
    """Regularised least squares of ``y`` on ``x`` over the ``members`` (with the prior's ridge rows and the
    ``extra`` smoothness rows): every point's prediction without its own row, and that prediction's variance
    (each row's noise: ``noise`` for points, ``typical`` for the others; M_(i)⁻¹x = M⁻¹x / (1 - h)).
    ``query``: rows to predict at instead (no row left out)."""
    n, k = x.shape
    sw = np.sqrt(weights[members])
    rows = [x[members] * sw[:, None], math.sqrt(prior_weight) * np.eye(k)]
    row_y = [y[members] * sw, math.sqrt(prior_weight) * prior_vec]
    row_noise = [noise[members], np.full(k, typical)]
    if extra is not None and len(extra):
        rows.append(extra)
        row_y.append(np.zeros(len(extra)))
        row_noise.append(np.full(len(extra), typical))
    design = np.vstack(rows)
    noise2 = np.concatenate(row_noise) ** 2
    inverse = np.linalg.inv(design.T @ design)
    if query is not None:
        reach = query @ inverse
        return (reach @ (design.T @ np.concatenate(row_y)),
                np.sum((reach @ ((design * noise2[:, None]).T @ design)) * reach, axis=1))
    reach = x @ inverse  # x'M⁻¹ for every point: [points, terms]
    pred = reach @ (design.T @ np.concatenate(row_y))
    quad = np.sum(reach * x, axis=1)  # x'M⁻¹x
    leverage = np.zeros(n)
    leverage[members] = np.minimum(weights[members] * quad[members], 1.0 - 1e-12)
    # Variance from every row but the point's own: x'M⁻¹(A'N²A)M⁻¹x minus that row.
    spread = np.sum((reach @ ((design * noise2[:, None]).T @ design)) * reach, axis=1)
    spread[members] -= noise[members] ** 2 * weights[members] * quad[members] ** 2
    high = np.flatnonzero(leverage > 0.5)  # there the subtraction would cancel: sum the other rows one by one
    if high.size:
        gain = reach[high] @ design.T  # [points, rows]
        gain[np.arange(high.size), np.searchsorted(np.flatnonzero(members), high)] = 0.0
        spread[high] = (gain ** 2) @ noise2
    return (pred - leverage * (y - pred) / (1.0 - leverage),
            np.maximum(spread, 0.0) / (1.0 - leverage) ** 2)


def _edges(verify_ms, fit_weights, shapes, design_rows, on_compute, priors, prior_weight, smooth, noise,
           typical) -> tuple[np.ndarray, np.ndarray]:
    """[plane, point]: for each point past the data (more batch tokens, KV tokens or pairs than every other
    point the fit holds), each plane's value at the point pulled back to the edge of the data, fitted without
    the point, and its variance (elsewhere -inf and inf). The planes never fall as those grow, but their
    unconstrained extrapolation may: a time of 0 ms at a KV length 10⁵ times the rest is no plausible step."""
    n = len(verify_ms)
    edge, edge_var = np.full((2, n), -np.inf), np.full((2, n), np.inf)
    live = fit_weights > 0
    if live.sum() < 2:
        return edge, edge_var
    caps = []
    for values in shapes:
        order = np.argsort(np.where(live, values, -np.inf))[::-1]
        cap = np.full(n, values[order[0]])
        cap[order[0]] = values[order[1]]  # the largest point's own edge is the next one
        caps.append(cap)
    far = np.flatnonzero(np.any([values > cap for values, cap in zip(shapes, caps)], axis=0))
    if not far.size:
        return edge, edge_var
    edge_mem, edge_comp, edge_offset = design_rows(*[np.minimum(v[far], cap[far]) for v, cap in zip(shapes, caps)])
    mem_x, comp_x, offset = design_rows(*shapes)
    for plane, x, y, edge_x, edge_add, members, extra in (
            (0, mem_x, verify_ms, edge_mem, np.zeros(far.size), ~on_compute, None),
            (1, comp_x, verify_ms - offset, edge_comp, edge_offset, on_compute, smooth)):
        for j, i in enumerate(far):
            keep = members.copy()
            keep[i] = False
            pred, spread = _leave_one_out(x, y, fit_weights, keep, priors[plane], prior_weight, extra, noise,
                                          typical, query=edge_x[j:j + 1])
            edge[plane, i], edge_var[plane, i] = float(pred[0] + edge_add[j]), float(spread[0])
    return edge, edge_var


def _non_negative(params: CostParams) -> CostParams:
    """Final guard: every fitted term ≥ 0 and finite, the curve non-decreasing (the fits above already
    keep them so; this makes it a property of the returned parameters)."""
    def clean(value: float) -> float:
        return float(value) if math.isfinite(value) and value > 0 else 0.0

    rise = np.maximum.accumulate([clean(r) for r in params.compute_rise_ms]) if params.compute_rise_ms else ()
    return replace(params, **{name: clean(getattr(params, name)) for name in _TERMS},
                   compute_rise_ms=tuple(float(r) for r in rise))


def _cell_index(batch_tokens: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
    """Verify-sketch cell of each observation. Batch cells: the compute curve's
    segments; KV cells: frexp's exponent of x >= 1 is int(x).bit_length(), 0
    stays in cell 0."""
    b = np.clip(np.searchsorted(_KNOTS, batch_tokens, side="right") - 1, 0, len(_KNOTS) - 1)
    k = np.where(kv_tokens >= 1, np.minimum(np.frexp(np.maximum(kv_tokens, 1.0))[1], KV_BITS - 1), 0)
    return b * KV_BITS + k


class StepCostModel:
    """Online fit of one worker's step cost.

    Parameters
    ----------
    prior : starting parameters (e.g. ``CostParams.from_hardware``).
    prior_weight : ridge weight pulling each plane toward the prior; it decides
        a plane no data supports and is negligible once data arrives.
    max_cell_weight : evidence cap per grid cell; older evidence is scaled
        down when a cell exceeds it, so the fit follows a worker that changes.

    Examples
    --------
    >>> truth = CostParams(mem_ms=8.0, mem_ms_per_kv_token=4e-5, compute_ms=1.0, compute_ms_per_token=0.02)
    >>> model = StepCostModel(prior=CostParams(mem_ms=5.0))
    >>> for b in (1, 4, 16, 64, 256, 1024, 2048):
    ...     for kv in (1_000, 100_000, 1_000_000):
    ...         model.observe_verify(b, kv, truth.verify_ms(b, kv))
    >>> fitted = model.refit()
    >>> round(fitted.mem_ms, 1), round(fitted.compute_ms_per_token, 3)
    (8.0, 0.02)
    """

    def __init__(self, prior: CostParams = CostParams(), prior_weight: float = 1e-3, max_cell_weight: float = 500.0):
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if max_cell_weight <= 0:
            raise ValueError(f"max_cell_weight must be > 0, got {max_cell_weight}")
        self.prior = prior
        self.prior_weight = prior_weight
        self.max_cell_weight = max_cell_weight
        cells = len(COMPUTE_KNOTS) * KV_BITS
        # Per cell: weight, Σw·N, Σw·KV, Σw·pairs, Σw·T, Σw·T².
        self._w = np.zeros(cells)
        self._n = np.zeros(cells)
        self._kv = np.zeros(cells)
        self._pairs = np.zeros(cells)
        self._t = np.zeros(cells)
        self._t2 = np.zeros(cells)
        # Draft model normal equations over [spec, max_depth, nodes, level-KV (millions)].
        self._draft_xtx = np.zeros((4, 4))
        self._draft_xty = np.zeros(4)
        self._draft_weight = 0.0
        # Catch-ups: decayed Σ ms and Σ tokens (a ratio through the origin).
        self._catch_up_ms = 0.0
        self._catch_up_tokens = 0.0
        self._catch_ups = 0.0
        # Observations since the last fold (bounded: folded every PENDING_FOLD).
        self._pending: list[tuple[float, float, float, float]] = []
        self._pending_draft: list[tuple[float, float, float, float, float]] = []
        # Start-up calibration, kept apart from live cells: [samples, (N, KV, pairs, ms, weight)].
        self._calibration = np.zeros((0, 5))
        self._calibration_cells = np.zeros(0, dtype=np.int64)
        self._calibration_fit: CostParams | None = None
        self.calibration_scale = 1.0
        self.calibration_error = CALIBRATION_ERROR_PRIOR  # until live cells inside its range say
        self.samples = 0
        self._judged_off = np.zeros(0, dtype=np.int64)  # cells the robust rule moved at the last refit
        self.params = prior
        self.rmse_ms = 0.0

    def calibrate(self, samples) -> None:
        """Verify times the worker measured at start-up, ``(batch_tokens,
        kv_tokens, attn_pairs, verify_ms, weight)`` each (at most 256 kept).

        They give the curve its *shape* where traffic has not been: the
        level is the live one. A worker measured on a quiet machine and
        then run among other processes (or warmer, or throttled) is slower
        at every shape by a similar factor, so at each refit the samples
        are scaled by the weighted least-squares ratio of live cell means to
        what the calibration alone predicts at those cells' shapes, over the
        live cells inside the calibrated range (``calibration_scale``; 1 until
        traffic reaches it). Shapes, not segments: one segment of batch tokens
        holds 96 requests of one token at 1k context and 15 of six tokens at
        4k; compared as one, a measured H200 table scaled itself to 0.6-0.7
        of live steps it matched exactly. Mixed unscaled, a calibration 20 %
        below live times makes the curve flat from the last live shape to
        the first calibrated one: the reference worker's controller saw 7
        and 8 tokens as free at batch 1 and planned 8-token trees."""
        rows = np.asarray(list(samples), dtype=float).reshape(-1, 5)[:256]
        bad = ~np.isfinite(rows).all(axis=1) | (rows[:, 3] <= 0) | (rows[:, 4] <= 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"calibration sample {i}: {tuple(rows[i].tolist())} needs finite values, "
                             f"verify_ms > 0 and weight > 0")
        self._calibration = rows
        self._calibration_cells = _cell_index(rows[:, 0], rows[:, 1])  # fixed with the samples
        # What the calibration alone says, at any shape (live cells are compared with it).
        self._calibration_fit = (fit_max_planes(rows[:, 0], rows[:, 1], rows[:, 3], rows[:, 4], self.prior,
                                                self.prior_weight, attn_pairs=rows[:, 2]) if len(rows) else None)

    @property
    def calibration_samples(self) -> int:
        return len(self._calibration)

    def _scaled_calibration(self) -> np.ndarray:
        """Calibration rows with ms scaled to the live level (see :meth:`calibrate`)."""
        cal = self._calibration.copy()
        # Live cells of a few steps each, inside the calibrated range (batch tokens within its span,
        # KV within a factor of 2 of its span: the calibration's fit interpolates there).
        n_lo, n_hi = cal[:, 0].min(), cal[:, 0].max()
        kv_lo, kv_hi = cal[:, 1].min() / 2, cal[:, 1].max() * 2
        live = np.flatnonzero(self._w >= 3.0)
        if live.size and self._calibration_fit is not None:
            w = self._w[live]
            n, kv, pairs, t = (self._n[live] / w, self._kv[live] / w, self._pairs[live] / w, self._t[live] / w)
            inside = (n >= n_lo) & (n <= n_hi) & (kv >= kv_lo) & (kv <= kv_hi)
            if inside.any():
                pred = np.asarray(self._calibration_fit.verify_ms(n[inside], kv[inside], pairs[inside]), dtype=float)
                w = np.minimum(w[inside], 64.0)  # one busy cell is not the whole comparison
                self.calibration_scale = float(np.clip(np.sum(w * t[inside] * pred) / np.sum(w * pred * pred),
                                                       0.25, 4.0))
                # What the scale leaves: the calibration's shape error, past what each cell's own noise
                # (its spread over its steps) explains. An error of shape is one per cell, not per step: a
                # cell counts as one comparison once it holds 64 steps, and the scale used one of them up
                # (one cell always matches), so few cells leave it near the prior.
                miss = t[inside] / (self.calibration_scale * pred) - 1.0
                steps = self._w[live][inside]
                spread2 = np.maximum(self._t2[live][inside] / steps - t[inside] ** 2, 0.0)
                noise2 = spread2 / np.maximum(t[inside], 1e-12) ** 2 / steps
                cells = w / 64.0
                excess = float(np.sum(cells * np.maximum(miss ** 2 - noise2, 0.0)))
                self.calibration_error = math.sqrt(
                    (CALIBRATION_PRIOR_CELLS * CALIBRATION_ERROR_PRIOR ** 2 + excess)
                    / (CALIBRATION_PRIOR_CELLS + max(float(cells.sum()) - 1.0, 0.0)))
        cal[:, 3] *= self.calibration_scale
        # Where live steps share its segment of the curve, a sample weighs what it is worth next to them:
        # its repeats average its noise away, not its systematic error. A live step scatters by the cells'
        # pooled noise σ²; a sample of w repeats is off by σ²/w + (error · ms)², so it is worth
        # 1 / (1/w + (error · ms)² / σ²) live steps, and a few live steps at its batch tokens outweigh it,
        # as they must (it is what they correct). Where no live step reaches it keeps its repeats: there it
        # is what shapes the curve against the smoothness pull. (The live noise, not the fit's RMSE: a
        # refit must not move the next one's weights.)
        cells = np.flatnonzero(self._w >= 2.0)
        if cells.size:
            w = self._w[cells]
            noise2 = float(np.sum(np.maximum(self._t2[cells] - self._t[cells] ** 2 / w, 0.0)) / w.sum())
            live_segment = self._w.reshape(len(COMPUTE_KNOTS), KV_BITS).sum(axis=1) > 0
            shared = live_segment[self._calibration_cells // KV_BITS]
            if noise2 > 0 and shared.any():
                bias2 = (self.calibration_error * cal[shared, 3]) ** 2
                cal[shared, 4] = cal[shared, 4] / (1.0 + cal[shared, 4] * bias2 / noise2)
        return cal

    def observe_verify(self, batch_tokens: int, kv_tokens: int, verify_ms: float, attn_pairs: float = 0.0) -> None:
        self._pending.append((batch_tokens, kv_tokens, verify_ms, attn_pairs))
        if len(self._pending) >= PENDING_FOLD:
            self._fold()

    def observe_draft(self, max_depth: int, total_nodes: int, level_kv_tokens: float, draft_ms: float) -> None:
        self._pending_draft.append((1.0 if max_depth > 0 else 0.0, max_depth, total_nodes,
                                    level_kv_tokens / _KV_SCALE, draft_ms))
        if len(self._pending_draft) >= PENDING_FOLD:
            self._fold()

    def observe_catch_up(self, tokens: int, catch_up_ms: float) -> None:
        """One step's catch-up: ``tokens`` caught up on in ``catch_up_ms``."""
        if not (tokens > 0 and math.isfinite(tokens) and 0 <= catch_up_ms <= MAX_STEP_MS):
            return
        if self._catch_ups >= self.max_cell_weight:  # follow a worker that changes
            self._catch_up_ms *= 0.5
            self._catch_up_tokens *= 0.5
            self._catch_ups *= 0.5
        self._catch_up_ms += catch_up_ms
        self._catch_up_tokens += tokens
        self._catch_ups += 1.0

    def observe_step(self, batch_tokens: int, kv_tokens: int, max_depth: int, total_nodes: int,
                     level_kv_tokens: float, draft_ms: float, verify_ms: float, attn_pairs: float = 0.0) -> None:
        self.observe_verify(batch_tokens, kv_tokens, verify_ms, attn_pairs)
        self.observe_draft(max_depth, total_nodes, level_kv_tokens, draft_ms)

    def _fold(self) -> None:
        """Move buffered observations into the grid and the normal equations
        (vectorised: the per-step path only appends a tuple)."""
        if self._pending:
            obs = np.asarray(self._pending, dtype=float)  # [steps, (N, KV, T, pairs)]
            self._pending.clear()
            # A report that is not a time (NaN, negative, past MAX_STEP_MS) would poison its cell for good.
            obs = obs[np.isfinite(obs).all(axis=1) & (obs[:, 0] > 0) & (obs[:, 1] >= 0) & (obs[:, 3] >= 0)
                      & (obs[:, 2] >= 0) & (obs[:, 2] <= MAX_STEP_MS)]
            self.samples += len(obs)
            n, kv, t, pairs = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
            cells = _cell_index(n, kv)
            for arr, values in ((self._w, np.ones_like(t)), (self._n, n), (self._kv, kv), (self._pairs, pairs),
                                (self._t, t), (self._t2, t * t)):
                np.add.at(arr, cells, values)
            over = self._w > self.max_cell_weight
            if over.any():  # forget the oldest evidence of busy cells
                scale = np.where(over, self.max_cell_weight / np.maximum(self._w, 1e-12), 1.0)
                for arr in (self._w, self._n, self._kv, self._pairs, self._t, self._t2):
                    arr *= scale
        if self._pending_draft:
            rows = np.asarray(self._pending_draft, dtype=float)  # [steps, (spec, depth, nodes, level-KV, y)]
            self._pending_draft.clear()
            rows = rows[np.isfinite(rows).all(axis=1) & (rows >= 0).all(axis=1) & (rows[:, 4] <= MAX_STEP_MS)]
            x, y = rows[:, :4], rows[:, 4]
            if self._draft_weight >= self.max_cell_weight * 4:
                self._draft_xtx *= 0.5
                self._draft_xty *= 0.5
                self._draft_weight *= 0.5
            self._draft_xtx += x.T @ x
            self._draft_xty += x.T @ y
            self._draft_weight += len(rows)

    def refit(self) -> CostParams:
        self._fold()
        w = self._w
        used = np.flatnonzero(w > 0)
        params = self.prior
        cal = self._scaled_calibration() if len(self._calibration) else np.zeros((0, 5))
        if used.size or len(cal):
            weights = w[used]
            n = self._n[used] / weights
            kv = self._kv[used] / weights
            t = self._t[used] / weights
            pairs = self._pairs[used] / weights
            t2 = self._t2[used] / weights
            spread = np.sqrt(np.maximum(t2 - t * t, 0.0))  # within each cell (the robust rule reads it)
            verify = np.concatenate([t, cal[:, 3]])
            start = np.zeros(len(verify), dtype=bool)  # the cells the robust rule judged off last time
            start[:used.size] = np.isin(used, self._judged_off)
            params, fitted = _fit_max_planes(
                np.concatenate([n, cal[:, 0]]), np.concatenate([kv, cal[:, 1]]), verify,
                np.concatenate([weights, cal[:, 4]]), self.prior, self.prior_weight,
                attn_pairs=np.concatenate([pairs, cal[:, 2]]),
                spread_ms=np.concatenate([spread, np.full(len(cal), np.nan)]), start_excluded=start)
            kept = fitted == verify  # cells the robust rule left alone
            self._judged_off = used[~kept[:used.size]]
            live = kept[:used.size]
            if live.any():  # RMSE over the live observations the fit kept: within-cell spread plus fit error
                pred = params.verify_ms(n[live], kv[live], pairs[live])
                mse = np.sum(weights[live] * (t2[live] - 2 * t[live] * pred + pred**2)) / weights[live].sum()
                self.rmse_ms = float(math.sqrt(max(mse, 0.0)))
            if params.compute_knots:
                evidence = np.zeros_like(self._w)
                evidence[used] = np.where(live, weights, 0.0)
                live_segment = evidence.reshape(len(COMPUTE_KNOTS), KV_BITS).sum(axis=1)
                np.add.at(evidence, self._calibration_cells, np.where(kept[used.size:], self._calibration[:, 4], 0.0))
                per_segment = evidence.reshape(len(COMPUTE_KNOTS), KV_BITS).sum(axis=1)
                params = replace(params, compute_evidence=tuple(float(e) for e in per_segment),
                                 live_evidence=tuple(float(e) for e in live_segment),
                                 verify_rmse_ms=self.rmse_ms,
                                 calibration_error=self.calibration_error if len(cal) else 0.0)
        params = self._fit_draft(params)
        if self._catch_up_tokens > 0:
            params = replace(params, catch_up_ms_per_token=self._catch_up_ms / self._catch_up_tokens)
        self.params = _non_negative(params)
        return self.params

    def _fit_draft(self, params: CostParams) -> CostParams:
        if self._draft_weight == 0:
            return params
        p = self.prior
        prior = np.array([p.draft_fixed_ms, p.draft_ms_per_level, p.draft_ms_per_node,
                          p.draft_ms_per_level_kv_token * _KV_SCALE])
        lam = self.prior_weight
        # min ||A θ - y||² + λ||θ - θ0||² with θ ≥ 0, via a Cholesky factor of
        # the regularised normal equations.
        factor = np.linalg.cholesky(self._draft_xtx + lam * np.eye(4))
        rhs = np.linalg.solve(factor, self._draft_xty + lam * prior)
        theta = nnls(factor.T, rhs)[0]
        return replace(params, draft_fixed_ms=float(theta[0]), draft_ms_per_level=float(theta[1]),
                       draft_ms_per_node=float(theta[2]), draft_ms_per_level_kv_token=float(theta[3] / _KV_SCALE))
