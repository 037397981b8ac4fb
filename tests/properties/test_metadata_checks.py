"""The plan invariants (properties/metadata.py, check_plan) reject each kind of wrong indptr they check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecInput
from properties import PROPERTIES
from properties.metadata import check_plan, planned, planned_leaves

VERIFY = BatchSpec(ForwardMode.TARGET_VERIFY, (4, 7, 2), (3, 3, 3), (MHALayer(0, 4, 2, 32, 32),),
                   spec=SpecInput(3, 2, 2, ((-1, 0, 0), (-1, 0, 1), (-1, 0, 0)), (2, 3, 1)), seed=4)


def test_a_verify_plans_mask_offsets_are_checked(device):
    (backend, fb), = planned_leaves(*planned(parse("torch_native"), VERIFY, device))
    meta = backend.planned_metadata()
    assert meta.mask_indptr is not None and check_plan(meta, fb) is None
    D, seq = 3, fb.seq_lens_cpu.tolist()
    # each request's tree mask taken as D x seq_len: its drafts' own D columns forgotten (the mutant
    # sglang_triton_verify_replay_mask_without_drafts does this in SGLang's Triton replay)
    short = torch.zeros(len(seq) + 1, dtype=torch.int64)
    short[1:] = torch.cumsum(torch.tensor([D * n for n in seq]), 0)
    problem = check_plan(dataclasses.replace(meta, mask_indptr=short.to(meta.mask_indptr.device)), fb)
    assert problem == f"mask_indptr[-1] = {int(short[-1])}, expected {sum(D * (n + D) for n in seq)}"
    moved = meta.mask_indptr.clone()
    moved[1] -= D  # the first request's mask a row short, the total unchanged
    problem = check_plan(dataclasses.replace(meta, mask_indptr=moved), fb)
    assert problem.startswith("mask_indptr steps") and "expected D*(seq_len+D) per request" in problem
    shifted = meta.qo_indptr.clone()
    shifted[1] += 1  # a boundary moved by one token: the totals still agree
    assert check_plan(dataclasses.replace(meta, qo_indptr=shifted), fb).startswith("qo_indptr steps")


# Two requests with more keys than a window of 6 and one with fewer; a full layer beside the window layer (SGLang has
# one window per model, and plans one window list for its window layers)
WINDOWED = BatchSpec(ForwardMode.DECODE, (11, 3, 9), (1, 1, 1),
                     (MHALayer(0, 4, 2, 32, 32, sliding_window=6), MHALayer(1, 4, 2, 32, 32)), seed=5)


@pytest.mark.skipif(parse("sglang.triton").unavailable_reason("cpu") is not None,
                    reason=str(parse("sglang.triton").unavailable_reason("cpu")))
def test_a_window_layers_own_key_lists_are_checked():
    """SGLang's Triton plans a sliding-window layer's keys apart (window_kv_indptr/indices): each request's list must
    be the last keys of its range, at least the window's worth; a list from the row's start, one cut short, one
    planned without its indices, and wrong offsets are each named."""
    (backend, fb), = planned_leaves(*planned(parse("sglang.triton"), WINDOWED, "cpu"))
    meta = backend.planned_metadata()
    assert meta.window == 6 and meta.window_kv_indptr is not None and check_plan(meta, fb) is None
    lens = meta.window_kv_indptr.diff().tolist()
    assert lens == [6, 4, 6], lens  # min(keys, window): decode's keys include the new token
    assert "attn_logits" in meta.unread and "num_kv_splits" in meta.unread  # said, not silently skipped
    row = fb.req_to_token[fb.req_pool_indices[0]].to("cpu", torch.int64)
    from_start = meta.window_kv_indices.clone()
    from_start[:6] = row[:6].to(from_start.device)  # request 0's first six slots, not its last six
    problem = check_plan(dataclasses.replace(meta, window_kv_indices=from_start), fb)
    assert problem.startswith("request 0: window_kv_indices hold") and "(its first ones), expected the last 6 of its " \
        "12 keys" in problem
    short = meta.window_kv_indptr.clone()
    short[1:] -= 1  # request 0's list one key short of the window (the rest shifted with it)
    problem = check_plan(
        dataclasses.replace(meta, window_kv_indptr=short, window_kv_indices=meta.window_kv_indices[1:]), fb)
    assert problem == "request 0: 5 window keys, expected at least min(12 keys, window 6) = 6 and at most 12"
    assert check_plan(dataclasses.replace(meta, window_kv_indices=None), fb) == \
        "window_kv_indptr planned without window_kv_indices"
    offsets = torch.tensor([6, 0, 3])  # each list's start in its range: 12 - 6, 4 - 4, 10 - 6 (the last one wrong)
    problem = check_plan(dataclasses.replace(meta, window_kv_offsets=offsets), fb)
    assert problem == "request 2: window_kv_offsets 3, expected 4 (its window's 6 keys end its 10)"
    # lists without the window they are for can only come from the harness's own reader: an adapter error, never a
    # finding against SGLang
    from properties.blame import adapter_frame

    with pytest.raises(ValueError, match="the harness's plan reader is wrong") as raised:
        check_plan(dataclasses.replace(meta, window=None), fb)
    assert adapter_frame(raised.value, parse("sglang.triton")) is not None


@pytest.mark.skipif(parse("sglang.triton").unavailable_reason("cpu") is not None,
                    reason=str(parse("sglang.triton").unavailable_reason("cpu")))
def test_a_passing_plan_verdict_names_the_fields_no_invariant_reads():
    """Eager and at a graph's replay, a passing verdict names the tensor fields of SGLang's plan that no invariant
    reads (Triton's split counts and scratch buffers), once each: what is not checked is said, not skipped."""
    from properties import PROPERTIES

    for prop, composition in (("metadata", "sglang.triton"), ("graph_metadata", "graph(sglang.triton)")):
        verdict = PROPERTIES[prop].run(parse(composition), WINDOWED, "cpu")
        assert verdict.ok, verdict.reason
        named = verdict.reason.split("; fields no invariant reads: ")[1].split(", ")
        assert "SglangTriton.num_kv_splits" in named and "SglangTriton.window_num_kv_splits" in named, verdict.reason
        assert len(named) == len(set(named)) and not any("window_kv_indices" in n for n in named), verdict.reason


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.DRAFT_DECODE])
def test_a_req_to_token_row_changed_while_the_layers_ran_is_said_not_checked_against(monkeypatch, mode):
    # Nothing in a forward pass writes req_to_token: a change is a stray write (an H200's TBO-over-GDN batch read a
    # reserved page 0 there, harness-out/gpu96.sh), and every plan would be judged against it
    from batch.spec import SpecInput, draft_forest
    from properties import metadata as md

    ran = md.run_case

    def stray(*args, **kwargs):
        run = ran(*args, **kwargs)
        fb = run.case.forward_batch
        fb.req_to_token[fb.req_pool_indices[0], 1] = 0  # page and slot 0 are reserved: never a request's
        return run

    monkeypatch.setattr(md, "run_case", stray)
    layers = (MHALayer(0, 4, 2, 32, 32),)
    if mode is ForwardMode.DECODE:
        spec = BatchSpec(mode, (5, 9), (1, 1), layers, seed=1)
    else:
        forest = draft_forest(1, 2)
        spec = BatchSpec(mode, (5, 9), (1, 1), layers, seed=1,
                         spec=SpecInput(len(forest), 1, 2, (forest,) * 2, (1, 1)))
    verdict = PROPERTIES["metadata"].run(parse("torch_native"), spec, "cpu")
    assert not verdict.ok and "request 0's req_to_token row changed during the forward pass (column 1 holds 0" in \
        verdict.reason, str(verdict)
    monkeypatch.setattr(md, "run_case", ran)
    assert PROPERTIES["metadata"].run(parse("torch_native"), spec, "cpu").ok


