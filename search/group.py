"""One batch, every composition: a batch drawn once, built once, its float64 reference computed once, and checked by
every row that could have drawn it.

Rows of one forward mode whose batches are drawn alike (the same layer kinds, dtype, profile and property options;
what they declare otherwise, page sizes, windows, caps, fp8, trees, verify algorithms, is merged:
``search.strategies.merge_options``) form a ``Group``. Its search draws from the merged strategy, and each row runs
the batches it could have drawn itself (``Group.admits``: its composition supports the batch, and its own options
allow it), up to its own number of examples. Generation and the reference, three fifths of a case's time on a GPU
(issue 26's profile), are paid once per batch instead of once per row.

A new failure is shrunk for its row alone: from then on each batch Hypothesis tries runs on that row only, and the
shrunk case is the row's reproducer, as ``search_row`` writes it. The group's search then goes on for its other rows
(a new Hypothesis run, its own database key). Known bugs, steering, adapter errors and a lost CUDA context are
judged per row exactly as ``search_row`` judges them (the same ``record_case``); a row's outcome is the same record.
``harness run``, sweeps and the benchmark search groups; ``harness mutants`` and the pytest matrix search row by row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import given
from hypothesis.reporting import with_reporter

from batch.spec import BatchSpec, ForwardMode
from engine.sharing import sharing
from properties.verdict import Verdict
from search.casefile import CaseFile, safe_name
from search.matrix import Row
from search.outcome import RowOutcome
from search.profiles import Profile, hypothesis_settings
from search.search_row import (ADAPTER, DEFAULT_OUT, FAILED, KNOWN, PASSED, POISONED, AdapterFailed, ContextPoisoned,
                               PropertyFailed, ShrinkBudgetSpent, raise_for, record_case, row_budget, row_options,
                               row_profile, search_row, settle, steered_off)
from search.strategies import MERGED_OPTIONS, batch_specs, drawable, merge_options

# Rows a group holds at most: a key's rows are cut into groups of this many, in matrix order. A group is searched in
# one process, round by round: the whole matrix's extend rows in one group (156 on an H100) held one worker for a
# whole 200 s sweep while it compiled every composition's kernels, and a round cut off by the budget counts nothing.
# A dozen rows share most of what sharing saves (generation and the reference cost 1/12 of a case each).
MAX_GROUP_ROWS = 12
# A group draws at most this many batches per example its hungriest row may run: a row that can take only a few
# of the merged draws (a narrow composition beside broad ones) gets fewer cases rather than holding the others up.
DRAWS_PER_EXAMPLE = 3


class GroupDone(BaseException):
    """Raised from the group's test once every row has run its examples: Hypothesis stops at once."""


@dataclass(frozen=True)
class Group:
    """Rows whose batches are drawn from one merged strategy."""

    rows: tuple[Row, ...]
    mode: ForwardMode
    kinds: frozenset[str]
    profile: Profile  # the rows' profile where they run (search_row.row_profile: the same for all)
    options: dict  # the merged options of batch_specs
    own: dict = field(default_factory=dict)  # row id -> its own options

    @property
    def id(self) -> str:
        """Stable while the group's rows are: its mode, size and a digest of its row ids."""
        digest = hashlib.sha256("\n".join(sorted(r.id for r in self.rows)).encode()).hexdigest()[:10]
        return f"group-{self.mode.value}-{len(self.rows)}-{digest}"

    @property
    def label(self) -> str:
        """For people: ``decode: torch_native, tbo(torch_native) +3 (12 rows)``."""
        comps = list(dict.fromkeys(str(r.composition) for r in self.rows))
        more = f" +{len(comps) - 3}" if len(comps) > 3 else ""
        rows = f" ({len(self.rows)} rows)" if len(self.rows) > 1 else f" {self.rows[0].property.name}"
        return f"{self.mode.value}: {', '.join(comps[:3])}{more}{rows}"

    def strategy(self):
        return batch_specs(self.profile, self.mode, self.kinds, **self.options)

    def view(self, row: Row, spec: BatchSpec) -> BatchSpec:
        """``spec`` as ``row`` runs it: without a graph replay's padded rows where its own strategy draws none."""
        if spec.graph_padding and not self.own[row.id].get("graph_padding"):
            return dataclasses.replace(spec, graph_padding=0)
        return spec

    def admits(self, row: Row, spec: BatchSpec) -> str | None:
        """Why ``row`` does not run ``spec`` (its composition cannot, or its own strategy could not have drawn it). A
        group of one row draws from that row's own strategy: everything it draws is the row's (a refuse_or_correct
        row's batches cross its composition's declared limits on purpose)."""
        if len(self.rows) == 1:
            return None
        return row.composition.unsupported_reason(spec) or drawable(spec, self.own[row.id], self.profile)


def _options(row: Row, profile: Profile) -> dict:
    """``row``'s own options, without those that shape no batch of its mode."""
    options = row_options(row, profile)
    if row.mode is not ForwardMode.DRAFT_EXTEND:
        options.pop("fixed_width", None)
    return options


