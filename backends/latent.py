"""MLA's up-projections as a serving engine applies them (the model's ``kv_b_proj``), for the backends and
the model side. Written apart from ``reference/mla.py`` on purpose: a differential test cannot see a bug in
code that the backend and the oracle share.
"""

from __future__ import annotations

import torch


def latent_to_heads(latent: torch.Tensor, kv_lora_rank: int, w_kc: torch.Tensor,
                    w_vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values from latent cache rows.

    latent ``[L, kv_lora_rank + rope]`` (ckv, then the rotated kpe shared by every head),
    w_kc ``[H, nope, kv_lora_rank]``, w_vc ``[H, kv_lora_rank, Dv]``
    -> k ``[L, H, nope + rope]`` (head h: ``w_kc[h] @ ckv`` then kpe), v ``[L, H, Dv]`` (``ckv @ w_vc[h]``),
    in float32.
    """
    lat = latent.float()
    ckv, kpe = lat[:, :kv_lora_rank], lat[:, kv_lora_rank:]
    H = w_kc.shape[0]
    # One product per head over all rows (a broadcast matmul would copy the weights once per row: a 32k-token
    # prefix asked for 128 GiB)
    k_nope = torch.einsum("hnc,lc->lhn", w_kc.float(), ckv)  # [L, H, nope]
    k = torch.cat([k_nope, kpe[:, None, :].expand(-1, H, -1)], dim=-1)
    v = torch.einsum("lc,hcv->lhv", ckv, w_vc.float())  # [L, H, Dv]
    return k, v


def query_to_latent(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """Absorb ``w_kc`` into the non-rotary query: q_nope ``[T, H, nope]`` -> ``[T, H, kv_lora_rank]`` in
    float32 (``q_latent[t, h] = q_nope[t, h] @ w_kc[h]``)."""
    return torch.einsum("thn,hnc->thc", q_nope.float(), w_kc.float())


def latent_to_output(o_latent: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """Up-project an absorbed output: ``[T, H, kv_lora_rank]`` -> ``[T, H, Dv]`` in float32."""
    return torch.einsum("thc,hcv->thv", o_latent.float(), w_vc.float())
