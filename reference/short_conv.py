"""Gated short convolution (LFM2's conv layers; Liquid AI, "LFM2 Technical Report", 2025): a causal depthwise
convolution over a short window, gated before and after.

A model's input projection gives each token three vectors of the hidden size, ``B``, ``C`` and ``x``. The layer
convolves ``u = B * x`` (elementwise) causally, channel by channel, with a kernel of width ``W`` (``L_cache`` in
LFM2's config, 3 in its checkpoints), and gates the result with ``C``::

    y_t[d] = sum_{j=0}^{W-1} w[d, j] * u_{t-(W-1)+j}[d]  (+ bias[d])
    o_t    = C_t * y_t

so ``w[:, W-1]`` weighs the current token and ``w[:, 0]`` the oldest. Before a request's first token the window
holds zeros; a request that continues a cached prefix carries the last ``W-1`` values of ``u`` instead (its conv
state, ``[D, W-1]``, oldest first). No activation: LFM2 convolves without one.

Written from that definition; :func:`short_conv_by_taps` is a second formulation (one shifted sum per tap) that the
tests hold the window form to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ShortConvResult:
    o: torch.Tensor  # (T, D)
    state: torch.Tensor  # (D, W-1): the last W-1 inputs of the convolution after the last token, oldest first
    states: torch.Tensor | None  # (T, D, W-1): the state after each token (keep_states)
    magnitudes: torch.Tensor  # (T, D): each output's root sum of squares of its terms (cancellation scale)


def _split(bcx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bcx (T, 3D)``, as LFM2's input projection emits it: B, then C, then x."""
    if bcx.shape[-1] % 3:
        raise ValueError(f"bcx's last dim must hold B, C and x of one size, got {bcx.shape[-1]}")
    return bcx.chunk(3, dim=-1)


def short_conv(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               conv_state: torch.Tensor | None = None, keep_states: bool = False) -> ShortConvResult:
    """One request's tokens: ``bcx (T, 3D)``, ``weight (D, W)``, ``bias (D,)`` or None, ``conv_state (D, W-1)`` or
    None (a fresh request: zeros). Computed in ``bcx``'s dtype (float64 for the reference)."""
    B, C, x = _split(bcx)
    T, D = x.shape
    W = weight.shape[1]
    if weight.shape[0] != D:
        raise ValueError(f"weight has {weight.shape[0]} channels for a hidden size of {D}")
    u = B * x
    carried = conv_state if conv_state is not None else u.new_zeros(D, W - 1)
    line = torch.cat([carried, u.T], dim=1)  # (D, W-1+T): the carried inputs, then this request's
    if T == 0:  # no token: nothing out, the state as carried
        empty = u.new_zeros(0, D)
        return ShortConvResult(o=empty, state=carried, states=u.new_zeros(0, D, W - 1) if keep_states else None,
                               magnitudes=empty)
    windows = line.unfold(1, W, 1)  # (D, T, W): token t's window is line[:, t : t+W]
    terms = windows * weight[:, None, :]
    y = terms.sum(-1).T  # (T, D)
    squares = (terms * terms).sum(-1).T
    if bias is not None:
        y = y + bias
        squares = squares + bias * bias
    o = C * y
    states = line.unfold(1, W - 1, 1)[:, 1:].permute(1, 0, 2) if W > 1 else line.new_zeros(T, D, 0)
    return ShortConvResult(o=o, state=line[:, line.shape[1] - (W - 1):], states=states if keep_states else None,
                           magnitudes=C.abs() * squares.sqrt())


def short_conv_by_taps(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       conv_state: torch.Tensor | None = None) -> torch.Tensor:
    """The same output as a sum over taps: tap ``j`` shifts ``u`` by ``W-1-j`` tokens (reading the carried state
    for the tokens before the request's first), weighs it by ``w[:, j]``; an independent check of the window form."""
    B, C, x = _split(bcx)
    T, D = x.shape
    W = weight.shape[1]
    u = B * x
    carried = conv_state if conv_state is not None else u.new_zeros(D, W - 1)
    y = torch.zeros_like(u) if bias is None else bias.expand(T, D).clone()
    for j in range(W):
        lag = W - 1 - j
        for t in range(T):
            source = u[t - lag] if t >= lag else carried[:, W - 1 - (lag - t)]
            y[t] += weight[:, j] * source
    return C * y
