"""Known bugs stop costing search: once a row has met a ledger entry, its later draws with what that entry's bug
needs are not run (Hypothesis draws others), and the outcome says how many."""

from __future__ import annotations

import dataclasses

import pytest

from batch.spec import BatchSpec, ForwardMode, MHALayer
from properties.verdict import Verdict
from search import ledger
from search import search_row as search_row_module
from search.profiles import PROFILES
from search.search_row import search_row
from tests.stand_ins import StandInProperty, row_with

PROFILE = PROFILES["ci"]


@dataclasses.dataclass(frozen=True)
class WrongFromThreeTokens(StandInProperty):
    """Wrong on every batch of 3 tokens or more; records the token counts it ran."""

    def run(self, composition, spec, device) -> Verdict:
        self.seen.append(spec.num_tokens)
        ok = spec.num_tokens < 3
        return Verdict(self.name, ok, "ok" if ok else "out of bounds", 1.0, 1e-3, "layer 0: request 0, token 0")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A stand-in ledger entry: explains any failure; its bug needs 3 tokens or more, or cannot be steered from."""

    id: str = "three-tokens"
    steerable: bool = True
    corrupts_process: bool = False

    def could_show(self, spec) -> bool:
        return self.steerable and spec.num_tokens >= 3


def search(prop, entry, tmp_path, monkeypatch):
    monkeypatch.setattr(search_row_module.ledger, "match", lambda *args: entry)
    return search_row(row_with(prop), PROFILE, "cpu", max_examples=40, out_dir=tmp_path, seed=3)


def test_after_a_known_failure_its_batches_are_not_run(tmp_path, monkeypatch):
    prop = WrongFromThreeTokens()
    result = search(prop, Entry(), tmp_path, monkeypatch)
    assert result.ok and result.known == {"three-tokens": 1}
    first = next(i for i, n in enumerate(prop.seen) if n >= 3)
    assert all(n < 3 for n in prop.seen[first + 1:]), prop.seen  # none of its batches ran after the first
    assert result.steered.get("three-tokens", 0) > 0
    assert "of its batches not run" in result.summary()
    assert result.record()["steered"] == result.steered


@dataclasses.dataclass(frozen=True)
class EveryBatch(Entry):
    """A stand-in entry whose bug any batch could show."""

    def could_show(self, spec) -> bool:
        return True


def test_a_row_whose_draws_are_all_a_known_bugs_ends_after_a_run_of_them(tmp_path, monkeypatch):
    prop = WrongFromThreeTokens()
    result = search(prop, EveryBatch(), tmp_path, monkeypatch)
    # every draw after the known failure is steered off: the search ends after STEERED_OUT_DRAWS of them, not at
    # Hypothesis's own limit of 1,000 draws
    assert result.ok and result.known == {"three-tokens": 1} and prop.seen[-1] >= 3
    assert result.steered == {"three-tokens": search_row_module.STEERED_OUT_DRAWS} and result.steered_out
    assert result.summary().endswith("search ended: its last draws all had what those bugs need)")
    assert result.record()["steered_out"] is True


def test_an_entry_without_a_batch_form_is_not_steered_from(tmp_path, monkeypatch):
    prop = WrongFromThreeTokens()
    result = search(prop, Entry(steerable=False), tmp_path, monkeypatch)
    assert result.ok and result.known["three-tokens"] > 1 and not result.steered


def test_every_batch_form_is_of_a_condition_and_holds_for_its_entrys_own_case():
    assert set(ledger.COULD_SHOW) <= set(ledger.CONDITIONS)
    from search.casefile import CaseFile

    for entry in ledger.known_failures():
        if entry.steerable:
            spec = CaseFile.read(entry.case_path).spec
            assert entry.could_show(spec), f"{entry.id}: its own case lacks what its batch form asks for"


@pytest.mark.parametrize("spec, shows", [
    (BatchSpec(ForwardMode.DECODE, (5,), (1,), (MHALayer(0, 4, 2, 32, 32, logit_cap=5.0),)), True),
    (BatchSpec(ForwardMode.DECODE, (5,), (1,), (MHALayer(0, 4, 2, 32, 32),)), False),
])
def test_a_soft_cap_batch_form(spec, shows):
    assert ledger.COULD_SHOW["layer_has_logit_cap"](spec) is shows


def test_a_row_whose_every_batch_is_a_known_bugs_ends_without_a_finding(tmp_path, monkeypatch):
    # Every batch of this row fails as the entry describes: after the first, everything drawn is rejected, which
    # Hypothesis reports as unsatisfiable; the row is done, not broken
    @dataclasses.dataclass(frozen=True)
    class AlwaysWrong(WrongFromThreeTokens):
        def run(self, composition, spec, device) -> Verdict:
            self.seen.append(spec.num_tokens)
            return Verdict(self.name, False, "out of bounds", 1.0, 1e-3, "layer 0: request 0, token 0")

    @dataclasses.dataclass(frozen=True)
    class Everywhere(Entry):
        def could_show(self, spec) -> bool:
            return True

    prop = AlwaysWrong()
    result = search(prop, Everywhere(), tmp_path, monkeypatch)
    assert result.ok and result.failure is None and result.known == {"three-tokens": 1}
    assert len(prop.seen) == 1 and result.steered["three-tokens"] > 0


def test_a_known_bug_met_while_a_new_one_shrinks_does_not_steer_its_replay(tmp_path, monkeypatch):
    # A new bug on batches of 5 tokens or more; batches of 3 or 4 fail as a known entry describes, but only once the
    # new bug has been seen (so the known bug is met while the new one shrinks). Steering then would reject the new
    # bug's final replay (its batch has what the entry needs), which Hypothesis reports as flaky, and the shrunk
    # case would be lost.
    @dataclasses.dataclass(frozen=True)
    class NewBugFromFive(WrongFromThreeTokens):
        def run(self, composition, spec, device) -> Verdict:
            n = spec.num_tokens
            self.seen.append(n)
            ok = n < 3 or (n < 5 and not any(m >= 5 for m in self.seen))
            return Verdict(self.name, ok, "ok" if ok else "out of bounds", 1.0, 1e-3, "layer 0: request 0, token 0")

    known = Entry()  # its bug needs 3 tokens or more: the new bug's batches have that too
    monkeypatch.setattr(search_row_module.ledger, "match",
                        lambda composition, mode, prop, spec, verdict, device: known if spec.num_tokens < 5 else None)
    prop = NewBugFromFive()
    result = search_row(row_with(prop), PROFILE, "cpu", max_examples=200, out_dir=tmp_path, seed=3)
    assert not result.ok and any(n >= 5 for n in prop.seen)
    assert "failed once" not in str(result.failure)  # not reported as flaky
    assert result.spec.num_tokens == 5  # shrunk to the smallest failing batch


def test_the_batch_a_property_runs_first_steers_too():
    # replan runs a batch of the drawn one's shapes first (Property.before) and the ledger judges a crash there by that
    # batch: a draw whose batch before has a known bug's shape is steered off like one that has it itself (found by
    # review: steering read the drawn batch only)
    from search.outcome import RowOutcome
    from search.search_row import steered_off

    two = BatchSpec(ForwardMode.EXTEND, (0,), (2,), (MHALayer(0, 4, 2, 16, 16),))
    grown = lambda spec: dataclasses.replace(spec, extend_lens=(3,))  # noqa: E731 - a stand-in batch before
    result = RowOutcome("row", "c", "extend", "p")
    assert not steered_off(two, [Entry()], [], result)
    assert steered_off(two, [Entry()], [], result, grown) and result.steered == {"three-tokens": 1}
    assert not steered_off(two, [Entry()], [("a new failure", None)], result, grown)  # never while one shrinks
