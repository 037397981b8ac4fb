"""What the installed SGLang provides, in one place: the version-dependent knowledge of the adapter.

SGLang moves every release (SGLANG.md, "Releases"): modules appear (``runtime_context``, ``cuda_graph_config``, the
breakable prefill graph), contracts change (the capture/replay hooks of the older base class became the
three-method ``init_forward_metadata_out_graph`` / ``_in_graph`` contract), classes gain the members the adapter
calls. The adapter does not ask which version is installed: it asks whether each *feature* it builds on is there,
and a row whose features are missing is unavailable and names what is missing. Following a new release is an
edit of :data:`FEATURES` (and of the code that uses a feature), with a test per contract.

Features are found by reading the installed package's source with ``ast`` (nothing is imported, so ``harness
list`` stays fast, and a release that would not even import still says what it lacks): a module exists, it defines
or imports a top-level name, a class there defines a member in its own body. Detection decides what the harness
can build, never what the engine is excused from: whether a wrapper overrides what its children override is
checked by the conformance property against the installed base class, and behaviour is always checked, never
detected.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Probe:
    """One fact about the source: ``module`` (dotted, e.g. ``sglang.srt.runtime_context``) exists; it defines (or
    imports) ``name`` at top level; the class ``name`` defines ``member`` in its body."""

    module: str
    name: str | None = None
    member: str | None = None

    def __str__(self) -> str:
        return self.module + (f".{self.name}" if self.name else "") + (f".{self.member}" if self.member else "")


@dataclass(frozen=True)
class Feature:
    what: str  # what the adapter builds with it
    probes: tuple[Probe, ...]


def _p(spec: str) -> Probe:
    """``module:Name`` or ``module:Class.member`` (module under ``sglang.``), or ``module`` alone; a member
    ``method(param)`` holds where the class's method takes that parameter."""
    module, _, name = spec.partition(":")
    cls, _, member = name.partition(".")
    return Probe(f"sglang.{module}", cls or None, member or None)


