"""The Mamba-2 mixer: the recurrence against SSD's quadratic form, the whole layer against an independent
pipeline, a hand-worked token, state carry across a split request, the per-token states, the gated norm by
groups, empty requests, shape checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from reference import mamba2 as m

F64 = torch.float64
H, P, N = 4, 3, 5
I = H * P


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def conv_dim(G: int) -> int:
    return I + 2 * G * N


def layer(G: int = 2, W: int = 4, seed: int = 0, with_bias: bool = True) -> dict:
    """A layer's parameters and sizes, as keyword arguments of mamba2_mixer; A = -exp(A_log) as models store it."""
    Cd = conv_dim(G)
    return dict(conv_weight=0.5 * rand(Cd, W, seed=seed),
                conv_bias=0.1 * rand(Cd, seed=seed + 1) if with_bias else None,
                dt_bias=rand(H, seed=seed + 2), A=-torch.exp(0.5 * rand(H, seed=seed + 3)), D=rand(H, seed=seed + 4),
                norm_weight=1 + 0.2 * rand(I, seed=seed + 5), num_heads=H, head_dim=P, n_groups=G, state_size=N)


def tokens(T: int, G: int, seed: int = 10) -> torch.Tensor:
    return rand(T, I + conv_dim(G) + H, seed=seed)


def ssd_inputs(T: int, G: int, seed: int = 20) -> tuple[torch.Tensor, ...]:
    """x (T, H, P), dt (T, H) in (0, ~1.3), A, B, C (T, G, N), D."""
    dt = F.softplus(rand(T, H, seed=seed + 1))
    return (rand(T, H, P, seed=seed), dt, -torch.exp(0.5 * rand(H, seed=seed + 2)), rand(T, G, N, seed=seed + 3),
            rand(T, G, N, seed=seed + 4), rand(H, seed=seed + 5))


