"""Running the mutant catalogue: is each injected bug caught, how fast, and how small is its reproducer?"""

from __future__ import annotations

import json
import multiprocessing
import queue as queue_module
import signal
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.registry import parse
from harness.mutants.catalogue import Mutant, MutantUnavailable
from harness.procs import COMPILE_TIMEOUT_S, compiler_running, default_case_timeout
from search.casefile import modified, pending_cases
from search.matrix import matrix_rows
from search.profiles import Profile
from search.search_row import search_row


@dataclass
class MutantResult:
    mutant: str
    status: str  # killed, survived, unavailable, broken (the kill was a crash of the mutant's own patch)
    seconds: float = 0.0  # to the first failing case (killed), or spent (survived)
    requests: int | None = None
    tokens: int | None = None
    property: str | None = None
    row: str | None = None
    reason: str = ""
    case_file: str | None = None
    shrink_seconds: float | None = None  # after the first failure: shrinking it to the reported case


def run_mutant(mutant: Mutant, profile: Profile, device: str, out_dir: Path, budget_s: float,
               case_timeout_s: float | None = None, shrink_seconds: float | None = None) -> MutantResult:
    """Search the mutant's rows until one fails; a mutant that ``crashes`` the process runs in a child.

    ``shrink_seconds`` bounds shrinking the killing case (0: the kill is the first failing example, as the
    CI test wants it; None: shrink fully, for the table's case sizes)."""
    if mutant.crashes and not (mutant.needs_device and mutant.needs_device != device):
        return run_mutant_isolated(mutant, profile, device, out_dir, budget_s, case_timeout_s)
    return _search_mutant(mutant, profile, device, out_dir, budget_s, shrink_seconds)


CATALOGUE_FILE = "harness/mutants/catalogue.py"


def own_crash(mutant: Mutant, failure) -> str | None:
    """Why ``failure`` is a crash of the mutant's own patch rather than its fault at work (None: it is not).

    A mutant kills by its mechanism: wrong K/V slots fail the cache or outputs check, a wrong scale the outputs, a
    wrapper that passes a child an extra keyword the child's TypeError (raised at the call the patch makes: the
    mechanism). A patch that no longer fits the code it replaces proves nothing: its replacement called with what
    it does not take (a ``TypeError`` naming ``MUTANT.<locals>.FUNCTION``), or its own code failing to find a name
    or attribute (``NameError``, ``AttributeError``, ``ImportError`` raised in the catalogue itself). Measured before
    this check: ``kv_written_one_slot_off`` "killed" its rows by ``set_kv_buffer() takes 5 positional arguments but
    7 were given``."""
    reason = getattr(failure, "reason", str(failure or ""))
    if "crashed:" not in reason:
        return None
    frames = list(getattr(failure, "details", {}).get("traceback", ()) or ())
    if f"{mutant.name}.<locals>." in reason:
        return f"the mutant's own replacement was called with what it does not take: {reason}"
    misfit = ("crashed: NameError", "crashed: AttributeError", "crashed: ImportError", "crashed: ModuleNotFoundError")
    if frames and CATALOGUE_FILE.split("/", 1)[1] in frames[-1] and reason.startswith(misfit):
        return f"the mutant's own patch does not fit the code it replaces ({frames[-1]}): {reason}"
    return None


def _search_mutant(mutant: Mutant, profile: Profile, device: str, out_dir: Path, budget_s: float,
                   shrink_seconds: float | None = None) -> MutantResult:
    if mutant.needs_device and mutant.needs_device != device:
        return MutantResult(mutant.name, "unavailable",
                            reason=f"the fault exists only on {mutant.needs_device} (this run uses {device})")
    compositions = [parse(t) for t in mutant.targets]
    runnable = [c for c in compositions if c.unavailable_reason(device) is None]
    if not runnable:
        reasons = "; ".join(f"{c}: {c.unavailable_reason(device)}" for c in compositions)
        return MutantResult(mutant.name, "unavailable", reason=reasons)
    try:
        patch = mutant.patch()
    except MutantUnavailable as e:
        return MutantResult(mutant.name, "unavailable", reason=str(e))
    start = time.perf_counter()
    with patch:
        rows = [r for comp in runnable
                for r in matrix_rows(device, profile, [str(comp)],
                                     list(mutant.properties) if mutant.properties else None,
                                     list(mutant.modes) if mutant.modes else None)[0]
                if r.composition == comp]
        # Breadth first: a few examples on every row, then the profile's count, then four times that.
        # Seeds are fixed per mutant and round, so a verdict is reproducible run to run.
        rounds = (min(3, profile.max_examples), profile.max_examples, 4 * profile.max_examples)
        for n, max_examples in enumerate(rounds):
            for row in rows:
                seed = zlib.crc32(f"{mutant.name}/{row.id}/{n}".encode())
                row_start = time.perf_counter()
                result = search_row(row, profile, device, database=None, max_examples=max_examples,
                                    out_dir=out_dir / mutant.name, seed=seed, shrink_seconds=shrink_seconds)
                if not result.ok:
                    spec, now = result.spec, time.perf_counter()
                    first = row_start - start + (result.first_failure_seconds or now - row_start)
                    broken = own_crash(mutant, result.failure)
                    if broken:
                        return MutantResult(mutant.name, "broken", first, property=row.property.name, row=row.id,
                                            reason=broken)
                    return MutantResult(mutant.name, "killed", first,
                                        None if spec is None else spec.batch_size,
                                        None if spec is None else spec.num_tokens, row.property.name, row.id,
                                        str(result.failure), None if result.case_file is None else str(result.case_file),
                                        shrink_seconds=now - start - first)
                if time.perf_counter() - start > budget_s:
                    return MutantResult(mutant.name, "survived", time.perf_counter() - start,
                                        reason=f"budget of {budget_s:.0f}s spent")
    return MutantResult(mutant.name, "survived", time.perf_counter() - start, reason=f"every row passed {len(rounds)} rounds")