_MEM = "srt.mem_cache.memory_pool"
_BASE = "srt.layers.attention.base_attn_backend"
FEATURES: dict[str, Feature] = {
    # What every adapted backend is built with (backends/sglang/runtime.py, make_runner)
    "attention_registry": Feature("SGLang's backends by server name", (
        _p("srt.layers.attention.attention_registry:ATTENTION_BACKENDS"),
        _p("srt.layers.attention.attention_registry:attn_backend_wrapper"),
        _p(f"{_BASE}:AttentionBackend"), _p("srt.layers.radix_attention:RadixAttention"),
        _p("srt.configs.model_config:AttentionArch"))),
    # Server args, parallel settings, the backend handoff and the KV surface moved between releases; each
    # alternative is a feature, and compat.py chooses by them (a Choice needs one of its alternatives).
    "runtime_context": Feature("server args published through the runtime context "
                               "(get_context().override_server_args; 0.5.22 on)", (
        _p("srt.runtime_context:get_context"), _p("srt.runtime_context:get_exec"),
        _p("srt.runtime_context:get_schedule"), _p("srt.runtime_context:RuntimeContext.override_server_args"))),
    "global_server_args": Feature("server args published as a process-wide ServerArgs dataclass "
                                  "(set_global_server_args_for_scheduler; up to 0.5.21)", (
        _p("srt.server_args:ServerArgs"), _p("srt.server_args:set_global_server_args_for_scheduler"),
        _p("srt.server_args:get_global_server_args"))),
    "parallel_context": Feature("one attention rank entered through get_parallel().override (0.5.14 on)", (
        _p("srt.runtime_context:get_parallel"),)),
    "attn_tp_group": Feature("one attention rank as the attention TP group that backends ask for its size "
                             "(get_attention_tp_size; up to 0.5.13)", (
        _p("srt.distributed.parallel_state:_ATTN_TP"), _p("srt.layers.dp_attention:get_attention_tp_size"))),
    "forward_context": Feature("the forward context layers read their backend from (0.5.14 on)", (
        _p("srt.model_executor.forward_context:ForwardContext"),
        _p("srt.model_executor.forward_context:forward_context"))),
    "batch_attn_backend": Feature("the backend carried by the ForwardBatch, with its pools (up to 0.5.13)", (
        _p("srt.model_executor.forward_batch_info:ForwardBatch.attn_backend"),
        _p("srt.model_executor.forward_batch_info:ForwardBatch.token_to_kv_pool"),
        _p("srt.model_executor.forward_batch_info:ForwardBatch.req_to_token_pool"))),
    "cuda_graph_config": Feature("the server's CUDA-graph settings (turned off for eager rows)", (
        _p("srt.model_executor.cuda_graph_config:CudaGraphConfig"),
        _p("srt.model_executor.cuda_graph_config:PhaseConfig"),
        _p("srt.model_executor.cuda_graph_config:Backend"))),
    "parallel_state": Feature("the runner's ParallelState (0.5.16 to 0.5.20; FlashAttention reads "
                              "model_runner.ps.attn_cp_size)", (
        _p("srt.distributed.parallel_state_wrapper:ParallelState.trivial"),)),
    "kv_index_translator": Feature("the runner's KV index translator (0.5.19 on; before, backends read "
                                   "req_to_token_pool.req_to_token themselves)", (
        _p("srt.mem_cache.kv_index_translator"),
        _p("srt.model_executor.model_runner:ModelRunner.init_kv_index_translator"))),
    "kv_index_binding": Feature("the translator bound to each batch: bind_own_plan, or a graph runner's "
                                "bind_runner_slots (0.5.22 on; 0.5.19 to 0.5.21 rebind a batch's write slots at "
                                "ForwardBatch construction, rebind_write_loc)", (
        _p("srt.mem_cache.kv_index_translator:KVIndexTranslator.bind_own_plan"),
        _p("srt.mem_cache.kv_index_translator:KVIndexTranslator.bind_runner_slots"))),
    "kv_pool_views": Feature("KV pools rebuilt over the harness's buffers (shared storage)", (
        _p(f"{_MEM}:MHATokenToKVPool"), _p(f"{_MEM}:MLATokenToKVPool"), _p(f"{_MEM}:ReqToTokenPool"))),
    "kv_buffer_descs": Feature("the MHA pool's own pointer refresh (0.5.22 on; before, _create_buffers "
                               "computes the pointers inline and the adapter recomputes them)", (
        _p(f"{_MEM}:MHATokenToKVPool._build_kv_buffer_descs"),
        _p(f"{_MEM}:MHATokenToKVPool._init_data_ptrs_and_strides"))),
    "batch": Feature("SGLang's ForwardBatch and its modes (DRAFT_EXTEND is DRAFT_EXTEND_V2)", (
        _p("srt.model_executor.forward_batch_info:ForwardBatch"),
        _p("srt.model_executor.forward_batch_info:ForwardMode.DRAFT_EXTEND_V2"),
        _p("srt.speculative.eagle_info:EagleVerifyInput"), _p("srt.speculative.spec_info:SpeculativeAlgorithm"))),
    # Per mode, wrapper or leaf
    "draft_extend_v2": Feature("EAGLE v2 draft extends (EagleDraftExtendInput)", (
        _p("srt.speculative.eagle_info:EagleDraftExtendInput"),)),
    "draft_decode": Feature("EAGLE's multi-step draft decode (DraftBackendFactory.create_decode_backend, "
                            "EagleDraftInput)", (
        _p("srt.speculative.draft_utils:DraftBackendFactory.create_decode_backend"),
        _p("srt.speculative.eagle_info:EagleDraftInput"))),
    # The other speculative algorithms' verify inputs, which backends branch on (flashinfer_backend.py: DFlash's
    # verify plans a trimmed window and a sync-free graph replay; EAGLE's a host plan); EAGLE's is the core's
    "ngram_verify": Feature("n-gram speculative decoding's verify input (NgramVerifyInput)", (
        _p("srt.speculative.ngram_info:NgramVerifyInput"), _p("srt.speculative.spec_info:SpeculativeAlgorithm.NGRAM"))),
    "frozen_kv_mtp_verify": Feature("frozen-KV MTP's verify input (FrozenKVMTPVerifyInput)", (
        _p("srt.speculative.frozen_kv_mtp_info:FrozenKVMTPVerifyInput"),
        _p("srt.speculative.spec_info:SpeculativeAlgorithm.FROZEN_KV_MTP"))),
    "dflash_verify": Feature("DFlash's block verify input (DFlashVerifyInput)", (
        _p("srt.speculative.dflash_info:DFlashVerifyInput"),
        _p("srt.speculative.spec_info:SpeculativeAlgorithm.DFLASH"))),
    # The server's draft window over the committed prefix (--speculative-draft-window-size, -sink-size), which the
    # draft containers of Triton and FlashInfer (MHA) pass to their index kernel (in 0.5.22 and 0.5.23; not in
    # 0.5.10 or 0.5.16)
    "draft_prefix_window": Feature("the draft loop's window and sinks over the committed prefix "
                                   "(resolve_draft_decode_window)", (
        _p("srt.speculative.spec_utils:resolve_draft_decode_window"),)),
    # TRT-LLM MLA's draft container plans its steps itself (0.5.23; sgl-project/sglang#26241); before, it inherits
    # FlashInfer MLA's planning, which allocates the steps' index rows on "cuda" by name (0.5.10)
    "trtllm_mla_draft_plans_steps": Feature("TRT-LLM MLA's draft container planning each step on its own "
                                            "(TRTLLMMLAMultiStepDraftBackend.init_forward_metadata)", (
        _p("srt.layers.attention.trtllm_mla_backend:TRTLLMMLAMultiStepDraftBackend.init_forward_metadata"),)),
    "draft_step_slices": Feature("the draft window's per-step write slots as SGLang slices them "
                                 "(per_step_draft_out_cache_loc; before, draft_forward slices inline)", (
        _p("srt.speculative.eagle_utils:per_step_draft_out_cache_loc"),)),
    "three_method_graph_contract": Feature(
        "the metadata contract graph() drives: init_forward_metadata_out_graph(fb, in_capture) and "
        "init_forward_metadata_in_graph(fb) (older releases: init_forward_metadata_capture/replay_cuda_graph)", (
            _p(f"{_BASE}:AttentionBackend.init_forward_metadata_out_graph"),
            _p(f"{_BASE}:AttentionBackend.init_forward_metadata_in_graph"))),
    "capture_replay_graph_contract": Feature(
        "the metadata contract of the older releases, which graph() drives as SGLang's graph runner did: "
        "init_forward_metadata_capture_cuda_graph at capture, init_forward_metadata_replay_cuda_graph before each "
        "replay (up to 0.5.13)", (
            _p(f"{_BASE}:AttentionBackend.init_forward_metadata_capture_cuda_graph"),
            _p(f"{_BASE}:AttentionBackend.init_forward_metadata_replay_cuda_graph"))),
    "prefill_graph": Feature("the breakable prefill graph (graph() rows of extend batches; seen in 0.5.22 and 0.5.23, not 0.5.16)", (
        _p("srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph:BreakableCUDAGraph"),
        _p("srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph:"
           "BreakableCUDAGraphCapture"),
        # the capture in progress, which its eager_on_graph breaks read (the harness's break count reads it too)
        _p("srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph:_current_capture_var"),
        _p("srt.model_executor.runner_backend_utils.breakable_cuda_graph.context:enable_breakable_cuda_graph"),
        _p("srt.model_executor.runner_backend_utils.breakable_cuda_graph.context:is_in_breakable_cuda_graph"),
        # the model's layers by id, through which 0.5.22's RadixAttention reaches its graph-break op (and Nemotron-H's
        # mamba split op its layer, in 0.5.23 too)
        _p("srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager:"
           "set_tc_piecewise_forward_context"),
        _p("srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager:"
           "get_tc_piecewise_forward_context"),
        _p("srt.model_executor.runner_utils.forward_batch:set_forward_batch"),
        _p("srt.model_executor.runner_utils.forward_batch:get_forward_batch"))),
    "prefill_graph_flags": Feature("the prefill-graph scope's flags, which 0.5.23's layers read to take their graph "
                                   "breaks (prefill_graph_scope)", (
        _p("srt.model_executor.runner_utils.prefill_graph:prefill_graph_scope"),
        _p("srt.model_executor.runner_utils.prefill_graph:is_in_prefill_graph_scope"))),
    "tbo": Feature("two-batch overlap: TboAttnBackend and its splitter", (
        _p("srt.layers.attention.tbo_backend:TboAttnBackend"),
        _p("srt.batch_overlap.two_batch_overlap:TboForwardBatchPreparer"),
        _p("srt.batch_overlap.two_batch_overlap:compute_split_seq_index"))),
    "prefill_decode": Feature("the prefill/decode split of --prefill-attention-backend and "
                              "--decode-attention-backend (HybridAttnBackend)", (
        _p("srt.layers.attention.hybrid_attn_backend:HybridAttnBackend"),)),
    # Up to 0.5.12 TorchFlexAttnBackend hands create_block_mask bound methods (self, b, h, q_idx, kv_idx); the
    # installed torch (2.13) counts a mask function's arguments from its __code__ (5, self included) and refuses
    # them as a score_mod ("create-block_mask requires a mask_mod function!"), on every flex row of 0.5.10
    # (ci/releases.sh 0.5.10, 79 rows). 0.5.13 made them static methods.
    "flex_static_masks": Feature("flex_attention's block-mask functions as static methods, which the installed torch "
                                 "accepts (0.5.13 on)", (
        _p("srt.layers.attention.torch_flex_backend:TorchFlexAttnBackend._causal_mask@staticmethod"),
        _p("srt.layers.attention.torch_flex_backend:TorchFlexAttnBackend._decode_mask@staticmethod"))),
    "hybrid_linear": Feature("the hybrid linear-attention wrapper and its state pools", (
        _p("srt.layers.attention.hybrid_linear_attn_backend:HybridLinearAttnBackend"),
        _p("srt.layers.radix_linear_attention:RadixLinearAttention"),
        _p(f"{_MEM}:HybridReqToTokenPool"), _p(f"{_MEM}:HybridLinearKVPool"),
        _p("srt.configs.mamba_utils:Mamba2CacheParams"), _p("srt.configs.mamba_utils:Mamba2StateDType"))),
    "gdn_model": Feature("a Qwen3-Next config for GDN hybrids", (_p("srt.configs.qwen3_next:Qwen3NextConfig"),)),
    "lightning_model": Feature("a Bailing config for lightning hybrids", (
        _p("srt.configs.bailing_hybrid:BailingHybridConfig"),)),
    # LFM2's conv layer runs its own conv kernels against state its backend hands it; its forward is called as
    # the model calls it (backends/sglang/runtime.py, short_conv_layer). Up to 0.5.21 the layer reads the pool itself,
    # by request row; from 0.5.22 through ShortConvAttnBackend.conv_state_metadata.
    # A Nemotron-H model's mamba layer: SGLang's MambaMixer2 (its SSD kernels) under Mamba2AttnBackend, called as the
    # model's decoder layer calls it (NemotronHMambaDecoderLayer._forward_mamba: the backend from the batch up to
    # 0.5.21, from the forward context after).
    "mamba2_model": Feature("a Nemotron-H config, its mamba decoder layer and SGLang's Mamba-2 mixer", (
        _p("srt.configs.nemotron_h:NemotronHConfig"), _p("srt.models.nemotron_h:NemotronHMambaDecoderLayer"),
        _p("srt.models.nemotron_h:NemotronHMambaDecoderLayer._forward_mamba"),
        _p("srt.layers.attention.mamba.mamba:MambaMixer2"))),
    # The scheduler installs the selective-state-update backend the mixer's decode calls (0.5.22 on; before, the
    # mixer called its kernel directly)
    "mamba_ssu_backend": Feature("the Mamba selective-state-update backend the scheduler installs at start-up", (
        _p("kernels.ops.mamba.triton_ops.ssu_dispatch:initialize_mamba_selective_state_update_backend"),)),
    # A Kimi Linear model's KDA layer: SGLang's KimiDeltaAttention (the model's gate and step-size handling: applied in
    # the model before 0.5.22's backend took them raw) over its RadixLinearAttention, under KDAAttnBackend
    "kda_model": Feature("a Kimi Linear config, its KDA layer and SGLang's KDA backend", (
        _p("srt.configs.kimi_linear:KimiLinearConfig"), _p("srt.models.kimi_linear:KimiDeltaAttention"),
        _p("srt.layers.attention.linear.kda_backend:KDAAttnBackend"))),
    # GLM-5.3 Flash's KDA layer (its forget gate handed flat), the one KDA model whose breakable prefill graph is on
    # by default
    "glm5_kda_model": Feature("GLM-5.3 Flash's KDA layer (Glm5NextLinearAttention)", (
        _p("srt.models.glm5_next:Glm5NextLinearAttention"),)),
    # KDA's safe gate (Ling V3's, Kimi K3's: each token's log-decay held in [lower_bound, 0]), 0.5.22 on; before it
    # a KDA layer has the standard gate only
    "kda_safe_gate": Feature("KDA's safe gate (a lower_bound on RadixLinearAttention)", (
        _p("srt.layers.radix_linear_attention:RadixLinearAttention.__init__(lower_bound)"),)),
    "short_conv_model": Feature("an LFM2 config and its short-convolution layer for short-conv hybrids", (
        _p("srt.configs.lfm2:Lfm2Config"), _p("srt.models.lfm2:Lfm2ShortConv"))),
    "deepseek_mla": Feature("DeepSeek's choice of MLA forward method (FlashInfer MLA rows)", (
        _p("srt.models.deepseek_common.attention_backend_handler:handle_attention_flashinfer"),
        _p("srt.models.deepseek_common.attention_forward_methods.forward_methods:AttnForwardMethod"))),
    "mamba_clear_slots": Feature("the state pool clears a fresh request's slots (MambaPool.clear_slots, 0.5.14 "
                                 "on; before, MambaPool.alloc zeroes what it hands out)", (
        _p(f"{_MEM}:MambaPool.clear_slots"),)),
    "fla_kernels": Feature("the fla kernels SGLang vendors, where the interpreter shims patch them (CPU; 0.5.22 on)", (
        _p("kernels.ops.attention.fla.op:exp"), _p("kernels.ops.attention.fla.utils:custom_device_ctx"))),
    "fla_kernels_in_srt": Feature("the fla kernels SGLang vendors, under srt (up to 0.5.21)", (
        _p("srt.layers.attention.fla.op:exp"), _p("srt.layers.attention.fla.utils:custom_device_ctx"))),
}
# Needs that one of several release-specific features meets (the first that holds is the one compat.py uses)
CHOICES: dict[str, tuple[str, ...]] = {
    "server_args": ("runtime_context", "global_server_args"),
    "single_rank": ("parallel_context", "attn_tp_group"),
    "backend_handoff": ("forward_context", "batch_attn_backend"),
    "fla_kernels_path": ("fla_kernels", "fla_kernels_in_srt"),
    "graph_contract": ("three_method_graph_contract", "capture_replay_graph_contract"),
    # Where backends read the parallel layout: a ParallelState handed to the runner (0.5.16 to 0.5.20), else the runtime
    # context or the TP group beside a runner attribute (compat.init_runner_caches sets both forms)
    "parallel_layout": ("parallel_state", "parallel_context", "attn_tp_group"),
}
# Every SGLang row needs these
CORE = ("attention_registry", "server_args", "single_rank", "backend_handoff", "kv_pool_views", "batch")


