"""A materialized case: the runtime batch, each layer's inputs and weights, and snapshots of the pools.

Made only by :mod:`engine.materialize`; read by the engine, the properties and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batch.forward_batch import ForwardBatch, KVPool, LayerInputs, LayerWeights, MambaPool
from batch.spec import BatchSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}


@dataclass
class Case:
    """A materialized batch: the ForwardBatch, each layer's inputs and weights, and pool snapshots."""

    spec: BatchSpec
    forward_batch: ForwardBatch
    inputs: list[LayerInputs]
    weights: list[LayerWeights]
    kv_pool_before: KVPool
    mamba_pool_before: MambaPool | None
    # KV slot of every token (cached and new) of each request: one [kv_len] int64 CPU tensor per request,
    # views of one flat tensor (torch.cat(token_slots) is every request's slots in batch order).
    token_slots: tuple[torch.Tensor, ...]

    @property
    def device(self) -> torch.device:
        return self.forward_batch.device
