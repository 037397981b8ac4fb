"""SGLang's FlashMLA backend (backends/sglang/flashinfer.py, ``SglangFlashMla``): every property where flash_mla (the
sgl-flash-mla wheel), FlashInfer and a Hopper GPU are present, its classes elsewhere (flash_mla an inert stand-in where
it is absent, backends/sglang/runtime.py). What a CPU checks of it: which level the leaf takes and why, that the
stand-in lets its class import and runs no kernel, the reader of its plan over SGLang's own metadata class, and the
form DeepSeek calls it in (its own dispatcher, the absorbed query concatenated)."""

from __future__ import annotations

import importlib

import pytest
import torch

from backends.registry import leaf_capabilities, parse
from backends.sglang import flashinfer as fi
from backends.sglang import mla as deepseek
from batch.spec import ForwardMode, MLALayer
from tests.plan_checks import on_machine

pytest.importorskip("sglang")


@pytest.mark.parametrize("flash_mla, flashinfer, gpu, capability, expected", [
    (False, True, True, (9, 0), "flash_mla is not installed"),
    (True, False, True, (9, 0), "FlashInfer is not installed"),
    (True, True, False, (9, 0), "no CUDA GPU is visible"),
    (True, True, True, (10, 0), "this GPU is SM100"),  # the legacy dense decode kernels are SM90's
    (True, True, True, RuntimeError("NVML unavailable"), "could not be read (RuntimeError: NVML unavailable)"),
    (True, True, True, (9, 0), None),
])
def test_the_leaf_is_built_only_where_flash_mla_flashinfer_and_a_hopper_gpu_are(monkeypatch, flash_mla, flashinfer,
                                                                                gpu, capability, expected):
    on_machine(monkeypatch, {"flash_mla": flash_mla, "flashinfer": flashinfer}, gpu, capability)
    why = fi.flashmla_unrunnable()
    if expected is None:
        assert why is None
        caps = fi._flashmla_capabilities(None)
        assert caps.class_only is None and caps.devices == {"cuda"} and caps.page_sizes == {64}
        assert "flash_mla" in caps.requires and not caps.draft_trees
    else:
        assert why.startswith(fi.FLASHMLA_KERNELS) and why.endswith(expected), why
        caps = fi._flashmla_capabilities(why)
        assert caps.class_only == why and caps.engine_classes == "flashmla"


def test_before_the_sgl_flash_mla_wheel_its_kernels_are_sgl_kernels(monkeypatch, tmp_path):
    # 0.5.1x's FlashMLA imports its kernels from sgl_kernel.flash_mla (0.5.10 flashmla_backend.py:12): a release
    # without SGLang's flash_mla interface needs sgl_kernel, whatever flash_mla is installed
    from backends.sglang import features

    monkeypatch.setattr(features, "package_root", lambda *a: tmp_path)  # no kernels/ops/attention/flash_mla_interface
    monkeypatch.setattr(features, "really_installed", lambda name: name != "sgl_kernel")
    assert fi.flashmla_unrunnable().endswith("sgl_kernel is not installed")


def test_where_flash_mla_is_absent_its_class_imports_over_an_inert_stand_in_and_runs_no_kernel():
    from backends.sglang import features, runtime

    if features.really_installed("flash_mla"):
        pytest.skip("flash_mla is installed here: no stand-in")
    runtime.load()
    assert not features.really_installed("flash_mla")  # the stand-in is not taken for the package
    # every package the adapter stands in for is named in the import probe's cache key
    assert set(runtime._INERT_WHEN_ABSENT) | {"sgl_kernel", "flash_mla"} == set(features.STAND_INS)
    caps = leaf_capabilities("sglang.flashmla")
    assert caps.class_only and caps.class_only.endswith("flash_mla is not installed")
    from sglang.kernels.ops.attention import flash_mla_interface
    from sglang.srt.layers.attention.flashmla_backend import FlashMLABackend

    assert [c.__name__ for c in fi.SglangFlashMla.engine_classes()] == [FlashMLABackend.__name__]
    with pytest.raises(RuntimeError, match="inert stub"):
        flash_mla_interface.get_mla_metadata(torch.tensor([3], dtype=torch.int32), 16, 1)
    with pytest.raises(TypeError, match="class-level leaf here"):
        fi.SglangFlashMla(None)
    # its row is its classes' conformance, and the reason is said for the rest
    from properties import PROPERTIES

    why = PROPERTIES["outputs"].applies(parse("sglang.flashmla"), ForwardMode.DECODE)
    assert why and why.startswith("only its classes are checked"), why


