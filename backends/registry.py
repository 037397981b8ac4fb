"""The one place backends are registered, and the compositions derived from their declarations.

A new backend is one new module plus one line in ``LEAVES``. Backend modules import their GPU packages
lazily (inside methods), so every class here imports on any machine and its ``capabilities`` can be read.
Compositions are written as terms: ``torch_native``, ``hybrid(torch_native,linear_torch)``,
``tbo(hybrid(flashinfer,fla))``, ``graph(triton)``, ``pd(sglang.triton,sglang.torch_native)`` (an engine's
prefill/decode split: the first backend prefills, the second decodes).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from functools import cache

from backends.base import AttentionBackend, Capabilities, Support
from batch.spec import RECURRENT_KINDS, BatchSpec, ForwardMode

LEAVES: dict[str, str] = {
    "torch_native": "backends.torch_native:TorchNativeBackend",
    "linear_torch": "backends.linear_torch:LinearTorchBackend",
    "triton": "backends.triton:TritonBackend",
    "flashinfer": "backends.flashinfer:FlashInferBackend",
    "flashinfer_mla": "backends.flashinfer_mla:FlashInferMLABackend",
    "fla": "backends.fla:FlaBackend",
    # SGLang's own classes, through the adapter (the extra: bash ci/install-sglang.sh)
    "sglang.torch_native": "backends.sglang.adapter:SglangTorchNative",
    "sglang.triton": "backends.sglang.adapter:SglangTriton",
    "sglang.flex_attention": "backends.sglang.adapter:SglangFlexAttention",
    "sglang.gdn": "backends.sglang.adapter:SglangGdn",
    "sglang.lightning": "backends.sglang.adapter:SglangLightning",
    "sglang.short_conv": "backends.sglang.adapter:SglangShortConv",
    "sglang.mamba2": "backends.sglang.adapter:SglangMamba2",
    "sglang.mamba2_granite": "backends.sglang.adapter:SglangMamba2Granite",
    "sglang.kda": "backends.sglang.adapter:SglangKda",
    "sglang.kda_glm5": "backends.sglang.adapter:SglangKdaGlm5",
    "sglang.flashinfer": "backends.sglang.flashinfer:SglangFlashInfer",
    "sglang.flashinfer_mla": "backends.sglang.flashinfer:SglangFlashInferMLA",
    "sglang.triton_mla": "backends.sglang.mla:SglangTritonMla",
    # Built where flash_mla, FlashInfer and a Hopper GPU are; its classes only elsewhere
    "sglang.flashmla": "backends.sglang.flashinfer:SglangFlashMla",
    # SGLang's backends whose planning runs here but not their kernels (backends/sglang/plans.py)
    "sglang.fa3": "backends.sglang.plans:SglangFa3",
    "sglang.fa4": "backends.sglang.plans:SglangFa4",
    # SGLang's backends whose kernels do not run here: their classes only (backends/sglang/classes.py)
    "sglang.trtllm_mha": "backends.sglang.flashinfer:SglangTrtllmMha",
    "sglang.trtllm_mla": "backends.sglang.flashinfer:SglangTrtllmMla",
    "sglang.cutedsl_mla": "backends.sglang.flashinfer:SglangCutedslMla",
    "sglang.cutlass_mla": "backends.sglang.classes:SglangCutlassMla",
    "sglang.dsa": "backends.sglang.classes:SglangDsa",
    "sglang.nsa": "backends.sglang.classes:SglangNsa",
    "sglang.aiter": "backends.sglang.classes:SglangAiter",
    "sglang.wave": "backends.sglang.classes:SglangWave",
    "sglang.qsa": "backends.sglang.classes:SglangQsa",
    "sglang.hpc_ops": "backends.sglang.classes:SglangHpcOps",
    "sglang.intel_amx": "backends.sglang.classes:SglangIntelAmx",
    "sglang.intel_xpu": "backends.sglang.classes:SglangIntelXpu",
    "sglang.minicpm_flashattn": "backends.sglang.classes:SglangMinicpmFlashattn",
    "sglang.minicpm_flashinfer": "backends.sglang.classes:SglangMinicpmFlashinfer",
    "sglang.llada2_cfg_flashinfer": "backends.sglang.classes:SglangLlada2CfgFlashinfer",
}
WRAPPERS = ("hybrid", "tbo", "graph", "pd")
ARITY = {"hybrid": 2, "tbo": 1, "graph": 1, "pd": 2}


class CompositionError(ValueError):
    """An unknown backend name or a malformed composition term."""


@cache
def leaf_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` in :data:`LEAVES`, imported on first use (cached);
    :class:`CompositionError` for an unknown name."""
    if name not in LEAVES:
        raise CompositionError(f"unknown backend {name!r}; known: {', '.join(LEAVES)}")
    module, cls = LEAVES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def leaf_capabilities(name: str) -> Capabilities:
    """The :class:`Capabilities` that leaf ``name`` declares."""
    return leaf_class(name).capabilities


