"""Running the mutant catalogue: is each injected bug caught, how fast, and how small is its reproducer?"""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.registry import parse
from harness.matrix import matrix_rows
from harness.mutants import Mutant
from harness.profiles import Profile
from harness.search import search_row


@dataclass
class MutantResult:
    mutant: str
    status: str  # killed, survived, unavailable
    seconds: float = 0.0
    requests: int | None = None
    tokens: int | None = None
    property: str | None = None
    row: str | None = None
    reason: str = ""
    case_file: str | None = None


def run_mutant(mutant: Mutant, profile: Profile, device: str, out_dir: Path, budget_s: float) -> MutantResult:
    if mutant.needs_device and mutant.needs_device != device:
        return MutantResult(mutant.name, "unavailable",
                            reason=f"the fault exists only on {mutant.needs_device} (this run uses {device})")
    compositions = [parse(t) for t in mutant.targets]
    runnable = [c for c in compositions if c.unavailable_reason(device) is None]
    if not runnable:
        reasons = "; ".join(f"{c}: {c.unavailable_reason(device)}" for c in compositions)
        return MutantResult(mutant.name, "unavailable", reason=reasons)
    start = time.perf_counter()
    with mutant.patch():
        for comp in runnable:
            rows, _ = matrix_rows(device, profile, [str(comp)], list(mutant.properties) if mutant.properties else None)
            for row in (r for r in rows if r.composition == comp):
                result = search_row(row, profile, device, database=None, out_dir=out_dir / mutant.name)
                if not result.ok:
                    spec = result.spec
                    return MutantResult(mutant.name, "killed", time.perf_counter() - start,
                                        None if spec is None else spec.batch_size,
                                        None if spec is None else spec.num_tokens, row.property.name, row.id,
                                        str(result.failure), None if result.case_file is None else str(result.case_file))
                if time.perf_counter() - start > budget_s:
                    return MutantResult(mutant.name, "survived", time.perf_counter() - start,
                                        reason=f"budget of {budget_s:.0f}s spent")
    return MutantResult(mutant.name, "survived", time.perf_counter() - start, reason="every row passed")


def _child(mutant_name: str, profile: Profile, device: str, out_dir: Path, budget_s: float, queue) -> None:
    from harness.mutants import MUTANTS
    queue.put(asdict(run_mutant(MUTANTS[mutant_name], profile, device, out_dir, budget_s)))


def run_mutant_isolated(mutant: Mutant, profile: Profile, device: str, out_dir: Path,
                        budget_s: float) -> MutantResult:
    """``run_mutant`` in a fresh process. On a GPU a device-side assert poisons the CUDA context for good,
    so one mutant that trips it would make every later mutant look killed; a process per mutant keeps
    each verdict its own. A process that dies is a kill by crash, its pending case file the reproducer."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = time.perf_counter()
    proc = ctx.Process(target=_child, args=(mutant.name, profile, device, out_dir, budget_s, queue), daemon=True)
    proc.start()
    limit = 2 * budget_s + 120  # the search checks its budget between rows; a row may still be shrinking
    try:
        return MutantResult(**queue.get(timeout=limit))
    except Exception:  # queue.Empty: the child died or hung
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            return MutantResult(mutant.name, "survived", time.perf_counter() - start,
                                reason=f"no verdict within {limit:.0f}s")
        pending = sorted((out_dir / mutant.name).glob("pending/*.json"))
        return MutantResult(mutant.name, "killed", time.perf_counter() - start, property="crash",
                            reason=f"the process died (exit code {proc.exitcode})",
                            case_file=str(pending[-1]) if pending else None)
    finally:
        proc.join(5)


def print_table(results: list[MutantResult]) -> None:
    w = max(len(r.mutant) for r in results)
    print(f"{'mutant':<{w}}  {'status':<11} {'seconds':>8} {'reqs':>5} {'tokens':>6}  property")
    for r in results:
        secs = f"{r.seconds:.1f}" if r.status != "unavailable" else "-"
        reqs = "-" if r.requests is None else str(r.requests)
        toks = "-" if r.tokens is None else str(r.tokens)
        extra = r.property or r.reason
        print(f"{r.mutant:<{w}}  {r.status:<11} {secs:>8} {reqs:>5} {toks:>6}  {extra}")
    killed = [r for r in results if r.status == "killed"]
    if killed:
        secs = sorted(r.seconds for r in killed)
        sizes = sorted(r.tokens for r in killed if r.tokens is not None)
        median = lambda xs: xs[len(xs) // 2] if xs else float("nan")  # noqa: E731
        print(f"\n{len(killed)} killed, {sum(r.status == 'survived' for r in results)} survived, "
              f"{sum(r.status == 'unavailable' for r in results)} unavailable; median seconds to kill "
              f"{median(secs):.1f}, median shrunk size {median(sizes)} token(s)")


def write_json(results: list[MutantResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=1))
