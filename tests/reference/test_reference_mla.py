"""MLA: the absorbed and the expanded form compute the same function, and each piece follows its formula."""

from __future__ import annotations

import pytest
import torch

from reference.mla import absorb_query, attention_absorbed, attention_expanded, expand_kv

F64 = torch.float64
H, N, R, C, V = 4, 16, 8, 32, 12


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def mla_inputs(lq: int, lk: int) -> tuple[torch.Tensor, ...]:
    return (rand(lq, H, N, seed=1), rand(lq, H, R, seed=2), rand(lk, C, seed=3), rand(lk, R, seed=4),
            rand(H, N, C, seed=5) / C**0.5, rand(H, C, V, seed=6) / C**0.5)


@pytest.mark.parametrize("lq, lk, causal, masked", [
    (5, 9, True, False),  # chunked prefill
    (1, 9, True, False),  # decode
    (6, 6, True, False),  # prefill, no prefix
    (5, 9, False, False),
    (5, 9, False, True),  # tree verification: full custom mask
    (5, 9, True, True),
])
def test_absorbed_equals_expanded(lq, lk, causal, masked):
    args = mla_inputs(lq, lk)
    mask = ((rand(lq, lk, seed=7) > 0) | (torch.arange(lk) == 0)) if masked else None
    absorbed = attention_absorbed(*args, sm_scale=(N + R) ** -0.5, causal=causal, mask=mask)
    expanded = attention_expanded(*args, sm_scale=(N + R) ** -0.5, causal=causal, mask=mask)
    assert absorbed.shape == (lq, H, V) and absorbed.dtype == F64
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)


def test_absorb_query_and_expand_kv_follow_their_formulas():
    q_nope, _, ckv, kpe, w_kc, w_vc = mla_inputs(3, 4)
    q_latent = absorb_query(q_nope, w_kc)
    k, v = expand_kv(ckv, kpe, w_kc, w_vc)
    assert q_latent.shape == (3, H, C) and k.shape == (4, H, N + R) and v.shape == (4, H, V)
    for h in range(H):
        torch.testing.assert_close(q_latent[:, h], q_nope[:, h] @ w_kc[h], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(k[:, h, :N], ckv @ w_kc[h].T, rtol=1e-13, atol=1e-13)
        assert torch.equal(k[:, h, N:], kpe)
        torch.testing.assert_close(v[:, h], ckv @ w_vc[h], rtol=1e-13, atol=1e-13)


def test_absorbed_equals_explicit_per_head_formula():
    q_nope, q_pe, ckv, kpe, w_kc, w_vc = mla_inputs(2, 5)
    out = attention_absorbed(q_nope, q_pe, ckv, kpe, w_kc, w_vc, sm_scale=0.2, causal=False)
    for h in range(H):
        scores = ((q_nope[:, h] @ w_kc[h]) @ ckv.T + q_pe[:, h] @ kpe.T) * 0.2
        expected = torch.softmax(scores, -1) @ ckv @ w_vc[h]
        torch.testing.assert_close(out[:, h], expected, rtol=1e-12, atol=1e-12)

