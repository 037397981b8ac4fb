"""The adapter follows the installed SGLang by its features, not by a version list (backends/sglang/features.py):
each contract is a set of probes on the package's source, a row needs features, and a missing one makes the row
unavailable with its name."""

from __future__ import annotations

import textwrap

import pytest

from backends.registry import parse
from backends.sglang import features, runtime
from batch.spec import BatchSpec, ForwardMode
from search.profiles import PROFILES


def _tree(tmp_path, modules: dict[str, str]):
    """A fake ``sglang`` package: {dotted module under sglang: source}."""
    root = tmp_path / "sglang"
    for module, source in modules.items():
        path = root.joinpath(*module.split("."))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """Point detection at a fake source tree (the installed SGLang's version string stays whatever it is)."""
    def use(modules: dict[str, str]):
        root = _tree(tmp_path, modules)
        monkeypatch.setattr(features, "package_root", lambda package="sglang": root)
        features.forget()
        return root
    yield use
    features.forget()


def test_probes_read_definitions_imports_guarded_imports_and_class_members(tmp_path):
    root = _tree(tmp_path, {"srt.m": """
        import os.path
        from a.b import c as d
        try:
            from x import guarded
        except ImportError:
            guarded = None
        X: int = 1
        class K:
            def own(self): ...
            attr = 2
            @property
            def prop(self): ...
        """})
    for name in ("os", "d", "guarded", "X", "K"):
        assert features.probe_fails(root, features.Probe("sglang.srt.m", name)) is None, name
    for member in ("own", "attr", "prop"):
        assert features.probe_fails(root, features.Probe("sglang.srt.m", "K", member)) is None, member
    assert features.probe_fails(root, features.Probe("sglang.srt.m", "c")) == "sglang.srt.m has no c"
    assert features.probe_fails(root, features.Probe("sglang.srt.m", "K", "gone")) == "sglang.srt.m.K has no gone"
    assert features.probe_fails(root, features.Probe("sglang.srt.none")) == "no module sglang.srt.none"


BASE = "srt.layers.attention.base_attn_backend"


def test_the_metadata_contract_is_told_apart_by_the_base_class(tmp_path):
    # 0.5.10-0.5.13: capture/replay hooks; 0.5.14 on: the three-method contract graph() drives
    old = {BASE: "class AttentionBackend:\n def init_forward_metadata_capture_cuda_graph(self): ...\n"
                 " def init_forward_metadata_replay_cuda_graph(self): ...\n"}
    new = {BASE: "class AttentionBackend:\n def init_forward_metadata_out_graph(self, fb, in_capture=False): ...\n"
                 " def init_forward_metadata_in_graph(self, fb): ...\n"}
    for release, (source, gap) in enumerate(((old, True), (new, False))):
        root = _tree(tmp_path / str(release), source)
        missing = features.missing_in(root, ["three_method_graph_contract"])
        assert bool(missing) is gap
        if gap:
            assert "AttentionBackend has no init_forward_metadata_out_graph" in missing[0]


@pytest.mark.skipif(runtime.installed_version() is None, reason="sglang is not installed (bash ci/install-sglang.sh)")
def test_the_installed_release_has_what_the_adapter_builds_with_and_no_version_is_refused(monkeypatch):
    # Every need, and every feature that is no release's alternative to another (those come and go by release)
    alternatives = {alt for alts in features.CHOICES.values() for alt in alts}
    assert features.missing(tuple(features.CHOICES) + tuple(set(features.FEATURES) - alternatives)) == ()
    monkeypatch.setattr(runtime, "installed_version", lambda: "0.6.0.dev1234+gabcdef")  # a checkout of main
    assert runtime.unavailable_reason() is None


