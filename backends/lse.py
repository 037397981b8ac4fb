"""Partial attention with log-sum-exp, and merging partial results (as FlashInfer's ``merge_state``)."""

from __future__ import annotations

import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one block of keys, keeping the log-sum-exp so blocks can be merged.

    q ``(Lq, H, D)``, k ``(Lk, H, D)``, v ``(Lk, H, Dv)`` (kv heads already expanded), mask ``(Lq, Lk)``
    bool or None. Returns o ``(Lq, H, Dv)`` in q's dtype and lse ``(Lq, H)`` float32 (natural log;
    -inf where a row sees no key, with o = 0 there). Computed in float32.
    """
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse[..., None]), 0.0))
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("hqk,khd->qhd", p, v.float())
    return o.to(q.dtype), lse.transpose(0, 1).contiguous()


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets: o ``(Lq, H, Dv)``, lse ``(Lq, H)`` float32."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    o = o_a.float() * w_a + o_b.float() * w_b
    return o.to(o_a.dtype), lse