def _child(mutant_name: str, profile: Profile, device: str, out_dir: Path, budget_s: float, queue) -> None:
    from harness.mutants.catalogue import MUTANTS
    queue.put(asdict(_search_mutant(MUTANTS[mutant_name], profile, device, out_dir, budget_s)))


def run_mutant_isolated(mutant: Mutant, profile: Profile, device: str, out_dir: Path,
                        budget_s: float, case_timeout_s: float | None = None) -> MutantResult:
    """``run_mutant`` in a fresh process. On a GPU a device-side assert poisons the CUDA context for good,
    so one mutant that trips it would make every later mutant look killed; a process per mutant keeps
    each verdict its own. A process that dies is a kill by crash, one whose pending case file has not
    changed for ``case_timeout_s`` (time while it runs a JIT compiler not counted, up to ``COMPILE_TIMEOUT_S``)
    a kill by hang; either way the pending case file is the reproducer."""
    # A mutant of an interpreted composition (SGLang's Triton on a CPU) gets those kernels' longer default
    case_timeout_s = case_timeout_s or default_case_timeout(
        device, any(parse(t).support().interpreted_on_cpu for t in mutant.targets))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = time.perf_counter()
    pending_dir = out_dir / mutant.name / "pending"
    for stale in pending_dir.glob("*.json"):  # a previous run's leftovers would read as this run's crash
        stale.unlink()
    proc = ctx.Process(target=_child, args=(mutant.name, profile, device, out_dir, budget_s, queue), daemon=True)
    proc.start()
    limit = 2 * budget_s + 120  # the search checks its budget between rows; a row may still be shrinking
    grace, grace_anchor, last_look = 0.0, None, time.time()  # compile time within the current case
    compiled = 0.0  # and within the whole run
    try:
        while time.perf_counter() - start < limit + compiled:
            try:
                return MutantResult(**queue.get(timeout=1.0))
            except queue_module.Empty:
                pass
            pending = pending_cases(pending_dir)
            if not proc.is_alive():
                return MutantResult(mutant.name, "killed", time.perf_counter() - start, property="crash",
                                    reason=f"the process died ({exit_description(proc.exitcode)})",
                                    case_file=str(pending[-1]) if pending else None)
            now = time.time()
            if compiler_running([proc.pid], machine_wide=True):
                grace += now - last_look
                compiled += now - last_look
            last_look = now
            active = modified(pending[-1]) if pending else None
            if active is None:
                continue
            if active != grace_anchor:
                grace, grace_anchor = 0.0, active
            if now - active - grace > case_timeout_s or now - active > COMPILE_TIMEOUT_S:
                proc.kill()
                return MutantResult(mutant.name, "killed", time.perf_counter() - start, property="hang",
                                    reason=f"one case ran for over {case_timeout_s:.0f}s", case_file=str(pending[-1]))
        proc.kill()
        return MutantResult(mutant.name, "survived", time.perf_counter() - start,
                            reason=f"no verdict within {limit:.0f}s")
    finally:
        proc.join(5)


def exit_description(code: int | None) -> str:
    """'killed by SIGSEGV' for a negative exit code (a signal), else 'exit code N'."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def print_table(results: list[MutantResult]) -> None:
    w = max(len(r.mutant) for r in results)
    print(f"{'mutant':<{w}}  {'status':<11} {'seconds':>8} {'shrink':>7} {'reqs':>5} {'tokens':>6}  property")
    for r in results:
        secs = f"{r.seconds:.1f}" if r.status != "unavailable" else "-"
        shrink = "-" if r.shrink_seconds is None else f"{r.shrink_seconds:.1f}"
        reqs = "-" if r.requests is None else str(r.requests)
        toks = "-" if r.tokens is None else str(r.tokens)
        extra = r.property or r.reason
        print(f"{r.mutant:<{w}}  {r.status:<11} {secs:>8} {shrink:>7} {reqs:>5} {toks:>6}  {extra}")
    killed = [r for r in results if r.status == "killed"]
    if killed:
        secs = sorted(r.seconds for r in killed)
        sizes = sorted(r.tokens for r in killed if r.tokens is not None)
        median = lambda xs: xs[len(xs) // 2] if xs else float("nan")  # noqa: E731
        print(f"\n{len(killed)} killed, {sum(r.status == 'survived' for r in results)} survived, "
              f"{sum(r.status == 'broken' for r in results)} broken, "
              f"{sum(r.status == 'unavailable' for r in results)} unavailable; median seconds to the first failure "
              f"{median(secs):.1f}, median shrunk size {median(sizes)} token(s)")


def write_json(results: list[MutantResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=1))
