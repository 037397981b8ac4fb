"""Dense multi-head attention: the readable oracle for every MHA kernel."""

from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float, causal: bool = True,
              mask: torch.Tensor | None = None, sliding_window: int | None = None,
              logit_cap: float | None = None) -> torch.Tensor:
    """Attention of ``q (Lq, H, D)`` over ``k (Lk, Hk, D)``, ``v (Lk, Hk, Dv)`` -> ``(Lq, H, Dv)``.

    GQA: query head h reads kv head ``h // (H // Hk)``. ``causal`` is aligned to the end: query i sits at
    position ``Lk - Lq + i`` and sees keys at positions up to its own. ``mask (Lq, Lk)`` bool (True = may
    attend) is combined with causal by AND. ``sliding_window`` = window_left: position p sees keys in
    ``[p - sliding_window, p]``. ``logit_cap``: scores become ``cap * tanh(scores / cap)`` after scaling.
    A query that sees no key returns zeros. Computed in the inputs' dtype.
    """
    Lq, H, _ = q.shape
    Lk, Hk, _ = k.shape
    if H % Hk:
        raise ValueError(f"{H} query heads are not a multiple of {Hk} kv heads")
    group = H // Hk
    kv_head = torch.arange(H, device=q.device) // group
    scores = torch.einsum("qhd,khd->hqk", q, k[:, kv_head]) * sm_scale
    if logit_cap is not None:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    q_pos = torch.arange(Lk - Lq, Lk, device=q.device)[:, None]
    k_pos = torch.arange(Lk, device=q.device)[None, :]
    visible = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos >= q_pos - sliding_window
    if mask is not None:
        visible &= mask.to(torch.bool)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible[None], probs, torch.zeros_like(probs))  # rows with no key: 0, not NaN
    return torch.einsum("hqk,khd->qhd", probs, v[:, kv_head])
