"""Running the kernels SGLang ships (its Triton attention, and the fla kernels it vendors in
``sglang.kernels.ops.attention.fla``) under Triton's CPU interpreter (``TRITON_INTERPRET=1``). Applied by
:func:`backends.sglang.runtime.load` only when the interpreter is on; nothing is edited on disk and compiled
(GPU) runs never see these.

1. fla binds ``exp``/``exp2``/``log``/``log2`` as module-level aliases of ``tl.exp`` etc. (``fla/op.py``). The
   interpreter swaps ``triton.language``'s functions while it interprets a kernel, so an alias taken at import
   time is the unswapped builtin and fails. The stand-ins below are ``@triton.jit`` functions that call
   ``tl.*`` at interpretation time; they must live at module level in a module whose globals hold ``tl``
   (the interpreter looks it up there: "triton.language must be visible from within jit'd function").
2. fla enters ``torch.<device>.device(index)`` around each call; on a CPU-only machine the device resolves to
   "cpu" and ``torch.cpu.device`` does not exist: a null context instead.
3. ``triton.autotune`` benchmarks every configuration, which needs a GPU driver: keep the first one.
4. Triton 3.9's interpreter hands a load/store mask to its C++ helper, which accepts only a numpy bool array;
   SGLang's causal-conv update kernel (``kernels/ops/mamba/causal_conv1d_triton.py``,
   ``_causal_conv1d_update_kernel``) builds one from a scalar comparison ``&`` a tensor, which the interpreter
   leaves in another numpy dtype ("mask has unsupported dtype"). The mask's truth values are cast to bool.
5. Bounds: a compiled kernel that reads or writes out of bounds faults on the GPU (or corrupts silently); the
   interpreter dereferences raw host addresses, so it corrupts the process's heap and aborts it later, far
   from the cause ("munmap_chunk(): invalid pointer"). Every masked load and store is checked against the
   storages of the kernel's tensor arguments, and one outside them raises ``OutOfBounds`` naming the kernel.
6. fp8 downcasts: the interpreter's round-to-nearest-even downcast (``runtime/interpreter.py`` ``_convert_float``,
   Triton 3.8.0) ORs the carry of a rounded-up mantissa into the exponent field instead of adding it, so a value
   whose mantissa rounds up past all ones in a binade with an odd exponent field comes out halved (float32 1.97 ->
   e4m3 1.0, not 2.0; 0.496 -> 0.25), and it rounds ties away from zero. A GPU converts with
   ``cvt.rn.satfinite`` (nearest even, finite overflow saturates). SGLang's Triton kernels cast q and the softmax
   probabilities to the cache's fp8 dtype (``extend_attention.py:619``), so under the interpreter an fp8 cache
   gave errors a compiled kernel does not make (docs/findings/sglang-triton-draft-extend-v2.md). Float32/16 and
   bfloat16 -> fp8e4nv/fp8e5 casts are done by torch instead (nearest even), clamped to the format's finite range.
   Upstream: triton-lang/triton#8322 (ties), the carry reported on PR #9808 and fixed in the open PR #11897.
7. SGLang's Mamba-2 mixer module (``layers/attention/mamba/mamba.py``) binds its causal-conv entry points only on
   CUDA, NPU and XPU; on a CPU the names are missing and its first call raises NameError. They are bound to
   SGLang's own Triton causal conv, as its XPU branch binds them ("the portable Triton implementation for both the
   native and the _triton entry points"). Its SSD kernels enter ``torch.get_device_module(device).device(index)``
   around each launch (``ssd_chunk_state.py``), which on a CPU is ``torch.cpu.device``, absent: a null context, as
   for fla (2).
8. bfloat16 arithmetic: the interpreter keeps bfloat16 values as their uint16 bit patterns, and two of its operations
   read those bits as integers. ``tl.dot`` multiplies them as uint16 matrices, and a cast between bfloat16 and any type
   but float32 converts the integer (``astype``), so 1.0 in float16 becomes 16256.0 in "bfloat16". A GPU multiplies
   bfloat16 operands exactly and accumulates in float32, and converts at nearest even (``cvt.rn``). SGLang's KDA chunk
   kernels cast their off-diagonal blocks to bfloat16 before the dot whatever the model's dtype (``fla/chunk_intra.py``,
   ``.to(tl.bfloat16)``), so under the interpreter a KDA prefill of more than 16 tokens came out NaN. Dots with a
   bfloat16 operand take the widened float32 values; casts from and to bfloat16 go through torch's conversions.
9. ``triton.language.extra.libdevice``'s functions are declarations whose body the interpreter runs as Python: they
   return None. fla's KDA gate kernel computes its sigmoid with ``libdevice.exp`` (``fla/kda.py``); under the
   interpreter ``libdevice.exp`` is the stand-in ``exp`` of (1).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def exp(x):
    return tl.exp(x)


@triton.jit
def exp2(x):
    return tl.math.exp2(x)


@triton.jit
def log(x):
    return tl.log(x)


@triton.jit
def log2(x):
    return tl.log2(x)


_APPLIED = False


class OutOfBounds(RuntimeError):
    """An interpreted Triton kernel addressed memory outside every tensor it was given."""


_ranges: list = []  # [(start, end, name)] of the running kernel's tensor arguments (host addresses)
_kernel: list = []  # the running kernel's name


def _mask_values(mask):
    """A load/store mask's numpy array: the interpreter passes a ``TensorHandle`` for ``tl.load(ptrs, mask)`` but,
    in Triton 3.6, the bare numpy array that a block pointer's ``materialize_pointers`` built (its ``.data`` is then
    the array's raw buffer, a ``memoryview``)."""
    import numpy as np

    return mask if isinstance(mask, np.ndarray) else mask.data


