"""An error in the harness's own code is never reported as the engine's bug: a crash is the engine's when its
innermost frame of either side is the engine's package, the adapter's when it is the project's."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from batch.spec import BatchSpec, ForwardMode, MHALayer
from properties import Property
from properties.blame import adapter_frame
from search.outcome import exit_status

ENGINE = SimpleNamespace(engine="fakeengine")  # what adapter_frame reads of a composition
HARNESS = SimpleNamespace(engine="harness")


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    package = tmp_path / "fakeengine"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import torch\n\ndef boom():\n    torch.zeros(2)[5]  # an IndexError raised inside torch, called from here\n\n"
        "def calls(fn):\n    return fn()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fakeengine", raising=False)
    import fakeengine

    return fakeengine


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


def _project_fails():
    from backends.sglang.runtime import _one_shape

    _one_shape([MHALayer(0, 4, 2, 16, 16), MHALayer(1, 8, 2, 16, 16)])  # a shape SGLang cannot build: ValueError


def test_a_crash_in_the_engine_is_the_engines_even_below_torch(fake_engine):
    assert adapter_frame(_raised(fake_engine.boom), ENGINE) is None


def test_a_crash_in_the_harness_around_the_engine_is_an_adapter_error(fake_engine):
    where = adapter_frame(_raised(_project_fails), ENGINE)
    assert where is not None and where.startswith("backends/sglang/runtime.py:") and where.endswith("in _one_shape")
    # the engine calling back into the harness, which fails: the harness's
    assert adapter_frame(_raised(lambda: fake_engine.calls(_project_fails)), ENGINE).endswith("in _one_shape")
    # the harness's own compositions: every crash is a finding of the backend under test
    assert adapter_frame(_raised(_project_fails), HARNESS) is None


def test_the_interpreters_launch_wrapper_is_neither_sides(fake_engine, monkeypatch):
    """backends/interpreter.py wraps Triton's interpreted launch (skip_repatching_in_device_calls): an engine kernel
    that reads out of bounds raises through it as through Triton's own frames, and stays the engine's finding (the
    wrapper's frame made four short_conv rows' known out-of-bounds read an adapter error)."""
    from backends import interpreter

    # a wrapper frame of that file between the engine's call and the library frame that raised (this test's own
    # frames are neither side's, as Triton's are)
    launch = compile("def launch(fn):\n    return fn()\n", interpreter.__file__, "exec")
    scope = {}
    exec(launch, scope)
    kernel = lambda: torch.zeros(2)[5]  # noqa: E731 - the interpreter's bounds check, raising
    assert adapter_frame(_raised(lambda: fake_engine.calls(lambda: scope["launch"](kernel))), ENGINE) is None
    # raised in the wrapper itself: the harness's bug, an adapter error
    broken = compile("def launch(fn):\n    raise TypeError('a bug in the wrapper')\n", interpreter.__file__, "exec")
    exec(broken, scope)
    where = adapter_frame(_raised(lambda: fake_engine.calls(lambda: scope["launch"](kernel))), ENGINE)
    assert where is not None and where.startswith("backends/interpreter.py:"), where


def test_the_engine_reading_what_the_adapters_stand_in_lacks_is_an_adapter_error(fake_engine):
    # The engine's frame raises, but the object it reads is one the harness built in place of the engine's (a model
    # runner, a model config): the stand-in is incomplete, the harness's to mend. An object of the engine's own, or
    # of a library's, lacking an attribute stays the engine's.
    from backends.sglang import runtime

    runner = runtime._ModelConfig.__new__(runtime._ModelConfig)  # any class of the adapter's modules
    where = adapter_frame(_raised(lambda: fake_engine.calls(lambda: runner.attn_cp_size)), ENGINE)
    assert where is not None and "lacks 'attn_cp_size'" in where and "_ModelConfig" in where
    assert adapter_frame(_raised(lambda: fake_engine.calls(lambda: SimpleNamespace().ps)), ENGINE) is None


def test_an_adapter_error_is_its_own_verdict_and_exit_status(fake_engine):
    spec = BatchSpec(ForwardMode.EXTEND, (0,), (1,), (MHALayer(0, 4, 2, 16, 16),))
    adapter = Property("outputs", lambda c, s, d: _project_fails(), "test").run(ENGINE, spec, "cpu")
    assert not adapter.ok and adapter.reason.startswith("adapter error at backends/sglang/runtime.py:")
    assert "adapter_error" in adapter.details
    engine = Property("outputs", lambda c, s, d: fake_engine.boom(), "test").run(ENGINE, spec, "cpu")
    assert not engine.ok and "adapter_error" not in engine.details and engine.reason.startswith("crashed: IndexError")
    assert "in boom: `torch.zeros(2)[5]" in engine.reason  # what failed, not only where: the ledger matches that
    assert exit_status([]) == 0 and exit_status(["adapter_error"]) == 3
    assert exit_status(["adapter_error", "failure"]) == 1 and exit_status(["crash"]) == 1


@pytest.mark.skipif(__import__("backends.sglang.runtime", fromlist=["x"]).unavailable_reason() is not None,
                    reason="needs the SGLang extra (bash ci/install-sglang.sh)")
def test_dispatch_reports_its_own_crash_as_an_adapter_error_not_a_misroute(monkeypatch, fake_engine):
    # dispatch catches a crash of the run to say where layers went; one in the harness's own code must still reach
    # Property.run as an adapter error, while one in the engine's stays a failed dispatch
    import importlib
    from pathlib import Path

    from backends.registry import parse
    from batch.spec import LightningLayer
    from properties import PROPERTIES
    conformance = importlib.import_module("properties.conformance")  # the module (the package exports a function)

    spec = BatchSpec(ForwardMode.EXTEND, (0,), (2,), (MHALayer(0, 4, 2, 32, 32), LightningLayer(1, 2, 128)),
                     dtype="float32")
    composition = parse("hybrid(sglang.torch_native,sglang.lightning)")
    monkeypatch.setattr(conformance, "execute", lambda *a, **k: _project_fails())
    ours = PROPERTIES["dispatch"].run(composition, spec, "cpu")
    assert not ours.ok and "adapter_error" in ours.details and ours.reason.startswith("adapter error at backends/")
    monkeypatch.setattr(conformance, "execute", lambda *a, **k: fake_engine.boom())
    monkeypatch.setattr("properties.blame.package_root", lambda package: Path(fake_engine.__file__).parent)
    engine = PROPERTIES["dispatch"].run(composition, spec, "cpu")
    assert not engine.ok and "adapter_error" not in engine.details and engine.reason.startswith("run crashed")


def test_an_asynchronous_device_error_raised_in_the_harness_is_not_its_error():
    """A GPU's illegal memory access surfaces at the next synchronizing call, wherever that is: on the H100 the
    cache property's .tolist() raised SGLang's GDN kernels' stray write (0.5.10), and the frame rule called it an
    adapter error. It is the engine's kernels' (a finding); a synchronous error in the same place stays ours."""
    class AcceleratorError(RuntimeError):  # torch's type for it, on a machine without a GPU
        pass

    def sync_in_the_harness(error):
        # raised from a frame of the project's properties/cache.py, where the H100 raised it
        from properties.blame import _PROJECT

        exec(compile("raise error", str(_PROJECT / "properties" / "cache.py"), "exec"), {"error": error})

    illegal = _raised(lambda: sync_in_the_harness(AcceleratorError("CUDA error: an illegal memory access was "
                                                                     "encountered")))
    assert adapter_frame(illegal, ENGINE) is None
    plain = _raised(lambda: sync_in_the_harness(RuntimeError("a shape the adapter got wrong")))
    assert adapter_frame(plain, ENGINE) is not None


def test_a_crash_in_the_class_level_check_is_an_adapter_error_not_a_finding(monkeypatch):
    # A class-level row (backends/sglang/classes.py) runs only the harness's code around SGLang's classes: if that
    # code fails, the engine is not to blame.
    import pytest

    pytest.importorskip("sglang")
    from backends.registry import leaf_class, parse
    from batch.spec import BatchSpec, ForwardMode, MHALayer
    from properties import PROPERTIES

    composition = parse("sglang.wave")
    if composition.unavailable_reason("cpu"):
        pytest.skip(composition.unavailable_reason("cpu"))

    def broken(cls):
        raise AttributeError("the harness's own bug")

    monkeypatch.setattr(leaf_class("sglang.wave"), "engine_classes", classmethod(broken))
    spec = BatchSpec(ForwardMode.EXTEND, (0,), (2,), (MHALayer(0, 2, 1, 16, 16),), seed=1)
    verdict = PROPERTIES["conformance"].run(composition, spec, "cpu")
    assert not verdict.ok and "adapter_error" in verdict.details, verdict.reason


def test_a_batch_the_strategy_draws_and_the_specification_refuses_is_the_harnesss_error(monkeypatch, tmp_path):
    """A strategy bug (a batch whose own validation refuses it, raised while Hypothesis draws) ends the row as an
    adapter error in one line, never as the engine's finding nor a dead process."""
    from hypothesis import strategies as st

    import search.search_row as search_row_module
    from search.matrix import matrix_rows
    from search.outcome import ADAPTER_ERROR
    from search.profiles import profile as profile_of

    def refused(_):
        return BatchSpec(ForwardMode.DECODE, (0,), (1,), (MHALayer(0, 4, 2, 32, 32),))  # decode needs a prefix

    monkeypatch.setattr(search_row_module, "row_strategy", lambda row, profile: st.just(None).map(refused))
    ci = profile_of("ci")
    row = next(r for r in matrix_rows("cpu", ci, ["torch_native"])[0] if r.property.name == "outputs")
    result = search_row_module.search_row(row, ci, "cpu", max_examples=3, out_dir=tmp_path, seed=1)
    assert not result.ok and result.finding_kind == ADAPTER_ERROR, result
    assert result.failure.reason.startswith("harness error: the strategy drew a batch the specification refuses")


