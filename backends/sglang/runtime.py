"""Loading SGLang on any machine, and building what its backends are constructed with.

The adapter runs SGLang's own classes; this module is the glue that SGLang's model runner would otherwise be:
a runner object with the attributes its attention backends read, pools that *share storage* with the harness's
pools (so the harness's cache and state checks see exactly what SGLang wrote), and the process-wide settings
SGLang publishes before it builds a backend. The facts behind each attribute come from SGLang's own unit-test
kit (``sglang/test/kits/attention_unittest/``) and are noted where they are not obvious.

Shims are applied only when needed, each only where the real package is absent: an inert ``torchvision``
(SGLang imports it at import time; it cannot be installed beside a CPU torch), ``IPython`` and ``sniffio``
(imported at import time, never called by attention; the GPU image lacks them), and ``sgl_kernel`` (SGLang
imports it unguarded on CUDA, and on any device in the modules of the backends that need it, e.g. FlashAttention's;
see :data:`_SGL_KERNEL_SHIMS`), and ``flash_mla`` (imported unguarded by FlashMLA's module: its class is then read at
class level). Nothing is edited in site-packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace

import torch

from backends.sglang import compat, features
from batch.forward_batch import ModelRunner
from batch.spec import RECURRENT_KINDS

INSTALL_HINT = "bash ci/install-sglang.sh"


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable_reason(needs: tuple[str, ...] = ()) -> str | None:
    """Why SGLang's backends (with the features ``needs`` beyond the core) cannot be built here: not installed, or
    the installed SGLang lacks a feature the adapter builds with (features.py). No version is refused by name."""
    version = installed_version()
    if version is None or importlib.util.find_spec("sglang") is None:
        return f"sglang is not installed (install the extra: {INSTALL_HINT})"
    gaps = features.missing(features.CORE + tuple(needs))
    if gaps:
        return f"sglang {version} lacks {'; '.join(gaps)}"
    return None


def cpu_on_a_cuda_host() -> str | None:
    """Why SGLang's rows cannot run on the CPU of this host, or None: a host with a CUDA GPU.

    SGLang decides by the host, not by the tensors: its custom ops are registered for the accelerator's dispatch
    key alone (CUDA wherever a GPU is visible, utils/common.py), and ``_layer_ops_on_cpu`` adds the CPU key only on
    a machine without CUDA. Seen on the lent H200 (harness-out/gpu64.sh): SGLang's torch_native decode over CPU
    tensors raised the dispatcher's NotImplementedError, which refuse_or_correct took for a refusal (a pass) and
    outputs would report as SGLang's crash."""
    if torch.cuda.is_available():
        return ("SGLang on the CPU of a host with a CUDA GPU calls ops registered for CUDA only: run its CPU rows on "
                "a machine without a GPU, or with CUDA_VISIBLE_DEVICES= set")
    return None


