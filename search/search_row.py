"""Searching one matrix row with Hypothesis: generate, check, shrink, and write the reproducer.

Used by the pytest matrix and by ``python -m harness run``. Before each example runs, its case is written
to a pending file, so a crash that kills the process (an illegal memory access, a segfault) still leaves
the case behind; after shrinking, the minimal failing case is written under ``cases/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from hypothesis import given, reject
from hypothesis.errors import Flaky, HypothesisException, Unsatisfiable
from hypothesis.reporting import with_reporter

from batch.spec import BatchSpec, SpecError
from properties.verdict import Verdict
from search.casefile import CaseFile, case_name, safe_name
from search.matrix import Row, strategy_options
from search import ledger
from search.outcome import (ADAPTER_ERROR, MPS_FAULT, MPS_PIPE, RowOutcome, mps_client, near_miss,
                            poisons_cuda_context)
from search.profiles import Profile, hypothesis_settings
from search.strategies import batch_specs

DEFAULT_OUT = Path("harness-out")


class ShrinkBudgetSpent(BaseException):
    """Raised from the test once the time for shrinking is spent. Not an ``Exception``, so Hypothesis does not
    take it for a failure but stops at once (as on Ctrl-C); the last failure found, the smallest so far (the
    shrinker only tries smaller cases), is the row's result."""


class ContextPoisoned(BaseException):
    """Raised from the test once a case has left a sticky CUDA error: nothing after it in this process can run,
    so Hypothesis stops at once (neither more examples nor shrinking)."""


class SteeredOut(BaseException):
    """Raised from the test once ``STEERED_OUT_DRAWS`` draws in a row were all steered off (``steered_off``): what is
    left of the row's batches is, as far as the search can tell, the known bugs it met. Hypothesis would go on drawing
    to its own limit (ten times the examples, at least 1,000 draws: a second or more on a CPU for a row of SGLang's
    torch_native refusals, whose every overreach is one of its two known bugs); the row ends with the cases it ran."""


class AdapterFailed(BaseException):
    """Raised from the test when the harness's own code failed around the engine's classes: no shrinking (the
    adapter, not the batch, is at fault) and no more examples (each would fail the same way)."""


class PropertyFailed(AssertionError):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(str(verdict))
        self.verdict = verdict


def row_options(row: Row, profile: Profile) -> dict:
    """The ``batch_specs`` options of ``row``: what its composition declares, and what its property asks for."""
    return strategy_options(row.composition, profile) | row.property.options(row.composition, row.mode)


def row_strategy(row: Row, profile: Profile):
    return batch_specs(profile, row.mode, row.composition.attention_kinds(), **row_options(row, profile))


def failing_case(row: Row, profile: Profile, device: str, spec: BatchSpec, verdict: Verdict) -> CaseFile:
    """The case file of a failing example: its spec, the verdict, and the bound that verdict enforced."""
    bound = verdict.details.get("bound")  # the bound the verdict enforced (None: an exact check)
    return CaseFile(str(row.composition), row.property.name, spec, device, profile.name,
                    verdict={"reason": verdict.reason, "check": verdict.check, "worst_error": verdict.worst_error,
                             "bound": verdict.bound, "where": verdict.where, "rel_l2": verdict.rel_l2},
                    tolerances=None if bound is None else {
                        "rel_l2": bound.rel_l2, "element": bound.element, "reason": bound.reason})


def row_profile(support, profile: Profile, device: str) -> Profile:
    """The profile a row's batches are drawn from on ``device``: without the long-context shape on a CPU for
    interpreted kernels, and for a backend that declares why it cannot take it there (``no_long_context_on_cpu``).

    Interpreted kernels over the long-context shape take tens of minutes a case (our Triton extend over
    16384+16384+4096 cached keys, metadata property: `harness repro` of it was still running after 25 minutes,
    beside a two-worker sweep on two cores), which a CPU sweep cannot spend and its case timeout would call a hang.
    Those lengths are drawn for these rows on a GPU, and on a CPU for the PyTorch backends."""
    if device == "cpu" and (support.interpreted_on_cpu or support.no_long_context_on_cpu):
        return dataclasses.replace(profile, long_context=None)
    return profile


