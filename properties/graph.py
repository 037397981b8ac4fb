"""Graph replay equals eager (DESIGN.md section 4): real rows match eager execution, the pools end identical
(the padding slot 0 aside), and replaying with new inputs gives the new inputs' outputs, not stale ones."""

from __future__ import annotations

import torch

from backends.registry import Composition
from batch.forward_batch import LayerInputs, ModelRunner
from batch.spec import BatchSpec
from engine.graph_runner import GraphRunner, eager_decode, padded_size
from engine.materialize import materialize
from properties.tolerances import layer_bound
from properties.verdict import Verdict, Worst, compare, token_starts

NAME = "graph_replay"


def _fresh_inputs(inputs: list[LayerInputs], seed: int) -> list[LayerInputs]:
    g = torch.Generator().manual_seed(seed)
    return [LayerInputs({n: torch.randn(t.shape, generator=g).to(t.dtype).to(t.device) for n, t in li.tensors.items()})
            for li in inputs]


def _pools(fb):
    tensors = {f"k{i}": b for i, b in fb.token_to_kv_pool.k_buffers.items()}
    tensors |= {f"v{i}": b for i, b in fb.token_to_kv_pool.v_buffers.items() if b is not None}
    if fb.mamba_pool is not None:
        tensors |= {f"conv{i}": t for i, t in fb.mamba_pool.conv_states.items()}
        tensors |= {f"ssm{i}": t for i, t in fb.mamba_pool.ssm_states.items()}
    return tensors


def graph_replay_equals_eager(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    inner = composition.children[0]
    starts = token_starts(spec)
    worst = Worst()
    graph_case = materialize(spec, device)
    fb = graph_case.forward_batch
    mr = ModelRunner.of(fb, spec.layers)
    before = {n: t.clone() for n, t in _pools(fb).items()}
    runner = GraphRunner(inner.build(spec, mr), mr, fb, spec.layers, graph_case.weights, graph_case.inputs,
                         padded_size(spec.batch_size), spec.mrope_sections)
    runner.capture()
    second_inputs = _fresh_inputs(graph_case.inputs, spec.seed + 1)
    for attempt, inputs in enumerate((graph_case.inputs, second_inputs)):
        for name, t in _pools(fb).items():  # each replay starts from the same pools as its eager twin
            t.copy_(before[name])
        replayed = runner.replay(fb, inputs)
        eager_case = materialize(spec, device)
        eager_runner = ModelRunner.of(eager_case.forward_batch, spec.layers)
        eager = eager_decode(inner.build(spec, eager_runner), eager_case.forward_batch, spec.layers, inputs,
                             eager_case.weights, spec.mrope_sections)
        label = "replay" if attempt == 0 else "replay with new inputs"
        for layer, a, b in zip(spec.layers, replayed, eager):
            bound = layer_bound(composition, spec, layer)
            worst.add(compare(a, b.to(torch.float64), bound, starts, f"{label} layer {layer.layer_id}:"), bound)
        eager_pools = _pools(eager_case.forward_batch)
        for name, t in _pools(fb).items():
            # Slot 0 takes the padded rows' writes; every other slot must match eager execution.
            bound = layer_bound(composition, spec, spec.layers[0])
            worst.add(compare(t[1:], eager_pools[name][1:].to(torch.float64), bound,
                              label=f"{label} pool {name}:"), bound)
    return worst.verdict(NAME, f"batch of {spec.batch_size} replayed in a graph captured at {runner.bs}")
