"""Measured step costs: one GPU's own verify and draft timings as the simulator's truth.

The roofline of :mod:`worker.sim.hardware` is a two-plane sketch; a real
forward has a fixed cost above its ``t0``, a step from GEMV to GEMM kernels,
tile staircases and large GEMMs faster than its ``efficiency`` says (one
extra token per request at batch 256 costs 1.39x on an H200, not the
roofline's 1.89x). :class:`MeasuredCostModel` prices forwards from a table
measured on the GPU instead (``worker/sim/hardware_tables/``; see the README
there for how it was measured).

Interpolation rule
------------------
A verify of ``B`` requests over ``batch_tokens = T`` new tokens reading
``kv_tokens = K`` cached entries is priced as ``B`` equal requests of
``q = T / B`` tokens and ``c = K / B`` context each (attention pairs are not
used: the table prices attention through the mean request's ``q`` and
``c``). Inside the measured box the price is linear in
``(log B, log q, c)`` between the eight surrounding grid points, so every
measured point comes back exactly. Context is linear because the cost is:
each cached token is read once, so at fixed ``B`` and ``q`` a forward costs
an intercept plus a slope per KV token (the table agrees: the slope from
1k to 8k and from 8k to 32k differ by at most 4 % at 8 of the 9 batch and
tokens pairs measured at both). Log-linear in context would put 4k context two
thirds of the way from 1k to 8k instead of three sevenths, 5-10 % above
the chord at every batch, a cost no GPU has. Outside it, the point is clamped to the
box and the excess is priced linearly, each axis with the slope of the
nearest measured segment (the one at the box's edge, interpolated at the
clamped point like the values), never negative:

- batch above the largest measured: ``ms per request`` of the last batch
  segment, times the extra requests;
- tokens per request above the largest: ``ms per batch token`` of the last
  tokens segment, times ``B · (q − q_edge)``;
- context above the largest or below the smallest: ``ms per KV token`` of
  the last (first) context segment, times ``B · (c − c_edge)``. The
  measured slope, not the device's copy rate: at wide trees it holds the
  attention compute too (at 16 tokens per request it is ~1.7x the slope at
  one token per request, which is KV reads alone at ~4.5 TB/s).

Batch and tokens below the grid (fewer than one request or token) clamp to
the edge. The measured grid leaves out shapes whose KV would not fit
(``batch · context > 512k``); those corners are filled first, from the
largest measured context of the same batch and tokens, along the KV slope
of the same context segment at the nearest batch that measured it (the
per-KV-token slope barely depends on the batch: 2.9e-5 ms at one token per
request from batch 4 to 64).

Drafting (EAGLE: one head forward per level) is priced per level the same
way on the table's ``(batch, width, context)`` grid: level 1 drafts one
token per request, deeper levels ``width`` tokens per request (the mean over
the requests drafting that level), ``context`` their mean context. The table
has no Medusa pass, so a Medusa drafter keeps the roofline's drafting cost.

Registry: :data:`MEASURED_HARDWARE` maps a hardware name scenarios may use
(``hardware: H200-measured``) to its table, the roofline profile of the same
GPU (HBM size for the KV capacity, the hints a worker's Hello carries) and
the one model whose shapes were measured.

Any other table file of the same schema (``specctl calibrate`` writes them,
for whatever device and model it ran on) prices a scenario worker that names
it (``cost_table: FILE``): :func:`table_hardware` wraps it with the worker's
roofline profile, and the worker's model must have the table's shapes
(:meth:`StepCostTable.model_profile` is the model the table describes).

>>> cost = MeasuredCostModel("H200-measured")
>>> kv = 256 * 1024                              # batch 256 at 1k context
>>> round(cost.verify_ms(512, kv, batch=256) / cost.verify_ms(256, kv, batch=256), 2)
1.39
>>> roof = CostModel("H200")
>>> round(roof.verify_ms(512, kv) / roof.verify_ms(256, kv), 2)
1.89
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from worker.sim.hardware import (
    HARDWARE_PROFILES,
    MODEL_PROFILES,
    CostModel,
    DraftCostProfile,
    HardwareProfile,
    ModelProfile,
    resolve,
)

TABLE_DIR = Path(__file__).resolve().parent / "hardware_tables"


# -- a grid of step costs -------------------------------------------------------
class CostGrid:
    """Milliseconds of one forward on a (requests × tokens per request × context) grid.

    Parameters
    ----------
    batch, tokens, context
        Increasing grid coordinates (at least two each): requests in the
        forward, new tokens per request, cached tokens per request.
    ms
        ``[batch, tokens, context]`` costs, NaN where not measured; only
        contexts above a batch/tokens pair's largest measured one may be
        missing (they are filled, see the module docstring).
    what
        Name used in error messages.

    >>> grid = CostGrid([1, 2], [1, 2], [10, 20], [[[1.0, 2.0], [2.0, 3.0]], [[2.0, 3.0], [3.0, 4.0]]])
    >>> float(grid(2, 2, 20)), float(grid(1, 1, 30))   # a grid point; the KV slope past the edge
    (4.0, 3.0)
    """

    def __init__(self, batch, tokens, context, ms, what: str = "table") -> None:
        self.batch, self.tokens, self.context = (np.asarray(a, dtype=np.float64) for a in (batch, tokens, context))
        for name, axis in (("batch", self.batch), ("tokens", self.tokens), ("context", self.context)):
            if axis.size < 2 or np.any(np.diff(axis) <= 0) or axis[0] <= 0:
                raise ValueError(f"{what}: the {name} axis needs two or more increasing positive values, got {axis}")
        raw = np.asarray(ms, dtype=np.float64)
        if raw.shape != (self.batch.size, self.tokens.size, self.context.size):
            raise ValueError(f"{what}: costs of shape {raw.shape} do not match the axes")
        self.measured = np.isfinite(raw)
        self.ms = _fill_contexts(raw, self.measured, self.batch, self.context, what)
        # Interpolation coordinates: log requests, log tokens per request, context (linear: see above).
        self._coords = (np.log(self.batch), np.log(self.tokens), self.context)
        b, q, c, ms = self.batch[:, None], self.tokens, self.context, self.ms
        # Slopes of the edge segments, per unit of what grows past the edge (never negative):
        # ms per request, per batch token, per KV token.
        self.slope_batch = np.maximum((ms[-1] - ms[-2]) / (self.batch[-1] - self.batch[-2]), 0.0)  # [q, c]
        self.slope_tokens = np.maximum((ms[:, -1] - ms[:, -2]) / (b * (q[-1] - q[-2])), 0.0)  # [b, c]
        self.slope_kv_high = np.maximum((ms[..., -1] - ms[..., -2]) / (b * (c[-1] - c[-2])), 0.0)  # [b, q]
        self.slope_kv_low = np.maximum((ms[..., 1] - ms[..., 0]) / (b * (c[1] - c[0])), 0.0)  # [b, q]

    def __call__(self, batch, tokens, context) -> np.ndarray:
        """Cost of ``batch`` requests of ``tokens`` new and ``context`` cached tokens each (broadcast arrays)."""
        b, q, c = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (batch, tokens, context)))
        lo = (self.batch[0], self.tokens[0], self.context[0])
        hi = (self.batch[-1], self.tokens[-1], self.context[-1])
        bc, qc, cc = (np.clip(x, l, h) for x, l, h in zip((b, q, c), lo, hi))
        ib, iq, ic = (_locate(g, x) for g, x in zip(self._coords, (np.log(bc), np.log(qc), cc)))
        ms = _blend(self.ms, ib, iq, ic)
        # Past the box, each axis's excess at its edge slope (only where there is any:
        # the oracle prices thousands of shapes a step, most inside the box).
        if np.any(b > bc):
            ms = ms + _blend(self.slope_batch, iq, ic) * (b - bc)
        if np.any(q > qc):
            ms = ms + _blend(self.slope_tokens, ib, ic) * b * np.maximum(q - qc, 0.0)
        if np.any(c > cc):
            ms = ms + _blend(self.slope_kv_high, ib, iq) * b * np.maximum(c - cc, 0.0)
        if np.any(c < cc):
            ms = ms + _blend(self.slope_kv_low, ib, iq) * b * np.minimum(c - cc, 0.0)
        return ms


def _locate(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cell index and position in it (0..1) of clamped coordinates: exact 0 / 1 on grid points."""
    i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, grid.size - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def _blend(values: np.ndarray, *axes: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Multilinear interpolation of ``values`` at (index, position) per axis."""
    flat = np.ascontiguousarray(values).ravel()
    steps = np.cumprod((values.shape[1:] + (1,))[::-1])[::-1]  # C-order strides in elements
    base = sum(i * st for (i, _), st in zip(axes, steps))
    out = 0.0
    for corner in itertools.product((0, 1), repeat=len(axes)):
        weight = 1.0
        for (_, t), o in zip(axes, corner):
            weight = weight * (t if o else 1.0 - t)
        out = out + weight * np.take(flat, base + int(np.dot(corner, steps)))
    return out


def _fill_contexts(raw: np.ndarray, measured: np.ndarray, batch: np.ndarray, context: np.ndarray,
                   what: str) -> np.ndarray:
    """Fill the unmeasured long-context corners (see the module docstring)."""
    ms = raw.copy()
    nb, nq, nc = raw.shape
    log_b = np.log(batch)
    for i, j in itertools.product(range(nb), range(nq)):
        have = measured[i, j]
        top = int(np.flatnonzero(have).max(initial=-1))
        if top < 0 or not have[: top + 1].all():
            raise ValueError(f"{what}: batch {batch[i]:g}, tokens index {j}: only contexts above the largest "
                             "measured one may be missing")
        for k in range(top + 1, nc):
            donors = np.flatnonzero(measured[:, j, k - 1] & measured[:, j, k])
            if donors.size == 0:
                raise ValueError(f"{what}: no batch measured contexts {context[k - 1]:g} and {context[k]:g}")
            # Nearest batch in log scale; ties to the larger one.
            d = donors[np.lexsort((-batch[donors], np.abs(log_b[donors] - log_b[i])))[0]]
            slope = max((raw[d, j, k] - raw[d, j, k - 1]) / (batch[d] * (context[k] - context[k - 1])), 0.0)
            ms[i, j, k] = ms[i, j, k - 1] + slope * batch[i] * (context[k] - context[k - 1])
    return ms


# -- the measured table --------------------------------------------------------
@dataclass(frozen=True)
class StepCostTable:
    """A measured table (``hardware_tables/*.json``): verify and draft-level grids.

    ``verify``: ms of one target forward by (requests, tokens per request,
    context); ``draft``: ms of one EAGLE head level by (requests, width,
    context); ``info``: the device's ceilings and the method; ``shapes``: the
    model shapes measured.
    """

    source: str
    verify: CostGrid
    draft: CostGrid
    info: dict[str, Any]
    shapes: dict[str, Any]

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token: the table's own figure, else from its dtype (bf16 unless said)."""
        s = self.shapes
        if "kv_bytes_per_token" in s:
            return float(s["kv_bytes_per_token"])
        return 2.0 * s["layers"] * s["kv_heads"] * s["head_dim"] * _dtype_bytes(s.get("dtype"))

    def model_profile(self) -> ModelProfile:
        """The model the table was measured on, as a simulator profile (its ``model`` section must give
        ``params`` and ``weight_bytes``, as ``specctl calibrate`` writes them)."""
        s = self.shapes
        missing = [k for k in ("params", "weight_bytes", "layers", "heads", "head_dim") if k not in s]
        if missing:
            raise ValueError(f"table {self.source}: its model section lacks {', '.join(missing)}; "
                             "name the model (model: NAME or an inline profile)")
        return ModelProfile(name=str(s.get("name") or Path(self.source).stem), weight_bytes=float(s["weight_bytes"]),
                            params=float(s["params"]), kv_bytes_per_token=self.kv_bytes_per_token,
                            n_layers=int(s["layers"]), q_dim=int(s["heads"]) * int(s["head_dim"]))

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "<dict>") -> "StepCostTable":
        verify = _grid(data["verify"], ("batch", "tokens_per_request", "context"), "verify_ms", f"{source}: verify")
        draft = _grid(data["draft"], ("batch", "width", "context"), "draft_level_ms", f"{source}: draft")
        return cls(source, verify, draft, dict(data.get("info", {})), dict(data["model"]))

    def matches(self, model: ModelProfile) -> bool:
        """Whether ``model`` has the shapes this table was measured with."""
        s = self.shapes
        return (model.n_layers == s["layers"] and model.q_dim == s["heads"] * s["head_dim"]
                and model.kv_bytes_per_token == self.kv_bytes_per_token)


def _dtype_bytes(dtype: str | None) -> int:
    """Bytes per element of a dtype named as torch prints it (``torch.float32``); 2 when unnamed."""
    name = str(dtype or "bfloat16").removeprefix("torch.")
    return {"float32": 4, "float": 4, "float64": 8, "double": 8, "float16": 2, "half": 2, "bfloat16": 2,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}.get(name, 2)


def _grid(rows: list[dict], keys: tuple[str, str, str], value: str, what: str) -> CostGrid:
    axes = [sorted({float(r[k]) for r in rows}) for k in keys]
    ms = np.full([len(a) for a in axes], np.nan)
    for r in rows:
        ms[tuple(a.index(float(r[k])) for a, k in zip(axes, keys))] = float(r[value])
    return CostGrid(*axes, ms, what=what)


def table_path(name: str | Path) -> Path:
    """A table file: ``name`` as a path when it exists, else the file of that name in ``hardware_tables/``."""
    path = Path(name).expanduser()
    if not path.is_absolute() and not path.exists():
        path = TABLE_DIR / name
    return path.resolve()


def load_table(name: str | Path) -> StepCostTable:
    """A table by file name in ``hardware_tables/`` (or a path), parsed once per process and file version.

    ``ValueError`` naming the file when it cannot be read or does not have
    the schema (``verify`` and ``draft`` rows, a ``model`` section).
    """
    path = table_path(name)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError as exc:
        raise ValueError(f"cannot read table {path}: {exc.strerror}") from None
    return _load_table(path, stamp)


@lru_cache(maxsize=None)
def _load_table(path: Path, stamp: int) -> StepCostTable:
    try:
        data = json.loads(path.read_text())
        return StepCostTable.from_json(data, path.name)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read table {path}: {exc}") from None
    except (KeyError, TypeError) as exc:
        raise ValueError(f"table {path} does not have the step-cost schema (info, model, verify rows of batch, "
                         f"tokens_per_request, context, verify_ms; draft rows of batch, width, context, "
                         f"draft_level_ms): missing {exc}") from None


# -- registry -------------------------------------------------------------------
@dataclass(frozen=True)
class MeasuredHardware:
    """A hardware name priced from a measured table.

    ``profile``: the roofline profile of the same GPU (its HBM sets the KV
    capacity; a worker's Hello reports its hints), by name or inline;
    ``model``: the model whose shapes were measured, the only one the table
    can price (None: any model with the table's shapes).
    """

    name: str
    profile: str | HardwareProfile
    model: str | None
    table: str


MEASURED_HARDWARE: dict[str, MeasuredHardware] = {
    "H200-measured": MeasuredHardware("H200-measured", "H200", "llama-3-8b", "h200-llama3-8b.json"),
}


def table_hardware(table: str | Path, profile: str | HardwareProfile = "H100-SXM") -> MeasuredHardware:
    """A table file (``cost_table:`` of a scenario worker) as measured hardware: priced from the
    table, with ``profile``'s HBM and hints; any model with the table's shapes."""
    path = table_path(table)
    load_table(path)  # refuse a bad file here, naming it
    return MeasuredHardware(f"table:{path.name}", profile, None, str(path))


def hardware_names() -> list[str]:
    """Every hardware name a scenario may use: roofline profiles and measured tables."""
    return sorted({*HARDWARE_PROFILES, *MEASURED_HARDWARE})


def check_model(hardware: str | MeasuredHardware, model: str | ModelProfile) -> None:
    """Refuse a model the measured ``hardware`` cannot price (a ``ValueError`` naming both)."""
    entry = hardware if isinstance(hardware, MeasuredHardware) else MEASURED_HARDWARE[hardware]
    name = model if isinstance(model, str) else model.name
    if entry.model is None:  # a table file: any model of its shapes
        profile = resolve(model, MODEL_PROFILES, "model")
        table = load_table(entry.table)
        if not table.matches(profile):
            s = table.shapes
            raise ValueError(f"model {name!r} does not have the shapes table {Path(entry.table).name} was measured "
                             f"with ({s.get('name', '?')}: {s.get('layers')} layers, {s.get('heads')} heads of "
                             f"{s.get('head_dim')}, {table.kv_bytes_per_token:.0f} KV bytes per token); leave "
                             "model out to use the table's own")
        return
    if not (model == entry.model if isinstance(model, str) else model == MODEL_PROFILES[entry.model]):
        raise ValueError(f"model {name!r} cannot run on hardware {entry.name!r}: its table was measured with "
                         f"{entry.model} shapes (use model: {entry.model}, or a roofline hardware profile)")


# -- the cost model ----------------------------------------------------------------
class MeasuredCostModel(CostModel):
    """Step costs from a measured table (noise-free; :meth:`noisy` as the roofline's).

    A drop-in for :class:`worker.sim.hardware.CostModel` on the simulator's
    and the oracle's paths — ``verify_ms``, ``draft_ms``,
    ``draft_levels_ms``, ``kv_capacity_tokens``, ``noisy`` — except that
    :meth:`verify_ms` needs the number of requests (``batch=``). The
    roofline's planes (``memory_ms``, ``compute_ms``, ``token_ms``,
    ``regime``) do not exist for a table and raise.

    Parameters
    ----------
    hardware
        A :data:`MEASURED_HARDWARE` name or entry (:func:`table_hardware` for a table file).
    model
        Must be the model the table was measured with (for a table file:
        one with its shapes).
    drafter
        Drafter cost profile or name; EAGLE is priced from the table, Medusa
        by the roofline (the table has no Medusa pass).
    noise_sigma
        Log-normal sigma applied by :meth:`noisy`.

    Examples
    --------
    Vectorised prices equal scalar ones (the oracle prices many candidate
    batches at once):

    >>> cost = MeasuredCostModel()
    >>> rng = np.random.default_rng(7)
    >>> b = rng.integers(1, 300, 50); t = b * rng.uniform(1, 40, 50); k = b * rng.uniform(100, 60000, 50)
    >>> many = cost.verify_ms(t, k, 0.0, batch=b)
    >>> bool(np.allclose(many, [cost.verify_ms(x, y, batch=z) for x, y, z in zip(t, k, b)], rtol=1e-12))
    True
    >>> round(cost.draft_ms([3, 3, 1], [4, 2, 1], [1000, 2000, 500]), 3)   # three levels of the EAGLE head
    0.93
    """

    roofline: ClassVar[bool] = False

    def __init__(
        self,
        hardware: str | MeasuredHardware = "H200-measured",
        model: ModelProfile | str = "llama-3-8b",
        drafter: DraftCostProfile | str = "eagle",
        noise_sigma: float = 0.03,
    ) -> None:
        entry = hardware if isinstance(hardware, MeasuredHardware) else resolve(hardware, MEASURED_HARDWARE,
                                                                              "measured hardware")
        check_model(entry, model)
        profile = resolve(entry.profile, HARDWARE_PROFILES, "hardware")
        super().__init__(profile, model, drafter, noise_sigma)
        self.measured = entry
        self.table = load_table(entry.table)
        if not self.table.matches(self.model):
            raise ValueError(f"table {entry.table} does not hold {self.model.name}'s shapes")

    # -- target -----------------------------------------------------------------
    def verify_ms(self, batch_tokens, kv_tokens, attn_pairs=0.0, batch=None):
        """One target forward of ``batch`` requests over ``batch_tokens`` new tokens reading ``kv_tokens``.

        Scalars give a float, arrays (broadcast together, ``attn_pairs``
        included) an array; 0 where ``batch_tokens <= 0``. ``attn_pairs`` is
        accepted for the roofline's signature and not used.
        """
        if batch is None:
            raise TypeError("MeasuredCostModel.verify_ms needs batch= (requests in the forward): "
                            "the table prices B requests of T/B tokens and K/B context each")
        vector = np.ndim(batch_tokens) or np.ndim(kv_tokens) or np.ndim(attn_pairs) or np.ndim(batch)
        t, k, b, _ = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64)
                                           for x in (batch_tokens, kv_tokens, batch, attn_pairs)))
        b = np.maximum(b, 1.0)
        ms = np.where(t > 0, self.table.verify(b, t / b, k / b), 0.0)
        return ms if vector else float(ms)

    def memory_ms(self, kv_tokens):
        raise NotImplementedError(self._no_planes("memory_ms"))

    def compute_ms(self, batch_tokens, attn_pairs=0.0):
        raise NotImplementedError(self._no_planes("compute_ms"))

    @property
    def token_ms(self) -> float:
        raise NotImplementedError(self._no_planes("token_ms"))

    def regime(self, batch_tokens: float, kv_tokens: float, attn_pairs: float = 0.0) -> str:
        raise NotImplementedError(self._no_planes("regime"))

    def _no_planes(self, what: str) -> str:
        return (f"{what} is a roofline plane; {self.measured.name} prices whole forwards from the measured "
                f"table {self.measured.table} (use verify_ms(..., batch=))")

    # -- drafter ----------------------------------------------------------------
    def draft_levels_ms(self, count, width_sum, kv):
        """Drafting cost from per-level aggregates (see :meth:`CostModel.draft_levels_ms`), EAGLE from the table."""
        if self.drafter.kind != "eagle":
            return super().draft_levels_ms(count, width_sum, kv)
        count, width_sum, kv = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (count, width_sum, kv)))
        active = count > 0
        n = np.where(active, count, 1.0)
        width = np.where(active, width_sum / n, 1.0)
        width[..., 0] = 1.0  # level 1 drafts one token per request
        per_level = self.table.draft(n, width, kv / n)
        return np.where(active, per_level, 0.0).sum(axis=-1)


def build_cost_model(
    hardware: str | HardwareProfile,
    model: str | ModelProfile,
    drafter: str | DraftCostProfile,
    noise_sigma: float = 0.03,
    gpus: int | None = None,
    table: str | Path | None = None,
) -> CostModel:
    """The cost truth a worker runs on: a :class:`MeasuredCostModel` for a measured
    hardware name or a ``table`` file (``hardware`` then gives the HBM and the hints), else
    the roofline (``gpus`` overrides its GPU count)."""
    if table is not None:
        if gpus not in (None, 1):
            raise ValueError(f"gpus: {gpus} — cost table {Path(table).name} prices one device")
        return MeasuredCostModel(table_hardware(table, hardware), model, drafter, noise_sigma)
    if isinstance(hardware, str) and hardware in MEASURED_HARDWARE:
        if gpus not in (None, 1):
            raise ValueError(f"gpus: {gpus} — hardware {hardware!r} was measured on one GPU")
        return MeasuredCostModel(hardware, model, drafter, noise_sigma)
    profile: HardwareProfile = resolve(hardware, HARDWARE_PROFILES, "hardware")
    if gpus:
        profile = profile.model_copy(update={"count": gpus})
    return CostModel(profile, model, drafter, noise_sigma)
