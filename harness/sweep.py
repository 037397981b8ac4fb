"""``python -m harness sweep``: spend a time budget searching the whole matrix, one process per group of rows.

Rows are searched in groups that share their batches (``search.group``: one batch drawn, built and referenced
once, checked by every row of the group that could have drawn it; a failure shrunk for its row alone). Groups are
searched round-robin until the budget is spent: each round runs a group's search with a fresh seed, the first
with a few examples a row (so a short sweep reaches the whole matrix), later ones with the profile's
``max_examples``, and the group whose rows are fewest rounds along goes next. Each group runs in a process of its
own (``harness.sweep_worker``; it goes on to further rounds while no other group waits for a worker), so a
segfault, an illegal memory access or a hang (a case running longer than ``--case-timeout``, not counting time
while a worker's JIT compiler runs, up to ``--compile-timeout``) becomes a finding of the row whose case was
running, with that case as its reproducer, and the sweep goes on with the other rows. A row with a finding is not
searched again in that sweep.

Everything lands in the output folder as it happens: ``findings.jsonl`` (one line per finding; its case file
under ``cases/``), ``results.jsonl`` (one line per row and round; ``--resume`` rebuilds the sweep's state
from it and skips the rows already done), ``logs/`` (each worker's output); at the end ``report.md``,
``report.json`` and the plots.

One sweep writes to a folder at a time (``OUT/.lock``, see ``harness.outlock``). Workers die with the sweep,
however it dies; SIGTERM stops a sweep as Ctrl-C does (workers stopped, report written, exit status 130).
Whatever a worker finished that the sweep did not record (its ``done`` events in ``workers/``, its case
files in ``cases/``: the sweep was killed before it read them) is adopted into ``results.jsonl`` and
``findings.jsonl`` on ``--resume`` and at the end of every sweep.

The example database is a folder (``OUT/examples``, or ``--db PATH``). CI shares it between runs by
restoring it to the same path before a sweep and saving it after (a cache, or an artifact downloaded by
the next run); failures saved there are replayed first. ``--redis URL`` shares one live database between
machines instead (needs the ``redis`` package).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.options import (MPS_HELP, UsageError, add_selection, duration, parse_budget, parse_shard, profile_named,
                             resolve_device)
from harness.outlock import OutFolderLock
from harness.procs import (CASE_TIMEOUT_DEFAULTS, COMPILE_TIMEOUT_S, STARTUP_ALLOWANCE_S, Terminated, compiler_running,
                           compilers_under, default_case_timeout)
from harness.sweep_worker import EXIT_CONTEXT_POISONED, EXIT_MPS_REFUSED, EXIT_MPS_UNAVAILABLE, mps_ready_timeout
from search.casefile import CaseFile, modified, safe_name
from search.matrix import shard_rows
from search.outcome import (ADAPTER_ERROR, MPS_FAULT, RowOutcome, exit_status, finding_kind, is_worse, merge_headroom,
                            mps_client, row_at_risk, unexplained_headroom)

ROOT = Path(__file__).resolve().parents[1]
STATE_FILES = ("sweep.json", "results.jsonl", "findings.jsonl")
STOP_GRACE_S = 5.0  # after SIGINT at the end of the budget, before SIGKILL
MAX_BUNDLE = 8  # groups a worker takes at most
# A group of the harness's own backends goes one round for every CONTROL_EVERY rounds of the engine's groups (its
# rows are a control sample; the engine's compositions are what a sweep is for)
CONTROL_EVERY = 4


def visible_gpus() -> list[str]:
    """The GPU ids a worker may be pinned to (within CUDA_VISIBLE_DEVICES when that is set)."""
    import torch

    count = torch.cuda.device_count()
    listed = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


MAX_WORKERS_PER_GPU = 4


def default_workers(device: str) -> int:
    """On a GPU host, several workers per GPU: a worker spends most of its time in Python on the CPU
    (generation, materialization, checking), so one per GPU leaves the GPU idle. About four cores each."""
    cpus = os.cpu_count() or 1
    if device == "cuda":
        gpus = max(1, len(visible_gpus()))
        return gpus * max(1, min(MAX_WORKERS_PER_GPU, cpus // (4 * gpus)))
    return 2 if cpus >= 4 else 1


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short when a sweep was killed mid-write
    return out


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


@dataclass
class RowState:
    """One row across the sweep's rounds (and the sweeps it resumes)."""

    row: object  # search.matrix.Row
    rounds: int = 0
    cases: int = 0
    seconds: float = 0.0
    worst_error: float | None = None
    bound: float | None = None
    headroom: dict = field(default_factory=dict)  # check -> largest ratio to its bound on passing cases, all rounds
    unexplained: dict = field(default_factory=dict)  # the same over passing cases no ledger entry explains
    near_misses_known: dict = field(default_factory=dict)  # ledger id -> passing near misses it explains
    finding: dict | None = None
    known: dict = field(default_factory=dict)  # ledger id -> cases that failed as it describes, all rounds
    steered: dict = field(default_factory=dict)  # ledger id -> draws not run after meeting it, all rounds
    passed_alone: dict = field(default_factory=dict)  # cause -> failures that passed alone, all rounds
    passed_alone_cases: list = field(default_factory=list)

    def absorb(self, result: dict) -> None:
        self.rounds += 1
        self.cases += result.get("cases", 0)
        self.seconds += result.get("seconds", 0.0)
        for known_id, n in (result.get("known") or {}).items():
            self.known[known_id] = self.known.get(known_id, 0) + n
        for known_id, n in (result.get("steered") or {}).items():
            self.steered[known_id] = self.steered.get(known_id, 0) + n
        for cause, n in (result.get("passed_alone") or {}).items():
            self.passed_alone[cause] = self.passed_alone.get(cause, 0) + n
        self.passed_alone_cases += result.get("passed_alone_cases") or []
        err, bound = result.get("worst_error"), result.get("bound")
        if is_worse(err, bound, self.worst_error, self.bound):
            self.worst_error, self.bound = err, bound
        self.headroom = merge_headroom(self.headroom, result.get("headroom"))
        self.unexplained = merge_headroom(self.unexplained, result.get("unexplained_headroom", result.get("headroom")))
        for known_id, n in (result.get("near_misses_known") or {}).items():
            self.near_misses_known[known_id] = self.near_misses_known.get(known_id, 0) + n

    def outcome(self) -> RowOutcome:
        """The row's outcome over every round (a finding's kind gives its status)."""
        r, f = self.row, self.finding
        return RowOutcome(r.id, str(r.composition), r.mode.value, r.property.name, self.cases, self.seconds,
                          self.rounds, ok=f is None, worst_error=self.worst_error, bound=self.bound,
                          headroom=dict(self.headroom), unexplained=dict(self.unexplained),
                          near_misses_known=dict(self.near_misses_known),
                          failure=None if f is None else f["reason"], finding_kind=None if f is None else f["kind"],
                          case_file=None if f is None else f.get("case_file"), known=dict(self.known),
                          steered=dict(self.steered), passed_alone=dict(self.passed_alone),
                          passed_alone_cases=list(self.passed_alone_cases))

    def record(self) -> dict:
        """The row as ``harness.report`` reads it."""
        return self.outcome().record()


