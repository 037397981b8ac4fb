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


@cache
def interpreter_fault() -> str | None:
    """One line saying why Triton's interpreter cannot run kernels here, or None when the probe kernel computes
    its expected result. The verdict is kept per environment (``_environment``) in the user's cache folder: every
    process of a run or sweep asks, and the probe (importing Triton, running a kernel) costs seconds."""
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
