"""Row-count-aware dispatch of the target's linear layers on the CPU.

Speculative decoding rests on one property of the hardware: a forward over
a few rows (the root plus its draft nodes) costs about what a forward over
one row costs, because either way the step is the time it takes to stream
the weights. On this project's CPU that property depends on the GEMM kernel,
not on the machine. torch's default ``F.linear`` (MKL sgemm) streams the
weights once for one row but pays again for every two or three more: over
SmolLM2's 30 MLP matrices (106 MB, one thread) it took 10.8 / 15.9 / 18.1 /
13.1 ms for 1 / 2 / 3 / 4 rows, and the 576 × 49 152 LM head 11.1 / 24.6 /
37.3 / 19.3 ms. oneDNN with a prepacked weight streams them once up to ~16
rows (MLP 8.1 / 9.7 / 6.9 / 6.3 ms; LM head 8.7 / 12.2 / 8.7 / 6.5 ms), but
has slow paths of its own (one and two rows cost more than four).

So the engine measures instead of assuming. :func:`tune` times every
candidate kernel (MKL, and oneDNN with each weight-layout hint of
``PACK_HINTS``) on the model's own matrices — enough of each shape to
stream from memory as a real forward does — at each row count of
``ROW_GRID``, and :func:`plan_dispatch` turns the timings into a table:
for ``r`` rows, the kernel and the padded row count ``r' ≥ r`` on the grid
with the least measured time. Zero rows of padding change no real row
(rows are independent in a matrix product), and taking the minimum over
``r' ≥ r`` makes the table's cost non-decreasing in ``r``: a forward over
more rows never costs less, which the controller's cost model relies on.
Each shape keeps at most one packed copy of its weights (the kernel whose
table is cheapest over the grid), or none when MKL alone is as good.

Timed shape by shape, a kernel can win and still lose inside the model: on
a 2-core AMD EPYC without AVX-512 (family 23) every shape's table came
within 0.93–1.00× MKL's time for one row, yet the whole stack of 211
layers, called in the model's order with oneDNN and MKL taking turns, ran
one row in 68.0 ms on the tables against 60.8 ms on MKL alone, and the
engine's plain step was 9 % dearer. So the tables are checked where they
are used (:func:`check_on_stack`): one pass over every tuned layer in the
model's order is timed at each row count up to ``CHECK_MAX_ROWS``, on the
tables and on MKL alone; each shape takes, per row count, whichever ran
faster inside the stack; and a second pass keeps, per row count, the
fastest of tables, that mix and MKL alone. The check compares
configurations at the same row count only, so it may leave a row count
dearer than the next one; the controller's cost model does not depend on
it, as it fits a monotone curve to the verify times it is sent.

The outputs differ from ``F.linear`` by float rounding only (a different
summation order: ~1e-6 relative); greedy decoding stays lossless against
plain decoding exactly as it was (MKL itself sums differently for one row
and for several), which the engine tests check on the tuned model.

A layer whose numerics may change — a drafter's: what it proposes is
verified by the target, so greedy decoding stays lossless whatever it
computes — can also take ``bf16:<hint>``: its weights packed in bfloat16 for
oneDNN's AVX-512 BF16 kernels (inputs rounded to bfloat16, accumulation and
output in fp32). Streaming half the bytes, it ran SmolLM2's MLP stack in
4.1–4.8 ms for 1–6 rows against 7.4–11.6 ms for fp32 oneDNN. Such a layer
can also take ``int8``: weights quantised to int8 per output channel
(symmetric), activations per call, fbgemm's integer GEMM with fp32 out
(torch's dynamic-quantisation kernels): a quarter of the bytes and integer
multiply-adds where the CPU has no bf16 ones; ~2 % relative error on
random weights. The target never gets either (``allow_lossy`` is off by
default): its numbers define the output every speculative step must
reproduce.

Tables are cached per (CPU, torch, threads, shapes, candidates) under
``$XDG_CACHE_HOME/specctl/kernels/``. The packed weights are copies: the
model must stay frozen once tuned (inference only; with autograd on, a
tuned layer falls back to ``F.linear`` on the original weight).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from worker.reference.cache import cache_dir

__all__ = ["BF16", "CHECK_MAX_ROWS", "DENSE", "DRAFT_ROW_GRID", "INT8", "ONEDNN", "PACK_HINTS", "ROW_GRID", "Dispatch",
           "KernelReport", "ShapeTiming", "StackTiming", "TunedLinear", "best_of", "bf16_available", "check_on_stack",
           "install", "int8_available", "is_tuned", "kernels_available", "mkl_only", "plan_dispatch", "time_stack",
           "tune", "tune_model"]

DENSE = "dense"  # F.linear (MKL)
ONEDNN = "onednn"  # "onednn:<hint>": fp32 weights prepacked for oneDNN
BF16 = "bf16"  # "bf16:<hint>": bfloat16 weights prepacked for oneDNN (lossy; drafters only)
INT8 = "int8"  # int8 weights per output channel, fbgemm's dynamic-quantised linear (lossy; drafters only)
# Row counts timed: every count a decode or verify step of up to 8 rows × 8
# nodes meets is at most one grid step away.
ROW_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 40, 48, 56, 64, 80, 96, 128)
# A drafter's forwards run one row per tree node of a level (≤ batch × width:
# 32 at 8 × 4), the few past it being prompt ingests. Its layers are tuned on
# this grid only: the packed kernel kept is the one cheapest summed over the
# grid, and on the full grid the 40–128-row costs, ten times the small ones,
# would choose it (int8 wins 2–4× up to 8 rows, not at 128).
DRAFT_ROW_GRID = tuple(r for r in ROW_GRID if r <= 32)
PACK_HINTS = (4, 16, 64)  # oneDNN's "expected rows" for the weight layout
# Matrices of one shape timed together: past the last-level cache, as in a forward.
STREAM_BYTES = 48 << 20
# Row counts up to which the tables are checked on the whole layer stack: a
# verify step's rows (batch x nodes); past it the rows are prefills, where
# the packed kernels win by far.
CHECK_MAX_ROWS = 32
_FORMAT = 4  # 4: tables checked on the whole stack (3: least time over the repetitions; 2: median)


def kernels_available() -> bool:
    """oneDNN's prepacked linear is in this torch build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def bf16_available() -> bool:
    """oneDNN packs bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on a plain AVX2 CPU the packing itself raises)."""
    if not kernels_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 4)
    except RuntimeError:
        return False
    return True


