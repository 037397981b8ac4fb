"""Two-batch overlap: where a batch splits, and the two child ForwardBatches (DESIGN.md section 4).

The rules follow SGLang's two_batch_overlap: EXTEND splits between requests at the most balanced point,
unless that leaves a side under ``TBO_TOKEN_THRESHOLD`` of the tokens; then a two-chunk split cuts at
``total // 2`` inside one request, whose first part goes to child A and the rest to child B as an extend
whose prefix grew by the part in A. DECODE splits at ``B // 2``; TARGET_VERIFY at ``B // 2`` requests,
``split_seq * draft_token_num`` tokens. Other modes are not split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from batch.forward_batch import ForwardBatch, SpecInfo
from batch.spec import ForwardMode

TBO_TOKEN_THRESHOLD = 0.48


def balanced_split_index(extend_lens: list[int]) -> int:
    """Index i that makes sum(lens[:i]) and sum(lens[i:]) closest (first best from the left)."""
    total, left, best, best_diff = sum(extend_lens), 0, 0, float("inf")
    for i in range(1, len(extend_lens)):
        left += extend_lens[i - 1]
        diff = abs(left - (total - left))
        if diff <= best_diff:
            best, best_diff = i, diff
        else:
            break
    return best


def two_chunk_split_enabled(extend_lens: list[int]) -> bool:
    total = sum(extend_lens)
    left = sum(extend_lens[:balanced_split_index(extend_lens)])
    return left < total * TBO_TOKEN_THRESHOLD or left > total * (1 - TBO_TOKEN_THRESHOLD)


@dataclass(frozen=True)
class TboSplit:
    """Where a batch splits. ``two_chunk``: request ``split_seq`` straddles the cut at ``split_token``."""

    split_seq: int
    split_token: int
    two_chunk: bool = False


def compute_split(mode: ForwardMode, extend_lens: list[int], draft_token_num: int | None = None) -> TboSplit | None:
    """The split of a batch, or None when it does not split (a side would be empty, or mode not split)."""
    B, T = len(extend_lens), sum(extend_lens)
    if mode is ForwardMode.EXTEND:
        if T < 2:
            return None
        if two_chunk_split_enabled(extend_lens):
            half, left = T // 2, 0
            for i, n in enumerate(extend_lens):
                if left + n > half:
                    # A cut exactly at a request boundary needs no chunking.
                    return TboSplit(i, half, two_chunk=half > left)
                left += n
        split = TboSplit(balanced_split_index(extend_lens), sum(extend_lens[:balanced_split_index(extend_lens)]))
    elif mode is ForwardMode.DECODE:
        split = TboSplit(B // 2, B // 2)
    elif mode is ForwardMode.TARGET_VERIFY:
        split = TboSplit(B // 2, (B // 2) * draft_token_num)
    else:
        return None
    if split.split_token == 0 or split.split_token == T:
        return None
    return split


def slice_spec_info(spec_info: SpecInfo | None, seq_lens: list[int], req: slice) -> SpecInfo | None:
    """The speculative inputs of requests ``req`` (verify masks are per-request blocks of D x (seq + D))."""
    if spec_info is None:
        return None
    D = spec_info.draft_token_num
    mask, positions = spec_info.custom_mask, spec_info.positions
    if mask is not None:
        block = [D * (s + D) for s in seq_lens]
        start = sum(block[: req.start])
        mask = mask[start:start + sum(block[req])]
    if positions is not None:
        positions = positions[req.start * D: req.stop * D]
    return SpecInfo(D, spec_info.topk, spec_info.spec_steps, mask, positions, spec_info.parents[req],
                    spec_info.accept_length[req], spec_info.accept_length_cpu[req], spec_info.algorithm)


def sub_batch(fb: ForwardBatch, req: slice | torch.Tensor, tok: slice | torch.Tensor, prefix: list[int], extend: list[int],
              mode: ForwardMode | None = None) -> ForwardBatch:
    """A batch of requests ``req`` of ``fb`` with query rows ``tok`` and the given lengths, sharing the
    pools and ``req_to_token``. Used for TBO children and for chunked-prefill equivalences."""
    dev = fb.device
    mode = mode or fb.forward_mode
    seq_lens = prefix if mode.is_target_verify() else [p + e for p, e in zip(prefix, extend)]
    starts, total = [], 0
    for e in extend:
        starts.append(total)
        total += e
    return dataclasses.replace(
        fb,
        forward_mode=mode,
        batch_size=len(extend),
        req_pool_indices=fb.req_pool_indices[req],
        seq_lens=torch.tensor(seq_lens, dtype=fb.seq_lens.dtype, device=dev),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        extend_seq_lens=torch.tensor(extend, dtype=torch.int32, device=dev),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        extend_seq_lens_cpu=list(extend),
        extend_prefix_lens_cpu=list(prefix),
        extend_num_tokens=total,
        positions=fb.positions[tok],
        mrope_positions=None if fb.mrope_positions is None else fb.mrope_positions[:, tok],
        out_cache_loc=fb.out_cache_loc[tok],
        state_slots=fb.state_slots[req],
        spec_info=slice_spec_info(fb.spec_info, fb.seq_lens_cpu.tolist(), req) if mode is fb.forward_mode else None,
        num_token_non_padded=total,
        tbo_split_seq_index=None,
        tbo_split_token_index=None,
        tbo_children=None,
    )


def split_forward_batch(fb: ForwardBatch, split: TboSplit) -> list[ForwardBatch]:
    """The two child batches of ``fb`` at ``split``; per-request fields by request, per-token by token."""
    prefix, extend = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
    s, t = split.split_seq, split.split_token
    if not split.two_chunk:
        return [sub_batch(fb, slice(0, s), slice(0, t), prefix[:s], extend[:s]),
                sub_batch(fb, slice(s, len(extend)), slice(t, fb.extend_num_tokens), prefix[s:], extend[s:])]
    part_a = t - sum(extend[:s])  # tokens of request s that stay in child A
    a = sub_batch(fb, slice(0, s + 1), slice(0, t), prefix[: s + 1], extend[:s] + [part_a])
    b = sub_batch(fb, slice(s, len(extend)), slice(t, fb.extend_num_tokens),
               [prefix[s] + part_a] + prefix[s + 1:], [extend[s] - part_a] + extend[s + 1:])
    return [a, b]


def attach_tbo_children(fb: ForwardBatch) -> TboSplit | None:
    """Compute the split of ``fb`` and attach its children (as the scheduler does with TBO on)."""
    D = fb.spec_info.draft_token_num if fb.spec_info is not None else None
    split = compute_split(fb.forward_mode, list(fb.extend_seq_lens_cpu), D)
    if split is None:
        fb.tbo_children = None
        return None
    fb.tbo_split_seq_index = split.split_seq
    fb.tbo_split_token_index = split.split_token
    fb.tbo_children = split_forward_batch(fb, split)
    return split
