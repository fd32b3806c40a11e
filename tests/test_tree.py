"""Tree buffers pinned by hand (block coordinates: 0 = root, i+1 = node i)."""

import pytest
import torch

from worker.reference.engine.tree import chain_parents, tree_buffers


def _bool(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_chain_parents():
    assert chain_parents(3) == [-1, 0, 1]
    assert chain_parents(1) == [-1]
    assert chain_parents(0) == []
    with pytest.raises(ValueError):
        chain_parents(-1)


def test_chain_of_three():
    b = tree_buffers(chain_parents(3))
    assert b.num_nodes == 3
    assert b.depth == 3
    assert torch.equal(
        b.attn_mask,
        _bool(
            [
                [1, 0, 0, 0],
                [1, 1, 0, 0],
                [1, 1, 1, 0],
                [1, 1, 1, 1],
            ]
        ),
    )
    assert b.position_offsets.tolist() == [0, 1, 2, 3]
    assert b.position_offsets.dtype == torch.long
    assert b.retrieve_paths.tolist() == [[0, 1, 2, 3]]
    assert b.retrieve_paths.dtype == torch.long


def test_two_by_two_tree():
    # root -> nodes 0, 1; node 0 -> 2, 3; node 1 -> 4, 5.
    # block: 0 root, 1..2 = nodes 0..1, 3..6 = nodes 2..5
    b = tree_buffers([-1, -1, 0, 0, 1, 1])
    assert b.num_nodes == 6
    assert b.depth == 2
    assert torch.equal(
        b.attn_mask,
        _bool(
            [
                # r  n0 n1 n2 n3 n4 n5
                [1, 0, 0, 0, 0, 0, 0],  # root
                [1, 1, 0, 0, 0, 0, 0],  # n0
                [1, 0, 1, 0, 0, 0, 0],  # n1
                [1, 1, 0, 1, 0, 0, 0],  # n2 (under n0)
                [1, 1, 0, 0, 1, 0, 0],  # n3 (under n0)
                [1, 0, 1, 0, 0, 1, 0],  # n4 (under n1)
                [1, 0, 1, 0, 0, 0, 1],  # n5 (under n1)
            ]
        ),
    )
    assert b.position_offsets.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert b.retrieve_paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]


def test_uneven_tree_pads_paths():
    # root -> 0 -> 1 -> 2, and root -> 3 (a short branch)
    b = tree_buffers([-1, 0, 1, -1])
    assert b.depth == 3
    assert b.position_offsets.tolist() == [0, 1, 2, 3, 1]
    assert b.retrieve_paths.tolist() == [[0, 1, 2, 3], [0, 4, -1, -1]]


def test_empty_tree_is_root_only():
    b = tree_buffers([])
    assert b.depth == 0
    assert b.attn_mask.tolist() == [[True]]
    assert b.position_offsets.tolist() == [0]
    assert b.retrieve_paths.tolist() == [[0]]


@pytest.mark.parametrize(
    "parents, node, value",
    [
        ([0], 0, 0),  # its own parent
        ([-1, 1], 1, 1),  # self again, later
        ([-1, 2, 0], 1, 2),  # a parent after the child
        ([-1, -2], 1, -2),  # below -1
    ],
)
def test_bad_parents_raise(parents, node, value):
    with pytest.raises(ValueError, match=rf"node {node} has parent {value}\b"):
        tree_buffers(parents)