@pytest.mark.skipif(runtime.installed_version() is None, reason="sglang is not installed (bash ci/install-sglang.sh)")
def test_a_missing_feature_makes_its_rows_unavailable_and_names_it(fake_sglang, cpu_rows_listed):
    root = features.package_root()
    modules = {}
    for feature in features.FEATURES.values():  # a copy of the installed source the probes read, file by file
        for probe in feature.probes:
            parts = probe.module.split(".")[1:]
            path = root.joinpath(*parts).with_suffix(".py")
            path = path if path.is_file() else root.joinpath(*parts, "__init__.py")
            if path.is_file():  # an older release's alternative is absent here
                modules[".".join(parts) + (".__init__" if path.name == "__init__.py" else "")] = path.read_text()
    fake = fake_sglang(modules)
    everything = tuple(features.CORE) + ("graph_contract", "prefill_graph", "tbo", "draft_extend_v2")
    assert features.missing(everything) == ()  # the copy has everything the installed release has
    # 0.5.22: no runner_utils/prefill_graph.py (the scope's flags): graph() keeps its extend rows (0.5.22's layers
    # take their breaks through the piecewise forward context)
    (fake / "srt" / "model_executor" / "runner_utils" / "prefill_graph.py").unlink()
    features.forget()
    assert features.has("prefill_graph") and not features.has("prefill_graph_flags")
    assert ForwardMode.EXTEND in parse("graph(sglang.triton)").support().modes
    # no runner_utils/forward_batch.py either (0.5.16): graph() loses its extend rows, nothing else
    (fake / "srt" / "model_executor" / "runner_utils" / "forward_batch.py").unlink()
    features.forget()
    graph = parse("graph(sglang.triton)")
    assert ForwardMode.EXTEND not in graph.support().modes and ForwardMode.DECODE in graph.support().modes
    why = dict(graph.engine_mode_gaps())[ForwardMode.EXTEND]
    assert "prefill_graph" in why and "no module sglang.srt.model_executor.runner_utils.forward_batch" in why
    assert ForwardMode.EXTEND in parse("sglang.triton").support().modes
    # no TboAttnBackend: every tbo() row over SGLang is unavailable, named
    (fake / "srt" / "layers" / "attention" / "tbo_backend.py").write_text("# gone\n")
    features.forget()
    reason = parse("tbo(sglang.torch_native)").unavailable_reason("cpu")
    assert reason is not None and "tbo (two-batch overlap" in reason and "has no TboAttnBackend" in reason
    # a core need none of whose alternatives is there (no forward context, no backend field on the batch): every
    # SGLang row is unavailable, naming each alternative and why
    (fake / "srt" / "model_executor" / "forward_context.py").unlink()
    features.forget()
    reason = parse("sglang.torch_native").unavailable_reason("cpu")
    assert reason is not None and "backend_handoff, one of: forward_context" in reason
    assert "ForwardBatch has no attn_backend" in reason


# What each release line's source looks like to the probes (the parts the choices read), from the facts in
# docs/findings/releases.md: the newest, 0.5.14 (runtime context without server args, forward context, fla under
# srt), 0.5.10 (no runtime context, the backend on the batch, capture/replay graph hooks)
_NEWEST = {
    "srt.runtime_context": "def get_context(): ...\ndef get_parallel(): ...\ndef get_exec(): ...\n"
                           "def get_schedule(): ...\nclass RuntimeContext:\n def override_server_args(self): ...\n",
    "srt.model_executor.forward_context": "class ForwardContext: ...\ndef forward_context(ctx): ...\n",
    BASE: "class AttentionBackend:\n def init_forward_metadata_out_graph(self, fb, in_capture=False): ...\n"
          " def init_forward_metadata_in_graph(self, fb): ...\n",
}
_0_5_14 = {
    "srt.runtime_context": "def get_context(): ...\ndef get_parallel(): ...\n",
    "srt.server_args": "class ServerArgs: ...\ndef set_global_server_args_for_scheduler(a): ...\n"
                       "def get_global_server_args(): ...\n",
    "srt.distributed.parallel_state": "_ATTN_TP = None\n",
    "srt.layers.dp_attention": "def get_attention_tp_size(): ...\n",
    "srt.model_executor.forward_context": _NEWEST["srt.model_executor.forward_context"],
    BASE: _NEWEST[BASE],
}
_0_5_10 = {
    "srt.server_args": _0_5_14["srt.server_args"],
    "srt.distributed.parallel_state": "_ATTN_TP = None\n",
    "srt.layers.dp_attention": "def get_attention_tp_size(): ...\n",
    "srt.model_executor.forward_batch_info": "class ForwardBatch:\n attn_backend: object = None\n"
                                             " token_to_kv_pool: object = None\n req_to_token_pool: object = None\n",
    BASE: "class AttentionBackend:\n def init_forward_metadata_capture_cuda_graph(self): ...\n"
          " def init_forward_metadata_replay_cuda_graph(self): ...\n",
}