@dataclass(frozen=True)
class Composition:
    """A backend or a wrapper over compositions; immutable and printable as its term."""

    name: str  # a leaf name, or one of WRAPPERS
    children: tuple["Composition", ...] = ()

    def __str__(self) -> str:
        if not self.children:
            return self.name
        return f"{self.name}({','.join(str(c) for c in self.children)})"

    @property
    def is_leaf(self) -> bool:
        """True for a single backend (a term without children)."""
        return not self.children

    def leaves(self) -> list[str]:
        """The leaf backend names of the term, left to right."""
        if self.is_leaf:
            return [self.name]
        return [leaf for c in self.children for leaf in c.leaves()]

    def wrappers(self) -> set[str]:
        """The wrapper names used anywhere in the term."""
        if self.is_leaf:
            return set()
        return {self.name} | set().union(*(c.wrappers() for c in self.children))

    def attention_kinds(self) -> frozenset[str]:
        """The layer kinds (``mha``, ``mla``, ``linear``) some leaf serves."""
        return frozenset().union(*(leaf_capabilities(n).attention_kinds for n in self.leaves()))

    @property
    def engine(self) -> str:
        """Whose classes run: "harness", or the engine whose backends (and wrappers) these are."""
        return leaf_capabilities(self.leaves()[0]).engine

    def captured_modes(self, support: Support) -> frozenset[ForwardMode]:
        """The modes graph() captures over this composition, given its leaves' declarations: each decode-side mode
        every leaf captures, and EXTEND where every leaf runs a breakable prefill graph (not under tbo(): the
        harness drives no engine's TBO through one)."""
        prefill = {ForwardMode.EXTEND} if support.prefill_graph and "tbo" not in self.wrappers() else set()
        return frozenset(support.cuda_graph_modes) | prefill

    def support(self) -> Support:
        """The leaves' declarations combined; under ``graph()`` only the modes it captures (``captured_modes``)."""
        caps = {n: _engine_limited(leaf_capabilities(n)) for n in self.leaves()}
        for split in self.splits():
            # A split's decode backend never sees a verify batch (the prefill one takes it): its tree mask is not needed
            decode = split.children[1].name
            caps[decode] = dataclasses.replace(caps[decode], custom_mask=True)
        support = Support.of(list(caps.values()))
        if self.name == "hybrid" and _class_level_hybrid(self.children[0].name):
            support = dataclasses.replace(
                support, modes=frozenset({ForwardMode.EXTEND}),
                class_only=f"SGLang's hybrid over {self.children[0].name} is read at class level: the adapter builds "
                           f"it over MHA backends only ({self.children[0].name}: {support.plan_only})")
        if "graph" in self.wrappers():
            support = dataclasses.replace(support, modes=support.modes & self.captured_modes(support))
        if not self.is_leaf and not (self.name == "graph" and self.children[0].is_leaf):
            # A draft worker builds its multi-step draft backend from the one backend it is configured with
            # (SGLang: DraftBackendFactory.create_decode_backend), never under a wrapper; its own graph runner
            # captures that container (graph() over a leaf that declares the mode among its cuda_graph_modes)
            support = dataclasses.replace(support, modes=support.modes - {ForwardMode.DRAFT_DECODE})
        if "tbo" in self.wrappers() and self.engine == "sglang":
            # SGLang's TBO splitter cuts the verify input as an EagleVerifyInput (two_batch_overlap.py split_spec_info:
            # dataclasses.replace over its retrieve_* fields), which an NgramVerifyInput (no dataclass) and a
            # DFlashVerifyInput (no such fields) are not
            support = dataclasses.replace(support,
                                          verify_algorithms=support.verify_algorithms & {"eagle", "frozen_kv_mtp"})
        gapped = {mode for _, mode, _ in self.wrapped_gaps()} | {mode for mode, _ in self.engine_mode_gaps()}
        return dataclasses.replace(support, modes=support.modes - gapped) if gapped else support

    def splits(self) -> list["Composition"]:
        """The pd() terms inside this one."""
        if self.is_leaf:
            return []
        return ([self] if self.name == "pd" else []) + [s for c in self.children for s in c.splits()]

    def engine_mode_gaps(self) -> list[tuple[ForwardMode, str]]:
        """(mode, why) for each mode the installed engine lacks a feature for (an engine's composition only)."""
        if self.engine != "sglang":
            return []
        from backends.sglang.features import mode_gaps

        return [(ForwardMode(mode), f"the installed SGLang lacks {why}") for mode, why in mode_gaps(self.wrappers())]

    def wrapped_gaps(self) -> list[tuple[str, ForwardMode, str]]:
        """The (wrapper, mode, why) declarations of this composition's leaves that its wrappers trigger."""
        wrappers = self.wrappers()
        return [(w, m, why) for n in self.leaves() for w, m, why in leaf_capabilities(n).wrapped_gaps
                if w in wrappers]

    def unavailable_reason(self, device: str) -> str | None:
        """``"leaf: why"`` for the first leaf that cannot run on ``device`` here, or None."""
        for n in self.leaves():
            reason = leaf_capabilities(n).unavailable_reason(device)
            if reason:
                return f"{n}: {reason}"
        if self.engine == "sglang" and self.wrappers():
            from backends.sglang.features import wrapper_gaps

            gaps = wrapper_gaps(self.wrappers())
            if gaps:
                return f"the installed SGLang lacks {'; '.join(gaps)}"
        return None

    def unsupported_reason(self, spec: BatchSpec) -> str | None:
        """Why this composition cannot run ``spec``, or None."""
        missing = spec.attention_kinds - self.attention_kinds()
        if missing:
            return f"no backend for {', '.join(sorted(missing))} layers"
        if self.name == "hybrid" and spec.draft_worker and self.children[0].attention_kinds() & RECURRENT_KINDS:
            return "draft workers run full attention only"
        if "graph" in self.wrappers() and spec.mode not in self.support().modes:
            return f"graph() captures {'/'.join(sorted(m.value for m in self.support().modes)) or 'no mode'}, " \
                   f"not {spec.mode.value}"
        return self.support().unsupported_reason(spec)

    def build(self, spec: BatchSpec, model_runner) -> AttentionBackend:
        """Instantiate the backends for batches of ``spec`` over ``model_runner``'s pools (the hybrid layout
        comes from the spec)."""
        if self.is_leaf and spec.mode.is_draft_decode():  # the draft worker's container of one backend per step
            s = spec.spec
            return leaf_class(self.name).multi_step_draft(model_runner, s.topk, s.spec_steps, s.draft_window_size,
                                                          s.draft_sink_size)
        if self.is_leaf:
            return leaf_class(self.name)(model_runner)
        if self.name == "hybrid" and self.engine != "harness":
            from backends.sglang.adapter import SglangHybrid  # SGLang builds its hybrid wrapper itself

            return SglangHybrid(leaf_class(self.children[0].name), leaf_class(self.children[1].name), model_runner,
                                draft_worker=spec.draft_worker)
        if self.name == "hybrid":
            from backends.hybrid import HybridLinearAttnBackend
            full, linear = self.children
            return HybridLinearAttnBackend(full.build(spec, model_runner), linear.build(spec, model_runner),
                                           list(hybrid_full_attn_layers(spec)))
        if self.name == "pd":
            from backends.sglang.adapter import SglangPrefillDecode  # SGLang's HybridAttnBackend
            prefill, decode = self.children
            return SglangPrefillDecode(leaf_class(prefill.name), leaf_class(decode.name), model_runner)
        if self.name == "tbo" and self.engine != "harness":
            from backends.sglang.adapter import SglangTbo  # SGLang's TboAttnBackend and its own splitter
            return SglangTbo(self.children[0].build(spec, model_runner), model_runner)
        if self.name == "tbo":
            from backends.tbo import TboAttnBackend
            (inner,) = self.children
            return TboAttnBackend(inner.build(spec, model_runner),
                                  [inner.build(spec, model_runner), inner.build(spec, model_runner)])
        if self.name == "graph":
            (inner,) = self.children
            return inner.build(spec, model_runner)  # the graph runner drives its out_graph/in_graph planning
        raise CompositionError(f"unknown wrapper {self.name!r}")


