"""FlaBackend (gated delta rule on fla kernels) on a CUDA GPU against the float64 reference: outputs and the
states left in the pools, for extend / decode / mixed / draft extend, and verify followed by the commit of the
accepted position."""

from __future__ import annotations

import pytest
from gpu_support import BF16_REL_L2, assert_outputs_match, assert_plan_valid, rel_l2, require_gpu_and, run_backend

from batch.spec import BatchSpec, ForwardMode, LinearLayer, SpecInput

pytestmark = pytest.mark.gpu
require_gpu_and("fla.ops.gated_delta_rule", "fla-core (with einops)")

from backends.fla import FlaBackend  # noqa: E402

# Qwen3-Next-like heads (the gpu profile): 4 q/k heads, 8 value heads, head dims 128.
LINEAR = (LinearLayer(0, 4, 8, 128, 128), LinearLayer(1, 4, 8, 128, 128))


def spec(mode, prefix, extend, **kw) -> BatchSpec:
    return BatchSpec(mode, tuple(prefix), tuple(extend), LINEAR, page_size=1, dtype="bfloat16", seed=5, **kw)


def assert_states_match(ran, *, committed: bool = False) -> None:
    """Pool states at each request's slot vs the reference: final states, or in TARGET_VERIFY the state after
    each draft position (and, once committed, the accepted one in the pool)."""
    s, fb = ran.case.spec, ran.case.forward_batch
    pool = fb.mamba_pool
    for layer in s.layers:
        expected = ran.reference.linear_states[layer.layer_id]
        for i, slot in enumerate(fb.state_slots.tolist()):
            if s.mode.is_target_verify():
                n = s.extend_lens[i]
                pairs = [(pool.intermediate_ssm_states[layer.layer_id][slot, :n], expected.ssm_steps[i]),
                         (pool.intermediate_conv_states[layer.layer_id][slot, :n], expected.conv_steps[i])]
                if committed:
                    a = s.spec.accept_lens[i] - 1
                    pairs += [(pool.ssm_states[layer.layer_id][slot], expected.ssm_steps[i][a]),
                              (pool.conv_states[layer.layer_id][slot], expected.conv_steps[i][a])]
            else:
                pairs = [(pool.ssm_states[layer.layer_id][slot], expected.ssm[i]),
                         (pool.conv_states[layer.layer_id][slot], expected.conv[i])]
            for actual, exp in pairs:
                err = rel_l2(actual, exp)
                assert err < BF16_REL_L2, f"layer {layer.layer_id} request {i}: state error {err:.3e}"


def check(s: BatchSpec):
    ran = run_backend(FlaBackend, s)
    assert_outputs_match(ran)
    assert_plan_valid(ran)
    assert_states_match(ran)
    return ran


def test_extend_fresh_and_cached():
    # Fresh requests start from zero states; the others from the (random) pool states; lengths across chunks.
    check(spec(ForwardMode.EXTEND, [0, 40, 0, 7], [100, 3, 1, 64]))


def test_decode():
    check(spec(ForwardMode.DECODE, [5, 1, 90], [1, 1, 1]))


def test_mixed():
    check(spec(ForwardMode.MIXED, [12, 0, 3], [1, 20, 1]))


def test_draft_extend():
    s = SpecInput(draft_token_num=4, topk=1, spec_steps=3, parents=((-1, 0, 1, 2),) * 3, accept_lens=(1, 4, 2))
    check(spec(ForwardMode.DRAFT_EXTEND, [12, 1, 31], [1, 4, 2], spec=s))


def test_verify_then_commit():
    s = SpecInput(draft_token_num=4, topk=1, spec_steps=3, parents=((-1, 0, 1, 2),) * 3, accept_lens=(1, 4, 2))
    ran = check(spec(ForwardMode.TARGET_VERIFY, [9, 30, 2], [4, 4, 4], spec=s))
    fb = ran.case.forward_batch
    pool, before = fb.mamba_pool, ran.case.mamba_pool_before
    for layer in ran.case.spec.layers:  # verification leaves the committed states alone
        assert (pool.ssm_states[layer.layer_id] == before.ssm_states[layer.layer_id]).all()
    ran.backend.update_mamba_state_after_mtp_verify(fb.spec_info.accept_length - 1)  # the last accepted position
    assert_states_match(ran, committed=True)


def test_idle():
    ran = run_backend(FlaBackend, spec(ForwardMode.IDLE, [], []))
    assert all(o.shape == (0, 8, 128) for o in ran.outputs)
