"""Whether Triton's interpreter works on this machine, asked once per process before any interpreted row runs.

On a CPU the Triton rows (ours and SGLang's) run under ``TRITON_INTERPRET=1``, which executes each kernel with
numpy. An interpreter can be broken where it is installed: on the lent GPU host's image (triton 3.6.0, torch 2.11.0)
every interpreted kernel raised ``InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python
scalars')``, with the image's numpy 2.5.2 and with numpy 2.4.6 alike (this machine's triton 3.8.0 runs them with
numpy 2.4.6), and a CPU sweep there reported 480 findings, each the toolchain's, none a backend's (2026-11-26).
A probe kernel that uses what the attention kernels use (program ids, masked loads, a scalar argument, reductions,
``tl.dot``, a loop) runs first; if it fails, every interpreted row is unavailable with the reason, and no case is
blamed on a backend.
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path


def _environment() -> str:
    """What the probe's verdict depends on: the interpreter's and numpy's releases, torch's, Python's (read from
    the installed distributions, nothing imported)."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"
    return (f"triton {version('triton')}, numpy {version('numpy')}, torch {version('torch')}, "
            f"python {platform.python_version()}, {sys.prefix}")


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attn-harness" / "interpreter-probe.json"


def late_switch() -> str | None:
    """Why this process cannot interpret Triton kernels although ``TRITON_INTERPRET=1`` is set, or None.

    ``triton.jit`` reads the switch when a kernel is defined. Set after triton was imported (on a GPU host, by a
    caller that asked for the CPU in a process that had already imported it), it makes every kernel defined later
    interpreted while triton's own library functions (``tl.max``, ``tl.sum``: ``triton/language/standard.py``)
    stay compiled, and the first interpreted kernel that calls one raises "Cannot call @triton.jit'd outside of
    the scope of a kernel". Seen on the lent H100: SGLang's Triton rows on the GPU crashed that way after a
    CPU-device test in the same pytest worker set the switch."""
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_interprets() is False:
        return ("TRITON_INTERPRET=1 was set after triton was imported in this process, so its library kernels are "
                "compiled and interpreted ones cannot call them: run the CPU rows in a fresh process")
    return None


def triton_interprets() -> bool | None:
    """Whether triton, as imported in this process, interprets its kernels: what ``triton.jit`` made of its own
    library functions, whatever the environment says now (None: triton is not imported yet)."""
    standard, jit = sys.modules.get("triton.language.standard"), sys.modules.get("triton.runtime.jit")
    if standard is None or jit is None:
        return None
    return not isinstance(getattr(standard, "max", None), jit.JITFunction)


def interpreter_fault() -> str | None:
    """One line saying why Triton's interpreter cannot run kernels in this process, or None: the process's own
    state (``late_switch``) first, then the environment's verdict (``environment_fault``). Where it can, the
    interpreter is made to skip work whose result it discards (``skip_repatching_in_device_calls``,
    ``skip_discarded_overflow_checks``, ``look_up_numpy_dtypes``) before any row runs: the same kernels compute the
    same values, faster."""
    fault = late_switch() or environment_fault()
    if fault is None and os.environ.get("TRITON_INTERPRET") == "1":
        skip_repatching_in_device_calls()
        skip_discarded_overflow_checks()
        look_up_numpy_dtypes()
    return fault


@cache
def environment_fault() -> str | None:
    """One line saying why Triton's interpreter cannot run kernels in this environment, or None when the probe
    kernel computes its expected result. The verdict is kept per environment (``_environment``) in the user's cache
    folder: every process of a run or sweep asks, and the probe (importing Triton, running a kernel) costs seconds.
    Asked only where the switch was not late (``interpreter_fault``): there the probe would fail for the process's
    sake, and its verdict would be kept for the environment."""
    key, path = _environment(), _cache_file()
    try:
        known = json.loads(path.read_text())
        if key in known:
            return known[key]
    except (OSError, ValueError):
        known = {}
    fault = _probe()
    try:
        known = known if isinstance(known, dict) else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: fault}, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # no cache folder: the next process probes again
    return fault


