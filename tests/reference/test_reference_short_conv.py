"""Gated short convolution: the window form against the tap-by-tap form, a hand-worked token, state passing across
a split request, the per-token states, the magnitudes."""

from __future__ import annotations

import pytest
import torch

from reference import short_conv as sc

F64 = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("T", [0, 1, 2, 9])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_window_form_equals_the_tap_form(T, W, with_state, with_bias):
    D = 5
    bcx, weight = rand(T, 3 * D, seed=1), rand(D, W, seed=2)
    bias = rand(D, seed=3) if with_bias else None
    state = rand(D, W - 1, seed=4) if with_state else None
    got = sc.short_conv(bcx, weight, bias, state).o
    assert got.shape == (T, D)
    torch.testing.assert_close(got, sc.short_conv_by_taps(bcx, weight, bias, state), rtol=1e-12, atol=1e-12)


def test_one_token_by_hand():
    # D = 1, W = 3: the window is (s0, s1, u) with u = B x = 2 * 3; y = w0 s0 + w1 s1 + w2 u + bias; o = C y.
    bcx = torch.tensor([[2.0, 5.0, 3.0]], dtype=F64)
    weight, bias = torch.tensor([[1.0, 10.0, 100.0]], dtype=F64), torch.tensor([0.5], dtype=F64)
    state = torch.tensor([[7.0, 11.0]], dtype=F64)
    res = sc.short_conv(bcx, weight, bias, state, keep_states=True)
    assert res.o.item() == pytest.approx(5.0 * (7.0 + 110.0 + 600.0 + 0.5))
    assert res.state.tolist() == [[11.0, 6.0]]  # the oldest input leaves, u enters last
    assert res.states.shape == (1, 1, 2) and res.states[0].tolist() == [[11.0, 6.0]]
    terms = torch.tensor([7.0, 110.0, 600.0, 0.5], dtype=F64)
    assert res.magnitudes.item() == pytest.approx(5.0 * terms.norm().item())


def test_a_fresh_request_starts_from_zeros():
    D, W = 4, 3
    bcx, weight = rand(6, 3 * D, seed=5), rand(D, W, seed=6)
    torch.testing.assert_close(sc.short_conv(bcx, weight).o,
                               sc.short_conv(bcx, weight, conv_state=torch.zeros(D, W - 1, dtype=F64)).o)


@pytest.mark.parametrize("cut", [0, 1, 2, 5, 8])
def test_a_request_split_anywhere_carries_its_state(cut):
    """Prefill in two chunks (a cached prefix, then the rest) equals one pass: the state is the whole carry."""
    D, W = 6, 4
    bcx, weight, bias = rand(8, 3 * D, seed=7), rand(D, W, seed=8), rand(D, seed=9)
    whole = sc.short_conv(bcx, weight, bias, keep_states=True)
    first = sc.short_conv(bcx[:cut], weight, bias)
    second = sc.short_conv(bcx[cut:], weight, bias, conv_state=first.state, keep_states=True)
    torch.testing.assert_close(torch.cat([first.o, second.o]), whole.o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second.state, whole.state)
    torch.testing.assert_close(second.states, whole.states[cut:])


def test_each_tokens_state_is_the_state_a_one_token_step_leaves():
    D, W = 3, 3
    bcx, weight, state = rand(5, 3 * D, seed=10), rand(D, W, seed=11), rand(D, W - 1, seed=12)
    res = sc.short_conv(bcx, weight, conv_state=state, keep_states=True)
    carry = state
    for t in range(5):
        carry = sc.short_conv(bcx[t:t + 1], weight, conv_state=carry).state
        torch.testing.assert_close(res.states[t], carry)
    torch.testing.assert_close(res.state, carry)


def test_bcx_must_split_in_three():
    with pytest.raises(ValueError, match="B, C and x"):
        sc.short_conv(rand(2, 7), rand(2, 3))
