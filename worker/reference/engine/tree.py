"""Draft trees as data: a parent list in, the tensors a verify pass needs out.

Conventions (shared with the rest of specctl)
---------------------------------------------
A draft tree hangs off the *root*, the last accepted token (the bonus token of
the previous step), whose KV is not in the cache yet. Draft nodes are numbered
``0..n-1`` in topological order and given by ``parents[i]``: the index of node
i's parent, or ``-1`` when the parent is the root.

Every tensor here is indexed in *block* coordinates, the order in which the
verify pass feeds tokens to the model: index 0 is the root and index ``i + 1``
is draft node ``i``. So a block has ``n + 1`` entries.

- depth ``d`` of the tree: the longest root-to-leaf path, in draft tokens
  (0 = no speculation; the block is the root alone).
- width 1 everywhere = a chain (``chain_parents``).

Nothing here touches a model; everything is a pure function of the parent list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TreeBuffers", "chain_parents", "tree_buffers"]


@dataclass(frozen=True)
class TreeBuffers:
    """Static buffers describing one draft tree, in block coordinates.

    Attributes
    ----------
    parents : tuple[int, ...]
        The validated parent list (draft-node coordinates, -1 = root).
    attn_mask : torch.Tensor
        bool ``[n+1, n+1]``; ``attn_mask[i, j]`` is True iff block entry i may
        attend to block entry j, i.e. j is i itself or one of its ancestors
        (the root is everybody's ancestor).
    position_offsets : torch.Tensor
        long ``[n+1]``; depth of each block entry (root = 0). Added to the
        root's absolute position to get RoPE positions: siblings share one.
    retrieve_paths : torch.Tensor
        long ``[num_leaves, depth+1]``; for each leaf, the block indices from
        the root (always 0) down to the leaf, right-padded with -1.
    depth : int
        Longest root-to-leaf path in draft tokens.
    """

    parents: tuple[int, ...]
    attn_mask: torch.Tensor
    position_offsets: torch.Tensor
    retrieve_paths: torch.Tensor
    depth: int

    @property
    def num_nodes(self) -> int:
        """Draft nodes ``n`` (the block holds ``n + 1`` tokens, root included)."""
        return len(self.parents)


def chain_parents(d: int) -> list[int]:
    """Parent list of a chain of ``d`` draft tokens.

    >>> chain_parents(4)
    [-1, 0, 1, 2]
    >>> chain_parents(0)
    []
    """
    if d < 0:
        raise ValueError(f"chain depth must be >= 0, got {d}")
    return [i - 1 for i in range(d)]


def _validate(parents: Sequence[int]) -> tuple[int, ...]:
    """Check topological order: every parent is the root or an earlier node."""
    out = []
    for i, p in enumerate(parents):
        p = int(p)
        if p < -1 or p >= i:
            raise ValueError(
                f"draft node {i} has parent {p}: a parent must be -1 (the root) "
                f"or an earlier node index in 0..{i - 1} (topological order)"
            )
        out.append(p)
    return tuple(out)


def _block_parents(parents: tuple[int, ...]) -> list[int]:
    """Parents in block coordinates: root (0) has none (-1), node i sits at i+1."""
    return [-1] + [p + 1 for p in parents]


def _depths(block_parents: list[int]) -> list[int]:
    # Topological order means a parent's depth is known before its children's.
    depth = [0] * len(block_parents)
    for i in range(1, len(block_parents)):
        depth[i] = depth[block_parents[i]] + 1
    return depth


def _ancestor_mask(block_parents: list[int]) -> torch.Tensor:
    """bool [n+1, n+1]: row i = i's own column plus its parent's row."""
    size = len(block_parents)
    mask = torch.eye(size, dtype=torch.bool, device="cpu")  # [n+1, n+1], host: build_block moves whole blocks
    for i in range(1, size):
        mask[i] |= mask[block_parents[i]]  # inherit the parent's ancestors
    return mask


def _leaf_paths(block_parents: list[int], depth: list[int]) -> torch.Tensor:
    """long [num_leaves, max_depth+1]: root→leaf block indices, -1 padded."""
    size = len(block_parents)
    has_child = [False] * size
    for i in range(1, size):
        has_child[block_parents[i]] = True
    leaves = [i for i in range(size) if not has_child[i]]  # root alone if n == 0
    width = max(depth) + 1
    paths = torch.full((len(leaves), width), -1, dtype=torch.long, device="cpu")
    for row, leaf in enumerate(leaves):
        node = leaf
        while node != -1:  # walk up, filling from the leaf's depth backwards
            paths[row, depth[node]] = node
            node = block_parents[node]
    return paths


def tree_buffers(parents: Sequence[int]) -> TreeBuffers:
    """Turn a parent list into the verify-pass buffers.

    Parameters
    ----------
    parents : Sequence[int]
        ``parents[i]`` is draft node i's parent (-1 = the root); nodes must be
        topologically ordered (a parent comes before its children).

    Returns
    -------
    TreeBuffers

    Raises
    ------
    ValueError
        If a parent index is < -1 or >= its own node index.

    Examples
    --------
    >>> b = tree_buffers([-1, -1, 0])   # two root children, node 0 has a child
    >>> b.position_offsets.tolist()
    [0, 1, 1, 2]
    >>> b.retrieve_paths.tolist()
    [[0, 2, -1], [0, 1, 3]]
    """
    checked = _validate(parents)
    block_parents = _block_parents(checked)
    depth = _depths(block_parents)
    return TreeBuffers(
        parents=checked,
        attn_mask=_ancestor_mask(block_parents),
        position_offsets=torch.tensor(depth, dtype=torch.long, device="cpu"),
        retrieve_paths=_leaf_paths(block_parents, depth),
        depth=max(depth),
    )