class _Inert:
    """Any attribute of a stubbed module: usable as a value, a base class or a hashable key, never called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is an inert stub (the real package is not installed)")

    def __mro_entries__(self, bases):
        return (object,)

    def __hash__(self) -> int:
        return hash(self._name)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Inert) and other._name == self._name


class _StubPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``root`` and every ``root.*`` submodule as an inert module (transformers reaches into
    ``torchvision.transforms`` once it finds the package, so one module is not enough). ``real`` names
    attributes that must be the real thing rather than inert: ``{module: {attr: callable}}``."""

    harness_stand_in = True  # how features.really_installed tells it from the package

    def __init__(self, root: str, real: dict[str, dict[str, object]] | None = None) -> None:
        self.root = root
        self.real = real or {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__file__ = f"<inert stub {spec.name}>"
        module.__version__ = "0.0.0"

        def __getattr__(attr, _name=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Inert(f"{_name}.{attr}")

        module.__getattr__ = __getattr__
        for attr, value in self.real.get(spec.name, {}).items():
            setattr(module, attr, value)
        return module

    def exec_module(self, module) -> None:
        pass


def _is_arch_support_pdl() -> bool:
    """SGLang's own answer (``sglang.kernels.jit.utils``; ``sglang.jit_kernel.utils`` before 0.5.22) to the question
    its Triton backend asks ``sgl_kernel.utils`` at construction on CUDA (triton_backend.py:340): whether the GPU
    launches with PDL."""
    for module in ("sglang.kernels.jit.utils", "sglang.jit_kernel.utils"):  # 0.5.22 on; 0.5.14 to 0.5.21
        try:
            return importlib.import_module(module).is_arch_support_pdl()
        except ModuleNotFoundError:
            continue
    return torch.cuda.get_device_capability()[0] >= 9  # what sgl_kernel.utils answers: PDL from Hopper on


def _strong_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``sgl_kernel.weak_ref_tensor``'s stand-in: the tensor itself. SGLang's breakable prefill graph holds its
    breaks' inputs weakly only so the graph pool can reuse their memory; a strong reference keeps the same
    storage at the same address, so every replay reads what it would have read."""
    return tensor


# sgl_kernel (SGLang's compiled kernels, a CUDA wheel tied to SGLang's torch) is imported unguarded on CUDA by
# modules the attention backends import, and on any device by the modules of the backends whose kernels it holds
# (flashattention_backend.py:62, FA3/FA4), which the plan-level leaves build (backends/sglang/plans.py). The
# adapted backends call none of its kernels on the paths they run; the functions called are answered by SGLang's
# own equivalent or an equivalent in effect. Every other attribute is inert: calling it raises, naming the stub,
# so a path that does need sgl_kernel fails loudly, never silently. On a CPU nothing SGLang runs there asks for it
# behind a guard (its CPU-engine imports sit behind SGLANG_USE_CPU_ENGINE, which the harness never sets).
_SGL_KERNEL_SHIMS = {"sgl_kernel.utils": {"is_arch_support_pdl": _is_arch_support_pdl},
                     "sgl_kernel": {"weak_ref_tensor": _strong_ref_tensor}}
# Imported at import time by SGLang or its dependencies, never on an attention path. opentelemetry is not
# stubbed: SGLang's one importer (srt/observability/trace.py) catches the ImportError, which a stub would turn
# into a RuntimeError at import.
_INERT_WHEN_ABSENT = ("torchvision", "IPython", "sniffio")
# Read by others once the stand-in is in sys.modules: matplotlib, drawing the report's plots, asks any imported IPython
# for version_info[:2] and then get_ipython() (backend_bases.py, _fix_ipython_backend2gui); inert, the first raised
# TypeError at the end of every GPU run that had loaded SGLang in the parent (seen on the H200, harness run --mutant).
# Answered as an IPython outside a shell answers: an old version and no shell, so matplotlib leaves it alone.
_REAL_WHEN_ABSENT = {"IPython": {"IPython": {"version_info": (0, 0, 0), "get_ipython": lambda: None}}}


def _install_shims() -> list[str]:
    """Install an inert stand-in for each package SGLang imports that is absent here; returns their names."""
    installed = []
    for name in _INERT_WHEN_ABSENT:
        if importlib.util.find_spec(name) is None:
            sys.meta_path.insert(0, _StubPackage(name, _REAL_WHEN_ABSENT.get(name)))
            installed.append(name)
    if importlib.util.find_spec("sgl_kernel") is None:
        sys.meta_path.insert(0, _StubPackage("sgl_kernel", _SGL_KERNEL_SHIMS))
        _define_sgl_kernel_ops()
        installed.append("sgl_kernel")
    # flash_mla (FlashMLA's kernels, the sgl-flash-mla wheel SGLang pins from 0.5.2x; a CUDA build) is imported
    # unguarded by the module of SGLang's FlashMLA backend (kernels/ops/attention/flash_mla_interface.py): where it is
    # absent, an inert stand-in lets that class import, so its class-level row reads it (backends/sglang/flashinfer.py,
    # SglangFlashMla); every one of its kernels raises when called, naming the stand-in.
    if importlib.util.find_spec("flash_mla") is None:
        sys.meta_path.insert(0, _StubPackage("flash_mla"))
        installed.append("flash_mla")
    return installed


# sgl_kernel ops that SGLang registers a fake implementation for at import, unguarded, on CUDA: 0.5.10 to 0.5.14,
# layers/moe/topk.py's ``torch.library.register_fake("sgl_kernel::moe_fused_gate")`` (0.5.10 :1119, 0.5.14 :1888),
# which fails unless the op exists. Defined here with the schema of that fake, and no kernel: a call raises
# ("no kernel registered"), as every other part of the stand-in does; attention never calls it.
_SGL_KERNEL_OPS = {"moe_fused_gate": "(Tensor input_tensor, Tensor bias, int num_expert_group, int topk_group, "
                                     "int topk, int num_fused_shared_experts=0, float routed_scaling_factor=0, "
                                     "bool apply_routed_scaling_factor_on_output=False) -> (Tensor, Tensor)"}
_SGL_KERNEL_LIBRARY: list = []


def _define_sgl_kernel_ops() -> None:
    if _SGL_KERNEL_LIBRARY:
        return
    library = torch.library.Library("sgl_kernel", "DEF")  # kept: the definitions live as long as the library
    for name, schema in _SGL_KERNEL_OPS.items():
        library.define(name + schema)
    _SGL_KERNEL_LIBRARY.append(library)


def _modules_of(package: str) -> list[str]:
    """The names in ``sys.modules`` of ``package`` and its submodules."""
    return [n for n in sys.modules if n == package or n.startswith(package + ".")]


def _forget_orphans(package: str = "sglang") -> None:
    """Forget the modules of ``package`` whose parent is not loaded: what an earlier failed import left behind.

    When a package's ``__init__`` raises, Python forgets the package but keeps the submodules it had imported by
    then; ``sglang.srt`` is a namespace package (no ``__init__.py``), and importing anything under it finds it in
    ``sys.modules`` and asks its parent for a path: ``KeyError: 'sglang'`` (``_NamespacePath._get_parent_path``).
    Seen on the lent H200: a pytest worker's first load failed that way after an earlier test's import of SGLang
    had failed on the absent sgl_kernel (imports in the engine's ``__init__`` on a GPU)."""
    for name in sorted(_modules_of(package), key=lambda n: n.count(".")):  # parents before their children
        parent = name.rpartition(".")[0]
        if parent and parent not in sys.modules:
            sys.modules.pop(name, None)


def _drop_partial_imports() -> None:
    """Forget the SGLang modules a failed import left half-initialised, so the retry imports them afresh."""
    for name in _modules_of("sglang"):
        del sys.modules[name]


def _import_names() -> dict[str, object]:
    """The SGLang names the adapter uses, imported where the installed SGLang has them."""
    # The core every SGLang row is built with (features.CORE; unavailable_reason checked it before)
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner as SglModelRunner
    from sglang.srt.environ import envs
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.layers.attention import attention_registry

    # What differs by release, imported where the installed SGLang has it (compat.py chooses between them)
    get_context = get_exec = get_schedule = None
    if features.has("runtime_context"):
        from sglang.srt.runtime_context import get_context, get_exec, get_schedule
    ForwardContext = forward_context = None
    if features.has("forward_context"):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    Backend = CudaGraphConfig = PhaseConfig = None
    if features.has("cuda_graph_config"):
        from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
    # What only some rows need (None where absent: no row that needs it is built, features.py and the matrix say why)
    EagleDraftExtendInput = None
    if features.has("draft_extend_v2"):
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    # The other speculative algorithms' verify inputs (features.VERIFY_FEATURES)
    NgramVerifyInput = FrozenKVMTPVerifyInput = DFlashVerifyInput = None
    if features.has("ngram_verify"):
        from sglang.srt.speculative.ngram_info import NgramVerifyInput
    if features.has("frozen_kv_mtp_verify"):
        from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPVerifyInput
    if features.has("dflash_verify"):
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    EagleDraftInput = DraftBackendFactory = per_step_draft_out_cache_loc = None
    if features.has("draft_decode"):
        from sglang.srt.speculative.draft_utils import DraftBackendFactory
        from sglang.srt.speculative.eagle_info import EagleDraftInput
    if features.has("draft_step_slices"):
        from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
    two_batch_overlap = TboAttnBackend = None
    if features.has("tbo"):
        from sglang.srt.batch_overlap import two_batch_overlap
        from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    HybridAttnBackend = None
    if features.has("prefill_decode"):
        from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    handle_attention_flashinfer = AttnForwardMethod = None
    if features.has("deepseek_mla"):
        from sglang.srt.models.deepseek_common.attention_backend_handler import handle_attention_flashinfer
        from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
    HybridLinearAttnBackend = RadixLinearAttention = HybridReqToTokenPool = HybridLinearKVPool = None
    Mamba2CacheParams = Mamba2StateDType = Qwen3NextConfig = BailingHybridConfig = None
    if features.has("hybrid_linear"):
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    if features.has("gdn_model"):
        from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    if features.has("lightning_model"):
        from sglang.srt.configs.bailing_hybrid import BailingHybridConfig
    NemotronHConfig = NemotronHMambaDecoderLayer = MambaMixer2 = None
    if features.has("mamba2_model"):
        from sglang.srt.configs.nemotron_h import NemotronHConfig
        from sglang.srt.layers.attention.mamba.mamba import MambaMixer2
        from sglang.srt.models.nemotron_h import NemotronHMambaDecoderLayer
    KimiLinearConfig = KimiDeltaAttention = Glm5NextLinearAttention = None
    if features.has("kda_model"):
        from sglang.srt.configs.kimi_linear import KimiLinearConfig
        from sglang.srt.models.kimi_linear import KimiDeltaAttention
    if features.has("glm5_kda_model"):
        from sglang.srt.models.glm5_next import Glm5NextLinearAttention
    Lfm2Config = Lfm2ShortConv = register_shortconv_verify_buffers = None
    if features.has("short_conv_model"):
        from sglang.srt.configs.lfm2 import Lfm2Config
        from sglang.srt.models import lfm2
        Lfm2ShortConv = lfm2.Lfm2ShortConv
        # Its verify path's index buffer (0.5.22 on; before, LFM2 verified through its prefill path)
        register_shortconv_verify_buffers = getattr(lfm2, "register_shortconv_verify_buffers", None)
    # The breakable prefill graph: its capture, its flag, the live batch its graph breaks read, the piecewise
    # forward context (the layers by id), and the prefill-graph scope's flags (0.5.23 on)
    BreakableCUDAGraph = BreakableCUDAGraphCapture = enable_breakable_cuda_graph = breakable_capture_var = None
    set_forward_batch = set_tc_piecewise_forward_context = prefill_graph_scope = None
    is_in_breakable_cuda_graph = get_tc_piecewise_forward_context = get_forward_batch = None
    if features.has("prefill_graph"):
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
            BreakableCUDAGraph, BreakableCUDAGraphCapture)
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
            _current_capture_var as breakable_capture_var)  # the capture in progress, which eager_on_graph reads
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
            enable_breakable_cuda_graph, is_in_breakable_cuda_graph)
        from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
            get_tc_piecewise_forward_context, set_tc_piecewise_forward_context)
        from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch, set_forward_batch
    is_in_prefill_graph_scope = None
    if features.has("prefill_graph_flags"):
        from sglang.srt.model_executor.runner_utils.prefill_graph import is_in_prefill_graph_scope, prefill_graph_scope

    return {k: v for k, v in locals().items()}


