"""A case that leaves a sticky CUDA error (an illegal address, a device-side assert) ends its row's search at
once, a known failure's included: every later case in the process would fail with the same error, so neither
more examples nor shrinking can mean anything, and the supervisors give the rows left a fresh process."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

from properties.verdict import Verdict
from search import search_row as search_row_module
from search.profiles import PROFILES
from search.search_row import search_row
from tests.stand_ins import StandInProperty, row_with

PROFILE = PROFILES["ci"]
ILLEGAL = "crashed: AcceleratorError: CUDA error: an illegal memory access was encountered"


@dataclasses.dataclass(frozen=True)
class IllegalAccessFromThreeTokens(StandInProperty):
    """'Crashes' the device on any batch of 3 tokens or more."""

    def run(self, composition, spec, device) -> Verdict:
        ok = spec.num_tokens < 3
        self.seen.append(ok)
        return Verdict(self.name, ok, "ok" if ok else ILLEGAL)


def search(prop, device, tmp_path):
    return search_row(row_with(prop), PROFILE, device, max_examples=60, out_dir=tmp_path, seed=3)


def test_a_finding_that_poisons_the_context_is_reported_unshrunk(tmp_path):
    prop = IllegalAccessFromThreeTokens()
    result = search(prop, "cuda", tmp_path)
    assert not result.ok and result.context_poisoned and result.cuda_context_lost
    assert prop.seen.count(False) == 1 and prop.seen[-1] is False  # nothing ran after it
    assert result.shrink_seconds == 0.0 and result.case_file and ILLEGAL in str(result.failure)


def test_a_known_failure_that_poisons_the_context_stops_the_row(tmp_path):
    prop = IllegalAccessFromThreeTokens()
    known = SimpleNamespace(id="some-known-bug")
    with mock.patch.object(search_row_module.ledger, "match", lambda *args: known):
        result = search(prop, "cuda", tmp_path)
    assert result.ok and result.known == {"some-known-bug": 1}
    assert result.context_poisoned and result.cuda_context_lost  # the supervisor starts a fresh process
    assert prop.seen[-1] is False


def test_the_same_words_off_a_gpu_shrink_as_usual(tmp_path):
    prop = IllegalAccessFromThreeTokens()
    result = search(prop, "cpu", tmp_path)
    assert not result.ok and not result.context_poisoned and prop.seen.count(False) > 1
