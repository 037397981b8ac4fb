"""The gated delta rule layer (Qwen3-Next style linear attention), readable first.

Recurrence per value head with state ``S (K, V)``::

    S = exp(g_t) * S
    S = S + outer(k_t, beta_t * (v_t - k_t @ S))
    o_t = scale * (q_t @ S)

The full layer adds a causal depthwise conv1d (with a state of the last ``W - 1`` inputs), SiLU, the split
into q | k | v, L2-normalised q and k, and the gating ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``. Value head j reads q/k head ``j // (HV // H)`` (grouped value attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _expand_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = q.shape[1]
    if hv % h:
        raise ValueError(f"{hv} value heads are not a multiple of {h} q/k heads")
    return q.repeat_interleave(hv // h, dim=1), k.repeat_interleave(hv // h, dim=1)


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=v.dtype, device=v.device)


def gated_delta_rule_states(q, k, v, g, beta, *, scale: float, initial_state=None):
    """Recurrent form keeping every state: ``q, k (T, H, K)``, ``v (T, HV, V)``, ``g, beta (T, HV)``,
    ``initial_state (HV, K, V)`` or None (zeros) -> ``o (T, HV, V)`` and ``states (T, HV, K, V)`` where
    ``states[t]`` is the state after token t."""
    q, k = _expand_heads(q, k, v.shape[1])
    S = _zero_state(k, v) if initial_state is None else initial_state.to(v.dtype)
    outs, states = [], []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], S))
        states.append(S)
    if not outs:
        return v.new_zeros(0, v.shape[1], v.shape[2]), S.new_zeros((0,) + S.shape)
    return torch.stack(outs), torch.stack(states)


def gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state=None):
    """Recurrent form. Shapes as :func:`gated_delta_rule_states`; returns ``o (T, HV, V)`` and the final
    state ``(HV, K, V)``."""
    o, states = gated_delta_rule_states(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    if states.shape[0] == 0:
        return o, (_zero_state(_expand_heads(q, k, v.shape[1])[1], v) if initial_state is None
                   else initial_state.to(v.dtype))
    return o, states[-1]


def gated_delta_rule_chunked(q, k, v, g, beta, *, scale: float, initial_state=None, chunk_size: int = 64):
    """Chunked (WY / UT-transform) form: same arguments and results as :func:`gated_delta_rule`.

    Within a chunk, with cumulative log-decays G, the delta-rule updates are solved at once by the unit
    lower-triangular system ``A = (I + tril(diag(beta) K K^T * exp(G_i - G_j), -1))^-1``; between chunks only
    the state is carried.
    """
    T, HV, V = v.shape
    q, k = _expand_heads(q, k, HV)
    K = k.shape[2]
    S = _zero_state(k, v) if initial_state is None else initial_state.to(v.dtype).clone()
    outs = []
    eye = torch.eye(chunk_size, dtype=v.dtype, device=v.device)
    for start in range(0, T, chunk_size):
        n = min(chunk_size, T - start)
        pad = chunk_size - n

        def chunk(x):
            return F.pad(x[start:start + n], (0, 0) * (x.dim() - 1) + (0, pad)).transpose(0, 1)  # (HV, C, ...)

        qc, kc, vc = chunk(q), chunk(k), chunk(v)
        gc, bc = chunk(g[..., None])[..., 0], chunk(beta[..., None])[..., 0]  # (HV, C); padding: g=0, beta=0
        G = gc.cumsum(-1)
        decay = torch.exp(G[:, :, None] - G[:, None, :]).tril()  # exp(G_i - G_j) for j <= i
        kb = kc * bc[..., None]
        strict = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device), -1)
        M = (kb @ kc.transpose(1, 2) * decay).masked_fill(~strict, 0)
        A = torch.linalg.solve_triangular(eye + M, eye.expand(HV, -1, -1), upper=False, unitriangular=True)
        u = A @ (vc * bc[..., None])  # pseudo-values before the carried state
        w = A @ (kb * torch.exp(G)[..., None])  # how the carried state enters each pseudo-value
        v_new = u - w @ S
        causal = (qc @ kc.transpose(1, 2) * decay).masked_fill(~torch.tril(torch.ones_like(strict)), 0)
        o = (qc * torch.exp(G)[..., None]) @ S + causal @ v_new
        outs.append((scale * o).transpose(0, 1)[:n])
        last = G[:, -1]
        S = S * torch.exp(last)[:, None, None] + (kc * torch.exp(last[:, None] - G)[..., None]).transpose(1, 2) @ v_new
    o = torch.cat(outs) if outs else v.new_zeros(0, HV, V)
    return o, S


def causal_conv1d_states(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, *,
                         activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence ``x (T, C)`` with ``weight (C, W)``; ``conv_state (C, W-1)``
    holds the inputs just before x, oldest first (zeros if None). Returns ``y (T, C)`` and the conv state
    after each token ``(T, C, W-1)``."""
    C, W = weight.shape
    state = torch.zeros(C, W - 1, dtype=x.dtype, device=x.device) if conv_state is None else conv_state.to(x.dtype)
    xpad = torch.cat([state.T, x])  # (W-1+T, C)
    y = torch.stack([(xpad[t:t + W].T * weight).sum(-1) for t in range(x.shape[0])]) if x.shape[0] else x.new_zeros(0, C)
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    states = torch.stack([xpad[t + 1:t + W].T for t in range(x.shape[0])]) if x.shape[0] else x.new_zeros(0, C, W - 1)
    return y, states


