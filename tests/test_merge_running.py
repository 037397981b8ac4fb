"""The float32 running merge the harness's FlashInfer MLA backend folds its prefix chunks with (a GPU backend; the
merge is plain torch, so it is held to a direct softmax here, on any device)."""

from __future__ import annotations

import torch

from backends.flashinfer import merge_running


def _partial(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one chunk of keys, as FlashInfer returns it: o [T, H, D] in the model's dtype (bf16) and lse
    [T, H] in float32, base 2."""
    o = torch.einsum("thk,khd->thd", scores.softmax(-1), values)
    return o.to(torch.bfloat16), (torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0, dtype=scores.dtype))).float()


def test_folding_chunks_one_by_one_equals_attention_over_all_keys():
    g = torch.Generator().manual_seed(0)
    T, H, D, chunks, width = 3, 2, 8, 40, 7  # 40 chunks: rounding the running state at each merge exceeds the bound
    scores = torch.randn(T, H, chunks * width, generator=g, dtype=torch.float64) * 4
    values = torch.randn(chunks * width, H, D, generator=g, dtype=torch.float64)
    full, _ = _partial(scores, values)
    o, lse = _partial(scores[..., :width], values[:width])
    for c in range(1, chunks):
        keys = slice(c * width, (c + 1) * width)
        o, lse = merge_running(o, lse, *_partial(scores[..., keys], values[keys]))
    assert o.dtype == torch.float32  # the running state stays float32 over every chunk
    # Each chunk's output was rounded to bf16 once (u = 2^-8 of its values' size); the merge is a convex combination
    # of them computed in float32, so the result stays within that one rounding, however many chunks
    bound = 2.0**-8 * values.abs().max().item()
    assert (o.double() - full).abs().max().item() <= bound
