"""Packed verify: the decoder's linear layers see the real block entries only.

A step's draft trees differ per row, and the engine lays them out dense
(``batch.py``): ``[batch, 1 + max_b nodes_b]``, every row padded to the
widest. Run as is, one row's deep tree makes every row of the batch pay for
its width: at batch 8 with two rows drafting three tokens, the forward
computes 32 token rows where 14 are real. A serving engine (vLLM, SGLang,
TensorRT-LLM) batches ragged instead, ``Σ_b (1 + nodes_b)`` tokens, and
the controller prices a worker by what its forward computes
(``Hello.verify_layout``), so its per-request decisions are worth what the
engine makes of them.

The matrix products are where the tokens cost (each of SmolLM2's 30 layers
streams 3.5 M weights through seven of them; the LM head already runs on
real entries only). So :func:`packed_rows` gathers the real entries before
each of them and scatters the result back into the dense layout after:
forward hooks on every decoder layer's MLP (gate, up and down in one go)
and on the attention's q, k, v and o projections (q, k and v share one
gather of their common input). Everything between them — norms, rotary
embeddings, the attention scores over the cache and the tree mask — keeps
the dense layout, which is why the layout needs no change anywhere else.

Exactness: a matrix product treats rows independently, so a real entry's
output is the one the dense forward computes, up to the summation order a
kernel picks for a row count (the tuned kernels choose by row count,
``kernels.py``; the engine tests check greedy output token for token against
plain decoding). Padding entries get zeros from every packed layer: their
keys and values are zero, they attend to themselves only (``batch.py``),
their logits are never computed and compaction drops their cache slots.

Gathers and scatters are not free (~1-3 ms a step over the 30 layers here),
so a step packs only when padding is at least :data:`PACK_PADDING` of its
dense block; a batch whose rows all draft the same shape runs dense.

The hooks stay installed (idle, they cost nothing measurable) and read
their instructions from a thread-local: engines that share one model from
several threads (the benchmark's lockstep) never see each other's packing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

__all__ = ["PACK_PADDING", "install_packing", "packed_rows", "real_entries"]

PACK_PADDING = 0.2  # share of a dense block that must be padding before a step packs

_local = threading.local()


class _Packing:
    """What the hooks of one thread do during one forward."""

    __slots__ = ("index", "batch", "width", "last_input", "last_gathered")

    def __init__(self, index: torch.Tensor, batch: int, width: int) -> None:
        self.index = index  # long [real]: row · width + entry of every real entry
        self.batch = batch
        self.width = width
        self.last_input: torch.Tensor | None = None  # q, k and v share their input: one gather for three
        self.last_gathered: torch.Tensor | None = None


def real_entries(sizes: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The flat indices ``row · width + entry`` of a dense block's real entries,
    or ``None`` when the block is not worth packing.

    Parameters
    ----------
    sizes : sequence of int
        Real entries per row (``1 + nodes``); the block is ``len(sizes) × max(sizes)``.
    device
        Where the index lives (the model's device).

    Returns
    -------
    torch.Tensor or None
        long ``[Σ sizes]``; ``None`` when padding is under :data:`PACK_PADDING`
        of the block.

    Examples
    --------
    >>> real_entries([3, 1, 1, 2]).tolist()  # 7 real entries of 12
    [0, 1, 2, 3, 6, 9, 10]
    >>> real_entries([2, 2, 2]) is None  # nothing to save
    True
    """
    width = max(sizes)
    dense = len(sizes) * width
    if dense - sum(sizes) < PACK_PADDING * dense:
        return None
    index = [b * width + entry for b, n in enumerate(sizes) for entry in range(n)]
    return torch.tensor(index, dtype=torch.long, device=device)


@contextmanager
def packed_rows(index: torch.Tensor | None, batch: int, width: int) -> Iterator[None]:
    """Within the block, the hooked layers of this thread run on ``index``'s entries only.

    ``index`` ``None`` (from :func:`real_entries`): the forward runs dense.
    The model must have had :func:`install_packing`.
    """
    if index is None:
        yield
        return
    previous = getattr(_local, "packing", None)
    _local.packing = _Packing(index, batch, width)
    try:
        yield
    finally:
        _local.packing = previous


def _gather(module: torch.nn.Module, args: tuple) -> tuple | None:
    p: _Packing | None = getattr(_local, "packing", None)
    if p is None:
        return None
    if not args:  # called with keywords only: not a layout this module knows
        return None
    x = args[0]  # [batch, width, hidden]
    if x.dim() != 3 or x.shape[0] != p.batch or x.shape[1] != p.width:
        return None
    if x is p.last_input:
        return (p.last_gathered, *args[1:])
    gathered = x.reshape(p.batch * p.width, x.shape[-1]).index_select(0, p.index)  # [real, hidden]
    p.last_input, p.last_gathered = x, gathered
    return (gathered, *args[1:])


def _scatter(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    p: _Packing | None = getattr(_local, "packing", None)
    if p is None or out.dim() != 2 or out.shape[0] != p.index.shape[0]:
        return None
    dense = out.new_zeros(p.batch * p.width, out.shape[-1]).index_copy_(0, p.index, out)
    return dense.reshape(p.batch, p.width, out.shape[-1])  # [batch, width, out]


def _linear_like(module) -> bool:
    """A row-wise matrix product: ``nn.Linear`` or a drop-in (``kernels.TunedLinear``)."""
    return isinstance(module, torch.nn.Module) and hasattr(module, "in_features") and hasattr(module, "out_features")


def _packable(layer) -> list[torch.nn.Module]:
    """The modules of one decoder layer that may run on packed rows: a dense gated MLP
    (``gate_proj``, ``up_proj``, ``down_proj``; not a mixture of experts, whose routing
    reads the batch layout) and the attention's four projections; none if either is missing."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    gated = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if mlp is None or hasattr(mlp, "experts") or not all(_linear_like(m) for m in projections + gated):
        return []
    return [mlp, *projections]


def install_packing(base: torch.nn.Module) -> int:
    """Hook the packed layers of every decoder layer of ``base`` (the model's
    ``model.model``: Llama family, ``layers[i].mlp`` and
    ``layers[i].self_attn.{q,k,v,o}_proj``); returns how many modules carry
    the hooks (0: a model of another shape, left dense).

    Idempotent, and it looks again each time: a layer swapped in since
    (``kernels.install`` replaces linears by tuned ones) gets its hooks at
    the next call; every :class:`~worker.reference.engine.engine.Engine`
    makes one."""
    hooked = 0
    for layer in getattr(base, "layers", ()):
        for module in _packable(layer):
            if not getattr(module, "_specctl_packing_hooks", False):
                module.register_forward_pre_hook(_gather)
                module.register_forward_hook(_scatter)
                module._specctl_packing_hooks = True
            hooked += 1
    return hooked
