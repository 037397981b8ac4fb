"""The one record of a matrix row's outcome, shared by ``run``, ``sweep`` (and its workers) and the report.

A row searched once (``harness run``) or over several rounds (``harness sweep``) ends as one JSON record
(:meth:`RowOutcome.record`); the status words and the worst-error rule are defined here and nowhere else.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from batch.spec import BatchSpec
from properties.verdict import CHECK_WORDS, Verdict

# How a finding's kind reads as the row's status; a row without a finding has passed, or not run at all.
FINDING_STATUS = {"failure": "failed", "crash": "crashed", "hang": "hung", "error": "error",
                  "adapter_error": "adapter error"}
# Not the engine's bug: the harness's own code failed around the engine's classes (properties.blame)
ADAPTER_ERROR = "adapter_error"


def finding_kind(status: str) -> str:
    """The finding kind a row record's status reads as (the inverse of FINDING_STATUS; "failure" for any other)."""
    return next((kind for kind, word in FINDING_STATUS.items() if word == status), "failure")


def exit_status(kinds) -> int:
    """A run's exit status from its findings' kinds: 1 if any is a finding, 3 if all are adapter errors, else 0
    (README, "Exit statuses")."""
    kinds = list(kinds)
    if any(k != ADAPTER_ERROR for k in kinds):
        return 1
    return 3 if kinds else 0


def poisons_cuda_context(failure) -> bool:
    """A CUDA error (an illegal address, a device-side assert) is sticky: every later case in the process
    would fail with it, whatever it tests."""
    # torch's wording. A Triton launcher says "Triton Error [CUDA]" for faults and harmless launch errors alike
    # (a grid too large); Property.run's synchronize after it tells the two apart.
    return "CUDA error" in str(failure)


# Under CUDA MPS (``--mps``: harness/mps.py) a fatal GPU fault of one client reaches every client of the daemon that
# shares the GPU (NVIDIA's MPS documentation, "Error containment", Volta on), and the daemon takes no new client until
# they have all exited: a worker's case that ended in a CUDA error may be another worker's fault. Such a failure that
# passes alone, outside MPS, is counted under this name in ``passed_alone`` (not a ledger entry)
MPS_FAULT = "mps-fault"
MPS_PIPE, MPS_DEFAULT_PIPE = "CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"