def package_root(package: str = "sglang") -> Path | None:
    """The installed package's folder, found without importing it (a release or a source checkout)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class _Module:
    names: frozenset[str]  # defined or imported at top level
    members: dict[str, frozenset[str]]  # class -> what its body defines


def _targets(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _body_names(body) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            # A function's parameters are also "NAME(PARAM)" (a probe can ask whether a method takes an argument)
            arguments = getattr(node, "args", None)
            if arguments is not None:
                names.update(f"{node.name}({a.arg})" for a in (*arguments.posonlyargs, *arguments.args,
                                                               *arguments.kwonlyargs))
            # A static method is also "NAME@staticmethod" (a probe can ask how a member is defined)
            if any(getattr(d, "id", None) == "staticmethod" for d in getattr(node, "decorator_list", ())):
                names.add(f"{node.name}@staticmethod")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(_targets(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions (try: import ... except: ...)
            for part in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                         *[h.body for h in getattr(node, "handlers", [])]):
                names |= _body_names(part)
    return names


@cache
def _read(root: Path, module: str) -> _Module | None:
    parts = module.split(".")[1:]
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            members = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members[node.name] = frozenset(_body_names(node.body))
            return _Module(frozenset(_body_names(tree.body)), members)
    return None


def probe_fails(root: Path, probe: Probe) -> str | None:
    """Why ``probe`` does not hold in the package at ``root`` (None: it holds)."""
    module = _read(root, probe.module)
    if module is None:
        return f"no module {probe.module}"
    if probe.name is None:
        return None
    if probe.member is None:
        return None if probe.name in module.names else f"{probe.module} has no {probe.name}"
    if probe.name not in module.members:
        return f"{probe.module} defines no class {probe.name}"
    return None if probe.member in module.members[probe.name] else f"{probe.module}.{probe.name} has no {probe.member}"


def _feature_fails(root: Path, name: str) -> str | None:
    feature = FEATURES[name]
    why = list(dict.fromkeys(w for w in (probe_fails(root, p) for p in feature.probes) if w))
    return f"{name} ({feature.what}): {'; '.join(why)}" if why else None


def missing_in(root: Path, names) -> list[str]:
    """``feature (what it is for): why`` for each of ``names`` (a feature or a :data:`CHOICES` need) that does not
    hold at ``root``; a need none of whose alternatives holds names each alternative and why."""
    out = []
    for name in names:
        if name in CHOICES:
            fails = [_feature_fails(root, alt) for alt in CHOICES[name]]
            if all(fails):
                out.append(f"{name}, one of: " + " | ".join(fails))
        elif (why := _feature_fails(root, name)) is not None:
            out.append(why)
    return out


def chosen(need: str) -> str | None:
    """Which alternative of a :data:`CHOICES` need the installed SGLang has (the first that holds), or None."""
    return next((alt for alt in CHOICES[need] if has(alt)), None)


@cache
def missing(names: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`missing_in` for the installed SGLang (empty when it is not installed: that is said elsewhere)."""
    root = package_root()
    return () if root is None else tuple(missing_in(root, names))


