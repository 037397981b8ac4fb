"""SGLang's TRT-LLM MHA backend (backends/sglang/flashinfer.py, ``SglangTrtllmMha``): every property where FlashInfer and
a GPU of its kernels' architectures are present (run on an H200: harness-out/gpu77.sh to gpu80.sh), its classes
elsewhere. What a CPU can check of it: which level the leaf takes and why, and that its plan is read by the reader the
CPU's FlashAttention rows exercise (``flash_attention_plan``), over SGLang's own metadata class."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from backends.registry import leaf_capabilities, parse
from backends.sglang import flashinfer as fi
from batch.spec import BatchSpec, ForwardMode, MHALayer
from properties import PROPERTIES

pytest.importorskip("sglang")


@pytest.mark.parametrize("installed, gpu, capability, expected", [
    (False, True, (9, 0), "FlashInfer is not installed"),
    (True, False, (9, 0), "no CUDA GPU is visible"),
    (True, True, (8, 0), "this GPU is SM80"),
    (True, True, RuntimeError("NVML unavailable"), "could not be read (RuntimeError: NVML unavailable)"),
    (True, True, (9, 0), None),  # Hopper: XQA decode, fmha_v2 prefill
    (True, True, (10, 0), None),  # Blackwell: TRT-LLM-gen
    (True, True, (12, 0), None),
])
def test_the_leaf_runs_only_where_flashinfer_and_a_gpu_of_its_kernels_are(monkeypatch, installed, gpu, capability,
                                                                          expected):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (real("torch") if installed else None)
                        if name == "flashinfer" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)

    def read():
        if isinstance(capability, Exception):
            raise capability
        return capability

    monkeypatch.setattr(fi, "_compute_capability", read)
    why = fi.trtllm_mha_unrunnable()
    if expected is None:
        assert why is None
    else:
        assert why.startswith(fi.TRTLLM_MHA_CLASS_ONLY) and why.endswith(expected), why


def test_where_it_cannot_run_its_classes_are_read_and_the_reason_is_said():
    caps = leaf_capabilities("sglang.trtllm_mha")
    if caps.class_only is None:
        pytest.skip("TRT-LLM MHA's kernels can run here: the leaf is built (its GPU rows run)")
    assert caps.class_only == fi.trtllm_mha_unrunnable()
    classes = fi.SglangTrtllmMha.engine_classes()
    assert [c.__name__ for c in classes] == ["TRTLLMHAAttnBackend"]
    batch = BatchSpec(ForwardMode.EXTEND, (0,), (1,), (MHALayer(0, 4, 2, 64, 64),))
    verdict = PROPERTIES["conformance"].run(parse("sglang.trtllm_mha"), batch, "cpu")
    assert verdict.ok, str(verdict)


def test_its_plan_is_read_as_flashattentions_over_sglangs_own_metadata_class():
    # The adapter reads TRTLLMMHAMetadata with flash_attention_plan, by its field names: if SGLang renames one, this
    # fails on a CPU, not first on a GPU runner
    from backends.sglang import runtime
    from backends.sglang.adapter import FLASH_ATTENTION_READ, flash_attention_plan

    runtime.load()
    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMMHAMetadata

    page = 16
    meta = TRTLLMMHAMetadata()
    assert FLASH_ATTENTION_READ <= set(vars(meta)), sorted(FLASH_ATTENTION_READ - set(vars(meta)))
    # a decode of two requests, 3 and 20 keys: pages [5] and [2, 7] of a table 4 pages wide, as _fill_page_table_device
    # writes it (the row's tail unwritten)
    meta.cache_seqlens_int32 = torch.tensor([3, 20], dtype=torch.int32)
    meta.cu_seqlens_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    meta.cu_seqlens_k = torch.tensor([0, 3, 23], dtype=torch.int32)
    meta.page_table = torch.tensor([[5, -1, -1, -1], [2, 7, -1, -1]], dtype=torch.int32)
    meta.swa_page_table = meta.page_table.clone()
    plan = flash_attention_plan(meta, page)
    assert plan.kv_indptr.tolist() == [0, 1, 3] and plan.kv_indices.tolist() == [5, 2, 7]
    assert plan.kv_indices_are_pages and plan.key_lens.tolist() == [3, 20]
    assert "swa_page_table" in plan.unread  # a window model's table: planned, not yet checked, and said so
