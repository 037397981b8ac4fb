"""One batch, every composition (search/group.py): rows drawn for together, each running only what its own strategy
could have drawn; a failure shrunk for its row alone; every row's examples kept; the reference computed once a batch."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import seed as with_seed

from harness.mutants.catalogue import MUTANTS
from engine.sharing import sharing
from properties import run as run_module
from properties.verdict import Verdict
from search.casefile import CaseFile
from search.group import Group, group_rows, search_group
from search.matrix import matrix_rows
from search.profiles import PROFILES
from search.search_row import row_options, row_strategy
from search.strategies import drawable, merge_options
from tests.stand_ins import StandInProperty

# Planning over the CPU rows (interpreted Triton, SGLang) on whatever host runs the tests (conftest.py)
pytestmark = pytest.mark.usefixtures("cpu_rows_listed")

PROFILE = PROFILES["ci"]


def draws(strategy, n: int, seed: int = 0) -> list:
    out = []

    @with_seed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(spec) -> None:
        out.append(spec)

    collect()
    return out


def cpu_rows(backends, modes, properties=None):
    return matrix_rows("cpu", PROFILE, backends, properties, modes)[0]


@pytest.mark.parametrize("profile", ["ci", "dev"])
@pytest.mark.parametrize("mode", ["extend", "decode", "target_verify", "draft_decode", "draft_extend"])
def test_a_row_could_draw_every_batch_its_own_strategy_draws(mode, profile):
    """``drawable`` is the strategy's own options read back: it must never refuse what batch_specs drew with them."""
    profile = PROFILES[profile]
    rows = matrix_rows("cpu", profile, ["sglang.torch_native", "torch_native", "graph(triton)", "linear_torch"],
                       ["outputs"], [mode])[0]
    for row in rows:
        for spec in draws(row_strategy(row, profile), 25):
            assert drawable(spec, row_options(row, profile), profile) is None, (row.id, spec)


def test_a_row_runs_no_prefix_longer_than_its_own_strategy_draws():
    """Kernel boundaries are drawn past the profile's prefixes (up to max_boundary): another row's boundaries in the
    merged strategy must not hand a row prefixes its own strategy never draws (found by review: 63-65 cached tokens
    for sglang.torch_native, whose own strategy stops at 41 under the ci profile)."""
    (group,) = group_rows(cpu_rows(["sglang.triton", "sglang.torch_native"], ["decode"], ["outputs"]), PROFILE, "cpu")
    narrow = next(r for r in group.rows if str(r.composition) == "sglang.torch_native")
    assert not group.own[narrow.id]["boundaries"] and group.options["boundaries"]  # SGLang Triton's, merged in
    taken = [s for s in draws(group.strategy(), 300) if group.admits(narrow, s) is None]
    # Without kernel boundaries of its own, a row's prefixes end at the profile's (a page boundary: one more), or at
    # its first page's end (page size + 1)
    small_pages = [s for s in taken if s.page_size + 1 <= PROFILE.max_prefix]
    assert small_pages and all(max(s.prefix_lens) <= PROFILE.max_prefix + 1 for s in small_pages)


def test_options_that_shape_batches_alike_must_be_equal_to_merge():
    assert merge_options([{"sliding_window": False, "page_sizes": (1,)}, {"sliding_window": True,
                                                                          "page_sizes": (16,)}]) == \
        {"sliding_window": True, "page_sizes": (1, 16)}
    assert merge_options([{"chain": True}, {"chain": False}]) == {"chain": False}
    with pytest.raises(ValueError, match="dtype"):
        merge_options([{"dtype": "float32"}, {"dtype": "bfloat16"}])