# Workers the MPS daemon may refuse in a row (each after a probe it took: faults keep coming) before the sweep gives
# their groups up
MPS_REFUSALS_MAX = 10

@dataclass
class Task:
    """A worker process searching a bundle of groups, one after the other."""

    units: list[str]  # the groups' ids
    slot: int
    proc: subprocess.Popen
    events: Path
    log: Path
    last_activity: float
    offset: int = 0
    current: str | None = None  # the group whose round started and is not yet done
    current_round: int = 0
    round_rows: set = field(default_factory=set)  # the rows of that round not yet done
    started_any: bool = False
    stopping: bool = False
    # Seconds of the current stall during which some worker had a JIT compiler running (not held against it).
    grace: float = 0.0
    grace_anchor: float = 0.0  # the last activity the grace belongs to
    last_watch: float = 0.0
    notices: int = 0  # compile notices printed during the current stall
    awaited_mps: bool = False  # whether it said it waits for the MPS daemon


@dataclass
class Sweep:
    rows: list[RowState]
    device: str
    profile: str
    out_dir: Path
    deadline: float
    workers: int
    case_timeout_s: float | None  # None: each group's default (``default_case_timeout``)
    seed: int
    db: str | None
    redis: str | None
    mutant: str | None
    max_rounds: int | None
    progress: object
    gpus: list[str] = field(default_factory=list)
    compile_timeout_s: float = COMPILE_TIMEOUT_S
    # ``harness run``'s settings (harness.run), when ``is_run``: its examples a row (None: the profile's, fewer for a slow
    # row, as ``search_group`` takes them; a sweep's rounds have ``round_examples``), each row's shrink seconds and the
    # run's in all (None: the profile's, no total; each worker gets what is left when it starts, so workers running
    # side by side may each spend it), and ``on_row(state)``, called for each row that passed its last round (the
    # one round, or the second under a budget) or has a finding, in place of the sweep's own lines
    is_run: bool = False
    examples: int | None = None
    shrink_seconds: float | None = None
    shrink_total: float | None = None
    on_row: object = None
    # A worker silent this long while its JIT compiler runs says so, in one line, and again each period
    compile_notice_s: float = 60.0
    mps: bool = False  # the workers of a GPU sweep are clients of an MPS daemon (harness/mps.py)
    mps_refusals: dict = field(default_factory=dict)  # group -> its workers the MPS daemon refused in a row
    mps_faults: list = field(default_factory=list)  # the cases of CUDA errors under MPS that passed alone
    fault_reproduced: bool = False  # whether a case's CUDA error under MPS failed alone with one too (fault_alone)
    running: dict[int, Task] = field(default_factory=dict)
    launches: int = 0
    compiling: bool = False  # whether a worker had a compiler running at the last look
    compile_checked: float = 0.0
    stop_sent: float | None = None  # when the first worker was told to stop (SIGINT); None: none yet

    def __post_init__(self) -> None:
        from search.group import group_rows
        from search.profiles import profile

        self.by_id = {s.row.id: s for s in self.rows}
        # The units of work: groups of rows that share their batches, in matrix order of their first rows
        self.groups = {g.id: g for g in group_rows([s.row for s in self.rows], profile(self.profile), self.device)}
        self.members = {unit: [self.by_id[r.id] for r in g.rows] for unit, g in self.groups.items()}
        self.unit_of = {r.id: unit for unit, g in self.groups.items() for r in g.rows}
        self.retired: set[str] = set()
        self._control_weight: int | None = None  # rank()'s, once
        # Names this invocation's task files and logs (the pid: two sessions may start within one second).
        self.session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    # ---- scheduling ------------------------------------------------------------------------------------
    def active(self, unit: str) -> list[RowState]:
        if unit in self.retired:
            return []
        return [s for s in self.members[unit] if s.finding is None
                and (self.max_rounds is None or s.rounds < self.max_rounds)]

    def waiting(self) -> list[str]:
        """Groups with rows to search and no worker, fewest rounds along first, a group of the harness's own backends
        counting each of its rounds CONTROL_EVERY times when the sweep has an engine's groups; at equal rounds those
        that run an engine's classes before the harness's own (the engine is what a sweep is for: a 46-minute CPU
        sweep in matrix order never reached an SGLang row), then matrix order."""
        busy = {u for t in self.running.values() for u in t.units}
        ready = [(self.rank(u), not self.engine_rows(u), order, u)
                 for order, u in enumerate(self.groups) if u not in busy and self.active(u)]
        return [u for *_, u in sorted(ready)]

    def rank(self, unit: str) -> int:
        """How far along the group ``unit`` counts: its rows' fewest rounds, times CONTROL_EVERY for a group of the
        harness's own backends when the sweep has an engine's groups."""
        if self._control_weight is None:
            self._control_weight = CONTROL_EVERY if any(self.engine_rows(u) for u in self.groups) else 1
        return min(s.rounds for s in self.active(unit)) * (1 if self.engine_rows(unit) else self._control_weight)

    def engine_rows(self, unit: str) -> bool:
        """Whether the group ``unit`` runs an engine's classes (not only the harness's own backends)."""
        return any(s.row.composition.engine != "harness" for s in self.members[unit])

    def bundle(self, waiting: list[str]) -> list[str]:
        """The groups the next worker takes: the first waiting one, and more of those waiting at its round, a fair
        share of them for the workers, up to MAX_BUNDLE. A worker process costs its imports (torch, the
        engine: seconds on a CPU), which a small group's round does not repay: a 150 s CPU sweep of 312 rows
        launched 50 workers for single groups and checked 860 cases, where 19 workers, one per composition, had
        checked 1304 (2026-11-27)."""
        # Those of the first one's rank (the order waiting() keeps: an engine group lagging a round does not take ours
        # along) and of its round (a worker searches its groups a round at a time)
        first = (self.rank(waiting[0]), min(s.rounds for s in self.active(waiting[0])))
        same = [u for u in waiting if (self.rank(u), min(s.rounds for s in self.active(u))) == first]
        # A share for every worker, not only the free ones: at the end of a round, one free worker taking every group
        # left would run them in turn while the others stood idle
        return same[:max(1, min(MAX_BUNDLE, -(-len(same) // self.workers)))]

    def launch(self, slot: int, units: list[str]) -> None:
        rows = [s for u in units for s in self.active(u)]
        round_ = min(s.rounds for s in rows)
        self.launches += 1
        more = f"+{len(units) - 1}" if len(units) > 1 else ""
        stem = f"{self.session}-{self.launches:03d}--{safe_name(units[0])}{more}--r{round_}"
        task_file, events = self.out_dir / "workers" / f"{stem}.json", self.out_dir / "workers" / f"{stem}.events.jsonl"
        log = self.out_dir / "logs" / f"{stem}.log"
        task_file.parent.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        task_file.write_text(json.dumps({
            "units": [{"unit": u, "compositions": sorted({str(r.composition) for r in self.groups[u].rows}),
                       "members": [r.id for r in self.groups[u].rows],
                       "rows": [{"row": s.row.id, "rounds": s.rounds} for s in self.active(u)]} for u in units],
            "device": self.device, "profile": self.profile, "seed": self.seed, "max_rounds": self.max_rounds,
            "out_dir": str(self.out_dir), "db": self.db, "redis": self.redis, "mutant": self.mutant,
            "deadline": self.deadline, "events": str(events), "parent": os.getpid(), "run": self.is_run,
            "examples": self.examples,
            "shrink_seconds": self.shrink_seconds, "shrink_total": self.shrink_total,
            # Further rounds in the same process only while no other group waits for a worker.
            "continue_until": self.deadline if len(self.waiting()) <= len(units) + self.workers - len(self.running) - 1
            else 0.0},
            indent=1))
        events.write_text("")
        with open(log, "w") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "harness.sweep_worker", str(task_file)],
                                    stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.worker_env(slot), start_new_session=True)
        self.running[slot] = Task(units, slot, proc, events, log, time.time())
        append_jsonl(self.out_dir / "workers" / "pids.jsonl", {"pid": proc.pid, "units": units,
                                                               "task": str(task_file), "time": time.time()})
        gpu = f" on GPU {self.gpus[slot % len(self.gpus)]}" if self.gpus else ""
        for u in units:
            rows = self.active(u)
            if self.is_run:  # the label says how many rows, unless a fresh process goes on after a crash
                left = "" if len(rows) == len(self.groups[u].rows) else f", {len(rows)} row(s) left"
                self.progress.event(f"start {self.groups[u].label}{left}{gpu}")
                continue
            self.progress.event(f"start {self.groups[u].label} at round {min(s.rounds for s in rows) + 1}: "
                                f"{len(rows)} row(s){gpu}")

    def worker_env(self, slot: int) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[slot % len(self.gpus)]  # set before the child imports torch
        else:
            env.setdefault("TRITON_INTERPRET", "1")
        # Workers share the cores: without this, each one's torch starts a thread per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.workers)))
        return env

    # ---- supervision -----------------------------------------------------------------------------------
    def run(self) -> None:
        from harness.mps import mps_daemon

        if self.mps and self.device != "cuda":
            self.progress.event("MPS: asked for, but the workers run on the CPU: nothing to share")
        with mps_daemon(self.mps and self.device == "cuda", self.progress.event):
            self._supervise()

    def note_mps(self, result: dict) -> None:
        """Count a row's result towards :meth:`unreproduced_fault`: its CUDA errors under MPS that passed alone, and
        whether one of its failures reproduced the fault alone."""
        self.mps_faults += [c["case"] for c in result.get("passed_alone_cases") or () if c.get("entry") == MPS_FAULT]
        self.fault_reproduced = self.fault_reproduced or bool(result.get("fault_alone"))

    def unreproduced_fault(self) -> None:
        """Under MPS every CUDA error that passed alone was counted as another worker's fault (``mps-fault``). A fault
        happened all the same: if no case reproduced one alone (its own fault may hang on memory layout or on what its
        process ran before), one finding says so and names the candidates, so that a GPU fault is never counted away
        whole. Called once the sweep (or run) has ended, stopped or not, after its last results were read; candidates an
        earlier session of the sweep already named are not named again."""
        named = {c for f in read_jsonl(self.out_dir / "findings.jsonl") for c in f.get("candidates") or ()}
        self.mps_faults = [c for c in self.mps_faults if c not in named]
        if self.mps_faults and not self.fault_reproduced:
            self.finding(None, "error", f"{len(self.mps_faults)} case(s) failed with a CUDA error under MPS and passed "
                                        f"alone; no case reproduced the GPU fault alone: its case is among them",
                         None, "MPS", None, candidates=list(self.mps_faults))

    def _supervise(self) -> None:
        try:
            while True:
                if time.time() - self.compile_checked >= 1.0:
                    # A worker waiting on another's build (a file lock: FlashInfer's, Inductor's ISA check), in this
                    # sweep or one beside it, has no compiler of its own (harness/procs.py).
                    self.compiling = compiler_running([t.proc.pid for t in self.running.values()], machine_wide=True)
                    self.compile_checked = time.time()
                for slot in list(self.running):
                    self.watch(self.running[slot])
                if time.time() >= self.deadline:
                    if self.running:
                        self.progress.event(f"budget spent: stopping {len(self.running)} worker(s); "
                                            f"their rows in progress are not counted")
                    break
                for slot in range(self.workers):
                    waiting = self.waiting()
                    if slot not in self.running and waiting:
                        self.launch(slot, self.bundle(waiting))
                if not self.running:
                    break
                self.progress.update(self.status_line(), [self.describe(t) for t in self.running.values()])
                time.sleep(0.2)
        finally:
            for task in list(self.running.values()):
                self.stop(task)

    def watch(self, task: Task) -> None:
        self.read_events(task)
        code = task.proc.poll()
        if code is not None:
            self.read_events(task)
            del self.running[task.slot]
            self.exited(task, code)
            return
        active = task.last_activity
        if task.current:  # rewritten before every example: its age is the running case's
            active = max(active, modified(self.pending_file(task.current)) or active)
        now = time.time()
        if active != task.grace_anchor:
            task.grace, task.grace_anchor, task.notices = 0.0, active, 0
        if self.compiling:
            task.grace += now - (task.last_watch or now)
            self.compile_notice(task, now - active)
        task.last_watch = now
        stalled = now - active
        limit = max(self.case_timeout(u) for u in ([task.current] if task.current else task.units))
        if not task.current:  # still starting: imports, not a case (harness/procs.py, STARTUP_ALLOWANCE_S)
            limit = max(limit, STARTUP_ALLOWANCE_S)
        if stalled - task.grace > limit or stalled > self.compile_timeout_s:
            self.dump_stacks(task)
            self.kill(task)
            del self.running[task.slot]
            what = "case" if task.current else "worker (before its first row)"
            waited = f", {task.grace:.0f}s of it while a JIT compiler ran" if task.grace >= 1 else ""
            self.crashed(task, "hang", f"hang: a {what} made no progress for {stalled:.0f}s{waited}")

    def compile_notice(self, task: Task, silent: float) -> None:
        """One line for each ``compile_notice_s`` a worker has been silent while a JIT compiler runs under it (slow,
        not hung: a cold GPU's FlashInfer builds take minutes), naming what it compiles for and how long it has."""
        if silent < (task.notices + 1) * self.compile_notice_s:
            return
        task.notices = int(silent // self.compile_notice_s)
        compilers = compilers_under(task.proc.pid)
        if compilers:
            self.progress.event(f"worker {task.slot}: {self.groups[task.current or task.units[0]].label}: compiling "
                                f"kernels for {silent:.0f}s ({', '.join(compilers)})")

    def case_timeout(self, unit: str) -> float:
        """How long one case of the group ``unit`` may make no progress: ``--case-timeout``, or the longest default
        of its rows' compositions."""
        if self.case_timeout_s:
            return self.case_timeout_s
        return max(default_case_timeout(self.device, bool(s.row.composition.support().interpreted_on_cpu))
                   for s in self.members[unit])

    def read_events(self, task: Task) -> None:
        with open(task.events, "rb") as f:
            f.seek(task.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
        task.offset += len(complete)
        for line in complete.decode().splitlines():
            event = json.loads(line)
            task.last_activity = time.time()
            if event["event"] == "awaiting-mps" and not task.awaited_mps:
                task.awaited_mps = True
                self.progress.event(f"worker {task.slot}: the MPS daemon takes no new client yet (after a GPU fault it "
                                    f"waits for every client to exit): waiting ({event.get('said') or 'refused'})")
            if event["event"] == "start":
                task.current, task.current_round, task.started_any = event["row"], event["round"], True
                task.round_rows = set(event.get("rows") or ())
            elif event["event"] == "done":
                task.round_rows.discard(event["row"])  # each row's as soon as its round is over
                if not task.round_rows:
                    task.current = None
                self.row_done(self.by_id[event["row"]], event["round"], event["result"], event.get("seed"))

    def row_done(self, state: RowState, round_: int, result: dict, seed: int | None = None) -> None:
        self.record_result(state, round_, result, seed)
        self.mps_refusals.pop(self.unit_of.get(state.row.id), None)
        if self.shrink_total is not None:  # a run's: what is left goes to the workers launched from now on
            self.shrink_total = max(0.0, self.shrink_total - (result.get("shrink_seconds") or 0.0))
        r = state.row
        if result["ok"] and self.on_row is not None:
            if state.rounds >= (self.max_rounds or 1):  # a run's row ends with its last round (two under a budget)
                self.on_row(state)
            return
        if result["ok"]:
            ratio = "" if result["worst_error"] is None else \
                f", worst {result['worst_error'] / result['bound']:.2f} of bound"
            ratio += "".join(f", AT RISK: {check} at {unexplained_headroom(result)[check]:.2f}"
                             for check in row_at_risk(result))
            self.progress.event(f"ok {r.id} round {round_ + 1}: {result['cases']} cases{ratio} "
                                f"({result['seconds']:.1f}s)")
            return
        kind = ADAPTER_ERROR if finding_kind(result.get("status", "")) == ADAPTER_ERROR else "failure"
        self.finding(state, kind, result["failure"], result["case_file"], str(r.composition), round_,
                     batch_size=result.get("batch_size"), num_tokens=result.get("num_tokens"))

    def record_result(self, state: RowState, round_: int, result: dict, seed: int | None = None) -> None:
        """``seed``: the group search's seed in that round (the worker's ``done`` event says it)."""
        state.absorb(result)
        self.note_mps(result)
        r = state.row
        append_jsonl(self.out_dir / "results.jsonl", {
            "row": r.id, "composition": str(r.composition), "mode": r.mode.value, "property": r.property.name,
            "round": round_, "group": self.unit_of.get(r.id), "seed": seed, **result})

    def adopt_orphans(self, since: float) -> int:
        """Record what workers finished but the sweep never read (it was killed first): ``done`` events missing
        from ``results.jsonl``, and case files under ``cases/`` that no finding names. Only files written
        since ``since`` (when this sweep began) count: older ones belong to a sweep moved aside. Returns how
        many results and findings were adopted."""
        have = {(r.get("row"), r.get("round")) for r in read_jsonl(self.out_dir / "results.jsonl")}
        adopted = 0
        for events in sorted((self.out_dir / "workers").glob("*.events.jsonl")):
            if events.stat().st_mtime < since:
                continue
            for event in read_jsonl(events):
                state = self.by_id.get(event.get("row"))
                if event.get("event") != "done" or state is None or (state.row.id, event["round"]) in have:
                    continue
                have.add((state.row.id, event["round"]))
                result = event["result"]
                self.record_result(state, event["round"], result, event.get("seed"))
                adopted += 1
                if not result["ok"] and state.finding is None:
                    self.finding(state, result.get("finding_kind") or "failure", result["failure"],
                                 result["case_file"], str(state.row.composition), event["round"],
                                 batch_size=result.get("batch_size"), num_tokens=result.get("num_tokens"),
                                 adopted=f"from {events.name}")
                    adopted += 1
        named = {Path(f["case_file"]).name for f in read_jsonl(self.out_dir / "findings.jsonl") if f.get("case_file")}
        for path in sorted((self.out_dir / "cases").glob("*.json")):
            if path.name in named or path.stat().st_mtime < since:
                continue
            if self.stop_sent is not None and path.stat().st_mtime >= self.stop_sent:
                # Written after its worker was told to stop: the stop may be what failed. A KeyboardInterrupt
                # raised inside numpy's conversion of a shape (an interpreted kernel's __index__) comes out as
                # "TypeError: expected a sequence of integers", which a CPU campaign adopted as a finding
                # (2026-11-26). Set aside, not adopted and not lost; a real failure is found again.
                aside = self.out_dir / "interrupted"
                aside.mkdir(exist_ok=True)
                path.replace(aside / path.name)
                self.progress.event(f"{path.name} was written after its worker was told to stop: not taken as a "
                                    f"finding (kept in {aside.name}/)")
                continue
            try:
                case = CaseFile.read(path)
            except Exception:  # noqa: BLE001 - not a case file this harness can read: not a finding of its own
                continue
            state = self.by_id.get(case.row_id)
            if state is None or state.finding is not None:
                continue  # a row outside this sweep, or one whose finding is already recorded
            reason = (case.verdict or {}).get("reason") or "a case file without a recorded finding"
            self.finding(state, "failure", reason, str(path), case.composition, None, adopted=f"from {path.name}")
            adopted += 1
        for path in sorted((self.out_dir / "replaying-alone").glob("*.json")):
            # A case a worker was replaying alone when it stopped (search_row.confirm_alone): neither a finding nor
            # cleared. Set aside with what its replays printed, said in one line
            from search.search_row import move_case

            move_case(path, self.out_dir / "interrupted")
            self.progress.event(f"{path.name} was being replayed alone when its worker stopped: not taken as a "
                                f"finding (kept in interrupted/; `harness repro` it to tell)")
        return adopted

    def exited(self, task: Task, code: int) -> None:
        if task.stopping or code == 0:
            return
        label = ", ".join(self.groups[u].label for u in task.units)
        refused = [self.mps_refusals.get(u, 0) + 1 for u in task.units]  # (a row's result resets its group's)
        if code == EXIT_MPS_REFUSED:
            self.mps_refusals.update(zip(task.units, refused))
        if code == EXIT_MPS_REFUSED and max(refused) <= MPS_REFUSALS_MAX:
            self.progress.event(f"{label}: the MPS daemon refused the worker after taking its probe (another worker's "
                                f"GPU fault since): a fresh process waits for it")
            return
        if code in (EXIT_MPS_REFUSED, EXIT_MPS_UNAVAILABLE):
            # Neither the engine's nor a row's: the daemon takes no client. This sweep leaves the groups alone.
            self.retired.update(task.units)
            why = (f"refused the group's worker {max(refused)} times in a row" if code == EXIT_MPS_REFUSED else
                   f"took no new client for {mps_ready_timeout():.0f}s")
            self.finding(None, "error", f"the MPS daemon {why}: its groups are left (stop the daemon, or run without "
                                        f"--mps)", None, label, None, groups=list(task.units))
            return
        if code == EXIT_CONTEXT_POISONED:
            self.progress.event(f"{self.groups[task.current or task.units[0]].label}: the process is unusable after a "
                                f"failure (a lost CUDA context, or a known bug's stray writes); its remaining rows go "
                                f"to a fresh process")
            return
        from harness.mutants.run import exit_description

        raised = self.exception_line(task)
        if code == 1 and not raised.startswith("SystemExit"):
            # An exception out of the worker's Python: Property.run turns every exception of a check (the engine's
            # included) into a verdict, so what escapes is the harness's own code (the search, the worker), never
            # the engine's bug
            self.crashed(task, ADAPTER_ERROR, f"harness error: the worker raised ({raised})")
            return
        self.crashed(task, "crash", f"crash: the worker died ({exit_description(code)})")

    def crashed(self, task: Task, kind: str, reason: str) -> None:
        """A worker died or hung: a finding for the row whose case was running (the group's pending case names it),
        with that case as reproducer."""
        label = ", ".join(self.groups[u].label for u in task.units)
        pending = self.pending_file(task.current) if task.current else None
        case = CaseFile.read(pending) if pending is not None and pending.exists() else None
        state = None if case is None else self.by_id.get(case.row_id)
        if state is not None and state.row.id not in task.round_rows:
            # The pending case is of a row whose round had ended (reported): what failed came after it, between cases
            state = None
        # Without a row to blame, a worker that raised is the harness's own error (never a finding of the engine's);
        # one that died or hung between cases is an error of unknown cause
        group_kind = ADAPTER_ERROR if kind == ADAPTER_ERROR else "error"
        if state is None and task.current:
            # A group's round was running, no case of a row still running named: the harness's own code failed
            # between cases. That group is left alone; the worker's other groups go on in a fresh process
            self.retired.add(task.current)
            if pending is not None:
                pending.unlink(missing_ok=True)
            where = "" if kind == ADAPTER_ERROR else self.innermost_frame(self.log_tail(task, 15))
            self.finding(None, group_kind, f"{reason}{where} in {self.groups[task.current].label}, between cases",
                         None, self.groups[task.current].label, None, groups=[task.current])
            return
        if state is None:
            # No group was running: the worker itself is broken (an import error, a bad environment). Its rows
            # would fail the same way in every process, so this sweep leaves its groups alone.
            self.retired.update(task.units)
            where = "before its first row" if not task.started_any else "between rows"
            self.finding(None, group_kind, f"{reason} {where}: {self.exception_line(task)}", None, label, None,
                         groups=list(task.units))
            return
        tail = self.log_tail(task, 15)
        reason += self.innermost_frame(tail)
        if "CUDA error" in tail and mps_client():  # (not replayed alone: the process is gone; its case is kept)
            reason += " [under MPS, another worker's GPU fault reaches every worker: replay the case alone to tell]"
        case_file = str(case.settle(pending, f"{reason} (not shrunk: the process died with it)", self.out_dir))
        self.finding(state, kind, reason, case_file, case.composition, task.current_round, log=str(task.log),
                     log_tail=tail)

    def finding(self, state: RowState | None, kind: str, reason: str, case_file: str | None, composition: str,
                round_: int | None, **extra) -> None:
        record = {"kind": kind, "row": state and state.row.id, "composition": composition,
                  "mode": state and state.row.mode.value, "property": state and state.row.property.name,
                  "round": round_, "reason": reason, "case_file": case_file, "mutant": self.mutant,
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}
        append_jsonl(self.out_dir / "findings.jsonl", record)
        if state is not None:
            state.finding = record
            if self.on_row is not None:
                self.on_row(state)
                return
        self.progress.event(f"FINDING ({kind}) {state.row.id if state else composition}: {reason}")
        if case_file:
            self.progress.event(f"  reproduce: python -m harness repro {case_file}")

    def pending_file(self, unit: str) -> Path:
        return self.out_dir / "pending" / f"{safe_name(unit)}.json"  # where search_group writes it

    @staticmethod
    def log_tail(task: Task, lines: int) -> str:
        """The end of the worker's log, or where faulthandler's last stack dump starts (innermost frame first)."""
        text = task.log.read_text(errors="replace").strip().splitlines() if task.log.exists() else []
        dumps = [i for i, line in enumerate(text) if "(most recent call first)" in line]
        if dumps:
            start = dumps[-1] - 2 if dumps[-1] >= 2 and "Fatal Python error" in text[dumps[-1] - 2] else dumps[-1]
            return "\n".join(text[start:start + lines])
        return "\n".join(text[-lines:]) if text else "(no output)"

    @staticmethod
    def exception_line(task: Task) -> str:
        """The last line of the worker's log that names an exception (``RuntimeError: ...``), else its last line:
        Hypothesis prints its notes after the exception it re-raises."""
        text = task.log.read_text(errors="replace").strip().splitlines() if task.log.exists() else []
        named = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed)\b(?::.*)?$")
        return next((line for line in reversed(text) if named.match(line)), text[-1] if text else "(no output)")

    @staticmethod
    def innermost_frame(log_tail: str) -> str:
        """', in forward_decode (mutants.py:258)' from a faulthandler dump, else ''."""
        m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', log_tail)
        return f", in {m.group(3)} ({m.group(1).rsplit('/', 1)[-1]}:{m.group(2)})" if m else ""

    # ---- stopping --------------------------------------------------------------------------------------
    def dump_stacks(self, task: Task) -> None:
        """Ask the hung worker for its Python stacks (faulthandler writes them to its log)."""
        try:
            os.kill(task.proc.pid, signal.SIGUSR1)
            task.proc.wait(1.0)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass

    def kill(self, task: Task) -> None:
        task.stopping = True
        try:
            os.killpg(task.proc.pid, signal.SIGKILL)  # the worker's own session: it and anything it started
        except ProcessLookupError:
            pass
        task.proc.wait()

    def stop(self, task: Task) -> None:
        task.stopping = True
        if self.stop_sent is None:
            self.stop_sent = time.time()
        try:
            os.killpg(task.proc.pid, signal.SIGINT)
            task.proc.wait(STOP_GRACE_S)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            self.kill(task)
        self.read_events(task)  # a row that finished during the grace period still counts
        self.running.pop(task.slot, None)

    # ---- display ---------------------------------------------------------------------------------------
    def status_line(self) -> str:
        done = [s for s in self.rows if s.rounds or s.finding]
        findings = sum(s.finding is not None for s in self.rows)
        rounds = min((s.rounds for s in self.rows if s.finding is None), default=0)
        left = "" if self.deadline == math.inf else f", {duration(max(0.0, self.deadline - time.time()))} left"
        return (f"{len(done)}/{len(self.rows)} rows searched, every row {rounds} round(s) or more, "
                f"{sum(s.cases for s in self.rows)} cases, {findings} finding(s){left}")

    def describe(self, task: Task) -> str:
        return f"worker {task.slot}: {self.groups[task.current or task.units[0]].label} round {task.current_round + 1}"


def selection_flags(selection: dict) -> str:
    """The command line's row selection, as flags: '--backends torch_native --modes decode'."""
    flags = [f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in selection.items() if v]
    return " ".join(flags) or "no --backends, --properties, --modes or --shard"


def same_selection(selection: dict) -> dict:
    """A selection compared up to order and spelling: [] and None are both 'all'."""
    return {k: (tuple(sorted(v)) if isinstance(v, list) else v) or None for k, v in selection.items()}


def prepare_out_dir(out_dir: Path, resume: bool, profile: str, device: str, seed: int | None = None,
                    mutant: str | None = None, rows: list[str] | None = None,
                    selection: dict | None = None) -> dict:
    """The sweep's metadata: the resumed sweep's (which must be the same sweep: profile, device, mutant and
    row selection), or a new sweep's (a previous sweep's files moved aside)."""
    meta_path = out_dir / "sweep.json"
    if resume and not meta_path.exists():
        raise UsageError(f"--resume: {out_dir} holds no sweep to resume (no sweep.json); "
                          f"drop --resume to start one there")
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        meta = json.loads(meta_path.read_text())
        for key, now in (("profile", profile), ("device", device)):
            if meta.get(key) != now:
                raise UsageError(f"--resume: {out_dir} holds a sweep with {key} {meta.get(key)}; "
                                  f"pass --{key} {meta.get(key)} or choose another --out")
        if "mutant" in meta and meta["mutant"] != mutant:  # (sweeps before this check recorded none)
            what = f"pass --mutant {meta['mutant']}" if meta["mutant"] else "drop --mutant"
            held = f"with mutant {meta['mutant']}" if meta["mutant"] else "without a mutant"
            raise UsageError(f"--resume: {out_dir} holds a sweep {held}; {what} or choose another --out")
        # The selection, not the row ids: a resumed nightly sweep goes on when a new backend adds rows.
        if selection is not None and "selection" in meta and same_selection(meta["selection"]) != same_selection(
                selection):
            raise UsageError(f"--resume: {out_dir} holds a sweep of other rows (selected by "
                              f"{selection_flags(meta['selection'])}); pass the same selection or choose another --out")
    else:
        old = [out_dir / n for n in STATE_FILES if (out_dir / n).exists()]
        if old:
            stamp = datetime.datetime.fromtimestamp(old[0].stat().st_mtime).strftime("%Y%m%d-%H%M%S")
            keep = out_dir / "previous" / stamp
            keep.mkdir(parents=True, exist_ok=True)
            for p in old:
                p.replace(keep / p.name)
        meta = {"seed": random.SystemRandom().getrandbits(32) if seed is None else seed, "profile": profile, "device": device,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "started": time.time(), "mutant": mutant, "selection": selection or {}, "rows": sorted(rows or [])}
        meta_path.write_text(json.dumps(meta, indent=1))
    for stale in (out_dir / "pending").glob("*.json"):  # cases of a sweep that was stopped, not findings
        stale.unlink()
    return meta


def resumed_profile(args) -> str:
    """``--profile``, or with ``--resume`` the resumed sweep's profile when it is the same one with its head
    rotation (``gpu@3``): a sweep resumed on another day keeps the configurations it started with."""
    meta_path = Path(args.out) / "sweep.json"
    if not args.resume or "@" in args.profile or not meta_path.exists():
        return args.profile
    try:
        recorded = json.loads(meta_path.read_text()).get("profile") or ""
    except (OSError, ValueError):
        return args.profile
    return recorded if recorded.split("@")[0] == args.profile else args.profile


def cmd_sweep(args) -> int:
    from harness.mutants.catalogue import mutant_named
    from harness.sweep_worker import example_database
    from properties import PROPERTIES
    from search.matrix import matrix

    budget = parse_budget(args.budget)
    shard = parse_shard(args.shard) if args.shard else None
    device = resolve_device(args.device)
    profile = profile_named(resumed_profile(args), shard[0] if shard else 0)  # the shard's head rotation
    mutant_named(args.mutant)
    unknown = [p for p in args.properties or [] if p not in PROPERTIES]
    if unknown:
        raise UsageError(f"unknown propert{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                          f"properties: {', '.join(PROPERTIES)}")
    for name, value in (("--workers", args.workers), ("--case-timeout", args.case_timeout),
                        ("--compile-timeout", args.compile_timeout), ("--rounds", args.rounds)):
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    selected = matrix(device, profile, args.backends, args.properties, args.modes)
    rows, skipped = selected.rows, selected.unavailable
    if not rows:
        raise UsageError(selected.why_empty())
    rows = shard_rows(rows, shard)
    out_dir = Path(args.out)
    db = None if args.redis else str((Path(args.db) if args.db else out_dir / "examples").absolute())
    try:
        example_database(db, args.redis)  # a bad --redis fails here, once, not in every worker
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.resume and not (out_dir / "sweep.json").exists():  # before the lock creates the folder
        prepare_out_dir(out_dir, True, profile.name, device)  # raises: nothing to resume
    lock = OutFolderLock(out_dir).acquire()  # one sweep writes here at a time; the kernel frees it on death
    try:
        return _sweep_locked(args, budget, shard, device, profile, rows, skipped, out_dir, db)
    finally:
        lock.release()


def sweep_began(meta: dict) -> float:
    """When the sweep in ``meta`` began (its first session), as a timestamp."""
    if meta.get("started") is not None:
        return float(meta["started"])
    try:  # a sweep.json of a sweep that did not record it: its creation, to the second
        return datetime.datetime.fromisoformat(meta["created"]).timestamp() - 1.0
    except (KeyError, TypeError, ValueError):
        return 0.0


def _sweep_locked(args, budget, shard, device, profile, rows, skipped, out_dir: Path, db) -> int:
    from harness.progress import make_progress
    from harness.report import write_reports

    selection = {"backends": args.backends, "properties": args.properties, "modes": args.modes, "shard": args.shard}
    meta = prepare_out_dir(out_dir, args.resume, profile.name, device, args.seed, mutant=args.mutant,
                           rows=[r.id for r in rows], selection=selection)
    states = {r.id: RowState(r) for r in rows}
    for result in read_jsonl(out_dir / "results.jsonl"):
        if result.get("row") in states:
            states[result["row"]].absorb(result)
    for f in read_jsonl(out_dir / "findings.jsonl"):
        if f.get("row") in states:
            states[f["row"]].finding = f

    start = time.time()
    progress = make_progress(start, budget)
    workers = args.workers or default_workers(device)
    sweep = Sweep(list(states.values()), device, profile.name, out_dir, start + budget, workers,
                  args.case_timeout, meta["seed"], db, args.redis,
                  args.mutant, args.rounds, progress, visible_gpus() if device == "cuda" else [],
                  args.compile_timeout or COMPILE_TIMEOUT_S, mps=args.mps)
    began = sweep_began(meta)
    for result in read_jsonl(out_dir / "results.jsonl"):  # an earlier session's faults under MPS (--resume)
        sweep.note_mps(result)
    if args.resume:
        adopted = sweep.adopt_orphans(began)
        if adopted:
            progress.event(f"adopted {adopted} result(s) and finding(s) that workers wrote after their sweep "
                           f"stopped reading")
    cases_before = sum(s.cases for s in sweep.rows)  # the cases/s below is this session's
    resumed = sum(1 for s in sweep.rows if s.rounds or s.finding)
    notes = [f"shard {shard[0]}/{shard[1]}"] if shard else []
    notes += [f"{resumed} row(s) resumed"] if resumed else []
    notes += [f"mutant {args.mutant}"] if args.mutant else []
    progress.event(f"sweep of {len(rows)} row(s) in {len(sweep.groups)} group(s) on {device}, profile "
                   f"{profile.name}, budget {duration(budget)}, {workers} worker(s)" + "".join(f", {n}" for n in notes))
    with Terminated(repeat=False) as terminated:
        try:
            sweep.run()
        except BaseException as e:
            terminated.wrap_up()
            if not terminated.is_stop(e):
                raise
        finally:
            terminated.wrap_up()
            progress.close()
        interrupted = terminated.stopped is not None
        elapsed = time.time() - start
        sweep.adopt_orphans(began)  # a case file of a worker killed between writing it and saying so
        sweep.unreproduced_fault()  # (stopped or not: a fault seen is reported)

        findings = read_jsonl(out_dir / "findings.jsonl")
        records = [s.record() for s in sweep.rows]
        searched = [s for s in sweep.rows if s.finding is None and s.rounds]
        rounds = (min(s.rounds for s in searched), max(s.rounds for s in searched)) if searched else (0, 0)
        settings = {"budget_s": budget, "elapsed_s": round(elapsed, 1), "shard": args.shard, "workers": workers,
                    "seed": meta["seed"], "mutant": args.mutant, "rounds": list(rounds),
                    "database": args.redis or db, "interrupted": interrupted}
        paths = write_reports(records, skipped, out_dir, device, profile.name, findings=findings,
                              extra={"sweep": settings})
        cases = sum(r["cases"] for r in records)
        session = cases - cases_before
        counted = f"{cases} cases ({session} this session)" if cases_before else f"{cases} cases"
        unreached = sum(r["status"] == "not run" for r in records)
        print(f"sweep: {len(records)} rows{f' ({unreached} not reached)' if unreached else ''}, rounds "
              f"{rounds[0]}-{rounds[1]}, {counted} in {duration(elapsed)} "
              f"({session / elapsed if elapsed else 0:.1f} cases/s), {len(findings)} finding(s)")
        for f in findings:
            print(f"FINDING ({f['kind']}) {f.get('row') or f['composition']}: {f['reason']}")
            if f.get("case_file"):
                print(f"  reproduce: python -m harness repro {f['case_file']}")
        print(f"report: {', '.join(str(p) for p in paths)}", flush=True)
    if interrupted:
        raise KeyboardInterrupt
    return exit_status(f["kind"] for f in findings)


def add_parser(sub) -> None:
    """Register ``sweep`` with the command line's subparsers."""
    sp = sub.add_parser("sweep", help="spend a time budget searching the whole matrix, a process per group of rows",
                        description=__doc__.splitlines()[0].split(": ", 1)[1])
    add_selection(sp, "nightly")
    sp.add_argument("--properties", nargs="*", help="property names (default: all)")
    sp.add_argument("--modes", nargs="*", help="forward modes (default: all the composition supports)")
    sp.add_argument("--budget", default="30m", help="wall time to spend, e.g. 90s, 30m, 2h (default 30m)")
    sp.add_argument("--shard", help="I/N: search only shard I of N (rows split by a stable hash of their id)")
    sp.add_argument("--rounds", type=int,
                    help="stop after this many rounds of every row (default: the budget decides)")
    db = sp.add_mutually_exclusive_group()
    db.add_argument("--db", help="Hypothesis example database folder (default OUT/examples)")
    db.add_argument("--redis", help="Hypothesis example database on a Redis server, e.g. redis://host:6379/0")
    sp.add_argument("--out", default="harness-out/sweep", help="folder for findings, case files, logs and the report")
    sp.add_argument("--workers", type=int,
                    help="worker processes at a time, pinned to the visible GPUs in turn (default: up to 4 per GPU, "
                         "about 4 cores each; 1-2 on a CPU)")
    sp.add_argument("--mps", action="store_true", help=MPS_HELP)
    sp.add_argument("--case-timeout", type=float,
                    help=f"seconds one case may run before it counts as a hang ({CASE_TIMEOUT_DEFAULTS}); "
                         "time while a worker's JIT compiler (nvcc, ninja, ptxas) runs is not counted")
    sp.add_argument("--compile-timeout", type=float,
                    help=f"seconds one case may wait in all, compiles included (default {COMPILE_TIMEOUT_S:.0f})")
    sp.add_argument("--mutant", help="inject this mutant from the catalogue into every worker")
    sp.add_argument("--seed", type=int, help="the sweep's seed (default: random; kept in sweep.json, and --resume "
                                             "keeps the resumed sweep's): equal seeds search the same cases")
    sp.add_argument("--resume", action="store_true",
                    help="continue the sweep in --out (with a fresh --budget): rows already done this round are "
                         "skipped, its findings kept")
    sp.set_defaults(fn=cmd_sweep)
