"""Dense multi-head attention for one request: the readable oracle for every MHA kernel.

Positions are aligned to the end: with ``Lq`` query rows over ``Lk`` keys, query ``i`` sits at position
``Lk - Lq + i`` (the new tokens are the last ``Lq`` of the sequence), which covers prefill, chunked prefill
and decode with one rule.
"""

from __future__ import annotations

import torch


def visible_keys(num_queries: int, num_keys: int, *, causal: bool = True, mask: torch.Tensor | None = None,
                 sliding_window: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Which keys each query row may attend to.

    Parameters
    ----------
    num_queries, num_keys : int
        ``Lq`` and ``Lk``; query ``i`` sits at position ``Lk - Lq + i``, key ``j`` at position ``j``.
    causal : bool
        Keys after the query's own position are hidden.
    mask : torch.Tensor | None
        ``(Lq, Lk)``, bool, True = may attend; ANDed with the rest.
    sliding_window : int | None
        window_left: a query at position ``p`` sees only keys in ``[p - sliding_window, p]`` (the upper
        end comes from ``causal``).
    device : torch.device | str | None
        Where to build the result.

    Returns
    -------
    torch.Tensor
        ``(Lq, Lk)``, bool.
    """
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos >= q_pos - sliding_window
    if mask is not None:
        if tuple(mask.shape) != (num_queries, num_keys):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected (Lq, Lk) = ({num_queries}, {num_keys})")
        visible &= mask.to(device=visible.device, dtype=torch.bool)
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float, causal: bool = True,
              mask: torch.Tensor | None = None, sliding_window: int | None = None,
              logit_cap: float | None = None) -> torch.Tensor:
    """Softmax attention of one request, computed in the inputs' dtype.

    ``scores = q . k * sm_scale``; with ``logit_cap``, ``scores = logit_cap * tanh(scores / logit_cap)``;
    hidden keys (see :func:`visible_keys`) are dropped; ``o = softmax(scores) @ v``. A query row that sees
    no key at all returns zeros, not NaN.

    Parameters
    ----------
    q : torch.Tensor
        ``(Lq, num_qo_heads, head_dim)``.
    k : torch.Tensor
        ``(Lk, num_kv_heads, head_dim)``.
    v : torch.Tensor
        ``(Lk, num_kv_heads, v_head_dim)``.
    sm_scale : float
        Multiplies ``q . k`` (usually ``head_dim ** -0.5``).
    causal : bool
        End-aligned causal masking (query ``i`` at position ``Lk - Lq + i``).
    mask : torch.Tensor | None
        ``(Lq, Lk)``, bool, True = may attend; ANDed with causal. Tree verification passes
        ``causal=False`` and the full mask.
    sliding_window : int | None
        window_left: a query at position ``p`` sees key positions ``[p - sliding_window, p]``.
    logit_cap : float | None
        tanh soft cap applied after ``sm_scale`` and before masking.

    Returns
    -------
    torch.Tensor
        ``(Lq, num_qo_heads, v_head_dim)`` in q's dtype. GQA: query head ``h`` reads kv head
        ``h // (num_qo_heads // num_kv_heads)``.
    """
    Lq, H, _ = q.shape
    Lk, Hk, _ = k.shape
    if Hk == 0 or H % Hk:
        raise ValueError(f"{H} query heads are not a multiple of {Hk} kv heads; GQA needs H % Hk == 0")
    kv_head = torch.arange(H, device=q.device) // (H // Hk)
    k, v = k[:, kv_head], v[:, kv_head]  # (Lk, H, D): one kv head per query head
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if logit_cap is not None:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    visible = visible_keys(Lq, Lk, causal=causal, mask=mask, sliding_window=sliding_window, device=q.device)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    # A row with no visible key is all -inf and softmaxes to NaN; kernels return 0 there.
    probs = probs.masked_fill(~visible, 0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def attention_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, *,
                     sm_scale: float, logit_cap: float | None = None,
                     magnitudes: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` for a batch of requests padded to common lengths, visibility given explicitly.

    The same formula, one request per leading index: for request ``b`` with ``lq`` query rows and ``lk``
    keys, ``out[b, :lq]`` equals ``attention(q[b, :lq], k[b, :lk], v[b, :lk], causal=False,
    mask=visible[b, :lq, :lk], ...)`` as long as ``visible`` hides the padding keys. Padding query rows that
    see no key are zeros. One call does a whole batch, so the reference costs a few large tensor ops per
    layer instead of a dozen small ones per request.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Lq, num_qo_heads, head_dim)``.
    k : torch.Tensor
        ``(B, Lk, num_kv_heads, head_dim)``.
    v : torch.Tensor
        ``(B, Lk, num_kv_heads, v_head_dim)``.
    visible : torch.Tensor
        ``(B, Lq, Lk)``, bool, True = may attend (causality, windows and padding all folded in).
    sm_scale, logit_cap
        As in :func:`attention`.
    magnitudes : bool
        Also return each output element's magnitude ``sum_j p_j |v_j|``: the probability-weighted size of the
        values it averages, which the rounding of every term it is computed from scales with; and each query
        row's score size ``sm_scale * |q| * max_j |k_j|`` over the keys it sees, which a score's own rounding
        scales with (the element bound of ``properties/tolerances.py``).

    Returns
    -------
    torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``(B, Lq, num_qo_heads, v_head_dim)`` in q's dtype; GQA as in :func:`attention`. With ``magnitudes``,
        a second tensor of the same shape and the score sizes, ``(B, Lq, num_qo_heads)``.
    """
    B, Lq, H, D = q.shape
    Hk = k.shape[2]
    if Hk == 0 or H % Hk:
        raise ValueError(f"{H} query heads are not a multiple of {Hk} kv heads; GQA needs H % Hk == 0")
    # Query head h = kv head h // group, member h % group: a view, so no copy of k per query head.
    q = q.reshape(B, Lq, Hk, H // Hk, D)
    scores = torch.einsum("bqkgd,bskd->bkgqs", q, k) * sm_scale
    if logit_cap is not None:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    hidden = ~visible[:, None, None]  # (B, 1, 1, Lq, Lk), broadcast over heads
    probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
    probs = probs.masked_fill_(hidden, 0.0)  # rows with no visible key: NaN -> 0, as in attention
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B, Lq, H, v.shape[-1])
    if not magnitudes:
        return out
    key_norms = torch.linalg.vector_norm(k, dim=-1)  # (B, Lk, Hk)
    seen = torch.where(visible[..., None], key_norms[:, None], 0.0).amax(dim=2)  # (B, Lq, Hk): largest key seen
    sizes = abs(sm_scale) * torch.linalg.vector_norm(q, dim=-1) * seen[..., None]  # (B, Lq, Hk, G)
    return (out, torch.einsum("bkgqs,bskd->bqkgd", probs, v.abs()).reshape(B, Lq, H, v.shape[-1]),
            sizes.reshape(B, Lq, H))
