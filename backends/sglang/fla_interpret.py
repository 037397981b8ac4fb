"""Making the fla kernels SGLang vendors (``sglang.kernels.ops.attention.fla``) run under Triton's CPU
interpreter (``TRITON_INTERPRET=1``). Applied by :func:`backends.sglang.runtime.load` only when the
interpreter is on; nothing is edited on disk and compiled (GPU) runs never see these.

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
"""

from __future__ import annotations

import contextlib
import sys

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


def apply() -> None:
    """Install the three shims (idempotent). Call after ``import sglang``, before any fla kernel runs."""
    global _APPLIED
    if _APPLIED:
        return
    import sglang.kernels.ops.attention.fla.op as op
    import sglang.kernels.ops.attention.fla.utils as fla_utils
    from triton.runtime import autotuner

    stand_ins = {"exp": exp, "exp2": exp2, "log": log, "log2": log2}
    aliases = {id(getattr(op, name)): name for name in stand_ins}
    for module_name, module in list(sys.modules.items()):  # op itself and every module that copied an alias
        if module is None or not module_name.startswith("sglang.kernels"):
            continue
        for name in stand_ins:
            if aliases.get(id(getattr(module, name, None))) == name:
                setattr(module, name, stand_ins[name])
    fla_utils.custom_device_ctx = lambda index: contextlib.nullcontext()
    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config

    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype != bool:
            mask = interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)
        return mask

    builder.create_masked_load = lambda self, ptrs, mask, *rest: masked_load(self, ptrs, as_bool(mask), *rest)
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: masked_store(self, ptrs, value,
                                                                                      as_bool(mask), *rest)
    _APPLIED = True
