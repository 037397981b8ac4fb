"""Input checks of the kernels' launch wrappers: each failure is one line that says what to fix."""

from __future__ import annotations

import torch


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def check_index(name: str, t: torch.Tensor, numel: int | None = None) -> None:
    """A contiguous 1-D int32/int64 tensor (of ``numel`` entries when given)."""
    require(t.dim() == 1 and t.dtype in (torch.int32, torch.int64) and t.stride(0) == 1,
            f"{name} must be a contiguous 1-D int32/int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    require(numel is None or t.numel() == numel, f"{name} must have batch_size + 1 = {numel} entries, got {t.numel()}")