def test_a_merged_list_keeps_the_first_rows_order():
    """A list option's first entry is where Hypothesis starts and shrinks to: the profile's first head configuration
    (GQA with two KV heads) shows a head-mapping bug that one KV head hides. Merged in sorted order, a group of
    torch_native and TBO over it started from one KV head, and `harness run` met the gqa_modulo_mapping mutant in 2
    runs of 12 (seeds 0-11, 4 examples a row), where each row searched alone met it in 12."""
    heads = ((4, 2), (4, 1), (4, 4))
    assert merge_options([{"head_configs": heads}, {"head_configs": heads}])["head_configs"] == heads
    assert merge_options([{"head_configs": ((8, 2),)}, {"head_configs": heads}])["head_configs"] == ((8, 2), *heads)
    assert merge_options([{"page_sizes": (16, 1)}, {"page_sizes": (1, 4)}])["page_sizes"] == (16, 1, 4)
    (group,) = group_rows(cpu_rows(["torch_native"], ["decode"], ["outputs"]), PROFILE, "cpu")
    # The simplest draw with an MHA layer: where Hypothesis starts, and what it shrinks to
    first = find(group.strategy(), lambda s: any(l.kind == "mha" for l in s.layers))
    mha = next(l for l in first.layers if l.kind == "mha")
    assert (mha.num_q_heads, mha.num_kv_heads) == PROFILE.heads[0][:2]


def test_a_row_runs_only_merged_draws_it_could_have_drawn():
    """sglang.torch_native declares no logit cap and no KV scales (known bugs); SGLang's Triton takes both: in one
    group, the narrow row never runs a batch with either, and every batch it runs is one it could have drawn."""
    groups = group_rows(cpu_rows(["sglang.triton", "sglang.torch_native"], ["decode"], ["outputs"]), PROFILE, "cpu")
    (group,) = groups
    narrow = next(r for r in group.rows if str(r.composition) == "sglang.torch_native")
    broad = next(r for r in group.rows if str(r.composition) == "sglang.triton")
    specs = draws(group.strategy(), 60)
    taken = [s for s in specs if group.admits(narrow, s) is None]
    assert 0 < len(taken) < len(specs)
    assert all(group.admits(broad, s) is None for s in specs)
    for s in taken:
        assert all(l.logit_cap is None and l.k_scale == l.v_scale == 1.0 for l in s.layers if l.kind == "mha")
        assert narrow.composition.unsupported_reason(s) is None


def test_groups_keep_apart_what_cannot_share_a_batch():
    rows = cpu_rows(["torch_native", "sglang.torch_native", "linear_torch", "hybrid(torch_native,linear_torch)"],
                    ["extend", "decode"])
    groups = group_rows(rows, PROFILE, "cpu")
    assert sorted(r.id for g in groups for r in g.rows) == sorted(r.id for r in rows)  # every row once
    for g in groups:
        assert len({r.mode for r in g.rows}) == 1
        assert len({r.composition.attention_kinds() for r in g.rows}) == 1
        if len(g.rows) > 1:  # class-only checks and deliberate crossings are searched alone
            assert not any(r.composition.support().class_only for r in g.rows)
            assert not any(row_options(r, PROFILE).get("overreach") for r in g.rows)
    assert any(len(g.rows) > 5 for g in groups)


@dataclasses.dataclass(frozen=True)
class Counting(StandInProperty):
    """Passes; records every batch it is given."""

    def run(self, composition, spec, device) -> Verdict:
        self.seen.append((str(composition), spec))
        return Verdict(self.name, True, "ok", 0.0, 1e-3)


def stand_in_group(props: dict) -> Group:
    """The decode group of SGLang's Triton and torch_native, each row's property replaced by ``props[comp]``."""
    rows = [dataclasses.replace(r, property=props[str(r.composition)])
            for r in cpu_rows(["sglang.triton", "sglang.torch_native"], ["decode"], ["outputs"])
            if str(r.composition) in props]
    (group,) = group_rows(rows, PROFILE, "cpu")
    return group


