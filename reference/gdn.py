"""The gated delta rule layer (Qwen3-Next style linear attention), readable first.

Per value head, with state ``S (K, V)`` (zeros when a request starts), each token t does::

    S = exp(g_t) * S                                   # g_t <= 0 is a log-decay
    S = S + outer(k_t, beta_t * (v_t - k_t @ S))       # delta rule: move k_t's readout towards v_t
    o_t = scale * (q_t @ S)

Value head ``j`` reads q/k head ``j // (HV // H)`` (grouped value attention). The whole layer adds, before
the recurrence, a causal depthwise conv1d with SiLU over the mixed channels (with a state of the last
``W - 1`` inputs), the split into q | k | v, L2-normalised q and k, and the gating
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

Everything is computed in the dtype of the activations (``v`` / ``mixed_qkv``); states passed in are cast
to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _per_value_head(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``(T, H, K)`` -> ``(T, HV, K)`` where value head j holds q/k head ``j // (HV // H)``."""
    H = q.shape[1]
    if H == 0 or num_v_heads % H:
        raise ValueError(f"{num_v_heads} value heads are not a multiple of {H} q/k heads; need HV % H == 0")
    return q.repeat_interleave(num_v_heads // H, dim=1), k.repeat_interleave(num_v_heads // H, dim=1)


def _start_state(initial_state: torch.Tensor | None, num_v_heads: int, head_k_dim: int,
                 like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(num_v_heads, head_k_dim, like.shape[-1])
    # A copy, so that a caller's state tensor is never aliased by (or returned as) ours.
    return initial_state.to(like.dtype).clone()


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                scale: float, initial_state: torch.Tensor | None,
                keep_states: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    T, HV, V = v.shape
    q, k = _per_value_head(q, k, HV)
    S = _start_state(initial_state, HV, k.shape[-1], v)  # (HV, K, V)
    outputs, states = [], []
    for t in range(T):
        S = torch.exp(g[t])[:, None, None] * S
        predicted = torch.einsum("hk,hkv->hv", k[t], S)  # what the decayed state recalls for key k_t
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        outputs.append(scale * torch.einsum("hk,hkv->hv", q[t], S))
        if keep_states:
            states.append(S)
    o = torch.stack(outputs) if T else v.new_zeros(0, HV, V)
    if not keep_states:
        return o, S, None
    return o, S, torch.stack(states) if T else S.new_zeros((0, *S.shape))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     scale: float, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (the definition; see the module docstring).

    Parameters
    ----------
    q, k : torch.Tensor
        ``(T, num_k_heads, head_k_dim)``; used as given (normalise them first if the model does).
    v : torch.Tensor
        ``(T, num_v_heads, head_v_dim)``; ``num_v_heads`` must be a multiple of ``num_k_heads``.
    g : torch.Tensor
        ``(T, num_v_heads)``: log-decay per token and value head (the state is multiplied by ``exp(g)``).
    beta : torch.Tensor
        ``(T, num_v_heads)``: delta-rule step size.
    scale : float
        Output scale (usually ``head_k_dim ** -0.5``).
    initial_state : torch.Tensor | None
        ``(num_v_heads, head_k_dim, head_v_dim)``, or None for zeros.

    Returns
    -------
    o, final_state : tuple[torch.Tensor, torch.Tensor]
        ``o (T, num_v_heads, head_v_dim)`` and ``final_state (num_v_heads, head_k_dim, head_v_dim)``, in v's
        dtype. With ``T == 0`` the final state is (a copy of) the initial state.
    """
    o, final_state, _ = _recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state, keep_states=False)
    return o, final_state


def gated_delta_rule_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, *, scale: float,
                            initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule` keeping the state after every token (speculative verification commits one).

    Arguments as :func:`gated_delta_rule`.

    Returns
    -------
    o, states : tuple[torch.Tensor, torch.Tensor]
        ``o (T, num_v_heads, head_v_dim)`` and ``states (T, num_v_heads, head_k_dim, head_v_dim)``, where
        ``states[t]`` is the state once token t is in (``states[-1]`` is the final state).
    """
    o, _, states = _recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state, keep_states=True)
    return o, states


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of n tokens, per value head: q, k ``(HV, n, K)``, v ``(HV, n, V)``, g, beta ``(HV, n)``,
    carried state S ``(HV, K, V)`` -> o ``(HV, n, V)`` and the state after the chunk.

    With ``G_i`` the log-decay from the chunk start through token i and ``u_i`` the increment token i adds
    (``S_i = exp(g_i) S_{i-1} + k_i u_i^T``), unrolling gives ``S_i = exp(G_i) S + sum_{j<=i}
    exp(G_i - G_j) k_j u_j^T`` and

        u_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) k_i S,

    a unit lower-triangular system ``(I + M) U = ...`` solved once for the whole chunk (the WY / UT form).
    """
    n = q.shape[1]
    eye = torch.eye(n, dtype=v.dtype, device=v.device)
    lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
    G = g.cumsum(-1)  # (HV, n)
    # exp(G_i - G_j) for j <= i, zero above; masked before exp because G_i - G_j > 0 there and may overflow.
    decay = torch.exp((G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")))  # (HV, n, n)
    M = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay) * (1 - eye)  # strictly lower: j < i
    A = torch.linalg.solve_triangular(eye + M, eye.expand_as(M), upper=False)  # (I + M)^-1
    u_without_state = A @ (beta[..., None] * v)  # (HV, n, V)
    state_weight = A @ (beta[..., None] * torch.exp(G)[..., None] * k)  # (HV, n, K): how S enters each u_i
    u = u_without_state - state_weight @ S  # (HV, n, V)
    o = torch.exp(G)[..., None] * (q @ S) + ((q @ k.transpose(1, 2)) * decay) @ u
    G_last = G[:, -1:]  # (HV, 1)
    S_next = torch.exp(G_last)[..., None] * S + (torch.exp(G_last - G)[..., None] * k).transpose(1, 2) @ u
    return scale * o, S_next


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, *, scale: float, initial_state: torch.Tensor | None = None,
                             chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunked (WY / UT-transform) form, as in flash-linear-attention's naive chunk
    reference: within a chunk the delta-rule updates are solved at once by a unit lower-triangular system;
    between chunks only the state is carried. The last chunk is simply shorter (fla pads it with ``g = 0``,
    ``beta = 0``, ``k = 0`` tokens, which leave the state unchanged; the result is the same).

    Arguments and results as :func:`gated_delta_rule`, plus ``chunk_size`` (tokens per chunk, >= 1). Equals
    the recurrent form up to rounding (~1e-13 relative in float64).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    T, HV, V = v.shape
    q, k = _per_value_head(q, k, HV)
    S = _start_state(initial_state, HV, k.shape[-1], v)
    outputs = []
    for start in range(0, T, chunk_size):
        rows = slice(start, min(start + chunk_size, T))
        o, S = _chunk_step(*(x[rows].transpose(0, 1) for x in (q, k, v, g, beta)), S, scale)  # heads first
        outputs.append(o.transpose(0, 1))
    o = torch.cat(outputs) if outputs else v.new_zeros(0, HV, V)
    return o, S


def causal_conv1d_states(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, *,
                         activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d` keeping the conv state after every token.

    Arguments as :func:`causal_conv1d`.

    Returns
    -------
    y, states : tuple[torch.Tensor, torch.Tensor]
        ``y (T, C)`` and ``states (T, C, W - 1)``, where ``states[t]`` holds the last ``W - 1`` inputs once
        token t is in, oldest first (``states[-1]`` is the final conv state).
    """
    y, xpad = _conv(x, weight, conv_state, activation)
    W = weight.shape[1]
    states = _windows(xpad, W)[..., 1:]  # window t without its oldest input: the W - 1 latest once t is in
    return y, states.contiguous()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, *,
                  activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over time for ONE sequence, continuing from a conv state.

    With ``xpad = cat(conv_state.T, x)`` ``(W - 1 + T, C)``:
    ``y[t, c] = act(sum_w weight[c, w] * xpad[t + w, c])``, i.e. ``torch.nn.functional.conv1d`` with
    ``groups=C`` and ``W - 1`` inputs of left context.

    Parameters
    ----------
    x : torch.Tensor
        ``(T, C)``: the sequence's inputs, time first.
    weight : torch.Tensor
        ``(C, W)``: one filter per channel, oldest tap first.
    conv_state : torch.Tensor | None
        ``(C, W - 1)``: the ``W - 1`` inputs just before x, oldest first; None for zeros (a new request).
    activation : str | None
        ``"silu"`` (or its alias ``"swish"``) or None.

    Returns
    -------
    y, new_conv_state : tuple[torch.Tensor, torch.Tensor]
        ``y (T, C)`` and ``new_conv_state (C, W - 1)`` = the last ``W - 1`` rows of xpad, transposed. In x's
        dtype.
    """
    y, xpad = _conv(x, weight, conv_state, activation)
    return y, xpad[x.shape[0]:].T.contiguous()


def _conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
          activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> y ``(T, C)`` and xpad ``(W - 1 + T, C)``."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"unknown activation {activation!r}; use 'silu' or None")
    C, W = weight.shape
    if x.shape[1] != C:
        raise ValueError(f"x has {x.shape[1]} channels but weight is for {C}")
    if conv_state is None:
        conv_state = x.new_zeros(C, W - 1)
    xpad = torch.cat([conv_state.to(x.dtype).T, x])  # (W - 1 + T, C)
    y = (_windows(xpad, W) * weight.to(x.dtype)).sum(-1)
    return (F.silu(y) if activation is not None else y), xpad


def _windows(xpad: torch.Tensor, W: int) -> torch.Tensor:
    """xpad ``(W - 1 + T, C)`` -> ``(T, C, W)`` with ``[t, c, w] = xpad[t + w, c]``: token t's conv window."""
    T = xpad.shape[0] - (W - 1)
    return torch.stack([xpad[w:w + T] for w in range(W)], dim=-1)


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token decay and step size of the gated delta rule.

    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``. softplus is torch's (beta 1,
    linear above 20), which is also what SGLang's fused_gdn_gating kernel computes.

    Parameters
    ----------
    A_log, dt_bias : torch.Tensor
        ``(num_v_heads,)``.
    a, b : torch.Tensor
        ``(T, num_v_heads)``.

    Returns
    -------
    g, beta : tuple[torch.Tensor, torch.Tensor]
        Each ``(T, num_v_heads)`` in a's dtype; ``g <= 0``, ``0 < beta < 1``.
    """
    g = -torch.exp(A_log.to(a.dtype)) * F.softplus(a + dt_bias.to(a.dtype))
    return g, torch.sigmoid(b.to(a.dtype))


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x * x, dim) + eps)``: fla's l2norm convention, with eps inside the square root
    (not ``x / max(||x||, eps)`` as in ``torch.nn.functional.normalize``). Same shape and dtype as x."""
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