def _probe() -> str | None:
    try:
        import numpy
        import torch
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - any import failure makes the interpreted rows unavailable
        return f"Triton's interpreter cannot be loaded here: {type(e).__name__}: {e}"

    @triton.jit
    def probe(x_ptr, y_ptr, out_ptr, scale, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = (start + offs) < n
            x = tl.load(x_ptr + row * BLOCK * n + offs[:, None] * n + start + offs[None, :], mask=mask[None, :],
                        other=0.0)
            y = tl.load(y_ptr + (start + offs[:, None]) * BLOCK + offs[None, :], mask=mask[:, None], other=0.0)
            acc += tl.dot(x, y)
        top = tl.max(acc, axis=1)
        p = tl.exp(acc - top[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        tl.store(out_ptr + row * BLOCK * BLOCK + offs[:, None] * BLOCK + offs[None, :], tl.where(p > 0, p * scale, 0.0))

    versions = f"triton {getattr(triton, '__version__', '?')}, numpy {numpy.__version__}"
    try:
        block, n, rows = 16, 24, 2
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, block, n, generator=gen)
        y = torch.randn(n, block, generator=gen)
        out = torch.empty(rows, block, block)
        probe[(rows,)](x, y, out, 2.0, n, BLOCK=block)
        expected = torch.softmax(x.double() @ y.double(), dim=-1) * 2.0
        if not torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-6):
            return (f"Triton's interpreter computes wrong results here ({versions}): a probe softmax(x @ y) is off "
                    f"by {(out.double() - expected).abs().max().item():.3g}")
    except Exception as e:  # noqa: BLE001 - whatever fails here would fail every interpreted case
        message = str(e).splitlines()[0] if str(e) else ""
        return f"Triton's interpreter fails on this machine ({versions}): {type(e).__name__}: {message}"
    return None


# The launch in progress (whether one is, and which language modules it patched); "skip": off, Triton's own way
_device_calls = {"grid": False, "patched": frozenset(), "skip": True}


def skip_repatching_in_device_calls() -> None:
    """Let a device function called inside an interpreted kernel run under the kernel's patched ``triton.language``
    instead of patching it again.

    Triton's interpreter patches ``triton.language`` for a launch (``GridExecutor.__call__`` -> ``_patch_lang``) and
    again at every call of a ``@triton.jit`` device function inside it (``InterpretedFunction.__call__``, triton
    3.6-3.8), for each program of the grid. The second patching finds the launch's patches in place and changes
    nothing, but costs an ``inspect.getmembers`` over the language modules per call: 27% of a ci-profile
    ``graph(sglang.triton)`` draft-decode row's 57 s (cProfile: 18,667 ``_patch_lang`` calls, 15.5 s), since SGLang's
    kernels call ``tl.cdiv`` and their own helpers in every program. A device function whose module sees a language
    module the launch did not patch is patched as before. Idempotent; a no-op where the interpreter's layout differs.
    """
    try:
        from triton.runtime import interpreter as tri
    except ImportError:
        return
    real_patch, real_grid_call = getattr(tri, "_patch_lang", None), getattr(tri.GridExecutor, "__call__", None)
    if real_patch is None or real_grid_call is None or getattr(real_patch, "skips_device_calls", False):
        return
    language = [m for m in (getattr(tri, "tl", None), getattr(getattr(tri, "tl", None), "core", None)) if m]

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in language))

    def patch_lang(fn):
        if _device_calls["skip"] and _device_calls["grid"] and langs(fn) <= _device_calls["patched"]:
            return tri._LangPatchScope()  # nothing changed, nothing to restore
        scope = real_patch(fn)
        if _device_calls["grid"]:
            _device_calls["patched"] = _device_calls["patched"] | langs(fn)
        return scope

    def grid_call(self, *args, **kwargs):
        outer = _device_calls["grid"], _device_calls["patched"]
        _device_calls.update(grid=True, patched=frozenset())
        try:
            return real_grid_call(self, *args, **kwargs)
        finally:
            _device_calls["grid"], _device_calls["patched"] = outer

    patch_lang.skips_device_calls = True
    tri._patch_lang = patch_lang
    tri.GridExecutor.__call__ = grid_call