def has(name: str) -> bool:
    return not missing((name,))


# The feature each speculative algorithm's verify needs (batch.spec.VERIFY_ALGORITHMS; EAGLE's is the core's)
VERIFY_FEATURES = {"frozen_kv_mtp": "frozen_kv_mtp_verify", "ngram": "ngram_verify", "dflash": "dflash_verify"}


def verify_algorithms() -> frozenset[str]:
    """The speculative algorithms whose verify input the installed SGLang has."""
    return frozenset({"eagle"} | {alg for alg, feature in VERIFY_FEATURES.items() if has(feature)})


def forget() -> None:
    """Drop what was read (a test that changes the source it reads)."""
    missing.cache_clear()
    _read.cache_clear()


# What a composition's wrappers and modes need beyond its leaves' features (backends/registry.py asks)
WRAPPER_FEATURES = {"tbo": ("tbo",), "graph": ("graph_contract",), "pd": ("prefill_decode",)}


# Wrapper combinations that need more than each wrapper does: a CUDA graph of TBO batches is driven through the
# three-method contract only. Up to 0.5.13 SGLang captures TBO graphs for even batch sizes alone (cuda_graph_runner.py,
# get_batch_sizes_to_capture: mul_base 2; TboAttnBackend asserts two non-empty halves at capture), while the graph
# runner captures each batch at its own size.
COMBINATION_FEATURES = {frozenset({"graph", "tbo"}): ("three_method_graph_contract",)}


