"""The gated delta rule: recurrent == chunked, hand-worked steps, head mapping, state passing, conv1d, the layer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from reference import gdn

F64 = torch.float64
U32 = 2.0**-24  # float32 unit roundoff
H, HV, K, V = 2, 4, 8, 6  # grouped value heads: HV = 2H


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def uniform(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rule_inputs(T: int, seed: int = 0, max_decay: float = 0.5) -> tuple[torch.Tensor, ...]:
    """q, k (T, H, K) with unit keys (as the layer makes them), v (T, HV, V), g in [-max_decay, 0], beta in [0, 1)."""
    return (rand(T, H, K, seed=seed), gdn.l2norm(rand(T, H, K, seed=seed + 1)), rand(T, HV, V, seed=seed + 2),
            -max_decay * uniform(T, HV, seed=seed + 3), uniform(T, HV, seed=seed + 4))


def tensors(*values, shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.tensor(x, dtype=F64).reshape(shape) for x in values]


# ---- the recurrence ----

@pytest.mark.parametrize("T", [0, 1, 5, 64, 65, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_equals_chunked(T, chunk_size, with_state):
    q, k, v, g, beta = rule_inputs(T)
    s0 = rand(HV, K, V, seed=9) if with_state else None
    o1, s1 = gdn.gated_delta_rule(q, k, v, g, beta, scale=K**-0.5, initial_state=s0)
    o2, s2 = gdn.gated_delta_rule_chunked(q, k, v, g, beta, scale=K**-0.5, initial_state=s0, chunk_size=chunk_size)
    assert o2.shape == (T, HV, V) and s2.shape == (HV, K, V)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=1e-12, atol=1e-12)


def test_recurrent_equals_chunked_under_strong_decay():
    # Decays down to exp(-8) per token: exp(G_i - G_j) spans hundreds of orders of magnitude in a chunk.
    q, k, v, g, beta = rule_inputs(40, seed=3, max_decay=8.0)
    s0 = rand(HV, K, V, seed=9)
    o1, s1 = gdn.gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=s0)
    o2, s2 = gdn.gated_delta_rule_chunked(q, k, v, g, beta, scale=0.3, initial_state=s0, chunk_size=16)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", [gdn.gated_delta_rule, gdn.gated_delta_rule_chunked])
def test_empty_sequence_returns_empty_output_and_the_initial_state(form):
    q, k, v, g, beta = rule_inputs(0)
    s0 = rand(HV, K, V, seed=9)
    o, s = form(q, k, v, g, beta, scale=0.5, initial_state=s0)
    assert o.shape == (0, HV, V) and torch.equal(s, s0) and s is not s0
    _, s = form(q, k, v, g, beta, scale=0.5)
    assert torch.equal(s, torch.zeros(HV, K, V, dtype=F64))
    _, states = gdn.gated_delta_rule_states(q, k, v, g, beta, scale=0.5, initial_state=s0)
    assert states.shape == (0, HV, K, V)


def test_hand_worked_scalar_case():
    # K = V = 1, one head, scale 2. Token 1: S = 0 + 1 * 0.5 * (2 - 0) = 1, o = 2 * 1 = 2.
    # Token 2: decay by exp(ln 0.5): S = 0.5; predicted 0.5; S = 0.5 + 1 * 1 * (4 - 0.5) = 4, o = 8.
    q, k, v = tensors([1.0, 1.0], [1.0, 1.0], [2.0, 4.0], shape=(2, 1, 1))
    g, beta = tensors([0.0, math.log(0.5)], [0.5, 1.0], shape=(2, 1))
    for form in (gdn.gated_delta_rule, gdn.gated_delta_rule_chunked):
        o, s = form(q, k, v, g, beta, scale=2.0)
        assert o.flatten().tolist() == pytest.approx([2.0, 8.0], rel=1e-14)
        assert s.item() == pytest.approx(4.0, rel=1e-14)


def test_hand_worked_delta_rule_memory():
    # K = 2, V = 1, keys e1, e2, e1 with values 1, 2, 5, beta 1, query (1, 1), scale 1.
    # Orthogonal keys store separately: S = [1, 0] then [1, 2] (o = 1, 3). Token 3 decays by 1/2 first
    # (S = [0.5, 1]) and then the delta rule replaces e1's recall 0.5 by 5: S = [5, 1], o = 6.
    q = torch.ones(3, 1, 2, dtype=F64)
    (k,) = tensors([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], shape=(3, 1, 2))
    v, g, beta = tensors([1.0, 2.0, 5.0], [0.0, 0.0, math.log(0.5)], [1.0, 1.0, 1.0], shape=(3, 1))
    for form in (gdn.gated_delta_rule, gdn.gated_delta_rule_chunked):
        o, s = form(q, k, v[..., None], g, beta, scale=1.0)
        assert o.flatten().tolist() == pytest.approx([1.0, 3.0, 6.0], rel=1e-14)
        assert s.flatten().tolist() == pytest.approx([5.0, 1.0], rel=1e-14)


def test_value_head_j_reads_qk_head_j_div_group():
    q, k, v, g, beta = rule_inputs(9)
    o, _ = gdn.gated_delta_rule(q, k, v, g, beta, scale=0.5)
    for j in range(HV):
        h, one = j // (HV // H), slice(j, j + 1)
        oj, _ = gdn.gated_delta_rule(q[:, h:h + 1], k[:, h:h + 1], v[:, one], g[:, one], beta[:, one], scale=0.5)
        torch.testing.assert_close(o[:, one], oj, rtol=1e-13, atol=1e-13)
    # Value head 1 is where j // group (head 0) and j % H (head 1) part ways.
    wrong, _ = gdn.gated_delta_rule(q[:, 1:2], k[:, 1:2], v[:, 1:2], g[:, 1:2], beta[:, 1:2], scale=0.5)
    assert (o[:, 1:2] - wrong).abs().max() > 1e-3
    with pytest.raises(ValueError, match="multiple"):
        gdn.gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], scale=0.5)


@pytest.mark.parametrize("form", [gdn.gated_delta_rule, gdn.gated_delta_rule_chunked])
def test_split_sequence_with_state_passing_equals_one_run(form):
    q, k, v, g, beta = rule_inputs(20)
    s0 = rand(HV, K, V, seed=9)
    o, s = gdn.gated_delta_rule(q, k, v, g, beta, scale=0.5, initial_state=s0)
    for cut in (0, 7, 16, 20):
        first, second = slice(0, cut), slice(cut, None)
        oa, sa = form(*(x[first] for x in (q, k, v, g, beta)), scale=0.5, initial_state=s0)
        ob, sb = form(*(x[second] for x in (q, k, v, g, beta)), scale=0.5, initial_state=sa)
        torch.testing.assert_close(torch.cat([oa, ob]), o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sb, s, rtol=1e-12, atol=1e-12)


def test_states_are_the_states_after_each_prefix():
    q, k, v, g, beta = rule_inputs(12)
    s0 = rand(HV, K, V, seed=9)
    o, states = gdn.gated_delta_rule_states(q, k, v, g, beta, scale=0.5, initial_state=s0)
    o_plain, final = gdn.gated_delta_rule(q, k, v, g, beta, scale=0.5, initial_state=s0)
    assert states.shape == (12, HV, K, V)
    torch.testing.assert_close(o, o_plain, rtol=0, atol=0)
    torch.testing.assert_close(states[-1], final, rtol=0, atol=0)
    for t in range(12):
        prefix = slice(0, t + 1)
        _, s = gdn.gated_delta_rule(*(x[prefix] for x in (q, k, v, g, beta)), scale=0.5, initial_state=s0)
        torch.testing.assert_close(states[t], s, rtol=0, atol=0)


def test_recurrence_float32_agrees_with_float64():
    # With unit keys and 0 <= beta <= 1 each step maps S to exp(g) (I - beta k k^T) S, which is
    # non-expansive, so an error made at one step is never amplified later: the float32 error is at most
    # the sum of each step's rounding, a few u*sqrt(K) relative per step (dot products of length K). Adding
    # T such errors as independent gives ~u*sqrt(K*T); the bound allows 8 times that.
    T = 130
    q, k, v, g, beta = rule_inputs(T)
    o64, s64 = gdn.gated_delta_rule(q, k, v, g, beta, scale=0.35)
    o32, s32 = gdn.gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(), scale=0.35)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    rel = ((o32.double() - o64).norm() / o64.norm()).item()
    bound = 8 * U32 * math.sqrt(K * T)
    assert rel < bound, f"float32 relative L2 error {rel:.2e} exceeds {bound:.2e}"


# ---- conv1d ----

def test_conv1d_equals_torch_conv1d_with_left_padding():
    T, C, W = 11, 5, 4
    x, w = rand(T, C, seed=1), rand(C, W, seed=2)
    expected = F.conv1d(F.pad(x.T[None], (W - 1, 0)), w[:, None, :], groups=C)[0].T
    y, state = gdn.causal_conv1d(x, w, None, activation=None)
    torch.testing.assert_close(y, expected, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gdn.causal_conv1d(x, w, None)[0], F.silu(expected), rtol=1e-13, atol=1e-13)
    assert torch.equal(state, x[-(W - 1):].T)
    # A state is the W - 1 inputs just before x, oldest first: the same as running over them.
    s0 = rand(C, W - 1, seed=3)
    y, _ = gdn.causal_conv1d(x, w, s0, activation=None)
    longer = F.conv1d(torch.cat([s0.T, x]).T[None], w[:, None, :], groups=C)[0].T
    torch.testing.assert_close(y, longer, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("cut", [0, 1, 2, 4, 11])
def test_conv1d_split_with_state_passing_equals_one_run(cut):
    x, w, s0 = rand(11, 5, seed=1), rand(5, 4, seed=2), rand(5, 3, seed=3)
    y, state = gdn.causal_conv1d(x, w, s0)
    ya, sa = gdn.causal_conv1d(x[:cut], w, s0)
    yb, sb = gdn.causal_conv1d(x[cut:], w, sa)
    torch.testing.assert_close(torch.cat([ya, yb]), y, rtol=0, atol=0)
    torch.testing.assert_close(sb, state, rtol=0, atol=0)


def test_conv1d_states_are_the_states_after_each_prefix():
    x, w, s0 = rand(7, 5, seed=1), rand(5, 4, seed=2), rand(5, 3, seed=3)
    y, states = gdn.causal_conv1d_states(x, w, s0)
    assert states.shape == (7, 5, 3)
    torch.testing.assert_close(y, gdn.causal_conv1d(x, w, s0)[0], rtol=0, atol=0)
    for t in range(7):
        torch.testing.assert_close(states[t], gdn.causal_conv1d(x[:t + 1], w, s0)[1], rtol=0, atol=0)
    y, state = gdn.causal_conv1d(x[:0], w, s0)
    assert y.shape == (0, 5) and torch.equal(state, s0)


# ---- gating, normalisation ----

def test_gating_hand_worked():
    # A_log = ln 2, a + dt_bias = 0: g = -2 * softplus(0) = -2 ln 2; b = 0: beta = 1/2.
    A_log, dt_bias = tensors([math.log(2.0)], [0.25], shape=(1,))
    a, b = tensors([[-0.25]], [[0.0]], shape=(1, 1))
    g, beta = gdn.gdn_gating(A_log, a, dt_bias, b)
    assert g.item() == pytest.approx(-2 * math.log(2.0), rel=1e-15)
    assert beta.item() == pytest.approx(0.5, rel=1e-15)


def test_l2norm_keeps_eps_inside_the_square_root():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=F64)
    out = gdn.l2norm(x)
    torch.testing.assert_close(out[0], x[0] / math.sqrt(25 + 1e-6), rtol=1e-15, atol=0)
    assert torch.equal(out[1], torch.zeros(2, dtype=F64))
    assert gdn.l2norm(x, eps=0.0)[0].tolist() == pytest.approx([0.6, 0.8], rel=1e-15)


# ---- the whole layer ----

W = 4
CONV_DIM = 2 * H * K + HV * V


def layer_inputs(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    params = dict(conv_weight=rand(CONV_DIM, W, seed=4) * 0.5, A_log=torch.log(uniform(HV, seed=5) + 0.1),
                  dt_bias=rand(HV, seed=6) * 0.1, num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
                  scale=K**-0.5)
    return rand(T, CONV_DIM, seed=1), rand(T, HV, seed=2), rand(T, HV, seed=3), params


def test_layer_is_conv_then_split_qkv_then_normalised_gated_delta_rule():
    x, a, b, p = layer_inputs(9)
    conv_state, ssm_state = rand(CONV_DIM, W - 1, seed=7), rand(HV, K, V, seed=8)
    out = gdn.linear_attention_layer(x, a, b, **p, conv_state=conv_state, ssm_state=ssm_state)
    y, expected_conv = gdn.causal_conv1d(x, p["conv_weight"], conv_state)
    q = gdn.l2norm(y[:, :H * K].reshape(9, H, K))
    k = gdn.l2norm(y[:, H * K:2 * H * K].reshape(9, H, K))
    v = y[:, 2 * H * K:].reshape(9, HV, V)
    g, beta = gdn.gdn_gating(p["A_log"], a, p["dt_bias"], b)
    o, expected_ssm = gdn.gated_delta_rule(q, k, v, g, beta, scale=K**-0.5, initial_state=ssm_state)
    torch.testing.assert_close(out.o, o, rtol=0, atol=0)
    torch.testing.assert_close(out.conv_state, expected_conv, rtol=0, atol=0)
    torch.testing.assert_close(out.ssm_state, expected_ssm, rtol=0, atol=0)
    assert out.conv_states is None and out.ssm_states is None


@pytest.mark.parametrize("cut", [0, 1, 5, 12])
def test_layer_split_with_state_passing_equals_one_run(cut):
    x, a, b, p = layer_inputs(12)
    whole = gdn.linear_attention_layer(x, a, b, **p, keep_states=True)
    first = gdn.linear_attention_layer(x[:cut], a[:cut], b[:cut], **p)
    second = gdn.linear_attention_layer(x[cut:], a[cut:], b[cut:], **p, conv_state=first.conv_state,
                                        ssm_state=first.ssm_state)
    torch.testing.assert_close(torch.cat([first.o, second.o]), whole.o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second.conv_state, whole.conv_state, rtol=0, atol=0)
    torch.testing.assert_close(second.ssm_state, whole.ssm_state, rtol=1e-12, atol=1e-12)
    if cut:
        torch.testing.assert_close(whole.conv_states[cut - 1], first.conv_state, rtol=0, atol=0)
        torch.testing.assert_close(whole.ssm_states[cut - 1], first.ssm_state, rtol=1e-12, atol=1e-12)


def test_layer_with_no_tokens_returns_the_given_states():
    x, a, b, p = layer_inputs(0)
    conv_state, ssm_state = rand(CONV_DIM, W - 1, seed=7), rand(HV, K, V, seed=8)
    out = gdn.linear_attention_layer(x, a, b, **p, conv_state=conv_state, ssm_state=ssm_state, keep_states=True)
    assert out.o.shape == (0, HV, V)
    assert torch.equal(out.conv_state, conv_state) and torch.equal(out.ssm_state, ssm_state)
    assert out.conv_states.shape == (0, CONV_DIM, W - 1) and out.ssm_states.shape == (0, HV, K, V)
    fresh = gdn.linear_attention_layer(x, a, b, **p)
    assert not fresh.conv_state.any() and not fresh.ssm_state.any()


def test_read_magnitudes_measure_the_state_read_an_output_cancels_in():
    # One token, no state: S = beta k v^T, o = scale (q.k) beta v. With q nearly orthogonal to k the output is
    # small beside the terms q[i] k[i] beta v it sums, which is what the tolerance must be widened by.
    from reference.gdn import read_magnitudes

    K, V = 4, 3
    q = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]], dtype=torch.float64) / 2**0.5  # (T=1, H=1, K)
    k = torch.tensor([[[1.0, -1.0 + 1e-6, 0.0, 0.0]]], dtype=torch.float64) / 2**0.5
    v = torch.tensor([[[1.0, 2.0, -3.0]]], dtype=torch.float64)
    beta, scale = 0.5, K ** -0.5
    state = beta * torch.einsum("thk,thv->thkv", k, v)
    o = scale * torch.einsum("thk,thkv->thv", q, state)
    m = read_magnitudes(q, state, scale=scale)
    assert m.shape == o.shape
    expected = scale * beta * v.abs() * torch.sqrt((q * q * k * k).sum(-1, keepdim=True))
    torch.testing.assert_close(m, expected)
    assert (m / o.abs()).min() > 1e5  # the output cancelled; its terms did not