@pytest.mark.parametrize("source, chosen", [
    (_NEWEST, {"server_args": "runtime_context", "single_rank": "parallel_context",
               "backend_handoff": "forward_context", "graph_contract": "three_method_graph_contract"}),
    (_0_5_14, {"server_args": "global_server_args", "single_rank": "parallel_context",
               "backend_handoff": "forward_context", "graph_contract": "three_method_graph_contract"}),
    (_0_5_10, {"server_args": "global_server_args", "single_rank": "attn_tp_group",
               "backend_handoff": "batch_attn_backend", "graph_contract": "capture_replay_graph_contract"}),
], ids=["newest", "0.5.14", "0.5.10"])
def test_each_release_line_gets_its_own_alternative_of_each_need(fake_sglang, source, chosen):
    fake_sglang(source)
    assert {need: features.chosen(need) for need in chosen} == chosen


def test_a_tbo_graph_needs_the_three_method_contract(fake_sglang):
    # 0.5.10 captures TBO graphs for even batch sizes only; the graph runner captures each batch at its own size
    fake_sglang(_0_5_10)
    assert features.wrapper_gaps({"graph"}) == []
    gaps = features.wrapper_gaps({"graph", "tbo"})
    assert any(g.startswith("three_method_graph_contract") for g in gaps)


def test_the_registry_inventory_reads_every_registered_backend_and_its_classes():
    # harness list --why lists every --attention-backend NAME of the installed SGLang: which leaf runs it here, or
    # why it is not a leaf yet. Read from the registry's source (its factories' returns), nothing imported.
    from backends.sglang import features

    if features.package_root() is None:
        pytest.skip("SGLang is not installed")
    registered = {b.name: b for b in features.registered_backends()}
    assert {"triton", "torch_native"} <= set(registered)
    assert ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend") in registered["triton"].classes
    if "fa3" in registered:  # the server's default on Hopper
        assert any(cls == "FlashAttentionBackend" for _, cls in registered["fa3"].classes)


def test_an_import_check_says_which_module_imports_and_why_another_does_not():
    from backends.sglang.features import import_failures

    found = import_failures(["json", "no_such_module_for_the_harness"])
    assert found["json"] is None
    assert found["no_such_module_for_the_harness"].startswith("ModuleNotFoundError")


def test_a_probe_can_ask_whether_a_member_is_a_static_method(tmp_path):
    # 0.5.10-0.5.12's TorchFlexAttnBackend hands create_block_mask bound methods, which torch 2.13 refuses; 0.5.13
    # made them static: the flex_attention leaf needs the static ones (flex_static_masks)
    old = _tree(tmp_path / "old", {"srt.layers.attention.torch_flex_backend": """
        class TorchFlexAttnBackend:
            def _causal_mask(self, b, h, q_idx, kv_idx): ...
            def _decode_mask(self, b, h, q_idx, kv_idx): ...
        """})
    new = _tree(tmp_path / "new", {"srt.layers.attention.torch_flex_backend": """
        class TorchFlexAttnBackend:
            @staticmethod
            def _causal_mask(b, h, q_idx, kv_idx): ...
            @staticmethod
            def _decode_mask(b, h, q_idx, kv_idx): ...
        """})
    assert features.missing_in(new, ["flex_static_masks"]) == []
    (why,) = features.missing_in(old, ["flex_static_masks"])
    assert "TorchFlexAttnBackend has no _causal_mask@staticmethod" in why


