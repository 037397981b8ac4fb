"""The kernel tests have teeth: a kernel with the wrong GQA mapping would fail them.

Instead of mutating the kernels, the oracle is given a wrong mapping (interleaved, ``h % Hk``, instead of
grouped, ``h // (Hq // Hk)``): the kernels' outputs must be far outside the tolerance of that wrong answer,
while inside the tolerance of the right one. So a kernel that mapped heads that way would fail the
tolerance the other tests use."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_cases import (
    DecodeCase,
    ExtendCase,
    assert_matches,
    dense_decode,
    dense_extend,
    make_decode_inputs,
    make_extend_inputs,
    value_bound,
)

from backends.triton_kernels.decode_attention import decode_attention_fwd
from backends.triton_kernels.extend_attention import extend_attention_fwd

WRONG_KV_HEAD = torch.arange(8) % 2  # interleaved: q head h -> kv head h % 2, not h // 4


def test_extend_wrong_gqa_mapping_is_caught():
    case = ExtendCase(prefix_lens=(0, 20), extend_lens=(6, 9), seed=12)
    t = make_extend_inputs(case)
    extend_attention_fwd(t["q"], t["k"], t["v"], t["o"], t["k_buffer"], t["v_buffer"], t["qo_indptr"],
                         t["kv_indptr"], t["kv_indices"], None, None, sm_scale=0.125)
    vmax = value_bound(t)
    assert_matches(t["o"], dense_extend(case, t, sm_scale=0.125), torch.float32, vmax)
    with pytest.raises(AssertionError, match="max \\|out - ref\\|"):
        assert_matches(t["o"], dense_extend(case, t, sm_scale=0.125, kv_head=WRONG_KV_HEAD), torch.float32, vmax)
    wrong = dense_extend(case, t, sm_scale=0.125, kv_head=WRONG_KV_HEAD)
    assert (t["o"].double().cpu() - wrong).abs().max() > 0.3, "the wrong mapping must be far off, not marginal"


def test_decode_wrong_gqa_mapping_is_caught():
    case = DecodeCase(kv_lens=(1, 30, 70), seed=13)
    t = make_decode_inputs(case)
    decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], t["o"], t["kv_indptr"], t["kv_indices"],
                         sm_scale=0.125)
    vmax = value_bound(t)
    assert_matches(t["o"], dense_decode(case, t, sm_scale=0.125), torch.float32, vmax)
    wrong = dense_decode(case, t, sm_scale=0.125, kv_head=WRONG_KV_HEAD)
    with pytest.raises(AssertionError, match="max \\|out - ref\\|"):
        assert_matches(t["o"], wrong, torch.float32, vmax)
    assert (t["o"].double().cpu() - wrong).abs().max() > 0.3
