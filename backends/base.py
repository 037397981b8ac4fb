"""The backend protocol (SGLang 0.5.23's ``AttentionBackend``), the capability declaration and the planned
metadata.

Every backend and wrapper implements the methods of :class:`AttentionBackend` under SGLang 0.5.23's names and
argument names; :data:`PROTOCOL_METHODS` is the one list of them, with the call SGLang makes to each. Metadata
follows SGLang's three-method contract:

* ``init_forward_metadata(forward_batch)``: eager planning. The base calls
  ``init_forward_metadata_out_graph(forward_batch)`` then ``init_forward_metadata_in_graph(forward_batch)``;
  a backend may override it with its own eager body (ours do).
* ``init_forward_metadata_out_graph(forward_batch, in_capture=False)``: host-side planning that runs outside
  graph capture: at capture (``in_capture=True``, over the padded static batch), before every replay
  (``in_capture=False``, the static batch now holding the real one) and, through the base's
  ``init_forward_metadata``, in eager mode. The base's is a no-op.
* ``init_forward_metadata_in_graph(forward_batch)``: static-shape device ops recorded into the graph at
  capture and re-run by every replay (no ``.item()``, ``.cpu()``, ``.tolist()`` or dynamic shapes). The base's
  is a no-op.

The legacy ``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph`` hooks are gone, as in
SGLang; so is ``get_verify_buffers_to_fill_after_draft``, replaced by the :attr:`AttentionBackend.verify_mask`
property (the tree mask the draft stage fills in place, or None). ``update_verify_buffers_to_fill_after_draft``
stays; the base raises there, so a backend the overlap plan stream can reach must define it.

Elsewhere the base raises :class:`NotImplementedError` naming the class and the method, except for ``forward``,
which dispatches by mode as SGLang's base does (MIXED goes to ``forward_extend``: SGLang sends it to
``forward_mixed`` only on NPUs). A *wrapper* must still define every protocol member itself (linear-attention
layers call ``forward`` with keywords only; an inherited default does not delegate), and the conformance
property checks that.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional

import torch

from batch.spec import RECURRENT_KINDS, VERIFY_ALGORITHMS, BatchSpec, ForwardMode

# The modes a backend of SGLang 0.5.23 serves, named one by one: a mode added to ForwardMode later joins no
# backend's declaration until someone declares it.
SERVING_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                           ForwardMode.DRAFT_EXTEND, ForwardMode.IDLE})


# Modes of a backend that also serves a draft worker's multi-step draft decode (AttentionBackend.multi_step_draft)
DRAFTING_MODES = SERVING_MODES | {ForwardMode.DRAFT_DECODE}


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to anything but empty, ``0``, ``false`` or ``False``."""
    return os.environ.get(name, "") not in ("", "0", "false", "False")

# The protocol, in one place: every method a backend and a wrapper must provide, each with the call SGLang
# 0.5.23 makes to it (positional arguments, keywords). The values are placeholders: conformance binds the call
# to each implementation's signature, and its spies take exactly these signatures.
PROTOCOL_METHODS: dict[str, tuple[tuple, dict]] = {
    "init_forward_metadata": (("forward_batch",), {}),
    "init_forward_metadata_out_graph": (("forward_batch",), {"in_capture": True}),
    "init_forward_metadata_in_graph": (("forward_batch",), {}),
    "forward": (("q", "k", "v", "layer", "forward_batch"), {"save_kv_cache": True}),
    "forward_extend": (("q", "k", "v", "layer", "forward_batch"), {"save_kv_cache": True}),
    "forward_decode": (("q", "k", "v", "layer", "forward_batch"), {"save_kv_cache": True}),
    "init_cuda_graph_state": ((), {"max_bs": 4, "max_num_tokens": 4}),
    "get_cuda_graph_seq_len_fill_value": ((), {}),
    "update_verify_buffers_to_fill_after_draft": ((), {"spec_info": None, "cuda_graph_bs": 4}),
}
# Properties of the protocol (read, never called).
PROTOCOL_PROPERTIES = ("verify_mask",)
# Members whose base implementation a backend (not a wrapper) may keep: the base's mode dispatch, the eager
# entry that runs out_graph then in_graph, the empty in-graph step, and "no verify mask".
BASE_DEFAULTS = frozenset({"forward", "init_forward_metadata", "init_forward_metadata_in_graph", "verify_mask"})
# Optional members: callers check ``hasattr`` (init_mha_chunk_metadata) or, like SGLang off NPUs, never call
# them (forward_mixed).
OPTIONAL_METHODS = ("init_mha_chunk_metadata", "forward_mixed")


