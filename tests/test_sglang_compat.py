"""The release-specific calls of backends/sglang/compat.py, each on both sides of the change it follows (the
features it chooses by are patched; the releases themselves run in the main job and in bisect)."""

from __future__ import annotations

import pytest
import torch

from backends.sglang import compat, features


@pytest.fixture
def release(monkeypatch):
    """Make the installed SGLang look like it has exactly these alternatives and features."""
    def use(chosen: dict[str, str], has: set[str] = frozenset()):
        monkeypatch.setattr(features, "chosen", lambda need: chosen.get(need))
        monkeypatch.setattr(features, "has", lambda name: name in has or name in chosen.values())
    return use


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def _static_batch():
    return type("FB", (), dict(batch_size=2, input_ids=torch.zeros(2), req_pool_indices=torch.tensor([1, 2]),
                               seq_lens=torch.tensor([3, 4]), seq_lens_sum=7, forward_mode="DECODE", spec_info=None,
                               seq_lens_cpu=torch.tensor([3, 4])))()


def test_graphs_drive_the_three_method_contract_where_the_release_has_it(release):
    release({"graph_contract": "three_method_graph_contract"})
    backend, fb = _Recorder(), _static_batch()
    compat.plan_out_graph(backend, fb, in_capture=True)
    compat.plan_in_graph(backend, fb)
    assert [c[0] for c in backend.calls] == ["init_forward_metadata_out_graph", "init_forward_metadata_in_graph"]
    assert backend.calls[0][2] == {"in_capture": True}


def test_graphs_drive_capture_and_replay_hooks_on_older_releases_as_their_graph_runner_did(release):
    release({"graph_contract": "capture_replay_graph_contract"})
    backend, fb = _Recorder(), _static_batch()
    compat.plan_out_graph(backend, fb, in_capture=True)
    compat.plan_out_graph(backend, fb, in_capture=False)
    compat.plan_in_graph(backend, fb)  # the older contract plans nothing inside the graph
    (cap, cap_args, _), (rep, rep_args, rep_kw) = backend.calls
    assert cap == "init_forward_metadata_capture_cuda_graph" and rep == "init_forward_metadata_replay_cuda_graph"
    assert cap_args[:2] == (2, 2) and cap_args[4] is None and cap_args[5] == "DECODE"  # bs, num_tokens; no encoder
    assert rep_args[0] == 2 and rep_args[3] == 7 and rep_kw["seq_lens_cpu"] is fb.seq_lens_cpu


def test_the_backend_reaches_layers_through_the_batch_on_releases_without_a_forward_context(release):
    release({"backend_handoff": "batch_attn_backend"})
    fb = type("FB", (), {"attn_backend": None})()
    with compat.backend_scope(None, "inner", fb):
        assert fb.attn_backend == "inner"
    assert fb.attn_backend is None  # restored: the next batch sets its own


def test_renamed_and_absent_keywords_follow_the_constructor_of_the_installed_release():
    def old(*, retrive_index, draft_token):  # 0.5.10's EagleVerifyInput spells retrieve as retrive
        return retrive_index, draft_token
    kwargs = compat.accepted(old, {"retrieve_index": 1, "draft_token": 2, "speculative_eagle_topk": 3},
                             compat.VERIFY_RENAMES)
    assert kwargs == {"retrive_index": 1, "draft_token": 2}


@pytest.mark.parametrize("release_signature, expected", [
    ("accepted_steps, mamba_track_indices, mamba_steps_to_track, model", {"accepted_steps"}),  # 0.5.10
    ("last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model", set()),  # 0.5.11 - 0.5.16
    ("last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model, req_pool_indices=None",
     {"req_pool_indices"})])  # 0.5.17 on
def test_the_verify_commit_is_called_with_its_release_s_keywords(release_signature, expected):
    """On the H100, 0.5.10 and 0.5.14 rejected the adapter's commit call (TypeError: unexpected keyword
    'last_correct_step_indices', 'req_pool_indices'), reported as adapter errors: it now passes what the
    installed signature takes."""
    namespace = {}
    exec(f"def commit(self, {release_signature}): pass", namespace)
    bound = namespace["commit"].__get__(object())
    kwargs = compat.accepted(bound, dict(last_correct_step_indices=1, mamba_track_indices=2, mamba_steps_to_track=3,
                                         model=4, req_pool_indices=5), compat.COMMIT_RENAMES)
    bound(**kwargs)  # the call the release's own caller makes
    assert set(kwargs) == {"mamba_track_indices", "mamba_steps_to_track", "model"} | expected | (
        {"last_correct_step_indices"} if "last_correct" in release_signature else set())
    assert kwargs.get("accepted_steps", kwargs.get("last_correct_step_indices")) == 1


