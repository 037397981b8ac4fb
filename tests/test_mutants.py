"""The mutant catalogue under the ci profile: every mutant whose compositions run here must be killed.

A mutant that survives is a gap in the harness: close the gap, never delete the mutant.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.mutants.catalogue import CATALOGUE
from harness.mutants.run import run_mutant
from search.profiles import PROFILES


def _ci_profile(device: str):
    """The ci profile, with the kernels' length boundaries drawn as far as the device's kernels put them. Its cap of
    65 keys covers the interpreted Triton blocks (16 keys: the decode's fourth split starts past 48); compiled on a
    GPU the blocks are 32 or 64 keys, and the fourth split starts past 96 or 192 (backends/triton.py), which the cap
    left out: decode_merge_drops_last_split survived 3 rounds on an H100."""
    ci = PROFILES["ci"]
    if device == "cpu":
        return ci
    from backends.triton import LENGTH_BOUNDARIES

    return dataclasses.replace(ci, max_boundary=max(ci.max_boundary, max(LENGTH_BOUNDARIES) + 1))


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_mutant_is_killed(mutant, device, tmp_path):
    # A crashing mutant's hang is detected after case_timeout_s without progress; 10 s is ample for a
    # ci-profile case, which takes well under a second. The kill is the first failing example: shrinking it
    # proves nothing more here (`harness mutants` shrinks, for its table of case sizes).
    # SGLang's interpreted GDN kernels take seconds a case: their mutants get a longer hang timeout.
    result = run_mutant(mutant, _ci_profile(device), device, tmp_path, budget_s=600,
                        case_timeout_s=10 if mutant.engine == "harness" else 120, shrink_seconds=0)
    if result.status == "unavailable":
        pytest.skip(f"{mutant.name}: {result.reason}")
    # "broken": the kill was a crash of the mutant's own patch, not its fault at work (harness.mutants.run.own_crash)
    assert result.status == "killed", f"{mutant.name} {result.status}: {result.reason}"
    if not mutant.crashes:  # found by a search: the time to the first failure, then the shrinking apart
        assert 0 < result.seconds and result.shrink_seconds is not None and result.shrink_seconds >= 0


def test_catalogue_is_documented_and_large_enough():
    assert len(CATALOGUE) >= 20
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    assert all(m.doc and ";" in m.doc for m in CATALOGUE), "each mutant: the bug; the symptom"


def test_a_kill_by_a_crash_of_the_mutants_own_patch_is_a_broken_mutant(device, tmp_path):
    # What kv_written_one_slot_off did before it took the fp8 scales: its replacement took 5 arguments, the caller
    # passed 7, and every row "failed" with a TypeError that says nothing of K/V written one slot off.
    from dataclasses import dataclass
    from unittest import mock

    from batch.forward_batch import KVPool
    from harness.mutants.catalogue import Mutant
    from harness.mutants.run import own_crash

    @dataclass(frozen=True)
    class OldSignature(Mutant):
        def patch(self):
            original = KVPool.set_kv_buffer

            def set_kv_buffer(self, layer_id, loc, k, v):
                original(self, layer_id, loc + 1, k, v)
            # as the catalogue names it: defined inside the function named after the mutant
            set_kv_buffer.__qualname__ = "kv_written_one_slot_off.<locals>.set_kv_buffer"
            return mock.patch.object(KVPool, "set_kv_buffer", set_kv_buffer)

    mutant = OldSignature("kv_written_one_slot_off", "old signature; crashes", ("torch_native",), ("cache",),
                          modes=("extend",))
    result = run_mutant(mutant, PROFILES["ci"], device, tmp_path, budget_s=120, shrink_seconds=0)
    assert result.status == "broken", result
    assert "kv_written_one_slot_off.<locals>.set_kv_buffer" in result.reason
    # A crash deeper in the code under test is the fault at work, not a broken mutant
    from properties.verdict import Verdict
    deep = Verdict("cache", False, "crashed: IndexError: index 99 is out of bounds (forward_batch.py:70 in "
                                   "set_kv_buffer: `...`)",
                   details={"traceback": ["harness/mutants/catalogue.py:150 in set_kv_buffer",
                                          "batch/forward_batch.py:70 in set_kv_buffer"]})
    assert own_crash(mutant, deep) is None
    inside = Verdict("cache", False, "crashed: AttributeError: 'KVPool' has no attribute 'k_buf' (catalogue.py:150 in "
                                     "set_kv_buffer: `...`)",
                     details={"traceback": ["engine/execute.py:40 in run", "mutants/catalogue.py:150 in set_kv_buffer"]})
    assert "does not fit the code it replaces" in own_crash(mutant, inside)
    # A faulty wrapper line in the patch calling a child with a keyword it does not take: the mechanism (hybrid_extra_kwarg)
    extra = Verdict("conformance", False, "crashed: TypeError: TorchNativeBackend.init_mha_chunk_metadata() got an "
                                          "unexpected keyword argument 'x' (catalogue.py:74 in init_mha_chunk_metadata)",
                    details={"traceback": ["harness/mutants/catalogue.py:74 in init_mha_chunk_metadata"]})
    assert own_crash(mutant, extra) is None
