"""Roofline step-cost model: the simulator's ground truth for time.

One target forward (verification of a whole batch) costs::

    verify_ms = t0 + max(bytes / bandwidth, flops / (peak * efficiency))
    bytes     = weight_bytes + kv_tokens * kv_bytes_per_token
    flops     = 2 * params * batch_tokens + attn_flops_per_pair * attn_pairs

with ``batch_tokens = Σ_i (1 + nodes_i)`` (tokens the forward processes),
``kv_tokens = Σ_i context_len_i`` (KV entries it reads) and
``attn_pairs = Σ_i (1 + nodes_i) * context_len_i`` (query-key pairs; the
attention flops term, ``4 * n_layers * q_dim`` per pair, is small unless
contexts are long *and* trees are wide).

The defaults give the three regimes of docs/design.md §3 / seed 000 §05:

- small batch: weights dominate the bytes, so verifying ``k + 1`` tokens
  costs about one token (speculate deep);
- large batch, short context: the flops plane wins and cost grows linearly
  with batch tokens (speculation loses);
- long context (16k-128k) at large batch: KV reads dominate and the pass is
  memory-bound again (speculation pays again, MagicDec).

Drafting (see :class:`DraftCostProfile`): EAGLE runs ``depth`` sequential
forwards of a one-layer head; Medusa runs one pass of its heads.

Default numbers (docs/design.md §6): H100-SXM 3.35 TB/s, 989 TFLOP/s dense bf16,
80 GB; H200 4.8 TB/s, 989 TFLOP/s, 141 GB; Llama-3-8B 16 GB bf16 weights,
8e9 params, 128 KiB KV per token (2 x 32 layers x 8 KV heads x 128 x 2 B).
``efficiency = 0.35`` is the fraction of dense peak that decode-shaped GEMMs
plus attention, norms and sampling reach inside a serving engine; it puts the
ridge point near 100 batch tokens on an H100 (70 on an H200), so an EAGLE
chain breaks even around batch 128-256 at short context, where engines
switch speculation off (SGLang's per-batch candidate lists, TensorRT-LLM's
``draft_len_schedule``).

>>> cost = CostModel()
>>> round(cost.verify_ms(1, 1000), 2)
6.32
>>> cost.verify_ms(8, 1000) / cost.verify_ms(1, 1000) < 1.01
True
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

GB = 1e9
KIB = 1024


class HardwareProfile(BaseModel):
    """One accelerator type (``count`` of them serve one worker, tensor-parallel).

    Bandwidth, flops and memory scale with ``count``; each extra GPU adds
    ``tp_overhead_ms`` of collective latency to every forward.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bandwidth_gb_s: float = Field(gt=0, description="HBM bandwidth per GPU, GB/s")
    peak_tflops: float = Field(gt=0, description="dense bf16 peak per GPU, TFLOP/s")
    memory_gb: float = Field(gt=0, description="HBM per GPU, GB")
    efficiency: float = Field(0.35, gt=0, le=1, description="achieved fraction of peak flops")
    t0_ms: float = Field(1.5, ge=0, description="fixed cost per forward: launches, scheduling, sampling")
    tp_overhead_ms: float = Field(0.3, ge=0, description="extra fixed cost per forward per additional GPU")
    count: int = Field(1, ge=1, description="GPUs serving one worker (tensor parallel)")
    memory_utilization: float = Field(0.9, gt=0, le=1, description="share of HBM the engine may use")

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gb_s * GB * self.count / 1e3

    @property
    def flops_per_ms(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency * self.count / 1e3

    @property
    def fixed_ms(self) -> float:
        return self.t0_ms + self.tp_overhead_ms * (self.count - 1)


class ModelProfile(BaseModel):
    """Target model: what one forward reads and computes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    weight_bytes: float = Field(gt=0)
    params: float = Field(gt=0)
    kv_bytes_per_token: float = Field(gt=0)
    n_layers: int = Field(gt=0)
    q_dim: int = Field(gt=0, description="query heads x head dim (attention flops)")

    @property
    def attn_flops_per_pair(self) -> float:
        """Flops per (query token, context token) pair: QK^T and PV, all layers."""
        return 4.0 * self.n_layers * self.q_dim


class DraftCostProfile(BaseModel):
    """Cost of drafting for one drafter kind.

    EAGLE: ``depth`` sequential forwards of the draft head (one decoder layer,
    an fc fusing features, and a 32k draft-vocabulary LM head as in EAGLE-3:
    ~0.38e9 params); forward 1 processes one token per request, later ones the
    ``width`` best frontier nodes; each also reads the head's own one-layer KV
    (``kv_fraction`` of the target's KV bytes per context token).
    Medusa: one pass of ``depth`` heads (ResBlock + projection, ~0.15e9 params
    each) over one token per request.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["eagle", "medusa"]
    params: float = Field(gt=0, description="EAGLE: head params per forward; Medusa: params per head")
    step_overhead_ms: float = Field(ge=0, description="fixed cost per draft forward (EAGLE) or per pass (Medusa)")
    kv_fraction: float = Field(0.0, ge=0, le=1, description="share of target KV bytes read per draft forward")


HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "H100-SXM": HardwareProfile(name="H100-SXM", bandwidth_gb_s=3350, peak_tflops=989, memory_gb=80),
    "H200": HardwareProfile(name="H200", bandwidth_gb_s=4800, peak_tflops=989, memory_gb=141),
}

MODEL_PROFILES: dict[str, ModelProfile] = {
    "llama-3-8b": ModelProfile(
        name="llama-3-8b", weight_bytes=16 * GB, params=8e9, kv_bytes_per_token=128 * KIB, n_layers=32, q_dim=4096
    ),
    # Multi-head attention: four times the KV of Llama-3-8B per token.
    "llama-2-7b": ModelProfile(
        name="llama-2-7b", weight_bytes=13.5 * GB, params=6.7e9, kv_bytes_per_token=512 * KIB, n_layers=32, q_dim=4096
    ),
}

DRAFT_COST_PROFILES: dict[str, DraftCostProfile] = {
    "eagle": DraftCostProfile(kind="eagle", params=0.38e9, step_overhead_ms=0.10, kv_fraction=1 / 32),
    "medusa": DraftCostProfile(kind="medusa", params=0.15e9, step_overhead_ms=0.15, kv_fraction=0.0),
}


def resolve(name_or_profile, registry: dict, what: str):
    """A profile from the registry by name, or the profile itself."""
    if isinstance(name_or_profile, str):
        try:
            return registry[name_or_profile]
        except KeyError:
            raise ValueError(f"unknown {what} profile {name_or_profile!r} (known: {', '.join(sorted(registry))})") from None
    return name_or_profile


class CostModel:
    """Ground-truth step costs of one worker (noise-free; see :meth:`noisy`).

    Parameters
    ----------
    hardware, model, drafter
        Profiles or registry names.
    noise_sigma
        Log-normal sigma applied by :meth:`noisy` (default 3%).
    """

    # The price is max(memory plane, compute plane): callers may use that
    # structure (the benchmark oracle's exact pruning). A truth that is not a
    # roofline (worker.sim.measured) says False.
    roofline: ClassVar[bool] = True

    def __init__(
        self,
        hardware: HardwareProfile | str = "H100-SXM",
        model: ModelProfile | str = "llama-3-8b",
        drafter: DraftCostProfile | str = "eagle",
        noise_sigma: float = 0.03,
    ) -> None:
        self.hardware: HardwareProfile = resolve(hardware, HARDWARE_PROFILES, "hardware")
        self.model: ModelProfile = resolve(model, MODEL_PROFILES, "model")
        self.drafter: DraftCostProfile = resolve(drafter, DRAFT_COST_PROFILES, "drafter cost")
        self.noise_sigma = float(noise_sigma)

    # -- target ---------------------------------------------------------------
    def memory_ms(self, kv_tokens):
        """Time to stream weights plus ``kv_tokens`` of KV cache (scalar or array)."""
        return (self.model.weight_bytes + kv_tokens * self.model.kv_bytes_per_token) / self.hardware.bytes_per_ms

    def compute_ms(self, batch_tokens, attn_pairs=0.0):
        """Time for the forward's flops at the achieved rate (scalar or array)."""
        flops = 2.0 * self.model.params * batch_tokens + self.model.attn_flops_per_pair * attn_pairs
        return flops / self.hardware.flops_per_ms

    @property
    def token_ms(self) -> float:
        """Verify compute per batch token, attention excluded: the slope past the roofline's kink."""
        return 2.0 * self.model.params / self.hardware.flops_per_ms

    def verify_ms(self, batch_tokens, kv_tokens, attn_pairs=0.0, batch=None):
        """One target forward over ``batch_tokens`` tokens reading ``kv_tokens`` KV entries.

        Scalars give a float; arrays (broadcast together) give an array, so
        callers can price many candidate batches at once.

        Parameters
        ----------
        batch_tokens
            ``Σ_i (1 + nodes_i)`` over the batch.
        kv_tokens
            ``Σ_i context_len_i`` over the batch.
        attn_pairs
            ``Σ_i (1 + nodes_i) * context_len_i``; 0 leaves the attention flops out.
        batch
            Requests in the forward. The roofline does not need it (its
            price depends on the sums only); a measured truth
            (:class:`worker.sim.measured.MeasuredCostModel`) does, so callers
            that may hold either pass it.
        """
        fixed = self.hardware.fixed_ms
        if np.ndim(batch_tokens) or np.ndim(kv_tokens) or np.ndim(attn_pairs):
            ms = fixed + np.maximum(self.memory_ms(kv_tokens), self.compute_ms(batch_tokens, attn_pairs))
            return np.where(np.asarray(batch_tokens) > 0, ms, 0.0)
        if batch_tokens <= 0:
            return 0.0
        return fixed + max(self.memory_ms(kv_tokens), self.compute_ms(batch_tokens, attn_pairs))

    def regime(self, batch_tokens: float, kv_tokens: float, attn_pairs: float = 0.0) -> str:
        """``"memory"`` or ``"compute"``: which roofline plane bounds the forward."""
        return "memory" if self.memory_ms(kv_tokens) >= self.compute_ms(batch_tokens, attn_pairs) else "compute"

    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit next to the weights in usable HBM."""
        hw = self.hardware
        free = hw.memory_gb * GB * hw.count * hw.memory_utilization - self.model.weight_bytes
        return max(int(free // self.model.kv_bytes_per_token), 0)

    # -- drafter --------------------------------------------------------------
    def draft_ms(self, depths: Sequence[int], widths: Sequence[int], context_lens: Sequence[int]) -> float:
        """Drafting cost of one step for the whole batch (0 when nobody drafts).

        Parameters
        ----------
        depths, widths, context_lens
            Per request: the (clamped) depth and width drafted, and its context length.
        """
        d = np.asarray(depths, dtype=np.int64)
        top = int(d.max(initial=0)) if d.size else 0
        if top <= 0:
            return 0.0

        def per_level(weights=None) -> np.ndarray:
            # Σ over requests drafting level l (depth >= l), for l = 1..top.
            return np.bincount(d, weights, top + 1)[::-1].cumsum()[::-1][1:]

        count = per_level().astype(np.float64)
        width_sum = per_level(np.asarray(widths, dtype=np.float64))
        kv = per_level(np.asarray(context_lens, dtype=np.float64))
        return float(self.draft_levels_ms(count, width_sum, kv))

    def draft_levels_ms(self, count, width_sum, kv):
        """Drafting cost from per-level aggregates; arrays ``[..., level]`` give ``[...]``.

        ``count[..., l]``: requests drafting level ``l + 1``; ``width_sum``:
        the sum of their tree widths; ``kv``: the sum of their context
        lengths. EAGLE runs one head forward per level over one token per
        request at level 1 and its ``width`` best frontier nodes below,
        reading its own one-layer KV; Medusa runs one pass in which the
        deepest request sets how many heads are read and every request runs
        its own heads on one token.
        """
        count = np.asarray(count, dtype=np.float64)
        hw, p, drafter = self.hardware, self.drafter.params, self.drafter
        active = count > 0
        if drafter.kind == "medusa":
            levels = active.sum(axis=-1)
            mem = 2.0 * p * levels / hw.bytes_per_ms
            comp = 2.0 * p * count.sum(axis=-1) / hw.flops_per_ms
            return np.where(levels > 0, drafter.step_overhead_ms + np.maximum(mem, comp), 0.0)
        tokens = np.array(width_sum, dtype=np.float64)
        tokens[..., 0] = count[..., 0]  # level 1 drafts one token per request
        kv_bytes = np.asarray(kv, dtype=np.float64) * (self.model.kv_bytes_per_token * drafter.kv_fraction)
        mem = (2.0 * p + kv_bytes) / hw.bytes_per_ms
        comp = 2.0 * p * tokens / hw.flops_per_ms
        per_level = np.where(active, drafter.step_overhead_ms + np.maximum(mem, comp), 0.0)
        return per_level.sum(axis=-1)

    # -- noise ----------------------------------------------------------------
    def noisy(self, ms: float, rng: np.random.Generator) -> float:
        """``ms`` times a log-normal factor (median 1, sigma ``noise_sigma``)."""
        if ms <= 0 or self.noise_sigma <= 0:
            return ms
        return ms * math.exp(self.noise_sigma * rng.standard_normal())
