"""Kimi Delta Attention (KDA; Kimi Linear's linear-attention layers), readable first.

KDA is the gated delta rule with a forget gate per key channel instead of one per head. Per head, with state
``S (K, V)`` (zeros when a request starts), each token t does::

    S = diag(exp(g_t)) S                               # g_t (K,) <= 0: row c of S decays by exp(g_t[c])
    S = S + outer(k_t, beta_t * (v_t - k_t @ S))       # delta rule: move k_t's readout towards v_t
    o_t = scale * (q_t @ S)

(Kimi Linear, arXiv:2510.26692, eq. 1-2.) The layer adds, before the recurrence, a causal depthwise conv1d with
SiLU over q | k | v (a state of the last ``W - 1`` inputs, :func:`reference.gdn.causal_conv1d`), L2-normalised q
and k, the step size ``beta = sigmoid(b)`` and the forget gate from its raw input ``a`` (``a + dt_bias`` per
channel, ``A = exp(A_log)`` per head)::

    g = -A * softplus(a + dt_bias)                     # the standard gate
    g = lower_bound * sigmoid(A * (a + dt_bias))       # the "safe" gate: each token's log-decay in [lower_bound, 0]

q, k and v have the same number of heads (Kimi Linear's layout). Everything is computed in the dtype of the
activations (``mixed_qkv``); states passed in are cast to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reference.gdn import causal_conv1d, causal_conv1d_states, l2norm, read_magnitudes


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None = None) -> torch.Tensor:
    """The per-channel log-decay of each token.

    Parameters
    ----------
    a : torch.Tensor
        ``(T, H, K)``: the raw forget-gate input (the model's ``f_b_proj`` output).
    A_log : torch.Tensor
        ``(H,)``.
    dt_bias : torch.Tensor
        ``(H, K)``.
    lower_bound : float | None
        None for the standard gate ``-exp(A_log) * softplus(a + dt_bias)`` (softplus as torch's: beta 1, linear
        above 20); a negative number for the safe gate ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``.

    Returns
    -------
    torch.Tensor
        ``g (T, H, K)``, ``g <= 0``, in a's dtype.
    """
    x = a + dt_bias.to(a.dtype)
    A = torch.exp(A_log.to(a.dtype))[:, None]
    if lower_bound is None:
        return -A * F.softplus(x)
    return lower_bound * torch.sigmoid(A * x)


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                scale: float, initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> o ``(T, H, V)`` and the state after each token ``(T, H, K, V)`` (the definition, one token at a time)."""
    T, H, V = v.shape
    K = k.shape[-1]
    S = v.new_zeros(H, K, V) if initial_state is None else initial_state.to(v.dtype).clone()
    outputs, states = [], []
    for t in range(T):
        S = torch.exp(g[t])[:, :, None] * S
        predicted = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        outputs.append(scale * torch.einsum("hk,hkv->hv", q[t], S))
        states.append(S)
    if not T:
        return v.new_zeros(0, H, V), S.new_zeros(0, H, K, V)
    return torch.stack(outputs), torch.stack(states)


def _final(states: torch.Tensor, initial_state: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The state after the last token, or (no token) a copy of the initial state (zeros without one)."""
    if states.shape[0]:
        return states[-1]
    return like.new_zeros(states.shape[1:]) if initial_state is None else initial_state.to(like.dtype).clone()


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, scale: float,
        initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence (module docstring), one token at a time.

    Parameters
    ----------
    q, k : torch.Tensor
        ``(T, H, K)``; used as given (normalise them first, as the layer does).
    v : torch.Tensor
        ``(T, H, V)``.
    g : torch.Tensor
        ``(T, H, K)``: per-channel log-decays (:func:`kda_gate`).
    beta : torch.Tensor
        ``(T, H)``: delta-rule step sizes.
    scale : float
        Output scale (``head_k_dim ** -0.5``).
    initial_state : torch.Tensor | None
        ``(H, K, V)``, or None for zeros.

    Returns
    -------
    o, final_state : tuple[torch.Tensor, torch.Tensor]
        ``o (T, H, V)`` and ``final_state (H, K, V)`` in v's dtype (with ``T == 0``, a copy of the initial state).
    """
    o, states = _recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return o, _final(states, initial_state, v)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                scale: float, initial_state: torch.Tensor | None = None,
                chunk_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunked (WY / UT) form, as fla's naive chunk_kda: within a chunk, with ``G_i`` the
    cumulative log-decay from the chunk's start through token i (a vector over key channels) and ``u_i`` the
    increment token i adds (``S_i = diag(exp(g_i)) S_{i-1} + k_i u_i^T``), unrolling gives
    ``S_i = diag(exp(G_i)) S + sum_{j<=i} diag(exp(G_i - G_j)) k_j u_j^T`` and

        u_i + beta_i sum_{j<i} <k_i exp(G_i - G_j), k_j> u_j = beta_i v_i - beta_i (k_i exp(G_i)) S,

    a unit lower-triangular system solved once per chunk; ``o_i = scale (q_i exp(G_i)) S + scale sum_{j<=i}
    <q_i exp(G_i - G_j), k_j> u_j``. Arguments and results as :func:`kda`; equal to it up to rounding (a second
    formulation for the tests, not what the harness compares against)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    T, H, V = v.shape
    K = k.shape[-1]
    S = v.new_zeros(H, K, V) if initial_state is None else initial_state.to(v.dtype).clone()
    outputs = []
    for start in range(0, T, chunk_size):
        rows = slice(start, min(start + chunk_size, T))
        qc, kc, vc, gc, bc = (x[rows].transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
        n = qc.shape[1]
        G = gc.cumsum(1)  # (H, n, K)
        lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        # exp(G_i - G_j) per channel for j <= i (zero above: masked before exp, where it may overflow)
        diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
        decay = torch.exp(diff)  # (H, n, n, K)
        kk = torch.einsum("hic,hijc,hjc->hij", kc, decay, kc)
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
        M = bc[:, :, None] * kk * (1 - eye)
        A = torch.linalg.solve_triangular(eye + M, eye.expand_as(M), upper=False)
        u = A @ (bc[..., None] * vc) - A @ (bc[..., None] * (kc * torch.exp(G))) @ S  # (H, n, V)
        qk = torch.einsum("hic,hijc,hjc->hij", qc, decay, kc)
        o = (qc * torch.exp(G)) @ S + qk @ u
        outputs.append(scale * o.transpose(0, 1))
        G_last = G[:, -1:, :]  # (H, 1, K)
        S = torch.exp(G_last).transpose(1, 2) * S + (torch.exp(G_last - G) * kc).transpose(1, 2) @ u
    o = torch.cat(outputs) if outputs else v.new_zeros(0, H, V)
    return o, S


@dataclass(frozen=True)
class KdaLayerOutput:
    """One request's pass through a KDA layer (all in the activations' dtype): ``o (T, H, V)``, the final
    ``conv_state (conv_dim, W - 1)`` and ``ssm_state (H, K, V)``; with ``keep_states`` the states after each token
    (``conv_states (T, conv_dim, W - 1)``, ``ssm_states (T, H, K, V)``), else None; ``read_magnitudes (T, H, V)``:
    per output element, the RSS of its state read's terms (:func:`reference.gdn.read_magnitudes`)."""

    o: torch.Tensor
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    conv_states: torch.Tensor | None
    ssm_states: torch.Tensor | None
    read_magnitudes: torch.Tensor


def kda_layer(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, conv_weight: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int, head_k_dim: int, head_v_dim: int,
              lower_bound: float | None = None, conv_state: torch.Tensor | None = None,
              ssm_state: torch.Tensor | None = None, keep_states: bool = False) -> KdaLayerOutput:
    """One request through a KDA layer: conv1d + SiLU, split q | k | v, L2-normalised q and k, the gates, the
    recurrence with scale ``head_k_dim ** -0.5``.

    Parameters
    ----------
    mixed_qkv : torch.Tensor
        ``(T, conv_dim)``, ``conv_dim = 2 * H * K + H * V``: all q heads, then all k heads, then all v heads.
    a : torch.Tensor
        ``(T, H * K)``: the raw forget-gate input, heads first.
    b : torch.Tensor
        ``(T, H)``: the raw step-size input (``beta = sigmoid(b)``).
    conv_weight : torch.Tensor
        ``(conv_dim, W)``.
    A_log : torch.Tensor
        ``(H,)``.
    dt_bias : torch.Tensor
        ``(H * K,)``.
    num_heads, head_k_dim, head_v_dim : int
        H, K, V.
    lower_bound : float | None
        The safe gate's bound, or None for the standard gate (:func:`kda_gate`).
    conv_state, ssm_state : torch.Tensor | None
        ``(conv_dim, W - 1)`` and ``(H, K, V)`` carried from a cached prefix, or None (zeros).
    keep_states : bool
        Also return the states after every token (TARGET_VERIFY).
    """
    T = mixed_qkv.shape[0]
    H, K, V = num_heads, head_k_dim, head_v_dim
    conv_dim = 2 * H * K + H * V
    if mixed_qkv.shape[1] != conv_dim:
        raise ValueError(f"mixed_qkv has {mixed_qkv.shape[1]} channels, expected 2*H*K + H*V = {conv_dim}")
    y, final_conv = causal_conv1d(mixed_qkv, conv_weight, conv_state)
    conv_states = causal_conv1d_states(mixed_qkv, conv_weight, conv_state)[1] if keep_states else None
    q = l2norm(y[:, :H * K].reshape(T, H, K))
    k = l2norm(y[:, H * K:2 * H * K].reshape(T, H, K))
    v = y[:, 2 * H * K:].reshape(T, H, V)
    g = kda_gate(a.to(y.dtype).reshape(T, H, K), A_log, dt_bias.reshape(H, K), lower_bound)
    beta = torch.sigmoid(b.to(y.dtype))
    scale = K**-0.5
    o, states = _recurrence(q, k, v, g, beta, scale=scale, initial_state=ssm_state)
    final_ssm = _final(states, ssm_state, v)
    return KdaLayerOutput(o, final_conv, final_ssm, conv_states, states if keep_states else None,
                          read_magnitudes(q, states, scale=scale))