def grouped_rms_norm(u: torch.Tensor, weight: torch.Tensor, G: int, eps: float) -> torch.Tensor:
    """Each group of I / G consecutive channels through torch's own RMSNorm."""
    T, width = u.shape
    return F.rms_norm(u.reshape(T, G, width // G), (width // G,), eps=eps).reshape(T, width) * weight


# ---- (1) the recurrence against a second formulation ----

@pytest.mark.parametrize("T", [0, 1, 5, 16])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrence_equals_the_quadratic_form(T, G, with_state):
    x, dt, A, B, C, D = ssd_inputs(T, G)
    s0 = rand(H, P, N, seed=30) if with_state else None
    got = m.ssd_recurrence(x, dt, A, B, C, D, ssm_state=s0).y
    assert got.shape == (T, H, P)
    torch.testing.assert_close(got, m.ssd_quadratic(x, dt, A, B, C, D, ssm_state=s0), rtol=1e-12, atol=1e-12)


def test_head_h_reads_group_h_over_heads_per_group():
    # H = 4, G = 2: heads 0, 1 read group 0 and heads 2, 3 group 1; each head run alone on its group agrees.
    x, dt, A, B, C, D = ssd_inputs(6, 2)
    whole = m.ssd_recurrence(x, dt, A, B, C, D)
    for h, g in enumerate([0, 0, 1, 1]):
        alone = m.ssd_recurrence(x[:, h:h + 1], dt[:, h:h + 1], A[h:h + 1], B[:, g:g + 1], C[:, g:g + 1], D[h:h + 1])
        torch.testing.assert_close(whole.y[:, h], alone.y[:, 0], rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(whole.state[h], alone.state[0], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("W", [2, 4])
def test_the_layer_equals_an_independent_pipeline(T, G, W):
    """A fresh request: the conv as one shifted sum per tap (tap j looks W-1-j tokens back, zeros before the
    first), torch's softplus and SiLU, the quadratic form, torch's RMSNorm. (Not F.conv1d: its float64 depthwise
    path costs a quarter second a call on CPU.)"""
    p, zxbcdt = layer(G, W), tokens(T, G)
    z, xBC, dt_raw = zxbcdt.split([I, conv_dim(G), H], dim=1)
    conv = p["conv_bias"].expand(T, -1).clone()
    for j in range(W):
        lag = W - 1 - j
        conv[lag:] += p["conv_weight"][:, j] * xBC[:T - lag]
    x, B, C = F.silu(conv).split([I, G * N, G * N], dim=1)
    dt = F.softplus(dt_raw + p["dt_bias"])
    y = m.ssd_quadratic(x.reshape(T, H, P), dt, p["A"], B.reshape(T, G, N), C.reshape(T, G, N), p["D"])
    want = grouped_rms_norm(y.reshape(T, I) * F.silu(z), p["norm_weight"], G, 1e-5)
    got = m.mamba2_mixer(zxbcdt, **p).o
    assert got.shape == (T, I)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---- (2) by hand ----

@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.0, 0.25), (1.5, 2.0)])
def test_one_token_by_hand(limit):
    # H = P = N = G = 1, W = 2, so conv_dim = 3 (x, B, C) and zxbcdt = (z, x, B, C, dt).
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    zxbcdt = torch.tensor([[1.2, 0.5, 1.5, 2.0, 0.3]], dtype=F64)
    conv_weight = torch.tensor([[0.5, 1.0], [0.25, 2.0], [1.0, 1.0]], dtype=F64)  # (old, current) per channel
    conv_bias = torch.tensor([0.1, 0.0, -0.5], dtype=F64)
    conv_state = torch.tensor([[1.0], [2.0], [-1.0]], dtype=F64)
    one = lambda v: torch.tensor([v], dtype=F64)  # noqa: E731
    res = m.mamba2_mixer(zxbcdt, conv_weight=conv_weight, conv_bias=conv_bias, dt_bias=one(0.2), A=one(-2.0),
                         D=one(0.7), norm_weight=one(1.5), num_heads=1, head_dim=1, n_groups=1, state_size=1,
                         eps=1e-3, conv_state=conv_state, ssm_state=torch.tensor([[[3.0]]], dtype=F64),
                         time_step_limit=limit, keep_states=True)
    x = silu(0.5 * 1.0 + 1.0 * 0.5 + 0.1)  # silu(1.1)
    B = silu(0.25 * 2.0 + 2.0 * 1.5)  # silu(3.5)
    C = silu(1.0 * -1.0 + 1.0 * 2.0 - 0.5)  # silu(0.5)
    dt = min(max(math.log(1 + math.exp(0.3 + 0.2)), limit[0]), limit[1])  # softplus(0.5) = 0.974..., clamped
    S = math.exp(dt * -2.0) * 3.0 + dt * x * B
    y = S * C + 0.7 * x
    u = y * silu(1.2)
    r = math.sqrt(u * u + 1e-3)
    assert res.ssm_state.item() == pytest.approx(S, rel=1e-14)
    assert res.o.item() == pytest.approx(u / r * 1.5, rel=1e-14)
    assert res.conv_state.tolist() == [[0.5], [1.5], [2.0]]  # the raw inputs, not silu of them
    assert res.conv_states.tolist() == [[[0.5], [1.5], [2.0]]] and res.ssm_states.item() == res.ssm_state.item()
    # the terms of y: the carried state's read (one term), this token's, and the skip
    terms = (math.exp(dt * -2.0) * 3.0 * C, dt * x * B * C, 0.7 * x)
    assert res.magnitudes.item() == pytest.approx(1.5 * silu(1.2) * math.hypot(*terms) / r, rel=1e-14)


def test_a_fresh_request_starts_from_zero_states_in_float64():
    p, zxbcdt = layer(), tokens(5, 2)
    fresh = m.mamba2_mixer(zxbcdt.float(), **p)
    zeros = m.mamba2_mixer(zxbcdt.float(), **p, conv_state=torch.zeros(conv_dim(2), 3),
                           ssm_state=torch.zeros(H, P, N))
    assert fresh.o.dtype == F64 and fresh.ssm_state.dtype == F64
    torch.testing.assert_close(fresh.o, zeros.o, rtol=0, atol=0)


# ---- (3), (4) the states ----

@pytest.mark.parametrize("cut", [0, 1, 3, 6, 7])
def test_a_request_split_anywhere_carries_both_states(cut):
    """A cached prefix, then the rest, carrying the conv and ssm states, equals one pass."""
    p, zxbcdt = layer(G=2, W=4), tokens(7, 2)
    whole = m.mamba2_mixer(zxbcdt, **p, keep_states=True)
    first = m.mamba2_mixer(zxbcdt[:cut], **p, keep_states=True)
    second = m.mamba2_mixer(zxbcdt[cut:], **p, conv_state=first.conv_state, ssm_state=first.ssm_state,
                            keep_states=True)
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([first.o, second.o]), whole.o, **close)
    torch.testing.assert_close(first.magnitudes, whole.magnitudes[:cut], **close)  # (the carry is one term after)
    torch.testing.assert_close(second.conv_state, whole.conv_state, **close)
    torch.testing.assert_close(second.ssm_state, whole.ssm_state, **close)
    torch.testing.assert_close(torch.cat([first.conv_states, second.conv_states]), whole.conv_states, **close)
    torch.testing.assert_close(torch.cat([first.ssm_states, second.ssm_states]), whole.ssm_states, **close)