@cache
def load() -> SimpleNamespace:
    """Import SGLang once per process (10-25 s) and enter its single-rank parallel settings for good.

    Returns the SGLang names the adapter uses. A failure to import is the adapter's (an adapter error, never an
    SGLang finding): the harness failed to load the engine it was pointed at.
    """
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    shims = _install_shims()
    import warnings

    warnings.filterwarnings("ignore", module="sglang")
    _forget_orphans()
    try:
        try:
            cpu_ops = _layer_ops_on_cpu()
            names = _import_names()
        except ModuleNotFoundError as e:
            # Up to 0.5.13 SGLang imports sgl_kernel on a CPU too (mem_cache/memory_pool_host.py imports its
            # kvcacheio unless the device is NPU, XPU or MPS), never on an attention path: the inert stand-in serves
            if not (e.name or "").startswith("sgl_kernel") or importlib.util.find_spec("sgl_kernel") is not None:
                raise
            _drop_partial_imports()
            sys.meta_path.insert(0, _StubPackage("sgl_kernel", _SGL_KERNEL_SHIMS))
            shims.append("sgl_kernel")
            cpu_ops = _layer_ops_on_cpu()
            names = _import_names()
        shims += cpu_ops + _host_pinning_on_cpu()
        compat.enter_single_rank()
    except Exception as e:  # noqa: BLE001 - raised again as what it is: the harness could not load the engine
        _drop_partial_imports()
        raise RuntimeError(f"loading sglang {installed_version()} failed: {type(e).__name__}: {e}"
                           f"{_where(e)}") from e
    from backends.interpreter import triton_interprets

    if triton_interprets():  # SGLang's kernels were defined interpreted (not: the environment says so now)
        from backends.sglang import interpreter_shims

        interpreter_shims.apply()
    return SimpleNamespace(shims=shims, **names)


def _where(e: BaseException) -> str:
    """Where a failed load raised, innermost frame first and the last of SGLang's own after it (an import error's
    message alone names no file: a KeyError: 'sglang' on the lent H200 said nothing of where)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    engine = [f for f in reversed(frames[:-1]) if "/sglang/" in f.filename and "/backends/sglang/" not in f.filename]
    shown = [frames[-1]] + engine[:1]
    return " (raised at " + ", from ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} in {f.name}"
                                           for f in shown) + ")"


def _host_pinning_on_cpu() -> list[str]:
    """On a machine without CUDA, ``Tensor.pin_memory`` answers a copy of the tensor, unpinned.

    Torch raises there ("Cannot access accelerator device when none is available"). SGLang's KDA prefill graph pins
    the host tables it copies to the device before each replay (linear/kda_prefill_graph.py,
    ``KDAPrefillGraphMetadata.fill``, 0.5.23). Pinning only lets a host-to-device copy run asynchronously; on a CPU
    the copy is host to host, and the values copied are the same. Returns ``["host pinning on cpu"]`` where it
    applies."""
    if torch.cuda.is_available():
        return []
    if not getattr(torch.Tensor.pin_memory, "harness_host", False):
        def pin_memory(self, device=None):
            return self.clone()  # a copy, as pinning an unpinned tensor makes one

        pin_memory.harness_host = True
        torch.Tensor.pin_memory = pin_memory
    return ["host pinning on cpu"]


def _layer_ops_on_cpu() -> list[str]:
    """On a machine without CUDA, SGLang's attention-layer custom ops also dispatch on the CPU, to their own Python
    bodies. Call before SGLang's layer modules are imported.

    SGLang registers each custom op (``utils/custom_op.py`` -> ``utils/common.py:direct_register_custom_op``) for
    the accelerator's dispatch key only: "CUDA" on any machine that is not NPU, XPU or MUSA, so on a CPU a call
    through the dispatcher fails ("Could not run 'sglang::unified_attention_with_output' with arguments from the
    'CPU' backend"). The ops of its attention layers (``layers/radix_attention.py`` and
    ``radix_linear_attention.py``: the graph-split ops 0.5.22's layers call under a prefill graph; Nemotron-H's
    mamba split op, ``models/nemotron_h.py``) are Python
    functions that hand their tensors to the attention backend; each is registered for the CPU key too, with the
    same function, so a CPU runs exactly what a GPU runs. Ops of other modules are left as SGLang registers them.
    Returns ``["layer custom ops on cpu"]`` where the registration function exists (0.5.14 on), else []."""
    if torch.cuda.is_available():
        return []
    try:
        from sglang.srt.utils import common
    except ImportError:
        return []
    register = getattr(common, "direct_register_custom_op", None)
    if register is None:
        return []
    if getattr(register, "also_on_cpu", False):  # installed already (a second load after a failed import)
        return ["layer custom ops on cpu"]
    # (and Nemotron-H's mamba split op, the model-level one a hybrid's mamba layer breaks a prefill graph with)
    modules = ("sglang.srt.layers.radix_attention", "sglang.srt.layers.radix_linear_attention",
               "sglang.srt.models.nemotron_h")

    def direct_register_custom_op(op_name, op_func, mutates_args, fake_impl=None, target_lib=None):
        register(op_name, op_func, mutates_args, fake_impl=fake_impl, target_lib=target_lib)
        if getattr(op_func, "__module__", None) in modules:
            library = target_lib or common.sglang_lib
            try:
                library.impl(op_name, op_func, "CPU")
            except RuntimeError as e:  # registered already (a second engine in this process): as SGLang does
                if "multiple times" not in str(e):
                    raise

    direct_register_custom_op.also_on_cpu = True
    common.direct_register_custom_op = direct_register_custom_op
    return ["layer custom ops on cpu"]


@cache
def _probe_scan() -> tuple[tuple[str, ...], frozenset[str]]:
    """One pass over the installed SGLang's source for ``probed_members`` and ``probed_on_full_backend``."""
    import ast
    import re

    root = features.package_root()  # read without importing SGLang (an import costs 10-25 s)
    probe = re.compile(r"hasattr\(\s*[\w.()]*attn_backend[\w.()]*\s*,\s*\"(\w+)\"")
    names, fallback = set(), set()
    for path in (root.joinpath("srt").rglob("*.py") if root is not None else ()):
        text = path.read_text(encoding="utf-8", errors="replace")
        found = probe.findall(text)
        names.update(found)
        if not found or "full_attn_backend" not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            held, full = set(), set()
            for call in ast.walk(fn):
                if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("hasattr", "getattr")
                        and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant)):
                    continue
                target = ast.unparse(call.args[0])
                if "full_attn_backend" in target:
                    full.add(call.args[1].value)
                elif "attn_backend" in target and call.func.id == "hasattr":
                    held.add(call.args[1].value)
            fallback |= held & full
    return tuple(sorted(names)), frozenset(fallback)