def hybrid_full_attn_layers(spec: BatchSpec) -> tuple[int, ...]:
    """The full-attention layer ids a hybrid wrapper is built with (a draft worker: ``[0]``)."""
    return spec.full_attn_layers


def parse(term: str) -> Composition:
    """Parse a composition term such as ``tbo(hybrid(torch_native,linear_torch))``."""
    term = term.replace(" ", "")
    comp, rest = _parse(term, term)
    if rest:
        raise CompositionError(f"unexpected {rest!r} after a complete composition in {term!r}")
    return comp


def _parse(s: str, whole: str) -> tuple[Composition, str]:
    i = 0
    while i < len(s) and (s[i].isalnum() or s[i] in "_."):
        i += 1
    name, rest = s[:i], s[i:]
    if not name:
        raise CompositionError(f"expected a backend name in {whole!r}")
    if not rest.startswith("("):
        leaf_class(name)
        return Composition(name), rest
    if name not in WRAPPERS:
        raise CompositionError(f"unknown wrapper {name!r} in {whole!r}; wrappers: {', '.join(WRAPPERS)}")
    children = []
    rest = rest[1:]
    while True:
        child, rest = _parse(rest, whole)
        children.append(child)
        if rest.startswith(","):
            rest = rest[1:]
            continue
        if rest.startswith(")"):
            rest = rest[1:]
            break
        raise CompositionError(f"unbalanced parentheses in {whole!r}")
    arity = ARITY[name]
    if len(children) != arity:
        raise CompositionError(f"{name}() takes {arity} argument(s), got {len(children)} in {whole!r}")
    engines = {leaf_capabilities(n).engine for c in children for n in c.leaves()}
    if len(engines) > 1:
        raise CompositionError(f"{name}() cannot mix the harness's backends with an engine's in {whole!r}")
    if name == "pd":
        if engines == {"harness"}:
            raise CompositionError(f"pd() is an engine's prefill/decode split; the harness's own backends have none, "
                                   f"in {whole!r}")
        if not all(c.is_leaf and c.attention_kinds() == {"mha"} for c in children) or children[0] == children[1]:
            raise CompositionError(f"pd() takes two different full-attention (MHA) backends of the engine, "
                                   f"prefill first, in {whole!r}")
    elif engines != {"harness"} and not _engine_term_adapted(name, children[0]):
        raise CompositionError(f"{name}() over {', '.join(sorted(engines))} backends: only its own hybrid and tbo() "
                               f"wrappers, pd(), and graph() over a backend, pd() or tbo() of one, are adapted so far, "
                               f"in {whole!r}")
    if name == "hybrid":
        full, linear = children
        if full.attention_kinds() - {"mha", "mla"}:
            raise CompositionError(f"hybrid's first argument must be a full-attention backend in {whole!r}")
        if not _serves_one_linear_kind(linear.attention_kinds()):
            raise CompositionError(f"hybrid's second argument must be a linear-attention backend in {whole!r}")
    return Composition(name, tuple(children)), rest