NEEDS_SGLANG = pytest.mark.skipif(
    __import__("backends.sglang.runtime", fromlist=["x"]).unavailable_reason() is not None,
    reason="needs the SGLang extra (bash ci/install-sglang.sh)")
EXTEND = BatchSpec(ForwardMode.EXTEND, (5, 0, 3), (4, 2, 1), (MHALayer(0, 4, 2, 32, 32),), dtype="float32", seed=4)


@NEEDS_SGLANG
def test_a_batch_the_adapter_translates_wrong_is_its_error_before_sglang_reads_it(monkeypatch):
    """The adapter checks the ForwardBatch it hands SGLang against what SGLang's scheduler guarantees
    (backends/sglang/handover.py). A wrong field there made SGLang's TorchNative answer wrong with nothing raised: an
    outputs disagreement the harness would have reported as SGLang's bug. With the check it is an adapter error
    naming the field."""
    import dataclasses

    from backends.registry import parse
    from backends.sglang import adapter, handover
    from properties import PROPERTIES

    composition = parse("sglang.torch_native")
    assert PROPERTIES["outputs"].run(composition, EXTEND, "cpu").ok
    translate = adapter.SglangBackend.translate

    def misplaced(self, fb, *args, **kwargs):  # the first two new tokens' write slots swapped
        slots = fb.out_cache_loc.clone()
        slots[[0, 1]] = slots[[1, 0]]
        return translate(self, dataclasses.replace(fb, out_cache_loc=slots), *args, **kwargs)

    monkeypatch.setattr(adapter.SglangBackend, "translate", misplaced)
    ours = PROPERTIES["outputs"].run(composition, EXTEND, "cpu")
    assert not ours.ok and ours.details.get("adapter_error", "").startswith("backends/sglang/handover.py"), str(ours)
    assert "out_cache_loc is [" in ours.reason and "the scheduler's would be [" in ours.reason, ours.reason
    monkeypatch.setattr(handover, "check", lambda *a: None)  # without the check: a wrong answer, blamed on SGLang
    blind = PROPERTIES["outputs"].run(composition, EXTEND, "cpu")
    assert not blind.ok and "adapter_error" not in blind.details and "relative L2 error" in blind.reason, str(blind)


