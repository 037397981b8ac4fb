"""SGLang's registered attention backends whose kernels the harness cannot run (their packages are not on its
machines, or their hardware is not: Blackwell's CUTLASS MLA, AMD's and Intel's GPUs) or has not adapted yet, and whose
planning the harness does not build either (FlashAttention's and TRT-LLM's do: plans.py, flashinfer.py), checked at the
level they reach without kernels: their classes. (FlashMLA takes this level where its kernels cannot run:
``class_level``, flashinfer.py.)

A leaf here is never built. Its one row, ``conformance`` (properties/conformance.py, ``class_conformance``), imports
the classes the server's ``--attention-backend NAME`` factory returns (read from SGLang's registry by features.py)
and checks that each takes every call SGLang makes of it: the base class's declared calls, the calls SGLang's
wrappers forward to a child, and the forward entry points a full-attention backend must define. Two of the five
bugs this project started from were of that kind (a TRT-LLM MLA backend's ``init_mha_chunk_metadata`` taking one
argument where the hybrid wrapper passes two): found here on any machine where the class imports.

The row is unavailable where no class of the backend imports (``harness list --why`` says which package is missing)
and where the installed release registers no backend of that name. One class plus one line in the registry's
``LEAVES`` adds a backend; when its kernels are adapted, its leaf moves to adapter.py and gains every property.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

from backends.base import AttentionBackend, Capabilities
from batch.spec import ForwardMode

CLASS_ONLY = "its kernels are not adapted to run here; its classes are read, never built"


def class_level(kind: str, why: str, name: str) -> Capabilities:
    """A class-level leaf's declaration: ``why`` its kernels are not run, ``name`` the --attention-backend it reads."""
    return Capabilities(attention_kinds=frozenset({kind}), modes=frozenset({ForwardMode.EXTEND}), requires=("sglang",),
                        engine="sglang", one_shape_per_kind=True, class_only=why, engine_classes=name)


class ReadsEngineClasses:
    """A leaf that names the classes SGLang's factory for its ``sglang_name`` returns: conformance reads them
    (``properties.conformance``), at class level, or beside the built object where the leaf is built."""

    sglang_name: ClassVar[str]

    @classmethod
    def engine_classes(cls) -> list[type]:
        return registered_classes(cls.sglang_name)


class SglangClassOnly(ReadsEngineClasses, AttentionBackend):
    """A registered SGLang backend read at class level (module docstring)."""

    capabilities: ClassVar[Capabilities]

    def __init__(self, model_runner) -> None:
        raise TypeError(f"sglang.{self.sglang_name} is a class-level leaf: only its classes are checked, it is "
                        f"never built ({self.capabilities.class_only})")


def registered_classes(name: str) -> list[type]:
    """The classes SGLang's ``--attention-backend name`` factory returns that import here."""
    from backends.sglang import features, runtime

    runtime.load()  # the stand-ins a CPU install needs, as every SGLang row has them
    return [getattr(importlib.import_module(module), cls) for module, cls in features.importable_classes(name)]


class SglangCutlassMla(SglangClassOnly):
    sglang_name = "cutlass_mla"  # registered up to the releases that replaced it with cutedsl_mla
    capabilities = class_level("mla", "its CUTLASS MLA kernels (sgl_kernel) run on Blackwell only", sglang_name)


class SglangDsa(SglangClassOnly):
    sglang_name = "dsa"
    capabilities = class_level("mla", "DeepSeek sparse attention needs its indexer's kernels (deep_gemm, "
                                      "sgl_kernel) and a model's sparse layers, not adapted yet", sglang_name)


class SglangNsa(SglangClassOnly):
    sglang_name = "nsa"
    capabilities = class_level("mla", "native sparse attention needs its indexer's kernels and a model's sparse "
                                      "layers, not adapted yet", sglang_name)


# Registered backends for other hardware whose classes import on any machine: read at the same level.
class SglangAiter(SglangClassOnly):
    sglang_name = "aiter"
    capabilities = class_level("mha", "AITER's kernels run on AMD Instinct GPUs (ROCm) only", sglang_name)


class SglangWave(SglangClassOnly):
    sglang_name = "wave"
    capabilities = class_level("mha", "Wave's kernels run on AMD GPUs (ROCm) only", sglang_name)


class SglangQsa(SglangClassOnly):
    sglang_name = "qsa"
    capabilities = class_level("mha", "Qwen sparse attention needs its indexer's kernels and a model's sparse layers, "
                                      "not adapted yet", sglang_name)


class SglangHpcOps(SglangClassOnly):
    sglang_name = "hpc_ops"
    capabilities = class_level("mha", "its kernels come with the hpc_ops package, not on the harness's machines",
                               sglang_name)


class SglangIntelAmx(SglangClassOnly):
    sglang_name = "intel_amx"
    capabilities = class_level("mha", "its kernels are sgl_kernel's CPU ops for Intel AMX (the sglang-kernel CPU "
                                      "build)", sglang_name)


class SglangIntelXpu(SglangClassOnly):
    sglang_name = "intel_xpu"
    capabilities = class_level("mha", "its kernels run on Intel GPUs (XPU) only", sglang_name)


# MiniCPM-SALA's sparse attention: a backend over FlashAttention's (minicpm_flashattn) or FlashInfer's
# (minicpm_flashinfer) that routes a MiniCPM hybrid model's sparse layers to its own kernels
class SglangMinicpmFlashattn(SglangClassOnly):
    sglang_name = "minicpm_flashattn"
    capabilities = class_level("mha", "MiniCPM's sparse layers (a MiniCPM hybrid model's) and its kernels beside "
                                      "FlashAttention's are not adapted yet", sglang_name)


class SglangMinicpmFlashinfer(SglangClassOnly):
    sglang_name = "minicpm_flashinfer"
    capabilities = class_level("mha", "MiniCPM's sparse layers (a MiniCPM hybrid model's) and its kernels beside "
                                      "FlashInfer's are not adapted yet", sglang_name)


class SglangLlada2CfgFlashinfer(SglangClassOnly):
    sglang_name = "llada2_cfg_flashinfer"
    capabilities = class_level("mha", "LLaDA2's classifier-free-guidance attention (a diffusion language model's "
                                      "batches) is not adapted yet", sglang_name)