def probed_members() -> tuple[str, ...]:
    """Members SGLang's callers look for on an attention backend with ``hasattr`` (``init_mha_chunk_metadata``,
    ``update_mamba_state_after_mtp_verify``, ...): protocol the base class does not define, read from the
    installed SGLang's source so it follows the version a user has."""
    return _probe_scan()[0]


def probed_on_full_backend() -> frozenset[str]:
    """The probed members whose callers, finding none on the backend they hold, look again on its
    ``full_attn_backend`` in the same function (0.5.23's ``qsa/glue.py``, ``resolve_qsa_sparse_backend``: "a hybrid
    wrapper keeps them on its full-attention side"): a hybrid wrapper does not owe them. A wrapper that itself
    passes a member on to its full backend (``HybridLinearAttnBackend.init_mha_chunk_metadata``) probes nothing on
    the backend it holds, so its members stay owed."""
    return _probe_scan()[1]


class _ModelConfig:
    """The ``model_config`` surface SGLang's dense backends read at construction (head counts, lengths)."""

    def __init__(self, sgl, num_q_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 context_len: int, sliding_window: int | None) -> None:
        self.attention_arch = sgl.AttentionArch.MHA
        self.context_len = context_len
        self.num_attention_heads, self.num_key_value_heads = num_q_heads, num_kv_heads
        self.head_dim, self.v_head_dim, self.swa_v_head_dim = head_dim, v_head_dim, v_head_dim
        self.hidden_size = num_q_heads * head_dim
        self.is_encoder_decoder = self.is_multimodal = self.model_is_mrope = False
        self.is_generation = True
        self.quantization = None
        self.is_hybrid_swa = sliding_window is not None
        # Chunked local attention (Llama 4's, with its attention_chunk_size), not a sliding window: SGLang sets it
        # from the architecture alone (configs/model_config.py:2549, is_local_attention_model), and FlashAttention
        # then asserts a chunk size (flashattention_backend.py:386-396). SGLang's own kit sets it for any window
        # (test/kits/attention_unittest/attention_methods/dense_attention.py:279), which no served model does.
        self.is_local_attention_model = False
        self.attention_chunk_size = None
        self.sliding_window_size = sliding_window
        hf = SimpleNamespace(architectures=["HarnessForCausalLM"], hidden_size=self.hidden_size,
                             num_attention_heads=num_q_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim)
        hf.get_text_config = lambda: hf
        self.hf_config = self.hf_text_config = hf
        self.linear_attn_registry_result = None

    def get_num_attention_heads(self, tp: int) -> int:
        return self.num_attention_heads // tp

    def get_max_num_attention_heads(self) -> int:
        return self.num_attention_heads

    def get_num_kv_heads(self, tp: int, dcp: int = 1) -> int:
        return self.num_key_value_heads // (tp // dcp)


class _MLAModelConfig(_ModelConfig):
    """What SGLang's ``ModelConfig`` holds for a DeepSeek-style MLA model (model_config.py, the
    ``AttentionArch.MLA`` branch): the latent widths, the MHA-path ``v_head_dim`` and the softmax ``scaling``
    (``1/sqrt(qk_nope + qk_rope)`` without rope scaling), one latent "KV head"."""

    def __init__(self, sgl, layer, context_len: int) -> None:
        super().__init__(sgl, layer.num_heads, 1, 256, layer.v_head_dim, context_len, None)
        self.attention_arch = sgl.AttentionArch.MLA
        self.kv_lora_rank, self.qk_nope_head_dim = layer.kv_lora_rank, layer.qk_nope_head_dim
        self.qk_rope_head_dim = layer.qk_rope_head_dim
        self.swa_kv_lora_rank, self.swa_qk_rope_head_dim = layer.kv_lora_rank, layer.qk_rope_head_dim
        self.index_head_dim = None
        self.scaling = layer.sm_scale
        hf = self.hf_config
        hf.architectures = ["HarnessMLAForCausalLM"]
        hf.kv_lora_rank, hf.qk_nope_head_dim = layer.kv_lora_rank, layer.qk_nope_head_dim
        hf.qk_rope_head_dim, hf.v_head_dim = layer.qk_rope_head_dim, layer.v_head_dim


def model_window(runner: ModelRunner) -> int | None:
    """SGLang has one sliding window per model (``runner.sliding_window_size``); a window of 0 means none."""
    windows = {layer.sliding_window for layer in runner.layers if layer.kind == "mha" and layer.sliding_window}
    if len(windows) > 1:
        raise ValueError(f"SGLang models have one sliding window, this model has {sorted(windows)}")
    return windows.pop() if windows else None


# A linear layer shape for hybrid models whose batch runs no linear layer (a draft worker's, or a batch of full
# layers only): SGLang still builds the linear child and its state pool from the model's config.
_IDLE_LINEAR_SHAPES = {
    "linear": (2, 4, 16, 16, 4),  # GDN: key heads, value heads, key dim, value dim, conv kernel
    "lightning": (2, 128),  # heads, head dim (seg_la's decode splits the key dim in blocks of 128)
    "short_conv": (16, 3, False),  # hidden size, kernel width, bias
    "mamba2": (2, 16, 1, 16, 4, 16, True),  # heads, head dim, groups, state size, conv kernel, chunk size, conv bias
    "kda": (2, 16, 16, 4, None, False),  # heads, key dim, value dim, conv kernel, the safe gate's bound, sharp decays
}


# The KV pool shape a model without MHA layers still hands the full-attention child: it runs no layer, but it may
# still plan (FlashInfer plans its prefill wrappers, compiling them for the model's head dim), so the head dim is
# one every backend builds kernels for, as a real model's is: with 16, FlashInfer 0.6.7 (SGLang 0.5.10) compiled an
# SM90 prefill for head dim 16 and refused it (static_assert HEAD_DIM_VO in 64/128/256; seen on an H200).
_IDLE_MHA_SHAPE = (1, 1, 128, 128)


