"""RoPE and mRoPE: rotations by the right angles, in the NeoX (rotate-halves) layout."""

from __future__ import annotations

import math

import pytest
import torch

from reference.rope import apply_rope, mrope_cos_sin, rope_cos_sin

F64 = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rotate(x: torch.Tensor, positions: list[int], rotary_dim: int | None = None, theta: float = 10000.0):
    rotary_dim = rotary_dim or x.shape[-1]
    cos, sin = rope_cos_sin(torch.tensor(positions), rotary_dim, theta=theta)
    return apply_rope(x, cos, sin)


def test_hand_worked_angles_and_neox_pairing():
    # rotary_dim 4, theta 100: inv_freq = [100^0, 100^-1/2] = [1, 0.1]; at position 2 the angles are 2, 0.2.
    cos, sin = rope_cos_sin(torch.tensor([2]), 4, theta=100.0)
    torch.testing.assert_close(cos, torch.tensor([[math.cos(2.0), math.cos(0.2)]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(sin, torch.tensor([[math.sin(2.0), math.sin(0.2)]], dtype=F64), rtol=0, atol=1e-15)
    # NeoX pairs dim j with dim j + rotary_dim/2 (not j+1 as GPT-J does): e_0 rotates into dim 2.
    e0 = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]], dtype=F64)
    expected = torch.tensor([[[math.cos(2.0), 0.0, math.sin(2.0), 0.0]]], dtype=F64)
    torch.testing.assert_close(apply_rope(e0, cos, sin), expected, rtol=0, atol=1e-15)


def test_position_zero_is_identity_and_rotation_preserves_norm():
    x = rand(4, 2, 16)
    torch.testing.assert_close(rotate(x, [0, 0, 0, 0]), x, rtol=0, atol=0)
    torch.testing.assert_close(rotate(x, [1, 7, 100, 4000]).norm(dim=-1), x.norm(dim=-1), rtol=1e-14, atol=0)


def test_scores_depend_only_on_relative_position():
    q, k = rand(1, 1, 16, seed=1), rand(1, 1, 16, seed=2)

    def score(pq: int, pk: int) -> float:
        return (rotate(q, [pq]) * rotate(k, [pk])).sum().item()

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-10)
    assert score(10, 3) == pytest.approx(score(7, 0), rel=1e-10)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_partial_rotary_passes_the_rest_through():
    x = rand(3, 2, 16)
    cos, sin = rope_cos_sin(torch.tensor([5, 6, 7]), 8)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], rotate(x[..., :8].contiguous(), [5, 6, 7]), rtol=0, atol=0)
    assert (out[..., :8] - x[..., :8]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(x, cos, sin, rotary_dim=6)


def test_cos_sin_are_cast_to_the_input_dtype():
    x = rand(2, 1, 8).float()
    cos, sin = rope_cos_sin(torch.tensor([3, 9]), 8)
    assert apply_rope(x, cos, sin).dtype == torch.float32
    assert rope_cos_sin(torch.tensor([3]), 8, dtype=torch.float32)[0].dtype == torch.float32


def test_mrope_with_equal_rows_is_plain_rope():
    pos = torch.tensor([0, 3, 9, 12, 4095])
    plain = rope_cos_sin(pos, 16)
    multi = mrope_cos_sin(torch.stack([pos, pos, pos]), 16, (2, 3, 3))
    torch.testing.assert_close(multi, plain, rtol=0, atol=0)


def test_mrope_sections_take_their_row():
    pos = torch.tensor([0, 3, 9, 12])
    rows = torch.stack([pos, 2 * pos + 1, 3 * pos + 2])
    cos, sin = mrope_cos_sin(rows, 16, (2, 3, 3))
    for j, row in [(0, 0), (1, 0), (2, 1), (4, 1), (5, 2), (7, 2)]:
        plain_cos, plain_sin = rope_cos_sin(rows[row], 16)
        torch.testing.assert_close(cos[:, j], plain_cos[:, j], rtol=0, atol=0)
        torch.testing.assert_close(sin[:, j], plain_sin[:, j], rtol=0, atol=0)


def test_mrope_rejects_sections_that_do_not_sum_to_half_the_rotary_dim():
    rows = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="summing to rotary_dim"):
        mrope_cos_sin(rows, 16, (2, 3, 4))
