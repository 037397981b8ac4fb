"""A sweep worker: a bundle of groups of rows (``search.group``: rows that share their batches), round after round,
in a process of their own.

Run as ``python -m harness.sweep_worker TASK.json`` by ``harness.sweep`` (and by ``harness run``, through the same
supervisor). The task file names its groups (each one's id, compositions and rows, the rows to search and the rounds
each has done; they are searched one after the other, a round of each at a time), the sweep's seed, the profile, the
device, the example database, the mutant to inject, the deadline, until when it may go on to further rounds (while no
other group waits for its slot, it keeps its process rather than paying for a fresh one each round), and, when a run
started it, the run's examples a row and shrink budget. Each event is one JSON line appended to the task's events
file: ``start`` before a round of the group's search, ``done`` with each row's result after it. The group's pending
case file, written by ``search_group`` before every case, names the row that ran it and is the reproducer when this
process dies or stalls.

A worker never outlives the sweep that started it (``parent`` in the task file): the kernel kills it when
its parent dies (``PR_SET_PDEATHSIG``, Linux), and a watchdog thread checks ``os.getppid()`` every second
where that is not available. Whatever it had finished is on disk (its ``done`` events, its case files), and
the sweep adopts it on ``--resume``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.procs import Terminated

EXIT_CONTEXT_POISONED = 3  # a sticky CUDA error: the rows left need a fresh process


FIRST_ROUND_EXAMPLES = 3  # round 0 is quick, so a short sweep still reaches every row of the matrix


def round_examples(profile, round_: int) -> int:
    """Examples per row in a round: a few in the first (breadth first), then the profile's number."""
    return min(FIRST_ROUND_EXAMPLES, profile.max_examples) if round_ == 0 else profile.max_examples


def run_examples(task: dict, profile, round_: int) -> int | None:
    """``harness run``'s examples a row in ``round_``: its own (None: the profile's, fewer for a slow row) in its one
    round; under a time budget (two rounds) a few in the first, so that every row is reached before any is searched
    in full, then its own in the second."""
    if (task.get("max_rounds") or 1) > 1 and round_ == 0:
        return min(FIRST_ROUND_EXAMPLES, task["examples"] or profile.max_examples)
    return task["examples"]


def round_seed(sweep_seed: int, unit: str, round_: int) -> int:
    """Each group's search in each round of a sweep draws from its own, reproducible seed."""
    return int.from_bytes(hashlib.sha256(f"{sweep_seed}/{unit}/{round_}".encode()).digest()[:8], "big")


def example_database(db: str | None, redis_url: str | None):
    """The Hypothesis example database: a folder, or a Redis server shared between machines."""
    if redis_url:
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError:
            raise ValueError("--redis needs the redis package (pip install redis)") from None
        try:
            client = redis.Redis.from_url(redis_url)
            client.ping()
        except Exception as e:  # noqa: BLE001 - bad URL or unreachable server, both the user's to fix
            raise ValueError(f"--redis {redis_url}: cannot reach the server ({type(e).__name__}: {e})") from None
        return RedisExampleDatabase(client)
    from hypothesis.database import DirectoryBasedExampleDatabase

    return DirectoryBasedExampleDatabase(db)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 1.0


def die_with_parent(parent: int | None) -> None:
    """Be killed when the sweep (pid ``parent``) dies, even by SIGKILL: the kernel's parent-death signal where
    there is one, and a thread polling ``os.getppid()`` in any case (it also covers a parent that died before
    the signal was set up)."""
    if parent is None:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog below does it
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(PARENT_POLL_S)

    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


# How long a worker waits for an MPS daemon to take clients again after a fault: until every client it had has
# exited, each after replaying its failing case alone (search.search_row: REPLAYS_ALONE of REPLAY_ALONE_SECONDS at most)
def mps_ready_timeout() -> float:
    """Seconds a worker waits for the daemon: every old client's replays alone, and some."""
    from search.search_row import REPLAY_ALONE_SECONDS, REPLAYS_ALONE

    return REPLAYS_ALONE * REPLAY_ALONE_SECONDS + 300.0


MPS_PROBE_TIMEOUT_S = 60.0  # one probe (a CUDA context in a child), well within a worker's start-up allowance
EXIT_MPS_REFUSED = 4  # the MPS daemon refused this worker's CUDA context after its probe: a fresh process waits again
EXIT_MPS_UNAVAILABLE = 5  # the MPS daemon took no client for mps_ready_timeout()
MPS_PROBE = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"