def call_accepting(fn, *args, **kwargs):
    """Call ``fn`` with only the keyword arguments its signature accepts."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


class EngineBrokeInvariant(AssertionError):
    """What an engine handed the harness breaks an invariant of its own data (a child batch whose per-token
    tensors do not match its token count, say). Raised by an adapter that checks what it reads before using it:
    a finding, never an adapter error, although the adapter's frame raised it."""


@dataclass(frozen=True)
class Capabilities:
    """What one backend supports; the test matrix is derived from these declarations."""

    attention_kinds: frozenset[str]
    modes: frozenset[ForwardMode]  # declared explicitly: a new mode joins no backend by default
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    head_dims: Optional[frozenset[int]] = None  # qk head dims it compiles for (MHA, lightning layers); None = any
    # MLA layers' (kv_lora_rank, qk_rope_head_dim) pairs its kernels take (SGLang's Triton MLA decode: 512 + 64 and
    # 256 + 32 only); None = any
    mla_latents: Optional[frozenset[tuple[int, int]]] = None
    # The engine builds one KV pool and one linear-attention config per model: every layer of a kind has one
    # shape (its Layer.SHAPE fields). Our own backends size each layer's pools by the layer.
    one_shape_per_kind: bool = False
    page_sizes: Optional[frozenset[int]] = None  # None = any
    custom_mask: bool = True
    sliding_window: bool = True
    logit_cap: bool = True
    mrope: bool = True
    cuda_graph_modes: frozenset[ForwardMode] = frozenset()  # modes it plans graphs for (out_graph/in_graph)
    # A linear backend whose layers a decode/verify graph captures (it plans them on the graph's static
    # buffers, as SGLang's GDN does); False: its kernels plan on the host and run eagerly between the graph's
    # pieces (capturing them would freeze one batch's plan into every replay).
    graph_captures_linear: bool = False
    # EXTEND batches run through a breakable prefill graph (engine.graph_runner.PrefillGraphRunner): the backend
    # object provides the engine's capture and scope, and its attention layers break out of the graph
    prefill_graph: bool = False
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    requires: tuple[str, ...] = ()  # importable module names
    # An engine's leaf: the features of the installed engine it is built with beyond the adapter's core
    # (backends/sglang/features.py), and those its CPU path needs too
    engine_features: tuple[str, ...] = ()
    cpu_engine_features: tuple[str, ...] = ()
    cpu_needs_env: str | None = None  # an environment flag the CPU path needs (Triton's interpreter)
    cpu_dtypes: frozenset[str] | None = None  # where the CPU path supports fewer dtypes (None: all of dtypes)
    # The soft-cap's tanh is computed as 2*sigmoid(2x) - 1, which cancels for small scores: the capped score
    # carries an absolute error of about 2*cap*u(float32) (properties/tolerances.py counts it).
    softcap_via_sigmoid: bool = False
    # Linear attention: TARGET_VERIFY leaves the committed conv state holding the window after the last draft
    # token (SGLang's GDN updates it in place); the commit after verify then writes the last accepted step's
    # window over it. False: verify changes only the intermediate (per-step) pools.
    verify_advances_conv_state: bool = False
    # Why one case takes seconds on a CPU (e.g. kernels interpreted by Triton); profiles draw fewer examples
    slow_on_cpu: str | None = None
    # Why a long-context batch (tens of thousands of cached keys) is out of a CPU's reach for this backend (work
    # that grows with the square of a request's key count, say); None: it draws them there too. Interpreted
    # backends never draw them on a CPU (Support.interpreted_on_cpu), whatever this says.
    no_long_context_on_cpu: str | None = None
    engine: str = "harness"  # whose classes run: "harness" (ours) or a serving engine's, through its adapter
    # A class-level leaf (backends/sglang/classes.py): why only its classes are checked (conformance), never built
    # or run, and the engine's --attention-backend name whose classes it reads (available where one imports)
    class_only: str | None = None
    engine_classes: str | None = None
    # A plan-level leaf (backends/sglang/plans.py): built, and its planning run (init_forward_metadata), its kernels
    # stand-ins that raise when called; why its forward cannot run here. Only plan-level properties run on it.
    plan_only: str | None = None
    gaps: tuple[tuple[str, str], ...] = ()  # (property, why it does not apply to this backend)
    cpu_gaps: tuple[tuple[str, str], ...] = ()  # (property, why it cannot run on the CPU path)
    # DRAFT_EXTEND batches cover the whole draft window for every request (EAGLE v2: accepted tokens first, the
    # rest padding), never a ragged accepted count
    fixed_width_draft_extend: bool = False
    # (wrapper, mode, why): a mode not run when this backend is under that wrapper (e.g. a known engine bug
    # whose symptom would take the process down instead of failing a check)
    wrapped_gaps: tuple[tuple[str, ForwardMode, str], ...] = ()
    # Unit roundoff of the kernel's matrix products for float32 inputs. Triton's default TF32 dot truncates an
    # fp32 operand to TF32's 10 explicit mantissa bits (triton-lang/triton#4574): 2**-10; tf32x3: 2**-21.
    fp32_matmul_roundoff: float = 2.0**-24
    # The same on the CPU path, where it is finer: Triton's interpreter computes tl.dot as an exact float32 numpy
    # product whatever its input_precision (triton/runtime/interpreter.py, create_dot). None: as on CUDA.
    cpu_fp32_matmul_roundoff: float | None = None
    # Unit roundoff of operands the kernels round to a type coarser than the layer's, whatever that is (SGLang's KDA
    # chunk kernels: blocks cast to bfloat16 before their dots, 2**-8, also in a float16 model); 0: none.
    operand_roundoff: float = 0.0
    # Takes KDA layers with the safe gate (KdaLayer.lower_bound); False: the standard gate only
    kda_safe_gate: bool = True
    # (engine feature, capability field, its value where the installed engine lacks the feature): declarations that
    # hold from some release of the engine on (an engine's leaf; backends/registry.py applies them)
    engine_limits: tuple[tuple[str, str, object], ...] = ()
    # Key or query counts at which the kernels change shape (a new key block, a KV split that becomes
    # non-empty, a prefix chunk): the strategies draw lengths at and across each (L - 1, L, L + 1), within
    # the profile's Profile.max_boundary. Compiled and interpreted configurations both listed.
    length_boundaries: frozenset[int] = frozenset()
    # Takes EXTEND/MIXED requests with no new tokens after a cached prefix (BatchSpec's docstring: where
    # engines produce them).
    empty_extend: bool = False
    # Whether the backend verifies draft trees (speculative_eagle_topk > 1); False: a model with it is served
    # with topk 1 only (the backend refuses more when it is built), so its batches verify chains.
    draft_trees: bool = True
    # A linear backend whose model's MTP draft worker the engine wraps in its hybrid too (with the draft's one full
    # layer, id 0); False: the draft model has no layer of this kind and runs its full backend alone.
    hybrid_draft_worker: bool = True
    # Applies the sliding window under a tree mask (TARGET_VERIFY) by positions (seq_len + depth), as
    # batch.spec.MHALayer defines it; a kernel that counts row indices instead is right for chains only.
    verify_window: bool = False
    # Its multi-step draft container (DRAFT_DECODE) is built for a model with a sliding window; False: the engine
    # refuses to build it for one, so a server with such a draft model cannot run the loop on this backend.
    draft_window: bool = True
    # Its multi-step draft container honours the server's draft window (--speculative-draft-window-size and
    # --speculative-draft-sink-size: each step reads the prefix's sinks and recent tokens only,
    # SpecInput.draft_prefix_columns); ours (backends/draft.py) does. Not to be confused with draft_window above
    # (a draft model whose layers have sliding windows of their own).
    draft_prefix_window: bool = True
    # ... also over pages of more than one token. False for a backend whose draft steps read whole pages of our
    # branch table (backends/draft.py), which the window's sinks and recent tokens leave unaligned.
    paged_draft_prefix_window: bool = True
    # Its draft loop takes draft trees (topk > 1) over pages of more than one token, in SGLang's paged tree layout
    # (batch.spec.draft_region: each branch's own pages, the prefix's last partial page repeated in each)
    paged_draft_trees: bool = True
    # Its multi-step draft container takes draft trees (topk > 1); False: the engine refuses to build it for more
    # (FlashInfer MLA's, FlashMLA's, TRT-LLM MLA's and CuTe DSL MLA's: "only supports topk=1"), so its draft loop runs
    # chains only, whatever its verify takes (draft_trees: an ngram verify reaches trees without a draft loop)
    draft_loop_trees: bool = True
    # The speculative algorithms whose target verify it serves (batch.spec.VERIFY_ALGORITHMS): ours read the tree
    # whatever its algorithm; an engine's backends branch on the verify input's class
    verify_algorithms: frozenset[str] = frozenset(VERIFY_ALGORITHMS)
    # KV cache storage it reads and writes (batch.spec.KV_CACHE_DTYPES): "auto" (the batch's dtype), "fp8_e4m3";
    # and whether it honours per-layer KV scales other than 1 (stores k / k_scale, reads back times k_scale).
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    kv_scales: bool = True

    def unavailable_reason(self, device: str) -> str | None:
        """Why this backend cannot run on ``device`` here, or None."""
        if device not in self.devices:
            return f"needs a {' or '.join(sorted(self.devices))} device (this run uses {device})"
        if device == "cuda" and not torch.cuda.is_available():
            return "needs a CUDA GPU; none is visible"
        if self.engine == "sglang" and device == "cpu":
            from backends.sglang.runtime import cpu_on_a_cuda_host

            reason = cpu_on_a_cuda_host()  # first: nothing else on this host would make these rows run
            if reason:
                return reason
        if device == "cpu" and self.cpu_needs_env and not env_flag(self.cpu_needs_env):
            return f"on the CPU it needs {self.cpu_needs_env}=1 (set before triton is imported)"
        if device == "cpu" and self.cpu_needs_env == "TRITON_INTERPRET":
            from backends.interpreter import interpreter_fault

            fault = interpreter_fault()
            if fault:
                return fault
        if self.engine == "sglang":
            from backends.sglang.runtime import unavailable_reason

            reason = unavailable_reason(self.engine_features + (self.cpu_engine_features if device == "cpu" else ()))
            if reason:
                return reason
            if self.engine_classes:
                from backends.sglang.features import class_unavailable_reason

                reason = class_unavailable_reason(self.engine_classes)
                if reason:
                    return reason
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"package '{module}' is not installed"
        return None



