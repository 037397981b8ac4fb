"""Lightning attention: the recurrence against its closed form, a hand-worked step, state passing, the decay rates."""

from __future__ import annotations

import math

import pytest
import torch

from reference import lightning

F64 = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("T", [0, 1, 7, 40])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrence_equals_the_closed_form(T, with_state):
    H, K, V = 3, 8, 5
    q, k, v = rand(T, H, K, seed=1), rand(T, H, K, seed=2), rand(T, H, V, seed=3)
    decay = torch.tensor([0.5, 0.05, 1e-5], dtype=F64)
    state = rand(H, K, V, seed=4) if with_state else None
    got = lightning.lightning_attention(q, k, v, decay, scale=K**-0.5, initial_state=state).o
    want = lightning.lightning_attention_closed_form(q, k, v, decay, scale=K**-0.5, initial_state=state)
    assert got.shape == (T, H, V)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_step_by_hand():
    # One head, K = V = 1: S = e^-lambda * S0 + k v, o = scale * q * S.
    q, k, v = (torch.tensor([[[x]]], dtype=F64) for x in (2.0, 3.0, 5.0))
    decay, s0 = torch.tensor([math.log(2.0)], dtype=F64), torch.tensor([[[4.0]]], dtype=F64)
    res = lightning.lightning_attention(q, k, v, decay, scale=0.5, initial_state=s0, keep_states=True)
    assert res.state.item() == pytest.approx(0.5 * 4.0 + 15.0)
    assert res.o.item() == pytest.approx(0.5 * 2.0 * 17.0)
    assert res.states.shape == (1, 1, 1, 1) and res.states[0].item() == res.state.item()


def test_a_state_carried_across_a_split_equals_one_pass():
    H, K, V, T = 2, 6, 4, 30
    q, k, v = rand(T, H, K, seed=5), rand(T, H, K, seed=6), rand(T, H, V, seed=7)
    decay = lightning.decay_rates(H, 1, 4)
    whole = lightning.lightning_attention(q, k, v, decay, scale=0.3)
    first = lightning.lightning_attention(q[:11], k[:11], v[:11], decay, scale=0.3)
    second = lightning.lightning_attention(q[11:], k[11:], v[11:], decay, scale=0.3, initial_state=first.state)
    torch.testing.assert_close(torch.cat([first.o, second.o]), whole.o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second.state, whole.state, rtol=1e-12, atol=1e-12)


def test_term_magnitudes_are_the_root_sum_of_squares_of_each_outputs_terms():
    # Written out term by term from the closed form: scale * q_t.k_s * v_s * e^-lambda(t-s) summed over key dims
    # and tokens, and the carried state's scale * q_t[i] * S0[i] * e^-lambda(t+1) over key dims.
    T, H, K, V = 4, 2, 3, 2
    q, k, v, s0 = rand(T, H, K, seed=11), rand(T, H, K, seed=12), rand(T, H, V, seed=13), rand(H, K, V, seed=14)
    decay = torch.tensor([0.7, 0.1], dtype=F64)
    got = lightning.term_magnitudes(q, k, v, decay, scale=0.4, initial_state=s0)
    want = torch.zeros(T, H, V, dtype=F64)
    for t in range(T):
        for h in range(H):
            for j in range(V):
                terms = [0.4 * q[t, h, i] * k[s, h, i] * v[s, h, j] * math.exp(-decay[h] * (t - s))
                         for s in range(t + 1) for i in range(K)]
                terms += [0.4 * q[t, h, i] * s0[h, i, j] * math.exp(-decay[h] * (t + 1)) for i in range(K)]
                want[t, h, j] = math.sqrt(sum(float(x) ** 2 for x in terms))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_a_state_passed_in_is_not_aliased():
    state = rand(1, 2, 2, seed=8)
    before = state.clone()
    res = lightning.lightning_attention(rand(3, 1, 2), rand(3, 1, 2), rand(3, 1, 2), torch.ones(1, dtype=F64),
                                        scale=1.0, initial_state=state)
    assert torch.equal(state, before) and res.state.data_ptr() != state.data_ptr()


def test_alibi_slopes():
    assert lightning.alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    assert lightning.alibi_slopes(1) == [2.0**-8]
    # Six heads: the four-head slopes, then every other slope of eight heads (the odd powers 1, 3)
    assert lightning.alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    with pytest.raises(ValueError):
        lightning.alibi_slopes(0)


def test_layerwise_decay_runs_from_fast_to_almost_none():
    slopes = torch.tensor(lightning.alibi_slopes(4), dtype=F64)
    torch.testing.assert_close(lightning.decay_rates(4, 0, 5), slopes * (1 + 1e-5))
    torch.testing.assert_close(lightning.decay_rates(4, 4, 5), slopes * 1e-5)
    torch.testing.assert_close(lightning.decay_rates(4, 2, 5), slopes * (0.5 + 1e-5))
    torch.testing.assert_close(lightning.decay_rates(4, 0, 1), slopes * (1 + 1e-5))
    torch.testing.assert_close(lightning.decay_rates(4, 3, 5, layerwise=False), slopes)


def test_shapes_that_do_not_describe_one_request_are_refused():
    with pytest.raises(ValueError, match="do not describe"):
        lightning.lightning_attention(rand(2, 2, 4), rand(2, 3, 4), rand(2, 2, 4), torch.ones(2, dtype=F64), scale=1.0)
