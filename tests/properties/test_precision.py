"""Our own backends keep their error where the dtype puts it however long the context: a long prefix must not
add roundings the engines they model do not make."""

from __future__ import annotations

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, MLALayer
from properties import PROPERTIES


def test_torch_natives_chunked_mla_prefix_rounds_once(device):
    # torch_native expands an MLA prefix 16 keys at a time (so CI's short prefixes span several chunks); an 8k
    # prefix is 512 merges, and rounding each partial output to bfloat16 grew the error to 5.6u against a bound
    # of 4u (the H100 sweep of 2026-11-24 failed chunked_prefill over a 16k prefix at 5.7u). Kept in float32
    # until the last merge, it stays under 1u.
    spec = BatchSpec(ForwardMode.EXTEND, (8192,), (2,), (MLALayer(0, 16, 128, 64, 512, 128),), dtype="bfloat16",
                     context_len=8256, seed=1)
    verdict = PROPERTIES["outputs"].run(parse("torch_native"), spec, device)
    assert verdict.ok and verdict.worst_error < verdict.bound / 4, str(verdict)


def test_a_long_float32_mla_prefix_is_held_to_the_magnitudes_it_averages(device):
    # The shrunk case of a CPU nightly sweep (`harness sweep --budget 180s --backends torch_native --properties
    # outputs chunked_prefill prefill_then_decode --seed 11`): one token over a 7705-token MLA prefix in float32.
    # Its relative L2 error passed (3.4e-6 against 6.0e-6), but the element check, scaled by max|output|, failed: an
    # average over thousands of keys is small beside the values it averages, and each element's roundings scale with
    # those values (properties/tolerances.py). Each element is now bounded by its own sum_j p_j |v_j|.
    # The running LSE of torch_native's 16-key chunk merges was also rounded to float32 at each of its 482 merges,
    # which put the relative L2 error at 0.57 of its bound (a float32 MHA layer, one pass, is at 0.28).
    layer = MLALayer(0, 8, qk_nope_head_dim=32, qk_rope_head_dim=16, kv_lora_rank=64, v_head_dim=32)
    spec = BatchSpec(ForwardMode.EXTEND, (7705,), (1,), (layer,), dtype="float32", context_len=8192, seed=1)
    verdict = PROPERTIES["outputs"].run(parse("torch_native"), spec, device)
    assert verdict.ok, str(verdict)
    assert max(verdict.details["headroom"].values()) < 0.5, verdict.details["headroom"]


def test_scores_of_size_s_round_by_s_and_the_element_bound_counts_it():
    # Float32 attention whose scores are large (q and the keys aligned: S = sm_scale |q| max|k| ~ 30): each score's
    # own rounding, about sqrt(D) u S, moves the output more than the element bound allowed before the score term
    # (a CPU campaign failed our torch_native at 1.001 of it); with the term, well inside.
    import math

    import torch

    from properties.tolerances import output_bound, with_score_term
    from properties.verdict import compare
    from reference.mha import attention_padded

    gen = torch.Generator().manual_seed(0)
    D, L, trials = 128, 24, 40
    base = torch.randn(trials, 1, 1, 1, D, generator=gen, dtype=torch.float64).abs() + 0.5
    q = 1.2 * base * (1 + 0.05 * torch.randn(trials, 1, 1, 1, D, generator=gen, dtype=torch.float64))  # (B, Lq, H, D)
    k = 1.2 * base[:, 0] * (1 + 0.05 * torch.randn(trials, L, 1, D, generator=gen, dtype=torch.float64))
    v = torch.randn(trials, L, 1, 64, generator=gen, dtype=torch.float64)
    visible = torch.ones(trials, 1, L, dtype=torch.bool)
    scale = 1 / math.sqrt(D)
    ref, m, sizes = attention_padded(q[:, 0], k, v, visible, sm_scale=scale, magnitudes=True)
    out = attention_padded(q[:, 0].float(), k.float(), v.float(), visible, sm_scale=scale)
    old = output_bound("float32", L, inner_dim=D)
    new = with_score_term(old, D, 2.0**-24)
    before = compare(out, ref, old, scale=m, score_size=sizes)
    after = compare(out, ref, new, scale=m, score_size=sizes)
    assert sizes.min() > 20
    assert before.element_error > before.element_bound  # the old bound: a false finding on correct float32 code
    assert after.element_error < 0.05 * after.element_bound
    # Not yet counted: the same rounding in the relative L2 bound. Here correct float32 code is at 1.7 of it; the
    # drawn batches (q, k ~ N(0, 1)) never passed 0.42 of it in 63,444 CPU cases. Kept as a known gap, measured:
    assert after.rel_l2 > after.rel_l2_bound
