"""``extend_attention_fwd`` against the dense float64 oracle: ragged batches, GQA, padded head dims, custom
tree masks, sliding windows, the logit cap, strided inputs, and its input checks."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_cases import (
    DEVICE,
    ExtendCase,
    assert_matches,
    dense_extend,
    make_extend_inputs,
    tree_mask,
    value_bound,
)

from backends.triton_kernels.extend_attention import extend_attention_fwd

# (head_dim, v_head_dim): a power of two, and a padded non-power-of-two with v_head_dim != head_dim.
HEAD_DIMS = [(64, 64), (80, 48)]
DTYPES = [torch.float32, torch.bfloat16]


def run_extend(t, *, custom_mask=None, mask_indptr=None, **kwargs):
    extend_attention_fwd(t["q"], t["k"], t["v"], t["o"], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                         t["kv_indptr"], t["kv_indices"], custom_mask, mask_indptr, **kwargs)
    return t["o"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_ragged_batch(dtype, dims):
    # Zero-length prefix, a 1-token extend, prefixes either side of the 16- and 64-key block edges, and an
    # extend spanning three 16-row query blocks.
    case = ExtendCase(prefix_lens=(0, 15, 17, 63, 65), extend_lens=(9, 1, 33, 16, 4), head_dim=dims[0],
                      v_head_dim=dims[1], dtype=dtype, seed=1)
    t = make_extend_inputs(case)
    sm_scale = dims[0] ** -0.5
    out = run_extend(t, sm_scale=sm_scale)
    assert_matches(out, dense_extend(case, t, sm_scale=sm_scale), dtype, value_bound(t))


def test_float16():
    case = ExtendCase(prefix_lens=(0, 40), extend_lens=(18, 3), head_dim=96, v_head_dim=64, dtype=torch.float16,
                      seed=13)
    t = make_extend_inputs(case)
    out = run_extend(t, sm_scale=96 ** -0.5)
    assert_matches(out, dense_extend(case, t, sm_scale=96 ** -0.5), torch.float16, value_bound(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_custom_tree_mask(dtype):
    # Target verification: each draft token sees (some of) the prefix, itself and its tree ancestors. The
    # prefix columns are thinned so that reading them matters; one row sees a later draft token (the mask
    # replaces the causal rule, it is not ANDed with it); one row sees nothing and must output zeros.
    case = ExtendCase(prefix_lens=(0, 20, 66), extend_lens=(5, 1, 18), head_dim=96, v_head_dim=64, dtype=dtype,
                      seed=2)
    t = make_extend_inputs(case)
    gen = torch.Generator().manual_seed(3)
    blocks = [tree_mask(gen, p, e, prefix_keep=0.7) for p, e in zip(case.prefix_lens, case.extend_lens)]
    blocks[2][4, 66 + 9] = True  # row 4 sees draft token 9
    blocks[0][3, :] = False
    custom_mask = torch.cat([b.flatten() for b in blocks]).to(DEVICE)
    mask_indptr = torch.tensor([0] + [b.numel() for b in blocks]).cumsum(0).to(DEVICE)
    sm_scale = 96 ** -0.5
    # causal=True on purpose: with a custom mask it must be ignored.
    out = run_extend(t, custom_mask=custom_mask, mask_indptr=mask_indptr, sm_scale=sm_scale, causal=True)
    ref = dense_extend(case, t, sm_scale=sm_scale, custom_mask=custom_mask.cpu(), mask_indptr=mask_indptr.cpu())
    assert_matches(out, ref, dtype, value_bound(t))
    assert (out[3] == 0).all(), "a row that sees no key must output zeros"


def test_custom_mask_uint8_equals_bool():
    case = ExtendCase(prefix_lens=(7, 30), extend_lens=(6, 4), num_qo_heads=4, seed=4)
    gen = torch.Generator().manual_seed(5)
    blocks = [tree_mask(gen, p, e, prefix_keep=0.5) for p, e in zip(case.prefix_lens, case.extend_lens)]
    mask = torch.cat([b.flatten() for b in blocks]).to(DEVICE)
    mask_indptr = torch.tensor([0] + [b.numel() for b in blocks], dtype=torch.int32).cumsum(0).int().to(DEVICE)
    t_bool, t_u8 = make_extend_inputs(case), make_extend_inputs(case)
    out_bool = run_extend(t_bool, custom_mask=mask, mask_indptr=mask_indptr, sm_scale=0.125)
    out_u8 = run_extend(t_u8, custom_mask=mask.to(torch.uint8), mask_indptr=mask_indptr, sm_scale=0.125)
    assert torch.equal(out_bool, out_u8)


@pytest.mark.parametrize("window", [0, 5, 24])
def test_sliding_window(window):
    # Windows shorter than the prefix, reaching into it, and a window of 0 (each token sees only itself).
    case = ExtendCase(prefix_lens=(0, 17, 70), extend_lens=(20, 3, 18), num_qo_heads=4, seed=6)
    t = make_extend_inputs(case)
    out = run_extend(t, sm_scale=0.125, sliding_window=window)
    ref = dense_extend(case, t, sm_scale=0.125, sliding_window=window)
    assert_matches(out, ref, torch.float32, value_bound(t))


def test_sliding_window_with_custom_mask():
    # Under a tree mask the window reads the tokens' positions (prefix + depth), not their rows: a row-based
    # window would cut siblings' keys that their depth keeps.
    case = ExtendCase(prefix_lens=(12, 40), extend_lens=(6, 7), num_qo_heads=4, dtype=torch.bfloat16, seed=7)
    t = make_extend_inputs(case)
    gen = torch.Generator().manual_seed(8)
    trees = [tree_mask(gen, p, e, with_depths=True) for p, e in zip(case.prefix_lens, case.extend_lens)]
    mask = torch.cat([m.flatten() for m, _ in trees]).to(DEVICE)
    mask_indptr = torch.tensor([0] + [m.numel() for m, _ in trees]).cumsum(0).to(DEVICE)
    positions = torch.cat([p + d for p, (_, d) in zip(case.prefix_lens, trees)]).to(DEVICE)
    assert any(int(d[j]) < j for _, d in trees for j in range(len(d)))  # some rows are not their depth
    out = run_extend(t, custom_mask=mask, mask_indptr=mask_indptr, sm_scale=0.125, sliding_window=9,
                     positions=positions)
    ref = dense_extend(case, t, sm_scale=0.125, custom_mask=mask.cpu(), mask_indptr=mask_indptr.cpu(),
                       sliding_window=9, positions=positions.cpu())
    assert_matches(out, ref, torch.bfloat16, value_bound(t))
    by_row = dense_extend(case, t, sm_scale=0.125, custom_mask=mask.cpu(), mask_indptr=mask_indptr.cpu(),
                          sliding_window=9)
    assert (by_row - ref).abs().max() > 0.05, "the window must cut differently by rows, or this proves nothing"
    with pytest.raises(ValueError, match="needs positions"):
        run_extend(t, custom_mask=mask, mask_indptr=mask_indptr, sm_scale=0.125, sliding_window=9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logit_cap(dtype):
    # q is scaled up so that raw scores reach ~+-15 and the cap of 4 changes the result a lot.
    case = ExtendCase(prefix_lens=(0, 33), extend_lens=(17, 5), num_qo_heads=4, dtype=dtype, seed=9,
                      q_scale=4.0)
    t = make_extend_inputs(case)
    out = run_extend(t, sm_scale=0.125, logit_cap=4.0)
    ref = dense_extend(case, t, sm_scale=0.125, logit_cap=4.0)
    assert_matches(out, ref, dtype, value_bound(t))
    uncapped = dense_extend(case, t, sm_scale=0.125)
    assert (uncapped - ref).abs().max() > 0.1, "the cap must matter in this case, or the test proves nothing"


def test_non_causal():
    case = ExtendCase(prefix_lens=(5, 0), extend_lens=(19, 6), num_qo_heads=4, head_dim=80, v_head_dim=80, seed=10)
    t = make_extend_inputs(case)
    out = run_extend(t, sm_scale=80 ** -0.5, causal=False)
    assert_matches(out, dense_extend(case, t, sm_scale=80 ** -0.5, causal=False), torch.float32, value_bound(t))


def test_strided_inputs_and_index_dtypes():
    # q/k/v as views of one packed qkv projection (token stride != heads * dim), int64 qo_indptr, int32
    # kv_indices, and empty requests (no new tokens) in the middle of the batch.
    case = ExtendCase(prefix_lens=(3, 9, 0, 20), extend_lens=(4, 0, 7, 0), num_qo_heads=4, num_kv_heads=4,
                      head_dim=32, v_head_dim=32, seed=11)
    t = make_extend_inputs(case)
    T = sum(case.extend_lens)
    qkv = torch.cat([t["q"].reshape(T, -1), t["k"].reshape(T, -1), t["v"].reshape(T, -1)], dim=1)
    t_strided = dict(t, q=qkv[:, :128].view(T, 4, 32), k=qkv[:, 128:256].view(T, 4, 32),
                     v=qkv[:, 256:].view(T, 4, 32), qo_indptr=t["qo_indptr"].long(),
                     kv_indices=t["kv_indices"].int())
    assert not t_strided["q"].is_contiguous()
    out = run_extend(t_strided, sm_scale=32 ** -0.5)
    assert_matches(out, dense_extend(case, t, sm_scale=32 ** -0.5), torch.float32, value_bound(t))


def test_no_tokens_is_a_no_op():
    case = ExtendCase(prefix_lens=(4, 2), extend_lens=(0, 0))
    t = make_extend_inputs(case)
    run_extend(t, sm_scale=0.125)
    assert t["o"].shape == (0, 8, 64)


def test_input_checks():
    case = ExtendCase(prefix_lens=(3,), extend_lens=(2,))
    t = make_extend_inputs(case)
    with pytest.raises(ValueError, match="o_extend has shape"):
        extend_attention_fwd(t["q"], t["k"], t["v"], t["o"][:, :4], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                             t["kv_indptr"], t["kv_indices"], None, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        extend_attention_fwd(t["q"][:, :3], t["k"], t["v"], t["o"][:, :3], t["k_buffer"], t["v_buffer"],
                             t["qo_indptr"], t["kv_indptr"], t["kv_indices"], None, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_indptr must have batch_size"):
        extend_attention_fwd(t["q"], t["k"], t["v"], t["o"], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                             t["kv_indptr"][:1], t["kv_indices"], None, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="needs mask_indptr"):
        extend_attention_fwd(t["q"], t["k"], t["v"], t["o"], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                             t["kv_indptr"], t["kv_indices"], torch.ones(10, dtype=torch.bool), None, sm_scale=1.0)
    with pytest.raises(ValueError, match="cast them to one dtype"):
        extend_attention_fwd(t["q"], t["k"].half(), t["v"], t["o"], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                             t["kv_indptr"], t["kv_indices"], None, None, sm_scale=1.0)
