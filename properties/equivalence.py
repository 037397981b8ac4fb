"""Equivalences between runs that must compute the same function (DESIGN.md section 5):
TBO split == unsplit; chunked prefill == one extend; prefill then decode == one prefill; verify of a
chain == extend of the same tokens, and committing the accepted state == extending by the accepted tokens.
"""

from __future__ import annotations

import torch

from backends.registry import Composition
from batch.case import TORCH_DTYPES
from batch.forward_batch import LayerInputs, ModelRunner
from batch.spec import RECURRENT_KINDS, BatchSpec, ForwardMode, is_recurrent
from batch.tbo_split import sub_batch
from engine.execute import execute
from engine.materialize import materialize
from engine.model import run_layers
from properties.outputs import linear_state_comparisons
from properties.run import Run, run_case
from properties.tolerances import input_dtype, layer_bound, widen_for_cancellation
from properties.verdict import Verdict, Worst, compare, compare_outputs, token_starts
from reference.batch import reference_outputs


def tbo_split_equals_unsplit(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    name = "tbo_split"
    split_run = run_case(composition, spec, device)
    if split_run.execution.split is None:
        return Verdict(name, True, "this batch does not split (a half would be empty); ran unsplit through the wrapper")
    inner = composition.children[0]
    whole = execute(inner, materialize(spec, device))
    worst = Worst()
    starts = token_starts(spec)
    reference = split_run.reference
    for layer, a, b, expected in zip(spec.layers, split_run.execution.outputs, whole.outputs, reference.outputs):
        bound = widen_for_cancellation(layer_bound(composition, spec, layer, device), expected,
                                       reference.magnitudes.get(layer.layer_id))
        worst.add(compare(a, b.to(torch.float64), bound, starts, f"layer {layer.layer_id}: split vs unsplit",
                          reference.element_scales.get(layer.layer_id), reference.score_sizes.get(layer.layer_id)),
                  bound)
    s = split_run.execution.split
    kind = "two-chunk" if s.two_chunk else "balanced"
    return worst.verdict(name, f"{kind} split at request {s.split_seq}, token {s.split_token}")


def _chunked(composition: Composition, spec: BatchSpec, device: str, first_part, name: str) -> Verdict:
    case = materialize(spec, device)
    reference = reference_outputs(case)
    fb = case.forward_batch
    starts = token_starts(spec)
    e1 = [min(first_part(e), e) for e in spec.extend_lens]  # a request with an empty extend has no first part
    tok1 = torch.tensor([starts[i] + j for i, n in enumerate(e1) for j in range(n)], dtype=torch.int64)
    reqs2 = [i for i, e in enumerate(spec.extend_lens) if e > e1[i]]
    tok2 = torch.tensor([starts[i] + j for i in reqs2 for j in range(e1[i], spec.extend_lens[i])], dtype=torch.int64)
    if not reqs2:
        return Verdict(name, True, "no request has a second chunk")
    e2 = [spec.extend_lens[i] - e1[i] for i in reqs2]
    mode2 = ForwardMode.DECODE if all(e == 1 for e in e2) else ForwardMode.EXTEND
    batch1 = sub_batch(fb, slice(0, spec.batch_size), tok1.to(fb.device), list(spec.prefix_lens), e1)
    batch2 = sub_batch(fb, torch.tensor(reqs2, device=fb.device), tok2.to(fb.device),
                       [spec.prefix_lens[i] + e1[i] for i in reqs2], e2, mode=mode2)
    backend = composition.build(spec, ModelRunner.of(fb, spec.layers))
    # Each layer's outputs in the precision it computes in (lightning layers: float32, whatever the batch's dtype)
    outs = [torch.empty_like(o, dtype=TORCH_DTYPES[input_dtype(spec, layer)])
            for o, layer in zip(reference.outputs, spec.layers)]
    for batch, tok in ((batch1, tok1), (batch2, tok2)):
        inputs = [LayerInputs({k: t[tok.to(t.device)] for k, t in inp.tensors.items()}) for inp in case.inputs]
        for out, part in zip(outs, run_layers(backend, batch, spec.layers, inputs, case.weights, spec.mrope_sections)):
            out[tok.to(out.device)] = part.to(out.dtype)
    worst = Worst()
    compare_outputs(outs, reference, composition, spec, device, worst, "chunked ")
    linear_state_comparisons(Run(case, None, reference), composition, device, worst)
    return worst.verdict(name, f"first chunk {e1}, then {'decode' if mode2 is ForwardMode.DECODE else 'extend'} {e2}")


def chunked_prefill_equals_whole(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    return _chunked(composition, spec, device, lambda e: (e + 1) // 2, "chunked_prefill")


def prefill_then_decode_equals_prefill(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    return _chunked(composition, spec, device, lambda e: max(e - 1, 1), "prefill_then_decode")


def verify_chain_equals_extend(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    """Verify (chain trees) == extend of the same tokens; then committing the accepted state == the
    reference state after the accepted tokens."""
    name = "verify_chain"
    if not spec.spec.is_chain():
        return Verdict(name, True, "not applicable: the draft trees are not chains")
    run = run_case(composition, spec, device)
    worst = Worst()
    compare_outputs(run.execution.outputs, run.reference, composition, spec, device, worst, "verify ")
    case = materialize(spec, device)
    fb = case.forward_batch
    as_extend = sub_batch(fb, slice(0, spec.batch_size), slice(0, spec.num_tokens), list(spec.prefix_lens),
                          list(spec.extend_lens), mode=ForwardMode.EXTEND)
    outs = run_layers(composition.build(spec, ModelRunner.of(fb, spec.layers)), as_extend, spec.layers, case.inputs,
                      case.weights, spec.mrope_sections)
    compare_outputs(outs, run.reference, composition, spec, device, worst, "as extend ")
    if spec.attention_kinds & RECURRENT_KINDS:
        run.execution.backend.update_mamba_state_after_mtp_verify(fb.spec_info.accept_length - 1)
        pool, slots = run.case.forward_batch.mamba_pool, run.case.forward_batch.state_slots.tolist()
        for layer in spec.layers:
            if not is_recurrent(layer):
                continue
            bound = layer_bound(composition, spec, layer, device)
            steps = run.reference.linear_states[layer.layer_id]
            for i, (slot, n) in enumerate(zip(slots, spec.spec.accept_lens)):
                worst.add(compare(pool.ssm_states[layer.layer_id][slot], steps.ssm_steps[i][n - 1], bound,
                                  label=f"layer {layer.layer_id} request {i} committed ssm:"), bound)
                worst.add(compare(pool.conv_states[layer.layer_id][slot], steps.conv_steps[i][n - 1], bound,
                                  label=f"layer {layer.layer_id} request {i} committed conv:"), bound)
    return worst.verdict(name, "verify vs extend vs reference, and the committed states")