def test_a_release_without_kdas_safe_gate_draws_and_takes_standard_gates_only(tmp_path, monkeypatch):
    # 0.5.10's RadixLinearAttention takes no lower_bound: its KDA rows draw the standard gate, and a safe-gate case
    # is refused as outside the composition's support (before: every such case an adapter error at layer build)
    from batch.spec import KdaLayer, MHALayer
    from search.matrix import strategy_options

    layer = """
        class RadixLinearAttention:
            def __init__(self, layer_id, num_q_heads, conv_weights=None, A_log=None, dt_bias=None{}): ...
        """
    old = _tree(tmp_path / "old", {"srt.layers.radix_linear_attention": layer.format("")})
    new = _tree(tmp_path / "new", {"srt.layers.radix_linear_attention": layer.format(", lower_bound=None")})
    assert features.missing_in(new, ["kda_safe_gate"]) == []
    (why,) = features.missing_in(old, ["kda_safe_gate"])
    assert "RadixLinearAttention has no __init__(lower_bound)" in why
    composition = parse("hybrid(sglang.triton,sglang.kda)")
    safe = BatchSpec(ForwardMode.EXTEND, (0,), (3,), (KdaLayer(0, 2, 16, 16, lower_bound=-5.0),
                                                       MHALayer(1, 4, 2, 16, 16)), dtype="float16")
    try:
        for root, takes in ((new, True), (old, False)):
            monkeypatch.setattr(features, "package_root", lambda package="sglang", root=root: root)
            features.forget()
            support = composition.support()
            assert support.kda_safe_gate is takes
            assert strategy_options(composition, PROFILES["ci"])["kda_safe_gate"] is takes
            assert (support.unsupported_reason(safe) is None) is takes
    finally:
        features.forget()


def test_modules_a_failed_import_left_without_their_package_are_forgotten_before_loading(tmp_path, monkeypatch):
    """A package whose __init__ raised is forgotten, the submodules it had imported are not; under a namespace
    package (SGLang's ``srt`` has no __init__.py) the next import then fails with KeyError: the package's name. On
    the lent H200 eight tests' first load in their pytest worker failed so; runtime.load forgets the orphans first."""
    import importlib
    import sys

    root = tmp_path / "fakeengine_ns"
    (root / "srt").mkdir(parents=True)
    (root / "__init__.py").write_text("import fakeengine_ns.srt.configs\nimport sgl_kernel_that_is_absent\n")
    (root / "srt" / "configs.py").write_text("")
    (root / "srt" / "layers.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("fakeengine_ns")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fakeengine_ns.srt.configs")
    assert "fakeengine_ns" not in sys.modules and "fakeengine_ns.srt" in sys.modules  # the orphans
    with pytest.raises(KeyError, match="fakeengine_ns"):
        importlib.import_module("fakeengine_ns.srt.layers")

    runtime._forget_orphans("fakeengine_ns")
    assert not [n for n in sys.modules if n.startswith("fakeengine_ns")]
    (root / "__init__.py").write_text("")  # the import can now succeed (the stand-in's role in load)
    importlib.invalidate_caches()
    assert importlib.import_module("fakeengine_ns.srt.layers")
    for name in [n for n in sys.modules if n.startswith("fakeengine_ns")]:
        del sys.modules[name]


@pytest.mark.device  # what it checks differs on a GPU host
def test_sglangs_cpu_rows_are_unavailable_on_a_host_with_a_cuda_gpu(monkeypatch):
    """SGLang registers its custom ops for the host's accelerator: on the lent H200 its torch_native decode over CPU
    tensors raised the dispatcher's NotImplementedError, and refuse_or_correct counted it a refusal (a pass)."""
    import torch

    comp = parse("sglang.torch_native")
    if comp.unavailable_reason("cuda" if torch.cuda.is_available() else "cpu"):
        pytest.skip(comp.unavailable_reason("cuda" if torch.cuda.is_available() else "cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA_VISIBLE_DEVICES" in comp.unavailable_reason("cpu")
    assert "CUDA_VISIBLE_DEVICES" in parse("hybrid(sglang.triton,sglang.gdn)").unavailable_reason("cpu")
    assert parse("torch_native").unavailable_reason("cpu") is None  # the harness's own run on any host's CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert comp.unavailable_reason("cpu") is None