def test_what_a_draft_loops_plans_read_is_told_apart():
    # properties/metadata.py draft_plans_read, which the MLA draft entries of the ledger read: exactly the committed
    # prefix, its counts alone, or neither (the right plan among them)
    from backends.base import PlannedMetadata
    from batch.spec import draft_forest
    from engine.materialize import materialize
    from properties.metadata import draft_plans_read, draft_step_batch

    forest = draft_forest(1, 3)
    spec = BatchSpec(ForwardMode.DRAFT_DECODE, (5, 9), (2, 2), (MHALayer(0, 4, 2, 32, 32),), seed=1,
                     spec=SpecInput(len(forest), 1, 3, (forest,) * 2, (1, 1)))
    fb = materialize(spec).forward_batch

    def plan(step, shift=0):
        want = draft_step_batch(spec, fb, step)
        rows = [want.req_to_token[i, :want.extend_prefix_lens_cpu[i] + 1] for i in range(want.batch_size)]
        lens = torch.tensor([r.numel() for r in rows])
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        return PlannedMetadata(qo_indptr=torch.arange(want.batch_size + 1), kv_indptr=indptr,
                               kv_indices=torch.cat(rows).roll(shift), kv_includes_new_tokens=True)
    assert draft_plans_read([plan(-1), plan(-1)], spec, fb) == "committed prefix"
    assert draft_plans_read([plan(-1, shift=1), plan(-1)], spec, fb) == "committed prefix lengths"
    assert draft_plans_read([plan(0), plan(1)], spec, fb) is None  # what a right container plans
    assert draft_plans_read([plan(-1), plan(1)], spec, fb) is None
