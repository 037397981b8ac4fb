"""``decode_attention_fwd`` against the dense float64 oracle: kv lengths from 1 to a few hundred, split-KV
merging, GQA groups smaller and larger than one program's head block, windows, the logit cap, empty
requests, and its input checks."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_cases import DecodeCase, assert_matches, dense_decode, make_decode_inputs, value_bound

from backends.triton_kernels.decode_attention import decode_attention_fwd

HEAD_DIMS = [(64, 64), (96, 80)]
DTYPES = [torch.float32, torch.bfloat16]
# One key, block edges (16, 64), a split boundary, and a few hundred keys.
KV_LENS = (1, 2, 15, 16, 17, 64, 65, 130, 257)


def run_decode(t, **kwargs):
    decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], t["o"], t["kv_indptr"], t["kv_indices"], **kwargs)
    return t["o"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_kv_lengths(dtype, dims):
    case = DecodeCase(kv_lens=KV_LENS, head_dim=dims[0], v_head_dim=dims[1], dtype=dtype, seed=1)
    t = make_decode_inputs(case)
    sm_scale = dims[0] ** -0.5
    out = run_decode(t, sm_scale=sm_scale)
    assert_matches(out, dense_decode(case, t, sm_scale=sm_scale), dtype, value_bound(t))


def test_float16():
    case = DecodeCase(kv_lens=(1, 17, 90), head_dim=96, v_head_dim=80, dtype=torch.float16, seed=8)
    t = make_decode_inputs(case)
    out = run_decode(t, sm_scale=96 ** -0.5)
    assert_matches(out, dense_decode(case, t, sm_scale=96 ** -0.5), torch.float16, value_bound(t))


@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_num_kv_splits(num_kv_splits):
    # 3 is not a power of two; with 8 splits of short requests most splits are empty and must weigh 0.
    case = DecodeCase(kv_lens=(3, 40, 100), num_qo_heads=4, seed=2)
    t = make_decode_inputs(case)
    out = run_decode(t, sm_scale=0.125, num_kv_splits=num_kv_splits)
    assert_matches(out, dense_decode(case, t, sm_scale=0.125), torch.float32, value_bound(t))


@pytest.mark.parametrize("heads", [(32, 1), (4, 4)], ids=["group32", "mha"])
def test_head_groups(heads):
    # A group of 32 query heads spans two 16-head programs; MHA uses one row of each program.
    case = DecodeCase(kv_lens=(5, 37), num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=32, v_head_dim=32,
                      seed=3)
    t = make_decode_inputs(case)
    out = run_decode(t, sm_scale=32 ** -0.5)
    assert_matches(out, dense_decode(case, t, sm_scale=32 ** -0.5), torch.float32, value_bound(t))


@pytest.mark.parametrize("window", [0, 7, 50])
def test_sliding_window(window):
    case = DecodeCase(kv_lens=(1, 8, 51, 130), num_qo_heads=4, seed=4)
    t = make_decode_inputs(case)
    out = run_decode(t, sm_scale=0.125, sliding_window=window)
    ref = dense_decode(case, t, sm_scale=0.125, sliding_window=window)
    assert_matches(out, ref, torch.float32, value_bound(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logit_cap(dtype):
    case = DecodeCase(kv_lens=(9, 77), num_qo_heads=4, dtype=dtype, seed=5, q_scale=4.0)
    t = make_decode_inputs(case)
    out = run_decode(t, sm_scale=0.125, logit_cap=4.0)
    ref = dense_decode(case, t, sm_scale=0.125, logit_cap=4.0)
    assert_matches(out, ref, dtype, value_bound(t))
    assert (dense_decode(case, t, sm_scale=0.125) - ref).abs().max() > 0.1, "the cap must matter here"


def test_empty_requests_output_zeros():
    case = DecodeCase(kv_lens=(0, 5, 0, 33), num_qo_heads=4, seed=6)
    t = make_decode_inputs(case)
    out = run_decode(t, sm_scale=0.125)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert_matches(out, dense_decode(case, t, sm_scale=0.125), torch.float32, value_bound(t))


def test_int32_indices():
    case = DecodeCase(kv_lens=(20, 3), num_qo_heads=4, seed=7)
    t = make_decode_inputs(case)
    out = run_decode(dict(t, kv_indices=t["kv_indices"].int()), sm_scale=0.125)
    assert_matches(out, dense_decode(case, t, sm_scale=0.125), torch.float32, value_bound(t))


def test_input_checks():
    t = make_decode_inputs(DecodeCase(kv_lens=(3, 4)))
    with pytest.raises(ValueError, match="o has shape"):
        decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], t["o"][:1], t["kv_indptr"], t["kv_indices"],
                             sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_indptr must have batch_size"):
        decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], t["o"], t["kv_indptr"][:2], t["kv_indices"],
                             sm_scale=1.0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], t["o"], t["kv_indptr"], t["kv_indices"],
                             sm_scale=1.0, num_kv_splits=0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention_fwd(t["q"][..., :32], t["k_buffer"], t["v_buffer"], t["o"], t["kv_indptr"],
                             t["kv_indices"], sm_scale=1.0)
