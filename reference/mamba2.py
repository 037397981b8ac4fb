"""The Mamba-2 mixer (SSD; Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through
Structured State Space Duality", ICML 2024), with the semantics of mamba_ssm's ``Mamba2`` module: grouped B and C,
a causal depthwise conv with SiLU over x, B and C, and a gated RMS norm by groups after the gate.

The layer sits between the model's input and output projections; its input is the input projection's output.
Sizes: H heads of head dim P (``I = H * P``), G groups (head h reads group ``g(h) = h // (H / G)``), state size N,
conv width W >= 2, ``conv_dim = I + 2 * G * N``. Each token's ``zxbcdt`` is, in this order, ``z [I]``,
``xBC [conv_dim]``, ``dt [H]``, and the layer does::

    xBC'_t  = silu(sum_{j=0}^{W-1} conv_weight[:, j] * line[:, t+j]  (+ conv_bias))
    x_t [H, P], B_t [G, N], C_t [G, N] = split(xBC'_t)
    dt_t[h] = clamp(softplus(dt_t[h] + dt_bias[h]), *time_step_limit)
    S_h     = exp(dt_t[h] * A[h]) * S_h + dt_t[h] * outer(x_t[h], B_t[g(h)])      # S_h [P, N]
    y_t[h]  = S_h @ C_t[g(h)] + D[h] * x_t[h]                                   # after this token's update
    u_t     = y_t * silu(z_t)
    o_t     = u_t / sqrt(mean over its group of u_t^2 + eps) * norm_weight       # G groups of I / G channels

where ``line`` is the conv state ``[conv_dim, W-1]`` (the last W-1 *raw* xBC inputs, oldest first, before
activation) followed by this request's xBC. A fresh request starts from zero conv and ssm states; a continuing one
carries both. ``A`` is negative (the model stores ``A_log`` and uses ``A = -exp(A_log)``); ``D`` is one scalar per
head. The default ``time_step_limit (0, inf)`` clamps nothing.

The SSD duality gives the same pre-norm ``y`` without a state (:func:`ssd_quadratic`, the form the tests hold the
recurrence to): with ``a_r = dt_r * A``,
``y_t = sum_{s<=t} (C_t . B_s) * exp(sum_{r=s+1}^{t} a_r) * dt_s * x_s + D * x_t``, an attention whose mask is the
decay (plus ``exp(sum_{r<=t} a_r) * S_0 @ C_t`` for a carried state S_0).

``magnitudes [T, I]`` gives, per output element, the scale of the rounding a correct kernel may make, to widen
tolerances where terms cancel: ``|norm_weight| * |silu(z)| * rss_y / r``, where ``rss_y`` is the root sum of squares
of all the terms of ``y_t[i]`` in the quadratic form above, ``(C_t[n] B_s[n]) L[t, s] dt_s x_s[p]`` for every earlier
token s and state channel n, the carried state's ``exp(...) S_0[p, n] C_t[n]`` (one term each: its history is not
known) and ``D x_t[p]``, and ``r`` is the group's RMS denominator ``sqrt(mean(u_g^2) + eps)`` of that token. It is
``|o|`` with ``|y|`` replaced by what ``y`` would be without cancellation, whether the terms cancel within the state
read or over the tokens the state summed (a kernel rounds each token's contribution, chunk by chunk, not the
state's final value). The squared terms follow the state's own recurrence with squared factors,
``Q <- exp(dt A)^2 Q + dt^2 (x^2 B^2)``, and ``rss_y^2 = sum_n Q[p, n] C[n]^2 + (D x[p])^2``.

Written from that definition, in float64 whatever the inputs' dtype; states passed in are copied, never aliased.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64


@dataclass
class Mamba2Result:
    o: torch.Tensor  # (T, I)
    conv_state: torch.Tensor  # (conv_dim, W-1): the last W-1 raw xBC inputs after the last token, oldest first
    ssm_state: torch.Tensor  # (H, P, N): the state after the last token
    conv_states: torch.Tensor | None  # (T, conv_dim, W-1): the conv state after each token (keep_states)
    ssm_states: torch.Tensor | None  # (T, H, P, N): the ssm state after each token (keep_states)
    magnitudes: torch.Tensor  # (T, I): the rounding scale of each output (see the module docstring)


@dataclass
class SSDResult:
    y: torch.Tensor  # (T, H, P): before the gate and the norm
    state: torch.Tensor  # (H, P, N): after the last token
    states: torch.Tensor | None  # (T, H, P, N): after each token (keep_states)
    rss: torch.Tensor  # (T, H, P): root sum of squares of all the terms of each y (the module docstring)


def _per_head(BC: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C ``(T, G, N)`` -> ``(T, H, N)``, head h holding group ``h // (H / G)``."""
    return BC.repeat_interleave(num_heads // BC.shape[1], dim=1)


def softplus(v: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(v))``, exactly and without overflow. Kernels (and torch's default threshold) return ``v``
    itself above 20, a difference under exp(-20), ~1e-10 relative: far below float32 rounding."""
    return torch.logaddexp(v, torch.zeros_like(v))


def time_steps(dt_raw: torch.Tensor, dt_bias: torch.Tensor,
               time_step_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """``dt (T, H)``: softplus of the raw step plus its bias, clamped to the limit (softplus > 0, so the default
    ``(0, inf)`` leaves it as is)."""
    lo, hi = time_step_limit
    return softplus(dt_raw + dt_bias).clamp(min=lo, max=hi)


def causal_conv_silu(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``xBC (T, Cd)`` with the carried ``conv_state (Cd, W-1)`` -> the activated output ``(T, Cd)`` and the whole
    line ``(Cd, W-1+T)`` (the carried inputs, then this request's), from which the states are read."""
    W = weight.shape[1]
    line = torch.cat([conv_state, xBC.T], dim=1)
    windows = line.unfold(1, W, 1)  # (Cd, T, W): token t's window is line[:, t : t+W], its own input last
    out = (windows * weight[:, None, :]).sum(-1).T
    if bias is not None:
        out = out + bias
    return out * torch.sigmoid(out), line


def ssd_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, *, ssm_state: torch.Tensor | None = None, keep_states: bool = False) -> SSDResult:
    """The SSM, one token at a time (the definition): x ``(T, H, P)``, dt ``(T, H)`` (after softplus), A and D
    ``(H,)``, B and C ``(T, G, N)``, ssm_state ``(H, P, N)`` or None (zeros)."""
    T, H, P = x.shape
    N = B.shape[-1]
    B, C = _per_head(B, H), _per_head(C, H)
    S = x.new_zeros(H, P, N) if ssm_state is None else ssm_state.clone()
    Q = S * S  # the squares of S's terms, summed (a carried state counts as one term)
    ys, rss, states = [], [], []
    for t in range(T):
        decay = torch.exp(dt[t] * A)[:, None, None]
        added = (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        S = decay * S + added
        Q = decay * decay * Q + added * added
        skip = D[:, None] * x[t]  # (H, P)
        ys.append((S * C[t][:, None, :]).sum(-1) + skip)
        rss.append(((Q * (C[t] * C[t])[:, None, :]).sum(-1) + skip * skip).sqrt())
        if keep_states:
            states.append(S)
    if T == 0:
        empty = x.new_zeros(0, H, P)
        return SSDResult(empty, S, x.new_zeros(0, H, P, N) if keep_states else None, empty)
    return SSDResult(torch.stack(ys), S, torch.stack(states) if keep_states else None, torch.stack(rss))


def ssd_quadratic(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor, *, ssm_state: torch.Tensor | None = None) -> torch.Tensor:
    """The same pre-norm ``y (T, H, P)`` as :func:`ssd_recurrence`, in SSD's quadratic (attention) form, no state
    update: ``y_t = sum_{s<=t} (C_t . B_s) L[t, s] dt_s x_s + D x_t`` with ``L[t, s] = exp(sum_{r=s+1}^{t} dt_r A)``,
    plus ``exp(sum_{r<=t} dt_r A) * (S_0 @ C_t)`` for a carried state. A second definition, for the tests."""
    T, H, P = x.shape
    group = [h // (H // B.shape[1]) for h in range(H)]  # head h's group, indexed here rather than by _per_head
    B, C = B[:, group], C[:, group]
    a = (dt * A).T  # (H, T): a[h, r] = dt_r A_h, the log-decay token r applies
    # sum_{r=s+1}^{t} a_r summed directly (not as a difference of prefix sums, which would cancel): row s of
    # `after` keeps a_r for r > s only, and its running sum at column t is the segment sum for (t, s).
    later = torch.ones(T, T, dtype=torch.bool).triu(1)  # [s, r]: r > s
    after = torch.where(later, a[:, None, :], torch.zeros((), dtype=a.dtype))  # (H, s, r)
    segment = after.cumsum(-1).transpose(1, 2)  # (H, t, s)
    L = torch.exp(segment.masked_fill(later, -math.inf))  # `later` as [t, s] is s > t: causal, L = 0 there
    scores = torch.einsum("thn,shn->hts", C, B) * L  # (H, t, s)
    y = torch.einsum("hts,sh,shp->thp", scores, dt, x) + D[:, None] * x
    if ssm_state is not None:
        carried = torch.exp(a.cumsum(-1)).T  # (T, H): the carried state's decay through token t
        y = y + carried[..., None] * torch.einsum("hpn,thn->thp", ssm_state, C)
    return y


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, *, n_groups: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm after the gate, by groups: ``u = y * silu(z)`` ``(T, I)``, each of G groups of I / G consecutive
    channels divided by its own RMS, times ``weight (I,)``. Returns the output ``(T, I)`` and the denominators
    ``r (T, G)``."""
    T, I = y.shape
    u = (y * (z * torch.sigmoid(z))).reshape(T, n_groups, I // n_groups)
    r = ((u * u).mean(-1) + eps).sqrt()
    return (u / r[..., None]).reshape(T, I) * weight, r


def _check(name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def mamba2_mixer(zxbcdt: torch.Tensor, *, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                 dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor, num_heads: int,
                 head_dim: int, n_groups: int, state_size: int, eps: float = 1e-5,
                 conv_state: torch.Tensor | None = None, ssm_state: torch.Tensor | None = None,
                 time_step_limit: tuple[float, float] = (0.0, math.inf), keep_states: bool = False) -> Mamba2Result:
    """One request's tokens through the mixer (see the module docstring): ``zxbcdt (T, I + conv_dim + H)``,
    ``conv_weight (conv_dim, W)``, ``conv_bias (conv_dim,)`` or None, ``dt_bias``, ``A``, ``D (H,)``,
    ``norm_weight (I,)``, ``conv_state (conv_dim, W-1)`` and ``ssm_state (H, P, N)`` or None (a fresh request).
    With ``T == 0`` the output is empty and the states are (copies of) those carried."""
    H, P, G, N = num_heads, head_dim, n_groups, state_size
    for name, size in (("num_heads", H), ("head_dim", P), ("n_groups", G), ("state_size", N)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    if H % G:
        raise ValueError(f"num_heads {H} is not a multiple of n_groups {G}")
    I = H * P
    Cd = I + 2 * G * N
    if zxbcdt.dim() != 2 or zxbcdt.shape[1] != I + Cd + H:
        raise ValueError(f"zxbcdt has shape {tuple(zxbcdt.shape)}, expected (T, I + conv_dim + H) = "
                         f"(T, {I} + {Cd} + {H})")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != Cd or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight has shape {tuple(conv_weight.shape)}, expected (conv_dim, W) = ({Cd}, W), "
                         "W >= 2")
    W = conv_weight.shape[1]
    for name, tensor, shape in (("conv_bias", conv_bias, (Cd,)), ("dt_bias", dt_bias, (H,)), ("A", A, (H,)),
                                ("D", D, (H,)), ("norm_weight", norm_weight, (I,)),
                                ("conv_state", conv_state, (Cd, W - 1)), ("ssm_state", ssm_state, (H, P, N))):
        _check(name, tensor, shape)
    if len(time_step_limit) != 2 or not time_step_limit[0] <= time_step_limit[1]:
        raise ValueError(f"time_step_limit must be (low, high) with low <= high, got {time_step_limit}")

    def f64(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(F64)

    zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight = map(
        f64, (zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight))
    T = zxbcdt.shape[0]
    carried_conv = zxbcdt.new_zeros(Cd, W - 1) if conv_state is None else conv_state.to(F64).clone()
    carried_ssm = zxbcdt.new_zeros(H, P, N) if ssm_state is None else ssm_state.to(F64).clone()
    if T == 0:  # no token: nothing out, the states as carried
        empty = zxbcdt.new_zeros(0, I)
        return Mamba2Result(o=empty, conv_state=carried_conv, ssm_state=carried_ssm,
                            conv_states=zxbcdt.new_zeros(0, Cd, W - 1) if keep_states else None,
                            ssm_states=zxbcdt.new_zeros(0, H, P, N) if keep_states else None, magnitudes=empty)

    z, xBC, dt_raw = zxbcdt.split([I, Cd, H], dim=1)
    activated, line = causal_conv_silu(xBC, conv_weight, conv_bias, carried_conv)
    x, B, C = activated.split([I, G * N, G * N], dim=1)
    dt = time_steps(dt_raw, dt_bias, time_step_limit)
    ssd = ssd_recurrence(x.reshape(T, H, P), dt, A, B.reshape(T, G, N), C.reshape(T, G, N), D,
                         ssm_state=carried_ssm, keep_states=keep_states)
    o, r = gated_rms_norm(ssd.y.reshape(T, I), z, norm_weight, n_groups=G, eps=eps)
    per_channel_r = r.repeat_interleave(I // G, dim=1)  # (T, I): each channel's group denominator
    magnitudes = norm_weight.abs() * (z * torch.sigmoid(z)).abs() * ssd.rss.reshape(T, I) / per_channel_r
    # The conv state after token t is line[:, t+1 : t+W]: the raw inputs, never the activated ones.
    conv_states = line.unfold(1, W - 1, 1)[:, 1:].permute(1, 0, 2) if keep_states else None
    return Mamba2Result(o=o, conv_state=line[:, T:].clone(), ssm_state=ssd.state,
                        conv_states=conv_states.clone() if keep_states else None, ssm_states=ssd.states,
                        magnitudes=magnitudes)
