"""``python -m harness warmup``: compile the kernels a profile's rows need, many at once, before any case is timed.

A cold GPU spends its first minutes in JIT compilers: FlashInfer builds each kernel variant with nvcc, Triton each
specialization with ptxas, flex_attention goes through Inductor. A run or a sweep meets them case by case, one build
at a time in each worker: on a cold H100 the main job (4 workers, 2181 rows) finished its first row after 134 s and
98 rows in 513 s, its workers compiling most of that time (2026-11-27).

Warmup builds them first, in parallel:

1. **The variants** (``--list`` prints them). For every leaf backend the selected rows run, in every forward mode,
   the features a batch selects compiled code by: per layer its kind and shape, whether it has a sliding window and
   a logit cap; the KV cache's dtype; a speculative draft window. They are read off draws of the row's own strategy
   (seeded: the same profile and selection list the same variants), taken by the leaf's simplest row (the leaf
   alone where it is a row, its ``outputs`` row first).
2. **One case for each variant**, in ``--workers`` processes at a time (:func:`warm_order`): the variants of leaves
   that need FlashInfer first (its nvcc builds take minutes each: all under way from the start), and within each
   kind the variants interleaved so that the cases running together build different kernels (a second builder of the same FlashInfer kernel waits on its lock, it
   does not build it again: interleaved by leaf and mode instead, 16 processes on a cold H100 finished 3 FlashInfer
   modules in 300 s, most of them waiting on the same builds). Each process's builds get its share of the cores
   (``MAX_JOBS``): sixteen processes each building a FlashInfer prefill module took 170-210 s apiece. The caches
   they fill (``~/.cache/flashinfer``, ``~/.triton``, Inductor's) are what the run after it reads.

The cases check nothing: their verdicts are counted, not reported (the run that follows searches these rows and
reports what fails). A process that dies takes its pool down: the cases running then go again one at a time, the
one that dies again is dropped (counted), and the rest go on. ``--budget`` bounds the whole warmup (from the command's
start), the builds it started included.
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from harness.options import (UsageError, add_selection, check_positive, duration, parse_budget, profile_named,
                             resolve_device)

DRAWS = 60  # batches drawn per leaf row to read its variants off
SLOW_S = 1.0  # a case this long built something: it gets its own line


def kernel_variants(spec) -> set[tuple]:
    """The features of ``spec`` that select compiled code, one per layer: (kind, shape, window, logit cap, KV cache
    dtype, draft window)."""
    draft_window = bool(spec.spec is not None and spec.spec.draft_window_size)
    return {(layer.kind, layer.shape, getattr(layer, "sliding_window", None) is not None,
             getattr(layer, "logit_cap", None) is not None, spec.kv_cache_dtype, draft_window)
            for layer in spec.layers}


def describe(variant: tuple) -> str:
    kind, shape, window, cap, kv_dtype, draft_window = variant
    words = [f"{kind} {'x'.join(map(str, shape))}", f"kv {kv_dtype}"]
    words += ["window"] * window + ["logit cap"] * cap + ["draft window"] * draft_window
    return ", ".join(words)


def leaf_rows(rows) -> dict[tuple[str, str], object]:
    """(leaf, mode) -> the row that warms it: an ``outputs`` row first (it runs the forward pass; a ``metadata`` or
    ``conformance`` row may build no kernel), then the simplest composition holding the leaf (fewest characters).
    Rows whose check reads classes only run no kernel, nor do idle batches (no tokens)."""
    chosen: dict[tuple[str, str], object] = {}
    for row in rows:
        if row.composition.support().class_only or row.mode.value == "idle":
            continue  # an idle batch has no tokens: its forward runs no attention kernel (its graph is decode's)
        for leaf in dict.fromkeys(row.composition.leaves()):
            key = (leaf, row.mode.value)
            rank = (row.property.name != "outputs", len(str(row.composition)), row.id)
            best = chosen.get(key)
            if best is None or rank < (best.property.name != "outputs", len(str(best.composition)), best.id):
                chosen[key] = row
    return chosen


# ---- in the worker processes -------------------------------------------------------------------------------------
def _init(device: str, threads: int) -> None:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    # Each process's builds get its share of the cores: FlashInfer's ninja runs MAX_JOBS compilers at once, and
    # sixteen processes at sixteen each would crowd 256 compilers onto 16 cores
    os.environ["MAX_JOBS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _row(device: str, profile_name: str, composition: str, row_id: str):
    from search.matrix import matrix_rows
    from search.profiles import profile

    return next(r for r in matrix_rows(device, profile(profile_name), [composition])[0] if r.id == row_id)


def plan_row(device: str, profile_name: str, composition: str, row_id: str, draws: int) -> list[tuple]:
    """(variant, batch) for each variant among ``draws`` seeded draws of the row's strategy, the first batch
    showing it."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    from search.profiles import profile
    from search.search_row import row_strategy

    row = _row(device, profile_name, composition, row_id)
    found: dict[tuple, object] = {}

    @with_seed(0)
    @settings(max_examples=draws, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(row_strategy(row, profile(profile_name)))
    def collect(spec) -> None:
        for variant in kernel_variants(spec):
            found.setdefault(variant, spec)

    collect()
    return list(found.items())


def warm_case(device: str, profile_name: str, composition: str, row_id: str, spec) -> tuple[float, bool]:
    """Run the row on ``spec`` once: (seconds, whether its check passed)."""
    row = _row(device, profile_name, composition, row_id)
    started = time.perf_counter()
    verdict = row.property.run(row.composition, spec, device)
    return time.perf_counter() - started, bool(verdict.ok)


# ---- the command ---------------------------------------------------------------------------------------------------
class Pool:
    """Processes running tasks, ``workers`` at a time. A process that dies (a crash in a case: the run will meet it
    and report it) takes down the pool's other processes too; the tasks running then are tried again one at a time in
    a process of their own, the one that dies again is dropped, and the rest go on in a fresh pool."""

    def __init__(self, device: str, workers: int) -> None:
        import multiprocessing

        self.device, self.workers, self.died = device, workers, 0
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self.context = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        self.executor = self._new(workers)
        self.killed = False

    def _new(self, workers: int) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers, mp_context=self.context, initializer=_init,
                                   initargs=(self.device, self.threads))

    def map(self, fn, tasks: list[tuple], deadline: float, on_done) -> bool:
        """``fn(*task)`` for every task, ``on_done(task, result or exception)`` as each ends (a task whose process
        died twice: a ``BrokenProcessPool``); False if the deadline came first (what was left is not run)."""
        left = list(tasks)
        while left:
            suspects = self._window(self.executor, self.workers, fn, left, deadline, on_done)
            if suspects is None:
                return False
            if not suspects:
                continue
            self.executor.shutdown(wait=False, cancel_futures=True)
            print(f"warmup: a worker process died (a crash in a case: the run will meet it); the {len(suspects)} "
                  f"case(s) running then go again one at a time", flush=True)
            for task in suspects:
                alone = self._new(1)
                try:
                    again = self._window(alone, 1, fn, [task], deadline, on_done)
                finally:
                    alone.shutdown(wait=False, cancel_futures=True)
                if again is None:
                    self.kill_executor(alone)
                    return False
                if again:  # it died again, alone: the culprit
                    self.died += 1
                    on_done(task, BrokenProcessPool(f"its process died running {fn.__name__}{task[2:4]}"))
            left = [t for t in left if t not in suspects]
            self.executor = self._new(self.workers)
        return True

    def _window(self, executor, width: int, fn, left: list[tuple], deadline: float, on_done) -> list[tuple] | None:
        """Run ``left`` (removing each task as it ends) with at most ``width`` submitted at once, so that a broken pool
        names only the tasks that were running. Returns the tasks running when a process died ([] if none did), or
        None at the deadline (the pool's processes and their builds killed)."""
        queue, running = list(left), {}
        while queue or running:
            while queue and len(running) < width:
                task = queue.pop(0)
                running[executor.submit(fn, *task)] = task
            done, _ = wait(running, timeout=max(0.0, deadline - time.time()), return_when=FIRST_COMPLETED)
            if not done:
                self.kill_executor(executor)
                return None
            broken = []
            for future in done:
                task = running.pop(future)
                try:
                    result = future.result()
                except BrokenProcessPool:
                    broken.append(task)
                    continue
                except Exception as e:  # noqa: BLE001 - the case's own error: the run reports it
                    result = e
                left.remove(task)
                on_done(task, result)
            if broken:
                return broken + list(running.values())
        return []

    def kill_executor(self, executor) -> None:
        """Stop every process of ``executor`` and the builds they started (a build left running would go on using
        the cores the run after the warmup needs)."""
        import signal

        from harness.procs import descendants

        self.killed = True
        for proc in list((getattr(executor, "_processes", None) or {}).values()):
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self.executor.shutdown(wait=not self.killed, cancel_futures=True)