def test_its_plan_is_read_over_sglangs_own_metadata_class():
    # The adapter reads FlashMLADecodeMetadata by its field names: a rename fails here, on a CPU
    from types import SimpleNamespace

    from backends.sglang import runtime

    runtime.load()
    from sglang.srt.layers.attention.flashmla_backend import PAGE_SIZE, FlashMLADecodeMetadata

    assert PAGE_SIZE == fi.FLASHMLA_PAGE
    # two requests of 3 and 70 keys: pages [5] and [2, 7] of a table 3 wide, padded with -1 as the Triton kernel leaves
    table = torch.tensor([[5, -1, -1], [2, 7, -1]], dtype=torch.int32)
    meta = FlashMLADecodeMetadata(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), table)
    decode = SimpleNamespace(seq_lens=torch.tensor([3, 70]), batch_size=2, forward_mode=_Mode(verify=False))
    plan = fi.flashmla_plan(meta, decode, 0)
    assert plan.kv_indptr.tolist() == [0, 1, 3] and plan.kv_indices.tolist() == [5, 2, 7]
    assert plan.kv_indices_are_pages and plan.kv_includes_new_tokens and plan.key_lens is None
    assert set(plan.unread) == {"flashmla_metadata", "num_splits"}  # the kernel's split schedule: named, not checked
    # a verify's keys are the batch's plus the server's draft window: 62 + 4 = 66 keys need a second page
    verify = SimpleNamespace(seq_lens=torch.tensor([3, 62]), batch_size=2, forward_mode=_Mode(verify=True))
    assert fi.flashmla_plan(meta, verify, 4).kv_indices.tolist() == [5, 2, 7]
    assert fi.flashmla_plan(meta, verify, 0).kv_indices.tolist() == [5, 2]
    # a draft extend's planned key counts are read, and checked
    meta = FlashMLADecodeMetadata(None, None, table, torch.tensor([3, 70], dtype=torch.int32))
    assert fi.flashmla_plan(meta, verify, 4).key_lens.tolist() == [3, 70]


class _Mode:
    def __init__(self, verify: bool) -> None:
        self.verify = verify

    def is_target_verify(self) -> bool:
        return self.verify


def test_deepseek_calls_it_through_its_own_dispatcher_with_the_absorbed_query_concatenated():
    # SGLang's list of the backends DeepSeek hands q_rope/k_rope apart: FlashInfer MLA's, not FlashMLA's
    # (forward_mla.py forward_absorb_core: attn_mqa(cat(q_nope_out, q_pe), cat(k_nope, k_pe), k_nope))
    from backends.sglang import runtime

    sgl = runtime.load()
    assert deepseek.rope_apart("flashinfer") and not deepseek.rope_apart("flashmla")
    handlers = importlib.import_module(sgl.handle_attention_flashinfer.__module__)
    assert callable(handlers.handle_attention_flashmla)


