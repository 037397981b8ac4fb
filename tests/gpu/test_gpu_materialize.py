"""Materialization on a CUDA GPU gives the CPU's tensors bit for bit: a case file found on one device replays
the same batch on another (the draws are counter-based and made where each tensor lives)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_support import CUDA_REASON
from hypothesis import given, settings
from hypothesis import strategies as st

from batch.spec import ForwardMode
from engine.materialize import materialize
from search.profiles import PROFILES
from search.strategies import batch_specs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)]

GPU = PROFILES["gpu"]


def case_tensors(case) -> dict[str, torch.Tensor]:
    """Every tensor of a case by a readable name: batch fields, pools, spec info, inputs and weights."""
    fb, out = case.forward_batch, {}
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value
    pools = [("kv", case.kv_pool_before)] + ([("mamba", case.mamba_pool_before)] if case.mamba_pool_before else [])
    for pool_name, pool in pools:
        for f in dataclasses.fields(pool):
            value = getattr(pool, f.name)
            if isinstance(value, dict):
                out.update({f"{pool_name}.{f.name}[{k}]": t for k, t in value.items() if t is not None})
    if fb.spec_info is not None:
        for f in dataclasses.fields(fb.spec_info):
            value = getattr(fb.spec_info, f.name)
            if isinstance(value, torch.Tensor):
                out[f"spec_info.{f.name}"] = value
    for i, (li, lw) in enumerate(zip(case.inputs, case.weights)):
        out.update({f"layer{i}.{n}": t for n, t in (li.tensors | lw.tensors).items()})
    return out


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_cuda_materialization_is_the_cpu_one_bit_for_bit(mode, data):
    spec = data.draw(batch_specs(GPU, mode, frozenset({"mha", "mla", "linear"}), hybrid=True))
    cpu, cuda = case_tensors(materialize(spec, "cpu")), case_tensors(materialize(spec, "cuda"))
    assert cpu.keys() == cuda.keys()
    for name, expected in cpu.items():
        actual = cuda[name]
        assert (actual.is_cuda or name.endswith("_cpu")) and actual.dtype == expected.dtype, name
        assert torch.equal(actual.cpu(), expected), f"{name} differs between CPU and CUDA"
