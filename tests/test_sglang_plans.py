"""SGLang's FlashAttention backend at plan level (backends/sglang/plans.py): built through SGLang's own factory, its
``init_forward_metadata`` run on CPU, its plan held to the metadata invariants; its kernels never run."""

from __future__ import annotations

import pytest
import torch

from backends.registry import all_compositions, parse
from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecInput
from properties import PROPERTIES
from search.matrix import matrix
from search.profiles import PROFILES
from tests.plan_checks import assert_eager_plan_holds

pytest.importorskip("sglang")

LAYERS = (MHALayer(0, 4, 2, 64, 64),)


def _available(name: str) -> None:
    why = parse(name).unavailable_reason("cpu")
    if why:
        pytest.skip(why)
    from backends.sglang import runtime

    runtime.load()  # a test that imports SGLang's modules itself finds them with the stand-ins a CPU install needs


def spec(mode, prefix, extend, page_size=1, **kw) -> BatchSpec:
    return BatchSpec(mode, tuple(prefix), tuple(extend), kw.pop("layers", LAYERS), page_size=page_size,
                     dtype="bfloat16", seed=kw.pop("seed", 3), **kw)


def tree(D: int, topk: int, B: int) -> SpecInput:
    parents = tuple((-1,) + tuple(range(D - 1)) for _ in range(B))  # a chain, drafted as topk would
    return SpecInput(draft_token_num=D, spec_steps=D, topk=topk, parents=parents, accept_lens=(1,) * B)


def test_plan_level_leaves_get_only_plan_level_rows_and_say_why():
    _available("sglang.fa3")
    m = matrix("cpu", PROFILES["ci"], ["sglang.fa3", "tbo(sglang.fa3)", "hybrid(sglang.fa3,sglang.gdn)"])
    assert {r.property.name for r in m.rows if r.composition.name != "graph"} == {"metadata", "conformance"}
    assert {r.property.name for r in m.rows if r.composition.name == "graph"} <= {"graph_metadata"}
    assert any(why.startswith("only its planning runs") for _, why in m.excluded)
    # a plan-level leaf stands where a built one does: alone, under SGLang's TBO, hybrid and prefill/decode wrappers,
    # and under graph(), whose plans it makes too
    wrapped = {c.name for c in all_compositions() if "sglang.fa3" in c.leaves() and not c.is_leaf}
    assert {"tbo", "hybrid", "pd", "graph"} <= wrapped


@pytest.mark.parametrize("batch", [
    spec(ForwardMode.EXTEND, (0, 5, 17), (7, 3, 1)),
    spec(ForwardMode.EXTEND, (0, 5, 17), (7, 3, 1), page_size=16),
    spec(ForwardMode.DECODE, (9, 40), (1, 1), page_size=4),
    spec(ForwardMode.MIXED, (4, 7), (3, 1)),
    spec(ForwardMode.TARGET_VERIFY, (6, 11), (4, 4), spec=tree(4, 1, 2)),  # a chain: prefix and drafts planned together
    spec(ForwardMode.TARGET_VERIFY, (6, 11), (4, 4), spec=tree(4, 2, 2)),  # a tree: the drafts planned apart
], ids=["extend", "extend-paged", "decode-paged", "mixed", "verify-chain", "verify-tree"])
@pytest.mark.parametrize("composition", ["sglang.fa3", "tbo(sglang.fa3)"])
def test_flash_attention_plans_satisfy_the_invariants(batch, composition):
    _available("sglang.fa3")
    assert_eager_plan_holds(composition, batch)


@pytest.mark.parametrize("fault, expected", [
    ("page_table", "kv_indices hold"),  # each request's first key read from the slot after its own
    ("cache_seqlens", "key lengths"),  # one key too few
    ("cu_seqlens_k", "key indptr"),  # the prefix sum of the lengths without its last step
    ("cu_seqlens_q", "qo_indptr"),
])
def test_a_wrong_flash_attention_plan_fails_the_metadata_property(monkeypatch, fault, expected):
    # The check reads FlashAttention's own plan: a plan that is wrong in any of its fields is caught
    _available("sglang.fa3")
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    planned = FlashAttentionBackend.init_forward_metadata

    def wrong(self, forward_batch):
        planned(self, forward_batch)
        meta = self.forward_metadata
        if fault == "page_table":
            meta.page_table = meta.page_table + 1
        elif fault == "cache_seqlens":
            meta.cache_seqlens_int32 = meta.cache_seqlens_int32 - 1
        elif fault == "cu_seqlens_k":
            meta.cu_seqlens_k = meta.cu_seqlens_k.clone()
            meta.cu_seqlens_k[-1] -= 1
        else:
            meta.cu_seqlens_q = meta.cu_seqlens_q.clone()
            meta.cu_seqlens_q[1] += 1

    monkeypatch.setattr(FlashAttentionBackend, "init_forward_metadata", wrong)
    verdict = PROPERTIES["metadata"].run(parse("sglang.fa3"), spec(ForwardMode.EXTEND, (5, 3), (2, 4)), "cpu")
    assert not verdict.ok and expected in verdict.reason, str(verdict)


