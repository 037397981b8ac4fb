"""Lightning attention (MiniMax-01, Bailing/Ling linear layers): linear attention with a fixed decay per head.

Per head, with state ``S (K, V)`` (zeros when a request starts), each token t does::

    S = exp(-lambda) * S + outer(k_t, v_t)        # lambda > 0: the head's decay rate
    o_t = scale * (q_t @ S)

so ``o_t = scale * sum_{s <= t} exp(-lambda * (t - s)) * (q_t . k_s) * v_s`` plus the decayed carried state.
There is no softmax and no normalisation: the output is a decayed sum of value rows weighted by raw scores.
q, k and v have one head each (no grouping).

The decay rates are the model's, not learned: ALiBi's geometric slopes (Press et al., "Train Short, Test
Long", 2022) for ``n`` heads, scaled per layer so that the first layer decays fastest and the last layer
hardly at all (``1 - layer / (num_layers - 1)``, plus 1e-5 so no rate is zero). A model without layer-wise
decay uses the plain slopes in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def alibi_slopes(n: int) -> list[float]:
    """ALiBi's slopes for ``n`` heads: ``2^(-8/n), 2^(-16/n), ...`` when n is a power of two; otherwise the
    slopes of the largest power of two below n, then every other slope of twice that many."""
    if n < 1:
        raise ValueError(f"need at least one head, got {n}")

    def power_of_two(m: int) -> list[float]:
        first = 2.0 ** (-8.0 / m)
        return [first ** (i + 1) for i in range(m)]

    if n & (n - 1) == 0:
        return power_of_two(n)
    below = 1 << (n.bit_length() - 1)
    return power_of_two(below) + power_of_two(2 * below)[0::2][:n - below]


def decay_rates(num_heads: int, layer_id: int, num_layers: int, layerwise: bool = True) -> torch.Tensor:
    """``lambda`` of each head of layer ``layer_id`` in a model of ``num_layers`` layers, float64 ``(H,)``."""
    slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float64)
    if not layerwise:
        return slopes
    if num_layers <= 1:
        return slopes * (1 + 1e-5)
    return slopes * (1 - layer_id / (num_layers - 1) + 1e-5)


@dataclass
class LightningResult:
    o: torch.Tensor  # (T, H, V)
    state: torch.Tensor  # (H, K, V): the state after the last token
    states: torch.Tensor | None  # (T, H, K, V): the state after each token (keep_states)


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float,
                        initial_state: torch.Tensor | None = None, keep_states: bool = False) -> LightningResult:
    """One request's tokens: q, k ``(T, H, K)``, v ``(T, H, V)``, decay ``(H,)``, state ``(H, K, V)`` or None.

    Computed token by token in the dtype of ``v``; a state passed in is copied, never aliased.
    """
    T, H, V = v.shape
    K = k.shape[-1]
    if q.shape != (T, H, K) or k.shape != (T, H, K) or decay.shape != (H,):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, decay "
                         f"{tuple(decay.shape)} do not describe T tokens of H heads")
    S = v.new_zeros(H, K, V) if initial_state is None else initial_state.to(v.dtype).clone()
    keep = torch.exp(-decay.to(v.dtype))[:, None, None]
    outputs, states = [], []
    for t in range(T):
        S = keep * S + torch.einsum("hk,hv->hkv", k[t], v[t])
        outputs.append(scale * torch.einsum("hk,hkv->hv", q[t], S))
        if keep_states:
            states.append(S)
    o = torch.stack(outputs) if T else v.new_zeros(0, H, V)
    kept = None
    if keep_states:
        kept = torch.stack(states) if T else S.new_zeros((0, *S.shape))
    return LightningResult(o, S, kept)


def term_magnitudes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float,
                    initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """Per output element, the root sum of squares of the terms :func:`lightning_attention` adds up for it
    (``scale * q_t[i] * k_s[i] * v_s * exp(-lambda * (t - s))``, and the carried state's): the size the output
    would have without cancellation. The output is a signed sum, not a convex combination, so where its terms
    cancel it is small beside them, and so is any relative error measured against it. Each term squared is the
    same recurrence over squared inputs with twice the decay."""
    sq = None if initial_state is None else initial_state.to(v.dtype) ** 2
    return lightning_attention(q * q, k * k, v * v, 2 * decay, scale=scale**2, initial_state=sq).o.sqrt()


def lightning_attention_closed_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *,
                                    scale: float, initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """The same outputs as :func:`lightning_attention`, written as one sum per token (no state update): a second
    definition the tests hold the recurrence to."""
    T, H, V = v.shape
    t = torch.arange(T, dtype=v.dtype)
    gap = t[:, None] - t[None, :]  # t - s
    weight = torch.where(gap >= 0, torch.exp(-decay.to(v.dtype)[:, None, None] * gap.clamp(min=0)),
                         torch.zeros((), dtype=v.dtype))  # (H, T, T)
    scores = torch.einsum("thk,shk->hts", q, k) * weight
    o = scale * torch.einsum("hts,shv->thv", scores, v)
    if initial_state is not None:
        carried = torch.exp(-decay.to(v.dtype)[None, :] * (t[:, None] + 1))  # (T, H)
        o = o + scale * carried[..., None] * torch.einsum("thk,hkv->thv", q, initial_state.to(v.dtype))
    return o

