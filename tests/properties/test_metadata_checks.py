"""The plan invariants (properties/metadata.py, check_plan) reject each kind of wrong indptr they check."""

from __future__ import annotations

import dataclasses

import torch

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, MHALayer, SpecInput
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