@pytest.mark.parametrize("name, apart", [("trtllm_mla", True), ("flashmla", False)])
def test_a_tbo_half_runs_the_mla_leafs_absorbed_call_in_the_form_its_backend_takes(monkeypatch, name, apart):
    # A TBO half borrows its leaf's _run and planned_metadata: everything they read must be the half's too (a helper
    # method of the leaf was an adapter error on every tbo(sglang.flashmla) row of the H200). Over TRT-LLM MLA's
    # halves (planned on a CPU), with SGLang's RadixAttention recorded instead of run.
    from types import SimpleNamespace

    from batch.spec import BatchSpec
    from properties.metadata import planned, planned_leaves

    composition = parse("tbo(sglang.trtllm_mla)")
    if composition.unavailable_reason("cpu"):
        pytest.skip(composition.unavailable_reason("cpu"))
    mla = MLALayer(0, 8, 64, 32, 128, 64)
    spec = BatchSpec(ForwardMode.DECODE, (9, 40, 70), (1, 1, 1), (mla,), page_size=64, dtype="bfloat16", seed=5)
    backend, fb = planned(composition, spec, "cpu")
    half, half_fb = next((leaf, b) for leaf, b in planned_leaves(backend, fb) if leaf is backend.children[0])
    calls = []

    class Recorded:
        def __init__(self, **kw):
            self.kw = kw

        def __call__(self, q, k, v, sfb, **kw):
            calls.append((q.shape, k.shape, v.shape, sorted(kw)))
            return torch.zeros(q.shape[0], self.kw["num_heads"] * self.kw["v_head_dim"])

    monkeypatch.setattr(half.sgl, "RadixAttention", Recorded)
    monkeypatch.setattr(half, "sglang_name", name)
    half.radix.clear()
    T, C, R = half_fb.out_cache_loc.numel(), 128, 64  # the half's query tokens
    layer = SimpleNamespace(spec=mla, layer_id=0, absorbed=True, weights={})
    q, k = torch.zeros(T, 8, C + R, dtype=torch.bfloat16), torch.zeros(T, 1, C + R, dtype=torch.bfloat16)
    out = deepseek.DeepseekMla._run(half, q, k, None, layer, half_fb, True)
    assert out.shape == (T, 8, C)
    (qs, ks, vs, kw), = calls
    if apart:  # q_nope_out and k_nope, their rope parts by keyword
        assert qs[-1] == C and ks[-1] == C and "q_rope" in kw and "k_rope" in kw
    else:  # concatenated, the value the latent rows' first C columns
        assert qs[-1] == C + R and ks[-1] == C + R and vs[-1] == C and "q_rope" not in kw
    # FlashMLA's reader, borrowed by the half, over a FlashMLA decode plan of the half's requests (one page each)
    from sglang.srt.layers.attention.flashmla_backend import FlashMLADecodeMetadata

    B = half_fb.batch_size
    monkeypatch.setattr(half.inner, "forward_metadata", FlashMLADecodeMetadata(
        None, None, torch.arange(1, B + 1, dtype=torch.int32)[:, None]), raising=False)
    monkeypatch.setattr(half.inner, "num_draft_tokens", 0, raising=False)
    plan = fi.SglangFlashMla.planned_metadata(half)
    assert plan.kv_indptr.tolist() == list(range(B + 1)) and plan.kv_indices.tolist() == list(range(1, B + 1))


def test_the_mla_leaf_asks_its_own_backends_dispatcher(monkeypatch):
    # DeepSeek asks handle_attention_<its backend>: FlashMLA's leaf must reach handle_attention_flashmla
    from backends.sglang import runtime

    sgl = runtime.load()
    handlers = importlib.import_module(sgl.handle_attention_flashinfer.__module__)
    asked = []
    for name in ("flashinfer", "flashmla", "triton"):
        monkeypatch.setattr(handlers, f"handle_attention_{name}", lambda attn, fb, name=name: asked.append(name))
    spec = MLALayer(0, 4, 16, 16, 64, 16)
    deepseek.forward_method(sgl, None, spec, "flashmla")
    deepseek.forward_method(sgl, None, spec, deepseek.SglangTritonMla.sglang_name)
    deepseek.forward_method(sgl, None, spec)
    assert asked == ["flashmla", "triton", "flashinfer"]
