"""SGLang's Triton backend serving an MLA model (backends/sglang/mla.py, ``SglangTritonMla``): DeepSeek's, Kimi's
and MiniCPM3's layers with ``--attention-backend triton``, on a CPU under Triton's interpreter. What is checked here:
that its rows run and pass at the profile's latent, that its MLA decode's two latent widths are declared and any other
is refused with the reason, and that a wrong hand-over of the absorbed layer fails the outputs property."""

from __future__ import annotations

import pytest

from backends.registry import leaf_capabilities, parse
from backends.sglang import mla
from batch.spec import BatchSpec, ForwardMode, MLALayer
from properties import PROPERTIES
from search.matrix import profile_reason
from search.profiles import PROFILES

pytest.importorskip("sglang")
MLA = (MLALayer(0, 4, 16, 32, 256, 16),)  # MiniCPM3's latent: 256 + rope 32


def _available():
    why = parse("sglang.triton_mla").unavailable_reason("cpu")
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("composition", ["sglang.triton_mla", "tbo(sglang.triton_mla)", "graph(sglang.triton_mla)"])
@pytest.mark.parametrize("mode, prefix, extend", [
    (ForwardMode.DECODE, (9, 40), (1, 1)),
    (ForwardMode.EXTEND, (0, 0), (5, 3)),  # no cached prefix: DeepSeek runs the expanded layer (MHA)
    (ForwardMode.EXTEND, (7, 20), (5, 3)),  # a cached prefix: the absorbed layer
])
def test_its_rows_pass_at_the_profiles_latent(composition, mode, prefix, extend):
    _available()
    if composition.startswith("graph") and mode is ForwardMode.EXTEND:
        pytest.skip("its graphs capture decode, verify and idle batches")
    prop = "graph_replay" if composition.startswith("graph") else "outputs"
    spec = BatchSpec(mode, prefix, extend, MLA, dtype="float32", seed=1)
    verdict = PROPERTIES[prop].run(parse(composition), spec, "cpu")
    assert verdict.ok, str(verdict)


def test_its_decode_takes_two_latent_widths_and_refuses_the_rest_with_the_reason():
    caps = leaf_capabilities("sglang.triton_mla")
    assert caps.mla_latents == {(512, 64), (256, 32)}
    support = parse("sglang.triton_mla").support()
    other = BatchSpec(ForwardMode.DECODE, (9,), (1,), (MLALayer(0, 4, 16, 8, 32, 16),), dtype="float32")
    assert support.unsupported_reason(other) == "MLA latent 32 + rope 8 not supported"
    assert support.unsupported_reason(BatchSpec(ForwardMode.DECODE, (9,), (1,), MLA, dtype="float32")) is None
    # every profile draws a latent it takes, so its rows run wherever the profile is used
    for profile in PROFILES.values():
        assert profile_reason(parse("sglang.triton_mla"), profile, "cpu" if profile.name != "gpu" else "cuda") is None
    from dataclasses import replace

    odd = replace(PROFILES["ci"], mla=(4, 16, 8, 32, 16))
    assert "MLA latent 32 + rope 8" in profile_reason(parse("sglang.triton_mla"), odd, "cpu")


def test_a_wrong_hand_over_of_the_absorbed_layer_fails_its_outputs(monkeypatch):
    # the new latent rows' rope part lost on the way to SGLang's attn_mqa: the float64 reference must tell
    _available()
    absorbed = mla._absorbed

    def rope_lost(backend, layer, q, k, sfb, save_kv_cache):
        k = k.clone()
        k[..., layer.spec.kv_lora_rank:] = 0
        return absorbed(backend, layer, q, k, sfb, save_kv_cache)

    monkeypatch.setattr(mla, "_absorbed", rope_lost)
    spec = BatchSpec(ForwardMode.DECODE, (9, 40), (1, 1), MLA, dtype="float32", seed=1)
    verdict = PROPERTIES["outputs"].run(parse("sglang.triton_mla"), spec, "cpu")
    assert not verdict.ok and "out of bounds" in verdict.reason, str(verdict)


def _draft(topk, steps, prefix=(5, 19), page_size=1):
    from batch.spec import SpecInput, draft_forest

    forest = draft_forest(topk, steps)
    return BatchSpec(ForwardMode.DRAFT_DECODE, prefix, (len(forest),) * len(prefix), MLA, page_size=page_size,
                     dtype="float32", seed=7,
                     spec=SpecInput(len(forest), topk, steps, (forest,) * len(prefix), (1,) * len(prefix)))


@pytest.mark.parametrize("composition, prop", [("sglang.triton_mla", "outputs"), ("sglang.triton_mla", "metadata"),
                                               ("graph(sglang.triton_mla)", "graph_replay"),
                                               ("graph(sglang.triton_mla)", "graph_metadata")])
def test_its_draft_workers_loop_reads_each_steps_chain_eager_and_replayed(composition, prop):
    # SGLang's TritonMultiStepDraftBackend over the absorbed layer (DeepSeek's MTP draft model), a tree of two
    # branches and three steps over pages of 16: each step reads its prefix and its branch's tokens so far
    _available()
    verdict = PROPERTIES[prop].run(parse(composition), _draft(2, 3, page_size=16), "cpu")
    assert verdict.ok, str(verdict)


def test_the_other_mla_draft_loops_take_chains_only_and_no_draft_window():
    # FlashInfer MLA's, FlashMLA's and TRT-LLM MLA's containers refuse topk > 1 when built, and none hands the index
    # kernel the server's draft window; Triton's takes both
    from dataclasses import replace as spec_replace

    tree, chain = _draft(2, 3, page_size=64), _draft(1, 3, page_size=64)  # the page every one of them takes
    windowed = spec_replace(chain, spec=spec_replace(chain.spec, draft_window_size=3))
    for name in ("sglang.flashinfer_mla", "sglang.flashmla", "sglang.trtllm_mla", "sglang.cutedsl_mla"):
        caps = leaf_capabilities(name)
        if caps.class_only:
            continue
        assert not caps.draft_loop_trees and not caps.draft_prefix_window, name
        support = parse(name).support()
        assert "in the draft loop not supported" in support.unsupported_reason(spec_replace(tree, dtype="bfloat16"))
        assert "draft window" in support.unsupported_reason(spec_replace(windowed, dtype="bfloat16"))
    support = parse("sglang.triton_mla").support()
    assert support.unsupported_reason(tree) is None and support.unsupported_reason(windowed) is None
