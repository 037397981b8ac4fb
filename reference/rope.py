"""Rotary position embeddings: plain RoPE and Qwen2-VL multimodal RoPE, NeoX (rotate-halves) layout.

The rotary part of a head, ``x[..., :rotary_dim]``, is split into two halves ``x1``, ``x2``; frequency
``j`` rotates the pair ``(x1[j], x2[j])`` by the angle ``position * theta ** (-2j / rotary_dim)``.
"""

from __future__ import annotations

import torch


def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # Always float64: the angles are the input of every comparison, so they must not carry float32
    # rounding (at position 4096 that would already be ~2e-4 rad).
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return theta ** -exponents


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, *, theta: float = 10000.0,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles.

    Parameters
    ----------
    positions : torch.Tensor
        ``(nnz_qo,)``, int64: absolute position of each token.
    rotary_dim : int
        Number of rotated dimensions of a head (even).
    theta : float
        RoPE base; ``inv_freq[j] = theta ** (-2j / rotary_dim)``.
    dtype : torch.dtype
        dtype of the returned tensors; the angles are computed in float64 and rounded once.

    Returns
    -------
    cos, sin : tuple[torch.Tensor, torch.Tensor]
        Each ``(nnz_qo, rotary_dim // 2)`` in ``dtype``: ``cos[t, j] = cos(positions[t] * inv_freq[j])``.
    """
    angles = positions.to(torch.float64)[:, None] * _inv_freq(rotary_dim, theta, positions.device)[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def mrope_cos_sin(mrope_positions: torch.Tensor, rotary_dim: int, sections: tuple[int, int, int], *,
                  theta: float = 10000.0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of Qwen2-VL multimodal RoPE (contiguous sections, not interleaved).

    Frequency ``j`` takes its angle from row 0 (temporal) for ``j < s0``, from row 1 (height) for
    ``s0 <= j < s0 + s1`` and from row 2 (width) after. For a text token the three rows are equal and this
    is plain RoPE.

    Parameters
    ----------
    mrope_positions : torch.Tensor
        ``(3, nnz_qo)``, int64: temporal, height and width positions of each token.
    rotary_dim : int
        Number of rotated dimensions of a head (even).
    sections : tuple[int, int, int]
        ``(s0, s1, s2)`` frequencies per row; must sum to ``rotary_dim // 2``.
    theta : float
        RoPE base, as in :func:`rope_cos_sin`.
    dtype : torch.dtype
        dtype of the returned tensors.

    Returns
    -------
    cos, sin : tuple[torch.Tensor, torch.Tensor]
        Each ``(nnz_qo, rotary_dim // 2)`` in ``dtype``.
    """
    if len(sections) != 3 or sum(sections) != rotary_dim // 2:
        raise ValueError(f"mrope sections {tuple(sections)} must be 3 counts summing to rotary_dim // 2 = "
                         f"{rotary_dim // 2}; fix the sections or the rotary_dim")
    device = mrope_positions.device
    # Built on the device with no host-to-device copy, so the model side can rotate inside a CUDA graph.
    row_of_freq = torch.cat([torch.full((n,), row, dtype=torch.int64, device=device)
                             for row, n in enumerate(sections)])  # (rotary_dim // 2,)
    positions = mrope_positions.to(torch.float64)[row_of_freq].T  # (nnz_qo, rotary_dim // 2)
    angles = positions * _inv_freq(rotary_dim, theta, device)[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dimensions of every head, NeoX style.

    With ``x1 = x[..., :rotary_dim // 2]`` and ``x2 = x[..., rotary_dim // 2:rotary_dim]`` the result is
    ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:])``.

    Parameters
    ----------
    x : torch.Tensor
        ``(nnz_qo, num_heads, head_dim)``.
    cos, sin : torch.Tensor
        ``(nnz_qo, rotary_dim // 2)``, from :func:`rope_cos_sin` or :func:`mrope_cos_sin`; cast to x's dtype.
    rotary_dim : int | None
        Number of rotated dimensions; None means ``2 * cos.shape[-1]``. Dimensions past it pass through.

    Returns
    -------
    torch.Tensor
        ``(nnz_qo, num_heads, head_dim)`` in x's dtype.
    """
    half = cos.shape[-1]
    if rotary_dim is None:
        rotary_dim = 2 * half
    if rotary_dim != 2 * half or rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} needs cos/sin with {rotary_dim // 2} columns (got {half}) "
                         f"and at most head_dim {x.shape[-1]}")
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
