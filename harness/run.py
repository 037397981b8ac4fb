"""``python -m harness run``, the main job: every row of the matrix searched once, with its profile's examples, and
reported row by row: a line as each row ends (in the order rows end), ``report.json`` after each, and at the end the
table, ``report.md``, ``junit.xml`` and the plots.

Rows are searched in groups that share their batches (``search.group``), as the sweep searches them: a batch is
drawn, built and referenced once and checked by every row of its group that could have drawn it; a failure is shrunk
for its row alone.

Where the groups run:
- in this process, one after the other (a CPU's default): a group that makes no progress for ``--stall-seconds``
  says so, in one line while a JIT compiler runs, else with every thread's stack;
- in worker processes (a GPU's default, and with a mutant that kills its process, ``--isolate`` or ``--workers``),
  several at a time, under the sweep's supervisor (``harness.sweep.Sweep``: one round and no time budget, or two
  rounds under ``--budget``). A crash or
  a hang is then a finding of the row whose case was running, with that case as its reproducer, and the other rows
  go on; a worker compiling kernels says so in one line per ``--stall-seconds``.

Under ``--budget`` (workers, always) the run ends when the time does: each row's first few examples come before any
row's full search (two rounds, as a sweep's first two), so a budget that cannot hold the whole matrix still reaches
every row it can, and a row the budget cut short ends with the cases it ran (the summary counts them); the rounds
under way when it ends are not counted. ``ci/gpu.sh`` gives the run what its time limit leaves.

Each group draws from ``round_seed(seed, group, 0)`` in this process and in workers alike (under ``--budget``, its
full search from ``round_seed(seed, group, 1)``). The seed is ``--seed`` or a
fresh one, printed at the start: the same seed, rows and example database draw the same cases again, whichever
process runs them.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

from harness.options import UsageError, duration, parse_budget


def fresh_seed() -> int:
    return random.SystemRandom().getrandbits(32)


def clear_worker_state(out_dir: Path) -> None:
    """An earlier run's worker files (its report is about to be replaced too). A sweep's folder is not a run's: its
    state is what ``--resume`` goes on from."""
    if (out_dir / "sweep.json").exists():
        raise UsageError(f"--out {out_dir} holds a sweep (sweep.json): a run there would mix its files with the "
                         f"sweep's; choose another --out")
    for name in ("results.jsonl", "findings.jsonl"):
        (out_dir / name).unlink(missing_ok=True)
    for name in ("workers", "logs"):
        shutil.rmtree(out_dir / name, ignore_errors=True)


def expected_time(out_dir: Path, device: str, profile: str, rows: int, workers: int,
                  budget: float | None = None) -> str:
    """How long this run should take, from the last finished run's report in ``out_dir`` (same device and profile),
    scaled by the number of rows, and no longer than ``budget``; or why there is no estimate."""
    bound = "" if budget is None else f"at most {duration(budget)} (its budget); "
    try:
        data = json.loads((out_dir / "report.json").read_text())
        last = data["run"]
        elapsed, rows_then = float(last["elapsed_s"]), len(data["rows"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{bound}no finished run in {out_dir} to estimate from"
    if data.get("device") != device or data.get("profile") != profile:
        return f"{bound}the earlier run in {out_dir} was on {data.get('device')} under {data.get('profile')}: no estimate"
    if last.get("interrupted") or not rows_then:
        return f"{bound}the earlier run in {out_dir} was interrupted: no estimate"
    if last.get("budget_s") and any(r.get("status") == "not run" or (r.get("ok") and r.get("rounds") == 1)
                                    for r in data["rows"]):
        return f"{bound}the earlier run in {out_dir} ended with its budget before its last row: no estimate"
    estimate = elapsed * rows / rows_then
    where = "this process" if not last.get("workers") else f"{last['workers']} worker(s)"
    note = "" if last.get("workers") == workers else " (other workers now)"
    if budget is not None and budget < estimate:
        return (f"expected {duration(budget)}, its budget: the last run here checked {rows_then} rows in "
                f"{duration(elapsed)} with {where}{note}, so about {duration(estimate)} for all of them")
    return (f"expected about {duration(estimate)}: the last run here checked {rows_then} rows in "
            f"{duration(elapsed)} with {where}{note}")


class RowLines:
    """The run's output as rows end: one line each (``[  n/N] row ... outcome``), its reproducer when it failed, and
    ``report.json`` rewritten, so a run killed midway leaves the report of the rows that ended."""

    def __init__(self, total: int, skipped, out_dir: Path, device: str, profile: str) -> None:
        self.total, self.skipped, self.out_dir, self.device, self.profile = total, skipped, out_dir, device, profile
        self.results: list = []
        self.ended: set[str] = set()

    def __call__(self, result) -> None:
        if result.row_id in self.ended:  # one outcome a row (a supervisor's second word on it is not a second row)
            print(f"note: {result.row_id} was reported again ({result.summary()}); its first outcome stands",
                  file=sys.stderr, flush=True)
            return
        self.ended.add(result.row_id)
        self.results.append(result)
        print(f"[{len(self.results):{len(str(self.total))}d}/{self.total}] {result.row_id} ... {result.summary()} "
              f"{result.seconds:.1f}s", flush=True)
        if not result.ok and result.case_file:
            print(f"          reproduce: python -m harness repro {result.case_file}", flush=True)
        from harness.report import write_json_report

        write_json_report(self.results, self.skipped, self.out_dir / "report.json", self.device, self.profile)


def unended_rows_failed(rows, kind: str, reason: str, lines: RowLines) -> None:
    """Each of ``rows`` that has no outcome yet gets ``kind`` (its group's search failed before it ended)."""
    from search.outcome import RowOutcome

    for row in rows:
        if row.id not in lines.ended:
            lines(RowOutcome(row.id, str(row.composition), row.mode.value, row.property.name, ok=False,
                             failure=f"{reason} (not searched to its end)", finding_kind=kind))


def harness_error(group, error: Exception, out_dir: Path, lines: RowLines) -> None:
    """The harness's own code raised out of ``group``'s search (Property.run turns every error of a check, the
    engine's included, into a verdict): an adapter error, never the engine's finding. The row whose case was running
    (the group's pending case, if that row has not ended) gets it with that case as its case file; the group's other
    unended rows get it without one; the traceback goes to ``logs/harness-errors.log``. The run goes on with the next
    group."""
    import traceback

    from search.casefile import CaseFile, safe_name
    from search.outcome import ADAPTER_ERROR, RowOutcome

    log = out_dir / "logs" / "harness-errors.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"== {group.label}\n{''.join(traceback.format_exception(error))}\n")
    reason = f"harness error: {type(error).__name__}: {error} (traceback in {log})"
    print(f"{group.label}: {reason}", file=sys.stderr, flush=True)
    pending = out_dir / "pending" / f"{safe_name(group.id)}.json"
    case = CaseFile.read(pending) if pending.exists() else None
    row = None if case is None else next((r for r in group.rows if r.id == case.row_id and r.id not in lines.ended),
                                         None)
    if row is not None:
        case_file = case.settle(pending, reason, out_dir)
        lines(RowOutcome(row.id, str(row.composition), row.mode.value, row.property.name, ok=False, failure=reason,
                         finding_kind=ADAPTER_ERROR, spec=case.spec, case_file=case_file))
    pending.unlink(missing_ok=True)
    unended_rows_failed(group.rows, ADAPTER_ERROR, reason, lines)


def run_in_process(groups, profile, device: str, *, database, examples: int | None, out_dir: Path,
                   shrink_seconds: float, seed: int, stall_seconds: float, mutant, on_row) -> None:
    """Search ``groups`` one after the other in this process; shrinking takes at most ``shrink_seconds`` a row and
    ``SHRINK_ROWS_PER_RUN`` rows' worth in all (past that, failures are reported as found)."""
    from harness.procs import StallWatchdog
    from harness.sweep_worker import round_seed
    from search.casefile import safe_name
    from search.group import search_group
    from search.profiles import SHRINK_ROWS_PER_RUN

    shrink_left = SHRINK_ROWS_PER_RUN * shrink_seconds
    watchdog = StallWatchdog(stall_seconds)

    def done(result) -> None:
        nonlocal shrink_left
        shrink_left -= result.shrink_seconds or 0.0
        on_row(result)

    try:
        with mutant.patch() if mutant else contextlib.nullcontext():
            for group in groups:
                # A case is progress: the group's pending case file is rewritten before each one
                watchdog.start(group.label, progress=out_dir / "pending" / f"{safe_name(group.id)}.json")
                try:
                    results = search_group(group, profile, device, database=database, max_examples=examples,
                                           out_dir=out_dir, seed=round_seed(seed, group.id, 0),
                                           shrink_seconds=max(0.0, min(shrink_seconds, shrink_left)), on_done=done)
                except Exception as e:  # noqa: BLE001 - the harness's own bug: reported, and the next group goes on
                    watchdog.stop()
                    harness_error(group, e, out_dir, on_row)
                    continue
                watchdog.stop()
                if device == "cuda" and any(r.cuda_context_lost for r in results):
                    # A device-side assert is sticky: every later case in this process would fail with it.
                    print(f"stopping: {group.label} left the CUDA context unusable; the rows after it need a fresh "
                          f"process (run with --isolate)", file=sys.stderr)
                    return
    finally:
        watchdog.close()


def run_in_workers(rows, profile, device: str, *, db: str, examples: int | None, out_dir: Path,
                   shrink_seconds: float, seed: int, workers: int, case_timeout: float | None, stall_seconds: float,
                   mutant: str | None, on_row: RowLines, progress, budget: float | None = None,
                   mps: bool = False) -> list[dict]:
    """Search ``rows`` in ``workers`` worker processes at a time, one round each; returns the findings that belong to
    no row (a worker that failed between cases or before its first).

    Under a ``budget`` (seconds from now) each row has two rounds, a few examples first (every row is reached before
    any is searched in full), then its own; at the budget's end the workers stop (the rounds they had under way are
    not counted) and each row that passed its first round ends with the cases it ran. A group whose worker failed
    between cases is reported first: its rows that had not ended get that failure, not a first round's pass."""
    from harness.procs import COMPILE_TIMEOUT_S
    from harness.sweep import RowState, Sweep, read_jsonl, visible_gpus
    from search.profiles import SHRINK_ROWS_PER_RUN

    began = time.time()
    rounds = 1 if budget is None else 2
    states = [RowState(r) for r in rows]
    sweep = Sweep(states, device, profile.name, out_dir, math.inf if budget is None else began + budget, workers,
                  case_timeout, seed, db, None, mutant, rounds, progress, visible_gpus() if device == "cuda" else [],
                  COMPILE_TIMEOUT_S, is_run=True, examples=examples, shrink_seconds=shrink_seconds,
                  shrink_total=SHRINK_ROWS_PER_RUN * shrink_seconds, on_row=lambda state: on_row(state.outcome()),
                  compile_notice_s=stall_seconds, mps=mps)
    try:
        sweep.run()
    finally:  # also when the run is stopped: what ended is reported
        sweep.adopt_orphans(began)  # a case file of a worker killed between writing it and saying so
        sweep.unreproduced_fault()  # (stopped or not: a fault seen is reported)
        orphans = [f for f in read_jsonl(out_dir / "findings.jsonl") if not f.get("row")]
        for f in orphans:  # a group left alone after its worker failed between cases: its rows that had not ended
            unended_rows_failed([r for unit in f.get("groups") or () for r in sweep.groups[unit].rows], f["kind"],
                                f["reason"], on_row)
        for state in states:  # the budget (or a stop) ended their full search: they end with what they ran
            if state.finding is None and 0 < state.rounds < rounds and state.row.id not in on_row.ended:
                on_row(state.outcome())
    return orphans


def run(args, rows, skipped, profile, device: str, out_dir: Path, mutant) -> int:
    """The run of ``rows`` as ``args`` ask (``harness.cli.cmd_run`` has checked them); returns the exit status."""
    from harness.procs import Terminated
    from harness.report import print_summary, write_reports
    from harness.sweep import default_workers
    from search.group import group_rows
    from search.outcome import RowOutcome, exit_status

    seed = fresh_seed() if args.seed is None else args.seed
    shrink_seconds = profile.shrink_seconds if args.shrink_seconds is None else args.shrink_seconds
    from harness.sweep_worker import FIRST_ROUND_EXAMPLES

    budget = parse_budget(args.budget) if args.budget else None
    # Worker processes where a crash or a hang is likely or costly: on a GPU (a device-side assert is sticky, an
    # illegal address kills the process, and one process leaves the GPU idle), with a mutant that kills the
    # process, or asked; and under a budget (the sweep's supervisor stops them when it ends).
    isolate = bool(args.isolate or args.workers or device == "cuda" or (mutant and mutant.crashes) or budget)
    workers = (args.workers or default_workers(device)) if isolate else 0
    if workers:
        clear_worker_state(out_dir)
    groups = group_rows(rows, profile, device)
    examples = args.max_examples or profile.max_examples
    control = "" if args.max_examples or not profile.control_examples else \
        f" ({min(examples, profile.control_examples)} for the harness's own rows, a control sample)"
    where = f"{workers} worker process(es)" if workers else "this process"
    within = "" if budget is None else \
        f", within {duration(budget)} (each row's first {min(FIRST_ROUND_EXAMPLES, examples)} examples first)"
    print(f"run of {len(rows)} row(s) in {len(groups)} group(s) on {device}, profile {profile.name}, up to {examples} "
          f"examples a row{control}, in {where}{within}, seed {seed} (--seed {seed} draws these cases again)",
          flush=True)
    print(expected_time(out_dir, device, profile.name, len(rows), workers, budget), flush=True)
    lines = RowLines(len(rows), skipped, out_dir, device, profile.name)
    orphans: list[dict] = []
    start = time.perf_counter()
    # SIGTERM (a CI timeout) stops the run as Ctrl-C does. Once, with workers: the sweep's supervisor stops them and
    # reads what they finished (seconds), which a repeated interrupt would cut short
    with Terminated(repeat=not workers) as terminated:
        db = Path(args.db or ".hypothesis/examples").absolute()
        try:
            if workers:
                from harness.progress import make_progress

                progress = make_progress(time.time(), None)
                try:
                    orphans = run_in_workers(rows, profile, device, db=str(db), examples=args.max_examples, out_dir=out_dir, shrink_seconds=shrink_seconds,
                                             seed=seed, workers=workers, case_timeout=args.case_timeout,
                                             stall_seconds=args.stall_seconds, mutant=args.mutant, on_row=lines,
                                             progress=progress, budget=budget, mps=args.mps)
                finally:
                    progress.close()
            else:
                from harness.sweep_worker import example_database

                run_in_process(groups, profile, device, database=example_database(str(db), None),
                               examples=args.max_examples, out_dir=out_dir, shrink_seconds=shrink_seconds, seed=seed,
                               stall_seconds=args.stall_seconds, mutant=mutant, on_row=lines)
        except BaseException as e:
            terminated.wrap_up()
            if not terminated.is_stop(e):
                raise
        terminated.wrap_up()
        interrupted = terminated.stopped is not None  # also a stop that surfaced too late to cut the run short
        elapsed = time.perf_counter() - start
        results = lines.results
        not_reached = [RowOutcome(r.id, str(r.composition), r.mode.value, r.property.name, rounds=0)
                       for r in rows if r.id not in lines.ended]
        if interrupted:
            print(f"\ninterrupted after {len(results)} of {len(rows)} rows: writing the report of the rows that "
                  f"ended", file=sys.stderr)
        print_summary(results + not_reached, skipped, elapsed)
        if budget is not None:
            first_only = sum(1 for r in results if r.ok and r.rounds == 1)
            print(f"budget {duration(budget)}: {len(results) - first_only} row(s) searched in full or with a finding, "
                  f"{first_only} with their first examples only, {len(not_reached)} not reached")
        for f in orphans:
            print(f"ERROR {f['composition']}: {f['reason']}")
        settings = {"elapsed_s": round(elapsed, 1), "workers": workers, "seed": seed, "examples": examples,
                    "interrupted": interrupted, "budget_s": budget}
        write_reports(results + not_reached, skipped, out_dir, device, profile.name,
                      findings=orphans or None, extra={"run": settings})
    if interrupted:
        return 130
    return exit_status([r.finding_kind or "failure" for r in results if not r.ok] + [f["kind"] for f in orphans])
