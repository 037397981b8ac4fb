"""TBO split rules and child batches (DESIGN.md section 4)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecInput
from batch.tbo_split import attach_tbo_children, balanced_split_index, compute_split, two_chunk_split_enabled
from engine.materialize import materialize

LAYER = (MHALayer(0, 4, 2, 32, 32),)


def test_balanced_extend_split():
    s = compute_split(ForwardMode.EXTEND, [10, 10, 10, 10])
    assert (s.split_seq, s.split_token, s.two_chunk) == (2, 20, False)


def test_uneven_extend_uses_two_chunk_split():
    lens = [100, 4, 4]
    assert two_chunk_split_enabled(lens)
    s = compute_split(ForwardMode.EXTEND, lens)
    assert (s.split_seq, s.split_token, s.two_chunk) == (0, 54, True)


def test_single_request_extend_splits_inside_it():
    s = compute_split(ForwardMode.EXTEND, [7])
    assert (s.split_seq, s.split_token, s.two_chunk) == (0, 3, True)


def test_decode_and_verify_split_by_requests():
    assert compute_split(ForwardMode.DECODE, [1] * 5) == compute_split(ForwardMode.DECODE, [1] * 5)
    d = compute_split(ForwardMode.DECODE, [1] * 5)
    assert (d.split_seq, d.split_token) == (2, 2)
    v = compute_split(ForwardMode.TARGET_VERIFY, [4] * 5, draft_token_num=4)
    assert (v.split_seq, v.split_token) == (2, 8)
    assert compute_split(ForwardMode.DECODE, [1]) is None  # a half would be empty


@given(st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_split_rules(lens):
    s = compute_split(ForwardMode.EXTEND, lens)
    if s is None:
        assert sum(lens) < 2
        return
    assert 0 < s.split_token < sum(lens)
    if not s.two_chunk:
        assert s.split_token == sum(lens[: s.split_seq])
        left = s.split_token / sum(lens)
        assert two_chunk_split_enabled(lens) or 0.48 <= left <= 0.52 or balanced_split_index(lens) == s.split_seq
    else:
        assert s.split_token == sum(lens) // 2
        assert sum(lens[: s.split_seq]) < s.split_token < sum(lens[: s.split_seq + 1])


def test_two_chunk_children_carry_the_straddling_request():
    spec = BatchSpec(ForwardMode.EXTEND, (5, 0), (30, 2), LAYER)
    fb = materialize(spec).forward_batch
    split = attach_tbo_children(fb)
    a, b = fb.tbo_children
    assert split.two_chunk and split.split_token == 16
    assert a.extend_seq_lens_cpu == [16] and a.extend_prefix_lens_cpu == [5]
    assert b.extend_seq_lens_cpu == [14, 2] and b.extend_prefix_lens_cpu == [21, 0]
    assert torch.equal(torch.cat([a.positions, b.positions]), fb.positions)
    assert torch.equal(torch.cat([a.out_cache_loc, b.out_cache_loc]), fb.out_cache_loc)
    assert a.req_pool_indices.tolist() == fb.req_pool_indices[:1].tolist()
    assert b.req_pool_indices.tolist() == fb.req_pool_indices.tolist()


def test_mrope_is_sliced_on_the_token_dimension():
    from batch.spec import ImageSpan, MropeLayout
    spec = BatchSpec(ForwardMode.EXTEND, (0, 0), (6, 6), LAYER, mrope=MropeLayout((4, 6, 6), (ImageSpan(1, 1, 1, 2, 2),)))
    fb = materialize(spec).forward_batch
    attach_tbo_children(fb)
    a, b = fb.tbo_children
    assert a.mrope_positions.shape == (3, 6) and b.mrope_positions.shape == (3, 6)
    assert torch.equal(torch.cat([a.mrope_positions, b.mrope_positions], dim=1), fb.mrope_positions)


def test_verify_children_get_their_mask_blocks():
    D = 3
    spec = BatchSpec(ForwardMode.TARGET_VERIFY, (4, 2, 5, 1), (D,) * 4, LAYER,
                     spec=SpecInput(D, 2, 2, ((-1, 0, 0),) * 4, (1, 2, 1, 2)))
    fb = materialize(spec).forward_batch
    attach_tbo_children(fb)
    a, b = fb.tbo_children
    sizes = [D * (s + D) for s in (4, 2, 5, 1)]
    assert a.spec_info.custom_mask.numel() == sum(sizes[:2]) and b.spec_info.custom_mask.numel() == sum(sizes[2:])
    assert torch.equal(torch.cat([a.spec_info.custom_mask, b.spec_info.custom_mask]), fb.spec_info.custom_mask)
    assert a.seq_lens.tolist() == [4, 2] and b.extend_num_tokens == 2 * D