@NEEDS_SGLANG
@pytest.mark.parametrize("field, change, says", [
    ("seq_lens_cpu", lambda t: t + 1, "seq_lens_cpu is [10, 3, 5]"),
    ("seq_lens_sum", lambda n: n + 1, "seq_lens_sum is 16"),
    ("out_cache_loc", lambda t: t.flip(0), "out_cache_loc is"),
    ("positions", lambda t: t + 1, "positions is [6, 7, 8, 9, 1, 2, 4]"),
    ("extend_prefix_lens_cpu", lambda x: [0, 0, 0], "extend_prefix_lens_cpu is [0, 0, 0]"),
    ("req_pool_indices", lambda t: t * 0, "reach row 0 (the harness's padding row)"),
    ("req_pool_indices", lambda t: t + 1000, "past the table's"),  # bounds first: no IndexError (a GPU's assert)
    ("extend_start_loc", lambda t: t + 1, "extend_start_loc is [1, 5, 7]"),
    ("extend_num_tokens", lambda n: n - 1, "extend_num_tokens is 6"),
])
def test_each_guarantee_of_the_scheduler_is_checked(field, change, says):
    from backends.registry import parse
    from backends.sglang import handover
    from batch.forward_batch import ModelRunner
    from engine.materialize import materialize

    case = materialize(EXTEND, "cpu")
    fb = case.forward_batch
    backend = parse("sglang.torch_native").build(EXTEND, ModelRunner.of(fb, EXTEND.layers))
    backend.init_forward_metadata(fb)
    sfb = next(iter(backend.batches.values()))
    table = backend.sgl_runner.req_to_token_pool.req_to_token
    assert handover.violations(sfb, table) == []
    setattr(sfb, field, change(getattr(sfb, field)))
    wrong = handover.violations(sfb, table)
    assert any(says in w for w in wrong), wrong