def _roundoffs(caps: list[Capabilities]) -> dict[str, float]:
    """device -> the coarsest float32 matrix-product roundoff among ``caps`` there (none: float32's own)."""
    def on(c: Capabilities, device: str) -> float:
        cpu = c.cpu_fp32_matmul_roundoff
        return cpu if device == "cpu" and cpu is not None else c.fp32_matmul_roundoff
    return {device: max((on(c, device) for c in caps), default=2.0**-24) for device in ("cpu", "cuda")}


@dataclass(frozen=True)
class Support:
    """What a composition of backends supports: its leaves' declarations combined, read in one place by the
    matrix, the strategies (to draw only batches inside it) and ``repro`` (to refuse a case outside it).

    Modes, dtypes, page sizes and mrope must hold for every leaf; head dims, sliding window, logit cap and the KV
    cache (dtypes, scales) for the leaves that own full-attention layers (a linear backend never sees those
    layers).
    """

    attention_kinds: frozenset[str]
    modes: frozenset[ForwardMode]
    dtypes: frozenset[str]
    head_dims: Optional[frozenset[int]]  # the full-attention leaves' (MHA layers)
    mla_latents: Optional[frozenset[tuple[int, int]]]  # the full-attention leaves' (MLA layers)
    page_sizes: Optional[frozenset[int]]
    sliding_window: bool
    logit_cap: bool
    mrope: bool
    cuda_graph_modes: frozenset[ForwardMode]
    fp32_matmul_roundoff: dict[str, float]  # device -> the full-attention leaves' (every leaf's when there is none)
    linear_fp32_matmul_roundoff: dict[str, float]  # device -> the linear leaves': each layer is held to its own's
    cpu_dtypes: frozenset[str]
    gaps: dict[str, str]  # property -> why it does not apply
    softcap_via_sigmoid: bool
    length_boundaries: frozenset[int]  # every leaf's: a composition runs all its leaves' kernels
    empty_extend: bool
    verify_window: bool
    draft_trees: bool = True
    hybrid_draft_worker: bool = True  # every linear leaf's (see Capabilities)
    draft_window: bool = True  # the full-attention leaves' (see Capabilities)
    draft_prefix_window: bool = True  # the full-attention leaves' (see Capabilities)
    paged_draft_prefix_window: bool = True  # the full-attention leaves' (see Capabilities)
    paged_draft_trees: bool = True  # the full-attention leaves' (see Capabilities)
    draft_loop_trees: bool = True  # the full-attention leaves' (see Capabilities)
    verify_algorithms: frozenset[str] = frozenset(VERIFY_ALGORITHMS)  # every leaf's (see Capabilities)
    verify_advances_conv_state: bool = False
    slow_on_cpu: str | None = None
    # Some leaf's CPU path runs kernels under Triton's interpreter (the only flag a CPU path needs): cases take
    # seconds to minutes there (a wide batch of SGLang's Triton decode: 125 s), whatever the examples drawn
    interpreted_on_cpu: bool = False
    no_long_context_on_cpu: str | None = None  # some leaf's reason (Capabilities.no_long_context_on_cpu)
    class_only: str | None = None  # some leaf's reason (Capabilities.class_only): only class-level properties run
    plan_only: str | None = None  # some leaf's reason (Capabilities.plan_only): only plan-level properties run
    cpu_gaps: dict[str, str] = field(default_factory=dict)  # property -> why it cannot run on the CPU
    fixed_width_draft_extend: bool = False
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    kv_scales: bool = True
    graph_captures_linear: bool = False  # every linear leaf's layers are captured (see Capabilities)
    prefill_graph: bool = False  # every leaf runs EXTEND batches through a breakable prefill graph
    linear_head_dims: Optional[frozenset[int]] = None  # the linear leaves' (lightning layers)
    one_shape_per_kind: bool = False  # any leaf's (see Capabilities)
    linear_operand_roundoff: float = 0.0  # the linear leaves' coarsest (Capabilities.operand_roundoff)
    kda_safe_gate: bool = True  # every linear leaf's (Capabilities.kda_safe_gate)

    def matmul_roundoff(self, layer_kind: str, device: str) -> float:
        """Unit roundoff of float32 matrix products in the kernels that run a layer of ``layer_kind`` on
        ``device`` ("cpu" or "cuda")."""
        per_device = self.linear_fp32_matmul_roundoff if layer_kind in RECURRENT_KINDS else self.fp32_matmul_roundoff
        return per_device["cpu" if device == "cpu" else "cuda"]

    def operand_roundoff(self, layer_kind: str) -> float:
        """Unit roundoff of operands the kernels of a ``layer_kind`` layer round coarser than its dtype (0: none)."""
        return self.linear_operand_roundoff if layer_kind in RECURRENT_KINDS else 0.0

    @classmethod
    def of(cls, caps: list[Capabilities]) -> "Support":
        """The support of a composition whose leaves declare ``caps`` (see the class docstring for which
        fields must hold for every leaf and which for the full-attention ones only); TARGET_VERIFY is dropped
        unless every leaf takes custom masks."""
        full = [c for c in caps if c.attention_kinds & {"mha", "mla"}]
        linear = [c for c in caps if c.attention_kinds & RECURRENT_KINDS]

        def meet(values):  # None (any) is the identity
            """Intersection of the sets that are not None; None (any) when every one is None."""
            values = [v for v in values if v is not None]
            return frozenset.intersection(*values) if values else None

        modes = frozenset.intersection(*(c.modes for c in caps))
        if not all(c.custom_mask for c in caps):
            modes -= {ForwardMode.TARGET_VERIFY}
        return cls(attention_kinds=frozenset().union(*(c.attention_kinds for c in caps)), modes=modes,
                   dtypes=frozenset.intersection(*(c.dtypes for c in caps)),
                   head_dims=meet([c.head_dims for c in full]), mla_latents=meet([c.mla_latents for c in full]),
                   page_sizes=meet([c.page_sizes for c in caps]),
                   linear_head_dims=meet([c.head_dims for c in linear]),
                   one_shape_per_kind=any(c.one_shape_per_kind for c in caps),
                   sliding_window=all(c.sliding_window for c in full), logit_cap=all(c.logit_cap for c in full),
                   mrope=all(c.mrope for c in caps),
                   cuda_graph_modes=frozenset.intersection(*(c.cuda_graph_modes for c in caps)),
                   fp32_matmul_roundoff=_roundoffs(full or caps),
                   linear_fp32_matmul_roundoff=_roundoffs(linear),
                   linear_operand_roundoff=max((c.operand_roundoff for c in linear), default=0.0),
                   kda_safe_gate=all(c.kda_safe_gate for c in linear),
                   cpu_dtypes=frozenset.intersection(*((c.cpu_dtypes or c.dtypes) for c in caps)),
                   gaps={prop: why for c in caps for prop, why in c.gaps},
                   cpu_gaps={prop: why for c in caps for prop, why in c.cpu_gaps},
                   fixed_width_draft_extend=any(c.fixed_width_draft_extend for c in caps),
                   softcap_via_sigmoid=any(c.softcap_via_sigmoid for c in full),
                   verify_advances_conv_state=any(c.verify_advances_conv_state for c in caps),
                   slow_on_cpu=next((c.slow_on_cpu for c in caps if c.slow_on_cpu), None),
                   interpreted_on_cpu=any(c.cpu_needs_env == "TRITON_INTERPRET" for c in caps),
                   no_long_context_on_cpu=next((c.no_long_context_on_cpu for c in caps if c.no_long_context_on_cpu),
                                               None),
                   class_only=next((c.class_only for c in caps if c.class_only), None),
                   plan_only=next((c.plan_only for c in caps if c.plan_only), None),
                   kv_cache_dtypes=frozenset.intersection(*(c.kv_cache_dtypes for c in full))
                   if full else frozenset({"auto"}),
                   kv_scales=all(c.kv_scales for c in full),
                   graph_captures_linear=bool(linear) and all(c.graph_captures_linear for c in linear),
                   prefill_graph=all(c.prefill_graph for c in caps),
                   length_boundaries=frozenset().union(*(c.length_boundaries for c in caps)),
                   empty_extend=all(c.empty_extend for c in caps),
                   draft_trees=all(c.draft_trees for c in caps),
                   hybrid_draft_worker=all(c.hybrid_draft_worker for c in linear),
                   verify_window=all(c.verify_window for c in full),
                   draft_window=all(c.draft_window for c in full),
                   draft_prefix_window=all(c.draft_prefix_window for c in full),
                   paged_draft_prefix_window=all(c.paged_draft_prefix_window for c in full),
                   paged_draft_trees=all(c.paged_draft_trees for c in full),
                   draft_loop_trees=all(c.draft_loop_trees for c in full),
                   verify_algorithms=frozenset.intersection(*(c.verify_algorithms for c in caps)))

    def unsupported_reason(self, spec: BatchSpec) -> str | None:
        """Why a batch of ``spec`` is outside this support, or None."""
        if spec.mode not in self.modes:
            why = "custom (tree) masks not supported" if spec.mode.is_target_verify() else "not supported"
            return f"mode {spec.mode.value}: {why}"
        if spec.dtype not in self.dtypes:
            return f"dtype {spec.dtype} not supported"
        if self.page_sizes is not None and spec.page_size not in self.page_sizes:
            return f"page_size {spec.page_size} not supported"
        if spec.mrope is not None and not self.mrope:
            return "mrope not supported"
        if spec.spec is not None and spec.spec.topk > 1 and not self.draft_trees:
            return "draft trees (topk > 1) not supported: verify chains only"
        if spec.spec is not None and spec.spec.algorithm not in self.verify_algorithms:
            served = ", ".join(sorted(self.verify_algorithms))
            return f"{spec.spec.algorithm}'s verify not supported (verifies {served})"
        if spec.spec is not None and spec.spec.draft_window_size > 0 and not self.draft_prefix_window:
            return "the draft window (--speculative-draft-window-size) not supported: its draft loop reads the whole " \
                   "prefix"
        if spec.spec is not None and spec.spec.draft_window_size > 0 and spec.page_size > 1 \
                and not self.paged_draft_prefix_window:
            return "the draft window over pages of more than one token not supported: its draft steps read whole " \
                   "pages, which a window's sinks and recent tokens do not fill"
        if spec.mode.is_draft_decode() and spec.page_size > 1 and spec.spec.topk > 1 and not self.paged_draft_trees:
            return "draft trees (topk > 1) over pages of more than one token not supported: draft chains only there"
        if spec.mode.is_draft_decode() and spec.spec.topk > 1 and not self.draft_loop_trees:
            return "draft trees (topk > 1) in the draft loop not supported: its multi-step draft container takes " \
                   "topk 1 only"
        if 0 in spec.extend_lens and not self.empty_extend:
            return "empty extends (a request with no new tokens) not supported"
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            return f"kv_cache_dtype {spec.kv_cache_dtype} not supported"
        if not self.kv_scales and any(l.kind == "mha" and (l.k_scale != 1.0 or l.v_scale != 1.0) for l in spec.layers):
            return "KV scales other than 1 not supported"
        if self.one_shape_per_kind:
            for kind in sorted(spec.attention_kinds):
                shapes = sorted({l.shape for l in spec.layers if l.kind == kind})
                if len(shapes) > 1:
                    return f"{kind} layers of shapes {shapes}: one shape per layer kind (the engine sizes one " \
                           f"pool and one config per model)"
        for layer in spec.layers:
            if layer.kind == "kda" and layer.lower_bound is not None and not self.kda_safe_gate:
                return "KDA's safe gate (lower_bound) not supported: the standard gate only"
            if layer.kind == "lightning" and self.linear_head_dims is not None \
                    and layer.head_dim not in self.linear_head_dims:
                return f"lightning head_dim {layer.head_dim} not supported"
            if layer.kind == "mla" and self.mla_latents is not None \
                    and (layer.kv_lora_rank, layer.qk_rope_head_dim) not in self.mla_latents:
                return f"MLA latent {layer.kv_lora_rank} + rope {layer.qk_rope_head_dim} not supported"
            if layer.kind != "mha":
                continue
            if self.head_dims is not None and layer.head_dim not in self.head_dims:
                return f"head_dim {layer.head_dim} not supported"
            if layer.sliding_window is not None and not self.sliding_window:
                return "sliding window not supported"
            if layer.sliding_window is not None and spec.mode.is_target_verify() and not self.verify_window:
                return "sliding window under a tree mask (target_verify) not supported"
            if layer.sliding_window is not None and spec.mode.is_draft_decode() and not self.draft_window:
                return "sliding window in the draft loop (draft_decode) not supported"
            if layer.logit_cap is not None and not self.logit_cap:
                return "logit cap not supported"
        return None