@dataclass(frozen=True)
class HybridModel:
    """What SGLang's hybrid wrapper is built from: the model's layer types by id, its kind of linear attention
    and that layer's shape, and whether this runner is an MTP draft worker."""

    layer_types: tuple[str, ...]  # "attention" / "linear_attention", as the configs' layers_block_type
    linear_kind: str  # "linear": GDN (a Qwen3-Next-shaped model); "lightning": Bailing/Ling's lightning layers;
    # "short_conv": LFM2's conv layers
    shape: tuple[int, ...]  # see _IDLE_LINEAR_SHAPES
    draft_worker: bool

    @classmethod
    def of(cls, runner: ModelRunner, draft_worker: bool, linear_kind: str) -> "HybridModel":
        linear = [l for l in runner.layers if l.kind == linear_kind]
        shape = _one_shape(linear) if linear else _IDLE_LINEAR_SHAPES[linear_kind]
        if draft_worker:
            # An MTP draft runs one full layer, id 0, but its runner carries the target model's config
            # (Qwen3-Next: every fourth layer is full, ids 3, 7, ...); SGLang builds the draft's hybrid wrapper
            # with full_attn_layers=[0] (attention_registry.py, attn_backend_wrapper).
            return cls(("linear_attention",) * 3 + ("attention",), linear_kind, shape, True)
        ids = {l.layer_id for l in linear}
        n = max((l.layer_id for l in runner.layers), default=0) + 1
        types = ["linear_attention" if i in ids else "attention" for i in range(n)]
        if not ids:  # a hybrid model has linear layers even when this batch's layers are all full
            types.append("linear_attention")
        return cls(tuple(types), linear_kind, shape, False)


@cache
def _hybrid_config_class(linear_kind: str):
    """The model config SGLang builds a hybrid of ``linear_kind`` for: Qwen3-Next's for GDN, Bailing's for
    lightning; either with the harness's layer layout instead of the model's every-Nth-layer rule."""
    sgl = load()
    base = sgl.BailingHybridConfig if linear_kind == "lightning" else sgl.Qwen3NextConfig

    class HarnessHybridConfig(base):
        def __init__(self, **kwargs) -> None:  # transformers gives a subclass without one a generated __init__
            super().__init__(**kwargs)

        @property
        def layers_block_type(self):
            return list(self.harness_layer_types)

    HarnessHybridConfig.__name__ = f"Harness{base.__name__}"
    return HarnessHybridConfig


def _hybrid_config(hybrid: HybridModel, hq: int, hk: int, d: int):
    """The hybrid model's config. A GDN model's full layers have ``hq``/``hk`` heads of ``d``, its GDN layers the
    drawn shape. Bailing's config has one head count and head dim, which its lightning layers take (its MHA
    layers' shapes reach SGLang's full backend through the runner's model config, not this one)."""
    n = len(hybrid.layer_types)
    if hybrid.linear_kind == "mamba2":
        # SGLang's own Nemotron-H config, its layers by pattern ("M" mamba, "*" attention); its mamba2_cache_params
        # size the conv state [conv_dim, kernel - 1] and the SSM state [heads, head dim, state size]
        heads, head_dim, groups, state, kernel, chunk, bias = hybrid.shape
        cfg = load().NemotronHConfig(
            hybrid_override_pattern="".join("M" if t == "linear_attention" else "*" for t in hybrid.layer_types),
            hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
            mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_n_groups=groups, ssm_state_size=state,
            mamba_d_conv=kernel, mamba_chunk_size=chunk, mamba_conv_bias=bias, n_routed_experts=0,
            n_groups=groups)  # as a checkpoint's config.json names it too: mamba2_cache_params reads n_groups
        cfg.architectures = ["NemotronHForCausalLM"]
        return cfg
    if hybrid.linear_kind == "kda":
        # SGLang's own Kimi Linear config: its linear_attn_config names the KDA layers (1-based) and sizes the state
        # pool, a conv state of [kernel - 1, conv_dim] and an SSM state of [heads, head dim, head dim]
        # (configs/mamba_utils.py, KimiLinearStateShape: one head dim, so the value dim is the key dim)
        heads, k, v, kernel, bound, _ = hybrid.shape
        if v != k:
            raise ValueError(f"a Kimi Linear model's KDA layers have one head dim, not key {k} and value {v}")
        ids = [i + 1 for i, t in enumerate(hybrid.layer_types) if t == "linear_attention"]
        cfg = load().KimiLinearConfig(
            num_hidden_layers=n, hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
            linear_attn_config=dict(kda_layers=ids, full_attn_layers=[i + 1 for i in range(n) if i + 1 not in ids],
                                    num_heads=heads, head_dim=k, short_conv_kernel_size=kernel,
                                    **({} if bound is None else {"gate_lower_bound": bound})))
        cfg.architectures = ["KimiLinearForCausalLM"]
        return cfg
    if hybrid.linear_kind == "short_conv":
        # SGLang's own LFM2 config: its layer_types name the conv layers, full_attention_layer_ids the others, and
        # its mamba2_cache_params size a conv state of [hidden, kernel - 1] and no SSM state (configs/lfm2.py).
        hidden, kernel, bias = hybrid.shape
        cfg = load().Lfm2Config(
            num_hidden_layers=n, hidden_size=hidden, num_attention_heads=hq, num_key_value_heads=hk,
            conv_L_cache=kernel, conv_bias=bias,
            layer_types=["conv" if t == "linear_attention" else "full_attention" for t in hybrid.layer_types])
        cfg.architectures = ["Lfm2ForCausalLM"]
        return cfg
    if hybrid.linear_kind == "lightning":
        heads, head_dim = hybrid.shape
        cfg = _hybrid_config_class("lightning")(num_hidden_layers=n, hidden_size=heads * head_dim,
                                                num_attention_heads=heads, num_key_value_heads=heads,
                                                head_dim=head_dim)
        architecture = "BailingMoeV2_5ForCausalLM"  # Ling 2.5/2.6 (models/bailing_moe_linear.py EntryClass)
    else:
        hk_lin, hv, k, v, w = hybrid.shape
        cfg = _hybrid_config_class("linear")(
            num_hidden_layers=n, hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
            linear_num_key_heads=hk_lin, linear_num_value_heads=hv, linear_key_head_dim=k,
            linear_value_head_dim=v, linear_conv_kernel_dim=w)
        architecture = "Qwen3NextForCausalLM"
    cfg.harness_layer_types = hybrid.layer_types
    cfg.architectures = [architecture]  # what a checkpoint's config names (FlashInfer reads it at build)
    return cfg


def _one_shape(layers) -> tuple[int, ...]:
    """The one shape (``Layer.SHAPE``) the layers share: SGLang sizes one KV pool and one linear config per model
    (declared, ``Capabilities.one_shape_per_kind``: a batch of mixed shapes is refused before it gets here)."""
    shapes = {l.shape for l in layers}
    if len(shapes) > 1:
        raise ValueError(f"one shape per layer kind, got {sorted(shapes)}")
    return shapes.pop()