def wrapper_gaps(wrappers: set[str]) -> list[str]:
    """What the installed SGLang lacks for these wrappers over its backends."""
    needs = [f for w in sorted(wrappers) for f in WRAPPER_FEATURES.get(w, ())]
    needs += [f for combo, fs in COMBINATION_FEATURES.items() if combo <= wrappers for f in fs]
    return list(missing(tuple(dict.fromkeys(needs))))


def mode_gaps(wrappers: set[str]) -> list[tuple[str, str]]:
    """(mode value, why) for each mode the installed SGLang cannot serve under these wrappers: EAGLE v2 draft
    extends need EagleDraftExtendInput; graph() extends run through the breakable prefill graph, graph() draft
    extends through the three-method contract."""
    gaps = [("draft_extend", m) for m in missing(("draft_extend_v2",))]
    gaps += [("draft_decode", m) for m in missing(("draft_decode",))]
    if "graph" in wrappers:
        gaps += [("extend", m) for m in missing(("prefill_graph",))]
        # Up to 0.5.12 draft extends are captured by their own runner (eagle_draft_extend_cuda_graph_runner.py),
        # which rewrites the spec input's lengths and positions into its buffers before each replay hook; the
        # adapter drives the older contract as the decode runner does only.
        gaps += [("draft_extend", m) for m in missing(("three_method_graph_contract",))]
    return gaps


