"""The engine's KV cache: preallocated slots, a per-row valid mask, rows that
join and leave between steps.

``SlotCache`` is a transformers ``Cache`` whose layers write into
preallocated ``[batch, kv_heads, capacity, head_dim]`` buffers and hand the
model views of the used prefix, so a step does not re-copy the whole cache
the way ``DynamicLayer``'s ``torch.cat`` does (capacity doubles when full).

``BatchKV`` pairs it with ``valid`` (bool ``[batch, S]``, True where a slot
holds a real token; the convention of ``verify.py``) and the operations an
engine with a changing batch needs:

- ``merge(other)``      rows that were prefilled apart join the batch (the
  shorter side is left-padded with invalid slots);
- ``select(rows)``      rows leave;
- ``compact(past, paths)`` after a verify step keep each row's accepted path
  (rows that accepted less get holes at the tail, as in ``compact_cache``);
- ``repack()``          right-align every row's valid slots and drop the
  columns no row uses, so holes and left padding stop costing attention.

A slot's key was rotated (RoPE) at the token's true position when it was
written, and the next position of a row is its count of valid slots, so
moving slots around never changes what the model computes.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["BatchKV", "SlotCache", "SlotLayer"]


class SlotLayer(DynamicLayer):
    """A full-attention cache layer over a preallocated buffer."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # [batch, heads, capacity, dim]
        self._v: torch.Tensor | None = None
        self.length = 0
        super().__init__()

    # transformers code reads and (in generic paths) assigns .keys/.values
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k = value if value is not None and value.dim() == 4 else None
        self.length = 0 if self._k is None else self._k.shape[2]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = value if value is not None and value.dim() == 4 else None

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def set(self, keys: torch.Tensor, values: torch.Tensor, spare: int = 64) -> None:
        """Replace the contents with ``keys``/``values`` ``[batch, heads, S, dim]`` (copied)."""
        b, h, s, d = keys.shape
        self._k = keys.new_empty(b, h, s + spare, d)
        self._v = values.new_empty(b, h, s + spare, d)
        self._k[:, :, :s] = keys
        self._v[:, :, :s] = values
        self.length = s
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if self._k is None or self._k.shape[0] != key_states.shape[0]:
            self.set(key_states, value_states, spare=max(64, n))
            return self.keys, self.values
        if self.length + n > self.capacity:
            grow = max(self.capacity, n, 64)
            b, h, _, d = self._k.shape
            for name in ("_k", "_v"):
                old = getattr(self, name)
                new = old.new_empty(b, h, self.capacity + grow, d)
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self._k is not None else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (tokens to remove), as DynamicLayer does in transformers 5")
        self.length = max(0, self.length + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k = self._k[indices]
            self._v = self._v[indices]

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        self.is_initialized = False


class SlotCache(Cache):
    """A ``Cache`` of ``SlotLayer``s, one per decoder layer."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[SlotLayer() for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model) -> "SlotCache":
        config = model.config
        config = getattr(config, "text_config", config)
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and any(
            t != "full_attention" for t in (getattr(config, "layer_types", None) or [])
        ):
            raise TypeError("the specctl engine supports full-attention models only (no sliding-window layers)")
        return cls(config.num_hidden_layers)


class BatchKV:
    """A ``SlotCache`` plus which slot of which row holds a real token."""

    def __init__(self, cache: SlotCache, valid: torch.Tensor) -> None:
        self.cache = cache
        self.valid = valid  # bool [batch, S]

    @classmethod
    def empty(cls, model, device: torch.device | str = "cpu") -> "BatchKV":
        return cls(SlotCache.for_model(model), torch.zeros(0, 0, dtype=torch.bool, device=device))

    # ------------------------------------------------------------ queries
    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def real_lengths(self) -> torch.Tensor:
        """long ``[batch]``: real tokens per row (= the next token's position)."""
        return self.valid.sum(-1)

    def holes(self) -> int:
        """Invalid slots in the rectangle (padding + holes)."""
        return int(self.valid.numel() - self.valid.sum())

    def _layers(self) -> list[SlotLayer]:
        return self.cache.layers  # type: ignore[return-value]

    def _check(self) -> None:
        for layer in self._layers():
            if layer._k is not None and layer.length != self.length:
                raise RuntimeError(f"cache layer holds {layer.length} slots, valid mask {self.length}")

    # ------------------------------------------------------------ batch changes
    def select(self, rows: list[int] | torch.Tensor) -> None:
        """Keep only ``rows`` (in that order)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid[idx]
        for layer in self._layers():
            if layer._k is not None:
                layer.batch_select_indices(idx.to(layer._k.device))
        if self.batch == 0:
            self.valid = self.valid[:, :0]
            for layer in self._layers():
                layer.reset()
        else:
            self.trim()

    def merge(self, other: "BatchKV") -> None:
        """Append ``other``'s rows after ours; the shorter side gets invalid
        slots on the left so both have the same length."""
        if other.batch == 0:
            return
        if self.batch == 0:
            self.cache, self.valid = other.cache, other.valid
            return
        s = max(self.length, other.length)
        mine = self._left_padded(s)
        theirs = other._left_padded(s)
        for layer, (k1, v1), (k2, v2) in zip(self._layers(), mine, theirs):
            layer.set(torch.cat([k1, k2]), torch.cat([v1, v2]))
        pad = lambda v: torch.cat([v.new_zeros(v.shape[0], s - v.shape[1]), v], dim=1)  # noqa: E731
        self.valid = torch.cat([pad(self.valid), pad(other.valid)])

    def _left_padded(self, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for layer in self._layers():
            k, v = layer.keys, layer.values
            extra = s - k.shape[2]
            if extra:
                z = k.new_zeros(k.shape[0], k.shape[1], extra, k.shape[3])
                k, v = torch.cat([z, k], dim=2), torch.cat([z, v], dim=2)
            out.append((k, v))
        return out

    # ------------------------------------------------------------ after a verify
    @torch.inference_mode()
    def compact(self, past_len: int, paths: torch.Tensor) -> None:
        """Keep each row's accepted block entries (block indices, -1 padded,
        ``[batch, K_max]``) in slots ``past_len ..``; drop the rest."""
        kept = int((paths >= 0).sum(-1).max())
        paths = paths[:, :kept]
        real = paths >= 0
        # Plain steps and accepted chain prefixes keep every entry where the forward wrote it:
        # only the valid mask and the length change (a rejected tail becomes a hole).
        if not bool(((paths == torch.arange(kept, device=paths.device)) | ~real).all()):
            src = past_len + paths.clamp(min=0)  # [batch, K] absolute slots; holes copy the root
            for layer in self._layers():
                b, h, _, d = layer._k.shape
                index = src.to(layer._k.device)[:, None, :, None].expand(b, h, kept, d)
                for buf in (layer._k, layer._v):
                    buf[:, :, past_len : past_len + kept] = buf[:, :, : layer.length].gather(2, index)
        for layer in self._layers():
            layer.length = past_len + kept
        self.valid = torch.cat([self.valid[:, :past_len], real.to(self.valid.device)], dim=1)

    def trim(self) -> None:
        """Drop leading columns that no row uses."""
        if self.length == 0:
            return
        used = self.valid.any(0)
        first = int(used.long().argmax()) if bool(used.any()) else self.length
        if first == 0:
            return
        self.valid = self.valid[:, first:]
        for layer in self._layers():
            if layer._k is not None:
                layer.set(layer.keys[:, :, first:], layer.values[:, :, first:])

    @torch.inference_mode()
    def repack(self) -> None:
        """Right-align each row's valid slots (order kept) and shrink to the longest row."""
        if self.batch == 0:
            return
        counts = self.valid.sum(-1)  # [batch]
        new_len = int(counts.max())
        if new_len == self.length and bool(self.valid.all()):
            return
        # Stable order of valid slots per row: sort by (valid, index).
        s = self.length
        ar = torch.arange(s, device=self.valid.device)
        key = torch.where(self.valid, ar + s, ar)  # invalid first, then valid, both in order
        order = key.argsort(-1)[:, s - new_len :]  # [batch, new_len]
        valid = self.valid.gather(1, order)
        for layer in self._layers():
            b, h, _, d = layer._k.shape
            index = order.to(layer._k.device)[:, None, :, None].expand(b, h, new_len, d)
            layer.set(layer.keys.gather(2, index), layer.values.gather(2, index))
        self.valid = valid

    def maybe_repack(self, max_hole_fraction: float = 0.25, min_len: int = 32) -> bool:
        """Repack when holes exceed ``max_hole_fraction`` of the rectangle."""
        if self.length >= min_len and self.holes() > max_hole_fraction * self.valid.numel():
            self.repack()
            return True
        return False