def _mha_pool(sgl, runner: ModelRunner, layers, dtype, device: str):  # dtype: the KV cache's (fp8 or the model's)
    """SGLang's ``MHATokenToKVPool`` over the harness's buffers (shared storage); the model config. A hybrid
    model whose batch has no MHA layer gets a placeholder pool its full child is built over and never reads."""
    hq, hk, d, dv = _one_shape(layers) if layers else _IDLE_MHA_SHAPE
    page_size, pool = runner.page_size, runner.token_to_kv_pool
    slots = next(iter(pool.k_buffers.values())).shape[0] if pool.k_buffers else 2 * page_size
    layer_num = max((l.layer_id for l in layers), default=0) + 1
    kv = sgl.MHATokenToKVPool(size=page_size, page_size=page_size, dtype=dtype, head_num=hk, head_dim=d,
                              v_head_dim=dv, layer_num=layer_num, device=device, enable_memory_saver=False,
                              enable_alt_stream=False)
    # Share storage: SGLang indexes its buffers by layer id; ids without an MHA layer get a small placeholder.
    # An fp8 pool stores its buffers as uint8 (store_dtype) and views them as float8 on read: ours, viewed so.
    kv.size = slots - page_size
    kv.k_buffer = [pool.k_buffers[i].view(kv.store_dtype) if i in pool.k_buffers
                   else torch.zeros(slots, hk, d, dtype=kv.store_dtype, device=device) for i in range(layer_num)]
    kv.v_buffer = [pool.v_buffers[i].view(kv.store_dtype) if i in pool.v_buffers
                   else torch.zeros(slots, hk, dv, dtype=kv.store_dtype, device=device) for i in range(layer_num)]
    compat.refresh_kv_pointers(kv)
    return kv, _ModelConfig(sgl, hq, hk, d, dv, runner.context_len, model_window(runner))


def _hybrid_kv_pool(sgl, runner: ModelRunner, layers, dtype, device: str, mamba_pool, placeholder):
    """What SGLang's runner builds for a hybrid linear-attention model: a ``HybridLinearKVPool`` whose full pool
    holds the full-attention layers' buffers in layer order and maps layer ids onto them
    (model_runner_kv_cache_mixin.py in 0.5.14, hybrid_pool_assembler.py later). Its full pool: the harness's
    buffers (shared storage); for a batch of linear layers only, the ``placeholder`` pool over one layer, as a
    draft worker's (``full_attention_layer_ids=[0]``)."""
    if layers:
        full_ids = sorted(layer.layer_id for layer in layers)
        hq, hk, d, dv = _one_shape(layers)
        page_size, pool = runner.page_size, runner.token_to_kv_pool
        slots = next(iter(pool.k_buffers.values())).shape[0]
        full = sgl.MHATokenToKVPool(size=page_size, page_size=page_size, dtype=dtype, head_num=hk, head_dim=d,
                                    v_head_dim=dv, layer_num=len(full_ids), device=device,
                                    enable_memory_saver=False, enable_alt_stream=False)
        full.size = slots - page_size
        full.k_buffer = [pool.k_buffers[i].view(full.store_dtype) for i in full_ids]
        full.v_buffer = [pool.v_buffers[i].view(full.store_dtype) for i in full_ids]
        compat.refresh_kv_pointers(full)
    else:
        full_ids, full = [0], placeholder
        hk, d, page_size = placeholder.head_num, placeholder.head_dim, placeholder.page_size
    hybrid = sgl.HybridLinearKVPool(**compat.accepted(sgl.HybridLinearKVPool, dict(
        size=page_size, dtype=dtype, page_size=page_size, head_num=hk, head_dim=d, full_attention_layer_ids=full_ids,
        enable_kvcache_transpose=False, device=device, mamba_pool=mamba_pool, enable_memory_saver=False,
        use_mla=False, full_kv_pool=full)))
    hybrid.full_kv_pool = full  # a release without full_kv_pool= built its own: ours replaces it
    hybrid.size = full.size
    return hybrid


def _mla_pool(sgl, runner: ModelRunner, layers, dtype, device: str):
    """SGLang's ``MLATokenToKVPool`` over the harness's latent buffers (``[slots, 1, kv_lora_rank + rope]``,
    the same layout; shared storage); the model config."""
    _one_shape(layers)
    page_size, pool = runner.page_size, runner.token_to_kv_pool
    slots = next(iter(pool.k_buffers.values())).shape[0]
    layer_num = max(l.layer_id for l in layers) + 1
    C, R = layers[0].kv_lora_rank, layers[0].qk_rope_head_dim
    kv = sgl.MLATokenToKVPool(size=page_size, page_size=page_size, dtype=dtype, kv_lora_rank=C,
                              qk_rope_head_dim=R, layer_num=layer_num, device=device, enable_memory_saver=False)
    kv.size = slots - page_size
    kv.kv_buffer = [pool.k_buffers.get(i, torch.zeros(slots, 1, C + R, dtype=dtype, device=device))
                    for i in range(layer_num)]
    kv.data_ptrs = torch.tensor([x.data_ptr() for x in kv.kv_buffer], dtype=torch.uint64, device=device)
    return kv, _MLAModelConfig(sgl, layers[0], runner.context_len)


# --speculative-algorithm for each of batch.spec.VERIFY_ALGORITHMS (SGLang's SpeculativeAlgorithm members)
SERVER_ALGORITHMS = {"eagle": "EAGLE", "frozen_kv_mtp": "FROZEN_KV_MTP", "ngram": "NGRAM", "dflash": "DFLASH"}