def row_budget(row: Row, profile: Profile, device: str, max_examples: int | None,
               shrink_seconds: float | None) -> tuple[int | None, float | None]:
    """A row's examples (None: the profile's) and shrinking time: fewer for a slow row and for a row of the harness's
    own backends (a control sample: ``Profile.control_examples``), one and no shrinking for a row whose check reads
    classes, not the batch (more examples, or shrinking one, repeat it). A ``max_examples`` given wins."""
    support = row.composition.support()
    slow = (device == "cpu" and support.slow_on_cpu) or row.property.runs_twice
    if max_examples is None:
        limits = [profile.slow_row_examples if slow else None,
                  profile.control_examples if row.composition.engine == "harness" else None]
        fewer = min((n for n in limits if n), default=None)
        if fewer is not None and fewer < profile.max_examples:
            max_examples = fewer
    if support.class_only:
        return (1 if max_examples is None else max_examples), 0
    return max_examples, shrink_seconds


# Draws in a row, each with what a known bug this row met needs, after which the row's search ends (``SteeredOut``)
STEERED_OUT_DRAWS = 50

# What one case's verdict means for the search (``record_case``)
PASSED, KNOWN, ADAPTER, FAILED, POISONED = "passed", "known", "adapter", "failed", "poisoned"


def steered_off(spec: BatchSpec, steer_off: list, failures: list, result: RowOutcome,
                before: Callable[[BatchSpec], BatchSpec] | None = None) -> bool:
    """Whether ``spec`` has what a known bug this row met needs (counted in ``result.steered``): not run. Never once a
    new failure is found: its shrinking and final replay must see every batch they try (a rejected replay reads as
    flaky). ``before``: the batch the row's property runs first (replan's, ``Property.before``), whose known bugs
    steer too: the ledger judges a crash there by that batch."""
    if failures or not steer_off:
        return False
    batches = (spec,) if before is None else (spec, before(spec))
    met = next((entry for entry in steer_off if any(entry.could_show(b) for b in batches)), None)
    if met is not None:
        result.steered[met.id] = result.steered.get(met.id, 0) + 1
    return met is not None


# Batches run and judged in this process (passed, or failed as the ledger explains) that a ledger entry whose bug
# leaves the process suspect (``corrupts_process``: stray writes on CUDA) says its bug reaches (a stray write need not
# fail the property that ran): entry id -> batches. A later failure that no entry explains may be those writes'
# doing, not its own batch's. A failing batch never taints the process for itself.
TAINTED: dict[str, int] = {}
PROJECT = Path(__file__).resolve().parents[1]
REPLAY_ALONE_SECONDS = 600
# Where the stray writes land depends on the memory layout, so one passing replay alone is weak evidence (the same
# case passed alone once and failed alone once on an H200, harness-out/gpu95.sh, gpu96.sh): every replay must pass
REPLAYS_ALONE = 2


def note_taint(row: Row, spec: BatchSpec, device: str) -> None:
    """Count a judged ``spec`` against every corrupting entry whose bug it reaches (TAINTED)."""
    for entry in ledger.known_failures():
        if entry.corrupts_process and entry.reaches(str(row.composition), row.mode.value, spec, device):
            TAINTED[entry.id] = TAINTED.get(entry.id, 0) + 1


# The catalogue mutant this process runs under (harness.mutants.catalogue's Mutant.patch sets it), which a replay
# alone injects as well: a mutant's own failure replayed without it would pass, and be counted away
REPLAY_MUTANT: str | None = None
# Called every few seconds while a case is replayed alone (a sweep's worker says it is alive: its supervisor would
# otherwise count the replays against the case's timeout and report a hang)
ALIVE: Callable[[], None] | None = None
ALIVE_EVERY_S = 5.0


