"""FlashInferBackend (MHA) on a CUDA GPU against the float64 reference, mode by mode, plus its planned metadata,
its KV-cache writes and decode CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from gpu_support import (
    BF16_REL_L2,
    assert_outputs_match,
    assert_plan_valid,
    graph_replay_errors,
    require_gpu_and,
    run_backend,
)

from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecInput

pytestmark = pytest.mark.gpu
require_gpu_and("flashinfer", "flashinfer-python")

from backends.flashinfer import FlashInferBackend  # noqa: E402

GQA = (MHALayer(0, 8, 2, 128, 128), MHALayer(1, 8, 2, 128, 128))


def spec(mode, prefix, extend, layers=GQA, page_size=16, **kw) -> BatchSpec:
    return BatchSpec(mode, tuple(prefix), tuple(extend), tuple(layers), page_size=page_size, dtype="bfloat16",
                     seed=kw.pop("seed", 7), **kw)


def check(s: BatchSpec):
    ran = run_backend(FlashInferBackend, s)
    assert_outputs_match(ran)
    assert_plan_valid(ran)
    return ran


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_without_prefix(page_size):
    check(spec(ForwardMode.EXTEND, [0, 0, 0], [37, 5, 64], page_size=page_size))


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_prefix(page_size):
    # Mixed: one fresh request, prefixes ending mid-page and on a page boundary.
    check(spec(ForwardMode.EXTEND, [0, 33, 48], [20, 17, 9], page_size=page_size))


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(page_size):
    check(spec(ForwardMode.DECODE, [1, 40, 16, 129], [1, 1, 1, 1], page_size=page_size))


def test_mixed():
    check(spec(ForwardMode.MIXED, [25, 0, 17], [1, 30, 1]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_tree(page_size):
    parents = ((-1, 0, 0, 1, 2), (-1, 0, 1, 1, 0))  # branching trees: the custom mask matters
    s = SpecInput(draft_token_num=5, topk=2, spec_steps=3, parents=parents, accept_lens=(2, 3))
    check(spec(ForwardMode.TARGET_VERIFY, [30, 15], [5, 5], page_size=page_size, spec=s))


def test_draft_extend():
    s = SpecInput(draft_token_num=4, topk=1, spec_steps=3, parents=((-1, 0, 1, 2),) * 3, accept_lens=(1, 4, 2))
    check(spec(ForwardMode.DRAFT_EXTEND, [12, 1, 31], [1, 4, 2], spec=s))


def test_idle():
    ran = run_backend(FlashInferBackend, spec(ForwardMode.IDLE, [], []))
    assert all(o.shape == (0, 8, 128) for o in ran.outputs)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_sliding_window(mode):
    layers = (MHALayer(0, 8, 2, 128, 128, sliding_window=6), MHALayer(1, 8, 2, 128, 128))  # one window per model
    extend = [9, 20] if mode is ForwardMode.EXTEND else [1, 1]
    check(spec(mode, [14, 3], extend, layers=layers))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_logit_cap(mode):
    layers = (MHALayer(0, 8, 2, 128, 128, logit_cap=5.0),)
    extend = [9, 20] if mode is ForwardMode.EXTEND else [1, 1]
    check(spec(mode, [14, 0] if mode is ForwardMode.EXTEND else [14, 3], extend, layers=layers))


def test_kv_cache_writes_exact():
    ran = check(spec(ForwardMode.EXTEND, [5, 0], [11, 4]))
    fb, case = ran.case.forward_batch, ran.case
    from engine.model import mha_qkv

    for layer, inputs in zip(case.spec.layers, case.inputs):
        _, k, v = mha_qkv(layer, inputs, fb)
        pool = fb.token_to_kv_pool
        assert torch.equal(pool.k_buffers[layer.layer_id][fb.out_cache_loc], k)
        assert torch.equal(pool.v_buffers[layer.layer_id][fb.out_cache_loc], v)
        untouched = torch.ones(pool.k_buffers[layer.layer_id].shape[0], dtype=torch.bool, device=fb.device)
        untouched[fb.out_cache_loc] = False
        before = case.kv_pool_before.k_buffers[layer.layer_id]
        assert torch.equal(pool.k_buffers[layer.layer_id][untouched], before[untouched])


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_cuda_graph_replay(page_size):
    errors = graph_replay_errors(FlashInferBackend, spec(ForwardMode.DECODE, [40, 17, 3], [1, 1, 1],
                                                         page_size=page_size))
    assert max(errors) < BF16_REL_L2, errors


def test_hybrid_with_fla_decode_graph():
    """Full layers captured (FlashInfer), linear layers eager between them (fla)."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core (and einops) is not installed")
    from backends.fla import FlaBackend
    from backends.hybrid import HybridLinearAttnBackend
    from batch.spec import LinearLayer

    layers = (MHALayer(0, 8, 2, 128, 128), LinearLayer(1, 4, 8, 128, 128), MHALayer(2, 8, 2, 128, 128))
    s = spec(ForwardMode.DECODE, [40, 17, 3], [1, 1, 1], layers=layers)
    errors = graph_replay_errors(lambda mr: HybridLinearAttnBackend(FlashInferBackend(mr), FlaBackend(mr), [0, 2]), s)
    assert max(errors) < BF16_REL_L2, errors