def test_each_tokens_states_are_those_a_one_token_step_leaves():
    p, zxbcdt = layer(G=1, W=3, with_bias=False), tokens(5, 1)
    conv, ssm = rand(conv_dim(1), 2, seed=40), rand(H, P, N, seed=41)
    res = m.mamba2_mixer(zxbcdt, **p, conv_state=conv, ssm_state=ssm, keep_states=True)
    for t in range(5):
        step = m.mamba2_mixer(zxbcdt[t:t + 1], **p, conv_state=conv, ssm_state=ssm)
        conv, ssm = step.conv_state, step.ssm_state
        torch.testing.assert_close(res.conv_states[t], conv, rtol=0, atol=0)
        torch.testing.assert_close(res.ssm_states[t], ssm, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.o[t], step.o[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.ssm_state, ssm, rtol=1e-12, atol=1e-12)


# ---- (5) the gated norm ----

def test_one_group_is_rmsnorm_of_the_gated_output():
    y, z, w = rand(4, I, seed=50), rand(4, I, seed=51), rand(I, seed=52)
    o, r = m.gated_rms_norm(y, z, w, n_groups=1, eps=1e-5)
    torch.testing.assert_close(o, F.rms_norm(y * F.silu(z), (I,), eps=1e-5) * w, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(r[:, 0], ((y * F.silu(z)).pow(2).mean(-1) + 1e-5).sqrt())


def test_each_group_is_normalised_on_its_own():
    y, z, w = rand(4, I, seed=53), rand(4, I, seed=54), rand(I, seed=55)
    o, _ = m.gated_rms_norm(y, z, w, n_groups=3, eps=1e-5)
    torch.testing.assert_close(o, grouped_rms_norm(y * F.silu(z), w, 3, 1e-5), rtol=1e-13, atol=1e-13)
    louder = y.clone()
    louder[:, :I // 3] *= 1000  # the first group only: the other groups' outputs must not move
    o2, _ = m.gated_rms_norm(louder, z, w, n_groups=3, eps=1e-5)
    torch.testing.assert_close(o2[:, I // 3:], o[:, I // 3:], rtol=0, atol=0)


# ---- (6), (7) edges ----

def test_no_tokens_returns_the_carried_states():
    p = layer(G=2, W=4)
    conv, ssm = rand(conv_dim(2), 3, seed=60), rand(H, P, N, seed=61)
    res = m.mamba2_mixer(tokens(0, 2), **p, conv_state=conv, ssm_state=ssm, keep_states=True)
    assert res.o.shape == (0, I) and res.magnitudes.shape == (0, I)
    assert res.conv_states.shape == (0, conv_dim(2), 3) and res.ssm_states.shape == (0, H, P, N)
    assert torch.equal(res.conv_state, conv) and torch.equal(res.ssm_state, ssm)
    assert res.conv_state.data_ptr() != conv.data_ptr()  # a copy, never the caller's tensor


@pytest.mark.parametrize("field, bad", [
    ("zxbcdt", dict(zxbcdt=rand(3, I + conv_dim(2) + H + 1))),
    ("conv_weight", dict(conv_weight=rand(conv_dim(2) - 1, 4))),
    ("conv_weight", dict(conv_weight=rand(conv_dim(2), 1))),
    ("conv_bias", dict(conv_bias=rand(conv_dim(2) + 1))),
    ("dt_bias", dict(dt_bias=rand(H + 1))),
    ("A", dict(A=rand(H, 1))),
    ("D", dict(D=rand(P))),
    ("norm_weight", dict(norm_weight=rand(I // 2))),
    ("conv_state", dict(conv_state=rand(conv_dim(2), 4))),
    ("ssm_state", dict(ssm_state=rand(H, N, P))),
    ("n_groups", dict(n_groups=3)),
    ("time_step_limit", dict(time_step_limit=(1.0, 0.5))),
])
def test_bad_shapes_name_the_field(field, bad):
    kwargs = dict(layer(G=2, W=4), zxbcdt=tokens(3, 2))
    kwargs.update(bad)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        m.mamba2_mixer(**kwargs)


def test_magnitudes_are_the_rss_of_every_term_of_the_quadratic_form():
    """For a fresh request, rss_y is the root sum of squares of (C_t . B_s)'s N products times L[t, s] dt_s x_s over
    every s <= t, and D x_t: computed here term by term, against the recurrence's squared-state form."""
    T, H, P, N = 6, 2, 3, 4
    g = torch.Generator().manual_seed(5)
    x, B, C = (torch.randn(T, H, P, generator=g, dtype=F64), torch.randn(T, 1, N, generator=g, dtype=F64),
               torch.randn(T, 1, N, generator=g, dtype=F64))
    dt, A, D = torch.rand(T, H, generator=g, dtype=F64), -torch.rand(H, generator=g, dtype=F64), torch.randn(H, dtype=F64)
    got = m.ssd_recurrence(x, dt, A, B, C, D).rss
    want = torch.zeros(T, H, P, dtype=F64)
    for t in range(T):
        for h in range(H):
            squares = (D[h] * x[t, h]) ** 2
            for s in range(t + 1):
                decay = torch.exp(dt[s + 1:t + 1, h].sum() * A[h])
                squares = squares + ((C[t, 0] * B[s, 0]) ** 2).sum() * (decay * dt[s, h] * x[s, h]) ** 2
            want[t, h] = squares.sqrt()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
