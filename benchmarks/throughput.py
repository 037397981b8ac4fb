"""Throughput of the harness itself: cases per second per composition and property, and where the time goes.

    python benchmarks/throughput.py [--profile ci] [--device auto] [--backends ...] [--properties ...]
                                    [--modes extend decode] [--cases 20] [--max-requests 16] [--workers N]
                                    [--shared] [--mps] [--json PATH]

For each matrix row, ``--cases`` batch specifications are drawn up front from the row's own strategy (a
seeded Hypothesis run that only generates: no database, no shrinking), then each runs through the row's
property while a clock splits the time into

- generation: drawing the specifications (Hypothesis);
- materialization: building tensors, pools and the forward batch (``engine.materialize.materialize``);
- reference: the float64 reference (``reference.batch.reference_outputs``);
- backend: building the backends, planning, and every layer's forward, model-side q/k/v and RoPE included
  (``Composition.build``, ``engine.model``, ``engine.execute``, the graph runner);
- checking: everything else the property does (comparisons, invariants, bookkeeping).

A failing case is counted as known when the ledger explains it (``docs/findings/known-failures.toml``: a bug already
triaged), apart from new failures; after a row's first case of a steerable entry, its later batches with what that
bug needs are not run, as in a search (``search.search_row.steered_off``), and counted in the last column; each
row's figures are printed as soon as the row is done, so a run killed before the end still says what it measured.

``--shared`` times what sweeps run: one batch, every composition (``search.group``). The rows are grouped as a
sweep groups them; each group's batches are drawn from its merged strategy, and each batch is checked by every row
of the group that could have drawn it, its reference computed once, until every row has ``--cases`` cases (a row
the merged draws rarely fit gets fewer: at most ``DRAWS_PER_EXAMPLE`` draws a case are made). A line per group;
generation is the time Hypothesis spent outside the checks.

The ``limit`` column is the cases per second of an engine-only loop over the same batches: each batch built
beforehand, then only the composition built, planned and run (``engine.execute.execute``), nothing drawn, referenced
or checked: what the harness cannot go below. With several workers their loops start together (each after all have
timed the unit), run side by side, as their checks did, and all end before any goes on to the next unit: the slowest
worker's engine time (its ``execute`` calls; building the batches is not timed) is the unit's.

The ``first`` column is how long a unit's first case took (warm-up included): its kernels' compiles, on a cold machine
(run ``harness warmup`` first to build them all in parallel). The units share their process, so a compile or the CUDA
setup that several need is charged to the first of them that runs. The summary says the slowest. On a GPU the summary
also gives the GPU's busy fraction: NVML's utilization (the share of each sample period in which a kernel ran), read
every 0.2 s and averaged over the samples taken while some unit's timed part ran (not the workers' start, the warm-up
or the engine-only loop).

Time is exclusive (a backend call inside materialization counts once, as backend) and, on a GPU, every
boundary synchronizes the device so kernels are charged to the phase that launched them. Each row first
runs ``--warmup`` cases of other specifications (Triton and FlashInfer compile on first use), not counted.

``--workers N`` runs N processes on the one device, as the sweep does (a worker is mostly CPU-bound Python,
so several keep a GPU busy); each times every row with its own seed, all starting a row together, and a
row's cases/s is all their cases over the wall time from the first start to the last finish. Without MPS the
workers take turns on the GPU; ``--mps`` makes them clients of an MPS daemon, whose kernels run side by side
(harness/mps.py has the figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import queue
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("generation", "materialization", "reference", "backend", "checking")
TIMED = {  # phase -> (module, attribute path) of the functions charged to it
    "materialization": [("engine.materialize", "materialize")],
    "reference": [("reference.batch", "reference_outputs")],
    "backend": [("engine.execute", "execute"), ("engine.model", "run_layers"), ("engine.model", "run_layer"),
                ("engine.model", "prepare_batch"), ("engine.graph_runner", "eager_run"),
                ("engine.graph_runner", "GraphRunner.capture"), ("engine.graph_runner", "GraphRunner.replay"),
                ("backends.registry", "Composition.build")],
}
PACKAGES = ("harness.", "properties.", "reference.", "backends.")


class PhaseClock:
    """Exclusive wall time per phase: entering a nested phase pauses the enclosing one."""

    def __init__(self, synchronize) -> None:
        self.synchronize = synchronize
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [phase, started]

    def now(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def enter(self, phase: str) -> None:
        now = self.now()
        if self.stack:
            self.totals[self.stack[-1][0]] += now - self.stack[-1][1]
        self.stack.append([phase, now])

    def leave(self) -> None:
        now = self.now()
        phase, started = self.stack.pop()
        self.totals[phase] += now - started
        if self.stack:
            self.stack[-1][1] = now

    def timed(self, phase: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return wrapper


@contextmanager
def instrumented(clock: PhaseClock):
    """Wrap the timed functions wherever the project's modules hold them (they import them by name)."""
    import importlib

    patches = []
    for phase, targets in TIMED.items():
        for module_name, path in targets:
            owner = importlib.import_module(module_name)
            *classes, name = path.split(".")
            for cls in classes:
                owner = getattr(owner, cls)
            original = getattr(owner, name)
            wrapped = clock.timed(phase, original)
            holders = [owner] if classes else [m for n, m in list(sys.modules.items())
                                               if n.startswith(PACKAGES) and m is not None]
            for holder in holders:
                for attr, value in list(vars(holder).items()):
                    if value is original:
                        patches.append((holder, attr, value))
                        setattr(holder, attr, wrapped)
    try:
        yield
    finally:
        for holder, attr, value in reversed(patches):
            setattr(holder, attr, value)