@dataclass
class PlannedMetadata:
    """A backend's planned metadata in one inspectable form (DESIGN.md section 2).

    Indices are token slots unless ``kv_indices_are_pages``. ``kv_*`` describe the keys read from the
    paged cache (for extend: the prefix; for decode: everything); None where a backend has no such plan.
    """

    qo_indptr: torch.Tensor | None = None  # [B+1]
    kv_indptr: torch.Tensor | None = None  # [B+1]
    kv_indices: torch.Tensor | None = None  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor | None = None  # [B], pages only
    kv_indices_are_pages: bool = False
    kv_includes_new_tokens: bool = False  # decode plans read the new token back from the cache
    custom_mask: torch.Tensor | None = None  # flat bool
    mask_indptr: torch.Tensor | None = None  # [B+1]
    state_slots: torch.Tensor | None = None  # [B], linear attention
    chunk: dict[str, Any] = field(default_factory=dict)  # MLA chunked-prefix plan
    # What a backend plans beside its indices (FlashAttention's cache_seqlens and cu_seqlens_k): each request's key
    # count, and their prefix sum; the keys counted as kv_indices' are (the new tokens' too where
    # kv_includes_new_tokens)
    key_lens: torch.Tensor | None = None  # [B]
    key_indptr: torch.Tensor | None = None  # [B+1]
    # A sliding-window layer's own key lists, where a backend plans them apart from the full layers' (SGLang's Triton
    # window_kv_*, FlashInfer's window wrapper): token slots, per request the last keys of the range kv_indices
    # covers; window_kv_offsets where each request's list starts in that range; window the layers' window
    window_kv_indptr: torch.Tensor | None = None  # [B+1]
    window_kv_indices: torch.Tensor | None = None  # [window_kv_indptr[-1]]
    window_kv_offsets: torch.Tensor | None = None  # [B]
    window: int | None = None
    # A draft step over a paged draft tree whose branches read the prefix's last partial page from their own copy of it
    # (batch.spec.draft_region's tail, which SGLang's prepare_for_draft duplicates) rather than from the prefix
    draft_tails_from_branch: bool = False
    # The fields of the engine's plan this form does not read (the metadata property lists them, never skips silently)
    unread: tuple[str, ...] = ()

    def cut_to_indptrs(self) -> "PlannedMetadata":
        """A graph's plan, whose buffers are sized for the largest capture, cut to what its kernels read: the
        ``kv_indices`` its ``kv_indptr`` ends at, the ``custom_mask`` its ``mask_indptr`` ends at, the window's list
        where its indptr ends."""
        out = self
        if out.kv_indptr is not None and out.kv_indices is not None:
            out = replace(out, kv_indices=out.kv_indices[:int(out.kv_indptr[-1])])
        if out.custom_mask is not None and out.mask_indptr is not None:
            out = replace(out, custom_mask=out.custom_mask[:int(out.mask_indptr[-1])])
        return out.cut_window()

    def cut_window(self) -> "PlannedMetadata":
        """The window lists cut to where their indptr ends (a buffer a kernel reads as far as its indptr says)."""
        if self.window_kv_indptr is None or self.window_kv_indices is None:
            return self
        return replace(self, window_kv_indices=self.window_kv_indices[:int(self.window_kv_indptr[-1])])


