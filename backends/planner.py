"""Planning shared by backends: turning a ForwardBatch into indptrs and indices.

Kept apart from the kernels (plan once per batch, run per layer). Every function states whether it plans
token slots (page size 1 as the kernel sees it) or pages, and whether new tokens are included.
"""

from __future__ import annotations

import torch

from backends.base import PlannedMetadata


def exclusive_cumsum(lens: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B+1]`` int32 indptr starting at 0."""
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens, 0)
    return out


def token_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level plan: ``kv_indptr[B+1]`` int32 and ``kv_indices[sum(kv_lens)]`` int64.

    Request i's keys are ``req_to_token[req_pool_indices[i], :kv_lens[i]]``.
    """
    kv_indptr = exclusive_cumsum(kv_lens)
    rows = [req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(), kv_lens.tolist())]
    kv_indices = torch.cat(rows).to(torch.int64) if rows else torch.zeros(0, dtype=torch.int64,
                                                                           device=req_to_token.device)
    return kv_indptr, kv_indices


def page_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page-level plan: ``kv_indptr[B+1]`` (in pages), ``kv_indices`` (page ids) and ``kv_last_page_len[B]``.

    A request of n keys spans ceil(n / page_size) pages; its last page holds ``(n - 1) % page_size + 1``
    keys (page_size when full). A request with no keys has no pages and last-page length 0.
    """
    num_pages = (kv_lens + page_size - 1) // page_size
    kv_indptr = exclusive_cumsum(num_pages)
    rows = [req_to_token[r, : n * page_size : page_size] // page_size
            for r, n in zip(req_pool_indices.tolist(), num_pages.tolist())]
    device = req_to_token.device
    kv_indices = torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, dtype=torch.int32, device=device)
    last = torch.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, torch.zeros_like(kv_lens)).to(torch.int32)
    return kv_indptr, kv_indices, last


def plan_token_level(forward_batch) -> PlannedMetadata:
    """The plan of a token-level backend (torch-native, Triton).

    Extend-like modes read the prefix from the cache (new tokens come from the call's k/v); decode reads all
    ``seq_lens`` keys from the cache, the new one included (the backend writes it first).
    """
    fb = forward_batch
    mode = fb.forward_mode
    if mode.is_idle():
        z = torch.zeros(1, dtype=torch.int32, device=fb.device)
        return PlannedMetadata(qo_indptr=z, kv_indptr=z, kv_indices=torch.zeros(0, dtype=torch.int64, device=fb.device))
    if mode.is_decode():
        qo_indptr = torch.arange(fb.batch_size + 1, dtype=torch.int32, device=fb.device)
        kv_indptr, kv_indices = token_kv_indices(fb.req_to_token, fb.req_pool_indices, fb.seq_lens)
        return PlannedMetadata(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                               kv_includes_new_tokens=True)
    qo_indptr = exclusive_cumsum(fb.extend_seq_lens)
    kv_indptr, kv_indices = token_kv_indices(fb.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens.to(torch.int64))
    meta = PlannedMetadata(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices)
    if mode.is_target_verify():
        D = fb.spec_info.draft_token_num
        meta.custom_mask = fb.spec_info.custom_mask
        meta.mask_indptr = exclusive_cumsum(D * (fb.seq_lens + D))
    return meta
