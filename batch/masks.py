"""Speculative draft trees as masks: which draft tokens each draft token sees (DESIGN.md section 1)."""

from __future__ import annotations

import torch

from batch.spec import BatchSpec


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """``[B, D]`` depth of each draft token from its parent indices (a root, parent -1, has depth 0: index 0, or
    each branch's first token in a draft decode's forest)."""
    depth = torch.zeros_like(parents)
    for j in range(1, parents.shape[1]):
        above = depth.gather(1, parents[:, j:j + 1].clamp(min=0))[:, 0] + 1
        depth[:, j] = torch.where(parents[:, j] < 0, 0, above)
    return depth


def tree_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """``[D, D]`` bool: draft token j sees draft token k iff k is j or one of j's ancestors."""
    D = len(parents)
    rows = [[False] * D for _ in range(D)]  # plain lists: one tensor write per element would be slow
    for j in range(D):
        k = j
        while k >= 0:
            rows[j][k] = True
            k = parents[k]
    return torch.tensor(rows, dtype=torch.bool).reshape(D, D)


def verify_custom_mask(spec: BatchSpec) -> torch.Tensor:
    """Flat custom mask of a TARGET_VERIFY batch: per request ``[D, seq_len + D]`` row-major, concatenated."""
    return verify_mask(spec.seq_lens, spec.spec.parents)


def verify_mask(seq_lens, parents) -> torch.Tensor:
    """The same from each request's cached length and its tree's parent list (``parents[i][0] == -1``)."""
    blocks = []
    for i, seq_len in enumerate(seq_lens):
        tree = tree_mask(tuple(parents[i]))
        block = torch.cat([torch.ones(tree.shape[0], seq_len, dtype=torch.bool), tree], dim=1)
        blocks.append(block.reshape(-1))
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