def mps_client() -> bool:
    """Whether a CUDA context this process makes is an MPS daemon's client: the daemon's control socket is in the
    folder the CUDA driver looks in (without one there, CUDA runs without MPS), and something listens on it. A socket
    left by a daemon that was killed refuses a connection (ECONNREFUSED, whatever its type); a live one of another
    socket type than the probe's answers EPROTOTYPE, which counts as listening (the H200's daemon did:
    harness-out/gpu110.sh, where a stream connection alone was taken for proof and every worker missed it)."""
    control = os.path.join(os.environ.get(MPS_PIPE) or MPS_DEFAULT_PIPE, "control")
    try:
        if not stat.S_ISSOCK(os.stat(control).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(control)
        except (ConnectionRefusedError, FileNotFoundError, PermissionError):
            return False  # no daemon (or one that quit meanwhile), or one CUDA cannot reach either
        except OSError:
            return True  # EPROTOTYPE: a live socket of another type (the daemon's); anything else: assume one
    return True


def is_worse(err: float | None, bound: float | None, than_err: float | None, than_bound: float | None) -> bool:
    """Whether ``err / bound`` is a worse ratio than the one kept so far (none kept: any ratio is)."""
    if err is None or not bound:
        return False
    return than_err is None or err / bound > than_err / than_bound


@dataclass
class RowOutcome:
    """What searching one row gave: cases, time, the worst error against its bound, the failure if any."""

    row_id: str
    composition: str
    mode: str
    property: str
    cases: int = 0
    seconds: float = 0.0
    rounds: int = 1
    ok: bool = True
    worst_error: float | None = None
    bound: float | None = None
    # check (rel_l2, element) -> the largest ratio of error to bound over the row's passing cases; ``unexplained``:
    # over those of them that no ledger entry explains (a known bug's mild instance, below its bound, is not a risk
    # of the bound's); ``near_misses_known``: ledger id -> passing cases above AT_RISK_RATIO it explains
    headroom: dict[str, float] = field(default_factory=dict)
    unexplained: dict[str, float] = field(default_factory=dict)
    near_misses_known: dict[str, int] = field(default_factory=dict)
    failure: Verdict | str | None = None
    finding_kind: str | None = None  # failure, crash, hang or error (None while ok)
    spec: BatchSpec | None = None
    case_file: Path | str | None = None
    first_failure_seconds: float | None = None
    shrink_seconds: float | None = None  # spent shrinking the failure to the reported case
    known: dict[str, int] = field(default_factory=dict)  # ledger id -> cases that failed as it describes
    # ledger id -> draws rejected, not run, after the row met that entry: batches with what its bug needs
    steered: dict[str, int] = field(default_factory=dict)
    # The search ended early: its last draws were all steered off (search_row.SteeredOut)
    steered_out: bool = False
    # ledger id -> failures of this row that passed when replayed alone in a fresh process, after this process had
    # run batches that entry's stray writes reach (search_row.confirm_alone): that entry's doing, not a finding
    passed_alone: dict[str, int] = field(default_factory=dict)
    passed_alone_cases: list[dict] = field(default_factory=list)  # each: the entry, the failure's reason, its case
    # Under MPS: a failure with a CUDA error whose replays alone failed with one too (the GPU fault reproduced outside
    # MPS: search_row.confirm_alone), which tells a sweep its fault is accounted for (harness/sweep.py)
    fault_alone: bool = False
    # A case left a sticky CUDA error (a known failure's included): the search of this row stopped there, and
    # the rows after it need a fresh process
    context_poisoned: bool = False

    @property
    def cuda_context_lost(self) -> bool:
        """Whether the process that searched this row can run nothing more on its GPU."""
        return self.context_poisoned or (not self.ok and poisons_cuda_context(self.failure))

    @property
    def cases_per_second(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0

    @property
    def status(self) -> str:
        if self.ok:
            return "passed" if self.cases else "not run"
        return FINDING_STATUS[self.finding_kind or "failure"]

    def keep_worst(self, verdict: Verdict, explained_by: str | None = None) -> None:
        """Keep the verdict's error if it is the row's worst; a passing verdict's headroom too (``explained_by``:
        the ledger entry whose mechanism explains this passing case's near miss, if any)."""
        if is_worse(verdict.worst_error, verdict.bound, self.worst_error, self.bound):
            self.worst_error, self.bound = verdict.worst_error, verdict.bound
        if verdict.ok:
            headroom = verdict.details.get("headroom")
            self.headroom = merge_headroom(self.headroom, headroom)
            if explained_by is None:
                self.unexplained = merge_headroom(self.unexplained, headroom)
            else:
                self.near_misses_known[explained_by] = self.near_misses_known.get(explained_by, 0) + 1

    def absorb(self, later: "RowOutcome") -> None:
        """Add a later search of the same row, which went on from this one (this one passed): its cases, time, known
        failures and worst error join these; its failure, if any, becomes the row's."""
        assert self.ok, "a row with a finding is not searched again"
        self.cases += later.cases
        self.seconds += later.seconds
        self.steered_out = self.steered_out or later.steered_out
        self.passed_alone_cases += later.passed_alone_cases
        self.fault_alone = self.fault_alone or later.fault_alone
        for mine, theirs in ((self.known, later.known), (self.steered, later.steered),
                             (self.near_misses_known, later.near_misses_known), (self.passed_alone, later.passed_alone)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        if is_worse(later.worst_error, later.bound, self.worst_error, self.bound):
            self.worst_error, self.bound = later.worst_error, later.bound
        self.headroom = merge_headroom(self.headroom, later.headroom)
        self.unexplained = merge_headroom(self.unexplained, later.unexplained)
        self.context_poisoned = self.context_poisoned or later.context_poisoned
        if not later.ok:
            self.ok, self.failure, self.finding_kind, self.spec = False, later.failure, later.finding_kind, later.spec
            self.case_file, self.shrink_seconds = later.case_file, later.shrink_seconds
            self.first_failure_seconds = later.first_failure_seconds

    @property
    def at_risk(self) -> list[str]:
        return checks_at_risk(self.unexplained)

    def summary(self) -> str:
        if self.ok:
            err = "" if self.worst_error is None else f", worst {self.worst_error:.2e} / bound {self.bound:.2e}"
            err += "".join(f", AT RISK: {check} at {self.unexplained[check]:.2f} of its bound" for check in self.at_risk)
            known = "".join(f", {n} known failure(s) {k}" + (f" (then {self.steered[k]} of its batches not run)"
                                                                if self.steered.get(k) else "")
                            for k, n in self.known.items())
            known += "".join(f", {n} failure(s) that passed alone in a fresh process after batches of {k} ran in this "
                             f"one (its stray writes)" for k, n in self.passed_alone.items() if k != MPS_FAULT)
            if self.passed_alone.get(MPS_FAULT):
                known += (f", {self.passed_alone[MPS_FAULT]} CUDA error(s) under MPS that passed alone (another "
                          f"worker's GPU fault reaches every MPS client)")
            if self.steered_out:
                known += ", search ended: its last draws all had what those bugs need"
            return f"ok ({self.cases} cases{err}{known})"
        return f"FAILED: {self.headline()}"

    def headline(self) -> str | None:
        """A failure in one line, how badly and where first: ``0.38 / bound 8.6e-07 (×4.4e+05) at layer 0:
        request 0, token 0, head 7: outputs: ...``; the tolerance's formula is left to report.md."""
        if self.ok:
            return None
        return failure_headline(self.failure)

    def record(self) -> dict:
        """The row as JSON: what ``results.jsonl``, a worker's events and ``report.json`` hold."""
        spec = self.spec
        return {"row": self.row_id, "composition": self.composition, "mode": self.mode, "property": self.property,
                "ok": self.ok, "status": self.status, "rounds": self.rounds, "cases": self.cases,
                "seconds": round(self.seconds, 3), "worst_error": self.worst_error, "bound": self.bound,
                "headroom": dict(self.headroom), "unexplained_headroom": dict(self.unexplained),
                "near_misses_known": dict(self.near_misses_known), "at_risk": self.at_risk,
                "failure": None if self.ok else str(self.failure),
                "case_file": None if self.case_file is None else str(self.case_file),
                "batch_size": None if spec is None else spec.batch_size,
                "num_tokens": None if spec is None else spec.num_tokens,
                "first_failure_seconds": self.first_failure_seconds, "shrink_seconds": self.shrink_seconds,
                "headline": self.headline(), "failure_at": failure_at(self.failure), "known": dict(self.known),
                "steered": dict(self.steered), "steered_out": self.steered_out, "passed_alone": dict(self.passed_alone),
                "passed_alone_cases": list(self.passed_alone_cases), "fault_alone": self.fault_alone}


def failure_at(failure: Verdict | str | None) -> dict | None:
    """The failing case's own worst error, bound and place (the row's ``worst_error`` is over all its cases)."""
    if not isinstance(failure, Verdict):
        return None
    return {"check": failure.check, "worst_error": failure.worst_error, "bound": failure.bound,
            "where": failure.where, "rel_l2": failure.rel_l2}


def failure_headline(failure: Verdict | str | None) -> str:
    """See :meth:`RowOutcome.headline`; a failure given as text (a crash, a hang) is its own headline."""
    if not isinstance(failure, Verdict):
        return str(failure)
    reason = failure.reason
    bound = failure.details.get("bound")
    formula = getattr(bound, "reason", None)
    if formula:
        reason = reason.replace(f" ({formula})", "")
    if failure.worst_error is None or not failure.bound:
        return f"{failure.property}: {reason}" + (f" at {failure.where}" if failure.where else "")
    ratio = failure.worst_error / failure.bound
    where = f" at {failure.where}" if failure.where else ""
    what = f"{CHECK_WORDS[failure.check]} " if failure.check in CHECK_WORDS else ""
    return (f"{what}{failure.worst_error:.3g} / bound {failure.bound:.3g} (×{ratio:.3g}){where}: "
            f"{failure.property}: {reason}")


# A passing row whose worst case came this close to a bound is at risk: correct code that near its bound is a false
# finding waiting to happen, or the bound is right and the code is not (properties/tolerances.py)
AT_RISK_RATIO = 0.5


def merge_headroom(kept: dict[str, float], new: dict[str, float] | None) -> dict[str, float]:
    """Each check's larger ratio of the two (a check either lacks is taken from the other)."""
    out = dict(kept)
    for check, ratio in (new or {}).items():
        out[check] = max(out.get(check, 0.0), ratio)
    return out


def checks_at_risk(headroom: dict[str, float] | None) -> list[str]:
    return sorted(check for check, ratio in (headroom or {}).items() if ratio > AT_RISK_RATIO)


def near_miss(headroom: dict[str, float] | None) -> bool:
    """Whether a passing case came close enough to a bound for the row to be at risk, unless a ledger entry
    explains it."""
    return bool(checks_at_risk(headroom))


def unexplained_headroom(record: dict) -> dict[str, float]:
    """A row record's headroom over the passing cases no ledger entry explains (a record without the split: all)."""
    return record.get("unexplained_headroom", record.get("headroom")) or {}


def row_at_risk(record: dict) -> list[str]:
    """The checks a row's record is at risk on: those whose unexplained headroom is above AT_RISK_RATIO."""
    return checks_at_risk(unexplained_headroom(record))


def throughput(records: list[dict]) -> list[tuple[str, int, float]]:
    """(composition, cases, seconds) per composition, in the records' order."""
    totals: dict[str, list] = {}
    for r in records:
        t = totals.setdefault(r["composition"], [0, 0.0])
        t[0] += r["cases"]
        t[1] += r["seconds"]
    return [(c, n, s) for c, (n, s) in totals.items()]