@cache
def source_identity() -> dict[str, str | bool]:
    """For an SGLang installed from a git checkout (``pip install -e python/``), the checkout's commit and whether
    its tree is dirty; empty for a release (its version says which it is)."""
    import subprocess

    root = package_root()
    if root is None or "site-packages" in root.parts or "dist-packages" in root.parts:
        return {}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": bool(status.strip())}


def version_key(version: str) -> tuple[int, ...]:
    """Order of SGLang versions: ``0.5.22 < 0.5.23rc0 < 0.5.23 < 0.5.23.post1 < 0.5.24.dev3+g1234`` (a pre-release
    or dev build sorts before its release; a local suffix is ignored)."""
    import re

    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:\.?(rc|dev|post)\.?(\d+))?", version)
    if m is None:
        raise ValueError(f"not an SGLang version: {version!r}")
    tag = {"dev": -2, "rc": -1, None: 0, "post": 1}[m[4]]
    return int(m[1]), int(m[2]), int(m[3]), tag, int(m[5] or 0)


# ---- SGLang's registered attention backends, read from its registry's source (harness list --why) ----


@dataclass(frozen=True)
class RegisteredBackend:
    name: str  # the server's --attention-backend name
    classes: tuple[tuple[str, str], ...]  # (module, class) of each class its factory returns, in source order


