"""Is a JIT compiler at work under a process?

FlashInfer builds each kernel configuration with ninja and nvcc on its first use (20-100 s, several minutes
when workers compile at once), and Triton runs ptxas. A case waiting for that is slow, not hung: the
supervisors that kill hung cases (the sweep, the isolated mutant runs) stop a case's clock while one of
their processes has a compiler running, up to ``COMPILE_TIMEOUT_S`` in all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

COMPILE_TIMEOUT_S = 1800.0
# Process names (/proc/PID/comm, at most 15 characters) of the tools a JIT build runs.
COMPILERS = frozenset({"ninja", "nvcc", "cicc", "cudafe++", "ptxas", "fatbinary", "nvlink", "cc1plus", "cc1",
                       "gcc", "g++", "cc", "c++", "clang", "clang++", "ld", "ld.lld", "as", "collect2"})


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, name) of every live process, from /proc (empty where there is none)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        comm_start, comm_end = stat.find("("), stat.rfind(")")  # the name may hold spaces and parentheses
        state, ppid = stat[comm_end + 2:].split()[:2]
        if state != "Z":
            table[int(name)] = (int(ppid), stat[comm_start + 1:comm_end])
    return table


def compiler_running(roots: Iterable[int]) -> bool:
    """Whether a compiler process descends from any of ``roots`` (always False without /proc)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = [c for r in roots for c in children.get(r, [])]
    while stack:
        pid = stack.pop()
        if table[pid][1] in COMPILERS:
            return True
        stack.extend(children.get(pid, []))
    return False