def draw_specs(row, profile, n: int, seed: int) -> list:
    """``n`` specifications from the row's strategy, by a generate-only, seeded Hypothesis run."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    from search.search_row import row_strategy

    specs = []

    @with_seed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(row_strategy(row, profile))
    def collect(spec) -> None:
        specs.append(spec)

    collect()
    return specs[:n]


@dataclasses.dataclass
class RowTiming:
    row: str
    composition: str
    mode: str
    property: str
    cases: int
    failures: int  # new ones: failures the ledger does not know
    seconds: dict[str, float]
    started: float = 0.0  # time.perf_counter() around the timed part (one clock for all processes)
    finished: float = 0.0
    workers: int = 1
    known: int = 0  # failures the ledger explains (docs/findings/known-failures.toml): a bug already triaged
    steered: int = 0  # batches not run: a known bug the row met needs what they have
    engine_seconds: float = 0.0  # the engine-only loop over the same batches (engine_only; workers': the slowest)
    first_case_s: float = 0.0  # how long the unit's first case (warm-up included) took: its compiles

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def wall(self) -> float:
        return self.finished - self.started

    @property
    def cases_per_second(self) -> float:
        """Cases over the timed part's wall time: with several workers, all of them together."""
        return self.cases / self.wall if self.wall > 0 else 0.0

    @property
    def limit(self) -> float:
        """Cases per second of the engine-only loop over the same batches."""
        return self.cases / self.engine_seconds if self.engine_seconds > 0 else 0.0


def engine_only(ran: list, device: str, sync) -> float:
    """Seconds the engine alone takes over ``ran`` ((composition, spec) pairs): each batch built beforehand (not
    timed), then the composition built, planned and run. A batch the engine fails on counts the time it took."""
    from engine.execute import execute
    from engine.materialize import materialize

    total = 0.0
    for composition, spec in ran:
        case = materialize(spec, device)
        sync()
        started = time.perf_counter()
        try:
            execute(composition, case)
        except Exception:  # noqa: BLE001 - a known bug's crash: the property reported it; its time still counts
            pass
        sync()
        total += time.perf_counter() - started
    return total


def engine_only_together(ran: list, device: str, sync, barrier=None) -> float:
    """:func:`engine_only` over a unit's batches; with a ``barrier``, between two waits: every worker's loop starts
    once all have timed the unit, runs beside the others', and all end before any goes on to the next unit."""
    if barrier is not None:
        barrier.wait()
    seconds = engine_only(ran, device, sync)
    if barrier is not None:
        barrier.wait()
    return seconds