def _as_bool(mask):
    """The mask with its truth values as numpy bools (shim 4), in the form it came: handle or bare array."""
    from triton.runtime import interpreter

    values = _mask_values(mask)
    if values.dtype == bool:
        return mask
    return values.astype(bool) if values is mask else interpreter.TensorHandle(values.astype(bool), mask.dtype)


def _check(ptrs, mask, what: str) -> None:
    import numpy as np

    if not _ranges:
        return
    addresses = ptrs.data[_mask_values(mask)] if mask is not None else ptrs.data
    if addresses.size == 0:
        return
    addresses = addresses.astype(np.uint64, copy=False).ravel()
    starts = np.array([r[0] for r in _ranges], dtype=np.uint64)
    ends = np.array([r[1] for r in _ranges], dtype=np.uint64)
    inside = ((addresses[:, None] >= starts[None, :]) & (addresses[:, None] < ends[None, :])).any(axis=1)
    if not inside.all():
        bad = int(addresses[~inside][0])
        nearest = min(_ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
        raise OutOfBounds(f"{_kernel[-1] if _kernel else 'a kernel'} {what} {int((~inside).sum())} element(s) "
                          f"outside its tensor arguments (first at {bad - nearest[0]:+d} bytes from the start of "
                          f"argument {nearest[2]!r}, {nearest[1] - nearest[0]} bytes long)")


def _fp8_downcaster(convert):
    """``create_fp_to_fp`` with float32/float16/bfloat16 -> fp8e4nv/fp8e5 at nearest even done as a GPU does it
    (shim 6); every other conversion goes to the interpreter's own ``convert``."""
    import numpy as np
    import torch
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst, source = dst_type.scalar, src.dtype.scalar
        if (dst not in fp8 or rounding_mode != ir.ROUNDING_MODE.RTNE
                or source not in (tl.float32, tl.float16, tl.bfloat16)):
            return convert(self, src, dst_type, rounding_mode)
        data = np.ascontiguousarray(src.data)
        if source == tl.bfloat16:  # stored as uint16: its bits are a float32's top half, exactly
            data = (data.astype(np.uint32) << 16).view(np.float32)
        x = torch.from_numpy(data).float()  # exact widening: one rounding, to fp8, below
        finite = torch.finfo(fp8[dst]).max
        out = x.clamp(-finite, finite).to(fp8[dst]).view(torch.uint8).numpy()  # clamp keeps NaN
        return interpreter.TensorHandle(out.reshape(np.shape(src.data)), dst)

    return create_fp_to_fp


def _torch_dtypes() -> dict:
    """Triton's scalar types the bfloat16 shim (8) converts between, as torch's."""
    return {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32,
            tl.float64: torch.float64, tl.int8: torch.int8, tl.int16: torch.int16, tl.int32: torch.int32,
            tl.int64: torch.int64, tl.uint8: torch.uint8}


def _as_torch(handle) -> torch.Tensor:
    """An interpreter value as a torch tensor of its own type (bfloat16 from its uint16 bits)."""
    import numpy as np

    data = np.ascontiguousarray(handle.data)
    if handle.dtype.scalar == tl.bfloat16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def _as_handle(x: torch.Tensor, dtype):
    """A torch tensor back into an interpreter value of ``dtype`` (bfloat16 as its uint16 bits)."""
    import numpy as np
    from triton.runtime import interpreter

    if x.dtype == torch.bfloat16:
        return interpreter.TensorHandle(x.view(torch.int16).numpy().view(np.uint16), dtype)
    return interpreter.TensorHandle(x.numpy(), dtype)


def _bf16_cast(cast):
    """``cast_impl`` with conversions from and to bfloat16 done by torch (shim 8); every other one the interpreter's."""
    def cast_impl(self, src, dst_type):
        types = _torch_dtypes()
        source, dst = src.dtype.scalar, dst_type.scalar
        if (source == tl.bfloat16) == (dst == tl.bfloat16) or source not in types or dst not in types:
            return cast(self, src, dst_type)
        return _as_handle(_as_torch(src).to(types[dst]), dst)

    return cast_impl


def _bf16_dot(dot):
    """``create_dot`` over the float32 values of bfloat16 operands (exact), accumulated in the accumulator's type
    (shim 8); every other dot the interpreter's."""
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        from triton.runtime import interpreter

        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        wide = [interpreter.TensorHandle(_as_torch(x).float().numpy(), tl.float32) for x in (a, b)]
        return dot(self, *wide, d, input_precision, max_num_imprecise_acc)

    return create_dot


def correct_fla(package: str) -> None:
    """Shims 1 and 2 for the fla kernels vendored at ``package`` (exported KDA files copy this function in): every
    loaded module's copies of fla's exp/log aliases become the jit stand-ins, and fla's device context a null one."""
    import contextlib
    import importlib
    import sys

    op = importlib.import_module(package + ".op")
    stand_ins = {"exp": exp, "exp2": exp2, "log": log, "log2": log2}
    aliases = {id(getattr(op, name)): name for name in stand_ins}
    for module_name, module in list(sys.modules.items()):  # op itself and every module that copied an alias
        if module is None or not module_name.startswith("sglang."):
            continue
        for name in stand_ins:
            if aliases.get(id(getattr(module, name, None))) == name:
                setattr(module, name, stand_ins[name])
    importlib.import_module(package + ".utils").custom_device_ctx = lambda index: contextlib.nullcontext()


def correct_arithmetic() -> None:
    """Shims 3, 8 and 9 (exported KDA files copy this function in): autotuning keeps its first configuration,
    bfloat16 dots and casts go through float32 and torch, libdevice's exp is the jit stand-in."""
    from triton.language.extra import libdevice
    from triton.runtime import autotuner, interpreter

    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config
    libdevice.exp = exp  # shim 9: looked up on the module at each call
    builder = interpreter.InterpreterBuilder
    builder.cast_impl = _bf16_cast(builder.cast_impl)
    builder.create_dot = _bf16_dot(builder.create_dot)


def apply() -> None:
    """Install the shims (idempotent). Call after ``import sglang``, before any fla kernel runs."""
    global _APPLIED
    if _APPLIED:
        return
    from triton.runtime import autotuner

    from backends.sglang import features

    fla = features.chosen("fla_kernels_path")  # where the release vendors them (none: no GDN row on the CPU)
    if fla is not None:
        correct_fla("sglang.kernels.ops.attention.fla" if fla == "fla_kernels" else "sglang.srt.layers.attention.fla")
    if features.has("mamba2_model"):
        mixer = importlib.import_module("sglang.srt.layers.attention.mamba.mamba")
        for package in ("sglang.kernels.ops.mamba", "sglang.srt.layers.attention.mamba"):  # 0.5.22 on; before
            try:
                conv = importlib.import_module(package + ".causal_conv1d_triton")
                break
            except ModuleNotFoundError:
                continue
        for name, kernel in (("causal_conv1d_fn", conv.causal_conv1d_fn),
                             ("causal_conv1d_fn_triton", conv.causal_conv1d_fn),
                             ("causal_conv1d_update", conv.causal_conv1d_update),
                             ("causal_conv1d_update_triton", conv.causal_conv1d_update)):
            if not hasattr(mixer, name):
                setattr(mixer, name, kernel)
        if not hasattr(torch.cpu, "device"):
            torch.cpu.device = lambda index: contextlib.nullcontext()
    correct_arithmetic()

    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def load(self, ptrs, mask, *rest):
        mask = _as_bool(mask)
        _check(ptrs, mask, "loads")
        return masked_load(self, ptrs, mask, *rest)

    def store(self, ptrs, value, mask, *rest):
        mask = _as_bool(mask)
        _check(ptrs, mask, "stores")
        return masked_store(self, ptrs, value, mask, *rest)

    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_fp_to_fp = _fp8_downcaster(builder.create_fp_to_fp)

    executor = interpreter.GridExecutor
    init_args = executor._init_args_hst
    execute = executor.__call__

    def record_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        names = list(self.arg_names) + list(kwargs_hst)
        for name, arg in zip(names, list(args_hst) + list(kwargs_hst.values())):
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                _ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), name))
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        saved = list(_ranges)
        _ranges.clear()
        _kernel.append(getattr(self.fn, "__name__", "kernel"))
        try:
            return execute(self, *args, **kwargs)
        finally:
            _kernel.pop()
            _ranges[:] = saved

    executor._init_args_hst, executor.__call__ = record_args, call
    _APPLIED = True
