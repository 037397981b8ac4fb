"""Graph replay equals eager (DESIGN.md section 4), in every mode a composition captures: real rows match
eager execution, the pools end identical (the padding slot 0 aside), and, where a real graph holds its
outputs (CUDA), replaying with new inputs gives the new inputs' outputs, not stale ones. On the CPU the layers
re-run from the static buffers at every replay, so a second replay could only repeat the first: it is skipped.

The padding is poisoned: padded rows' per-token inputs are NaN, and so is what they read and write in the
pools (KV slot 0, state slot 0), so a padded row that leaks into a real one turns it NaN. The capture runs
over the fill-value batch, never the real one, and the real batch may have fewer requests (and so fewer
tokens) than the capture; an IDLE batch replays the decode graph with every row padding.
"""

from __future__ import annotations

import torch

from backends.registry import Composition
from batch.forward_batch import LayerInputs, ModelRunner
from batch.spec import BatchSpec, ForwardMode
from engine.draft_loop import DraftGraphRunner, run_draft_steps
from engine.graph_runner import GraphRunner, PrefillGraphRunner, eager_run, replay_size
from engine.materialize import materialize
from properties.tolerances import layer_bound
from properties.verdict import Verdict, Worst, compare, token_starts

NAME = "graph_replay"
POISON = float("nan")


def _fresh_inputs(inputs: list[LayerInputs], seed: int) -> list[LayerInputs]:
    g = torch.Generator().manual_seed(seed)
    return [LayerInputs({n: torch.randn(t.shape, generator=g).to(t.dtype).to(t.device) for n, t in li.tensors.items()})
            for li in inputs]


def pool_tensors(fb) -> dict[str, torch.Tensor]:
    """Every pool a layer may write, each indexed by slot (KV) or state slot (linear) on dim 0."""
    tensors = {f"k{i}": b for i, b in fb.token_to_kv_pool.k_buffers.items()}
    tensors |= {f"v{i}": b for i, b in fb.token_to_kv_pool.v_buffers.items() if b is not None}
    if fb.mamba_pool is not None:
        pool = fb.mamba_pool
        for name, d in (("conv", pool.conv_states), ("ssm", pool.ssm_states),
                        ("conv_draft", pool.intermediate_conv_states), ("ssm_draft", pool.intermediate_ssm_states)):
            tensors |= {f"{name}{i}": t for i, t in d.items()}
    return tensors


def _splits_tbo_itself(inner: Composition) -> bool:
    """Whether the graph runner splits ``inner``'s TBO halves (the harness's TBO); an engine's splits with its own."""
    return inner.name == "tbo" and inner.engine == "harness"


def _graph_runner(composition: Composition, spec: BatchSpec, case, mr: ModelRunner, pad_value: float = 0.0
                  ) -> GraphRunner:
    """The decode/verify/draft-extend graph runner of ``graph(inner)`` for ``case``, at the padded size a batch of
    ``spec``'s requests replays in."""
    inner = composition.children[0]
    return GraphRunner(inner.build(spec, mr), mr, case.forward_batch, spec.layers, case.weights, case.inputs,
                       replay_size(spec, mr.max_requests), spec.mrope_sections,
                       split_tbo=_splits_tbo_itself(inner), pad_value=pad_value,
                       capture_linear=composition.support().graph_captures_linear)


def _draft_graph_runner(composition: Composition, spec: BatchSpec, case, mr: ModelRunner, pad_value: float = 0.0
                        ) -> DraftGraphRunner:
    """The draft loop's graph runner of ``graph(leaf)`` for ``case``, at the padded size its requests replay in."""
    return DraftGraphRunner(composition.children[0].build(spec, mr), mr, case.forward_batch, spec.layers,
                            case.weights, case.inputs, replay_size(spec, mr.max_requests), pad_value=pad_value)


