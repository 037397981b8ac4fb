"""Command-line input shared by every subcommand: its one error type and the parsers of its values.

Each parser turns bad input into a :class:`UsageError` (one line on stderr, exit status 2).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

UNITS = {"s": 1, "m": 60, "h": 3600}
DEVICES = ("auto", "cpu", "cuda")


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def resolve_device(requested: str) -> str:
    """'auto' picks CUDA when present. On the CPU, Triton kernels run in its interpreter, which must be
    switched on before triton is first imported."""
    check_device_name(requested)  # before importing torch, which takes seconds
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA GPU is visible (use --device cpu)")
    if requested == "cpu" and "triton" not in sys.modules:
        # Too late once triton is imported (a caller's process on a GPU host): the switch would interpret the
        # kernels defined from then on and not triton's own, and they cannot run together
        # (backends/interpreter.py late_switch). Left unset, the interpreted rows say they need it.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return requested


def check_device_name(requested: str) -> None:
    """The --device value alone (no torch needed): auto, cpu or cuda."""
    if requested not in DEVICES:
        raise UsageError(f"--device must be auto, cpu or cuda, got {requested!r}")


def profile_named(name: str, shard_index: int = 0):
    """The profile ``name`` (``NAME`` or ``NAME@K``, a head rotation; see search/profiles.py)."""
    from search.profiles import ProfileError, profile

    try:
        return profile(name, shard_index)
    except ProfileError as e:
        raise UsageError(str(e)) from None


def parse_budget(text: str) -> float:
    """'90s', '30m', '2h' (or plain seconds) -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)([smh]?)", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--budget {text!r} is not a duration; write e.g. 90s, 30m or 2h")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def check_properties(names: list[str] | None) -> None:
    """Every name in --properties must be a property (imports the properties, hence torch, when given)."""
    if not names:
        return
    from properties import PROPERTIES

    unknown = [p for p in names or [] if p not in PROPERTIES]
    if unknown:
        raise UsageError(f"unknown propert{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"properties: {', '.join(PROPERTIES)}")


def check_modes(names: list[str] | None) -> None:
    """Every name in --modes must be a forward mode (no torch needed)."""
    from batch.spec import ForwardMode

    known = [m.value for m in ForwardMode]
    unknown = [m for m in names or [] if m not in known]
    if unknown:
        raise UsageError(f"unknown mode{'' if len(unknown) == 1 else 's'} {', '.join(unknown)}; "
                         f"modes: {', '.join(known)}")


def check_positive(flag: str, value: float | None) -> None:
    """A numeric option that must be > 0 when given."""
    if value is not None and value <= 0:
        raise UsageError(f"{flag} must be positive, got {value}")


def check_out_folder(flag: str, path: str | Path) -> None:
    """Fail early, without creating anything, when ``path`` cannot become a folder: a file is there, or
    the nearest existing parent is not a folder."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a folder")
    parent = next((a for a in p.absolute().parents if a.exists()), None)
    if not p.exists() and parent is not None and not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")


def make_out_folder(flag: str, path: str | Path) -> Path:
    """Create the output folder ``path`` and check that a file can be written there."""
    check_out_folder(flag, path)
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there: {e.strerror or e}") from None
    return p


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise UsageError(f"--shard {text!r}: write I/N with 0 <= I < N, e.g. 0/2 and 1/2")
    return int(m.group(1)), int(m.group(2))


def duration(seconds: float) -> str:
    """Seconds as the budget syntax writes them: 45s, 2m05s, 1h30m."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


MPS_HELP = ("on a GPU, make the worker processes clients of a CUDA MPS daemon (started for them; or yours where "
            "CUDA_MPS_PIPE_DIRECTORY is set), so that their kernels run side by side instead of taking turns "
            "(harness/mps.py: FlashInfer decode checked 1.3x the cases/s at 4 workers, 2x at 8 on an H200; "
            "host-bound rows gain nothing). A fatal GPU fault of one worker then reaches them all: a case that failed "
            "with a CUDA error is replayed alone, outside MPS, before it is reported")


def add_selection(sp, profile_default: str = "ci") -> None:
    """The options that say where and what a command runs: --device, --profile, --backends."""
    sp.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    sp.add_argument("--profile", default=profile_default,
                    help=f"ci, dev, nightly or gpu (default {profile_default})")
    sp.add_argument("--backends", nargs="*", help="leaf backend names or composition terms to include")
