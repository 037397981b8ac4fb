"""reference.mha.attention against PyTorch's SDPA, hand-worked numbers, GQA mapping, windows, caps, precision."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from reference.mha import attention

F64 = torch.float64
U32 = 2.0**-24  # float32 unit roundoff


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch's attention on our (L, H, D) layout; enable_gqa maps q head h to kv head h // group."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def end_aligned_causal(lq: int, lk: int) -> torch.Tensor:
    return torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]


@pytest.mark.parametrize("lq, lk, h, hk", [(5, 5, 4, 4), (3, 11, 8, 2), (1, 17, 4, 1), (7, 9, 6, 3)])
def test_causal_end_aligned_matches_sdpa(lq, lk, h, hk):
    q, k, v = rand(lq, h, 16, seed=1), rand(lk, hk, 16, seed=2), rand(lk, hk, 8, seed=3)
    expected = sdpa(q, k, v, end_aligned_causal(lq, lk), 0.25)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.25), expected, rtol=1e-12, atol=1e-12)


def test_full_and_custom_mask_match_sdpa():
    q, k, v = rand(4, 4, 8, seed=1), rand(6, 2, 8, seed=2), rand(6, 2, 5, seed=3)
    full = torch.ones(4, 6, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.3, causal=False), sdpa(q, k, v, full, 0.3),
                               rtol=1e-12, atol=1e-12)
    mask = rand(4, 6, seed=4) > 0
    mask[:, 0] = True  # every row sees something, so SDPA has no NaN row
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.3, causal=False, mask=mask), sdpa(q, k, v, mask, 0.3),
                               rtol=1e-12, atol=1e-12)


def test_mask_is_anded_with_causal():
    q, k, v = rand(3, 2, 8, seed=1), rand(5, 2, 8, seed=2), rand(5, 2, 8, seed=3)
    mask = torch.tensor([[1, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.bool)
    both = mask & end_aligned_causal(3, 5)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.3, mask=mask),
                               sdpa(q, k, v, both, 0.3), rtol=1e-12, atol=1e-12)


def test_decode_query_sees_every_key():
    q, k, v = rand(1, 4, 8, seed=1), rand(9, 2, 8, seed=2), rand(9, 2, 8, seed=3)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.3), attention(q, k, v, sm_scale=0.3, causal=False))


def test_hand_worked_case():
    # One query [1, 0] over keys [1, 0], [0, 1] with values 1, 3, scale 1: scores 1, 0, so weights
    # e/(e+1) and 1/(e+1), output (e + 3)/(e + 1).
    q = torch.tensor([[[1.0, 0.0]]], dtype=F64)
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=F64)
    v = torch.tensor([[[1.0]], [[3.0]]], dtype=F64)
    expected = (math.e + 3) / (math.e + 1)
    assert attention(q, k, v, sm_scale=1.0).item() == pytest.approx(expected, rel=1e-15)
    # Two queries over two keys, causal: the first sits at position 0 and sees only the value 1.
    out = attention(torch.cat([q, q]), k, v, sm_scale=1.0)
    assert out.flatten().tolist() == pytest.approx([1.0, expected], rel=1e-15)
    # sm_scale 2 doubles the score gap: weights e^2/(e^2+1), 1/(e^2+1).
    e2 = math.e**2
    assert attention(q, k, v, sm_scale=2.0).item() == pytest.approx((e2 + 3) / (e2 + 1), rel=1e-15)


def test_gqa_maps_head_h_to_kv_head_h_div_group():
    H, Hk = 4, 2
    q, k, v = rand(3, H, 8, seed=1), rand(3, Hk, 8, seed=2), rand(3, Hk, 8, seed=3)
    out = attention(q, k, v, sm_scale=0.3)
    for h in range(H):
        kv = slice(h // (H // Hk), h // (H // Hk) + 1)
        torch.testing.assert_close(out[:, h:h + 1], attention(q[:, h:h + 1], k[:, kv], v[:, kv], sm_scale=0.3))
    # Head 1 is where h // group (kv head 0) and h % Hk (kv head 1) part ways.
    wrong = attention(q[:, 1:2], k[:, 1:2], v[:, 1:2], sm_scale=0.3)
    assert (out[:, 1:2] - wrong).abs().max() > 1e-2


def test_heads_not_a_multiple_raise():
    with pytest.raises(ValueError, match="multiple"):
        attention(rand(2, 3, 4), rand(2, 2, 4), rand(2, 2, 4), sm_scale=1.0)


@pytest.mark.parametrize("lq, lk, window", [(4, 10, 3), (6, 6, 2), (1, 9, 4), (3, 8, 0)])
def test_sliding_window_equals_explicit_mask(lq, lk, window):
    q, k, v = rand(lq, 2, 8, seed=1), rand(lk, 2, 8, seed=2), rand(lk, 2, 8, seed=3)
    q_pos, k_pos = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
    mask = (k_pos <= q_pos) & (k_pos >= q_pos - window)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.3, sliding_window=window),
                               sdpa(q, k, v, mask, 0.3), rtol=1e-12, atol=1e-12)


def test_window_zero_returns_own_value_and_huge_window_is_no_window():
    q, k, v = rand(3, 1, 4, seed=1), rand(5, 1, 4, seed=2), rand(5, 1, 2, seed=3)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.5, sliding_window=0), v[2:])
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.5, sliding_window=100), attention(q, k, v, sm_scale=0.5))


def test_logit_cap_applies_tanh_after_scaling_and_before_masking():
    q, k, v = rand(2, 1, 4, seed=1) * 5, rand(3, 1, 4, seed=2) * 5, rand(3, 1, 2, seed=3)
    scores = 2.0 * torch.tanh(torch.einsum("qhd,khd->hqk", q, k) * 0.5 / 2.0)
    scores = scores.masked_fill(~end_aligned_causal(2, 3), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(attention(q, k, v, sm_scale=0.5, logit_cap=2.0), expected, rtol=1e-12, atol=1e-12)
    assert (attention(q, k, v, sm_scale=0.5) - expected).abs().max() > 1e-3


def test_row_with_no_visible_key_is_zero():
    q, k, v = rand(2, 1, 4), rand(3, 1, 4), rand(3, 1, 4)
    mask = torch.tensor([[False, False, False], [True, False, True]])
    out = attention(q, k, v, sm_scale=1.0, causal=False, mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], sdpa(q[1:], k, v, mask[1:], 1.0))


def test_float32_agrees_with_float64_within_its_precision():
    # Treating float32 rounding errors as independent (the usual probabilistic bound): a score q . k of
    # length D carries ~u*sqrt(D)*|q||k| absolute error, which becomes a relative error of that size in
    # each probability; the weighted sum over Lk values adds ~u*sqrt(Lk) relative. So the relative L2 error
    # is a few u * (sqrt(D) * sm_scale * max|q||k| + sqrt(Lk)); the factor 4 leaves room for the exp and
    # normalisation roundings.
    Lq, Lk, D, scale = 16, 200, 64, 0.125
    q, k, v = rand(Lq, 4, D, seed=1), rand(Lk, 2, D, seed=2), rand(Lk, 2, D, seed=3)
    exact = attention(q, k, v, sm_scale=scale)
    single = attention(q.float(), k.float(), v.float(), sm_scale=scale)
    assert single.dtype == torch.float32
    rel = ((single.double() - exact).norm() / exact.norm()).item()
    qk = (q.norm(dim=-1).max() * k.norm(dim=-1).max()).item()
    bound = 4 * U32 * (math.sqrt(D) * scale * qk + math.sqrt(Lk))
    assert rel < bound, f"float32 relative L2 error {rel:.2e} exceeds {bound:.2e}"
