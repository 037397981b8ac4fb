"""Is a JIT compiler at work under a process?

FlashInfer builds each kernel configuration with ninja and nvcc on its first use (20-100 s, several minutes
when workers compile at once), and Triton runs ptxas. A case waiting for that is slow, not hung: the
supervisors that kill hung cases (the sweep, the isolated mutant runs) stop a case's clock while one of
their processes has a compiler running, up to ``COMPILE_TIMEOUT_S`` in all.

A case may also wait on a build it did not start: compilers take file locks shared by every process of the user
(FlashInfer's per-kernel build locks; Inductor's ISA check, ``torch/_inductor/cpu_vec_isa.py`` ``check_build``,
which compiles a test program under one lock in the user's temporary folder before flex_attention's first CPU
kernel). Two sweeps side by side on one host (shards, or a CPU campaign's two seeds) wait on each other's
builds: a lent host's 64-process campaign reported three flex_attention cases as hangs, each after 121 s in
``filelock``'s ``_poll_until_acquired`` under ``check_build`` (2026-11-26). So the supervisors also count a
compiler that any process of this user runs (``machine_wide``); ``COMPILE_TIMEOUT_S`` still bounds the wait.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

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


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """The pids of the processes descending from ``root`` (empty without /proc)."""
    table = _process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def compilers_under(root: int) -> list[str]:
    """The names of the compiler processes descending from ``root`` (sorted, each once; empty without /proc)."""
    table = _process_table()
    return sorted({table[pid][1] for pid in descendants(root, table) if table[pid][1] in COMPILERS})


def _mtime(path: Path | None) -> float | None:
    from search.casefile import modified

    return None if path is None else modified(path)


class StallWatchdog:
    """While a row runs: every ``seconds`` without the row ending, one line if a JIT compiler runs under this process
    (a compile is slow, not hung: FlashInfer's nvcc builds take minutes on a cold machine), else every thread's stack
    (a hang is never silent). ``start(row)`` arms it for a row, ``stop()`` disarms it, ``close()`` ends its thread.

    The check runs on a Python thread, which needs the interpreter lock: a hang that holds the lock (in a C
    extension) would silence it, so faulthandler's own timer (a C thread) stays armed as a backstop at twice the
    period, pushed back each time the Python thread reports.

    ``start(row, progress=PATH)``: a file rewritten at each step of the row (a group's pending case file, rewritten
    before each case); its change counts as progress, so a long group whose cases go on is not reported."""

    def __init__(self, seconds: float, file=None) -> None:
        import threading

        self.seconds, self.file = seconds, file or sys.stderr
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._generation, self._armed, self._closed = 0, False, False
        self.row, self.since, self.progress, self.progress_seen = None, 0.0, None, None
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def _backstop(self, on: bool) -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        if on:
            try:
                faulthandler.dump_traceback_later(2 * self.seconds, repeat=True, file=self.file)
            except (ValueError, OSError, AttributeError):  # a file without a descriptor (a test's capture)
                pass

    def start(self, row: str, progress: Path | None = None) -> None:
        self._arm(row, progress)

    def stop(self) -> None:
        self._arm(None)

    def _arm(self, row: str | None, progress: Path | None = None) -> None:
        """Watch ``row`` from now (None: watch nothing); a period in progress no longer counts."""
        import time

        with self._wake:
            self.row, self.since, self.progress = row, time.monotonic(), progress
            self.progress_seen = _mtime(progress)
            self._generation += 1
            self._armed = row is not None
            self._backstop(self._armed)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed, self._armed = True, False
            self._backstop(False)
            self._wake.notify()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        import time

        while True:
            with self._wake:
                while not self._armed and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                generation = self._generation
                self._wake.wait(self.seconds)
                if self._closed:
                    return
                if not self._armed or self._generation != generation:
                    continue  # the row ended, or another started, within the period
                seen = _mtime(self.progress)
                if seen != self.progress_seen:  # a step of the row within the period: progress
                    self.progress_seen, self.since = seen, time.monotonic()
                    self._backstop(True)
                    continue
                row, waited = self.row, time.monotonic() - self.since
                self._backstop(True)  # this thread still runs: push the C timer back
            try:
                self._report(row, waited)
            except Exception as e:  # noqa: BLE001 - the watchdog must outlive a bad output file
                try:
                    print(f"{row}: stall watchdog could not report: {type(e).__name__}: {e}", file=sys.__stderr__)
                except Exception:  # noqa: BLE001
                    pass

    def _report(self, row: str, waited: float) -> None:
        import faulthandler

        compilers = compilers_under(os.getpid())
        if compilers:
            print(f"{row}: still compiling kernels after {waited:.0f} s ({', '.join(compilers)} running)",
                  file=self.file, flush=True)
        else:
            print(f"{row}: no progress for {waited:.0f} s and no compiler running; every thread's stack:",
                  file=self.file, flush=True)
            faulthandler.dump_traceback(file=self.file, all_threads=True)


def compiler_running(roots: Iterable[int], machine_wide: bool = False) -> bool:
    """Whether a compiler process descends from any of ``roots`` or, with ``machine_wide``, runs anywhere as this
    user (module docstring); always False without /proc."""
    table = _process_table()
    if machine_wide:
        uid = os.getuid()
        for pid, (_, name) in table.items():
            if name in COMPILERS:
                try:
                    if os.stat(f"/proc/{pid}").st_uid == uid:
                        return True
                except OSError:  # it exited meanwhile
                    pass
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


def default_case_timeout(device: str, interpreted: bool = False) -> float:
    """Seconds one example may run before its process counts as hung, for run, sweep and mutants alike.

    On a GPU the first case of a kernel configuration may JIT-compile for minutes (compiler time is not
    counted at all, see ``compiler_running``). On a CPU a case of the PyTorch backends takes well under a
    second, so two minutes is far outside a healthy one. Interpreted kernels (a composition whose support is
    ``interpreted_on_cpu``: Triton under TRITON_INTERPRET) are another matter: the nightly profile draws batches of up to
    36,864 cached keys, and one such case of our Triton backend (extend, three requests, 8 heads) ran for more
    than two minutes in a sweep of two workers on two cores and was reported as a hang (replayed alone beside
    that sweep, it was still running after 25 minutes). Such rows no longer draw the long-context shape on a CPU
    (``search.search_row``); their other cases still take up to a few minutes there (a TBO verify metadata row:
    324 s for 3 cases; SGLang's Triton decode over a batch of 128 requests: 125 s, reported as a hang), so they
    get ``SLOW_CPU_CASE_TIMEOUT_S``, still finite, so a kernel that really loops forever is still found.
    """
    if device == "cuda":
        return 600.0
    return SLOW_CPU_CASE_TIMEOUT_S if interpreted else 120.0


SLOW_CPU_CASE_TIMEOUT_S = 1200.0
# Before its first row a process only starts: imports torch and the engine (SGLang: 10-25 s alone, more on a loaded
# host). That is held to this, or to the case timeout if longer, never to a short ``--case-timeout``: a test run with
# ``--case-timeout 5`` beside a loaded suite killed its child "before its first row" and the run ended in a traceback.
STARTUP_ALLOWANCE_S = 120.0

# The default as the command lines state it, derived from the function so the help never goes stale.
CASE_TIMEOUT_DEFAULTS = (f"default {default_case_timeout('cuda'):.0f} on a GPU, {default_case_timeout('cpu'):.0f} "
                         f"on a CPU, {default_case_timeout('cpu', True):.0f} there for interpreted kernels")


class Terminated:
    """SIGTERM (what CI timeouts and ``kill`` send) stops a run or a sweep as Ctrl-C does: the first SIGTERM or
    SIGINT raises KeyboardInterrupt; while the report is written (after ``wrap_up``), further ones are ignored.

    A KeyboardInterrupt does not always arrive as itself, so the stop is also recorded (``stopped``) and
    repeated until the run takes it:
    - raised while Hypothesis sets a search up, it surfaces as an AssertionError from Hypothesis's cleanup
      (seen in CI: ``assert state._runner is not None``): ``is_stop`` reads whatever a stopped run raises as
      the stop, not as a bug;
    - raised inside a garbage-collector callback (Hypothesis registers one), Python prints it and drops it, and
      the run went on to its end with status 0 (seen here, 1 stop in 16): until ``wrap_up``, a timer raises it
      again every ``AGAIN_S`` seconds, and Python's printout of the one it dropped is held back.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    AGAIN_S = 0.5

    def __init__(self, repeat: bool = True) -> None:
        # Only where Hypothesis searches (run, a sweep's worker): the sweep itself runs no search, and a repeat
        # would cut short its own clean-up (it gives each worker STOP_GRACE_S to end after its SIGINT).
        self.repeat = repeat

    def __enter__(self):
        self.previous: dict[int, object] = {}
        self.stopped: int | None = None
        self.closing = False
        for sig in self.SIGNALS + (signal.SIGALRM,):
            try:
                self.previous[sig] = signal.signal(sig, self.handle if sig != signal.SIGALRM else self.again)
            except ValueError:  # not the main thread (called from a test's thread): leave signals alone
                break
        self.previous_hook = sys.unraisablehook
        sys.unraisablehook = self.unraisable
        return self

    def unraisable(self, info) -> None:
        """Python's note on a stop it dropped (a traceback of the gc callback) is noise: the stop comes again."""
        if not (self.stopped is not None and issubclass(info.exc_type, KeyboardInterrupt)):
            self.previous_hook(info)

    def handle(self, signum, frame):
        self.stopped = signum
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self.repeat:
            signal.setitimer(signal.ITIMER_REAL, self.AGAIN_S, self.AGAIN_S)
        raise KeyboardInterrupt

    def again(self, signum, frame):
        if self.stopped is not None and not self.closing:
            raise KeyboardInterrupt

    def is_stop(self, error: BaseException) -> bool:
        """Whether ``error`` is how the stop surfaced (a KeyboardInterrupt, or anything raised after a signal)."""
        return isinstance(error, KeyboardInterrupt) or self.stopped is not None

    def wrap_up(self) -> None:
        """The stop is taken: no more repeats, and further signals are ignored while the report is written."""
        if self.previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc) -> None:
        # A repeat still pending must not interrupt the restoring of the handlers below (seen in the test suite: a
        # test that left the block without wrap_up kept SIGINT ignored for the next test of its worker)
        self.closing = True
        sys.unraisablehook = self.previous_hook
        if self.previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
