"""Kimi Delta Attention: the recurrence against its chunked form, a hand-worked token, the gated delta rule as the
special case of a gate the same on every channel, the two gates, state passing across a split request, the layer."""

from __future__ import annotations

import math

import pytest
import torch

from reference import gdn
from reference import kda as kd

F64 = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def inputs(T: int, H: int = 2, K: int = 4, V: int = 3, seed: int = 0):
    q, k = gdn.l2norm(rand(T, H, K, seed=seed)), gdn.l2norm(rand(T, H, K, seed=seed + 1))
    v = rand(T, H, V, seed=seed + 2)
    g = -torch.rand(T, H, K, generator=torch.Generator().manual_seed(seed + 3), dtype=F64) * 2  # decays to e^-2
    beta = torch.sigmoid(rand(T, H, seed=seed + 4))
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [0, 1, 5, 16, 17, 40])
@pytest.mark.parametrize("chunk", [1, 4, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_form_equals_the_recurrence(T, chunk, with_state):
    q, k, v, g, beta = inputs(T)
    state = rand(2, 4, 3, seed=9) if with_state else None
    o, final = kd.kda(q, k, v, g, beta, scale=0.5, initial_state=state)
    o_c, final_c = kd.kda_chunked(q, k, v, g, beta, scale=0.5, initial_state=state, chunk_size=chunk)
    torch.testing.assert_close(o_c, o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final_c, final, rtol=1e-10, atol=1e-10)


def test_one_token_by_hand():
    # H = 1, K = 2, V = 1: S0 = [[2], [4]], g = (log 1/2, 0): S = [[1], [4]]; k = (1, 0) reads 1;
    # u = beta (v - 1) = 0.5 (3 - 1) = 1; S = [[2], [4]]; q = (0, 1) reads 4; o = scale * 4.
    q = torch.tensor([[[0.0, 1.0]]], dtype=F64)
    k = torch.tensor([[[1.0, 0.0]]], dtype=F64)
    v = torch.tensor([[[3.0]]], dtype=F64)
    g = torch.tensor([[[math.log(0.5), 0.0]]], dtype=F64)
    beta = torch.tensor([[0.5]], dtype=F64)
    o, final = kd.kda(q, k, v, g, beta, scale=0.25, initial_state=torch.tensor([[[2.0], [4.0]]], dtype=F64))
    assert o.item() == pytest.approx(1.0)
    assert final.flatten().tolist() == pytest.approx([2.0, 4.0])


def test_a_gate_the_same_on_every_channel_is_the_gated_delta_rule():
    q, k, v, g, beta = inputs(9)
    per_head = g[..., 0]
    state = rand(2, 4, 3, seed=5)
    o, final = kd.kda(q, k, v, per_head[..., None].expand_as(g), beta, scale=0.5, initial_state=state)
    o_gdn, final_gdn = gdn.gated_delta_rule(q, k, v, per_head, beta, scale=0.5, initial_state=state)
    torch.testing.assert_close(o, o_gdn, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_gdn, rtol=1e-12, atol=1e-12)


def test_the_gates():
    a, A_log, dt_bias = rand(3, 2, 4, seed=1), rand(2, seed=2), rand(2, 4, seed=3)
    x, A = a + dt_bias, A_log.exp()[:, None]
    torch.testing.assert_close(kd.kda_gate(a, A_log, dt_bias), -A * torch.log1p(torch.exp(x)))
    safe = kd.kda_gate(a, A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(safe, -5.0 / (1 + torch.exp(-A * x)))
    assert (safe >= -5.0).all() and (safe <= 0).all()


def layer(T: int, seed: int, **kw):
    H, K, V, W = 2, 4, 3, 4
    C = 2 * H * K + H * V
    args = dict(conv_weight=rand(C, W, seed=seed + 1), A_log=rand(H, seed=seed + 2) * 0.3,
                dt_bias=rand(H * K, seed=seed + 3), num_heads=H, head_k_dim=K, head_v_dim=V)
    args.update(kw)
    return rand(T, C, seed=seed), rand(T, H * K, seed=seed + 4), rand(T, H, seed=seed + 5), args


@pytest.mark.parametrize("cut", [0, 1, 3, 7])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_a_request_split_anywhere_carries_its_states(cut, lower_bound):
    """Prefill in two chunks (a cached prefix, then the rest) equals one pass: conv and SSM states are the carry."""
    x, a, b, args = layer(7, seed=10, lower_bound=lower_bound)
    whole = kd.kda_layer(x, a, b, keep_states=True, **args)
    first = kd.kda_layer(x[:cut], a[:cut], b[:cut], **args)
    second = kd.kda_layer(x[cut:], a[cut:], b[cut:], conv_state=first.conv_state, ssm_state=first.ssm_state,
                          keep_states=True, **args)
    torch.testing.assert_close(torch.cat([first.o, second.o]), whole.o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second.ssm_state, whole.ssm_state, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second.conv_state, whole.conv_state)
    torch.testing.assert_close(second.ssm_states, whole.ssm_states[cut:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole.ssm_states[-1], whole.ssm_state)
    torch.testing.assert_close(whole.conv_states[-1], whole.conv_state)


def test_the_layer_is_conv_norm_gates_and_recurrence():
    """The layer composed by hand from the conv, the norms, the gate and the recurrence (a second reading of its
    channel layout: q heads, k heads, v heads; a's channels heads first)."""
    x, a, b, args = layer(5, seed=20)
    H, K, V = 2, 4, 3
    conv_state, ssm_state = rand(2 * H * K + H * V, 3, seed=30), rand(H, K, V, seed=31)
    res = kd.kda_layer(x, a, b, conv_state=conv_state, ssm_state=ssm_state, **args)
    y, _ = gdn.causal_conv1d(x, args["conv_weight"], conv_state)
    q = gdn.l2norm(y[:, :H * K].reshape(5, H, K))
    k = gdn.l2norm(y[:, H * K:2 * H * K].reshape(5, H, K))
    v = y[:, 2 * H * K:].reshape(5, H, V)
    g = -args["A_log"].exp()[None, :, None] * torch.nn.functional.softplus(a + args["dt_bias"]).reshape(5, H, K)
    o, final = kd.kda_chunked(q, k, v, g, torch.sigmoid(b), scale=K**-0.5, initial_state=ssm_state, chunk_size=2)
    torch.testing.assert_close(res.o, o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.ssm_state, final, rtol=1e-10, atol=1e-10)
    # The read's terms scale * q_t[k] * S_t[k, v], summed over k: their RSS, from the states after each token
    states = kd.kda_layer(x, a, b, conv_state=conv_state, ssm_state=ssm_state, keep_states=True, **args).ssm_states
    terms = K**-0.5 * q[..., None] * states  # (T, H, K, V)
    torch.testing.assert_close(res.read_magnitudes, terms.pow(2).sum(2).sqrt(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.o, terms.sum(2), rtol=1e-10, atol=1e-10)
