"""Running ``harness run``'s rows so that a crash or a hang is a finding, not the end of the run.

:func:`search_rows` searches rows one after the other in this process (with the run's shrink budget).
:func:`search_rows_isolated` does the same in a child process, supervised the way ``run_mutant_isolated``
supervises a mutant: a child that dies is a crash of the row it was running, one whose pending case has not
changed for ``case_timeout_s`` (time while a JIT compiler runs under it not counted, up to
``COMPILE_TIMEOUT_S``) a hang; either way the row's pending case file (written by ``search_row`` before
every example) becomes its case file, as in the sweep, and a fresh child goes on with the rows left. One
child serves as many rows as it can (a process start costs seconds of imports).

Both yield ``("start", row, None)`` before a row and ``("done", row, RowOutcome)`` after it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from harness.mutants.run import exit_description
from harness.procs import (COMPILE_TIMEOUT_S, STARTUP_ALLOWANCE_S, StallWatchdog, compiler_running,
                           default_case_timeout)
from harness.sweep_worker import EXIT_CONTEXT_POISONED  # a sticky CUDA error: the rows left need a fresh process
from search.casefile import CaseFile, case_name, modified, safe_name
from search.outcome import RowOutcome
from search.profiles import SHRINK_ROWS_PER_RUN, Profile
from search.search_row import search_row

def mutant_patch(mutant: str | None):
    if not mutant:
        return contextlib.nullcontext()
    from harness.mutants.catalogue import MUTANTS

    return MUTANTS[mutant].patch()


def search_rows(rows, profile: Profile, device: str, *, database, max_examples: int | None, out_dir: Path,
                shrink_seconds: float, shrink_left: float | None = None, seed: int | None = None) -> Iterator[tuple]:
    """Search ``rows`` in this process. Shrinking takes at most ``shrink_seconds`` a row and ``shrink_left``
    (default ``SHRINK_ROWS_PER_RUN`` rows' worth) in all; past that, failures are reported as found. ``seed``
    fixes each row's random choices (the same seed draws the same cases, given the same example database)."""
    if shrink_left is None:
        shrink_left = SHRINK_ROWS_PER_RUN * shrink_seconds
    for row in rows:
        yield "start", row, None
        result = search_row(row, profile, device, database=database, max_examples=max_examples, out_dir=out_dir,
                            shrink_seconds=max(0.0, min(shrink_seconds, shrink_left)), seed=seed)
        shrink_left -= result.shrink_seconds or 0.0
        yield "done", row, result


def _picklable(result: RowOutcome) -> RowOutcome:
    try:
        pickle.dumps(result)
        return result
    except Exception:  # noqa: BLE001 - a verdict's details holding something that does not pickle
        failure = result.failure
        if failure is not None and not isinstance(failure, str):
            failure = replace(failure, details={k: v for k, v in failure.details.items() if _pickles(v)})
        return replace(result, failure=failure)


def _pickles(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False


def _child(task: dict, conn) -> None:
    """The child's side: search the task's rows, reporting each start and result on ``conn`` (a pipe: each
    message is written before the row goes on, so a crash right after a start still shows which row)."""
    log = open(task["log"], "a")
    faulthandler.enable(file=log, all_threads=True)  # a segfault's Python stack, for the finding's reason
    from search.matrix import matrix_rows
    from search.profiles import profile as profile_of

    profile, device = profile_of(task["profile"]), task["device"]
    by_id = {r.id: r for r in matrix_rows(device, profile, task["compositions"])[0]}
    rows = [by_id[i] for i in task["rows"]]
    database = None
    if task["db"]:
        from hypothesis.database import DirectoryBasedExampleDatabase

        database = DirectoryBasedExampleDatabase(task["db"])
    watchdog = StallWatchdog(task["stall_seconds"])  # a compile says so in one line; a stall dumps every stack
    with mutant_patch(task["mutant"]):
        for kind, row, result in search_rows(rows, profile, device, database=database,
                                             max_examples=task["max_examples"], out_dir=Path(task["out_dir"]),
                                             shrink_seconds=task["shrink_seconds"], shrink_left=task["shrink_left"],
                                             seed=task["seed"]):
            if kind == "start":
                conn.send(("start", row.id, None))
                watchdog.start(row.id)
                continue
            watchdog.stop()
            conn.send(("done", row.id, _picklable(result)))
            if device == "cuda" and result.cuda_context_lost:
                conn.close()
                os._exit(EXIT_CONTEXT_POISONED)
    watchdog.close()
    conn.close()


def innermost_frame(log_text: str) -> str:
    """', in forward_decode (catalogue.py:262)' from the last faulthandler dump in a log, else ''."""
    dump = log_text.rsplit("(most recent call first)", 1)
    m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', dump[-1]) if len(dump) == 2 else None
    return f", in {m.group(3)} ({m.group(1).rsplit('/', 1)[-1]}:{m.group(2)})" if m else ""


def search_rows_isolated(rows, profile: Profile, device: str, *, db: str | None, max_examples: int | None,
                         out_dir: Path, shrink_seconds: float, mutant: str | None = None,
                         case_timeout_s: float | None = None, stall_seconds: float = 180.0,
                         seed: int | None = None) -> Iterator[tuple]:
    """:func:`search_rows` in child processes; a crash or a hang ends only the row it happened in."""
    ctx = multiprocessing.get_context("spawn")
    by_id = {r.id: r for r in rows}
    left = [r.id for r in rows]
    shrink_left = SHRINK_ROWS_PER_RUN * shrink_seconds
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    children = 0
    while left:
        children += 1
        log = out_dir / "logs" / f"run-child-{children}.log"
        log.write_text("")
        receiver, sender = ctx.Pipe(duplex=False)
        task = {"rows": left, "compositions": list(dict.fromkeys(str(by_id[i].composition) for i in left)),
                "profile": profile.name, "device": device, "db": db, "max_examples": max_examples,
                "out_dir": str(out_dir), "mutant": mutant, "shrink_seconds": shrink_seconds,
                "shrink_left": shrink_left, "stall_seconds": stall_seconds, "log": str(log), "seed": seed}
        proc = ctx.Process(target=_child, args=(task, sender), daemon=True)
        proc.start()
        sender.close()  # the child holds the only writing end: its death reads as the end of the pipe
        current, activity = None, time.time()
        grace, grace_anchor, last_look = 0.0, None, time.time()  # compile time within the current case
        try:
            while True:
                kind = None
                try:
                    if receiver.poll(0.5):
                        kind, row_id, result = receiver.recv()
                except EOFError:  # the child has ended; its exit code says how
                    proc.join()
                if kind == "start":
                    current, activity = row_id, time.time()
                    yield "start", by_id[row_id], None
                    continue
                if kind == "done":
                    current, activity = None, time.time()
                    left.remove(row_id)
                    shrink_left -= result.shrink_seconds or 0.0
                    yield "done", by_id[row_id], result
                    continue
                if not proc.is_alive():
                    proc.join()
                    if current is None:
                        if left and proc.exitcode not in (0, EXIT_CONTEXT_POISONED):
                            raise RuntimeError(f"the child process running the rows ended "
                                               f"({exit_description(proc.exitcode)}) between rows; see {log}")
                        break  # done, or a fresh process for the rows after a sticky CUDA error
                    reason = f"crash: the process died ({exit_description(proc.exitcode)})"
                    reason += innermost_frame(log.read_text(errors="replace"))
                    left.remove(current)
                    yield "done", by_id[current], _lost_row(by_id[current], "crash", reason, out_dir,
                                                           time.time() - activity)
                    break
                pending = out_dir / "pending" / f"{safe_name(current)}.json" if current else None
                active = max(activity, modified(pending) or activity) if pending else activity
                now = time.time()
                if active != grace_anchor:
                    grace, grace_anchor = 0.0, active
                if compiler_running([proc.pid], machine_wide=True):
                    grace += now - last_look
                last_look = now
                stalled = now - active
                limit = case_timeout_s or default_case_timeout(
                    device, current is not None and bool(by_id[current].composition.support().interpreted_on_cpu))
                if current is None:
                    limit = max(limit, STARTUP_ALLOWANCE_S)
                if stalled - grace > limit or stalled > COMPILE_TIMEOUT_S:
                    proc.kill()
                    proc.join()
                    what = f"a case of {current}" if current else "the child process (before its first row)"
                    if current is None:
                        raise RuntimeError(f"{what} made no progress for {stalled:.0f}s; see {log}")
                    left.remove(current)
                    yield "done", by_id[current], _lost_row(
                        by_id[current], "hang", f"hang: {what} made no progress for {stalled:.0f}s", out_dir,
                        time.time() - activity)
                    break
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            receiver.close()


def _lost_row(row, kind: str, reason: str, out_dir: Path, seconds: float) -> RowOutcome:
    """The finding of a row whose process died or hung: its pending case becomes its case file."""
    result = RowOutcome(row.id, str(row.composition), row.mode.value, row.property.name, seconds=seconds,
                        ok=False, failure=reason, finding_kind=kind)
    pending = out_dir / "pending" / f"{safe_name(row.id)}.json"
    if pending.exists():
        case = CaseFile.read(pending)
        case.verdict = {"reason": f"{reason} (not shrunk: the process died with it)", "worst_error": None,
                        "bound": None, "where": None}
        result.spec = case.spec
        result.case_file = case.write(out_dir / "cases" / case_name(case.composition, case.property,
                                                                   row.mode.value, case.spec))
        pending.unlink()
    return result