def test_fresh_state_slots_are_zeroed_as_the_older_allocator_did(release):
    release({}, has=set())  # no MambaPool.clear_slots (0.5.10): alloc zeroed the slots it handed out
    pool = type("Pool", (), {})()
    pool.mamba_cache = type("Cache", (), dict(conv=[torch.ones(2, 4, 3)], temporal=torch.ones(2, 4, 5)))()
    compat.clear_state_slots(pool, torch.tensor([1, 3]))
    assert pool.mamba_cache.conv[0][:, [1, 3]].abs().sum() == 0 and pool.mamba_cache.conv[0][:, [0, 2]].min() == 1
    assert pool.mamba_cache.temporal[:, [1, 3]].abs().sum() == 0 and pool.mamba_cache.temporal[:, 0].min() == 1


@pytest.mark.parametrize("state_slots", [3, 12])
def test_the_state_map_has_one_entry_per_request_row(state_slots):
    # 0.5.10 sizes it by the state pool, which the harness sizes on its own
    pool = type("Pool", (), {"req_index_to_mamba_index_mapping": torch.zeros(state_slots, dtype=torch.int32)})()
    compat.fit_state_mapping(pool, rows=4)
    assert pool.req_index_to_mamba_index_mapping.shape == (4,)


def test_the_sgl_kernel_stand_in_defines_the_op_older_releases_register_a_fake_for():
    # What 0.5.10 to 0.5.14 do at import on CUDA (layers/moe/topk.py): register_fake fails unless the op exists.
    # The stand-in defines it on CUDA only; the definition itself is exercised here, on any device.
    from backends.sglang import runtime

    runtime._define_sgl_kernel_ops()
    runtime._define_sgl_kernel_ops()  # idempotent: a second library would redefine the op and raise

    @torch.library.register_fake("sgl_kernel::moe_fused_gate")
    def _fake(input_tensor, bias, num_expert_group, topk_group, topk, num_fused_shared_experts=0,
              routed_scaling_factor=0, apply_routed_scaling_factor_on_output=False):
        return input_tensor.new_empty(input_tensor.shape[0], topk), input_tensor.new_empty(input_tensor.shape[0], topk)

    with pytest.raises(NotImplementedError):  # no kernel: a call fails loudly, as the rest of the stand-in does
        torch.ops.sgl_kernel.moe_fused_gate(torch.zeros(2, 4), torch.zeros(4), 1, 1, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU registration applies on a machine without CUDA")
def test_the_attention_layers_custom_ops_run_their_python_bodies_on_a_cpu():
    # SGLang registers a custom op for the CUDA key on any non-NPU/XPU/MUSA machine: on a CPU, 0.5.22's prefill-graph
    # split op failed ("Could not run 'sglang::unified_attention_with_output' with arguments from the 'CPU'
    # backend"). An op defined in an attention layer's module is also registered for the CPU, with its own body;
    # an op of any other module is left as SGLang registers it.
    pytest.importorskip("sglang")
    from backends.sglang import runtime

    runtime.load()
    from sglang.srt.utils import common

    installed = common.direct_register_custom_op
    assert runtime._layer_ops_on_cpu() == ["layer custom ops on cpu"]
    assert common.direct_register_custom_op is installed and installed.also_on_cpu  # installed once, not wrapped twice
    library = torch.library.Library("harness_test_ops", "DEF")

    def layer_op(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 2)

    def other_op(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 3)

    layer_op.__module__ = "sglang.srt.layers.radix_attention"
    other_op.__module__ = "sglang.srt.layers.moe.topk"
    common.direct_register_custom_op("layer_op", layer_op, ["out"], target_lib=library)
    common.direct_register_custom_op("other_op", other_op, ["out"], target_lib=library)
    x, out = torch.arange(3.0), torch.zeros(3)
    torch.ops.harness_test_ops.layer_op(x, out)
    assert out.tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.harness_test_ops.other_op(x, out)


def test_the_piecewise_context_lists_each_layer_as_sglangs_runner_does():
    # SGLang's layer_setup lists a layer module that wraps an attn (Kimi Linear's KimiDeltaAttention) by that attn,
    # any other by itself; 0.5.22's linear split op calls the backend with what it finds there. A view: layers
    # built after the context was entered are listed too.
    wrapped, plain = torch.nn.Module(), torch.nn.Module()
    wrapped.attn = torch.nn.Identity()
    blocks = {0: wrapped}
    layers = compat._AttentionLayers(blocks)
    blocks[1] = plain
    assert layers[0] is wrapped.attn and layers[1] is plain
    assert list(layers) == [0, 1] and len(layers) == 2
