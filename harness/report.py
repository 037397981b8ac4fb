"""The run's summary: a table on the terminal and a JSON report next to the case files."""

from __future__ import annotations

import json
from pathlib import Path


def write_json_report(results, skipped, path: Path, device: str, profile: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "device": device,
        "profile": profile,
        "rows": [{"row": r.row_id, "composition": r.composition, "mode": r.mode, "property": r.property,
                  "ok": r.ok, "cases": r.cases, "seconds": round(r.seconds, 3), "worst_error": r.worst_error,
                  "bound": r.bound, "failure": None if r.ok else str(r.failure),
                  "case_file": None if r.case_file is None else str(r.case_file)} for r in results],
        "unavailable": [{"composition": c, "reason": why} for c, why in skipped],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def print_summary(results, skipped, seconds: float) -> None:
    print()
    comp_w = max([len(r.composition) for r in results] + [11])
    print(f"{'composition':<{comp_w}} {'mode':<13} {'property':<20} {'cases':>5} {'worst/bound':>11}  status")
    for r in results:
        ratio = "-" if r.worst_error is None else f"{r.worst_error / r.bound:.3f}"
        print(f"{r.composition:<{comp_w}} {r.mode:<13} {r.property:<20} {r.cases:>5} {ratio:>11}  "
              f"{'ok' if r.ok else 'FAILED'}")
    for comp, why in skipped:
        print(f"{comp:<{comp_w}} unavailable: {why}")
    failed = [r for r in results if not r.ok]
    cases = sum(r.cases for r in results)
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed, {len(skipped)} unavailable: "
          f"{cases} cases in {seconds:.1f}s")
    for r in failed:
        print(f"FAILED {r.row_id}: {r.failure}")
        if r.case_file:
            print(f"  reproduce: python -m harness repro {r.case_file}")
