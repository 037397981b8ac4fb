"""Numerics shared by the attention kernels: the logit soft-cap, and GPU-like rounding for the interpreter.

Triton's CPU interpreter differs from compiled code in two ways that matter here (seen with triton 3.9):
``tl.dot`` on bfloat16 operands multiplies their raw 16-bit patterns as integers (bfloat16 is held as
uint16 in numpy), and a float32 -> bfloat16 cast truncates instead of rounding to nearest even (its
round-to-nearest mode can lose the carry into the exponent). So when ``INTERPRETED`` is set, operands are
upcast to float32, and values that a GPU would round to a 16-bit type are rounded to nearest even by
hand and kept in float32: the same numbers the GPU computes with, up to summation order.

Each call of one ``triton.jit`` function from another costs the interpreter about half a millisecond (it
re-patches ``triton.language``), so the kernels do the interpreter's conversions inline and call these
helpers only where they are needed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)``, from exp2 of a non-positive argument: it cannot overflow, and ``tl`` has no
    portable tanh."""
    t = tl.exp2(-2.8853900817779268 * tl.abs(s / cap))  # exp(-2|x|); 2.885... = 2 / ln 2
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(s >= 0, th, -th)


@triton.jit
def round_like_gpu(x, dtype: tl.constexpr):
    """For the interpreter: float32 ``x`` rounded to the 16-bit ``dtype`` to nearest even, kept in float32
    (it holds the value exactly, so a later cast to ``dtype`` is exact)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)  # float16: numpy's cast rounds to nearest even


def is_interpreted(kernel) -> bool:
    """Whether ``triton.jit`` gave an interpreted function (``TRITON_INTERPRET=1`` when it ran)."""
    return not isinstance(kernel, triton.runtime.jit.JITFunction)