def make_runner(runner: ModelRunner, backend_name: str, max_draft_tokens: int = 0, topk: int = 0,
                hybrid: HybridModel | None = None, decode_backend_name: str | None = None,
                num_steps: int | None = None, draft_window: tuple[int, int] = (0, 0), algorithm: str = "eagle",
                prefill_graph: bool = False):
    """An SGLang model runner over the harness runner's pools (KV storage shared, not copied; linear-attention
    states are copied, see :class:`StateSync`).

    SGLang's ``ModelRunner.__init__`` loads a model; like the engine's own unit-test kit, this skips it and
    sets only what attention backends read. A model of MLA layers gets SGLang's MLA pool and model config
    and ``use_mla_backend`` (which is how SGLang's registry picks, e.g., FlashInfer's MLA backend for
    "flashinfer"); a model of MHA layers the MHA ones. ``hybrid``: the model is a linear-attention hybrid (a
    Qwen3-Next-shaped config for GDN, a Bailing one for lightning; hybrid request pool with state pools, MHA full
    layers), so ``attn_backend_wrapper`` builds SGLang's hybrid wrapper. ``decode_backend_name``: the server runs
    ``backend_name`` for prefill and this one for decode (``--prefill-attention-backend`` /
    ``--decode-attention-backend``; speculative verify on the prefill backend, SGLang's default
    ``--speculative-attention-mode prefill``). ``num_steps``: the server's ``--speculative-num-steps`` (default: one
    less than the draft tokens, a chain's). ``draft_window``: its ``--speculative-draft-window-size`` and
    ``--speculative-draft-sink-size`` (0: unset). ``algorithm``: its ``--speculative-algorithm`` where it drafts
    (batch.spec.VERIFY_ALGORITHMS). ``prefill_graph``: its extends run through the breakable prefill graph
    (``cuda_graph_config.prefill.backend`` breakable, a CUDA server's default from 0.5.22): published so, a backend
    whose extend can be captured says so at construction (the hybrid's
    ``use_captured_forward_metadata_for_breakable_cuda_graph`` over KDA); eager rows publish every phase disabled.
    """
    sgl = load()
    kinds = {layer.kind for layer in runner.layers} - RECURRENT_KINDS
    if hybrid is None and kinds not in ({"mha"}, {"mla"}):
        raise ValueError(f"the SGLang adapter runs a model of MHA or of MLA layers, not {sorted(kinds) or 'neither'}")
    if hybrid is not None and kinds - {"mha"}:
        raise ValueError("SGLang's linear-attention hybrids are adapted over MHA full-attention layers only")
    use_mla = kinds == {"mla"}
    layers = [layer for layer in runner.layers if layer.kind in kinds]
    page_size = runner.page_size
    pool = runner.token_to_kv_pool
    if pool.k_buffers:
        kv_dtype = next(iter(pool.k_buffers.values())).dtype  # float8_e4m3fn: SGLang's --kv-cache-dtype fp8_e4m3
    else:  # linear layers only: a placeholder KV pool the full child is built over and never reads
        kv_dtype = next(iter(runner.mamba_pool.conv_states.values())).dtype
    dtype = pool.model_dtype or kv_dtype
    kv_cache_dtype_str = "fp8_e4m3" if kv_dtype == torch.float8_e4m3fn else "auto"
    device = str(runner.device)
    window = None if use_mla else model_window(runner)

    class Runner(sgl.SglModelRunner):
        # (SGLang's backends and registry read the hybrid configs as functions of model_config,
        # configs/hybrid_arch.py, never as runner attributes: a hybrid is recognised from its hf_config alone.)
        def __init__(self) -> None:  # noqa: D107 - no super().__init__: it would load a model
            pass

    r = Runner()
    r.device, r.dtype, r.kv_cache_dtype, r.kv_cache_dtype_str = device, dtype, kv_dtype, kv_cache_dtype_str
    decode_name = decode_backend_name or backend_name
    r.prefill_attention_backend_str, r.decode_attention_backend_str = backend_name, decode_name
    r.draft_attention_backend = None
    r.gpu_id, r.canary_manager, r.page_size = 0, None, page_size
    r.harness_hybrid = hybrid
    compat.init_runner_caches(r)
    r.is_draft_worker = hybrid is not None and hybrid.draft_worker
    r.max_running_requests = runner.req_to_token.shape[0] - 1  # row 0 is padding
    r.model = torch.nn.Module()
    server_algorithm = SERVER_ALGORITHMS[algorithm] if max_draft_tokens else None
    r.spec_algorithm = getattr(sgl.SpeculativeAlgorithm, server_algorithm or "NONE")
    r._kernel_warmed_up = True
    # Backends read the published server args at construction (draft token counts, KV splits). The MLA
    # prefill settings are the server's defaults: ragged (MHA) prefill on, chunked prefix cache on.
    # CUDA graphs off for the eager rows where the release configures them so (before: disable_cuda_graph)
    split = {} if decode_backend_name is None else dict(  # published only where the server splits them
        prefill_attention_backend=backend_name, decode_attention_backend=decode_name,
        speculative_attention_mode="prefill")
    window_size, sink_size = draft_window  # published where set only: a release before 0.5.22 has no such flags
    windowed = {} if window_size <= 0 else dict(speculative_draft_window_size=window_size,
                                                speculative_draft_sink_size=sink_size)
    graphs = {} if sgl.CudaGraphConfig is None else {"cuda_graph_config": sgl.CudaGraphConfig(
        decode=sgl.PhaseConfig(backend=sgl.Backend.DISABLED),
        prefill=sgl.PhaseConfig(backend=sgl.Backend.BREAKABLE if prefill_graph else sgl.Backend.DISABLED))}
    r.server_args = compat.publish_server_args(
        sgl, attention_backend=backend_name, chunked_prefill_size=-1, **graphs, **split, **windowed,
        disable_radix_cache=False, dllm_algorithm=None, dllm_algorithm_config=None, dp_size=1,
        enable_deterministic_inference=False, enable_mis=False, is_embedding=False, kv_cache_dtype=kv_cache_dtype_str,
        max_running_requests=None, page_size=page_size, pp_size=1, revision=None,
        speculative_algorithm=server_algorithm,
        speculative_eagle_topk=topk, speculative_num_draft_tokens=max_draft_tokens,
        speculative_num_steps=max(0, max_draft_tokens - 1) if num_steps is None else num_steps, tp_size=1,
        triton_attention_num_kv_splits=8, triton_attention_split_tile_size=None,
        linear_attn_backend="triton", linear_attn_decode_backend=None, linear_attn_prefill_backend=None,
        _mamba_cache_chunk_size=64, disaggregation_mode=None, disable_chunked_prefix_cache=False,
        flashinfer_mla_disable_ragged=False,
        # A server resolves its device ("cuda"); SGLang's TBO splitter moves rebuilt lengths there
        # (two_batch_overlap.py:192): left unset, they stay on the CPU and its Triton kernels reject them.
        **({"device": "cuda"} if runner.device.type == "cuda" else {}))
    kv, r.model_config = (_mla_pool if use_mla else _mha_pool)(sgl, runner, layers, kv_dtype, device)
    rows = runner.req_to_token.shape[0]
    if hybrid is None:
        r.req_to_token_pool = sgl.ReqToTokenPool(size=1, max_context_len=1, device=device, enable_memory_saver=False)
    else:
        mc = r.model_config
        mc.hf_config = mc.hf_text_config = _hybrid_config(hybrid, mc.num_attention_heads, mc.num_key_value_heads,
                                                          mc.head_dim)
        mc.is_draft_model = hybrid.draft_worker  # read for Nemotron-H configs (configs/hybrid_arch.py, mamba2_config)
        if hybrid.linear_kind == "mamba2":
            compat.init_mamba_backend(r.server_args)
        r.req_to_token_pool = _hybrid_request_pool(sgl, mc.hf_config, runner, dtype, device, max_draft_tokens, topk)
        kv = _hybrid_kv_pool(sgl, runner, layers, kv_dtype, device, r.req_to_token_pool.mamba_pool, kv)
    r.req_to_token_pool.req_to_token = runner.req_to_token  # ours: [max_reqs, context_len] int32, row 0 padding
    # SGLang's size counts requests; from 0.5.12 its allocation adds a padding row (our row 0), before it does not
    r.req_to_token_pool.size = rows - compat.request_pool_padding()
    r.token_to_kv_pool = kv
    r.token_to_kv_pool_allocator = SimpleNamespace(page_size=page_size, get_kvcache=lambda: kv)
    compat.init_kv_indices(r)  # after req_to_token is ours: a translator keeps a reference to it
    r.attention_chunk_size = None
    r.hisparse_coordinator = None
    r.init_new_workspace = False
    r.is_hybrid_swa = window is not None
    r.sliding_window_size = window
    r.use_mla_backend = use_mla
    return r