def interleave(tasks: list[tuple], key) -> list[tuple]:
    """Round robin over ``key``'s values: the first task of each, then the second of each, ..."""
    by_key: dict = {}
    for task in tasks:
        by_key.setdefault(key(task), []).append(task)
    out, i = [], 0
    while len(out) < len(tasks):
        out += [group[i] for group in by_key.values() if i < len(group)]
        i += 1
    return out


# Packages whose kernels build slowly on a cold machine: their leaves' variants are warmed first
SLOW_BUILDERS = {
    # nvcc per module: 85 s with the machine's 16 cores to itself, 150-210 s among 16 builds at once (H100,
    # 2026-11-27, gpu51.sh and gpu53.sh); in gpu53.sh's interleaved order the first FlashInfer build started 2.5
    # minutes in and its prefill modules were never reached in 9 minutes
    "flashinfer": "FlashInfer's JIT (nvcc), minutes a module",
}


def slow_builder(leaf: str) -> bool:
    """Whether ``leaf`` needs a package whose kernels build slowly (:data:`SLOW_BUILDERS`)."""
    from backends.registry import leaf_capabilities

    return any(package in SLOW_BUILDERS for package in leaf_capabilities(leaf).requires)


def warm_order(tasks: list, leaf, variant) -> list:
    """The order to warm ``tasks`` in: the slow builders' leaves first (:func:`slow_builder`), so that their builds
    (minutes each) are all under way from the start and the quick ones fill the cores around them; within each,
    round robin over the variants, so that the cases running at once build different kernels (the leaves and modes
    of one variant mostly share theirs: FlashInfer's decode, draft decode and verify rows, SGLang's wrapper and ours,
    all wait on one build of one module when they run side by side)."""
    return [t for slow in (True, False) for t in interleave([t for t in tasks if slow_builder(leaf(t)) == slow],
                                                             key=variant)]


