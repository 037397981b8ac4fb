"""The draft loop as a draft worker runs it (SGLang: ``EagleWorkerV2.draft`` then ``draft_forward``): the multi-step
draft backend plans every step once, then each step runs the draft model's layers on its own step backend,
``topk`` tokens per request, one more position each step.

A DRAFT_DECODE batch holds every step's tokens (``BatchSpec``: each request's branches one after the other, step by
step within a branch); the loop takes step i's rows, request by request and branch by branch (SGLang's order of a
draft step's tokens), and puts each step's outputs back in the batch's row order.
"""

from __future__ import annotations

import dataclasses

import torch

from batch.forward_batch import ForwardBatch, LayerInputs
from batch.spec import BatchSpec, ForwardMode
from engine.model import run_layer


def step_rows(spec: BatchSpec, step: int) -> torch.Tensor:
    """The batch rows of draft step ``step``: for each request, each branch's token of that step."""
    K, n = spec.spec.topk, spec.spec.spec_steps - 1
    rows, start = [], 0
    for e in spec.extend_lens:
        rows.extend(start + j * n + step for j in range(K))
        start += e
    return torch.tensor(rows, dtype=torch.int64)


def step_view(fb: ForwardBatch, rows: torch.Tensor) -> ForwardBatch:
    """What the draft model holds at one step: a decode batch (SGLang's draft batch is one) with that step's
    positions and write slots."""
    idx = rows.to(fb.device)
    return dataclasses.replace(fb, forward_mode=ForwardMode.DECODE, positions=fb.positions[idx],
                               out_cache_loc=fb.out_cache_loc[idx],
                               extend_num_tokens=rows.numel(), num_token_non_padded=rows.numel())


def run_draft_steps(drafter, spec: BatchSpec, fb: ForwardBatch, inputs: list[LayerInputs], weights,
                    fused_qkv: bool = False) -> list[torch.Tensor]:
    """Plan the loop once, run every step's layers on its step backend; one output per layer, in batch row order."""
    drafter.init_forward_metadata(fb)
    outputs: list[torch.Tensor | None] = [None] * len(spec.layers)
    for step in range(spec.spec.spec_steps - 1):
        rows = step_rows(spec, step)
        view = step_view(fb, rows)
        backend = drafter.attn_backends[step]
        for n, (layer, inp, w) in enumerate(zip(spec.layers, inputs, weights)):
            step_inputs = LayerInputs({name: t[rows.to(t.device)] for name, t in inp.tensors.items()})
            out = run_layer(backend, layer, step_inputs, w, view, spec.mrope_sections, fused_qkv)
            if outputs[n] is None:
                outputs[n] = out.new_empty((spec.num_tokens,) + tuple(out.shape[1:]))
            outputs[n][rows.to(out.device)] = out
    return outputs
