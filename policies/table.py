"""Decisions and the decision table a worker evaluates locally.

Vocabulary used throughout specctl:

- depth ``d``: draft tokens along one path; ``0`` means speculation off.
- width ``w``: candidates kept per tree level; ``1`` is a chain.
- nodes ``n``: draft tokens verified for one request in one step (root excluded).
- accepted ``τ``: draft tokens accepted in a step, bonus token excluded, so a
  step emits ``τ + 1`` tokens.

A table is keyed by batch-size buckets and context-length buckets: bucket ``i``
of an edge list covers ``[edges[i], edges[i + 1])`` and the last bucket is
open-ended.

>>> table = DecisionTable.uniform(Decision.chain(3), batch_edges=(1, 8), context_edges=(0, 4096))
>>> table.lookup(batch_size=4, context_len=100)
Decision(depth=3, width=1, max_nodes=3)
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Sequence

DEFAULT_BATCH_EDGES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_CONTEXT_EDGES: tuple[int, ...] = (0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True, slots=True)
class Decision:
    """What one request does in one step: draft ``depth`` levels of up to
    ``width`` candidates each, verifying at most ``max_nodes`` draft tokens."""

    depth: int = 0
    width: int = 0
    max_nodes: int = 0

    def __post_init__(self) -> None:
        if self.depth < 0 or self.width < 0 or self.max_nodes < 0:
            raise ValueError(f"decision fields must be >= 0, got {self}")
        if self.depth == 0 and (self.width or self.max_nodes):
            raise ValueError(f"an off decision (depth=0) must have width=0 and max_nodes=0, got {self}")
        if self.depth > 0 and (self.width < 1 or self.max_nodes < self.depth):
            raise ValueError(f"depth={self.depth} needs width >= 1 and max_nodes >= depth, got {self}")

    @property
    def speculate(self) -> bool:
        return self.depth > 0

    @classmethod
    def off(cls) -> "Decision":
        return cls(0, 0, 0)

    @classmethod
    def chain(cls, depth: int) -> "Decision":
        return cls(depth, 1, depth) if depth > 0 else cls.off()

    def clamp(self, max_depth: int, max_width: int, max_nodes: int) -> "Decision":
        """The same decision cut to what a drafter can produce."""
        depth = min(self.depth, max_depth)
        if depth == 0:
            return Decision.off()
        width = max(1, min(self.width, max_width))
        nodes = max(depth, min(self.max_nodes, max_nodes, depth * width))
        return Decision(depth, width, nodes)


def bucket_index(edges: Sequence[int], value: int) -> int:
    """Index of the bucket ``value`` falls in (values below the first edge go to bucket 0)."""
    return max(bisect_right(edges, value) - 1, 0)


def validate_edges(edges: Sequence[int], first: int, field: str) -> tuple[int, ...]:
    edges = tuple(int(e) for e in edges)
    if not edges or edges[0] != first:
        raise ValueError(f"{field} must start at {first}, got {list(edges)}")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"{field} must be strictly increasing, got {list(edges)}")
    return edges


@dataclass(frozen=True, slots=True)
class DecisionTable:
    """Dense row-major table: ``decisions[b * len(context_edges) + c]``."""

    batch_edges: tuple[int, ...]
    context_edges: tuple[int, ...]
    decisions: tuple[Decision, ...]

    def __post_init__(self) -> None:
        validate_edges(self.batch_edges, 1, "batch_size_edges")
        validate_edges(self.context_edges, 0, "context_len_edges")
        expected = len(self.batch_edges) * len(self.context_edges)
        if len(self.decisions) != expected:
            raise ValueError(
                f"table has {len(self.decisions)} decisions, expected "
                f"{len(self.batch_edges)} batch buckets x {len(self.context_edges)} context buckets = {expected}"
            )

    @classmethod
    def uniform(
        cls,
        decision: Decision,
        batch_edges: Sequence[int] = DEFAULT_BATCH_EDGES,
        context_edges: Sequence[int] = DEFAULT_CONTEXT_EDGES,
    ) -> "DecisionTable":
        return cls(tuple(batch_edges), tuple(context_edges), (decision,) * (len(batch_edges) * len(context_edges)))

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[Sequence[Decision]],
        batch_edges: Sequence[int],
        context_edges: Sequence[int],
    ) -> "DecisionTable":
        flat = tuple(d for row in rows for d in row)
        return cls(tuple(batch_edges), tuple(context_edges), flat)

    def cell(self, batch_bucket: int, context_bucket: int) -> Decision:
        return self.decisions[batch_bucket * len(self.context_edges) + context_bucket]

    def lookup(self, batch_size: int, context_len: int) -> Decision:
        b = bucket_index(self.batch_edges, batch_size)
        c = bucket_index(self.context_edges, context_len)
        return self.decisions[b * len(self.context_edges) + c]

    def clamped(self, max_depth: int, max_width: int, max_nodes: int) -> "DecisionTable":
        """The same table with every decision clamped to a drafter's limits."""
        return DecisionTable(self.batch_edges, self.context_edges,
                             tuple(d.clamp(max_depth, max_width, max_nodes) for d in self.decisions))

    def row(self, batch_bucket: int) -> tuple[Decision, ...]:
        n = len(self.context_edges)
        return self.decisions[batch_bucket * n : (batch_bucket + 1) * n]