def test_every_row_gets_its_examples_even_where_the_merged_draws_rarely_fit(tmp_path):
    broad, narrow = Counting(), Counting()
    group = stand_in_group({"sglang.triton": broad, "sglang.torch_native": narrow})
    outcomes = search_group(group, PROFILE, "cpu", max_examples=12, out_dir=tmp_path, seed=5)
    assert [o.cases for o in outcomes] == [12, 12] and all(o.ok for o in outcomes)
    shared = {spec for _, spec in broad.seen} & {spec for _, spec in narrow.seen}
    assert shared, "no batch was checked by both rows"
    row = next(r for r in group.rows if str(r.composition) == "sglang.torch_native")
    assert all(row.composition.unsupported_reason(spec) is None for _, spec in narrow.seen)


@dataclasses.dataclass(frozen=True)
class WrongFromTwoRequests(StandInProperty):
    def run(self, composition, spec, device) -> Verdict:
        self.seen.append(spec)
        ok = spec.batch_size < 2
        return Verdict(self.name, ok, "ok" if ok else "out of bounds", 1.0, 1e-3, "layer 0: request 1, token 0")


@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_a_failure_found_in_a_group_is_shrunk_not_reported_as_flaky(tmp_path, seed):
    """Hypothesis tells failures apart by where they are raised: a shrink replay raising elsewhere than the failure it
    replays read as flaky, and the failure came back unshrunk (found by review)."""
    group = stand_in_group({"sglang.triton": WrongFromTwoRequests(), "sglang.torch_native": Counting()})
    outcomes = {o.composition: o for o in search_group(group, PROFILE, "cpu", max_examples=25, out_dir=tmp_path,
                                                         seed=seed)}
    failed = outcomes["sglang.triton"]
    assert not failed.ok and "failed once" not in str(failed.failure), failed.failure
    assert failed.spec.batch_size == 2


@dataclasses.dataclass(frozen=True)
class LosesTheContext(StandInProperty):
    """Fails with a sticky CUDA error from two requests on: an engine's (or, ``adapter``, the harness's own); says so
    in ``tells`` (what another row's stand-in reads)."""

    adapter: bool = False
    tells: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def run(self, composition, spec, device) -> Verdict:
        if spec.batch_size < 2:
            return Verdict(self.name, True, "ok", 0.0, 1e-3)
        self.tells.append(True)
        details = {"adapter_error": "RuntimeError", "traceback": ""} if self.adapter else {}
        return Verdict(self.name, False, "crashed: CUDA error: an illegal memory access was encountered",
                       details=details)


@dataclasses.dataclass(frozen=True)
class FailsOnceTheContextIsLost(StandInProperty):
    """Passes until another row lost the CUDA context (``lost``), then fails as every later case would."""

    lost: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def run(self, composition, spec, device) -> Verdict:
        self.seen.append(spec)
        if self.lost:
            return Verdict(self.name, False, "crashed: CUDA error: an illegal memory access was encountered")
        return Verdict(self.name, True, "ok", 0.0, 1e-3)


@pytest.mark.parametrize("adapter", [False, True])
def test_a_lost_cuda_context_ends_the_group_and_no_other_row_is_blamed(tmp_path, adapter):
    """A case that leaves a sticky CUDA error (the engine's, or the harness's own) ends the group: no other row runs in
    the dead context (it would fail with the same error, a false finding), and a row short of its examples is not
    reported as done (a fresh process searches it)."""
    other = FailsOnceTheContextIsLost()
    sticky = LosesTheContext(adapter=adapter, tells=other.lost)
    group = stand_in_group({"sglang.triton": sticky, "sglang.torch_native": other})
    reported = []
    outcomes = {o.composition: o for o in search_group(group, PROFILE, "cuda", max_examples=12, out_dir=tmp_path,
                                                         seed=3, on_done=reported.append)}
    lost, bystander = outcomes["sglang.triton"], outcomes["sglang.torch_native"]
    assert not lost.ok and lost.cuda_context_lost
    assert lost.finding_kind == ("adapter_error" if adapter else None)
    assert bystander.ok, bystander.failure  # never ran after the context was lost
    # the bystander's round is over only if it had all its examples before the context was lost
    assert [o.row_id for o in reported if o is not lost] == ([bystander.row_id] if bystander.cases >= 12 else [])
    assert lost in reported