def _key(row: Row, profile: Profile, device: str) -> tuple:
    """What rows must share to be drawn for together: everything but the options merge_options merges. A row whose
    check reads classes only (one example, not shrunk) and a row whose draws cross a declared limit on purpose
    (refuse_or_correct: its crossings lift its own options) are each a group of their own."""
    support = row.composition.support()
    options = _options(row, profile)
    if support.class_only or options.get("overreach"):
        return ("alone", row.id)
    common = tuple(sorted((k, repr(v)) for k, v in options.items() if k not in MERGED_OPTIONS))
    # Layer kinds stay apart: an MHA-only row beside an MHA and MLA one would take half the draws (measured: a
    # model's full-attention kind is one of them), a linear-only row beside a hybrid one hardly any
    return (row.mode, row.composition.attention_kinds(), row_profile(support, profile, device), common)


def group_rows(rows: list[Row], profile: Profile, device: str) -> list[Group]:
    """``rows`` in groups of at most MAX_GROUP_ROWS, in the order of each group's first row."""
    keyed: dict[tuple, list[Row]] = {}
    for row in rows:
        keyed.setdefault(_key(row, profile, device), []).append(row)
    groups = []
    chunks = [rows[i:i + MAX_GROUP_ROWS] for rows in keyed.values() for i in range(0, len(rows), MAX_GROUP_ROWS)]
    for members in chunks:
        own = {r.id: _options(r, profile) for r in members}
        first = members[0]
        groups.append(Group(tuple(members), first.mode, first.composition.attention_kinds(),
                            row_profile(first.composition.support(), profile, device),
                            merge_options(list(own.values())), own))
    return groups


@dataclass
class _Member:
    row: Row
    budget: int
    shrink_seconds: float | None
    result: RowOutcome
    failures: list = field(default_factory=list)
    steer_off: list = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    done: bool = False  # its search ended (a finding, an adapter error)

    @property
    def hungry(self) -> bool:
        return not self.done and self.result.cases < self.budget

    def shrink_time_spent(self) -> bool:
        r = self.result
        return (self.shrink_seconds is not None and r.first_failure_seconds is not None
                and time.perf_counter() - self.start - r.first_failure_seconds > self.shrink_seconds)


def search_group(group: Group, profile: Profile, device: str, *, database=None, max_examples: int | None = None,
                 out_dir: Path = DEFAULT_OUT, seed: int | None = None, shrink_seconds: float | None = None,
                 skip: frozenset[str] = frozenset(), on_done=None) -> list[RowOutcome]:
    """Search ``group``'s rows (but those in ``skip``) on shared batches; one outcome per row searched, in group order.

    ``max_examples`` (None: the profile's, fewer for a slow row: ``row_budget``) and ``shrink_seconds`` are each row's,
    as ``search_row`` takes them. Before each case, the case is written to ``pending/GROUP.json`` (a crash leaves it
    behind, naming the row that ran it). ``on_done(outcome)`` is called for each row as soon as its search is over (its
    examples run, or its finding shrunk), so a round cut off by a budget loses only the rows still searched; after a
    lost CUDA context, never for a row still short of its examples (a fresh process searches it). A group of one row
    is ``search_row``'s."""
    reported: set[str] = set()

    def done(result: RowOutcome) -> None:
        if on_done is not None and result.row_id not in reported:
            reported.add(result.row_id)
            on_done(result)

    rows = [r for r in group.rows if r.id not in skip]
    pending = out_dir / "pending" / f"{safe_name(group.id)}.json"
    if len(rows) == 1:
        result = search_row(rows[0], profile, device, database=database, max_examples=max_examples, out_dir=out_dir,
                            seed=seed, shrink_seconds=shrink_seconds, pending=pending)
        done(result)
        return [result]
    members = []
    for row in rows:
        budget, shrink = row_budget(row, profile, device, max_examples, shrink_seconds)
        members.append(_Member(row, budget or profile.max_examples, shrink,
                               RowOutcome(row.id, str(row.composition), row.mode.value, row.property.name)))
    draw_cap = DRAWS_PER_EXAMPLE * max(m.budget for m in members)
    draws, attempt = 0, 0
    # An exception out of here (the harness's own bug) leaves the pending case behind: it names the row that was
    # running, which a sweep's supervisor makes the finding's
    try:
        with sharing():
            while draws < draw_cap and any(m.hungry for m in members):
                ended, drawn = _attempt(group, members, profile, device, database, out_dir, pending, seed,
                                        attempt, draw_cap - draws, skip, done)
                draws += drawn
                attempt += 1
                if ended:
                    break
    except KeyboardInterrupt:
        pending.unlink(missing_ok=True)  # a stopped search's case, not a finding
        raise
    pending.unlink(missing_ok=True)
    for m in members:
        if any(other.result.cuda_context_lost for other in members):
            # Nothing more runs in this process: the rows still short of their examples are not over (on_done is not
            # called for them), and a fresh process searches them again
            break
        if m.hungry:
            # The merged draws rarely fit this row (a narrow composition beside broad ones): the examples it still
            # lacks are searched on its own strategy
            m.result.absorb(search_row(m.row, profile, device, database=database, out_dir=out_dir,
                                       max_examples=m.budget - m.result.cases, shrink_seconds=m.shrink_seconds,
                                       seed=None if seed is None else seed + len(group.rows) + attempt,
                                       pending=pending))
        done(m.result)
    return [m.result for m in members]