@NEEDS_SGLANG
def test_a_draft_decode_batch_is_checked_as_eagle_prepares_it():
    """EAGLE's draft decode: topk branches a request from its committed length, a window of write slots per branch
    (not the request table's): positions repeat each length topk times, and the slots are whole windows."""
    from types import SimpleNamespace

    from backends.sglang import handover, runtime

    sgl = runtime.load()
    seq = torch.tensor([7, 3], dtype=torch.int32)

    def draft(positions, slots):
        return SimpleNamespace(forward_mode=sgl.ForwardMode.DECODE, batch_size=2, req_pool_indices=torch.tensor([1, 2]),
                               seq_lens=seq, seq_lens_cpu=seq, seq_lens_sum=10, positions=torch.tensor(positions),
                               out_cache_loc=torch.arange(1, slots + 1), spec_info=SimpleNamespace(num_tokens_per_req=2))

    assert handover.violations(draft([7, 7, 3, 3], 2 * 2 * 3), None) == []  # topk 2, 3 steps
    assert handover.violations(draft([7, 3, 7, 3], 12), None) == [
        "positions is [7, 3, 7, 3], the scheduler's would be [7, 7, 3, 3]"]
    assert "not a draft window of 2 requests x topk 2" in handover.violations(draft([7, 7, 3, 3], 10), None)[0]


