"""The draft loop (DRAFT_DECODE): the batch's layout, our multi-step draft container, SGLang's, and the faults each
property catches there."""

from __future__ import annotations

import dataclasses

import pytest

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecError, SpecInput, draft_forest, draft_step_rows
from engine.materialize import materialize
from harness.mutants.catalogue import MUTANTS, SGLANG_CATALOGUE
from properties import PROPERTIES

MHA = MHALayer(0, 4, 2, 32, 32)


def draft(prefix, topk, steps, page_size=1, layers=(MHA,), seed=7):
    forest = draft_forest(topk, steps)
    return BatchSpec(ForwardMode.DRAFT_DECODE, prefix, (len(forest),) * len(prefix), layers, page_size=page_size,
                     spec=SpecInput(len(forest), topk, steps, (forest,) * len(prefix), (1,) * len(prefix)), seed=seed)


def test_a_draft_batch_holds_every_branch_of_every_step():
    spec = draft((5, 9), topk=2, steps=4)
    assert draft_forest(2, 4) == (-1, 0, 1, -1, 3, 4)  # two branches of three steps
    # positions: the prefix, then each branch's depth (its step)
    assert spec.positions() == [5, 6, 7, 5, 6, 7, 9, 10, 11, 9, 10, 11]
    assert spec.seq_lens == (5, 9)  # the committed lengths, as SGLang's draft batch has them
    assert spec.cache_lens == (5 + 8, 9 + 8)  # every branch keeps spec_steps slots; the last step's is never written
    # a step sees its prefix and its own branch: what bounds and the window ledger conditions count, not every branch
    assert spec.keys_seen == (5 + 3, 9 + 3) and spec.kv_lens == (5 + 6, 9 + 6)
    assert spec.new_token_columns(0) == [5, 6, 7, 9, 10, 11]  # branch j's step s at prefix + j * steps + s
    # one draft step: each request's branches in turn (SGLang's order of a step's tokens)
    assert draft_step_rows(2, 2, 4, 1) == [1, 4, 7, 10]


def test_materialized_draft_slots_follow_sglangs_cache_rows():
    spec = draft((3, 6), topk=3, steps=3)
    fb = materialize(spec).forward_batch
    loc = fb.out_cache_loc.tolist()
    # SGLang's layout, by hand: branch j's step s at column prefix + j * spec_steps + s (steps 0 and 1 are written;
    # column prefix + j * 3 + 2, the last step's, is allocated and never written)
    columns = [[3, 4, 6, 7, 9, 10], [6, 7, 9, 10, 12, 13]]
    rows = fb.req_pool_indices.tolist()
    assert loc == [int(fb.req_to_token[rows[i], c]) for i in range(2) for c in columns[i]]
    assert len(set(loc)) == len(loc)
    allocated = {int(fb.req_to_token[rows[i], spec.prefix_lens[i] + c]) for i in range(2) for c in range(9)}
    assert set(loc) < allocated and len(allocated) == 18  # every draft slot distinct, the last steps' unused


@pytest.mark.parametrize("change, message", [
    (dict(spec_steps=1), "spec_steps >= 2"),
    (dict(parents=((-1, 0, 1, -1), (-1, 0, 1, -1))), "draft_forest"),
    (dict(accept_lens=(2, 1)), "accept nothing"),
    (dict(page_size=4), "paged tree layout"),
])
def test_an_impossible_draft_batch_is_one_line(change, message):
    forest = draft_forest(2, 3)
    s = dict(draft_token_num=len(forest), topk=2, spec_steps=3, parents=(forest, forest), accept_lens=(1, 1))
    page_size = change.pop("page_size", 1)
    s.update(change)
    with pytest.raises(SpecError, match=message) as e:
        BatchSpec(ForwardMode.DRAFT_DECODE, (4, 5), (len(forest),) * 2, (MHA,), page_size=page_size,
                  spec=SpecInput(**s))
    assert "\n" not in str(e.value)