def _hybrid_request_pool(sgl, config, runner: ModelRunner, dtype: torch.dtype, device: str, max_draft_tokens: int,
                         topk: int):
    """SGLang's request pool of a hybrid model: request rows plus the linear layers' state pools, one state slot per row
    of the harness's pools (slot 0 reserved in both).

    Conv states are kept in the model's dtype, as ``SGLANG_MAMBA_CONV_DTYPE=<model dtype>`` makes SGLang do (its
    default is bfloat16 whatever the model's dtype; bf16 serving models see no difference), SSM states in
    float32 (SGLang's default, and the harness's).
    """
    params = config.mamba2_cache_params
    params = sgl.Mamba2CacheParams(shape=params.shape, layers=params.layers,
                                   dtype=sgl.Mamba2StateDType(conv=dtype, temporal=torch.float32))
    rows = runner.req_to_token.shape[0]
    state_slots = rows if runner.mamba_pool is None else \
        next(iter(runner.mamba_pool.ssm_states.values())).shape[0]
    pool = sgl.HybridReqToTokenPool(**compat.accepted(sgl.HybridReqToTokenPool, dict(
        size=rows - compat.request_pool_padding(), mamba_size=state_slots - 1, mamba_spec_state_size=state_slots - 1,
        max_context_len=1,
        device=device, enable_memory_saver=False, cache_params=params, mamba_layer_ids=list(params.layers),
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=max_draft_tokens or None,
        speculative_eagle_topk=topk or None, enable_overlap_schedule=False)))
    compat.fit_state_mapping(pool, rows)
    return pool


class StateSync:
    """Copies the linear-attention states between the harness's pools and SGLang's, which differ in layout:
    SGLang keeps one tensor per kind over all linear layers, ``conv[L, slots, conv_dim, W-1]`` and
    ``temporal[L, slots, Hv, V, K]`` (GDN: value before key), the harness ``conv_states[id][slots, conv_dim, W-1]``
    and ``ssm_states[id][slots, Hv, K, V]``. Speculative steps: SGLang's ``intermediate_ssm[L, slots, D, Hv, V, K]``
    and ``intermediate_conv_window[0][L, slots, D, conv_dim, W-1]``. Lightning layers keep ``temporal[..., H, K,
    V]`` as the harness does (seg_la's state is key-major), and an empty conv state. KDA layers keep ``temporal[...,
    H, V, K]`` as GDN's and their conv states token-major, ``conv[L, slots, W-1, conv_dim]`` (and the per-step
    windows so), configs/mamba_utils.py KimiLinearStateShape. States go in before a batch
    is planned and come back after each linear layer runs, every slot both ways, so a write to a wrong slot is
    seen."""

    def __init__(self, sgl_runner, runner: ModelRunner) -> None:
        self.pool = sgl_runner.req_to_token_pool
        self.harness = runner.mamba_pool
        self.runner = runner
        self.value_major = {layer.layer_id for layer in runner.layers if layer.kind in ("linear", "kda")}
        self.token_major_conv = {layer.layer_id for layer in runner.layers if layer.kind == "kda"}

    def _layout(self, layer_id: int, state: torch.Tensor) -> torch.Tensor:
        """An SSM state between SGLang's layout and the harness's (the same swap both ways)."""
        return state.transpose(-1, -2) if layer_id in self.value_major else state

    def _conv_layout(self, layer_id: int, state: torch.Tensor) -> torch.Tensor:
        """A conv state between SGLang's layout and the harness's (the same swap both ways)."""
        return state.transpose(-1, -2) if layer_id in self.token_major_conv else state

    def push(self, fb) -> None:
        """The harness's states and request->slot map into SGLang's pools, then what SGLang's scheduler does
        before such a batch: a request without a cached prefix got a fresh state slot, which it clears
        (``ScheduleBatch.mamba_clear_indices``; the GDN kernels read the slot's SSM state whatever the prefix)."""
        mapping = self.pool.req_index_to_mamba_index_mapping
        mapping.copy_(self.runner.req_to_state_slot.to(mapping.dtype))
        if self.harness is None:
            return
        self.push_states()
        mode = fb.forward_mode
        if mode.is_decode() or mode.is_idle() or mode.is_target_verify():
            return
        fresh = [slot for slot, prefix in zip(fb.state_slots.tolist(), fb.extend_prefix_lens_cpu) if prefix == 0]
        if fresh:
            compat.clear_state_slots(self.pool.mamba_pool,
                                     torch.tensor(fresh, dtype=torch.int64, device=mapping.device))

    def push_states(self) -> None:
        """The harness's committed states into SGLang's pools (they are the state; SGLang's are a copy), e.g.
        before a verify commit, which a property may repeat from the same verified states."""
        for layer_id, conv in self.harness.conv_states.items():
            cache = self.pool.mamba2_layer_cache(layer_id)
            cache.conv[0].copy_(self._conv_layout(layer_id, conv))
            cache.temporal.copy_(self._layout(layer_id, self.harness.ssm_states[layer_id]))

    def pull(self, layer_id: int, state_slots: torch.Tensor | None = None, verify: bool = False) -> None:
        """SGLang's states of one linear layer back into the harness's pools; after a verify, also its
        per-draft-step states, which SGLang keeps by batch row (request i owns scratch row i,
        ``linear/utils.py`` build_verify_intermediate_state_indices) and the harness by ``state_slots`` (one per
        row, a device tensor). Device-side copies only, so a CUDA graph can capture them."""
        if self.harness is None or layer_id not in self.harness.conv_states:
            return
        cache = self.pool.mamba2_layer_cache(layer_id)
        self.harness.conv_states[layer_id].copy_(self._conv_layout(layer_id, cache.conv[0]))
        self.harness.ssm_states[layer_id].copy_(self._layout(layer_id, cache.temporal))
        if verify and layer_id in self.harness.intermediate_ssm_states:
            ours_ssm = self.harness.intermediate_ssm_states[layer_id]
            ours_conv = self.harness.intermediate_conv_states[layer_id]
            rows, d = state_slots.shape[0], ours_ssm.shape[1]
            ours_ssm.index_copy_(0, state_slots, self._layout(layer_id, cache.intermediate_ssm[:rows, :d]))
            ours_conv.index_copy_(0, state_slots,
                                  self._conv_layout(layer_id, cache.intermediate_conv_window[0][:rows, :d]))
