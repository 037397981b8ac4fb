"""``harness bisect``: which releases a range names, what is refused in one line, and where a bug came and went."""

from __future__ import annotations

import pytest

from harness.bisect import Outcome, chosen_versions, release_key, summary
from harness.cli import main
from harness.options import UsageError

INDEX = ["0.5.10", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.22", "0.5.23"]


def test_a_range_takes_every_release_between_its_ends_in_order():
    assert release_key("0.5.12.post1") > release_key("0.5.12") and release_key("0.5.10rc0") is None
    assert chosen_versions(["0.5.12..0.5.22"], INDEX) == ["0.5.12", "0.5.12.post1", "0.5.13", "0.5.22"]
    assert chosen_versions(["0.5.23", "0.5.10", "0.5.23"], INDEX) == ["0.5.10", "0.5.23"]


@pytest.mark.parametrize("spec, words", [
    (["0.5.9..0.5.23"], "older than the oldest supported release 0.5.10"),
    (["0.5.23..0.5.10"], "empty range"),
    (["0.5.14..0.5.21"], "no release on the package index"),
    (["latest"], "not a release version"),
])
def test_bad_ranges_are_refused(spec, words):
    with pytest.raises(UsageError, match=words):
        chosen_versions(spec, ["0.5.10", "0.5.22", "0.5.23"])


def test_the_first_failing_release_and_the_fix():
    def run(*statuses):
        return [Outcome(f"0.5.{10 + i}", s, "") for i, s in enumerate(statuses)]
    assert summary(run("unavailable", "pass", "fail", "fail", "pass")) == ("0.5.12", "0.5.14")
    assert summary(run("fail", "fail")) == ("0.5.10", None)
    assert summary(run("pass", "unavailable")) == (None, None)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["bisect", str(tmp_path / "none.json"), "--versions", "0.5.22"]) == 2
    assert "cannot read case file" in capsys.readouterr().err
