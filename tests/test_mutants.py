"""The mutant catalogue under the ci profile: every mutant whose compositions run here must be killed.

A mutant that survives is a gap in the harness: close the gap, never delete the mutant.
"""

from __future__ import annotations

import pytest

from harness.mutants.catalogue import CATALOGUE
from harness.mutants.run import run_mutant
from search.profiles import PROFILES


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_mutant_is_killed(mutant, device, tmp_path):
    # A crashing mutant's hang is detected after case_timeout_s without progress; 10 s is ample for a
    # ci-profile case, which takes well under a second. The kill is the first failing example: shrinking it
    # proves nothing more here (`harness mutants` shrinks, for its table of case sizes).
    # SGLang's interpreted GDN kernels take seconds a case: their mutants get a longer hang timeout.
    result = run_mutant(mutant, PROFILES["ci"], device, tmp_path, budget_s=600,
                        case_timeout_s=10 if mutant.engine == "harness" else 120, shrink_seconds=0)
    if result.status == "unavailable":
        pytest.skip(f"{mutant.name}: {result.reason}")
    assert result.status == "killed", f"{mutant.name} survived: {result.reason}"
    if not mutant.crashes:  # found by a search: the time to the first failure, then the shrinking apart
        assert 0 < result.seconds and result.shrink_seconds is not None and result.shrink_seconds >= 0


def test_catalogue_is_documented_and_large_enough():
    assert len(CATALOGUE) >= 20
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    assert all(m.doc and ";" in m.doc for m in CATALOGUE), "each mutant: the bug; the symptom"