def bench_row(row, profile, device: str, n: int, seed: int, warmup: int, barrier=None) -> RowTiming:
    """Warm up on specifications of their own, then time drawing and running ``n`` cases. With a
    ``barrier``, every worker starts its timed part together (so their wall times overlap), then its engine-only
    loop, and leaves the unit with the others (a worker's next unit does not run beside another's loop)."""
    import torch

    from search.group import DRAWS_PER_EXAMPLE

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    first_case_s = None
    for spec in draw_specs(row, profile, warmup, seed + 1_000_003) if warmup else []:
        case_began = time.perf_counter()
        row.property.run(row.composition, spec, device)
        first_case_s = first_case_s or time.perf_counter() - case_began
    if barrier is not None:
        barrier.wait()
    sync()
    drawing = time.perf_counter()
    specs = draw_specs(row, profile, DRAWS_PER_EXAMPLE * n, seed)  # more than n: steered batches are not run
    drawn = time.perf_counter() - drawing
    started = time.perf_counter()
    clock = PhaseClock(sync)
    failures = known = cases = 0
    steer = Steering()
    ran: list = []
    with instrumented(clock):
        for spec in specs:
            if cases == n:
                break
            if steer.off(row, spec):
                continue
            clock.enter("checking")  # whatever the property does outside the timed calls
            case_began = time.perf_counter()
            try:
                verdict = row.property.run(row.composition, spec, device)
            finally:
                clock.leave()
            cases += 1
            first_case_s = first_case_s or time.perf_counter() - case_began
            ran.append((row.composition, spec))
            if not verdict.ok:  # counted apart from the timed part: the ledger is the report's, not the search's
                if steer.known(row, spec, verdict, device):
                    known += 1
                else:
                    failures += 1
    finished = time.perf_counter()
    # Generation: the share of the drawing the batches looked at took (drawn up front, more than were needed)
    generation = drawn * (cases + steer.steered) / max(1, len(specs))
    seconds = {p: clock.totals.get(p, 0.0) for p in PHASES} | {"generation": generation}
    engine = engine_only_together(ran, device, sync, barrier)
    return RowTiming(row.id, str(row.composition), row.mode.value, row.property.name, cases, failures,
                     seconds, started - generation, finished, known=known, steered=steer.steered,
                     engine_seconds=engine, first_case_s=first_case_s or 0.0)


class Steering:
    """Known bugs stop costing cases, as in a search: after a row's first case of a steerable ledger entry, its
    batches with what that bug needs are not run (``search.search_row.steered_off``)."""

    def __init__(self) -> None:
        self.met: dict[str, list] = defaultdict(list)  # row id -> steerable entries it met
        self.steered = 0

    def off(self, row, spec) -> bool:
        from search.outcome import RowOutcome
        from search.search_row import steered_off

        if steered_off(spec, self.met[row.id], [], RowOutcome(row.id, "", "", "")):
            self.steered += 1
            return True
        return False

    def known(self, row, spec, verdict, device: str) -> bool:
        """Whether the ledger explains ``verdict`` (a failure); a steerable entry is steered from from now on."""
        from search import ledger

        entry = ledger.match(str(row.composition), row.mode.value, row.property.name, spec, verdict, device)
        if entry is not None and entry.steerable and entry not in self.met[row.id]:
            self.met[row.id].append(entry)
        return entry is not None