def skip_discarded_overflow_checks() -> None:
    """Skip the integer-overflow check of each ``+``, ``-`` and ``*`` where its verdict would be thrown away.

    Every integer add, sub and mul narrower than 64 bits (signed or unsigned) inside a kernel calls
    ``binary_op_sanitize_overflow_impl`` (``triton/language/semantic.py``, triton 3.8.0), which casts both operands to
    int64, redoes the operation, compares it with the type's two bounds, ands the comparisons and hands the condition
    to ``device_assert``. ``device_assert`` returns at once unless the builder's ``options.debug`` is set, and the
    interpreter's options never set it (``InterpreterOptions()``): six interpreted operations computed and discarded
    per integer operation. With ``look_up_numpy_dtypes``, a third of a ci-profile run over SGLang's Triton, KDA and
    Mamba-2 rows (``harness run --profile ci --seed 7 --backends sglang.kda sglang.mamba2 sglang.triton --modes extend
    decode --properties outputs --max-examples 2``: 24.2 CPU-s, 17.6 with both; every row's worst error the same to
    the last bit). Under ``debug`` the check runs as before. The method is replaced on Triton's semantic class, so a
    kernel compiled in this process (none is: the switch is on, and ``triton.jit`` interprets every kernel defined
    after it) would skip it too, which changes nothing there either: without ``debug`` the compiled check is dead code
    too. Idempotent; a no-op where the interpreter's layout differs."""
    try:
        from triton.language import semantic
    except ImportError:
        return
    cls = getattr(semantic, "TritonSemantic", None)
    real = getattr(cls, "binary_op_sanitize_overflow_impl", None)
    if real is None or getattr(real, "skips_discarded", False):
        return

    def sanitize(self, lhs, rhs, binary_op):
        options = getattr(self.builder, "options", None)
        if options is not None and getattr(options, "debug", True) is False:
            return None  # device_assert would return before reading the condition
        return real(self, lhs, rhs, binary_op)

    sanitize.skips_discarded, sanitize.real = True, real
    cls.binary_op_sanitize_overflow_impl = sanitize


def look_up_numpy_dtypes() -> None:
    """Answer the interpreter's ``_get_np_dtype`` from one table built once.

    Triton's interpreter maps a Triton type to the numpy dtype that stores it at every operation's cast, bitcast and
    result (``triton/runtime/interpreter.py``, triton 3.8.0), and builds its 18-entry dictionary afresh at each call,
    hashing every key (the other part of the figure ``skip_discarded_overflow_checks`` gives). The table here is that
    dictionary, built by calling the interpreter's own function on each key; a type missing from it, or one that
    cannot be hashed, goes to the interpreter's function, which answers or raises as before. Idempotent; a no-op
    where the interpreter's layout differs."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real = getattr(interpreter, "_get_np_dtype", None)
    if real is None or getattr(real, "table", None) is not None:
        return
    try:
        table = {t: real(t) for t in (tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64,
                                      tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5,
                                      tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
        pointer = real(tl.pointer_type(tl.float32))
    except (AttributeError, KeyError, TypeError):
        return
    pointer_type, block_type = tl.pointer_type, tl.block_type

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer_type):
            return pointer
        element = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        if isinstance(element, pointer_type):
            return pointer
        try:
            found = table.get(element)
        except TypeError:  # unhashable (a tuple type): Triton's own function says what it makes of it
            found = None
        return found if found is not None else real(tt_dtype)

    get_np_dtype.table, get_np_dtype.real = table, real
    interpreter._get_np_dtype = get_np_dtype