def test_a_failure_is_shrunk_for_its_row_alone_and_the_others_go_on(tmp_path):
    wrong, fine = WrongFromTwoRequests(), Counting()
    group = stand_in_group({"sglang.triton": wrong, "sglang.torch_native": fine})
    reported = []
    outcomes = {o.composition: o for o in search_group(group, PROFILE, "cpu", max_examples=15, out_dir=tmp_path,
                                                         seed=2, on_done=reported.append)}
    assert sorted(map(id, reported)) == sorted(map(id, outcomes.values()))  # each row once, as soon as it is over
    failed = outcomes["sglang.triton"]
    assert not failed.ok and failed.spec.batch_size == 2  # shrunk to the smallest failing batch
    case = CaseFile.read(failed.case_file)
    assert case.composition == "sglang.triton" and case.spec == failed.spec
    assert outcomes["sglang.torch_native"].ok and outcomes["sglang.torch_native"].cases == 15
    assert list((tmp_path / "cases").iterdir()) == [failed.case_file]  # the first failing case replaced by the shrunk
    assert not list((tmp_path / "pending").glob("*.json"))


@dataclasses.dataclass(frozen=True)
class ReadingPending(StandInProperty):
    """Passes; records the composition the group's pending case file names while it runs."""

    folder: object = None

    def run(self, composition, spec, device) -> Verdict:
        (pending,) = (self.folder / "pending").glob("*.json")
        self.seen.append((str(composition), json.loads(pending.read_text())["composition"]))
        return Verdict(self.name, True, "ok", 0.0, 1e-3)


def test_the_pending_case_names_the_row_running_it(tmp_path):
    """A crash leaves the pending case behind: it must name the row that was running, whichever of the group's."""
    group = stand_in_group({"sglang.triton": ReadingPending(folder=tmp_path),
                            "sglang.torch_native": ReadingPending(folder=tmp_path)})
    search_group(group, PROFILE, "cpu", max_examples=12, out_dir=tmp_path, seed=1)
    seen = [x for r in group.rows for x in r.property.seen]
    assert {running for running, _ in seen} == {"sglang.triton", "sglang.torch_native"}
    assert all(running == named for running, named in seen), seen
    assert not list((tmp_path / "pending").glob("*.json"))


def test_a_batch_reference_is_computed_once_and_the_verdicts_are_the_rows_own(tmp_path, monkeypatch):
    """The real properties on one group: the reference once per batch, and each row's outcome its own (a fault in
    torch_native's GQA mapping: the outputs rows fail, the metadata rows, which do not see it, pass)."""
    rows = cpu_rows(["torch_native", "tbo(torch_native)"], ["decode"], ["outputs", "metadata"])
    (group,) = group_rows(rows, PROFILE, "cpu")
    computed = []
    original = run_module.reference_outputs
    monkeypatch.setattr(run_module, "reference_outputs", lambda case: computed.append(case.spec) or original(case))
    with MUTANTS["gqa_modulo_mapping"].patch():
        outcomes = search_group(group, PROFILE, "cpu", max_examples=4, out_dir=tmp_path, seed=11, shrink_seconds=0)
    by_row = {o.row_id: o for o in outcomes}
    for row_id, o in by_row.items():
        assert o.ok == row_id.endswith("-metadata"), (row_id, o.summary())
        if not o.ok:
            case = CaseFile.read(o.case_file)
            assert row_id.startswith(case.composition + "-") and case.property == o.property
    assert len(computed) == len(set(computed)), "a batch's reference computed twice"