def bench_group(group, profile, device: str, n: int, seed: int, warmup: int, barrier=None) -> RowTiming:
    """As ``bench_row``, for a group of rows sharing their batches: each batch drawn from the group's strategy is
    checked by every row that could have drawn it (its reference computed once), until each row has ``n`` cases or
    DRAWS_PER_EXAMPLE * ``n`` batches are drawn. Generation is the time outside the checks."""
    import torch
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    from engine.sharing import sharing
    from search.group import DRAWS_PER_EXAMPLE, GroupDone

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    counts = {r.id: 0 for r in group.rows}
    totals = {"failures": 0, "known": 0}
    ran: list = []
    clock = PhaseClock(sync)
    steer = Steering()
    first_case_s = None  # how long the first case took, once there is one

    def check(spec, limit: int, timed: bool) -> None:
        nonlocal first_case_s
        for row in group.rows:
            if counts[row.id] >= limit or group.admits(row, spec) is not None:
                continue
            view = group.view(row, spec)
            if timed and steer.off(row, view):
                continue
            clock.enter("checking")
            case_began = time.perf_counter()
            try:
                verdict = row.property.run(row.composition, view, device)
            finally:
                clock.leave()
            counts[row.id] += 1
            first_case_s = first_case_s or time.perf_counter() - case_began
            if timed:
                ran.append((row.composition, view))
            if timed and not verdict.ok:
                if steer.known(row, view, verdict, device):
                    totals["known"] += 1
                else:
                    totals["failures"] += 1
        if all(c >= limit for c in counts.values()):
            raise GroupDone

    def run(limit: int, draw_seed: int, timed: bool) -> None:
        @with_seed(draw_seed)
        @settings(max_examples=DRAWS_PER_EXAMPLE * limit, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(group.strategy())
        def collect(spec) -> None:
            check(spec, limit, timed)

        try:
            collect()
        except GroupDone:
            pass

    with sharing():
        if warmup:
            run(warmup, seed + 1_000_003, timed=False)
            counts.update({k: 0 for k in counts})
            clock.totals.clear()
        if barrier is not None:
            barrier.wait()
        sync()
        started = time.perf_counter()
        with instrumented(clock):
            run(n, seed, timed=True)
        finished = time.perf_counter()
    seconds = {p: clock.totals.get(p, 0.0) for p in PHASES}
    seconds["generation"] = max(0.0, finished - started - sum(seconds.values()))
    engine = engine_only_together(ran, device, sync, barrier)
    return RowTiming(group.id, group.label, group.mode.value, f"{len(group.rows)} rows", sum(counts.values()),
                     totals["failures"], seconds, started, finished, known=totals["known"], steered=steer.steered,
                     engine_seconds=engine, first_case_s=first_case_s or 0.0)


def combine(parts: list[RowTiming]) -> RowTiming:
    """One row timed by several workers at once: cases and phase seconds add up, wall time spans them all; their
    engine-only loops ran side by side, so the slowest one's time is theirs (a sum would count the device as
    running one worker at a time: it made 4 workers' checked rate 1.67 times their "limit" on an H200)."""
    first = parts[0]
    return dataclasses.replace(
        first, cases=sum(p.cases for p in parts), failures=sum(p.failures for p in parts),
        known=sum(p.known for p in parts), steered=sum(p.steered for p in parts),
        engine_seconds=max(p.engine_seconds for p in parts), first_case_s=max(p.first_case_s for p in parts),
        seconds={ph: sum(p.seconds[ph] for p in parts) for ph in PHASES},
        started=min(p.started for p in parts), finished=max(p.finished for p in parts), workers=len(parts))


def select_rows(args, device: str):
    """The profile (batches up to ``--max-requests``) and the units timed: the selected matrix rows, or with
    ``--shared`` their groups."""
    from harness.options import profile_named
    from search.group import group_rows
    from search.matrix import matrix_rows

    profile = dataclasses.replace(profile_named(args.profile), max_requests=args.max_requests)
    rows, _ = matrix_rows(device, profile, args.backends, args.properties, args.modes)
    return profile, group_rows(rows, profile, device) if args.shared else rows


def bench(unit, profile, device: str, n: int, seed: int, warmup: int, barrier=None) -> RowTiming:
    from search.group import Group

    timed = bench_group if isinstance(unit, Group) else bench_row
    return timed(unit, profile, device, n, seed, warmup, barrier)


def worker(index: int, args, device: str, barrier, results) -> None:
    """One of ``--workers`` processes on the device: the same rows in the same order, its own seeds."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.workers))
    profile, rows = select_rows(args, device)
    try:
        for n, row in enumerate(rows):
            timing = bench(row, profile, device, args.cases, args.seed + 7919 * index, args.warmup, barrier)
            results.put((n, timing))
    except threading.BrokenBarrierError:
        return  # another worker failed; the parent says so


def run_workers(args, device: str, rows) -> list[RowTiming] | None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    barrier, results = ctx.Barrier(args.workers), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(i, args, device, barrier, results), daemon=True)
             for i in range(args.workers)]
    for proc in procs:
        proc.start()
    parts: dict[int, list[RowTiming]] = defaultdict(list)
    done = 0
    while done < len(rows) * len(procs):
        try:
            n, timing = results.get(timeout=5)
        except queue.Empty:
            dead = [proc for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                barrier.abort()
                print(f"error: a benchmark worker exited with status {dead[0].exitcode}", file=sys.stderr)
                for proc in procs:  # now: an MPS daemon told to quit waits for its clients
                    proc.terminate()
                return None
            continue
        parts[n].append(timing)
        done += 1
        if len(parts[n]) == len(procs):  # the row's figures now: a run killed later still tells what it measured
            print(f"[{n + 1}/{len(rows)}] {table_row(combine(parts[n]), len(combine(parts[n]).composition))}",
                  file=sys.stderr, flush=True)
    for proc in procs:
        proc.join()
    return [combine(parts[n]) for n in range(len(rows))]


def table_row(r: RowTiming, w: int) -> str:
    """One row's figures: cases/s over wall time (all workers together), each phase's share of the summed per-phase
    time, new failures and known ones (the ledger's)."""
    shares = "".join(f"{100 * r.seconds[p] / r.total if r.total else 0:>7.1f}" for p in PHASES)
    return (f"{r.composition:<{w}} {r.mode:<7} {r.property:<20} {r.cases:>5} {r.cases_per_second:>8.2f} {r.limit:>8.2f}"
            f"{shares} {r.failures:>5} {r.known:>5} {r.steered:>5} {r.first_case_s:>6.1f}")


def print_table(results: list[RowTiming], busy: float | None, busy_how: str) -> None:
    w = max([len(r.composition) for r in results] + [11])
    heads = "".join(f"{p[:5] + '%':>7}" for p in PHASES)
    print(f"{'composition':<{w}} {'mode':<7} {'property':<20} {'cases':>5} {'cases/s':>8} {'limit':>8}{heads} "
          f"{'fails':>5} {'known':>5} {'steer':>5} {'first':>6}")
    for r in results:
        print(table_row(r, w))
    total = {p: sum(r.seconds[p] for r in results) for p in PHASES}
    all_s, cases, wall = sum(total.values()), sum(r.cases for r in results), sum(r.wall for r in results)
    engine = sum(r.engine_seconds for r in results)
    shares = "".join(f"{100 * total[p] / all_s if all_s else 0:>7.1f}" for p in PHASES)
    rate, limit = cases / wall if wall else 0.0, cases / engine if engine else 0.0
    print(f"{'all':<{w}} {'':<7} {'':<20} {cases:>5} {rate:>8.2f} {limit:>8.2f}{shares}")
    if limit:
        print(f"checked cases/s are {rate / limit:.2f} of the engine-only loop's over the same batches")
    slowest = max(results, key=lambda r: r.first_case_s)
    print(f"first case: every unit's took {slowest.first_case_s:.1f}s or less ({slowest.composition} "
          f"{slowest.mode} {slowest.property} the slowest; its compiles included)")
    print(f"GPU busy: {f'{100 * busy:.0f}% of the wall time' if busy is not None else 'not measured'} ({busy_how})")


class BusySampler:
    """The GPU's busy fraction over the benchmark: NVML's utilization (the share of its last sample period in which a
    kernel ran on the GPU), read every ``period`` seconds on a thread, averaged. ``read`` returns a percentage."""

    def __init__(self, read, period: float = 0.2) -> None:
        self.read, self.period = read, period
        self.samples: list[tuple[float, float]] = []  # (time.perf_counter(), percent)
        self.error: str | None = None
        self.tried = threading.Event()  # set after the first read, whatever it gave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.samples.append((time.perf_counter(), float(self.read())))
            except Exception as e:  # noqa: BLE001 - no NVML here: the figure is missing, the benchmark goes on
                self.error = f"{type(e).__name__}: {e}"
                return
            finally:
                self.tried.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, spans: list[tuple[float, float]]) -> float | None:
        """The mean utilization, as a fraction, over the samples taken within ``spans`` ((start, end) perf_counter
        times: the units' timed parts); None without one."""
        inside = [pct for t, pct in self.samples if any(a <= t <= b for a, b in spans)]
        return sum(inside) / len(inside) / 100 if inside else None


def smi_device(index: int, visible: str) -> str:
    """What ``nvidia-smi -i`` calls the visible CUDA device ``index``: nvidia-smi numbers the GPUs without
    ``CUDA_VISIBLE_DEVICES``, so the device's own entry there (an index or a UUID), else the index itself."""
    listed = [x.strip() for x in visible.split(",") if x.strip()]
    return listed[index] if index < len(listed) else str(index)


def busy_reader(device: str):
    """A function returning the GPU's utilization in percent (NVML through torch, else ``nvidia-smi``), and how it is
    read; (None, why) on a CPU."""
    if device != "cuda":
        return None, f"no GPU: {device}"
    import subprocess

    import torch

    index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    try:
        torch.cuda.utilization(index)
        return (lambda: torch.cuda.utilization(index)), "NVML utilization over the timed parts"
    except Exception:  # noqa: BLE001 - torch reads NVML through pynvml, which may be missing
        which = smi_device(index, os.environ.get("CUDA_VISIBLE_DEVICES", ""))

        def smi() -> float:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                  "-i", which], capture_output=True, text=True, timeout=10, check=True)
            return float(out.stdout.strip().splitlines()[0])

        return smi, "nvidia-smi utilization over the timed parts"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="ci", help="ci (default), dev, nightly or gpu")
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--backends", nargs="*", help="leaf backend names or composition terms (default: all available)")
    p.add_argument("--properties", nargs="*", help="property names (default: all)")
    p.add_argument("--modes", nargs="*", default=["extend", "decode"], help="forward modes (default: extend decode)")
    p.add_argument("--cases", type=int, default=20, help="timed cases per row (default 20)")
    p.add_argument("--warmup", type=int, default=1, help="untimed cases per row first (default 1)")
    p.add_argument("--max-requests", type=int, default=16, help="largest batch drawn (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn specifications")
    p.add_argument("--workers", type=int, default=1,
                   help="processes timing each row at once on the one device (cases/s is theirs together)")
    p.add_argument("--shared", action="store_true",
                   help="one batch, every composition: time the rows' groups as sweeps search them")
    p.add_argument("--mps", action="store_true",
                   help="with --workers N on a GPU: the workers are clients of a CUDA MPS daemon, their kernels "
                        "side by side (harness/mps.py)")
    p.add_argument("--json", help="also write the timings here")
    args = p.parse_args(argv)

    from harness.options import UsageError, resolve_device

    try:
        device = resolve_device(args.device)  # before anything imports triton
        from properties import PROPERTIES

        unknown = [x for x in args.properties or [] if x not in PROPERTIES]
        if unknown:
            raise UsageError(f"unknown properties {', '.join(unknown)}; properties: {', '.join(PROPERTIES)}")
        if args.cases < 1 or args.workers < 1:
            raise UsageError(f"--cases and --workers must be positive, got {args.cases} and {args.workers}")
        profile, rows = select_rows(args, device)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("error: no matrix row matches the selection (see `python -m harness list`)", file=sys.stderr)
        return 2
    print(f"device {device}, profile {profile.name}, batches up to {profile.max_requests} requests, "
          f"{args.cases} cases per row after {args.warmup} warm-up, {args.workers} worker(s)"
          + (f", {len(rows)} group(s) sharing their batches" if args.shared else ""), file=sys.stderr)
    read, busy_how = busy_reader(device)
    sampler = BusySampler(read) if read is not None else None
    try:
        if args.mps and (device != "cuda" or args.workers < 2):
            print("MPS: asked for, but it serves several workers on a GPU: not used", file=sys.stderr)
        if args.workers > 1:
            from harness.mps import mps_daemon

            with mps_daemon(args.mps and device == "cuda", lambda line: print(line, file=sys.stderr, flush=True)):
                results = run_workers(args, device, rows)
            if results is None:
                return 1
        else:
            results = []
            for n, row in enumerate(rows, 1):
                results.append(bench(row, profile, device, args.cases, args.seed, args.warmup))
                print(f"[{n}/{len(rows)}] {table_row(results[-1], len(results[-1].composition))}", file=sys.stderr,
                      flush=True)
    finally:
        if sampler is not None:
            sampler.stop()
    busy = sampler.busy([(r.started, r.finished) for r in results]) if sampler is not None else None
    if sampler is not None and sampler.error:
        busy_how += f"; could not read it: {sampler.error}"
    print_table(results, busy, busy_how)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) | {"cases_per_second": r.cases_per_second,
                                                                          "limit": r.limit}
                                               for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
