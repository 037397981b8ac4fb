"""The tree_branch property: leaf paths cover every node, the chain batches carry the tree's own rows, and a
tree whose nodes disagree with their branches fails while a correct backend passes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecInput
from engine.materialize import materialize
from properties.tolerances import UNIT_ROUNDOFF, branch_bound
from properties.tree import leaf_paths, path_batch, tree_branch_equals_chain

TREE = SpecInput(5, 2, 3, ((-1, 0, 0, 1, 1), (-1, 0, 1, 2, 0)), (3, 4))
SPEC = BatchSpec(ForwardMode.TARGET_VERIFY, (6, 11), (5, 5), (MHALayer(0, 4, 2, 32, 32, sliding_window=3),
                                                             MHALayer(1, 4, 2, 32, 32)), spec=TREE, seed=3)


def test_leaf_paths_cover_every_node_once_per_leaf():
    assert leaf_paths(SPEC) == [(0, [0, 2]), (0, [0, 1, 3]), (0, [0, 1, 4]), (1, [0, 1, 2, 3]), (1, [0, 4])]
    covered = {(i, n) for i, path in leaf_paths(SPEC) for n in path}
    assert covered == {(i, n) for i in range(2) for n in range(5)}


def test_path_batches_read_the_trees_rows():
    case = materialize(SPEC)
    fb = case.forward_batch
    paths = leaf_paths(SPEC)
    before = fb.req_to_token.clone()
    batch, tok = path_batch(fb, SPEC, [paths[1], paths[3]])  # request 0's [0, 1, 3], request 1's [0, 1, 2, 3]
    assert tok.tolist() == [0, 1, 3, 5, 6, 7, 8]
    assert batch.extend_seq_lens_cpu == [3, 4] and batch.extend_prefix_lens_cpu == [6, 11]
    assert batch.positions.tolist() == [6, 7, 8, 11, 12, 13, 14]  # prefix + depth, the tree's positions
    # As a scheduler's extend: each path writes at the slots its request's row lists after the prefix (the verify's
    # row lists the tree's nodes in draft order: request 0's node 2 where the path has node 3), and the row is kept
    rows = batch.req_pool_indices.tolist()
    assert batch.out_cache_loc.tolist() == fb.req_to_token[rows[0], 6:9].tolist() + \
        fb.req_to_token[rows[1], 11:15].tolist()
    assert batch.out_cache_loc[2] != fb.out_cache_loc[3]  # not node 3's own slot
    assert torch.equal(fb.req_to_token, before)
    with pytest.raises(ValueError, match="two paths of one request"):
        path_batch(fb, SPEC, paths[:2])


def test_a_correct_backend_passes_on_trees_with_a_window(device):
    verdict = tree_branch_equals_chain(parse("torch_native"), SPEC, device)
    assert verdict.ok, str(verdict)
    assert verdict.worst_error is not None and verdict.worst_error < verdict.bound


def test_the_bound_is_two_roundings_of_two_runs():
    bound = branch_bound(parse("torch_native"), SPEC, SPEC.layers[0], "cuda")
    u = UNIT_ROUNDOFF["float32"]
    # two roundings of two runs (4u) and the accumulation of both runs over L = 16 keys of D = 32
    assert bound.rel_l2 == pytest.approx(4 * u + 2 * (16**0.5 + 32**0.5) * 2**-24, rel=1e-12)
    bf16 = branch_bound(parse("torch_native"), dataclasses.replace(SPEC, dtype="bfloat16"), SPEC.layers[0], "cuda")
    assert abs(bf16.rel_l2 - 4 * 2**-8) < 1e-5