def graph_replay_equals_eager(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    inner = composition.children[0]
    split_tbo = _splits_tbo_itself(inner)
    starts = token_starts(spec)
    worst = Worst()
    graph_case = materialize(spec, device)
    fb = graph_case.forward_batch
    mr = ModelRunner.of(fb, spec.layers)
    before = {n: t.clone() for n, t in pool_tensors(fb).items()}
    if spec.mode is ForwardMode.EXTEND:  # a breakable prefill graph
        runner = PrefillGraphRunner(inner.build(spec, mr), mr, fb, spec.layers, graph_case.weights, graph_case.inputs,
                                    spec.num_tokens, spec.mrope_sections, pad_value=POISON)
    elif spec.mode.is_draft_decode():  # the draft loop's own graph runner
        runner = _draft_graph_runner(composition, spec, graph_case, mr, pad_value=POISON)
    else:
        runner = _graph_runner(composition, spec, graph_case, mr, pad_value=POISON)
    runner.capture()
    unbroken = runner.unbroken_layers() if isinstance(runner, PrefillGraphRunner) else []
    if unbroken:
        in_graph = (f" ({', '.join(sorted(runner.in_graph))} layers: 0, the backend runs them inside the graph on "
                    f"tables it refreshes at each replay)" if runner.in_graph else "")
        layers = ", ".join(f"layer {layer.layer_id} ({layer.kind}) took {breaks}" for layer, breaks in unbroken)
        return Verdict(NAME, False, f"{spec.mode.value} batch of {spec.batch_size} ({spec.num_tokens} tokens), prefill "
                                    f"graph captured {runner.captured}: {layers} eager graph break(s) where each layer "
                                    f"takes exactly 1{in_graph}; a layer captured into a segment replays the capture "
                                    f"batch's plan and state slots on every batch")
    replays = [graph_case.inputs]
    if runner.use_cuda_graph:  # a captured graph holds its outputs: a second replay must not return the first's
        replays.append(_fresh_inputs(graph_case.inputs, spec.seed + 1))
    for attempt, inputs in enumerate(replays):
        for name, t in pool_tensors(fb).items():  # each replay starts from the same pools as its eager twin
            t.copy_(before[name])
            if t.is_floating_point():
                t[0] = POISON  # the padding slot: what padded rows read and write
        replayed = runner.replay(fb, inputs)
        eager_case = materialize(spec, device)
        eager_runner = ModelRunner.of(eager_case.forward_batch, spec.layers)
        if spec.mode.is_draft_decode():
            eager = run_draft_steps(inner.build(spec, eager_runner), spec, eager_case.forward_batch, inputs,
                                    eager_case.weights)
        else:
            eager = eager_run(inner.build(spec, eager_runner), eager_case.forward_batch, spec.layers, inputs,
                              eager_case.weights, spec.mrope_sections, split_tbo=split_tbo)
        label = "replay" if attempt == 0 else "replay with new inputs"
        for layer, a, b in zip(spec.layers, replayed, eager):
            # Not widened for a lightning layer's cancellation (properties/tolerances.py): replay and eager run the
            # same kernels on the same inputs, so no cancelled difference of roundings separates them (measured on
            # the CPU: 0.000 of the bound in every graph row).
            bound = layer_bound(composition, spec, layer, device)
            worst.add(compare(a, b.to(torch.float64), bound, starts, f"{label} layer {layer.layer_id}:"), bound)
        eager_pools = pool_tensors(eager_case.forward_batch)
        for name, t in pool_tensors(fb).items():
            # Slot 0 takes the padded rows' writes; every other slot must match eager execution.
            bound = layer_bound(composition, spec, spec.layers[0], device)
            worst.add(compare(t[1:], eager_pools[name][1:].to(torch.float64), bound,
                              label=f"{label} pool {name}:"), bound)
    verdict = worst.verdict(NAME, f"{spec.mode.value} batch of {spec.batch_size} ({spec.num_tokens} tokens) replayed "
                                  f"in a {runner.mode.value} graph captured {runner.captured}")
    if not verdict.ok and spec.mode.is_draft_decode():  # what the replayed steps' plans read (the ledger reads it)
        from properties.metadata import draft_plans_read

        verdict.details["draft_step_reads"] = draft_plans_read(runner.drafter.step_plans(), spec, fb,
                                                               runner.bs - spec.batch_size)
    if isinstance(runner, PrefillGraphRunner):  # the layer kinds the engine ran inside the graph (the ledger reads it)
        verdict.details["in_graph"] = tuple(sorted(runner.in_graph))
    return verdict


GRAPH_METADATA = "graph_metadata"


def _replay_leaves(backend, fb) -> list[tuple[object, object]]:
    """(leaf, the batch it planned) for every plan a replay of the padded ``fb`` made. Under a two-batch-overlap
    wrapper: its primary's of the whole batch, and each non-empty half's, cut where the wrapper's replay cut the padded
    batch (``replay_split``: the harness's wrapper's rule, or SGLang's ``compute_split_indices_for_cuda_graph_replay``
    for its ``TboAttnBackend``), each half counting its own padded rows (the parent's are the last ones)."""
    from batch.tbo_split import TboSplit, split_forward_batch
    from properties.metadata import planned_leaves

    if not hasattr(backend, "replay_split"):
        return planned_leaves(backend, fb)
    out = planned_leaves(backend.primary, fb)
    s = backend.replay_split(fb)
    if s is None:
        return out
    per_request = fb.spec_info.draft_token_num if fb.forward_mode.is_target_verify() else 1
    real = fb.batch_size - (fb.num_padding or 0)
    halves = split_forward_batch(fb, TboSplit(s, s * per_request))
    for child, half, (lo, hi) in zip(backend.children, halves, ((0, s), (s, fb.batch_size))):
        half.num_padding = (hi - lo) - max(0, min(hi, real) - lo)
        out += planned_leaves(child, half)
    return out


def graph_plans_satisfy_invariants(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    """The plan a decode, verify or draft-extend graph replays with satisfies the metadata invariants
    (properties/metadata.py), read where the graph's layers would read it: after a capture over the fill-value batch,
    a replay's plan over the real batch padded to the captured size with the backend's fill value, padded rows
    included. (The capture's own plan is of the fill-value batch and is overwritten before any replay reads it; SGLang's
    kit checks the plan after replay initialisation too, runner_modes/metadata_invariants.py.) Only the plans are
    made (``GraphRunner.capture_plan``, ``replay_plan``), no layer runs: a plan-level composition
    (``Support.plan_only``) is checked too."""
    from properties.metadata import check_plan, draft_plans_read, draft_step_batch, planned_leaves, unread_note

    case = materialize(spec, device)
    fb = case.forward_batch
    if spec.mode.is_draft_decode():  # each step's plan, the padded requests' branches included
        runner = _draft_graph_runner(composition, spec, case, ModelRunner.of(fb, spec.layers))
        runner.capture_plan()
        runner.replay_plan(fb, case.inputs)
        padded = runner.bs - spec.batch_size
        plans = runner.drafter.step_plans()
        for step, plan in enumerate(plans):
            problem = check_plan(plan, draft_step_batch(spec, fb, step, padded_requests=padded,
                                                        tails_from_branch=plan.draft_tails_from_branch))
            if problem:
                return Verdict(GRAPH_METADATA, False, f"at replay {runner.captured} ({padded} padded row(s)): "
                                                      f"draft step {step}: {problem}", where=f"draft step {step}",
                               details={"draft_step_reads": draft_plans_read(plans, spec, fb, padded)})
        return Verdict(GRAPH_METADATA, True, f"{len(plans)} draft step plan(s) of a replay {runner.captured} "
                                             f"({padded} padded row(s)) satisfy every invariant" +
                       unread_note(("draft step", plan) for plan in plans))
    runner = _graph_runner(composition, spec, case, ModelRunner.of(fb, spec.layers))
    runner.capture_plan()
    runner.replay_plan(fb, case.inputs)
    leaves = _replay_leaves(runner.backend, runner.fb)
    padded = runner.bs - spec.batch_size
    named = []
    for backend, planned_fb in leaves:
        plan = backend.planned_metadata()
        problem = check_plan(plan, planned_fb)
        if problem:
            return Verdict(GRAPH_METADATA, False, f"at replay {runner.captured} ({padded} padded row(s)): "
                                                  f"{type(backend).__name__}: {problem}")
        named.append((type(backend).__name__, plan))
    return Verdict(GRAPH_METADATA, True, f"{len(leaves)} plan(s) of a replay {runner.captured} ({padded} padded "
                                         f"row(s)) satisfy every invariant" + unread_note(named))
