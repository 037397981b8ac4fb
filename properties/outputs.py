"""Outputs agree with the reference: finite, one row per query token, within the dtype's bound; and the
linear-attention states left in the pools agree with the reference's states."""

from __future__ import annotations

from backends.registry import Composition
from batch.spec import BatchSpec, is_recurrent
from properties.run import Run, run_case
from properties.tolerances import layer_bound
from properties.verdict import Verdict, Worst, compare, compare_outputs

NAME = "outputs"


def linear_state_comparisons(run: Run, composition: Composition, device: str, worst: Worst, layers=None) -> None:
    """Pool states at each request's slot vs the reference (per draft position in TARGET_VERIFY), of ``layers`` (by
    default every layer of the batch; only the recurrent ones have states)."""
    spec, pool = run.case.spec, run.case.forward_batch.mamba_pool
    slots = run.case.forward_batch.state_slots.tolist()
    for layer in spec.layers if layers is None else layers:
        if not is_recurrent(layer):
            continue
        expected = run.reference.linear_states[layer.layer_id]
        bound = layer_bound(composition, spec, layer, device)
        for i, slot in enumerate(slots):
            if spec.mode.is_target_verify():
                n = spec.extend_lens[i]
                pairs = [(pool.intermediate_ssm_states[layer.layer_id][slot, :n], expected.ssm_steps[i], "ssm steps"),
                         (pool.intermediate_conv_states[layer.layer_id][slot, :n], expected.conv_steps[i], "conv steps")]
            else:
                pairs = [(pool.ssm_states[layer.layer_id][slot], expected.ssm[i], "ssm state"),
                         (pool.conv_states[layer.layer_id][slot], expected.conv[i], "conv state")]
            for actual, exp, what in pairs:
                worst.add(compare(actual, exp, bound, label=f"layer {layer.layer_id} request {i} {what}:"), bound)


def judge(name: str, run: Run, composition: Composition, device: str, what: str) -> Verdict:
    """``run``'s outputs and linear states against its reference: one row per query token, each layer within the
    dtype's bound. A verdict of property ``name``; ``what`` says what was compared (a failure's reason leads
    with it)."""
    spec = run.case.spec
    for layer, out in zip(spec.layers, run.execution.outputs):
        if out.shape[0] != spec.num_tokens:
            return Verdict(name, False, f"{what}: layer {layer.layer_id} returned {out.shape[0]} rows for "
                                        f"{spec.num_tokens} query tokens")
    worst = Worst()
    compare_outputs(run.execution.outputs, run.reference, composition, spec, device, worst)
    linear_state_comparisons(run, composition, device, worst)
    verdict = worst.verdict(name, what)
    drafter = run.execution.backend
    if not verdict.ok and spec.mode.is_draft_decode() and hasattr(drafter, "step_plans"):
        # what the draft steps' plans read, where the container keeps them (the ledger reads it)
        from properties.metadata import draft_plans_read

        verdict.details["draft_step_reads"] = draft_plans_read(drafter.step_plans(), spec, run.case.forward_batch)
    return verdict


def outputs_match_reference(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    return judge(NAME, run_case(composition, spec, device), composition, device,
                 "outputs and states vs float64 reference")
