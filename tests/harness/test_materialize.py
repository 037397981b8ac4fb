"""Materialization: determinism, paged non-contiguous slots, reserved padding, and every batch field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batch.masks import verify_custom_mask
from batch.spec import KV_LAYOUTS, BatchSpec, ForwardMode, LinearLayer, MHALayer, MLALayer, SpecInput
from engine.materialize import _Draw, _normal_table, materialize
from search.profiles import PROFILES
from search.strategies import batch_specs

CI = PROFILES["ci"]


def _tensors(case):
    fb = case.forward_batch
    out = [fb.req_to_token, fb.req_pool_indices, fb.out_cache_loc, fb.positions, fb.state_slots]
    out += list(fb.token_to_kv_pool.k_buffers.values())
    out += [b for b in fb.token_to_kv_pool.v_buffers.values() if b is not None]
    for li in case.inputs:
        out += list(li.tensors.values())
    if fb.mamba_pool is not None:
        out += list(fb.mamba_pool.ssm_states.values()) + list(fb.mamba_pool.conv_states.values())
    return out


@given(batch_specs(CI, ForwardMode.EXTEND, frozenset({"mha", "linear"}), hybrid=True))
def test_same_spec_same_tensors_bit_for_bit(spec):
    a, b = materialize(spec), materialize(spec)
    for x, y in zip(_tensors(a), _tensors(b)):
        assert x.dtype == y.dtype and torch.equal(x, y)


@given(batch_specs(CI, ForwardMode.EXTEND, frozenset({"mha"})))
def test_slots_are_paged_shuffled_and_never_zero(spec):
    case = materialize(spec)
    ps = spec.page_size
    used = []
    for i, slots in enumerate(case.token_slots):
        slots = slots.tolist()
        assert len(slots) == spec.kv_lens[i]
        row = case.forward_batch.req_to_token[case.forward_batch.req_pool_indices[i]]
        assert row[: len(slots)].tolist() == slots
        for j, s in enumerate(slots):
            assert s % ps == j % ps and s // ps == slots[j - j % ps] // ps  # token j at page offset j % ps
        used += slots
    assert 0 not in used and len(set(used)) == len(used)
    assert case.forward_batch.out_cache_loc.tolist() == [s for i, sl in enumerate(case.token_slots)
                                                         for s in sl[spec.prefix_lens[i]:].tolist()]
    assert 0 not in case.forward_batch.req_pool_indices.tolist()  # row 0 is padding
    # ... and, as SGLang's zero-allocated pool, points at slot 0 only: a graph's padded rows read the padding slot
    assert not case.forward_batch.req_to_token[0].any()


@given(batch_specs(CI, ForwardMode.EXTEND, frozenset({"mha"})))
def test_slots_are_the_page_order_token_by_token(spec):
    """The slot layout case files reproduce: the first draw is the page order, and request i takes the next
    ceil(kv_len / page_size) pages of it, token j at offset j % page_size of its (j // page_size)-th page
    (the shuffled_pages layout, every case file's before layouts were drawn)."""
    spec = dataclasses.replace(spec, kv_layout="shuffled_pages")
    ps = spec.page_size
    pages_needed = [-(-n // ps) for n in spec.kv_lens]
    num_pages = 1 + sum(pages_needed) + 2 + sum(pages_needed) // 4
    page_order = (_Draw(spec.seed).perm(num_pages - 1) + 1).tolist()
    case, cursor = materialize(spec), 0
    for i, n in enumerate(spec.kv_lens):
        pages = page_order[cursor:cursor + pages_needed[i]]
        cursor += pages_needed[i]
        assert case.token_slots[i].tolist() == [pages[j // ps] * ps + j % ps for j in range(n)]

def _pages(case, spec) -> list[list[int]]:
    """Each request's physical pages, in token order."""
    ps = spec.page_size
    return [[s // ps for s in slots.tolist()[::ps]] for slots in case.token_slots]


@given(batch_specs(CI, ForwardMode.EXTEND, frozenset({"mha"})), st.sampled_from(KV_LAYOUTS[1:]))
def test_each_layout_lays_pages_as_it_promises(spec, layout):
    spec = dataclasses.replace(spec, kv_layout=layout)
    case = materialize(spec)
    pages = _pages(case, spec)
    flat = [p for ps_ in pages for p in ps_]
    assert len(set(flat)) == len(flat) and 0 not in flat
    if layout == "contiguous":  # one ascending run, requests back to back
        assert flat == list(range(1, len(flat) + 1))
    elif layout == "interleaved_pages":  # dealt one page per request in turn
        turns = sorted((k, i) for i, ps_ in enumerate(pages) for k in range(len(ps_)))
        assert [pages[i][k] for k, i in turns] == list(range(1, len(flat) + 1))
    else:  # non_monotonic_extend: prefix pages ascending, pages of new tokens only descending
        for i, ps_ in enumerate(pages):
            first_new = -(-spec.prefix_lens[i] // spec.page_size)
            assert ps_[:first_new] == sorted(ps_[:first_new])
            assert ps_[first_new:] == sorted(ps_[first_new:], reverse=True)
            if len(ps_) - first_new >= 2:
                new = case.token_slots[i][spec.prefix_lens[i]:].tolist()
                assert new != sorted(new)  # out_cache_loc goes down inside this extend


def test_layouts_share_every_other_draw():
    """Only the page table changes with the layout: pools and inputs are the same tensors."""
    base = BatchSpec(ForwardMode.EXTEND, (9, 0), (3, 5), (MHALayer(0, 4, 2, 32, 32),), page_size=4, seed=5)
    cases = [materialize(dataclasses.replace(base, kv_layout=l)) for l in KV_LAYOUTS]
    for c in cases[1:]:
        assert torch.equal(c.inputs[0].tensors["q"], cases[0].inputs[0].tensors["q"])
        assert not torch.equal(c.forward_batch.out_cache_loc, cases[0].forward_batch.out_cache_loc)


def _bits_in_python(seed: int, call: int, i: int) -> int:
    """``_Draw.bits`` element ``i`` of draw number ``call``, in plain Python integers modulo 2**32."""
    m = (1 << 32) - 1
    draw = _Draw(seed)
    draw.calls = call - 1
    k1, k2 = (k & m for k in draw._keys())
    x = ((i + k1) * 0x9E3779B1) & m
    x ^= x >> 16
    x = ((x * 0x7FEB352D) & m) ^ k2
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


@pytest.mark.parametrize("seed", [0, 7, 2**31 + 5])
def test_draw_bits_are_the_hash_exactly(seed):
    """The int32 tensor ops wrap like arithmetic modulo 2**32: this pins the stream on every platform (the GPU
    test compares a CPU and a CUDA materialization bit for bit)."""
    draw = _Draw(seed)
    first, second = draw.bits(1000, torch.device("cpu")), draw.bits(70_000, torch.device("cpu"))
    for call, words in [(1, first), (2, second)]:
        for i in [0, 1, 2, 999, 69_999][: 4 if call == 1 else 5]:
            assert int(words[i]) & 0xFFFFFFFF == _bits_in_python(seed, call, i)
    assert not torch.equal(first, second[:1000])  # a new draw is a new stream


def test_draws_have_the_intended_distributions():
    draw = _Draw(11)
    x = draw.normal(400_000).double()
    assert abs(x.mean()) < 0.01 and abs(x.std() - 1) < 0.01
    assert x.abs().max() < 4.33  # the table's ends: +-Phi^-1(1 - 2**-17) = +-4.32
    table = _normal_table(torch.device("cpu")).double()
    assert torch.all(table[1:] > table[:-1]) and torch.allclose(table, -table.flip(0))
    assert not torch.equal(draw.normal(10), draw.normal(10))  # consecutive draws differ
    u = draw.uniform(100_000, lo=0.02, hi=0.5)
    assert u.min() >= 0.02 and u.max() <= 0.5 and abs(u.mean() - 0.26) < 0.005
    assert sorted(draw.perm(1000).tolist()) == list(range(1000))
    ints = draw.ints(3, 9, 50_000)
    assert ints.min() == 3 and ints.max() == 8


def test_pages_are_not_contiguous():
    spec = BatchSpec(ForwardMode.EXTEND, (40, 40), (8, 8), (MHALayer(0, 4, 2, 32, 32),), page_size=4, seed=3)
    slots = materialize(spec).token_slots[0].tolist()
    pages = [s // 4 for s in slots[::4]]
    assert pages != sorted(pages)


def test_positions_verify_mask_and_mrope():
    D = 4
    spec = BatchSpec(ForwardMode.TARGET_VERIFY, (5, 3), (D, D), (MHALayer(0, 4, 2, 32, 32),),
                     spec=SpecInput(D, 2, 3, ((-1, 0, 0, 1), (-1, 0, 1, 2)), (2, 3)))
    fb = materialize(spec).forward_batch
    assert fb.positions.tolist() == [5, 6, 6, 7, 3, 4, 5, 6]  # seq_len + tree depth
    assert fb.seq_lens.tolist() == [5, 3]
    mask = verify_custom_mask(spec)
    assert mask.numel() == D * (5 + D) + D * (3 + D) == fb.spec_info.custom_mask.numel()
    block = mask[: D * (5 + D)].view(D, 5 + D)
    assert block[:, :5].all()
    assert block[3, 5:].tolist() == [True, True, False, True]  # node 3 sees itself, its parent 1 and root 0
    text = BatchSpec(ForwardMode.EXTEND, (2,), (3,), (MHALayer(0, 4, 2, 32, 32),),
                     mrope=__import__("batch.spec", fromlist=["MropeLayout"]).MropeLayout((4, 6, 6)))
    mfb = materialize(text).forward_batch
    assert (mfb.mrope_positions == mfb.positions[None]).all()


def test_linear_pools_and_mla_cache_shapes():
    spec = BatchSpec(ForwardMode.EXTEND, (0, 6), (3, 2),
                     (MLALayer(0, 4, 16, 8, 32, 16), LinearLayer(1, 2, 4, 16, 16)))
    case = materialize(spec)
    fb = case.forward_batch
    assert fb.token_to_kv_pool.k_buffers[0].shape[1:] == (1, 32 + 8)
    assert fb.token_to_kv_pool.v_buffers[0] is None
    assert fb.mamba_pool.ssm_states[1].dtype == torch.float32
    assert fb.mamba_pool.conv_states[1].shape[1:] == (2 * 2 * 16 + 4 * 16, 3)
    assert 0 not in fb.state_slots.tolist() and fb.req_to_state_slot[0] == 0
    assert case.inputs[1].tensors["mixed_qkv"].shape == (5, 2 * 2 * 16 + 4 * 16)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                                  ForwardMode.TARGET_VERIFY])
@given(data=st.data())
def test_paged_write_slots_sit_at_their_columns_page_offsets(mode, data):
    # As SGLang's paged allocator places tokens (mem_cache/allocator/paged.py): the adapter's handover check asks it
    # of every batch, and tree_branch writes a path's tokens at its verify row's columns, which it asks of a tree
    spec = data.draw(batch_specs(CI, mode, frozenset({"mha"}), page_sizes=(4, 16), tree=mode.is_target_verify()))
    fb = materialize(spec, "cpu").forward_batch
    P, new = spec.page_size, spec.extend_lens
    for i, (prefix, row) in enumerate(zip(spec.prefix_lens, fb.req_pool_indices.tolist())):
        width = spec.spec.draft_token_num if mode.is_target_verify() else new[i]
        cols = fb.req_to_token[row, prefix:prefix + width].tolist()
        assert all(s % P == (prefix + j) % P for j, s in enumerate(cols)), (i, prefix, cols)
    if not mode.is_target_verify():  # tokens at their positions' offsets
        assert all(s % P == p % P for s, p in zip(fb.out_cache_loc.tolist(), fb.positions.tolist()))
