"""backends/interpreter.py's speedups of Triton's interpreter: each skips work whose result the interpreter throws
away, so a kernel computes bit for bit what it computes under Triton's own interpreter, with less done."""

from __future__ import annotations

import os

import pytest
import torch
from triton_kernel_cases import DecodeCase, make_decode_inputs

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton runs compiled here, not in its interpreter", allow_module_level=True)

import triton  # noqa: E402 - after the switch above is known
import triton.language as tl  # noqa: E402
from triton.language import semantic  # noqa: E402
from triton.runtime import interpreter as tri  # noqa: E402

from backends import interpreter  # noqa: E402
from backends.triton_kernels.decode_attention import decode_attention_fwd  # noqa: E402

CASE = DecodeCase(kv_lens=(1, 17, 40), head_dim=64, v_head_dim=64, dtype=torch.bfloat16, seed=3)


def decode() -> torch.Tensor:
    """SGLang-style split-KV decode with a logit cap (device functions in every program, int32 offsets)."""
    t = make_decode_inputs(CASE)
    decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], t["o"], t["kv_indptr"], t["kv_indices"], sm_scale=0.125,
                         logit_cap=30.0)
    return t["o"].clone()


@triton.jit
def _int32_product(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * tl.load(y_ptr + offs))


def test_the_interpreters_device_calls_compute_the_same_without_repatching(monkeypatch):
    """skip_repatching_in_device_calls: a device function called inside an interpreted kernel runs under the
    launch's patched triton.language; the outputs must be bit for bit those of Triton's own repatching at every
    call, with fewer patchings (the kernel calls soft_cap and round_like_gpu in every program)."""
    interpreter.skip_repatching_in_device_calls()
    patchings = []
    real_builtin = tri._patch_builtin
    monkeypatch.setattr(tri, "_patch_builtin", lambda *a: patchings.append(1) or real_builtin(*a))

    def run() -> tuple[torch.Tensor, int]:
        patchings.clear()
        return decode(), len(patchings)

    with monkeypatch.context() as m:  # Triton's own: the language patched again at each device call
        m.setitem(interpreter._device_calls, "skip", False)
        slow, slow_patchings = run()
    fast, fast_patchings = run()
    assert torch.equal(slow, fast)
    assert fast_patchings < slow_patchings / 4, (fast_patchings, slow_patchings)


def test_overflow_checks_are_skipped_only_where_their_verdict_is_discarded(monkeypatch):
    """skip_discarded_overflow_checks: the same outputs as Triton's own check-and-discard, without the check's
    comparisons; under the builder's debug option the check still runs and an int32 overflow still raises."""
    interpreter.skip_discarded_overflow_checks()
    fast_check = semantic.TritonSemantic.binary_op_sanitize_overflow_impl
    assert fast_check.skips_discarded
    comparisons = []
    real_less_equal = semantic.TritonSemantic.less_equal
    monkeypatch.setattr(semantic.TritonSemantic, "less_equal",
                        lambda *a, **k: comparisons.append(1) or real_less_equal(*a, **k))

    def run() -> tuple[torch.Tensor, int]:
        comparisons.clear()
        return decode(), len(comparisons)

    with monkeypatch.context() as m:  # Triton's own: every int32 +, -, * checked, the verdict thrown away
        m.setattr(semantic.TritonSemantic, "binary_op_sanitize_overflow_impl", fast_check.real)
        slow, slow_comparisons = run()
    fast, fast_comparisons = run()
    assert torch.equal(slow, fast)
    assert fast_comparisons < slow_comparisons / 2, (fast_comparisons, slow_comparisons)

    x = torch.full((4,), 1 << 20, dtype=torch.int32)
    y = torch.full((4,), 1 << 12, dtype=torch.int32)
    out = torch.ones(4, dtype=torch.int32)
    _int32_product[(1,)](x, y, out, BLOCK=4)
    assert torch.equal(out, torch.zeros(4, dtype=torch.int32))  # 2**32 wraps to 0, as in a compiled kernel
    options = tri.interpreter_builder.options
    monkeypatch.setattr(tri.interpreter_builder, "options", type(options)(**{**vars(options), "debug": True}))
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _int32_product[(1,)](x, y, out, BLOCK=4)


def test_the_numpy_dtype_table_answers_as_the_interpreters_own_function():
    """look_up_numpy_dtypes: the same numpy dtype for every Triton type (scalars, pointers, blocks of each), and a
    type the interpreter does not know, or cannot hash, raises from the interpreter's own function, as before."""
    interpreter.look_up_numpy_dtypes()
    fast = tri._get_np_dtype
    real = fast.real
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
               tl.float8e4b15]
    types = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4, 2]) for t in scalars]
    types += [tl.block_type(tl.pointer_type(tl.float16), [8])]
    assert [fast(t) for t in types] == [real(t) for t in types]
    assert len(fast.table) == len(scalars)
    with pytest.raises(KeyError) as raised:
        fast(tl.void)
    assert raised.traceback[-1].frame.code.raw is real.__code__  # raised by Triton's own function, as before
    with pytest.raises(TypeError) as raised:  # a type that cannot be hashed, as Triton's own function meets it
        fast(tl.tuple_type([tl.int32, tl.int32]))
    assert raised.traceback[-1].frame.code.raw is real.__code__