def _engine_term_adapted(wrapper: str, child: Composition) -> bool:
    """Whether ``wrapper(child)`` over an engine's backends is adapted: its own hybrid() over two of its
    backends, its tbo() over one of them, its hybrid or its pd(), and graph() (the harness's runner driving the
    engine's three-method contract) over one of its backends, its hybrid, its pd(), or tbo() of one backend."""
    if wrapper == "hybrid":
        return True
    if wrapper == "tbo":
        return child.is_leaf or child.name in ("hybrid", "pd")
    return wrapper == "graph" and (child.is_leaf or child.name in ("hybrid", "pd")
                                   or (child.name == "tbo" and child.children[0].is_leaf))


def _engine_limited(caps: Capabilities) -> Capabilities:
    """``caps`` with each of its ``engine_limits`` applied whose feature the installed engine lacks."""
    if caps.engine != "sglang":
        return caps
    from backends.sglang import features

    limited = {field: value for feature, field, value in caps.engine_limits if not features.has(feature)}
    # The verify inputs are the engine's, whichever backend reads them: only the algorithms the installed release has
    algorithms = caps.verify_algorithms & features.verify_algorithms()
    if algorithms != caps.verify_algorithms:
        limited["verify_algorithms"] = algorithms
    return dataclasses.replace(caps, **limited) if limited else caps


def _serves_one_linear_kind(kinds: frozenset[str]) -> bool:
    """What a hybrid's second argument serves: one kind of linear attention."""
    return len(kinds) == 1 and kinds <= RECURRENT_KINDS


def _is_linear_leaf(name: str) -> bool:
    return _serves_one_linear_kind(leaf_capabilities(name).attention_kinds)