def await_mps_daemon(emit, timeout_s: float | None = None, probe: str = MPS_PROBE) -> bool:
    """Wait until the MPS daemon this process would be a client of takes a client: after a fatal fault it refuses new
    ones until every client it had has exited (NVIDIA's MPS documentation, "Error containment"), and a CUDA context
    refused once stays refused in torch's process. Probed in a child process, an event emitted each time (the sweep
    then knows the worker is alive). Returns whether the daemon took one; without MPS at once."""
    from search.outcome import mps_client

    if not mps_client():
        return True
    timeout_s = mps_ready_timeout() if timeout_s is None else timeout_s
    start = time.time()
    while True:
        try:
            done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                  timeout=MPS_PROBE_TIMEOUT_S)
            if done.returncode == 0:
                return True
            said = (done.stderr.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            said = f"the probe made no CUDA context in {MPS_PROBE_TIMEOUT_S:.0f}s"
        waited = time.time() - start
        emit(event="awaiting-mps", seconds=round(waited, 1), said=said)
        if waited >= timeout_s:
            return False
        time.sleep(1.0)


def cuda_usable() -> bool:
    """Whether this process's CUDA context works (an MPS daemon recovering from a fault refuses it)."""
    import torch

    try:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - torch raises RuntimeError or its AcceleratorError; either way, not usable
        return False


def run_task(task: dict) -> int:
    die_with_parent(task.get("parent"))
    device = task["device"]
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    faulthandler.enable()  # a segfault prints the Python stack into the worker's log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the sweep asks for the stack of a hung case

    from search.profiles import profile as profile_of

    profile = profile_of(task["profile"])
    with open(task["events"], "a") as events:
        def emit(**fields) -> None:
            events.write(json.dumps(fields | {"time": time.time()}) + "\n")
            events.flush()
        return _run_groups(task, device, profile, emit)


def _run_groups(task: dict, device: str, profile, emit) -> int:
    """The task's groups, round after round, each event through ``emit``; the worker's exit status."""
    from search import search_row
    from search.group import group_rows
    from search.matrix import matrix_rows
    from search.outcome import mps_client

    # Before anything asks CUDA: a CUDA context the MPS daemon refused stays refused in this process, and the matrix
    # would hold none of the group's rows (a GPU sweep under MPS, 2026-11-29: every worker started while the daemon
    # recovered from a fault failed so)
    if device == "cuda" and not await_mps_daemon(emit):
        return EXIT_MPS_UNAVAILABLE  # not the engine's, nor a row's: the sweep says so in one line
    if device == "cuda" and mps_client() and not cuda_usable():
        # The daemon took the probe, then refused this process: a fault in between (on the H200 the mutant's rows
        # faulted again within seconds of a recovery, harness-out/gpu108.sh). A fresh process waits again.
        emit(event="mps-refused")
        return EXIT_MPS_REFUSED
    # Its groups, each as the sweep grouped it, and the rounds each of their rows has done
    groups, rounds = [], {}
    for item in task["units"]:
        members = set(item["members"])
        rows = [r for r in matrix_rows(device, profile, item["compositions"])[0] if r.id in members]
        group = next((g for g in group_rows(rows, profile, device) if g.id == item["unit"]), None)
        if group is None:
            raise RuntimeError(f"group {item['unit']} is not in this process's matrix ({len(rows)} of its "
                               f"{len(members)} rows are): is the {device} device usable here?")
        groups.append(group)
        rounds[item["unit"]] = {row["row"]: row["rounds"] for row in item["rows"]}
    # ``harness run``'s shrink budget: each row's seconds, and this worker's in all (None: the profile's, no total)
    shrink_seconds, shrink_left = task.get("shrink_seconds"), task.get("shrink_total")
    emit(event="ready", pid=os.getpid())
    search_row.ALIVE = lambda: emit(event="replaying-alone")  # the supervisor's stall clock: alive
    try:
        return _search_rounds(task, device, profile, emit, groups, rounds, shrink_seconds, shrink_left)
    finally:
        search_row.ALIVE = None


def _search_rounds(task: dict, device: str, profile, emit, groups, rounds, shrink_seconds, shrink_left) -> int:
    """Round after round of the groups' searches until the task's rounds, deadline or turn end; the exit status."""
    from harness.mutants.catalogue import MUTANTS
    from search.group import search_group

    database = example_database(task.get("db"), task.get("redis"))
    out_dir = Path(task["out_dir"])
    first_round = min(n for rows in rounds.values() for n in rows.values())
    with MUTANTS[task["mutant"]].patch() if task.get("mutant") else contextlib.nullcontext():
        while any(rounds.values()):
            round_ = min(n for rows in rounds.values() for n in rows.values())
            if task["max_rounds"] is not None and round_ >= task["max_rounds"]:
                break
            if round_ > first_round and time.time() >= task["continue_until"]:
                break  # another group waits for this worker's slot
            for group in groups:
                left = rounds[group.id]
                now = {r for r, n in left.items() if n == round_}
                if not now:
                    continue
                if time.time() >= task["deadline"]:
                    emit(event="stopped", reason="budget spent")
                    return 0
                seed = round_seed(task["seed"], group.id, round_)
                emit(event="start", row=group.id, round=round_, rows=sorted(now))

                def row_done(result, round_=round_, seed=seed, left=left) -> None:
                    nonlocal shrink_left
                    emit(event="done", row=result.row_id, round=round_, seed=seed, result=result.record())
                    if shrink_left is not None:
                        shrink_left -= result.shrink_seconds or 0.0
                    left[result.row_id] += 1
                    if not result.ok:
                        del left[result.row_id]  # a row with a finding is done for this sweep

                shrink = shrink_seconds if shrink_left is None or shrink_seconds is None else \
                    max(0.0, min(shrink_seconds, shrink_left))
                results = search_group(group, profile, device, database=database, out_dir=out_dir,
                                       max_examples=run_examples(task, profile, round_) if task.get("run")
                                       else round_examples(profile, round_),
                                       seed=seed, shrink_seconds=shrink,
                                       skip=frozenset(r.id for r in group.rows if r.id not in now),
                                       on_done=row_done)
                if device == "cuda" and any(result.cuda_context_lost for result in results):
                    return EXIT_CONTEXT_POISONED
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m harness.sweep_worker TASK.json (started by `python -m harness sweep`)",
              file=sys.stderr)
        return 2
    with Terminated() as terminated:  # the sweep stops its workers with SIGINT when the budget is spent
        try:
            return run_task(json.loads(Path(argv[0]).read_text()))
        except BaseException as e:
            terminated.wrap_up()
            if not terminated.is_stop(e):
                raise
            return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
