"""Whose a crash is: the engine's (a finding) or the harness's own, around the engine's classes (an adapter error)."""

from __future__ import annotations

import traceback
from pathlib import Path

from backends.base import EngineBrokeInvariant
from backends.registry import Composition
from backends.sglang.features import package_root

_PROJECT = Path(__file__).resolve().parents[1]
# The project's own packages (a virtualenv or an unpacked site folder may live inside the checkout too)
_OWN = tuple(_PROJECT / d for d in ("backends", "batch", "engine", "harness", "properties", "reference", "search"))
# Harness code on the engine's side: a mutant's patched-in function is the engine's code, and the interpreter's
# bounds checker raises on behalf of the engine's kernel that read or wrote outside its tensors
_ENGINE_STAND_INS = (_PROJECT / "harness" / "mutants", _PROJECT / "backends" / "sglang" / "interpreter_shims.py")
# Harness code inside Triton's interpreter (a launch goes through it as through Triton's own frames): neither side's
_TOOLCHAIN = (_PROJECT / "backends" / "interpreter.py",)


# Errors a GPU reports asynchronously: raised by whichever later call synchronizes (a .tolist(), a copy), so the
# frame that raises them says nothing about the kernel that faulted.
_ASYNCHRONOUS_DEVICE_ERRORS = ("an illegal memory access was encountered", "device-side assert triggered",
                               "unspecified launch failure", "misaligned address")


def asynchronous_device_error(e: BaseException) -> bool:
    return type(e).__name__ == "AcceleratorError" or any(s in str(e) for s in _ASYNCHRONOUS_DEVICE_ERRORS)


def adapter_frame(e: BaseException, composition: Composition) -> str | None:
    """Where the harness's own code failed, if a crash of an engine's composition is the harness's and not the
    engine's: the innermost frame that is either the engine's package or this project decides (frames of torch,
    Triton and other libraries are the callees of one of the two). A crash raised in the engine's code is a
    finding; one raised in the project's (the adapter's translation, an import or a member it expected) is an
    adapter error, never counted as the engine's bug. None for the harness's own compositions, whose crashes are
    findings wherever they happen."""
    if composition is None or composition.engine == "harness" or isinstance(e, EngineBrokeInvariant):
        return None
    if asynchronous_device_error(e):
        # Seen on the H100 (0.5.10, tbo(hybrid(sglang.triton,sglang.gdn)) extend): SGLang's GDN kernels wrote out of
        # bounds and the cache property's .tolist() raised "illegal memory access", which the frame rule called an
        # adapter error. The kernels of an engine's composition are the engine's (the adapter launches torch copies
        # and indexing only), so such a crash is a finding; CUDA_LAUNCH_BLOCKING=1 on replay places it.
        return None
    stand_in = _stand_in_lacking(e)
    if stand_in:
        return stand_in
    built = getattr(e, "harness_built_without_kernels", None)
    if built:  # a plan-level leaf's constructor failed where the harness built it on stand-ins (plans.py)
        return f"{built}, which SGLang's constructor needs more of than the stand-ins give"
    engine_root = package_root(composition.engine)
    engine_root = None if engine_root is None else engine_root.resolve()
    frames = traceback.extract_tb(e.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if path in _TOOLCHAIN and frame is not frames[-1]:  # raised in it: the harness's own bug
            continue
        if (engine_root is not None and engine_root in path.parents) or \
                any(d == path or d in path.parents for d in _ENGINE_STAND_INS):
            return None
        if any(d in path.parents for d in _OWN):
            return f"{path.relative_to(_PROJECT)}:{frame.lineno} in {frame.name}"
    return None


def _stand_in_lacking(e: BaseException) -> str | None:
    """The engine read an attribute of an object the harness built in place of the engine's own (the adapter's model
    runner, model config), and the object lacks it: the stand-in is incomplete for this release, which is the
    harness's to mend, not the engine's bug (seen on 0.5.10: FlashAttention reads ``model_runner.attn_cp_size``,
    which later releases read elsewhere). Raised in the engine's frame, so the frame rule would call it a finding."""
    obj = getattr(e, "obj", None) if isinstance(e, AttributeError) else None
    module = type(obj).__module__ if obj is not None else ""
    if not any(module == p or module.startswith(p + ".") for p in (d.name for d in _OWN)):
        return None
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return (f"{module}'s {type(obj).__name__} (the adapter's stand-in) lacks {e.name!r}, read at "
            f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}")


def crash_reason(e: BaseException) -> str:
    """``crashed: TYPE: message (file.py:LINE in function: `the failing line`)``: the line number says where in this
    release, the function and the source line say what failed in any release (the ledger matches those)."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    line = f": `{frame.line.strip()}`" if frame.line else ""
    return (f"crashed: {type(e).__name__}: {e} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in "
            f"{frame.name}{line})")