def _attempt(group: Group, members: list[_Member], profile: Profile, device: str, database, out_dir: Path,
             pending: Path, seed: int | None, attempt: int, draws_left: int,
             skip: frozenset[str], done) -> tuple[bool, int]:
    """One Hypothesis run over the group's hungry rows, until a row's new failure is shrunk, every row has its
    examples, or ``draws_left`` batches are drawn. Returns (whether the whole search is over, batches drawn)."""
    target: list[_Member] = []  # the row whose failure is being shrunk
    drawn = 0

    def run(m: _Member, spec: BatchSpec) -> tuple[str, Verdict]:
        spec = group.view(m.row, spec)
        CaseFile(str(m.row.composition), m.row.property.name, spec, device, group.profile.name).write(pending)
        started = time.perf_counter()
        verdict = m.row.property.run(m.row.composition, spec, device)
        outcome = record_case(m.row, group.profile, device, spec, verdict, m.result, m.failures, m.steer_off,
                              out_dir, m.start)
        m.result.seconds += time.perf_counter() - started
        if outcome in (PASSED, KNOWN) and not target and not m.hungry:
            done(m.result)  # its examples run: this round is over for it
        return outcome, verdict

    @hypothesis_settings(profile, database=database, max_examples=draws_left,
                         shrink=any(m.shrink_seconds != 0 for m in members))
    @given(group.strategy())
    def probe(spec: BatchSpec) -> None:
        nonlocal drawn
        # Every ending is raised from one place (raise_for): Hypothesis tells failures apart by where they were raised,
        # and a replay raising elsewhere than the failure it replays reads as flaky
        if target:  # shrinking one row's failure: the other rows are not run
            m = target[0]
            if m.shrink_time_spent():
                raise ShrinkBudgetSpent
            if group.admits(m.row, spec) is None:
                raise_for(*run(m, spec))
            return
        drawn += 1
        for m in members:
            if not m.hungry:
                continue
            if group.admits(m.row, spec) is not None:
                continue
            if steered_off(spec, m.steer_off, m.failures, m.result, m.row.property.before):
                continue
            outcome, verdict = run(m, spec)
            if outcome == ADAPTER and not m.result.context_poisoned:
                # The harness's own code: this row stops, unshrunk; the others go on (in a usable process)
                settle(AdapterFailed(), m.row, group.profile, device, m.result, m.failures, out_dir, m.start)
                m.done = True
                done(m.result)
            elif outcome == FAILED and m.shrink_seconds == 0:  # reported as found
                settle(PropertyFailed(verdict), m.row, group.profile, device, m.result, m.failures, out_dir, m.start)
                m.done = True
                done(m.result)
            elif outcome in (ADAPTER, POISONED, FAILED):
                target.append(m)
                raise_for(outcome, verdict)
        if not any(m.hungry for m in members):
            raise GroupDone

    # One database key per group and set of rows left, so a saved failure is replayed where its row is searched again
    # (a row with a finding leaves the group's later runs: their key differs, and their saved failures stay theirs)
    left = sorted(m.row.id for m in members if m.done) + sorted(skip)
    key = group.id + ("" if not left else "-without-" + hashlib.sha256("\n".join(left).encode()).hexdigest()[:10])
    probe.hypothesis.inner_test._hypothesis_internal_add_digest = key.encode()
    if seed is not None:  # as search_row: generation seeded, the database left in place
        probe._hypothesis_internal_use_seed = seed + attempt
    try:
        # Hypothesis's notes are not printed: they name the merged draw, and the row's case file is the reproducer
        with with_reporter(lambda _note: None):
            probe()
    except GroupDone:
        return True, drawn
    except BaseException as e:  # noqa: BLE001 - settle() re-raises what is not the search's own ending
        if isinstance(e, ContextPoisoned):  # nothing more runs in this process
            m = target[0]
            settle(e, m.row, group.profile, device, m.result, m.failures, out_dir, m.start)
            m.done = True
            done(m.result)
            return True, drawn
        if target:
            m = target[0]
            settle(e, m.row, group.profile, device, m.result, m.failures, out_dir, m.start)
            m.done = True
            done(m.result)
            return m.result.cuda_context_lost, drawn  # (an adapter error's CUDA error: nothing more runs here)
        for m in members:  # the group's strategy or Hypothesis itself: every row searched here ends the same way
            if m.hungry:
                settle(e, m.row, group.profile, device, m.result, m.failures, out_dir, m.start)
                m.done = True
        return True, drawn
    return True, drawn  # every batch it could draw was drawn
