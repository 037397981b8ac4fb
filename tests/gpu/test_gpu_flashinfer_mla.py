"""FlashInferMLABackend on a CUDA GPU against the float64 reference: absorbed decode / verify / draft extend over
the latent cache, the expanded (MHA, chunked-prefix) extend, planned metadata and decode CUDA-graph replay."""

from __future__ import annotations

import pytest
from gpu_support import (
    BF16_REL_L2,
    assert_outputs_match,
    assert_plan_valid,
    graph_replay_errors,
    require_gpu_and,
    run_backend,
)

from batch.spec import BatchSpec, ForwardMode, MLALayer, SpecInput

pytestmark = pytest.mark.gpu
require_gpu_and("flashinfer", "flashinfer-python")

from backends.flashinfer_mla import FlashInferMLABackend  # noqa: E402

# DeepSeek shapes (the gpu profile): 16 heads, nope 128, rope 64, kv_lora_rank 512, v 128.
MLA = (MLALayer(0, 16, 128, 64, 512, 128), MLALayer(1, 16, 128, 64, 512, 128))


def spec(mode, prefix, extend, page_size=16, **kw) -> BatchSpec:
    return BatchSpec(mode, tuple(prefix), tuple(extend), MLA, page_size=page_size, dtype="bfloat16", seed=11, **kw)


def check(s: BatchSpec):
    ran = run_backend(FlashInferMLABackend, s)
    assert_outputs_match(ran)
    assert_plan_valid(ran)
    return ran


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(page_size):
    check(spec(ForwardMode.DECODE, [1, 40, 16, 300], [1, 1, 1, 1], page_size=page_size))


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_without_prefix(page_size):
    check(spec(ForwardMode.EXTEND, [0, 0], [45, 7], page_size=page_size))


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_prefix_in_several_chunks(page_size):
    # mla_prefix_chunk is 256: prefixes of 600 and 257 span three and two chunks; one request has none.
    ran = check(spec(ForwardMode.EXTEND, [600, 0, 257], [13, 9, 30], page_size=page_size))
    assert len(ran.backend.mha_chunk["chunks"]) == 3


def test_mixed():
    check(spec(ForwardMode.MIXED, [25, 0, 17], [1, 30, 1]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_chain(page_size):
    s = SpecInput(draft_token_num=4, topk=1, spec_steps=3, parents=((-1, 0, 1, 2),) * 2, accept_lens=(2, 4))
    ran = check(spec(ForwardMode.TARGET_VERIFY, [30, 15], [4, 4], page_size=page_size, spec=s))
    assert ran.backend.rows is None  # chains run the causal kernel, as SGLang does


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_tree(page_size):
    parents = ((-1, 0, 0, 1, 2), (-1, 0, 1, 1, 0))
    s = SpecInput(draft_token_num=5, topk=2, spec_steps=3, parents=parents, accept_lens=(2, 3))
    ran = check(spec(ForwardMode.TARGET_VERIFY, [30, 15], [5, 5], page_size=page_size, spec=s))
    assert ran.backend.rows is not None  # one query row per draft token


def test_draft_extend():
    s = SpecInput(draft_token_num=4, topk=1, spec_steps=3, parents=((-1, 0, 1, 2),) * 3, accept_lens=(1, 4, 2))
    check(spec(ForwardMode.DRAFT_EXTEND, [12, 1, 31], [1, 4, 2], spec=s))


def test_idle():
    ran = run_backend(FlashInferMLABackend, spec(ForwardMode.IDLE, [], []))
    assert all(o.shape == (0, 16, 128) for o in ran.outputs)


def test_missing_chunk_plan_is_an_error():
    import torch

    from batch.forward_batch import ModelRunner
    from engine.materialize import materialize
    from engine.model import run_layer

    case = materialize(spec(ForwardMode.EXTEND, [20], [5]), "cuda")
    fb = case.forward_batch
    backend = FlashInferMLABackend(ModelRunner.of(fb, case.spec.layers))
    backend.init_forward_metadata(fb)  # but no init_mha_chunk_metadata
    with pytest.raises(RuntimeError, match="missing or stale"):
        run_layer(backend, case.spec.layers[0], case.inputs[0], case.weights[0], fb)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_cuda_graph_replay(page_size):
    errors = graph_replay_errors(FlashInferMLABackend, spec(ForwardMode.DECODE, [40, 17, 3], [1, 1, 1],
                                                            page_size=page_size))
    assert max(errors) < BF16_REL_L2, errors