@dataclass(frozen=True)
class LinearLayerOutput:
    """What one request's pass through a linear-attention layer produces (all in the activations' dtype).

    ``o (T, num_v_heads, head_v_dim)``; final ``conv_state (conv_dim, W - 1)`` and
    ``ssm_state (num_v_heads, head_k_dim, head_v_dim)``; with ``keep_states``, the states after each token,
    ``conv_states (T, conv_dim, W - 1)`` and ``ssm_states (T, num_v_heads, head_k_dim, head_v_dim)``,
    otherwise None.
    """

    o: torch.Tensor
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    conv_states: torch.Tensor | None = None
    ssm_states: torch.Tensor | None = None
    # Per output element, the root sum of squares of the terms of its state read ``scale * sum_k q_t[k] S_t[k, v]``
    # (see :func:`read_magnitudes`): what the output would be without cancellation in that read
    read_magnitudes: torch.Tensor | None = None


def linear_attention_layer(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                           conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                           num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, scale: float,
                           conv_state: torch.Tensor | None = None, ssm_state: torch.Tensor | None = None,
                           keep_states: bool = False) -> LinearLayerOutput:
    """One request through a gated-delta-rule layer: conv1d + SiLU, split q | k | v, L2-normalise q and k,
    gating, recurrence.

    Parameters
    ----------
    mixed_qkv : torch.Tensor
        ``(T, conv_dim)`` with ``conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim``;
        channels are all q heads, then all k heads, then all v heads (each head contiguous).
    a, b : torch.Tensor
        ``(T, num_v_heads)``: gating inputs (see :func:`gdn_gating`).
    conv_weight : torch.Tensor
        ``(conv_dim, W)``.
    A_log, dt_bias : torch.Tensor
        ``(num_v_heads,)``.
    num_k_heads, num_v_heads, head_k_dim, head_v_dim : int
        Head layout; ``num_v_heads`` is a multiple of ``num_k_heads``.
    scale : float
        Output scale of the recurrence (usually ``head_k_dim ** -0.5``).
    conv_state : torch.Tensor | None
        ``(conv_dim, W - 1)``, or None for a request with no prefix (zeros).
    ssm_state : torch.Tensor | None
        ``(num_v_heads, head_k_dim, head_v_dim)``, or None for zeros.
    keep_states : bool
        Also return the states after every token (TARGET_VERIFY).

    Returns
    -------
    LinearLayerOutput
    """
    T = mixed_qkv.shape[0]
    qk_dim = num_k_heads * head_k_dim
    conv_dim = 2 * qk_dim + num_v_heads * head_v_dim
    if mixed_qkv.shape[1] != conv_dim:
        raise ValueError(f"mixed_qkv has {mixed_qkv.shape[1]} channels, expected 2*H*K + HV*V = {conv_dim}")
    y, final_conv = causal_conv1d(mixed_qkv, conv_weight, conv_state)
    conv_states = causal_conv1d_states(mixed_qkv, conv_weight, conv_state)[1] if keep_states else None
    q = l2norm(y[:, :qk_dim].reshape(T, num_k_heads, head_k_dim))
    k = l2norm(y[:, qk_dim:2 * qk_dim].reshape(T, num_k_heads, head_k_dim))
    v = y[:, 2 * qk_dim:].reshape(T, num_v_heads, head_v_dim)
    g, beta = gdn_gating(A_log, a.to(y.dtype), dt_bias, b)
    o, final_ssm, ssm_states = _recurrence(q, k, v, g, beta, scale=scale, initial_state=ssm_state,
                                           keep_states=True)
    magnitudes = read_magnitudes(q, ssm_states, scale=scale)
    return LinearLayerOutput(o, final_conv, final_ssm, conv_states, ssm_states if keep_states else None, magnitudes)


def read_magnitudes(q: torch.Tensor, states: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``(T, HV, V)``: per output element, the root sum of squares of the terms of the state read that makes it,
    ``scale * q_t[k] * S_t[k, v]`` over k, from the state after each token ``states (T, HV, K, V)``. The output is
    a signed sum of them: where they cancel (a token whose key nearly misses its query, q.k near 0), it is small
    beside them, and so is any error measured relative to it (``widen_for_cancellation``). Cancellation inside the
    state's own update is not counted: it is a difference of two terms of the same rounding, both in the state."""
    T, HV = states.shape[0], states.shape[1]
    if T == 0:
        return states.new_zeros(0, HV, states.shape[-1])
    q = q.repeat_interleave(HV // q.shape[1], dim=1)
    return scale * torch.einsum("thk,thkv->thv", q * q, states * states).sqrt()