def test_a_shared_batch_is_handed_out_as_copies_equal_to_a_build(monkeypatch):
    """On a GPU a group's batch is built once and copied for each run (a copy cost a third of a build on an H100):
    each copy must equal a fresh build, tensor for tensor, and own its tensors (a run writes into its pools)."""
    import torch

    from engine import materialize as materializing

    monkeypatch.setattr(materializing, "COPIED_ON", ("cpu",))
    row = cpu_rows(["torch_native"], ["decode"], ["outputs"])[0]
    spec = draws(row_strategy(row, PROFILE), 3, seed=4)[-1]
    fresh = materializing.materialize(spec, "cpu")
    built = []
    real_build = materializing._build
    monkeypatch.setattr(materializing, "_build", lambda *a: built.append(a) or real_build(*a))
    with sharing():
        first, second = materializing.materialize(spec, "cpu"), materializing.materialize(spec, "cpu")
    assert len(built) == 1
    for copy_ in (first, second):
        for name in ("k_buffers", "v_buffers"):
            for layer, buf in getattr(fresh.forward_batch.token_to_kv_pool, name).items():
                if buf is not None:
                    assert torch.equal(getattr(copy_.forward_batch.token_to_kv_pool, name)[layer], buf)
        assert torch.equal(copy_.forward_batch.out_cache_loc, fresh.forward_batch.out_cache_loc)
    layer = next(iter(first.forward_batch.token_to_kv_pool.k_buffers))
    first.forward_batch.token_to_kv_pool.k_buffers[layer].view(torch.uint8).bitwise_not_()  # any dtype, fp8 too
    assert torch.equal(second.forward_batch.token_to_kv_pool.k_buffers[layer], fresh.forward_batch.token_to_kv_pool.k_buffers[layer])


def test_a_context_lost_while_a_row_is_searched_alone_ends_the_group(tmp_path, monkeypatch):
    """A row the merged draws did not fill is searched alone at the end; if that loses the CUDA context, the rows
    after it do not run in the dead process (found by review: the next row failed with the same error)."""
    from search import group as group_module

    monkeypatch.setattr(group_module, "DRAWS_PER_EXAMPLE", 0)  # no shared draws: every row is searched alone
    other = FailsOnceTheContextIsLost()
    sticky = LosesTheContext(tells=other.lost)
    group = stand_in_group({"sglang.torch_native": sticky, "sglang.triton": other})
    assert str(group.rows[0].composition) == "sglang.torch_native"  # searched first
    reported = []
    outcomes = {o.composition: o for o in search_group(group, PROFILE, "cuda", max_examples=12, out_dir=tmp_path,
                                                         seed=3, on_done=reported.append)}
    assert outcomes["sglang.torch_native"].cuda_context_lost
    assert outcomes["sglang.triton"].ok and not other.seen
    assert [o.composition for o in reported] == ["sglang.torch_native"]


@dataclasses.dataclass(frozen=True)
class Broken(StandInProperty):
    """The harness's own bug: raises."""

    def run(self, composition, spec, device) -> Verdict:
        raise TypeError("a bug in the harness")


@pytest.mark.parametrize("rows", [1, 2])
def test_a_bug_that_escapes_leaves_the_pending_case_naming_its_row(tmp_path, rows):
    """An exception out of a group's search (one row: search_row's) leaves the pending case behind, so a sweep's
    supervisor blames the row that was running (found by review: a one-row round deleted it)."""
    group = stand_in_group({"sglang.triton": Broken(), "sglang.torch_native": Counting()})
    skip = frozenset() if rows == 2 else frozenset(r.id for r in group.rows if "torch_native" in r.id)
    with pytest.raises(TypeError):
        search_group(group, PROFILE, "cpu", max_examples=3, out_dir=tmp_path, seed=1, skip=skip)
    (pending,) = (tmp_path / "pending").glob("*.json")
    assert json.loads(pending.read_text())["composition"] == "sglang.triton"


