"""One verify step for a batch whose rows carry *different* draft trees.

``verify.py`` verifies one tree shape for the whole batch; a serving engine
gives each request its own decision, so here every row has its own tree,
padded to the largest. Padding entries attend to nothing but themselves,
their logits are never computed and their KV is dropped by compaction.

Block coordinates as in ``tree.py``: entry 0 is the root, entry ``i + 1`` is
draft node ``i``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from worker.reference.drafters.base import DraftTree
from worker.reference.engine.tree import TreeBuffers, tree_buffers

__all__ = ["Block", "RowOutcome", "build_block", "cached_tree_buffers", "greedy_path", "row_outcome", "typical_path"]


@functools.lru_cache(maxsize=4096)
def cached_tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    """``tree_buffers`` memoised on the parent tuple (drafters repeat shapes)."""
    return tree_buffers(parents)


class Block(NamedTuple):
    """Model inputs of one step: ``ids`` / ``position_ids`` long ``[batch, N+1]``,
    ``attention_mask`` additive ``[batch, 1, N+1, past+N+1]``, ``sizes`` the
    real block entries per row (``n_b + 1``)."""

    ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    sizes: list[int]


def build_block(
    roots: Sequence[int],
    trees: Sequence[DraftTree],
    past_valid: torch.Tensor,
    dtype: torch.dtype,
    pad_id: int = 0,
) -> Block:
    """Token ids, positions and the 4-D additive mask for ``[past | root | nodes]`` per row."""
    batch, past = past_valid.shape
    device = past_valid.device
    sizes = [t.num_nodes + 1 for t in trees]
    width = max(sizes)
    # Built on the host row by row, then moved in one go (one copy each, not one per row).
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device="cpu")
    offsets = torch.zeros(batch, width, dtype=torch.long, device="cpu")
    tree_mask = torch.eye(width, dtype=torch.bool, device="cpu").repeat(batch, 1, 1)  # pads: self only
    sees_past = torch.zeros(batch, width, dtype=torch.bool, device="cpu")
    for b, (root, tree) in enumerate(zip(roots, trees)):
        n = sizes[b]
        ids[b, 0] = int(root)
        if n > 1:
            ids[b, 1:n] = torch.tensor(tree.tokens, dtype=torch.long, device="cpu")
            buf = cached_tree_buffers(tuple(tree.parents))
            offsets[b, :n] = buf.position_offsets
            tree_mask[b, :n, :n] = buf.attn_mask
        sees_past[b, :n] = True
    ids, offsets, tree_mask, sees_past = (t.to(device) for t in (ids, offsets, tree_mask, sees_past))
    root_pos = past_valid.sum(-1)  # [batch]: real tokens before the root
    position_ids = root_pos[:, None] + offsets
    allowed = torch.cat([past_valid[:, None, :] & sees_past[:, :, None], tree_mask], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return Block(ids, position_ids, mask[:, None], sizes)


@dataclass(slots=True)
class RowOutcome:
    """Verification of one row (greedy or sampled).

    ``path``: block indices root-first of the accepted entries; ``tokens``:
    the accepted draft tokens then the token after them (bonus or sample:
    what the row emits);
    ``accepted``: τ; ``accepted_rank`` / ``level_candidates`` /
    ``draft_confidence``: per level reached, as ``worker/sdk/telemetry.py``
    defines them (rank by draft confidence, 1-based, 0 = rejected)."""

    path: list[int]
    tokens: list[int]
    accepted: int
    accepted_rank: list[int]
    level_candidates: list[int]
    draft_confidence: list[float]


def greedy_path(tree: DraftTree, target: Sequence[int]) -> tuple[list[int], int]:
    """Longest draft path the target's argmax agrees with, plus the bonus.

    ``target[j]`` is the target's greedy token after block entry ``j``
    (``j = 0`` the root). Among equally deep accepted nodes the first one in
    node order wins (their tokens are identical anyway: each is forced).
    Returns the path (block indices, root first) and the bonus token.

    >>> greedy_path(DraftTree([-1, -1, 0], [7, 8, 9], [0.6, 0.4, 0.9]), [8, 5, 1, 3])
    ([0, 2], 1)
    """
    n = tree.num_nodes
    depth = [0] * (n + 1)
    ok = [True] + [False] * n
    best = 0
    for i in range(n):
        p = tree.parents[i] + 1
        if ok[p] and tree.tokens[i] == target[p]:
            ok[i + 1] = True
            depth[i + 1] = depth[p] + 1
            if depth[i + 1] > depth[best]:
                best = i + 1
    path = [best]
    while path[-1] != 0:
        path.append(tree.parents[path[-1] - 1] + 1)
    path.reverse()
    return path, int(target[best])


def typical_path(tree: DraftTree, passes: Sequence[bool], target: Sequence[int]) -> tuple[list[int], int]:
    """Typical acceptance's walk down a row's tree, plus the bonus.

    From the root, take the first child in node order that ``passes`` (the
    typical bar of ``verify.typical_passes``), then its first passing child,
    and so on until no child passes; the bonus is the target's greedy token
    ``target[j]`` after the last accepted entry ``j``. Returns the path
    (block indices, root first) and the bonus.

    >>> t = DraftTree([-1, -1, 0, 1], [7, 8, 9, 4], [0.6, 0.4, 0.9, 0.5])
    >>> typical_path(t, [False, True, True, True], [8, 5, 1, 3, 2])   # node 0 fails, node 1 then node 3 pass
    ([0, 2, 4], 2)
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p + 1, []).append(i + 1)
    path = [0]
    while True:
        nxt = next((j for j in children.get(path[-1], ()) if passes[j - 1]), 0)
        if not nxt:
            return path, int(target[path[-1]])
        path.append(nxt)


def row_outcome(tree: DraftTree, path: Sequence[int], next_token: int) -> RowOutcome:
    """What a row emits and reports once verification chose ``path`` (block
    indices, root first) and the token after it (greedy bonus or sample).

    >>> t = DraftTree([-1, -1, 0], [7, 8, 9], [0.6, 0.4, 0.9])
    >>> o = row_outcome(t, [0, 2], 1)   # node 1 (token 8) accepted, a leaf: no rejection entry
    >>> o.tokens, o.accepted, o.accepted_rank, o.level_candidates
    ([8, 1], 1, [2], [2])
    """
    path = list(path)
    tau = len(path) - 1
    tokens = [tree.tokens[j - 1] for j in path[1:]] + [int(next_token)]
    ranks: list[int] = []
    cands: list[int] = []
    confs: list[float] = []
    if tree.num_nodes:
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            children.setdefault(p + 1, []).append(i + 1)
        tree_depth = tree.depth()
        for level in range(1, min(tau + 1, tree_depth) + 1):
            parent = path[level - 1]
            kids = children.get(parent, [])
            if not kids:  # the path ended at a leaf shallower than the tree
                break
            by_conf = sorted(kids, key=lambda j: (-tree.confidences[j - 1], j))
            confs.append(min(1.0, max(0.0, float(tree.confidences[by_conf[0] - 1]))))
            cands.append(len(kids))
            ranks.append(by_conf.index(path[level]) + 1 if level <= tau else 0)
    return RowOutcome(path, tokens, tau, ranks, cands, confs)