def default_workers(device: str) -> int:
    """A build is a CPU's work (nvcc, ptxas, a C++ compiler): one process per core, at most 16 (each holds a CUDA
    context on a GPU)."""
    return max(1, min(16, os.cpu_count() or 1))


def cmd_warmup(args) -> int:
    start = time.time()  # the budget counts from here: deriving the matrix takes tens of seconds with SGLang
    budget = parse_budget(args.budget)
    check_positive("--workers", args.workers)
    from search.matrix import matrix

    device = resolve_device(args.device)
    profile = profile_named(args.profile)
    selected = matrix(device, profile, args.backends, None, args.modes)
    if not selected.rows:
        raise UsageError(selected.why_empty())
    chosen = leaf_rows(selected.rows)
    workers = args.workers or default_workers(device)
    deadline = start + budget
    pool = Pool(device, workers)
    try:
        print(f"warmup: {len(chosen)} (leaf, mode) pair(s) of {len(selected.rows)} row(s) on {device}, profile "
              f"{profile.name}, {workers} process(es); reading their kernel variants off {DRAWS} draws each",
              flush=True)
        variants: dict[tuple[str, str], list[tuple]] = {}

        def planned(task, result) -> None:
            if isinstance(result, Exception):
                print(f"  {task[2]} ({task[3]}): its strategy drew nothing ({type(result).__name__}: {result})")
                return
            variants[task[4]] = result

        plans = [(device, profile.name, str(r.composition), r.id, key) for key, r in chosen.items()]
        if not pool.map(_plan, plans, deadline, planned):
            print(f"warmup: budget {duration(budget)} spent while reading the variants", flush=True)
            return 0
        listed = sum(len(v) for v in variants.values())
        print(f"warmup: {listed} kernel variant(s) listed in {time.time() - start:.0f}s", flush=True)
        if args.list:
            for (leaf, mode), found in sorted(variants.items()):
                row = chosen[(leaf, mode)]
                print(f"{leaf} {mode} (by {row.id}):")
                for variant, _ in sorted(found, key=lambda vs: describe(vs[0])):
                    print(f"    {describe(variant)}")
            return 0
        tasks = [(device, profile.name, str(chosen[key].composition), chosen[key].id, spec, key, variant)
                 for key, found in variants.items() for variant, spec in found]
        tasks = warm_order(tasks, leaf=lambda t: t[5][0], variant=lambda t: t[6])
        counts = {"done": 0, "slow": 0, "failed": 0, "errors": 0}

        def warmed(task, result) -> None:
            counts["done"] += 1
            (leaf, mode), variant = task[5], task[6]
            if isinstance(result, Exception):
                counts["errors"] += 1
                what = "its process died" if isinstance(result, BrokenProcessPool) else type(result).__name__
                print(f"[{counts['done']:>4}/{len(tasks)}] {leaf} {mode}: {describe(variant)}: {what} (the run "
                      f"reports it)", flush=True)
                return
            seconds, ok = result
            counts["failed"] += not ok
            if seconds >= SLOW_S:
                counts["slow"] += 1
                print(f"[{counts['done']:>4}/{len(tasks)}] {leaf} {mode}: {describe(variant)}: {seconds:.1f}s "
                      f"[{duration(time.time() - start)}]", flush=True)

        finished = pool.map(_warm, tasks, deadline, warmed)
        print(f"warmup: {counts['done']} of {len(tasks)} variant(s) run in {duration(time.time() - start)}, "
              f"{counts['slow']} of them {SLOW_S:.0f}s or longer (a build){'' if finished else ', budget spent'}; "
              f"{counts['failed']} check(s) failed and {counts['errors']} raised or died (not reported here: the "
              f"run searches these rows)", flush=True)
        return 0
    finally:
        pool.close()


def _plan(device, profile_name, composition, row_id, key):
    return plan_row(device, profile_name, composition, row_id, DRAWS)


def _warm(device, profile_name, composition, row_id, spec, key, variant):
    return warm_case(device, profile_name, composition, row_id, spec)


def add_parser(sub) -> None:
    sp = sub.add_parser("warmup", help="compile the kernels a profile's rows need, in parallel, before a run",
                        description=__doc__.splitlines()[0].split(": ", 1)[1])
    add_selection(sp)
    sp.add_argument("--modes", nargs="*", help="forward modes (default: all)")
    sp.add_argument("--workers", type=int, help="processes at a time (default: one per core, at most 16)")
    sp.add_argument("--budget", default="20m", help="stop after this long, e.g. 10m (default 20m)")
    sp.add_argument("--list", action="store_true", help="list the kernel variants and exit (compiles nothing)")
    sp.set_defaults(fn=cmd_warmup)