def test_the_harness_own_rows_are_a_control_sample_where_the_profile_says():
    """Issue 26: a run's examples go to the engine's compositions; rows of the harness's own backends get the
    profile's control_examples (the gpu profile: 5 of 20), a --max-examples given wins."""
    from search.search_row import row_budget

    profile = dataclasses.replace(PROFILE, max_examples=20, control_examples=5)
    rows = matrix_rows("cpu", profile, ["torch_native", "sglang.torch_native"], ["outputs"], ["decode"])[0]
    own = next(r for r in rows if str(r.composition) == "torch_native")
    assert row_budget(own, profile, "cpu", None, 10.0) == (5, 10.0)
    assert row_budget(own, profile, "cpu", 12, 10.0) == (12, 10.0)
    assert row_budget(own, PROFILE, "cpu", None, 10.0) == (None, 10.0)  # ci: none set
    assert PROFILES["gpu"].control_examples == 5
    engine = [r for r in rows if r.composition.engine == "sglang"]
    if not engine:
        pytest.skip("SGLang is not installed: an engine row's budget is not checked")
    assert row_budget(engine[0], profile, "cpu", None, 10.0) == (None, 10.0)


def test_a_failure_after_a_corrupting_bugs_batches_is_replayed_alone_before_it_is_reported(tmp_path, monkeypatch):
    # On CUDA, sglang-tbo-linear-child-start-loc-cuda-writes's GDN kernels write past a plainly cut half's tensors
    # whether or not the property that ran them fails; a later failure in the same process may be theirs (an H200's
    # TBO-over-GDN metadata failure passed alone, harness-out/gpu95.sh). Such a failure is replayed in a fresh process:
    # passing there, it is counted under that entry and the process is marked suspect; failing there, it is a finding.
    from types import SimpleNamespace

    from batch.spec import BatchSpec, ForwardMode, LinearLayer, MHALayer
    from search import search_row as sr
    from search.outcome import RowOutcome

    monkeypatch.setattr(sr, "TAINTED", {})
    layers = (MHALayer(0, 4, 2, 32, 32), LinearLayer(1, 2, 4, 16, 16))
    plain = BatchSpec(ForwardMode.EXTEND, (0, 0, 0), (40, 3, 41), layers)  # cut between requests, not rebased
    whole = BatchSpec(ForwardMode.EXTEND, (0,), (80,), layers)  # one request: a two-chunk cut, nothing stray
    row = SimpleNamespace(composition="tbo(hybrid(sglang.triton,sglang.gdn))", mode=ForwardMode.EXTEND)
    # a judged batch taints (record_case counts those that passed or failed as the ledger explains, never a failing
    # one for itself)
    sr.note_taint(row, whole, "cuda")
    sr.note_taint(row, plain, "cpu")  # the interpreter stops at the first out-of-bounds access: nothing stray
    assert sr.TAINTED == {}
    sr.note_taint(row, plain, "cuda")
    assert sr.TAINTED == {"sglang-tbo-linear-child-start-loc-cuda-writes": 1}

    def failed() -> RowOutcome:
        case = tmp_path / "cases" / "row.json"
        case.parent.mkdir(exist_ok=True)
        case.write_text("{}")
        return RowOutcome("row", row.composition, "mixed", "metadata", ok=False, case_file=case,
                          failure=Verdict("metadata", False, "kv_indices hold [1], expected its pages [0]"))

    result = failed()
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 1)  # fails alone too: a finding
    assert not result.ok and result.case_file is not None and not result.passed_alone
    replays = iter([0, 1])  # where stray writes land depends on the layout: every replay must pass
    result = failed()
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: next(replays))
    assert not result.ok and not result.passed_alone
    result = failed()
    sr.confirm_alone(result, "cuda", tmp_path, replay=lambda case: 0)
    assert result.ok and result.context_poisoned and result.case_file is None
    assert result.passed_alone == {"sglang-tbo-linear-child-start-loc-cuda-writes": 1}
    kept = tmp_path / "passed-alone" / "row.json"
    assert kept.is_file()  # kept, not lost, with what failed
    assert result.passed_alone_cases == [{"entry": "sglang-tbo-linear-child-start-loc-cuda-writes", "case": str(kept),
                                          "reason": "metadata: FAILED: kv_indices hold [1], expected its pages [0]"}]
    assert "passed alone in a fresh process after batches of sglang-tbo-linear" in result.summary()
    result = failed()
    sr.confirm_alone(result, "cpu", tmp_path, replay=lambda case: 0)  # no stray writes there: never replayed away
    assert not result.ok
