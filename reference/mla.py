"""DeepSeek multi-head latent attention (MLA) in its two forms, which compute the same function.

Per token the cache holds the latent ``ckv (kv_lora_rank,)`` and the rotary key ``kpe (qk_rope_head_dim,)``,
shared by all heads. ``w_kc (H, N, C)`` maps the latent to each head's non-rotary key and ``w_vc (H, C, V)``
to each head's value (N = qk_nope_head_dim, R = qk_rope_head_dim, C = kv_lora_rank, V = v_head_dim).

- absorbed (decode): fold ``w_kc`` into the query, attend over the latent as multi-query attention with a
  single kv head of dim ``C + R`` and value ``ckv``, then up-project the latent output with ``w_vc``;
- expanded (prefill): rebuild per-head k and v from the latent and run ordinary MHA.

Weights are cast to the activations' dtype so a float32 weight works with float64 activations.
"""

from __future__ import annotations

import torch

from reference.mha import attention, attention_padded


def absorb_query(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """Project the non-rotary query into the latent space.

    Parameters
    ----------
    q_nope : torch.Tensor
        ``(Lq, num_heads, qk_nope_head_dim)``.
    w_kc : torch.Tensor
        ``(num_heads, qk_nope_head_dim, kv_lora_rank)``.

    Leading dimensions other than ``Lq`` (a padded batch) pass through.

    Returns
    -------
    torch.Tensor
        ``(Lq, num_heads, kv_lora_rank)`` in q_nope's dtype:
        ``q_latent[l, h, c] = sum_n q_nope[l, h, n] * w_kc[h, n, c]``.
    """
    return torch.einsum("...hn,hnc->...hc", q_nope, w_kc.to(q_nope.dtype))


def expand_kv(ckv: torch.Tensor, kpe: torch.Tensor, w_kc: torch.Tensor,
              w_vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild per-head keys and values from the latent cache.

    Parameters
    ----------
    ckv : torch.Tensor
        ``(Lk, kv_lora_rank)``.
    kpe : torch.Tensor
        ``(Lk, qk_rope_head_dim)``, already rotated; shared by every head.
    w_kc : torch.Tensor
        ``(num_heads, qk_nope_head_dim, kv_lora_rank)``.
    w_vc : torch.Tensor
        ``(num_heads, kv_lora_rank, v_head_dim)``.

    Returns
    -------
    k, v : tuple[torch.Tensor, torch.Tensor]
        ``k (Lk, num_heads, qk_nope_head_dim + qk_rope_head_dim)`` = ``cat(w_kc[h] @ ckv[l], kpe[l])`` and
        ``v (Lk, num_heads, v_head_dim)`` = ``ckv[l] @ w_vc[h]``, in ckv's dtype.
    """
    H = w_kc.shape[0]
    k_nope = torch.einsum("hnc,lc->lhn", w_kc.to(ckv.dtype), ckv)
    k = torch.cat([k_nope, kpe.to(ckv.dtype)[:, None, :].expand(-1, H, -1)], dim=-1)
    v = torch.einsum("lc,hcv->lhv", ckv, w_vc.to(ckv.dtype))
    return k, v


def attention_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       w_kc: torch.Tensor, w_vc: torch.Tensor, *, sm_scale: float, causal: bool = True,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """MLA as multi-query attention over the latent cache, then up-projected.

    ``scores = (q_latent . ckv + q_pe . kpe) * sm_scale``, ``o_latent = softmax(scores) @ ckv``,
    ``o[l, h] = o_latent[l, h] @ w_vc[h]``.

    Parameters
    ----------
    q_nope : torch.Tensor
        ``(Lq, num_heads, qk_nope_head_dim)``.
    q_pe : torch.Tensor
        ``(Lq, num_heads, qk_rope_head_dim)``, already rotated.
    ckv : torch.Tensor
        ``(Lk, kv_lora_rank)``.
    kpe : torch.Tensor
        ``(Lk, qk_rope_head_dim)``, already rotated.
    w_kc : torch.Tensor
        ``(num_heads, qk_nope_head_dim, kv_lora_rank)``.
    w_vc : torch.Tensor
        ``(num_heads, kv_lora_rank, v_head_dim)``.
    sm_scale : float
        Score scale; DeepSeek uses ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, not the latent dim.
    causal, mask
        As in :func:`reference.mha.attention` (end-aligned causal; ``mask (Lq, Lk)`` bool, ANDed).

    Returns
    -------
    torch.Tensor
        ``(Lq, num_heads, v_head_dim)`` in q_nope's dtype.
    """
    q = torch.cat([absorb_query(q_nope, w_kc), q_pe], dim=-1)  # (Lq, H, C + R)
    k = torch.cat([ckv, kpe.to(ckv.dtype)], dim=-1)[:, None, :]  # (Lk, 1, C + R): one kv head for all
    o_latent = attention(q, k, ckv[:, None, :], sm_scale=sm_scale, causal=causal, mask=mask)  # (Lq, H, C)
    return torch.einsum("lhc,hcv->lhv", o_latent, w_vc.to(o_latent.dtype))


def attention_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       w_kc: torch.Tensor, w_vc: torch.Tensor, *, sm_scale: float, causal: bool = True,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """MLA as ordinary MHA over keys and values expanded from the latent (:func:`expand_kv`).

    Same arguments, shapes and result as :func:`attention_absorbed`; the query is
    ``cat(q_nope, q_pe) (Lq, num_heads, qk_nope_head_dim + qk_rope_head_dim)``.
    """
    k, v = expand_kv(ckv, kpe, w_kc, w_vc)
    return attention(torch.cat([q_nope, q_pe], dim=-1), k, v, sm_scale=sm_scale, causal=causal, mask=mask)


def attention_absorbed_padded(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                              w_kc: torch.Tensor, w_vc: torch.Tensor, visible: torch.Tensor, *,
                              sm_scale: float, magnitudes: bool = False
                              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_absorbed` for a batch of requests padded to common lengths (see
    :func:`reference.mha.attention_padded`): ``out[b, :lq]`` is request ``b``'s result with
    ``mask=visible[b, :lq, :lk]`` and ``causal=False``.

    Parameters
    ----------
    q_nope : torch.Tensor
        ``(B, Lq, num_heads, qk_nope_head_dim)``.
    q_pe : torch.Tensor
        ``(B, Lq, num_heads, qk_rope_head_dim)``, already rotated.
    ckv : torch.Tensor
        ``(B, Lk, kv_lora_rank)``.
    kpe : torch.Tensor
        ``(B, Lk, qk_rope_head_dim)``, already rotated.
    w_kc, w_vc, sm_scale
        As in :func:`attention_absorbed`.
    visible : torch.Tensor
        ``(B, Lq, Lk)``, bool, True = may attend.

    magnitudes : bool
        Also return each output element's magnitude: ``sum_c (sum_j p_j |ckv_j[c]|) |w_vc[h, c, v]|``, the size of
        the terms an absorbed kernel sums (the latent average, then its product with ``w_vc``). It is at least
        ``sum_j p_j |v_j|`` of the expanded values ``v_j = ckv_j . w_vc`` (triangle inequality), so it covers
        an expanded kernel's roundings too.

    Returns
    -------
    torch.Tensor | tuple[torch.Tensor, torch.Tensor]
        ``(B, Lq, num_heads, v_head_dim)`` in q_nope's dtype; with ``magnitudes``, a second such tensor and each
        query row's score size over its absorbed query and latent keys, ``(B, Lq, num_heads)``.
    """
    q = torch.cat([absorb_query(q_nope, w_kc), q_pe], dim=-1)  # (B, Lq, H, C + R)
    k = torch.cat([ckv, kpe.to(ckv.dtype)], dim=-1)[:, :, None, :]  # (B, Lk, 1, C + R): one kv head for all
    w_vc = w_vc.to(q.dtype)
    if not magnitudes:
        o_latent = attention_padded(q, k, ckv[:, :, None, :], visible, sm_scale=sm_scale)  # (B, Lq, H, C)
        return torch.einsum("blhc,hcv->blhv", o_latent, w_vc)
    o_latent, m_latent, sizes = attention_padded(q, k, ckv[:, :, None, :], visible, sm_scale=sm_scale,
                                                 magnitudes=True)
    return (torch.einsum("blhc,hcv->blhv", o_latent, w_vc), torch.einsum("blhc,hcv->blhv", m_latent, w_vc.abs()),
            sizes)