def test_draft_decode_rows_are_leaves_and_graphs_of_leaves_only():
    assert ForwardMode.DRAFT_DECODE in parse("torch_native").support().modes
    assert ForwardMode.DRAFT_DECODE in parse("graph(triton)").support().modes  # the draft graph runner
    for term in ("tbo(torch_native)", "graph(tbo(triton))", "hybrid(torch_native,linear_torch)"):
        assert ForwardMode.DRAFT_DECODE not in parse(term).support().modes, term


@pytest.mark.parametrize("prop", ["outputs", "metadata"])
def test_branches_keyed_by_another_branch_are_caught(prop, device):
    spec = draft((5, 9), topk=3, steps=3)
    comp = parse("torch_native")
    assert PROPERTIES[prop].run(comp, spec, device).ok
    with MUTANTS["draft_branches_read_first_branch"].patch():
        verdict = PROPERTIES[prop].run(comp, spec, device)
    assert not verdict.ok, str(verdict)


def _sglang_triton(device):
    comp = parse("sglang.triton")
    why = comp.unavailable_reason(device)
    if why:
        pytest.skip(why)
    return comp


@pytest.mark.parametrize("topk, steps, page_size", [(3, 3, 1), (1, 4, 4)], ids=["tree", "paged-chain"])
def test_sglangs_multi_step_draft_backend_answers_every_step(topk, steps, page_size, device):
    comp = _sglang_triton(device)
    spec = draft((6, 11), topk=topk, steps=steps, page_size=page_size)
    for prop in ("outputs", "cache", "metadata"):
        verdict = PROPERTIES[prop].run(comp, spec, device)
        assert verdict.ok, f"{prop}: {verdict}"


def test_a_draft_step_left_with_the_previous_steps_plan_is_caught(device):
    comp = _sglang_triton(device)
    spec = draft((6, 11), topk=2, steps=3)
    with next(m for m in SGLANG_CATALOGUE if m.name == "sglang_triton_draft_step_keeps_previous_plan").patch():
        outputs = PROPERTIES["outputs"].run(comp, spec, device)
        metadata = PROPERTIES["metadata"].run(comp, spec, device)
    assert not outputs.ok and "out of bounds" in outputs.reason, str(outputs)
    # step 1 planned as step 0: each branch's keys stop one short, before its own new token
    assert not metadata.ok and metadata.reason.startswith("draft step 1: request 0: kv_indices hold"), str(metadata)


@pytest.mark.parametrize("prop", ["graph_replay", "graph_metadata"])
def test_sglangs_draft_loop_replays_in_a_graph_as_eagerly(prop, device):
    _sglang_triton(device)
    comp = parse("graph(sglang.triton)")
    spec = dataclasses.replace(draft((6, 11, 3), topk=2, steps=3), graph_padding=1)  # 3 requests in a graph of 4
    assert ForwardMode.DRAFT_DECODE in comp.support().modes
    verdict = PROPERTIES[prop].run(comp, spec, device)
    assert verdict.ok and "at 4 x 2 branches x 2 steps" in verdict.reason, str(verdict)
    with next(m for m in SGLANG_CATALOGUE if m.name == "sglang_triton_draft_replay_keeps_capture_plan").patch():
        broken = PROPERTIES[prop].run(comp, spec, device)
    assert not broken.ok, str(broken)


@pytest.mark.parametrize("prop", ["graph_replay", "graph_metadata"])
def test_our_draft_loop_replays_in_a_graph_and_a_stale_branch_table_is_caught(prop, device):
    if parse("triton").unavailable_reason(device):
        pytest.skip(parse("triton").unavailable_reason(device))
    comp = parse("graph(triton)")
    spec = dataclasses.replace(draft((6, 11, 3), topk=2, steps=3), graph_padding=1)
    verdict = PROPERTIES[prop].run(comp, spec, device)
    assert verdict.ok and "at 4 x 2 branches x 2 steps" in verdict.reason, str(verdict)
    with MUTANTS["draft_graph_table_kept_from_capture"].patch():
        broken = PROPERTIES[prop].run(comp, spec, device)
    assert not broken.ok, str(broken)