def int8_available() -> bool:
    """torch's dynamic-quantised linear (``quantized::linear_dynamic``) is in this build."""
    return hasattr(torch.ops.quantized, "linear_dynamic") and "fbgemm" in torch.backends.quantized.supported_engines


def _pack_int8(weight: torch.Tensor):
    """``weight`` ``[out, in]`` as int8 with one scale per output row
    (symmetric: ``w ≈ scale_o · q``, ``q`` in [-127, 127]), packed for fbgemm."""
    w = weight.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
    with warnings.catch_warnings():  # torch marks quantised tensors deprecated; its kernels still take only them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scales.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def _pack(weight: torch.Tensor, kernel: str):
    """The weight copy ``kernel`` (``onednn:<hint>``, ``bf16:<hint>`` or ``int8``) runs on."""
    if kernel == INT8:
        return _pack_int8(weight)
    family, hint = kernel.split(":", 1)
    w = weight.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16) if family == BF16 else w, int(hint))


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _run_packed(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` on a packed copy, in ``x``'s dtype (a bf16 copy computes
    in bf16 and an int8 one in integers; both add the bias in fp32)."""
    if not isinstance(packed, torch.Tensor):
        # int8: each call quantises x per tensor to 7 bits (reduce_range: on CPUs without
        # VNNI, u8·s8 pair sums saturate int16 at 8 bits) and rescales the int32 sums
        out = torch.ops.quantized.linear_dynamic(x, packed, True)
    elif packed.dtype == x.dtype:
        return _packed_linear(x, packed, bias)
    else:
        out = _packed_linear(x.to(packed.dtype), packed, None).to(x.dtype)
    return out if bias is None else out + bias


@dataclass(frozen=True)
class ShapeTiming:
    """Median milliseconds per matrix of one ``[out, in]`` shape, per kernel
    and row count (``ms[kernel][i]`` at ``rows[i]``)."""

    out_features: int
    in_features: int
    matrices: int  # how many of the model's matrices were timed together
    rows: tuple[int, ...]
    ms: dict[str, tuple[float, ...]]


@dataclass(frozen=True)
class Dispatch:
    """What a tuned layer runs for ``r`` rows: ``choices[r - 1]`` = (kernel,
    padded rows) for ``r`` up to the grid's end; past it, the last entry's
    kernel on the rows as they are. ``packed``: the one packed kernel the
    layer keeps a weight copy for (None: MKL only). ``ms[r - 1]``: the
    measured cost of that choice."""

    packed: str | None
    choices: tuple[tuple[str, int], ...]
    ms: tuple[float, ...]

    def lookup(self, rows: int) -> tuple[str, int]:
        if rows <= len(self.choices):
            return self.choices[rows - 1]
        return self.choices[-1][0], rows


def plan_dispatch(timing: ShapeTiming, keep_dense_within: float = 0.02) -> Dispatch:
    """The cheapest (kernel, padded rows ≥ r) for every r on ``timing``'s grid.

    One packed kernel is kept per shape: the one whose table costs least
    summed over the grid; MKL alone is kept when it comes within
    ``keep_dense_within`` of that (no packed copy of the weights then).

    >>> t = ShapeTiming(8, 4, 1, (1, 2, 4), {"dense": (1.0, 3.0, 2.0), "onednn:4": (2.0, 2.5, 1.5)})
    >>> d = plan_dispatch(t)
    >>> d.packed, d.choices
    ('onednn:4', (('dense', 1), ('onednn:4', 4), ('onednn:4', 4), ('onednn:4', 4)))
    >>> d.lookup(3), d.lookup(9)
    (('onednn:4', 4), ('onednn:4', 9))
    """
    rows = np.asarray(timing.rows)

    def table(kernels: list[str]) -> tuple[list[tuple[str, int]], list[float]]:
        costs = np.stack([np.asarray(timing.ms[k]) for k in kernels])  # [kernels, grid]
        choices, ms = [], []
        for r in range(1, int(rows[-1]) + 1):
            at = np.flatnonzero(rows >= r)  # grid points that fit r rows
            k, g = np.unravel_index(np.argmin(costs[:, at]), (len(kernels), len(at)))
            choices.append((kernels[k], int(rows[at[g]])))
            ms.append(float(costs[k, at[g]]))
        return choices, ms

    dense_only = best = table([DENSE])
    packed = None
    for kernel in sorted(k for k in timing.ms if k != DENSE):
        candidate = table([DENSE, kernel])
        if sum(candidate[1]) < sum(best[1]):
            packed, best = kernel, candidate
    if sum(dense_only[1]) <= (1 + keep_dense_within) * sum(best[1]):
        packed, best = None, dense_only
    return Dispatch(packed, tuple(best[0]), tuple(best[1]))


@dataclass(frozen=True)
class StackTiming:
    """Least ms of one pass over every tuned layer in the model's order, per
    row count of ``rows`` and configuration (a name: ``total[name][i]``),
    and of that pass the time spent inside each shape's layers
    (``by_shape[name][shape][i]``)."""

    rows: tuple[int, ...]
    total: dict[str, tuple[float, ...]]
    by_shape: dict[str, dict[str, tuple[float, ...]]]


def _measured(timing: ShapeTiming, kernel: str, rows: int) -> float:
    """``kernel``'s ms for ``rows`` rows (interpolated between grid points)."""
    return float(np.interp(rows, timing.rows, timing.ms[kernel]))


def mkl_only(d: Dispatch, timing: ShapeTiming) -> Dispatch:
    """MKL on the rows as they are, for every row count ``d`` covers."""
    rows = range(1, len(d.choices) + 1)
    return Dispatch(None, tuple((DENSE, r) for r in rows), tuple(_measured(timing, DENSE, r) for r in rows))


def best_of(options: dict[str, Dispatch], costs: dict[str, Sequence[float]], rows: tuple[int, ...],
            timing: ShapeTiming) -> Dispatch:
    """One shape's dispatch picked among whole ``options`` by measured cost.

    For every ``r`` up to ``rows[-1]``, the option with the least
    ``costs[option]`` at the first grid point ``r' >= r`` decides, and the
    shape runs what that option runs for ``r'`` rows. Options are compared
    at the same row count only: they were timed in turns there, so a slow
    minute of a shared machine falls on all of them, where it may fall on
    one row count and not the next (padding across row counts stays with
    :func:`plan_dispatch`, on each shape's own timing). Past ``rows[-1]``
    the first option's choices stand. The packed copy kept is the first
    option's, if any choice still runs it.

    >>> t = ShapeTiming(8, 4, 1, (1, 2, 4), {"dense": (1.0, 3.0, 2.0), "onednn:4": (2.0, 2.5, 1.5)})
    >>> table = plan_dispatch(t)
    >>> table.choices
    (('dense', 1), ('onednn:4', 4), ('onednn:4', 4), ('onednn:4', 4))
    >>> options = {"table": table, "mkl": mkl_only(table, t)}
    >>> best_of(options, {"table": (1.0, 2.4), "mkl": (1.1, 2.0)}, (1, 2), t).choices
    (('dense', 1), ('dense', 2), ('onednn:4', 4), ('onednn:4', 4))
    >>> mkl = best_of(options, {"table": (1.0, 2.4, 2.2), "mkl": (1.1, 2.0, 1.7)}, (1, 2, 4), t)
    >>> mkl.choices, mkl.packed
    ((('dense', 1), ('dense', 2), ('dense', 4), ('dense', 4)), None)
    """
    names = list(options)
    cost = np.stack([np.asarray(costs[n], dtype=float) for n in names])  # [options, grid]
    first = options[names[0]]
    choices = list(first.choices)
    for r in range(1, min(rows[-1], len(choices)) + 1):
        g = next(i for i, n in enumerate(rows) if n >= r)
        choices[r - 1] = options[names[int(np.argmin(cost[:, g]))]].lookup(rows[g])
    ms = tuple(_measured(timing, kernel, padded) for kernel, padded in choices)
    packed = first.packed if any(kernel == first.packed for kernel, _ in choices) else None
    return Dispatch(packed, tuple(choices), ms)


class TunedLinear(torch.nn.Module):
    """``nn.Linear`` whose forward runs the kernel its :class:`Dispatch` picks
    for the number of rows. Shares ``weight`` and ``bias`` with the layer it
    replaces (tied embeddings stay tied); the packed copy is not a parameter."""

    def __init__(self, linear: torch.nn.Linear, dispatch: Dispatch) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.dispatch = dispatch
        self._packed = None if dispatch.packed is None else _pack(linear.weight, dispatch.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None or x.dtype != self.weight.dtype or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        kernel, padded = self.dispatch.lookup(rows) if rows else (DENSE, 0)
        if kernel == DENSE:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        if padded > rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out = _run_packed(flat.contiguous(), self._packed, self.bias)  # [padded, out]
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def redispatch(self, dispatch: Dispatch) -> None:
        """Run ``dispatch`` from now on: the same packed kernel, or none (the copy is dropped)."""
        if dispatch.packed not in (None, self.dispatch.packed):
            raise ValueError(f"redispatch keeps the packed kernel {self.dispatch.packed} or drops it, "
                             f"not {dispatch.packed}")
        self.dispatch = dispatch
        if dispatch.packed is None:
            self._packed = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.dispatch.packed}"


def is_tuned(model: torch.nn.Module) -> bool:
    """Some layer of ``model`` runs tuned kernels."""
    return any(isinstance(m, TunedLinear) for m in model.modules())


def _linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, layer) of every plain ``nn.Linear`` in ``model``."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                found.append((parent, name, child))
    return found


def candidates(hints: Iterable[int], allow_lossy: bool) -> list[str]:
    """Kernel names timed: MKL, oneDNN fp32 per hint, and where allowed the
    lossy ones this CPU and build run: oneDNN bf16 per hint and int8."""
    families = (ONEDNN, BF16) if allow_lossy and bf16_available() else (ONEDNN,)
    names = [DENSE] + [f"{f}:{h}" for f in families for h in hints]
    return names + [INT8] if allow_lossy and int8_available() else names


def _kernels(weights: list[torch.Tensor], names: list[str]) -> dict[str, Callable[[torch.Tensor], None]]:
    def dense(x: torch.Tensor) -> None:
        for w in weights:
            F.linear(x, w)

    def packed(copies: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
        def run(x: torch.Tensor) -> None:
            for p in copies:
                _run_packed(x, p, None)
        return run

    return {name: dense if name == DENSE else packed([_pack(w, name) for w in weights]) for name in names}


@torch.inference_mode()
def tune(weights: list[torch.Tensor], rows: tuple[int, ...] = ROW_GRID, kernels: list[str] | None = None,
         reps: int = 3, progress: Callable[[], None] | None = None) -> ShapeTiming:
    """Least ms per matrix of each kernel at each row count over ``reps``
    repetitions, over ``weights`` (all of one ``[out, in]`` shape) run back
    to back. Kernels and row counts are interleaved within every repetition,
    so a slow moment of a shared machine falls on all of them alike, and the
    least time is taken because another process on the core only ever adds
    time: with the median of three, a table tuned beside a busy process
    padded 1 row to 2 and ran the target slower than torch's default
    kernels. ``progress`` is called once per row count and repetition."""
    out_f, in_f = weights[0].shape
    runs = _kernels(weights, kernels or candidates(PACK_HINTS, allow_lossy=False))
    inputs = {r: torch.randn(r, in_f, dtype=weights[0].dtype) for r in rows}
    for run in runs.values():  # first touch: page in the packed copies
        run(inputs[rows[0]])
    samples = {k: [[] for _ in rows] for k in runs}
    names = list(runs)
    for rep in range(reps):
        for i, r in enumerate(rows):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                runs[name](inputs[r])
                samples[name][i].append(time.perf_counter() - t0)
            if progress is not None:
                progress()
    ms = {k: tuple(round(1e3 * float(np.min(s)) / len(weights), 5) for s in per_row) for k, per_row in
          samples.items()}
    return ShapeTiming(int(out_f), int(in_f), len(weights), tuple(rows), ms)


@torch.inference_mode()
def time_stack(layers: list[TunedLinear], rows: tuple[int, ...], configs: dict[str, dict[str, Dispatch]],
               reps: int = 3, progress: Callable[[], None] | None = None) -> StackTiming:
    """Least ms over ``reps`` of one pass over ``layers`` (in the order given:
    the model's) at each row count, once per configuration (a dispatch per
    shape; every configuration of a layer must keep its packed kernel, or
    none), interleaved as in :func:`tune`; each layer call is timed too, for
    ``by_shape``. ``progress`` is called once per row count and repetition."""
    keys = [f"{layer.out_features}x{layer.in_features}" for layer in layers]
    shapes = sorted(set(keys))
    saved = [layer.dispatch for layer in layers]
    inputs = {(r, n): torch.randn(r, n, dtype=layers[0].weight.dtype) for r in rows for n in
              {layer.in_features for layer in layers}}
    names = list(configs)
    totals = {n: [[] for _ in rows] for n in names}
    parts = {n: {s: [[] for _ in rows] for s in shapes} for n in names}

    def one_pass(name: str, r: int) -> dict[str, float]:
        """Seconds spent inside each shape's layers in one pass."""
        spent = dict.fromkeys(shapes, 0.0)
        for layer, key in zip(layers, keys):
            layer.dispatch = configs[name][key]
            x = inputs[r, layer.in_features]
            t0 = time.perf_counter()
            layer(x)
            spent[key] += time.perf_counter() - t0
        return spent

    try:
        for name in names:  # warm-up
            one_pass(name, rows[0])
        for rep in range(reps):
            for i, r in enumerate(rows):
                shift = (rep + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    spent = one_pass(name, r)
                    totals[name][i].append(sum(spent.values()))
                    for s in shapes:
                        parts[name][s][i].append(spent[s])
                if progress is not None:
                    progress()
    finally:
        for layer, d in zip(layers, saved):
            layer.dispatch = d

    def least(samples: list[list[float]]) -> tuple[float, ...]:
        return tuple(round(1e3 * min(s), 4) for s in samples)

    return StackTiming(tuple(rows), {n: least(totals[n]) for n in names},
                       {n: {s: least(parts[n][s]) for s in shapes} for n in names})


def check_on_stack(layers: list[TunedLinear], planned: dict[str, Dispatch], timings: dict[str, ShapeTiming],
                   rows: tuple[int, ...], reps: int = 3,
                   progress: Callable[[], None] | None = None) -> tuple[dict[str, Dispatch], StackTiming]:
    """The per-shape tables ``planned``, checked where they run: in the model.

    Pass one times the whole stack on the tables and on MKL alone, and each
    shape takes, row count by row count, whichever ran faster *inside the
    stack* (:func:`best_of` on that shape's share of the pass): the mix.
    Pass two times tables, mix and MKL alone on the whole stack, and every
    row count runs whichever of the three was fastest there (for the mix
    moves the other shapes' costs too). Configurations are compared at the
    same row count only; padding stays the per-shape tables'. Returns the
    dispatch and pass two."""
    mkl = {k: mkl_only(d, timings[k]) for k, d in planned.items()}
    first = time_stack(layers, rows, {"tables": planned, "mkl": mkl}, reps, progress)
    mix = {k: best_of({"tables": d, "mkl": mkl[k]}, {n: first.by_shape[n][k] for n in ("tables", "mkl")}, rows,
                      timings[k]) for k, d in planned.items()}
    second = time_stack(layers, rows, {"tables": planned, "mix": mix, "mkl": mkl}, reps, progress)
    chosen = {k: best_of({"tables": d, "mix": mix[k], "mkl": mkl[k]}, second.total, rows, timings[k])
              for k, d in planned.items()}
    return chosen, second


@dataclass
class KernelReport:
    """What :func:`tune_model` did: per shape (``"out x in"``), the timing and
    the dispatch; ``cached``: read from the cache file; ``layers``: layers tuned;
    ``stack``: the last pass of :func:`check_on_stack` (tables, mix, MKL alone)."""

    path: Path | None
    cached: bool
    layers: int
    timings: dict[str, ShapeTiming]
    dispatch: dict[str, Dispatch]
    stack: StackTiming

    def summary(self) -> str:
        lines = [f"linear kernels: {self.layers} layers, {len(self.dispatch)} shapes"
                 + (f" (cached {self.path})" if self.cached else f" (tuned, saved to {self.path})" if self.path else "")]
        for key, d in self.dispatch.items():
            t = self.timings[key]
            r = {n: i for i, n in enumerate(t.rows)}
            picks = ", ".join(f"{n} rows {d.ms[n - 1] / t.ms[DENSE][r[n]]:.2f}x" for n in (1, 2, 3, 4, 8, 16)
                              if n in r and n <= len(d.ms))
            lines.append(f"  {key}: {d.packed or 'MKL only'}; timed alone, vs MKL: {picks}")
        s = self.stack
        lines.append("  whole stack vs MKL alone, tables / mix: " + ", ".join(
            f"{n} rows {table / mkl:.2f}x / {mix / mkl:.2f}x"
            for n, table, mix, mkl in zip(s.rows, s.total["tables"], s.total["mix"], s.total["mkl"])
            if n in (1, 2, 3, 4, 8, 16)))
        return "\n".join(lines)


def _cache_dir() -> Path:
    return cache_dir("kernels")


def _cache_key(shapes: list[tuple[int, int]], dtype: torch.dtype, rows, kernels) -> str:
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    import platform

    ident = [_FORMAT, cpu or platform.processor(), platform.machine(), torch.__version__, torch.get_num_threads(),
             str(dtype), sorted(shapes), list(rows), list(kernels)]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def _load(path: Path) -> tuple[dict[str, ShapeTiming], dict[str, Dispatch], StackTiming] | None:
    try:
        data = json.loads(path.read_text())
        timings = {k: ShapeTiming(**{**v, "rows": tuple(v["rows"]), "ms": {n: tuple(m) for n, m in v["ms"].items()}})
                   for k, v in data["timings"].items()}
        dispatch = {k: Dispatch(v["packed"], tuple((c[0], int(c[1])) for c in v["choices"]), tuple(v["ms"]))
                    for k, v in data["dispatch"].items()}
        s = data["stack"]
        stack = StackTiming(tuple(s["rows"]), {n: tuple(v) for n, v in s["total"].items()},
                            {n: {k: tuple(v) for k, v in by.items()} for n, by in s["by_shape"].items()})
        return timings, dispatch, stack
    except (OSError, ValueError, KeyError, TypeError):
        return None


def install(model: torch.nn.Module, dispatch: dict[str, Dispatch]) -> int:
    """Replace every ``nn.Linear`` whose shape has a dispatch by a
    :class:`TunedLinear`; returns how many were replaced."""
    count = 0
    for parent, name, layer in _linears(model):
        key = f"{layer.out_features}x{layer.in_features}"
        if key in dispatch:
            setattr(parent, name, TunedLinear(layer, dispatch[key]))
            count += 1
    return count


def tune_model(model: torch.nn.Module, cache: bool = True, reps: int = 3, rows: tuple[int, ...] = ROW_GRID,
               hints: tuple[int, ...] = PACK_HINTS, allow_lossy: bool = False, show_progress: bool = True,
               log=print) -> KernelReport | None:
    """Time, choose and install row-count-aware kernels for ``model``'s
    linear layers (fp32 on the CPU). ``allow_lossy``: bfloat16 and int8
    kernels may be chosen too — only for layers whose exact numbers do not
    matter (a drafter's). Returns None, changing nothing, where oneDNN is
    missing or the model is elsewhere; a model tuned before is left as it is
    (its layers are no longer plain ``nn.Linear``)."""
    layers = _linears(model)
    if not layers or not kernels_available():
        return None
    weight = layers[0][2].weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    names = candidates(hints, allow_lossy)
    by_shape: dict[str, list[torch.Tensor]] = {}
    for _, _, layer in layers:
        by_shape.setdefault(f"{layer.out_features}x{layer.in_features}", []).append(layer.weight.detach())
    path = _cache_dir() / f"{_cache_key([tuple(w[0].shape) for w in by_shape.values()], weight.dtype, rows, names)}.json"
    loaded = _load(path) if cache else None
    if loaded is not None:
        timings, dispatch, stack = loaded
        report = KernelReport(path, True, install(model, dispatch), timings, dispatch, stack)
    else:
        from worker.reference.progress import ProgressBar

        checked = tuple(r for r in rows if r <= CHECK_MAX_ROWS) or rows[:1]
        bar = ProgressBar((len(by_shape) * len(rows) + 2 * len(checked)) * reps, "tune linear kernels",
                          enabled=show_progress)
        timings = {}
        for key, weights in by_shape.items():
            per = weights[0].numel() * weights[0].element_size()
            take = max(1, min(len(weights), -(-STREAM_BYTES // per)))
            timings[key] = tune(weights[:take], rows, names, reps, progress=lambda: bar.update(1))
        planned = {k: plan_dispatch(t) for k, t in timings.items()}
        layers_tuned = install(model, planned)
        tuned = [m for m in model.modules() if isinstance(m, TunedLinear)]  # the model's order
        dispatch, stack = check_on_stack(tuned, planned, timings, checked, reps, progress=lambda: bar.update(1))
        bar.close()
        for layer in tuned:
            layer.redispatch(dispatch[f"{layer.out_features}x{layer.in_features}"])
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"timings": {k: asdict(t) for k, t in timings.items()},
                                       "dispatch": {k: asdict(d) for k, d in dispatch.items()},
                                       "stack": asdict(stack)}, indent=1))
            tmp.replace(path)
        report = KernelReport(path if cache else None, False, layers_tuned, timings, dispatch, stack)
    if log is not None:
        log(report.summary())
    return report
