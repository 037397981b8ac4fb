"""The batched reference (all requests of a layer on one padded grid) equals the single-request definitions
(``reference.mha.attention``, ``reference.mla.attention_absorbed``) applied one request at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.batch as batch
from batch.case import Case
from batch.masks import tree_mask
from batch.spec import (BatchSpec, ForwardMode, ImageSpan, LightningLayer, LinearLayer, MHALayer, MLALayer, MropeLayout,
                        SpecInput)
from engine.materialize import materialize
from reference import mha, mla
from reference.rope import apply_rope, mrope_cos_sin, rope_cos_sin
from search.profiles import PROFILES
from search.strategies import batch_specs

F64 = torch.float64
# Larger than ci, so that batches split into several padding groups on a CPU.
PROFILE = dataclasses.replace(PROFILES["dev"], max_requests=8)


def per_request_outputs(case: Case) -> list[torch.Tensor | None]:
    """Each full-attention layer's output, one request at a time through the single-request functions
    (None for linear layers, which the batched path also runs one request at a time)."""
    spec = case.spec
    if spec.mrope is not None:
        positions = torch.tensor(spec.mrope_positions(), dtype=torch.int64)
    else:
        positions = torch.tensor(spec.positions(), dtype=torch.int64)

    def rope(x, rows, rotary_dim, theta):
        if spec.mrope is not None:
            cos, sin = mrope_cos_sin(positions[:, rows], rotary_dim, spec.mrope.sections, theta=theta)
        else:
            cos, sin = rope_cos_sin(positions[rows], rotary_dim, theta=theta)
        return apply_rope(x, cos, sin)

    outputs: list[torch.Tensor | None] = []
    for layer, inp, w in zip(spec.layers, case.inputs, case.weights):
        if layer.kind == "linear":
            outputs.append(None)
            continue
        t = {n: x.to(F64) for n, x in inp.tensors.items()}
        pool = case.kv_pool_before.k_buffers[layer.layer_id]
        per_request, start = [], 0
        for i, (prefix, extend) in enumerate(zip(spec.prefix_lens, spec.extend_lens)):
            rows = slice(start, start + extend)
            start += extend
            cached = case.token_slots[i][:prefix]
            mask, window = None, getattr(layer, "sliding_window", None)
            if spec.mode.drafts_tree():  # a verify's tree, a draft loop's branches
                mask = torch.cat([torch.ones(extend, prefix, dtype=torch.bool), tree_mask(spec.spec.parents[i])], 1)
                if window is not None:  # by positions: a draft at prefix + depth, its row notwithstanding
                    q_pos = prefix + torch.tensor(spec.spec.depths(i))
                    k_pos = torch.cat([torch.arange(prefix), q_pos])
                    mask &= k_pos[None, :] >= q_pos[:, None] - window
                    window = None
            if layer.kind == "mha":
                q = rope(t["q"][rows], rows, layer.head_dim, layer.rope_theta)
                k = torch.cat([pool[cached].to(F64), rope(t["k"][rows], rows, layer.head_dim, layer.rope_theta)])
                v = torch.cat([case.kv_pool_before.v_buffers[layer.layer_id][cached].to(F64), t["v"][rows]])
                per_request.append(mha.attention(q, k, v, sm_scale=layer.sm_scale, causal=mask is None, mask=mask,
                                                 sliding_window=window, logit_cap=layer.logit_cap))
            else:
                N, R, C = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank
                q_pe = rope(t["q"][rows][..., N:], rows, R, layer.rope_theta)
                kpe_new = rope(t["kpe"][rows][:, None, :], rows, R, layer.rope_theta)[:, 0]
                latent = pool[cached, 0].to(F64)
                ckv, kpe = torch.cat([latent[:, :C], t["ckv"][rows]]), torch.cat([latent[:, C:], kpe_new])
                per_request.append(mla.attention_absorbed(t["q"][rows][..., :N], q_pe, ckv, kpe, w.tensors["w_kc"],
                                                          w.tensors["w_vc"], sm_scale=layer.sm_scale,
                                                          causal=mask is None, mask=mask))
        outputs.append(torch.cat(per_request) if per_request else None)
    return outputs


def assert_batched_equals_per_request(spec: BatchSpec) -> None:
    case = materialize(spec)
    batched = batch.reference_outputs(case).outputs
    for layer, got, expected in zip(spec.layers, batched, per_request_outputs(case)):
        assert got.shape[0] == spec.num_tokens
        if expected is not None:
            assert got.shape == expected.shape and got.dtype == F64
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=f"layer {layer.layer_id}")


# Padding groups: the device's default, one request per group unless they pad perfectly, one group always; and
# one group taken a few query rows at a time (a long prefill's chunks: at most 64 scores per call).
GROUPINGS = {"default": None, "split": (1.0, 0, None), "one group": (float("inf"), 0, None),
             "query chunks": (float("inf"), 0, 64)}


@pytest.fixture(params=list(GROUPINGS))
def grouping(request, monkeypatch):
    if GROUPINGS[request.param] is not None:
        max_padding, budget, max_scores = GROUPINGS[request.param]
        monkeypatch.setattr(batch, "MAX_PADDING", max_padding)
        monkeypatch.setattr(batch, "PADDING_BUDGET", {"cpu": budget, "cuda": budget})
        if max_scores is not None:
            monkeypatch.setattr(batch, "MAX_SCORES", max_scores)
    return request.param


KINDS = [frozenset({"mha"}), frozenset({"mla"}), frozenset({"mha", "linear"})]


@settings(max_examples=25)
@given(data=st.data())
def test_batched_equals_per_request_on_drawn_batches(grouping, data):
    mode = data.draw(st.sampled_from(list(ForwardMode)))
    kinds = data.draw(st.sampled_from(KINDS))
    assert_batched_equals_per_request(data.draw(batch_specs(PROFILE, mode, kinds, hybrid="linear" in kinds,
                                                            verify_window=True, empty_extend=True)))


def mha_layer(layer_id=0, **kw) -> MHALayer:
    return MHALayer(layer_id, kw.pop("hq", 8), kw.pop("hk", 2), kw.pop("d", 32), kw.pop("dv", 16), **kw)


@pytest.mark.parametrize("spec", [
    # GQA, a prefix-0 request, the model's sliding window on two of three layers (one of them a window of 1),
    # logit cap, paged slots.
    BatchSpec(ForwardMode.EXTEND, (0, 37, 5, 0), (9, 3, 20, 1),
              (mha_layer(0), mha_layer(1, sliding_window=4, logit_cap=5.0), mha_layer(2, sliding_window=4)),
              page_size=4, seed=1),
    BatchSpec(ForwardMode.EXTEND, (0, 7), (5, 3), (mha_layer(0, sliding_window=1), mha_layer(1)),
              page_size=4, seed=7),
    BatchSpec(ForwardMode.DECODE, (1, 60, 17), (1, 1, 1), (mha_layer(0, sliding_window=8),), seed=2),
    BatchSpec(ForwardMode.MIXED, (12, 0, 30), (1, 7, 1), (MLALayer(0, 4, 16, 8, 32, 16),), page_size=16, seed=3),
    # Tree verification: ragged prefixes, trees of different shapes.
    BatchSpec(ForwardMode.TARGET_VERIFY, (5, 23, 1), (4, 4, 4), (mha_layer(0), mha_layer(1, hk=8)), seed=4,
              spec=SpecInput(4, 2, 3, ((-1, 0, 0, 1), (-1, 0, 1, 2), (-1, 0, 0, 0)), (2, 3, 1))),
    BatchSpec(ForwardMode.TARGET_VERIFY, (9, 2), (3, 3), (MLALayer(0, 4, 16, 8, 32, 16),), seed=5,
              spec=SpecInput(3, 2, 2, ((-1, 0, 0), (-1, 0, 1)), (2, 3))),
    # A window during verification, by positions: siblings at depth 1 but rows 1..3.
    BatchSpec(ForwardMode.TARGET_VERIFY, (12, 3), (5, 5), (mha_layer(0, sliding_window=2), mha_layer(1)), seed=9,
              spec=SpecInput(5, 4, 3, ((-1, 0, 0, 0, 1), (-1, 0, 0, 1, 3)), (1, 3))),
    # Requests with an empty extend after a cached prefix, first and last.
    BatchSpec(ForwardMode.EXTEND, (6, 0, 9), (0, 4, 0), (mha_layer(0, sliding_window=3),), page_size=4, seed=10),
    BatchSpec(ForwardMode.DRAFT_EXTEND, (1, 11), (3, 1), (mha_layer(0, logit_cap=2.0),), seed=6,
              spec=SpecInput(3, 1, 2, ((-1, 0, 1), (-1, 0, 1)), (3, 1))),
    # mRoPE with an image inside the new tokens and one in the prefix.
    BatchSpec(ForwardMode.EXTEND, (4, 10), (12, 6), (mha_layer(0, d=16), MLALayer(1, 4, 16, 16, 32, 16)), seed=7,
              mrope=MropeLayout((2, 3, 3), (ImageSpan(0, 6, 1, 2, 3), ImageSpan(1, 1, 2, 2, 2)))),
    # Hybrid: linear layers interleaved with full attention.
    BatchSpec(ForwardMode.EXTEND, (0, 8), (5, 2), (mha_layer(0), LinearLayer(1, 2, 4, 16, 16), mha_layer(2)), seed=8),
], ids=["gqa-window-cap", "window-of-one", "decode-window", "mixed-mla", "verify-mha", "verify-mla", "verify-window",
        "empty-extends", "draft-extend", "mrope", "hybrid"])
def test_batched_equals_per_request_on_chosen_batches(grouping, spec):
    assert_batched_equals_per_request(spec)


def test_idle_batch_gives_empty_outputs_of_the_right_shape():
    spec = BatchSpec(ForwardMode.IDLE, (), (), (mha_layer(0, dv=24), MLALayer(1, 4, 16, 8, 32, 16),
                                                 LinearLayer(2, 2, 4, 16, 12)))
    result = batch.reference_outputs(materialize(spec))
    assert [tuple(o.shape) for o in result.outputs] == [(0, 8, 24), (0, 4, 16), (0, 4, 12)]
    assert result.linear_states[2].conv == [] and result.linear_states[2].ssm == []


def test_request_groups_cover_the_batch_and_bound_the_padding():
    spec = BatchSpec(ForwardMode.EXTEND, (0, 300, 5, 290, 0, 40), (200, 3, 180, 10, 1, 40), (mha_layer(0),))
    groups = batch.request_groups(spec, torch.device("cpu"))
    assert sorted(i for g in groups for i in g) == list(range(spec.batch_size))
    assert len(groups) > 1
    for g in groups:
        padded = len(g) * max(spec.extend_lens[i] for i in g) * max(spec.kv_lens[i] for i in g)
        needed = sum(spec.extend_lens[i] * spec.kv_lens[i] for i in g)
        assert padded <= max(batch.MAX_PADDING * needed, batch.PADDING_BUDGET["cpu"])
    assert len(batch.request_groups(spec, torch.device("cuda"))) == 1  # within a GPU's budget


def test_request_groups_bound_the_keys_they_gather():
    # 160 decode requests of 32k tokens pad perfectly, but one group would gather 5M float64 key rows
    spec = BatchSpec(ForwardMode.DECODE, (32767,) * 160, (1,) * 160, (mha_layer(0),), context_len=32768)
    groups = batch.request_groups(spec, torch.device("cuda"))
    assert sorted(i for g in groups for i in g) == list(range(160))
    assert all(len(g) * 32768 <= batch.MAX_KEY_ROWS for g in groups) and len(groups) == 10


def test_lightning_layers_read_a_carried_state_and_ignore_a_fresh_slot():
    # A request with a cached prefix starts from its slot's state; a fresh one from zeros, whatever its slot
    # holds (materialize fills it with garbage); in TARGET_VERIFY the state after every draft token is kept.
    from reference.lightning import decay_rates, lightning_attention

    layers = (MHALayer(0, 4, 2, 16, 16), LightningLayer(1, 2, 16))
    extend = BatchSpec(ForwardMode.EXTEND, (4, 0), (3, 5), layers, seed=3)
    case = materialize(extend, "cpu")
    ref = batch.reference_outputs(case)
    pool = case.mamba_pool_before.ssm_states[1].double()
    slots = case.forward_batch.state_slots.tolist()
    assert pool[slots[1]].abs().sum() > 0  # the fresh request's slot holds garbage the reference must not read
    decay = decay_rates(2, 1, 2)
    q, k, v = (case.inputs[1].tensors[n].double() for n in ("q", "k", "v"))
    first = lightning_attention(q[:3], k[:3], v[:3], decay, scale=16**-0.5, initial_state=pool[slots[0]])
    fresh = lightning_attention(q[3:], k[3:], v[3:], decay, scale=16**-0.5)
    torch.testing.assert_close(ref.outputs[1], torch.cat([first.o, fresh.o]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.linear_states[1].ssm[1], fresh.state, rtol=1e-12, atol=1e-12)
    assert ref.linear_states[1].conv[0].shape == (0, 0)  # no conv state

    chain = SpecInput(3, 1, 2, ((-1, 0, 1),), (2,))
    verify = BatchSpec(ForwardMode.TARGET_VERIFY, (5,), (3,), layers, spec=chain, seed=4)
    vcase = materialize(verify, "cpu")
    vref = batch.reference_outputs(vcase)
    assert vref.linear_states[1].ssm_steps[0].shape == (3, 2, 16, 16)
    torch.testing.assert_close(vref.linear_states[1].ssm_steps[0][-1], vref.linear_states[1].ssm[0])
