"""replan (properties/replan.py): the batch before the checked one has its shapes and nothing else of it."""

from __future__ import annotations

import torch

from batch.spec import BatchSpec, ForwardMode, ImageSpan, MHALayer, MropeLayout, SpecInput
from engine.materialize import materialize
from engine.model import fused_views
from properties.graph import pool_tensors
from properties.replan import moved_into, same_shapes

VERIFY = BatchSpec(ForwardMode.TARGET_VERIFY, (4, 7, 2), (3, 3, 3), (MHALayer(0, 4, 2, 32, 32),),
                   spec=SpecInput(3, 2, 2, ((-1, 0, 0), (-1, 0, 1), (-1, 0, 0)), (2, 3, 1)), seed=4)


def test_the_batch_before_has_the_same_shapes_its_requests_rotated():
    before = same_shapes(VERIFY)
    assert before.prefix_lens == (7, 2, 4) and before.extend_lens == VERIFY.extend_lens
    assert before.spec.parents == ((-1, 0, 1), (-1, 0, 0), (-1, 0, 0)) and before.spec.accept_lens == (3, 1, 2)
    assert before.kv_layout != VERIFY.kv_layout and before.seed != VERIFY.seed and before.layers == VERIFY.layers
    images = BatchSpec(ForwardMode.EXTEND, (0, 0), (4, 2), VERIFY.layers,
                       mrope=MropeLayout((4, 6, 6), (ImageSpan(0, 0, 1, 2, 2),)))
    assert same_shapes(images).mrope.images == (ImageSpan(1, 0, 1, 2, 2),)  # request 0 is now the last


def test_the_checked_batch_moves_into_the_first_batchs_pools(device):
    first, second = materialize(same_shapes(VERIFY), device), materialize(VERIFY, device)
    moved = moved_into(first, second)
    fb, fb1 = moved.forward_batch, first.forward_batch
    assert fb.req_to_token is fb1.req_to_token and fb.token_to_kv_pool is fb1.token_to_kv_pool
    assert torch.equal(fb.req_to_token, second.forward_batch.req_to_token)
    for name, t in pool_tensors(fb).items():
        assert torch.equal(t, pool_tensors(second.forward_batch)[name])


def test_fused_views_keep_the_values_and_stride_every_row_by_the_whole_width():
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 6)
    fq, fk, fv = fused_views(q, k, v)
    assert torch.equal(fq, q) and torch.equal(fk, k) and torch.equal(fv, v)
    assert fq.stride(0) == fk.stride(0) == fv.stride(0) == 4 * 8 + 2 * 8 + 2 * 6
    assert not fq.is_contiguous() and fq.untyped_storage().data_ptr() == fv.untyped_storage().data_ptr()
