"""Rotary position embeddings: plain RoPE and Qwen2-VL multimodal RoPE (NeoX rotate-halves layout)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, *, theta: float = 10000.0,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(T, rotary_dim // 2)`` for int64 ``positions (T,)``; inv_freq[j] = theta^(-2j / rotary_dim)."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def mrope_cos_sin(mrope_positions: torch.Tensor, rotary_dim: int, sections: tuple[int, int, int], *,
                  theta: float = 10000.0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE from ``mrope_positions (3, T)`` (temporal, height, width rows).

    Frequency j takes its angle from row 0 for j < s0, row 1 for s0 <= j < s0 + s1, row 2 after;
    ``sum(sections)`` must equal ``rotary_dim // 2``. Returns cos, sin ``(T, rotary_dim // 2)``.
    """
    if len(sections) != 3 or sum(sections) != rotary_dim // 2:
        raise ValueError(f"mrope sections {tuple(sections)} must be 3 counts summing to rotary_dim // 2 = {rotary_dim // 2}")
    cos_rows, sin_rows = zip(*(rope_cos_sin(mrope_positions[r], rotary_dim, theta=theta, dtype=dtype) for r in range(3)))
    row_of_freq = torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
    cos = torch.stack(cos_rows)[row_of_freq, :, torch.arange(rotary_dim // 2)].T
    sin = torch.stack(sin_rows)[row_of_freq, :, torch.arange(rotary_dim // 2)].T
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate ``x (T, H, D)`` by cos, sin ``(T, rotary_dim // 2)``: the first rotary_dim dims are split in two
    halves x1, x2 and become (x1 cos - x2 sin, x2 cos + x1 sin); later dims pass through."""
    rotary_dim = rotary_dim or 2 * cos.shape[-1]
    half = rotary_dim // 2
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
