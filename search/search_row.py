"""Searching one matrix row with Hypothesis: generate, check, shrink, and write the reproducer.

Used by the pytest matrix and by ``python -m harness run``. Before each example runs, its case is written
to a pending file, so a crash that kills the process (an illegal memory access, a segfault) still leaves
the case behind; after shrinking, the minimal failing case is written under ``cases/``.
"""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given
from hypothesis.errors import HypothesisException

from batch.spec import BatchSpec
from properties.verdict import Verdict
from search.casefile import CaseFile, case_name, safe_name
from search.matrix import Row, strategy_options
from search import ledger
from search.outcome import RowOutcome
from search.profiles import Profile, hypothesis_settings
from search.strategies import batch_specs

DEFAULT_OUT = Path("harness-out")


class PropertyFailed(AssertionError):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(str(verdict))
        self.verdict = verdict


def row_strategy(row: Row, profile: Profile):
    options = strategy_options(row.composition, profile) | dict(row.property.strategy_options)
    return batch_specs(profile, row.mode, row.composition.attention_kinds(), **options)


def search_row(row: Row, profile: Profile, device: str, *, database=None, max_examples: int | None = None,
               out_dir: Path = DEFAULT_OUT, seed: int | None = None) -> RowOutcome:
    """Search one row; ``seed`` fixes Hypothesis's random choices (a sweep gives each round its own)."""
    result = RowOutcome(row.id, str(row.composition), row.mode.value, row.property.name)
    pending = out_dir / "pending" / f"{safe_name(row.id)}.json"
    failures: list[tuple[BatchSpec, Verdict]] = []
    start = time.perf_counter()

    @hypothesis_settings(profile, database=database, max_examples=max_examples)
    @given(row_strategy(row, profile))
    def probe(spec: BatchSpec) -> None:
        CaseFile(str(row.composition), row.property.name, spec, device, profile.name).write(pending)
        verdict = row.property.run(row.composition, spec, device)
        result.cases += 1
        known = None if verdict.ok else ledger.match(str(row.composition), row.mode.value, row.property.name,
                                                      spec, verdict)
        if known is not None:  # triaged and reported: counted, and the search goes on for anything else
            result.known[known.id] = result.known.get(known.id, 0) + 1
            return
        result.keep_worst(verdict.worst_error, verdict.bound)
        if not verdict.ok:
            if result.first_failure_seconds is None:
                result.first_failure_seconds = time.perf_counter() - start
            failures.append((spec, verdict))
            raise PropertyFailed(verdict)

    # One database key per row, so replays of saved failures stay with their row.
    probe.hypothesis.inner_test._hypothesis_internal_add_digest = row.id.encode()
    if seed is not None:
        # Not ``hypothesis.seed(seed)``: it also sets ``database=None``, so a seeded search (every sweep round)
        # would neither save its failures nor replay saved ones. This attribute is what ``seed()`` sets for
        # generation; with the database left in place, saved failures of this row are replayed first
        # (Hypothesis's reuse phase), then the search goes on from the seed.
        probe._hypothesis_internal_use_seed = seed
    try:
        probe()
    except PropertyFailed:
        spec, verdict = failures[-1]  # Hypothesis replays the shrunk example last
        result.ok, result.failure, result.spec = False, verdict, spec
        bound = verdict.details.get("bound")  # the bound the verdict enforced (None: an exact check)
        result.case_file = CaseFile(str(row.composition), row.property.name, spec, device, profile.name,
                                    verdict={"reason": verdict.reason, "worst_error": verdict.worst_error,
                                             "bound": verdict.bound, "where": verdict.where},
                                    tolerances=None if bound is None else {
                                        "rel_l2": bound.rel_l2, "element": bound.element, "reason": bound.reason},
                                    ).write(out_dir / "cases" / case_name(str(row.composition), row.property.name,
                                                                          row.mode.value, spec))
    except HypothesisException as e:
        result.ok = False
        result.failure = Verdict(row.property.name, False, f"search could not run: {type(e).__name__}: {e}")
    finally:
        pending.unlink(missing_ok=True)
        result.seconds = time.perf_counter() - start
    return result