class AttentionBackend:
    """Base of every backend and wrapper: SGLang 0.5.23's ``AttentionBackend`` (see the module docstring)."""

    capabilities: ClassVar[Capabilities]
    is_wrapper: ClassVar[bool] = False

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not implement {method}()")

    @classmethod
    def multi_step_draft(cls, model_runner, topk: int, speculative_num_steps: int, draft_window_size: int = 0,
                         draft_sink_size: int = 0):
        """The draft worker's container of one backend of this class per draft step, for DRAFT_DECODE batches (a
        backend that declares that mode), for a server with the given draft window (batch.spec.SpecInput): ours is
        :class:`backends.draft.MultiStepDraft`; an engine's adapter builds the engine's own."""
        from backends.draft import MultiStepDraft

        return MultiStepDraft(cls, model_runner, topk, speculative_num_steps, draft_window_size, draft_sink_size)

    # ---- per batch ----
    def init_forward_metadata(self, forward_batch) -> None:
        """Eager entry point: ``out_graph`` then ``in_graph``, as SGLang's base. Backends may override it."""
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host-side planning outside graph capture: at capture (``in_capture=True``), before each replay and
        in eager mode (``in_capture=False``). Default: nothing."""

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Static-shape device ops, recorded into the graph at capture and re-run by each replay (no host
        syncs, no dynamic shapes). Default: nothing."""

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        """Run one layer. q ``[T, Hq, D]``, k ``[T, Hk, D]``, v ``[T, Hk, Dv]`` -> o ``[T, Hq, Dv]``."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return q.new_empty(0, layer.tp_q_head_num, layer.v_head_dim)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Run one layer over the new tokens of an extend-like batch (EXTEND, MIXED, DRAFT_EXTEND,
        TARGET_VERIFY): each request's queries over its cached prefix and its new keys, causal (with the layer's
        window) or under the draft tree's mask. With ``save_kv_cache`` the new k/v are first written to the pool at
        ``out_cache_loc[T]``. MHA: q ``[T, Hq, D]``, k ``[T, Hk, D]``, v ``[T, Hk, Dv]`` -> o ``[T, Hq, Dv]`` in
        q's dtype, ``T = extend_num_tokens`` (MLA layers: see :mod:`backends.flashinfer_mla`)."""
        raise self._missing("forward_extend")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Run one layer for a DECODE batch: each request's one new token over all its ``seq_lens`` keys, the
        new key included (written to the pool at ``out_cache_loc[B]`` first when ``save_kv_cache``). MHA: q
        ``[B, Hq, D]``, k ``[B, Hk, D]``, v ``[B, Hk, Dv]`` -> o ``[B, Hq, Dv]`` in q's dtype."""
        raise self._missing("forward_decode")

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True):
        """SGLang's MIXED path on NPUs; elsewhere (and in :meth:`forward` here) MIXED runs ``forward_extend``."""
        raise self._missing("forward_mixed")

    # ---- CUDA graphs ----
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate, once before capture, the static buffers that CUDA-graph batches of up to ``max_bs``
        requests (``max_num_tokens`` tokens) are planned into."""
        raise self._missing("init_cuda_graph_state")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The ``seq_lens`` value the graph runner gives the padding rows of a captured batch."""
        raise self._missing("get_cuda_graph_seq_len_fill_value")

    # ---- speculative decoding (overlap plan stream) ----
    @property
    def verify_mask(self):
        """The tree mask the draft stage fills in place, if this backend has one (SGLang: ``VerifyMask``;
        ours: the planned flat custom mask). Default: None."""
        return None

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Redo the metadata that depends on the tree mask and positions after drafting."""
        raise self._missing("update_verify_buffers_to_fill_after_draft")

    # ---- inspection (harness only) ----
    def planned_metadata(self) -> PlannedMetadata:
        """The current batch's plan as one :class:`PlannedMetadata`, which the metadata properties check
        against the batch (harness only; not in SGLang's protocol)."""
        raise self._missing("planned_metadata")