def causal_conv1d(x, weight, conv_state, *, activation: str | None = "silu"):
    """As :func:`causal_conv1d_states`, returning ``y (T, C)`` and the final state ``(C, W-1)``."""
    y, states = causal_conv1d_states(x, weight, conv_state, activation=activation)
    if states.shape[0] == 0:
        W = weight.shape[1]
        return y, (torch.zeros(x.shape[1], W - 1, dtype=x.dtype, device=x.device) if conv_state is None
                   else conv_state.to(x.dtype))
    return y, states[-1]


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor):
    """``A_log, dt_bias (HV,)``, ``a, b (T, HV)`` -> ``g = -exp(A_log) * softplus(a + dt_bias)`` (log-decay)
    and ``beta = sigmoid(b)``, both ``(T, HV)``."""
    return -torch.exp(A_log) * F.softplus(a + dt_bias), torch.sigmoid(b)


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` along ``dim`` (fla's convention: eps inside the square root)."""
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


@dataclass(frozen=True)
class LinearLayerOutput:
    o: torch.Tensor  # (T, HV, V)
    conv_state: torch.Tensor  # (C, W-1)
    ssm_state: torch.Tensor  # (HV, K, V)
    conv_states: torch.Tensor | None = None  # (T, C, W-1), after each token
    ssm_states: torch.Tensor | None = None  # (T, HV, K, V), after each token


def linear_attention_layer(mixed_qkv, a, b, *, conv_weight, A_log, dt_bias, num_k_heads: int, num_v_heads: int,
                           head_k_dim: int, head_v_dim: int, scale: float, conv_state=None, ssm_state=None,
                           keep_states: bool = False) -> LinearLayerOutput:
    """One request through the whole layer: ``mixed_qkv (T, 2*H*K + HV*V)`` (channels q | k | v),
    ``a, b (T, HV)``, conv state ``(C, W-1)`` and SSM state ``(HV, K, V)`` (None = zeros)."""
    T = mixed_qkv.shape[0]
    y, conv_states = causal_conv1d_states(mixed_qkv, conv_weight, conv_state)
    qk = num_k_heads * head_k_dim
    q = l2norm(y[:, :qk].reshape(T, num_k_heads, head_k_dim))
    k = l2norm(y[:, qk:2 * qk].reshape(T, num_k_heads, head_k_dim))
    v = y[:, 2 * qk:].reshape(T, num_v_heads, head_v_dim)
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    o, ssm_states = gated_delta_rule_states(q, k, v, g, beta, scale=scale, initial_state=ssm_state)
    C, W = conv_weight.shape
    final_conv = conv_states[-1] if T else (torch.zeros(C, W - 1, dtype=y.dtype, device=y.device)
                                            if conv_state is None else conv_state)
    final_ssm = ssm_states[-1] if T else (torch.zeros(num_v_heads, head_k_dim, head_v_dim, dtype=y.dtype,
                                                      device=y.device) if ssm_state is None else ssm_state)
    return LinearLayerOutput(o, final_conv, final_ssm, conv_states if keep_states else None,
                             ssm_states if keep_states else None)
