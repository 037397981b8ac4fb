"""Shared pieces of the GPU backend tests: the bound, running a backend next to the float64 reference, and
CUDA-graph replay. (A plain module, imported by its siblings: pytest puts this folder on sys.path.)

Every test module here is marked ``gpu`` and skips, with its reason, when no CUDA GPU is visible or the
backend's package is missing (``pytest tests/gpu -q -rs`` prints the reasons).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from batch.case import Case
from batch.forward_batch import LayerInputs, ModelRunner
from batch.spec import BatchSpec
from engine.materialize import materialize

# Relative L2 bound for bfloat16 outputs: 2u with u = 2**-8 (3.9e-3). Measured on an H100: FlashInfer ragged
# prefill 1.9e-3, paged decode 2.0e-3, MLA 2.4e-3, fla chunk GDN 3.3e-3 (shared/device/README.md).
BF16_REL_L2 = 2 * 2.0**-8

CUDA_REASON = "needs a CUDA GPU; none is visible (these kernels are CUDA-only)"


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are empty)."""
    a, e = actual.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64)
    if e.numel() == 0:
        return 0.0
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


@dataclass
class Ran:
    case: Case
    backend: object
    outputs: list[torch.Tensor]
    reference: object  # reference.batch.ReferenceResult


def run_backend(make_backend, spec: BatchSpec) -> Ran:
    """Materialize ``spec`` on the GPU, build the backend over its pools, run every layer as a model does."""
    from engine.model import run_layers
    from reference.batch import reference_outputs

    case = materialize(spec, "cuda")
    reference = reference_outputs(case)  # reads only the pool snapshots and the inputs
    backend = make_backend(ModelRunner.of(case.forward_batch, spec.layers))
    outputs = run_layers(backend, case.forward_batch, spec.layers, case.inputs, case.weights, spec.mrope_sections)
    torch.cuda.synchronize()
    return Ran(case, backend, outputs, reference)


def assert_outputs_match(ran: Ran, bound: float = BF16_REL_L2) -> None:
    spec = ran.case.spec
    for layer, out, ref in zip(spec.layers, ran.outputs, ran.reference.outputs):
        assert out.shape[0] == spec.num_tokens, f"layer {layer.layer_id}: {out.shape[0]} rows for {spec.num_tokens}"
        assert torch.isfinite(out.float()).all(), f"layer {layer.layer_id}: non-finite output"
        err = rel_l2(out, ref)
        assert err < bound, f"layer {layer.layer_id}: relative L2 error {err:.3e} >= {bound:.3e}"


def assert_plan_valid(ran: Ran) -> None:
    from properties.metadata import check_plan

    problem = check_plan(ran.backend.planned_metadata(), ran.case.forward_batch)
    assert problem is None, problem


def fresh_inputs(inputs: list[LayerInputs], seed: int) -> list[LayerInputs]:
    g = torch.Generator().manual_seed(seed)
    return [LayerInputs({n: torch.randn(t.shape, generator=g).to(t.dtype).to(t.device) for n, t in li.tensors.items()})
            for li in inputs]


def graph_replay_errors(make_backend, spec: BatchSpec) -> list[float]:
    """Capture DECODE layers at the padded batch size, replay the real batch twice (its inputs, then fresh
    ones) and return each replayed layer's relative L2 error against the float64 reference."""
    from engine.graph_runner import GraphRunner, replay_size
    from reference.batch import reference_outputs

    case = materialize(spec, "cuda")
    fb = case.forward_batch
    mr = ModelRunner.of(fb, spec.layers)
    pools = _pool_tensors(fb)
    before = {n: t.clone() for n, t in pools.items()}
    runner = GraphRunner(make_backend(mr), mr, fb, spec.layers, case.weights, case.inputs,
                         replay_size(spec, mr.max_requests),
                         spec.mrope_sections)
    runner.capture()
    errors = []
    for attempt, inputs in enumerate((case.inputs, fresh_inputs(case.inputs, spec.seed + 1))):
        for n, t in pools.items():
            t.copy_(before[n])
        replayed = runner.replay(fb, inputs)
        torch.cuda.synchronize()
        expected_case = materialize(spec, "cuda")
        expected_case.inputs = inputs
        expected = reference_outputs(expected_case).outputs
        errors += [rel_l2(a, b) for a, b in zip(replayed, expected)]
    return errors


def _pool_tensors(fb) -> dict[str, torch.Tensor]:
    out = {f"k{i}": b for i, b in fb.token_to_kv_pool.k_buffers.items()}
    out |= {f"v{i}": b for i, b in fb.token_to_kv_pool.v_buffers.items() if b is not None}
    if fb.mamba_pool is not None:
        out |= {f"conv{i}": t for i, t in fb.mamba_pool.conv_states.items()}
        out |= {f"ssm{i}": t for i, t in fb.mamba_pool.ssm_states.items()}
    return out


def require_gpu_and(package: str, what: str):
    """Skip the calling test module unless a CUDA GPU is visible and ``package`` imports; returns the module."""
    if not torch.cuda.is_available():
        pytest.skip(CUDA_REASON, allow_module_level=True)
    return pytest.importorskip(package, reason=f"{what} is not installed (GPU-only; see shared/device/README.md)")