def alone_log(case_file: Path | str) -> Path:
    """Where the replays alone of ``case_file`` write what they printed (beside it: the evidence either way)."""
    return Path(f"{case_file}.alone.log")


def move_case(case: Path, folder: Path) -> Path:
    """Move ``case`` into ``folder`` with what its replays alone printed, if any; its new path."""
    folder.mkdir(parents=True, exist_ok=True)
    moved = folder / case.name
    if alone_log(case).exists():
        alone_log(case).replace(alone_log(moved))
    case.replace(moved)
    return moved


def replay_alone(case_file: Path | str) -> int | None:
    """``harness repro CASE --known-passes`` in a fresh process (under :data:`REPLAY_MUTANT`), outside CUDA MPS (its
    pipe folder pointed at an empty one: CUDA then runs without MPS, so no other worker's fault reaches it): its exit
    status (0: the case passes, or fails only as a ledger entry describes; 1: it fails otherwise), None where it could
    not tell (it hung, or ended otherwise). What it printed is appended to :func:`alone_log`."""
    mutant = ["--mutant", REPLAY_MUTANT] if REPLAY_MUTANT else []
    argv = [sys.executable, "-m", "harness", "repro", str(case_file), "--known-passes", *mutant]
    with tempfile.TemporaryDirectory(prefix="harness-no-mps-") as no_daemon, \
            open(alone_log(case_file), "a") as log:
        log.write(f"$ {' '.join(argv[1:])}\n")
        log.flush()
        # Its own session: a stop or the deadline ends the replay and whatever it started (a JIT compiler), and the
        # sweep's SIGINT to this worker's group does not reach it
        proc = subprocess.Popen(argv, cwd=PROJECT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ | {MPS_PIPE: no_daemon}, start_new_session=True)
        try:
            deadline = time.monotonic() + REPLAY_ALONE_SECONDS
            while True:
                try:
                    code = proc.wait(timeout=ALIVE_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    if ALIVE is not None:
                        ALIVE()
                    if time.monotonic() >= deadline:
                        log.write(f"(no end after {REPLAY_ALONE_SECONDS} s)\n")
                        return None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.write(f"(exit status {code})\n")
    return code if code in (0, 1) else None


def confirm_alone(result: RowOutcome, device: str, out_dir: Path,
                  replay: Callable[[Path | str], int | None] | None = None) -> None:
    """A failure on CUDA that may be another's doing is replayed alone in a fresh process before it is reported. If
    it passes there, the row counts it under its cause (``passed_alone``), its case file moves to
    ``OUT/passed-alone/``, and the process is marked suspect (its group's other rows go on in a fresh one). It must
    pass every one of REPLAYS_ALONE replays; what failed (its reason and its kept case) stays in the row's record.
    Two causes:

    - a failure that no ledger entry explains, in a process that had run batches a corrupting entry's bug reaches
      (TAINTED): those stray writes. Seen on an H200 (harness-out/gpu95.sh): a TBO-over-GDN metadata failure whose
      expected req_to_token row read a page 0 no batch had put there, after the same process had run plainly cut GDN
      batches; alone, it passed. Counted under that entry.
    - a CUDA error in a client of an MPS daemon (``--mps``): another worker's fatal GPU fault reaches every client
      (:data:`search.outcome.MPS_FAULT`). Replayed outside MPS; counted under ``mps-fault``. Such an error may be
      raised in the harness's own code (the next call that synchronizes), so an adapter error with one is replayed
      too.

    What each replay printed is kept beside the case (``CASE.alone.log``). A failure that already passed on a rerun
    in this process (Hypothesis's flaky) is not replayed: it stays a finding."""
    if device != "cuda" or result.ok or result.case_file is None:
        return
    mps_fault = mps_client() and poisons_cuda_context(result.failure)
    if not mps_fault and (not TAINTED or result.finding_kind == ADAPTER_ERROR):
        return
    # Out of cases/ while it is replayed: a sweep stopped meanwhile adopts what it finds there as findings (seen on an
    # H200, harness-out/gpu108.sh: a case another worker's fault had failed, adopted as its row's finding)
    replay = replay or replay_alone
    case = Path(result.case_file)
    replaying = move_case(case, out_dir / "replaying-alone")
    if any(replay(replaying) != 0 for _ in range(REPLAYS_ALONE)):
        move_case(replaying, case.parent)  # it fails alone too (or a replay could not tell): a finding
        said = [line[len("verdict:"):].strip() for line in _read(alone_log(case)).splitlines()
                if line.startswith("verdict:")]
        failed_alone = said and ": FAILED:" in said[-1]
        result.fault_alone = bool(mps_fault and failed_alone and poisons_cuda_context(said[-1]))
        if mps_fault and failed_alone and not poisons_cuda_context(said[-1]):
            # Its own failure, but not that CUDA error: reported as the replay failed, whose it is included (the CUDA
            # error may have been raised in the harness's code, the replay's failure in the engine's, or back)
            result.failure = dataclasses.replace(result.failure, reason=f"{result.failure.reason} [alone, outside "
                                                 f"MPS, it failed otherwise: {said[-1]}]")
            result.finding_kind = ADAPTER_ERROR if "adapter error at " in said[-1] else None
        return
    entry = MPS_FAULT if mps_fault else max(TAINTED, key=TAINTED.get)
    result.passed_alone[entry] = result.passed_alone.get(entry, 0) + 1
    kept = move_case(replaying, out_dir / "passed-alone")
    result.passed_alone_cases.append({"entry": entry, "reason": str(result.failure), "case": str(kept)})
    result.ok, result.failure, result.finding_kind, result.spec, result.case_file = True, None, None, None, None
    result.context_poisoned = True


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def record_case(row: Row, profile: Profile, device: str, spec: BatchSpec, verdict: Verdict, result: RowOutcome,
                failures: list, steer_off: list, out_dir: Path, start: float) -> str:
    """Count one case of ``row`` into ``result``: its verdict against the ledger, its headroom, its case file when
    it is the row's first failure. Returns what the search does next: PASSED or KNOWN (go on), ADAPTER (the
    harness's own code failed: stop, no shrinking), FAILED (shrink it), POISONED (nothing more can run here)."""
    result.cases += 1
    poisoned = device == "cuda" and not verdict.ok and poisons_cuda_context(verdict.reason)
    if not verdict.ok and "adapter_error" in verdict.details:
        result.first_failure_seconds = time.perf_counter() - start
        result.case_file = failing_case(row, profile, device, spec, verdict).write(
            out_dir / "cases" / case_name(str(row.composition), row.property.name, row.mode.value, spec))
        failures.append((spec, verdict))
        result.context_poisoned = poisoned
        return ADAPTER
    known = None if verdict.ok else ledger.match(str(row.composition), row.mode.value, row.property.name,
                                                  spec, verdict, device)
    if verdict.ok or known is not None:
        note_taint(row, spec, device)
    if known is not None:  # triaged and reported: counted, and the search goes on for anything else
        result.known[known.id] = result.known.get(known.id, 0) + 1
        if poisoned or known.corrupts_process:  # ... unless it left the context (or memory) unusable
            result.context_poisoned = True
            return POISONED
        if known.steerable and known not in steer_off and not failures:
            steer_off.append(known)
        return KNOWN
    # A passing case near its bound that a ledger entry would explain had it failed is a known bug's mild
    # instance (SGLang Triton's e4m3 arithmetic passes at up to 0.99 of the bf16 bound), not a risk of the bound's
    explained = None
    if verdict.ok and near_miss(verdict.details.get("headroom")):
        entry = ledger.match(str(row.composition), row.mode.value, row.property.name, spec,
                             dataclasses.replace(verdict, ok=False), device)
        explained = None if entry is None else entry.id
    result.keep_worst(verdict, explained)
    if verdict.ok:
        return PASSED
    if result.first_failure_seconds is None:
        result.first_failure_seconds = time.perf_counter() - start
        result.case_file = failing_case(row, profile, device, spec, verdict).write(
            out_dir / "cases" / case_name(str(row.composition), row.property.name, row.mode.value, spec))
    failures.append((spec, verdict))
    if poisoned:  # no shrinking: every later case in this process would fail with the same error
        result.context_poisoned = True
        return POISONED
    return FAILED


def raise_for(outcome: str, verdict: Verdict) -> None:
    """End the Hypothesis test the way ``outcome`` (``record_case``'s) asks."""
    if outcome == ADAPTER:
        raise AdapterFailed
    if outcome == POISONED:
        raise ContextPoisoned
    if outcome == FAILED:
        raise PropertyFailed(verdict)


def settle(e: BaseException, row: Row, profile: Profile, device: str, result: RowOutcome, failures: list,
           out_dir: Path, start: float) -> bool:
    """Put the search's ending ``e`` (raised by Hypothesis's run of the row's test) into ``result``; re-raise what is
    not an ending of the search (Ctrl-C, a bug). Returns whether the search was stopped (Hypothesis's notes, written
    for a search that ran to its end, then mislead)."""
    if isinstance(e, SteeredOut):
        result.steered_out = True
        return True
    if isinstance(e, AdapterFailed):
        spec, verdict = failures[-1]
        result.ok, result.failure, result.spec, result.shrink_seconds = False, verdict, spec, 0.0
        result.finding_kind = ADAPTER_ERROR
        confirm_alone(result, device, out_dir)  # (a CUDA error under MPS only: may be another worker's fault)
        return True
    if isinstance(e, ContextPoisoned):
        if failures:  # the case that poisoned it, unshrunk (written when it failed)
            spec, verdict = failures[0]
            result.ok, result.failure, result.spec, result.shrink_seconds = False, verdict, spec, 0.0
            confirm_alone(result, device, out_dir)
        return True
    if isinstance(e, (PropertyFailed, ShrinkBudgetSpent)):
        spec, verdict = failures[-1]  # Hypothesis replays the shrunk example last
        result.ok, result.failure, result.spec = False, verdict, spec
        result.shrink_seconds = time.perf_counter() - start - result.first_failure_seconds
        first = result.case_file  # the first failing example's, written when it failed
        result.case_file = failing_case(row, profile, device, spec, verdict).write(
            out_dir / "cases" / case_name(str(row.composition), row.property.name, row.mode.value, spec))
        if first is not None and Path(first) != Path(result.case_file):
            Path(first).unlink(missing_ok=True)  # the shrunk case replaces it
        confirm_alone(result, device, out_dir)
        return isinstance(e, ShrinkBudgetSpent)
    if isinstance(e, Flaky):
        # The failing case passed when Hypothesis ran it again. A finding all the same: the engine may change state
        # after a failure (torch.compile falls back to eager for a frame whose compile failed: SGLang's
        # flex_attention on CUDA, 2026-11-26), so the first failure is the one reported, with its case file.
        result.ok = False
        if failures:
            spec, verdict = failures[0]
            result.spec, result.shrink_seconds = spec, 0.0
            result.failure = dataclasses.replace(verdict, reason=f"{verdict.reason} [failed once; passed when run "
                                                                 f"again in the same process]")
        else:
            result.failure = Verdict(row.property.name, False, "a case failed once and passed when run again")
        return False
    if isinstance(e, SpecError):
        # The strategy drew a batch its own specification refuses (before any engine code ran): the harness's error,
        # never the engine's (seen on an H200, 2026-11-27: a draft window drawn before a window crossing)
        result.ok = False
        result.failure = Verdict(row.property.name, False, f"harness error: the strategy drew a batch the "
                                                           f"specification refuses: {e}")
        result.finding_kind = ADAPTER_ERROR
        return False
    if isinstance(e, HypothesisException):
        # Hypothesis ends a search quietly when most draws are rejected (it stops at its limit of invalid draws); should
        # a release call that unsatisfiable instead, a row steered off everything it drew is done, not broken
        if not (isinstance(e, Unsatisfiable) and result.steered):
            result.ok = False
            result.failure = Verdict(row.property.name, False, f"search could not run: {type(e).__name__}: {e}")
        return False
    raise e


def search_row(row: Row, profile: Profile, device: str, *, database=None, max_examples: int | None = None,
               out_dir: Path = DEFAULT_OUT, seed: int | None = None, shrink_seconds: float | None = None,
               pending: Path | None = None) -> RowOutcome:
    """Search one row; ``seed`` fixes Hypothesis's random choices (a sweep gives each round its own).

    ``shrink_seconds`` bounds the time spent shrinking a failure (None: no limit; 0: no shrinking). The first
    failing example's case file is written at once, and replaced by the shrunk one when shrinking ends, so a
    run stopped while it shrinks still leaves its reproducer. Before each example its case is written to ``pending``
    (default ``OUT/pending/ROW.json``)."""
    result = RowOutcome(row.id, str(row.composition), row.mode.value, row.property.name)
    max_examples, shrink_seconds = row_budget(row, profile, device, max_examples, shrink_seconds)
    profile = row_profile(row.composition.support(), profile, device)
    pending = pending or out_dir / "pending" / f"{safe_name(row.id)}.json"
    failures: list[tuple[BatchSpec, Verdict]] = []
    steer_off: list = []  # ledger entries this row has met: later draws with what their bugs need are rejected
    steered_in_a_row = 0
    start = time.perf_counter()

    def shrink_time_spent() -> bool:
        return (shrink_seconds is not None and result.first_failure_seconds is not None
                and time.perf_counter() - start - result.first_failure_seconds > shrink_seconds)

    @hypothesis_settings(profile, database=database, max_examples=max_examples, shrink=shrink_seconds != 0)
    @given(row_strategy(row, profile))
    def probe(spec: BatchSpec) -> None:
        nonlocal steered_in_a_row
        if shrink_time_spent():
            raise ShrinkBudgetSpent
        if steered_off(spec, steer_off, failures, result, row.property.before):
            steered_in_a_row += 1
            if steered_in_a_row >= STEERED_OUT_DRAWS:
                raise SteeredOut
            reject()  # Hypothesis draws another
        steered_in_a_row = 0
        CaseFile(str(row.composition), row.property.name, spec, device, profile.name).write(pending)
        verdict = row.property.run(row.composition, spec, device)
        raise_for(record_case(row, profile, device, spec, verdict, result, failures, steer_off, out_dir, start),
                  verdict)

    # One database key per row, so replays of saved failures stay with their row.
    probe.hypothesis.inner_test._hypothesis_internal_add_digest = row.id.encode()
    if seed is not None:
        # Not ``hypothesis.seed(seed)``: it also sets ``database=None``, so a seeded search (every sweep round)
        # would neither save its failures nor replay saved ones. This attribute is what ``seed()`` sets for
        # generation; with the database left in place, saved failures of this row are replayed first
        # (Hypothesis's reuse phase), then the search goes on from the seed.
        probe._hypothesis_internal_use_seed = seed
    # Hypothesis's notes, held back: after a stop (the shrink budget, Ctrl-C) they would offer a @seed to
    # "reproduce this failure", which misleads.
    reported: list[str] = []
    stopped = ended = False
    try:
        with with_reporter(reported.append):
            probe()
        ended = True
    except BaseException as e:  # noqa: BLE001 - settle() re-raises what is not the search's own ending
        stopped = isinstance(e, KeyboardInterrupt)  # (Ctrl-C: the notes are not printed; a bug's are)
        stopped = settle(e, row, profile, device, result, failures, out_dir, start)
        ended = True
    finally:
        if not stopped:
            for line in reported:
                print(line)
        if ended or stopped:  # a bug's exception leaves the pending case behind: a supervisor names its row by it
            pending.unlink(missing_ok=True)
        result.seconds = time.perf_counter() - start
    return result