def all_compositions() -> list[Composition]:
    """Every composition the declarations allow, whether or not it can run here.

    Full-attention backends alone, linear backends alone, hybrid(full, linear) for pairs sharing a device,
    tbo() over each of those, and graph() over each composition with full attention whose backends all
    plan graph batches (``init_forward_metadata_out_graph``). The harness's wrappers wrap its own leaves; an
    engine's leaves (``sglang.*``) stand alone, under the engine's own TBO wrapper, and under graph() over
    either where they capture graphs.
    """
    ours = [n for n in LEAVES if leaf_capabilities(n).engine == "harness"]
    full = [n for n in ours if leaf_capabilities(n).attention_kinds & {"mha", "mla"}]
    linear = [n for n in ours if _is_linear_leaf(n)]
    base = [Composition(n) for n in full + linear]
    for f in full:
        for lin in linear:
            if leaf_capabilities(f).devices & leaf_capabilities(lin).devices:
                base.append(Composition("hybrid", (Composition(f), Composition(lin))))
    out = base + [Composition("tbo", (c,)) for c in base]
    out += [Composition("graph", (c,)) for c in out
            if c.support().cuda_graph_modes and c.attention_kinds() & {"mha", "mla"}]
    # An engine's classes compose with its own wrappers only. SGLang builds a linear backend only inside its
    # hybrid wrapper, so its linear leaves appear as hybrid's second argument, never alone.
    # A class-level leaf (Capabilities.class_only) stands alone: its wrappers' rows need it built.
    class_only = [n for n in LEAVES if leaf_capabilities(n).class_only]
    theirs_full = [n for n in LEAVES if n not in ours and n not in class_only
                   and leaf_capabilities(n).attention_kinds & {"mha", "mla"}]
    theirs_linear = [n for n in LEAVES if n not in ours and _is_linear_leaf(n)]
    theirs = [Composition(n) for n in theirs_full]
    theirs += [Composition("hybrid", (Composition(f), Composition(lin))) for f in theirs_full for lin in theirs_linear
               if leaf_capabilities(f).engine == leaf_capabilities(lin).engine
               and leaf_capabilities(f).attention_kinds == {"mha"}
               and leaf_capabilities(f).devices & leaf_capabilities(lin).devices]
    theirs += [Composition("tbo", (c,)) for c in theirs]
    # The engine's prefill/decode split over every ordered pair of its MHA backends that share a device (not under
    # tbo(): a server may combine them, but CI's time goes to the split itself first)
    mha = [n for n in theirs_full if leaf_capabilities(n).attention_kinds == {"mha"}]
    theirs += [Composition("pd", (Composition(p), Composition(d))) for p in mha for d in mha
               if p != d and leaf_capabilities(p).engine == leaf_capabilities(d).engine
               and leaf_capabilities(p).devices & leaf_capabilities(d).devices]
    # graph() over what captures a decode-side graph, or runs its extends through a breakable prefill graph (not
    # under tbo(), as Composition.support says)
    theirs += [Composition("graph", (c,)) for c in theirs
               if _engine_term_adapted("graph", c) and c.captured_modes(c.support())]
    # A class-level leaf alone, under SGLang's TBO wrapper, and beside each SGLang linear backend under its hybrid
    # wrapper: never built, their rows read the wrapper's class against the leaf's classes (class_conformance)
    read = [Composition(n) for n in class_only]
    read += [Composition("tbo", (c,)) for c in read[:len(class_only)]]
    read += [Composition("hybrid", (Composition(n), Composition(lin))) for n in class_only for lin in theirs_linear
             if leaf_capabilities(n).engine == leaf_capabilities(lin).engine]
    # So is a plan-level MLA leaf under the hybrid (Kimi Linear's layers on Blackwell: TRT-LLM MLA beside KDA): the
    # adapter builds SGLang's hybrid over MHA leaves only, so these rows are read at class level (Composition.support)
    read += [Composition("hybrid", (Composition(n), Composition(lin))) for n in theirs_full for lin in theirs_linear
             if _class_level_hybrid(n) and leaf_capabilities(n).engine == leaf_capabilities(lin).engine]
    return out + theirs + read


def _class_level_hybrid(full: str) -> bool:
    """Whether SGLang's hybrid over the full-attention leaf ``full`` is read at class level though the leaf is built: a
    plan-level MLA leaf (the adapter builds the hybrid over MHA leaves only)."""
    caps = leaf_capabilities(full)
    return caps.engine == "sglang" and bool(caps.plan_only) and caps.attention_kinds == {"mla"}
