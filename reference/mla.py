"""DeepSeek multi-head latent attention in both forms, which compute the same function.

Per token the cache holds the latent ``ckv (kv_lora_rank,)`` and the rotary key ``kpe (qk_rope_head_dim,)``,
shared by all heads. ``w_kc (H, nope, C)`` maps the latent to each head's non-rotary key, ``w_vc (H, C, V)``
to each head's value.
"""

from __future__ import annotations

import torch

from reference.mha import attention


def absorb_query(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """``q_nope (Lq, H, N)`` -> the query in latent space ``(Lq, H, C)``: q_latent = q_nope @ w_kc[h]."""
    return torch.einsum("lhn,hnc->lhc", q_nope, w_kc.to(q_nope.dtype))


def expand_kv(ckv: torch.Tensor, kpe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent ``ckv (Lk, C)``, ``kpe (Lk, R)`` -> per-head ``k (Lk, H, N + R)`` and ``v (Lk, H, V)``."""
    k_nope = torch.einsum("hnc,lc->lhn", w_kc.to(ckv.dtype), ckv)
    k = torch.cat([k_nope, kpe[:, None, :].expand(-1, w_kc.shape[0], -1)], dim=-1)
    v = torch.einsum("lc,hcv->lhv", ckv, w_vc.to(ckv.dtype))
    return k, v


def attention_absorbed(q_nope, q_pe, ckv, kpe, w_kc, w_vc, *, sm_scale: float, causal: bool = True,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """MLA as multi-query attention over the latent cache, then up-projected.

    ``q_nope (Lq, H, N)``, ``q_pe (Lq, H, R)``, ``ckv (Lk, C)``, ``kpe (Lk, R)`` -> ``(Lq, H, V)``. Scores are
    ``(q_latent . ckv + q_pe . kpe) * sm_scale``; the output ``P @ ckv`` is mapped by ``w_vc``.
    """
    q = torch.cat([absorb_query(q_nope, w_kc), q_pe], dim=-1)
    k = torch.cat([ckv, kpe], dim=-1)[:, None, :]
    o_latent = attention(q, k, ckv[:, None, :], sm_scale=sm_scale, causal=causal, mask=mask)
    return torch.einsum("lhc,hcv->lhv", o_latent, w_vc.to(o_latent.dtype))


def attention_expanded(q_nope, q_pe, ckv, kpe, w_kc, w_vc, *, sm_scale: float, causal: bool = True,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """MLA as ordinary MHA over keys and values expanded from the latent; same arguments and result as
    :func:`attention_absorbed`."""
    k, v = expand_kv(ckv, kpe, w_kc, w_vc)
    return attention(torch.cat([q_nope, q_pe], dim=-1), k, v, sm_scale=sm_scale, causal=causal, mask=mask)