@cache
def registered_backends() -> tuple[RegisteredBackend, ...]:
    """Every ``@register_attention_backend("name")`` of the installed SGLang's registry, with the classes its factory
    returns (``return Cls(runner, ...)``, each matched to the ``from MODULE import Cls`` that brings it). Read from
    the source: nothing is imported."""
    root = package_root()
    path = None if root is None else root / "srt" / "layers" / "attention" / "attention_registry.py"
    if path is None or not path.is_file():
        return ()
    out = []
    for node in ast.parse(path.read_text(encoding="utf-8", errors="replace")).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        names = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call)
                 and getattr(d.func, "id", None) == "register_attention_backend" and d.args
                 and isinstance(d.args[0], ast.Constant)]
        if not names:
            continue
        imported = {}
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module:
                imported.update({(a.asname or a.name): (inner.module, a.name) for a in inner.names})
        returned = []
        for inner in ast.walk(node):
            if isinstance(inner, ast.Return) and isinstance(inner.value, ast.Call) \
                    and isinstance(inner.value.func, ast.Name) and inner.value.func.id in imported:
                where = imported[inner.value.func.id]
                if where not in returned:
                    returned.append(where)
        out.append(RegisteredBackend(names[0], tuple(returned)))
    return tuple(out)


# Which stand-ins the import probe runs under (runtime._install_shims): part of its cache key, so a change of them
# asks again. 2: sgl_kernel's on every device (before: on CUDA only); 3: flash_mla's where it is absent.
PROBE_STAND_INS = 3
# The packages runtime._install_shims stands in for where they are absent (the key names those absent here)
STAND_INS = ("torchvision", "IPython", "sniffio", "sgl_kernel", "flash_mla")


def really_installed(name: str) -> bool:
    """Whether the package ``name`` itself is importable here, not the inert stand-in ``runtime._install_shims`` puts
    in its place (which ``importlib.util.find_spec`` also finds once a process has loaded SGLang)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and not getattr(spec.loader, "harness_stand_in", False)
IMPORT_PROBE = """
import importlib, json, sys
out = {}
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        out[module] = None
    except BaseException as e:  # noqa: BLE001 - any failure to import is the answer
        out[module] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