def test_a_plan_level_leaf_runs_no_kernel():
    # Its layers refuse to run (the reason named), and sgl_kernel's stand-in raises when a kernel is called
    _available("sglang.fa3")
    from backends.base import Capabilities
    from backends.registry import leaf_class
    from batch.forward_batch import ModelRunner
    from engine.materialize import materialize

    batch = spec(ForwardMode.DECODE, (5,), (1,))
    case = materialize(batch, "cpu")
    backend = leaf_class("sglang.fa3")(ModelRunner.of(case.forward_batch, batch.layers))
    assert isinstance(backend.capabilities, Capabilities) and backend.capabilities.plan_only
    backend.init_forward_metadata(case.forward_batch)
    # FA3's decode scheduler, the one kernel on its planning path, answered as SGLang answers it itself with the
    # precompute off: no schedule
    assert backend.inner.forward_metadata.scheduler_metadata is None
    with pytest.raises(RuntimeError, match="plan-level leaf"):
        backend._run(None, None, None, None, case.forward_batch, True)
    import sgl_kernel

    if getattr(sgl_kernel, "__file__", "").startswith("<inert stub"):
        with pytest.raises(RuntimeError, match="inert stub"):
            sgl_kernel.merge_state_v2(None, None, None, None)


@pytest.mark.parametrize("composition", ["graph(sglang.fa3)", "graph(sglang.triton)"])
@pytest.mark.parametrize("batch", [
    spec(ForwardMode.DECODE, (9, 40, 3), (1, 1, 1), page_size=4),  # 3 requests replayed in a graph of 4: one padded
    spec(ForwardMode.TARGET_VERIFY, (6, 11, 2), (2, 2, 2), spec=tree(2, 1, 3)),
], ids=["decode-padded", "verify-padded"])
def test_a_replayed_graph_plan_is_held_to_the_batch_padded_rows_included(composition, batch):
    _available(composition.removeprefix("graph(").removesuffix(")"))
    c = parse(composition)
    if c.unsupported_reason(batch) or PROPERTIES["graph_metadata"].applies(c, batch.mode):
        pytest.skip(c.unsupported_reason(batch) or PROPERTIES["graph_metadata"].applies(c, batch.mode))
    verdict = PROPERTIES["graph_metadata"].run(c, batch, "cpu")
    assert verdict.ok and "1 padded row" in verdict.reason, str(verdict)


@pytest.mark.parametrize("mutant, composition, expected", [
    ("sglang_fa3_replay_keeps_capture_plan", "graph(sglang.fa3)", "key lengths"),  # a stale plan
    ("sglang_triton_replay_pads_real_rows", "graph(sglang.triton)", "kv_indices hold"),  # padding over real rows
])
def test_a_replay_that_does_not_plan_the_real_batch_is_caught(mutant, composition, expected):
    _available(composition.removeprefix("graph(").removesuffix(")"))
    from harness.mutants.catalogue import SGLANG_CATALOGUE

    batch = spec(ForwardMode.DECODE, (9, 40, 3), (1, 1, 1), page_size=4)
    with next(m for m in SGLANG_CATALOGUE if m.name == mutant).patch():
        verdict = PROPERTIES["graph_metadata"].run(parse(composition), batch, "cpu")
    assert not verdict.ok and "at replay" in verdict.reason and expected in verdict.reason, str(verdict)


def _draft(prefix, topk, steps, page_size):
    from batch.spec import draft_forest

    forest = draft_forest(topk, steps)
    return spec(ForwardMode.DRAFT_DECODE, prefix, (len(forest),) * len(prefix), page_size=page_size,
                spec=SpecInput(len(forest), topk, steps, (forest,) * len(prefix), (1,) * len(prefix)))


DRAFTS = [_draft((5, 40), 1, 3, 16), _draft((5, 40), 2, 3, 1), _draft((7, 20, 33), 3, 3, 16)]


@pytest.mark.parametrize("batch", DRAFTS, ids=["chain-paged", "tree", "tree-paged"])
@pytest.mark.parametrize("composition, prop", [("sglang.fa3", "metadata"), ("graph(sglang.fa3)", "graph_metadata")])
def test_flash_attentions_draft_steps_each_read_their_branch(batch, composition, prop):
    # FlashAttentionMultiStepBackend: step i adds i + 1 to the committed lengths; over trees it attends the prefix per
    # request and each branch's own keys apart (with pages, the prefix's last partial page from the branch's copy of
    # it), read as one decode per branch
    _available("sglang.fa3")
    verdict = PROPERTIES[prop].run(parse(composition), batch, "cpu")
    assert verdict.ok, str(verdict)


def test_a_paged_tree_draft_planned_over_lengths_an_earlier_step_cut_fails(monkeypatch):
    # FlashAttention subtracts each request's last partial page in place from seq_lens.to(torch.int32): over int32
    # lengths (SGLang's scheduler hands int64; the adapter once handed int32) the first step cut them for the next
    _available("sglang.fa3")
    from backends.sglang import draft

    translate = draft.SglangMultiStepDraft._translate

    def int32(self, fb, graph):
        sfb = translate(self, fb, graph)
        sfb.seq_lens, sfb.seq_lens_cpu = sfb.seq_lens.to(torch.int32), sfb.seq_lens_cpu.to(torch.int32)
        return sfb

    monkeypatch.setattr(draft.SglangMultiStepDraft, "_translate", int32)
    verdict = PROPERTIES["metadata"].run(parse("sglang.fa3"), DRAFTS[2], "cpu")
    assert not verdict.ok and "draft step 1: key lengths" in verdict.reason, str(verdict)
