"""Command-line input shared by every subcommand: its one error type and the parsers of its values.

Each parser turns bad input into a :class:`UsageError` (one line on stderr, exit status 2).
"""

from __future__ import annotations

import os
import re

UNITS = {"s": 1, "m": 60, "h": 3600}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def resolve_device(requested: str) -> str:
    """'auto' picks CUDA when present. On the CPU, Triton kernels run in its interpreter, which must be
    switched on before triton is first imported."""
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA GPU is visible (use --device cpu)")
    if requested not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return requested


def profile_named(name: str):
    from search.profiles import PROFILES

    if name not in PROFILES:
        raise UsageError(f"unknown profile {name!r}; profiles: {', '.join(PROFILES)}")
    return PROFILES[name]


def parse_budget(text: str) -> float:
    """'90s', '30m', '2h' (or plain seconds) -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)([smh]?)", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--budget {text!r} is not a duration; write e.g. 90s, 30m or 2h")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


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
