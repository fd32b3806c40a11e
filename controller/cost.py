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
the three regimes of design.md §3: at small batch the memory plane
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
traffic has been yet, at the level live traffic sets.

Memory is bounded: verify observations land in a fixed grid of cells over
(batch-token segment, log2 kv_tokens), each keeping decayed weighted sums;
the draft model keeps 4×4 normal-equation sums. Nothing grows with traffic.
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
KV_BITS = 30  # KV tokens up to 1G per step


@dataclass(frozen=True)
class CostParams:
    mem_ms: float = 10.0
    mem_ms_per_kv_token: float = 0.0
    compute_ms: float = 0.0
    compute_ms_per_token: float = 0.0
    compute_ms_per_pair: float = 0.0
    # The compute curve: batch tokens at the knots and the ms it has risen above
    # ``compute_ms`` there (non-decreasing, 0 at the first knot). Empty: linear plane.
    compute_knots: tuple[float, ...] = ()
    compute_rise_ms: tuple[float, ...] = ()
    # How well the fit knows each segment of the curve: the (decayed) number of
    # verify observations whose batch tokens fall in it, and the fit's RMSE.
    # Empty: the parameters are exact (a prior, or a simulator's truth).
    compute_evidence: tuple[float, ...] = ()
    verify_rmse_ms: float = 0.0
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
                + self.compute_ms_per_pair * np.asarray(attn_pairs, dtype=float))
        out = np.maximum(mem, comp)
        return float(out) if out.ndim == 0 else out

    def verify_sd_ms(self, batch_tokens):
        """Standard error (ms) of :meth:`verify_ms` at ``batch_tokens``: the fit's
        RMSE over the root of one plus the observations in that segment of the
        curve. A batch size the worker has never run is priced by interpolation
        and carries a whole RMSE; one it runs all day, almost none. 0 when the
        parameters carry no evidence (exact costs)."""
        n = np.asarray(batch_tokens, dtype=float)
        if not self.compute_evidence or self.verify_rmse_ms <= 0:
            out = np.zeros(n.shape)
        else:
            knots = np.asarray(self.compute_knots, dtype=float)
            seg = np.clip(np.searchsorted(knots, n, side="right") - 1, 0, len(knots) - 1)
            out = self.verify_rmse_ms / np.sqrt(1.0 + np.asarray(self.compute_evidence)[seg])
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
    continues at the last fitted slope.
    """
    ones = np.ones(len(batch_tokens))
    pairs = np.zeros(len(batch_tokens)) if attn_pairs is None else attn_pairs
    start, length = _segments(np.asarray(knots, dtype=float))
    active = np.flatnonzero((start < batch_tokens.max()) & (start + length > batch_tokens.min()))
    seg_x = _segment_basis(batch_tokens, start[active], length[active],
                           open_last=bool(len(active)) and active[-1] == len(start) - 1)  # [points, active segments]
    mem_x = np.column_stack([ones, kv_tokens / _KV_SCALE])  # [points, 2]
    comp_x = np.column_stack([ones, pairs / _P_SCALE, seg_x])  # [points, 2 + active]
    sw = np.sqrt(weights)
    prior_mem = np.array([prior.mem_ms, prior.mem_ms_per_kv_token * _KV_SCALE])
    # The intercept is the plane's value where the data starts: at the first active segment.
    anchor = start[active[0]] if len(active) else batch_tokens.min()
    prior_comp = np.concatenate([[prior.compute_ms + float(prior.compute_curve_ms(anchor)),
                                  prior.compute_ms_per_pair * _P_SCALE],
                                 prior.segment_slopes(knots)[active] * length[active]])
    ridge = math.sqrt(prior_weight)
    # Smoothness rows: (slope_j - slope_{j+1}) times their mean length, for neighbouring active segments.
    smooth = np.zeros((max(len(active) - 1, 0), comp_x.shape[1]))
    for row, (a, b) in enumerate(zip(active[:-1], active[1:])):
        scale = math.sqrt(SMOOTHNESS) * 0.5 * (length[a] + length[b])
        smooth[row, 2 + row] = scale / length[a]
        smooth[row, 3 + row] = -scale / length[b]

    def solve(x: np.ndarray, mask: np.ndarray, prior_vec: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        blocks = [x[mask] * sw[mask, None], ridge * np.eye(len(prior_vec))]
        target = [verify_ms[mask] * sw[mask], ridge * prior_vec]
        if extra is not None and len(extra):
            blocks.append(extra)
            target.append(np.zeros(len(extra)))
        return nnls(np.vstack(blocks), np.concatenate(target))[0]

    def sse(mem: np.ndarray, comp: np.ndarray) -> float:
        pred = np.maximum(mem_x @ mem, comp_x @ comp)
        return float(np.sum(weights * (pred - verify_ms) ** 2))

    # Both extremes (every point on one plane) among the starts: from "all memory" alone, a CPU where each
    # token costs ~7 % settled on one flat memory plane over 1-8 tokens (tests: the Xeon EAGLE cells).
    starts = [np.zeros(len(ones), dtype=bool), np.ones(len(ones), dtype=bool),
              batch_tokens > np.median(batch_tokens), comp_x @ prior_comp > mem_x @ prior_mem]
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for mask in starts:
        mem, comp = prior_mem, prior_comp
        for _ in range(iterations):
            mem = solve(mem_x, ~mask, prior_mem)
            comp = solve(comp_x, mask, prior_comp, smooth)
            new_mask = comp_x @ comp > mem_x @ mem
            if np.array_equal(new_mask, mask):
                break
            mask = new_mask
        err = sse(mem, comp)
        if best is None or err < best[0]:
            best = (err, mem, comp)
    _, mem, comp = best
    fitted = replace(prior, mem_ms=float(mem[0]), mem_ms_per_kv_token=float(mem[1] / _KV_SCALE),
                     compute_ms_per_pair=float(comp[1] / _P_SCALE))
    if not len(active):  # one batch size only: the curve keeps the prior's shape
        return replace(fitted, compute_ms=float(comp[0]) - float(prior.compute_curve_ms(anchor)))
    slopes = np.zeros(len(start))  # flat below the data
    slopes[active] = comp[2:] / length[active]
    # Past the data the curve continues at the steeper of the last segment's slope
    # and the mean slope over the data: one sparse, noisy last segment must not
    # make every larger batch look free (kernels only get more compute-bound).
    lo, hi = max(start[active[0]], batch_tokens.min()), batch_tokens.max()
    covered = np.clip(np.minimum(start[active] + length[active], hi) - np.maximum(start[active], lo), 0.0, None)
    mean_slope = float(np.sum(slopes[active] * covered) / max(hi - lo, 1e-9))
    slopes[active[-1] + 1:] = max(slopes[active[-1]], mean_slope)
    rise = np.concatenate([[0.0], np.cumsum(slopes[:-1] * length[:-1])])  # 0 up to the anchor
    return replace(fitted, compute_ms=float(comp[0]), compute_ms_per_token=float(slopes[-1]),
                   compute_knots=tuple(float(k) for k in start), compute_rise_ms=tuple(float(r) for r in rise))


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
        self.calibration_scale = 1.0
        self.samples = 0
        self.params = prior
        self.rmse_ms = 0.0

    def calibrate(self, samples) -> None:
        """Verify times the worker measured at start-up, ``(batch_tokens,
        kv_tokens, attn_pairs, verify_ms, weight)`` each (at most 256 kept).

        They give the curve its *shape* where traffic has not been: the
        level is the live one. A worker measured on a quiet machine and
        then run among other processes (or warmer, or throttled) is slower
        at every shape by a similar factor, so at each refit the samples
        are scaled by the weighted least-squares ratio of live means to
        calibration at the batch-token segments that have both
        (``calibration_scale``; 1 until traffic overlaps them). Mixed unscaled, a calibration 20 %
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

    @property
    def calibration_samples(self) -> int:
        return len(self._calibration)

    def _scaled_calibration(self) -> np.ndarray:
        """Calibration rows with ms scaled to the live level (see :meth:`calibrate`)."""
        cal = self._calibration.copy()
        # Compared per batch-token segment (all context lengths together): a start-up
        # grid and live traffic rarely share a KV cell, and the scale is one number.
        segment = self._calibration_cells // KV_BITS
        seg_w = self._w.reshape(len(COMPUTE_KNOTS), KV_BITS).sum(axis=1)
        seg_t = self._t.reshape(len(COMPUTE_KNOTS), KV_BITS).sum(axis=1)
        live_w = seg_w[segment]
        both = live_w >= 3.0  # a few live steps at the same batch tokens
        if both.any():
            live = seg_t[segment[both]] / live_w[both]
            ms, w = cal[both, 3], np.minimum(live_w[both], cal[both, 4])
            self.calibration_scale = float(np.clip(np.sum(w * live * ms) / np.sum(w * ms * ms), 0.25, 4.0))
        cal[:, 3] *= self.calibration_scale
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
        if tokens <= 0:
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
            self.samples += len(self._pending)
            self._pending.clear()
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
            params = fit_max_planes(np.concatenate([n, cal[:, 0]]), np.concatenate([kv, cal[:, 1]]),
                                    np.concatenate([t, cal[:, 3]]), np.concatenate([weights, cal[:, 4]]),
                                    self.prior, self.prior_weight, attn_pairs=np.concatenate([pairs, cal[:, 2]]))
            if used.size:  # RMSE over every live observation: within-cell spread plus fit error
                t2 = self._t2[used] / weights
                pred = params.verify_ms(n, kv, pairs)
                mse = np.sum(weights * (t2 - 2 * t * pred + pred**2)) / weights.sum()
                self.rmse_ms = float(math.sqrt(max(mse, 0.0)))
            if params.compute_knots:
                evidence = self._w.copy()
                np.add.at(evidence, self._calibration_cells, self._calibration[:, 4])
                per_segment = evidence.reshape(len(COMPUTE_KNOTS), KV_BITS).sum(axis=1)
                params = replace(params, compute_evidence=tuple(float(e) for e in per_segment),
                                 verify_rmse_ms=self.rmse_ms)
        params = self._fit_draft(params)
        if self._catch_up_tokens > 0:
            params = replace(params, catch_up_ms_per_token=self._catch_up_ms / self._catch_up_tokens)
        self.params = params
        return params

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