print(json.dumps(out))
"""


def import_failures(modules: list[str], timeout_s: float = 120.0) -> dict[str, str | None]:
    """module -> why it does not import here (None: it imports), from a fresh process with the harness's stand-ins
    for what a CPU install of SGLang lacks (backends/sglang/runtime.py); {} if the probe itself failed."""
    import json
    import subprocess
    import sys

    code = ("from backends.sglang import runtime; runtime._install_shims()\n" + IMPORT_PROBE)
    try:
        done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                              timeout=timeout_s)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return {}



def _import_cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attn-harness" / "sglang-imports.json"


@cache
def registered_import_failures() -> dict[str, str | None]:
    """module -> why it does not import here (None: it imports), for the module of every class the installed
    SGLang's registry returns. One fresh process answers for all of them (SGLang's import takes 10-25 s), and the
    answer is kept per installed SGLang (its version, folder and registry file's modification time) in the user's
    cache folder, as the Triton interpreter probe's is: every process of a run asks."""
    import json
    import sys

    root = package_root()
    if root is None:
        return {}
    modules = sorted({mod for b in registered_backends() for mod, _ in b.classes})
    registry = root / "srt" / "layers" / "attention" / "attention_registry.py"
    try:
        stamp = registry.stat().st_mtime_ns
    except OSError:
        stamp = 0
    from importlib import metadata

    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        version = "-"
    # which stand-ins the probe runs under: a package installed (or removed) later asks again
    absent = [name for name in STAND_INS if not really_installed(name)]
    key = (f"sglang {version} at {root} ({stamp}), python {sys.version.split()[0]} at {sys.prefix}, "
           f"stand-ins {PROBE_STAND_INS} for {','.join(absent) or 'none'}")
    path = _import_cache_file()
    try:
        known = json.loads(path.read_text())
        if isinstance(known, dict) and isinstance(known.get(key), dict) and set(known[key]) == set(modules):
            return known[key]
    except (OSError, ValueError):
        known = {}
    verdicts = import_failures(modules)
    if verdicts:  # an empty answer is the probe's own failure: asked again next time
        try:
            known = known if isinstance(known, dict) else {}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**known, key: verdicts}, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return verdicts


def _own_classes(name: str) -> list[tuple[str, str]]:
    """(module, class) of the classes SGLang's ``--attention-backend name`` factory returns, less another backend's
    main class (the first its factory returns) where it is not this one's too: fa4's factory returns triton's
    TritonAttnBackend for one diffusion model; fa3's and fa4's main class is the same FlashAttentionBackend."""
    registered = registered_backends()
    entry = next((b for b in registered if b.name == name), None)
    if entry is None or not entry.classes:
        return []
    others = {b.classes[0] for b in registered if b.name != name and b.classes} - {entry.classes[0]}
    return [c for c in entry.classes if c not in others]


def class_unavailable_reason(name: str) -> str | None:
    """Why no class of its own that SGLang's ``--attention-backend name`` builds can be read here: the installed
    release registers no such backend, or none of its own classes (``_own_classes``) imports (their kernels'
    packages missing; a factory picks one class per platform, e.g. fa3's ``MusaFlashAttentionBackend``), or None."""
    entry = next((b for b in registered_backends() if b.name == name), None)
    if entry is None:
        return f"the installed SGLang registers no attention backend {name!r}"
    own = _own_classes(name)
    if not own:
        return f"SGLang's {name!r} factory returns no class of its own that the harness finds in its source"
    verdicts = registered_import_failures()
    if not verdicts:
        return "the import probe of SGLang's attention modules failed here"
    failures = [f"{cls}: {verdicts.get(module) or 'not probed'}" for module, cls in own
                if verdicts.get(module, "not probed")]
    if len(failures) == len(own):
        return "no class of it imports here (" + "; ".join(failures) + ")"
    return None


def importable_classes(name: str) -> list[tuple[str, str]]:
    """(module, class) of each class of its own (``_own_classes``) that SGLang's ``--attention-backend name``
    factory returns and that imports here."""
    verdicts = registered_import_failures()
    return [(m, c) for m, c in _own_classes(name) if m in verdicts and verdicts[m] is None]