@NEEDS_SGLANG
def test_a_decode_batchs_positions_and_a_request_rows_slots_are_checked():
    from backends.registry import parse
    from backends.sglang import handover
    from batch.forward_batch import ModelRunner
    from engine.materialize import materialize

    spec = BatchSpec(ForwardMode.DECODE, (5, 2), (1, 1), (MHALayer(0, 4, 2, 32, 32),), dtype="float32", seed=4)
    fb = materialize(spec, "cpu").forward_batch
    backend = parse("sglang.torch_native").build(spec, ModelRunner.of(fb, spec.layers))
    backend.init_forward_metadata(fb)
    sfb = next(iter(backend.batches.values()))
    table = backend.sgl_runner.req_to_token_pool.req_to_token
    assert handover.violations(sfb, table) == []
    sfb.positions = sfb.positions + 1
    assert handover.violations(sfb, table) == ["positions is [6, 3], the scheduler's would be [5, 2]"]
    sfb.positions = sfb.positions - 1
    twice = table.clone()  # request 0 lists one slot twice
    row = int(sfb.req_pool_indices[0])
    twice[row, 1] = twice[row, 0]
    assert any("are not distinct real slots" in w for w in handover.violations(sfb, twice))


@NEEDS_SGLANG
def test_each_harness_batch_is_checked_once_at_its_first_translation(monkeypatch):
    """A later plan of the same batch would read tensors SGLang's code may have written in place since."""
    from backends.registry import parse
    from backends.sglang import handover
    from batch.forward_batch import ModelRunner
    from engine.materialize import materialize

    checked = []
    real = handover.check
    monkeypatch.setattr(handover, "check", lambda *a: checked.append(a[0]) or real(*a))
    fb = materialize(EXTEND, "cpu").forward_batch
    for _ in range(2):
        backend = parse("sglang.torch_native").build(EXTEND, ModelRunner.of(fb, EXTEND.layers))
        backend.init_forward_metadata(fb)
    assert len(checked) == 1


@NEEDS_SGLANG
def test_a_write_slot_at_another_offset_in_its_page_than_its_position_is_caught():
    import dataclasses

    from backends.registry import parse
    from backends.sglang import handover
    from batch.forward_batch import ModelRunner
    from engine.materialize import materialize

    spec = dataclasses.replace(EXTEND, page_size=4)
    fb = materialize(spec, "cpu").forward_batch
    backend = parse("sglang.torch_native").build(spec, ModelRunner.of(fb, spec.layers))
    backend.init_forward_metadata(fb)
    sfb = next(iter(backend.batches.values()))
    assert backend.sgl_runner.page_size == 4
    assert handover.violations(sfb, None, page_size=4) == []
    wrong = handover.violations(sfb, None, out_cache_loc=sfb.out_cache_loc + 1, page_size=4)
    assert wrong and "at another offset in their page than their position's (page size 4)" in wrong[0], wrong


def test_a_plan_level_leaf_whose_build_fails_on_its_stand_ins_is_an_adapter_error(monkeypatch):
    # SGLang builds TRT-LLM MHA only where FlashInfer is; the harness builds it on a CPU over stand-ins for
    # FlashInfer's wrapper classes (backends/sglang/flashinfer.py). With a stand-in missing, SGLang's constructor raises
    # a NameError in its own frame: seen as a "finding" before this rule, though the gap was the harness's.
    import pytest

    pytest.importorskip("sglang")
    from backends.registry import parse
    from backends.sglang import flashinfer as fi
    from batch.spec import BatchSpec, ForwardMode, MHALayer
    from properties import PROPERTIES

    composition = parse("sglang.trtllm_mha")
    if composition.unavailable_reason("cpu") or not composition.support().plan_only:
        pytest.skip(composition.unavailable_reason("cpu") or "TRT-LLM MHA's kernels run here: nothing stands in")
    monkeypatch.setattr(fi, "FLASHINFER_WRAPPER_CLASSES", ())
    spec = BatchSpec(ForwardMode.DECODE, (9,), (1,), (MHALayer(0, 4, 2, 64, 64),), page_size=16, dtype="bfloat16")
    verdict = PROPERTIES["metadata"].run(composition, spec, "cpu")
    assert not verdict.ok and "adapter_error" in verdict.details, verdict.reason
    assert "built without its kernels" in verdict.reason and "NameError" in verdict.reason, verdict.reason
