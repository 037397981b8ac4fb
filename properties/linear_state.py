"""Committing verified linear-attention states (DESIGN.md section 3; SGLang's
``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``).

A TARGET_VERIFY forward keeps, for every draft position, the state after it; which one becomes the request's
state is decided afterwards, by how many drafts were accepted. So one verify must serve every accept length:
after it, for each possible last accepted position ``r`` (0 .. D-1), the commit is made again from the same
post-verify pools, with requests given different positions in one commit (request ``i`` gets ``(r + i) % D``),
so every request is committed at every position and a commit that applies one request's position to another
shows. The radix cache's tracked copy goes along: request ``i``'s state after a second position (or none, -1)
goes to a slot no request of the batch owns. After each commit:

* each request's slot holds the reference state (SSM and conv) after its position, within the layer's bound;
* each tracked slot holds the reference state after its tracked position;
* every other slot, and every intermediate (per-position) state, is exactly as the verify left it.

The batch's state slots come in every layout (batch.spec.STATE_SLOT_LAYOUTS: shuffled, compact, reversed,
gapped), so a commit that writes slot ``i + 1`` or the request row instead of the request's slot fails.

Under ``graph()`` the verify is a replay of a graph captured at a padded batch size (linear layers eager
between captured segments, as the piecewise runner does; on the CPU its CPU path), so the backend's last plan
is the padded one: the commit must take the real requests' rows of it.
"""

from __future__ import annotations

import torch

from backends.registry import Composition
from batch.case import Case
from batch.forward_batch import ModelRunner
from batch.spec import RECURRENT_KINDS, BatchSpec, is_recurrent
from engine.graph_runner import GraphRunner, replay_size
from engine.materialize import materialize
from properties.run import run_case
from properties.tolerances import layer_bound
from properties.verdict import Verdict, Worst, compare
from reference.batch import ReferenceResult, reference_outputs

NAME = "verify_commit"


def _pools(pool) -> dict[str, dict[int, torch.Tensor]]:
    return {"conv_states": pool.conv_states, "ssm_states": pool.ssm_states,
            "intermediate_conv_states": pool.intermediate_conv_states,
            "intermediate_ssm_states": pool.intermediate_ssm_states}


def commit_plan(r: int, batch_slots: list[int], num_slots: int, D: int
                ) -> tuple[list[int], list[int], list[int]]:
    """Round ``r``'s commit: each request's last accepted position, its tracked slot and tracked position (-1:
    none). Tracked slots are slots no request of the batch owns (slot 0 is padding), one per request while they
    last; a request without one tracks nothing."""
    free = [s for s in range(1, num_slots) if s not in set(batch_slots)]
    steps = [(r + i) % D for i in range(len(batch_slots))]
    track_slots = [free[i] if i < len(free) else 0 for i in range(len(batch_slots))]
    track_steps = [((r + 2 * i + 1) % (D + 1)) - 1 if i < len(free) else -1 for i in range(len(batch_slots))]
    return steps, track_slots, track_steps


def verified(composition: Composition, spec: BatchSpec, device: str) -> tuple[Case, ReferenceResult, object]:
    """The case after its TARGET_VERIFY forward (eager, or replayed in a graph for ``graph()``), its reference,
    and the backend that ran it (the one whose plan a commit reads)."""
    if composition.name != "graph":
        run = run_case(composition, spec, device)
        return run.case, run.reference, run.execution.backend
    case = materialize(spec, device)
    reference = reference_outputs(case)
    runner_model = ModelRunner.of(case.forward_batch, spec.layers)
    backend = composition.children[0].build(spec, runner_model)
    runner = GraphRunner(backend, runner_model, case.forward_batch, spec.layers, case.weights, case.inputs,
                         replay_size(spec, runner_model.max_requests), spec.mrope_sections,
                         capture_linear=composition.support().graph_captures_linear)
    runner.capture()
    runner.replay(case.forward_batch, case.inputs)
    return case, reference, backend


def verify_commits_every_position(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    if not spec.attention_kinds & RECURRENT_KINDS:
        return Verdict(NAME, True, "not applicable: no linear-attention layer")
    case, reference, backend = verified(composition, spec, device)
    fb = case.forward_batch
    pool = fb.mamba_pool
    after_verify = _pools(pool.clone())
    batch_slots = fb.state_slots.tolist()
    num_slots = next(iter(pool.ssm_states.values())).shape[0]
    D = spec.spec.draft_token_num
    linear = [layer for layer in spec.layers if is_recurrent(layer)]
    worst = Worst()
    for r in range(D):
        for name, d in _pools(pool).items():
            for i, t in d.items():
                t.copy_(after_verify[name][i])
        steps, track_slots, track_steps = commit_plan(r, batch_slots, num_slots, D)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=fb.device)  # noqa: E731
        backend.update_mamba_state_after_mtp_verify(
            as_tensor(steps), as_tensor(track_slots), as_tensor(track_steps))
        written: set[int] = set()
        for layer in linear:
            bound = layer_bound(composition, spec, layer, device)
            ref = reference.linear_states[layer.layer_id]
            targets = [(slot, i, step, "committed") for i, (slot, step) in enumerate(zip(batch_slots, steps))]
            targets += [(slot, i, step, "tracked") for i, (slot, step) in enumerate(zip(track_slots, track_steps))
                        if step >= 0]
            for slot, i, step, what in targets:
                written.add(slot)
                where = f"commit at position {step}: layer {layer.layer_id} request {i} {what}"
                worst.add(compare(pool.ssm_states[layer.layer_id][slot], ref.ssm_steps[i][step], bound,
                                  label=f"{where} ssm (slot {slot}):"), bound)
                worst.add(compare(pool.conv_states[layer.layer_id][slot], ref.conv_steps[i][step], bound,
                                  label=f"{where} conv (slot {slot}):"), bound)
        for name, d in _pools(pool).items():
            frozen = name.startswith("intermediate")
            for layer_id, t in d.items():
                changed = (t != after_verify[name][layer_id]).reshape(t.shape[0], -1).any(dim=1)
                for slot in torch.nonzero(changed).flatten().tolist():
                    if frozen or slot not in written:
                        why = "a commit only reads the per-position states" if frozen else "no commit targets it"
                        return Verdict(NAME, False, f"commit round {r}: layer {layer_id} {name}: slot {slot} "
                                                    f"changed ({why})", where=f"state slot {slot}")
    return worst.verdict(NAME, f"{D} commit rounds over slots {batch_slots}"
                               f" ({spec.state_slot_layout}), every position of every request")
