"""The Triton kernels run compiled on a CUDA device and in Triton's interpreter elsewhere.

The interpreter must be chosen before triton is first imported (``triton.jit`` decides when a kernel is
defined), so this runs first and asks torch, not triton, whether a GPU is there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
