"""What changed between SGLang releases in the surface the adapter drives, one function per change.

Each function chooses by a feature of :mod:`backends.sglang.features` (never by a version string), and its
docstring names the releases on each side. The adapter calls these and nothing release-specific of its own, so
following a new release is an edit in ``features.py`` plus, where a contract moved, one function here.

The facts (file:line per release) are in ``docs/findings/releases.md``; in short:

- server args: 0.5.22 on publish them through ``runtime_context`` (``get_context().override_server_args``), read
  back as namespaces (``get_exec()``, ``get_schedule()``); up to 0.5.21 a ``ServerArgs`` dataclass is published
  with ``set_global_server_args_for_scheduler`` and read with ``get_global_server_args()`` or
  ``model_runner.server_args``.
- one attention rank: 0.5.14 on, ``get_parallel().override(...)`` (0.5.14 knows no ``attn_dcp_*`` field); up to
  0.5.13, backends import ``get_attention_tp_size`` by name, which reads the attention TP group.
- the backend a layer runs: 0.5.14 on, ``forward_context(ForwardContext(attn_backend=...))``; up to 0.5.13,
  ``forward_batch.attn_backend``, beside the pools the batch carries.
- KV indices: 0.5.22 on, the runner's ``KVIndexTranslator`` bound to each batch; 0.5.19 to 0.5.21, a translator
  that rebinds write slots at batch construction; before, backends read ``req_to_token_pool.req_to_token``.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import inspect
from functools import cache
from types import SimpleNamespace

import torch

from backends.sglang import features


# ---- server args ----
def publish_server_args(sgl, **args):
    """Publish the server's arguments as the installed SGLang's backends read them; returns the ServerArgs-like
    object a runner keeps as ``server_args``. Keys a release does not know are dropped (``enable_mis``,
    ``cuda_graph_config`` before 0.5.14: those releases have the feature off or absent); the CUDA-graph settings
    of a release without ``cuda_graph_config`` are ``disable_cuda_graph``."""
    if features.chosen("server_args") == "runtime_context":
        # Publishing builds SGLang's config bags from every field (5 ms of a 15 ms CPU case, the harness's profile):
        # arguments equal to the last publication's, still the installed ones and overridden by nothing since
        # (``RuntimeContext.override`` logs what it changes; a publication empties the log), are published already
        key = repr(sorted(args.items()))
        context = sgl.get_context()
        if _PUBLISHED and _PUBLISHED[0] == key and _installed(context) is _PUBLISHED[1] \
                and not getattr(context, "_overrides_log", None):
            return _PUBLISHED[1]
        _PUBLISHED[:] = key, context.override_server_args(**args).install()
        return _PUBLISHED[1]
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    server_args = object.__new__(ServerArgs)  # as SGLang's mock_server_args: defaults, no __post_init__
    for name, f in fields.items():
        if f.default is not dataclasses.MISSING:
            setattr(server_args, name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(server_args, name, f.default_factory())
    renamed = {"_mamba_cache_chunk_size": "mamba_cache_chunk_size"}
    for key, value in args.items():
        key = renamed.get(key, key)
        if key in fields:
            setattr(server_args, key, value)
    if "cuda_graph_config" not in fields and "disable_cuda_graph" in fields:
        server_args.disable_cuda_graph = True
    if "model_path" in fields and getattr(server_args, "model_path", None) is None:
        server_args.model_path = "harness"
    set_global_server_args_for_scheduler(server_args)
    return server_args


# (the arguments' key, the ServerArgs published for them) of the last publication through the runtime context
_PUBLISHED: list = []


def _installed(context):
    """The server args ``context`` has installed now (None when none is)."""
    try:
        return context.server_args
    except ValueError:  # none installed yet ("Global server args is not set yet!")
        return None


def server_setting(sgl, group: str, name: str):
    """One published setting, where the installed release keeps it: ``get_exec().<group>.<name>`` or
    ``get_schedule().<name>`` (``group == "schedule"``) on 0.5.22 on, the ServerArgs field before."""
    if features.chosen("server_args") == "runtime_context":
        return getattr(sgl.get_schedule() if group == "schedule" else getattr(sgl.get_exec(), group), name)
    from sglang.srt.server_args import get_global_server_args

    return getattr(get_global_server_args(), name)


# ---- one attention rank ----
_ENTERED: list = []


def enter_single_rank() -> None:
    """One attention rank, no torch.distributed, for the rest of the process (SGLang reads the sizes at every
    call): ``get_parallel().override`` with the fields the release knows (0.5.14 on; 0.5.14 has no
    ``attn_dcp_*``), and, where the release still has it, an attention TP group of one rank if none was
    initialized: backends up to 0.5.13 and 0.5.14's model configs (``Qwen3NextConfig.mamba2_cache_params``) ask
    ``get_attention_tp_size()``, which reads that group."""
    if features.has("parallel_context"):
        import sglang.srt.runtime_context as runtime_context

        # and the model's tensor-parallel rank, which its parallel linear layers read when they are built
        # (MambaMixer2's, backends/sglang/adapter.py)
        wanted = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_dcp_rank": 0, "tp_size": 1, "tp_rank": 0}
        known = getattr(runtime_context, "_PARALLEL_FIELDS", None)
        parallel = runtime_context.get_parallel().override(
            **{k: v for k, v in wanted.items() if known is None or k in known})
        parallel.__enter__()
        _ENTERED.append(parallel)  # kept: a context manager collected as garbage exits, undoing the override
    if features.has("attn_tp_group"):
        from sglang.srt.distributed import parallel_state

        # and the attention context-parallel group, which 0.5.14's FlashInfer backends ask for directly, and the
        # model's tensor-parallel group, which its parallel linear layers read when they are built (MambaMixer2's)
        for group in ("_ATTN_TP", "_ATTN_CP", "_TP"):
            if hasattr(parallel_state, group) and getattr(parallel_state, group) is None:
                setattr(parallel_state, group, SimpleNamespace(world_size=1, rank_in_group=0, ranks=[0],
                                                               local_rank=0, device_group=None, cpu_group=None))


def init_mamba_backend(server_args) -> None:
    """What SGLang's scheduler does at start-up for a Mamba model (managers/scheduler.py, 0.5.22 on): install the
    selective-state-update backend its server args name, which MambaMixer2's decode and verify dispatch to (the
    Mamba-2 leaf requires the feature: backends/sglang/adapter.py, SglangMamba2)."""
    from sglang.kernels.ops.mamba.triton_ops import initialize_mamba_selective_state_update_backend

    initialize_mamba_selective_state_update_backend(server_args)


# ---- the backend a layer runs ----
@contextlib.contextmanager
def backend_scope(sgl, backend, forward_batch):
    """Layers run under ``forward_batch`` dispatch to ``backend``: SGLang's forward context (0.5.14 on), or the
    batch's own ``attn_backend`` field (up to 0.5.13, RadixAttention calls ``forward_batch.attn_backend``)."""
    if features.chosen("backend_handoff") == "forward_context":
        with sgl.forward_context(sgl.ForwardContext(attn_backend=backend)):
            yield
        return
    saved = getattr(forward_batch, "attn_backend", None)
    forward_batch.attn_backend = backend
    try:
        yield
    finally:
        forward_batch.attn_backend = saved


@contextlib.contextmanager
def prefill_graph_flags(sgl, raw_num_tokens: int):
    """The prefill-graph scope's flags (0.5.23 on: RadixAttention and RadixLinearAttention take their graph breaks
    where ``is_in_prefill_graph_scope()``); 0.5.22 has no such scope (its layers go by the piecewise forward
    context, :func:`piecewise_forward_context`)."""
    if sgl.prefill_graph_scope is None:
        yield
        return
    with sgl.prefill_graph_scope(full_graph=False, raw_num_tokens=raw_num_tokens):
        yield


class _AttentionLayers(collections.abc.Mapping):
    """The model's attention layers by id as SGLang's runner lists them for its graphs
    (model_runner_components/layer_setup.py, 0.5.22): a layer module that wraps an ``attn`` (Kimi Linear's
    ``KimiDeltaAttention`` over its RadixLinearAttention) stands for that ``attn``; any other (a RadixAttention,
    Nemotron-H's mamba decoder layer) for itself. A view of the adapter's dict, which fills as each layer is built on
    its first forward."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def __getitem__(self, layer_id):
        block = self.blocks[layer_id]
        return getattr(block, "attn", block)

    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)


def piecewise_forward_context(sgl, forward_batch, layers, num_tokens: int, raw_num_tokens: int):
    """SGLang's piecewise forward context as its prefill runner sets it (no quantization, MoE layers or indexers):
    the batch, the model's attention layers by id (``layers``: the adapter's layer modules by id; SGLang's split ops
    only index it: 0.5.22's linear-attention op takes the layer it calls the backend with from there), the static and
    real token counts."""
    fn = sgl.set_tc_piecewise_forward_context
    return fn(forward_batch, _AttentionLayers(layers), None, [], [],
              **accepted(fn, dict(num_tokens=num_tokens, raw_num_tokens=raw_num_tokens)))


def attach_pools(forward_batch, sgl_runner) -> None:
    """Up to 0.5.13 a ForwardBatch carries the runner's pools (``forward_batch.token_to_kv_pool``, which the
    backends write through) and its backend; later releases read them from the runner."""
    if features.chosen("backend_handoff") == "batch_attn_backend":
        forward_batch.req_to_token_pool = sgl_runner.req_to_token_pool
        forward_batch.token_to_kv_pool = sgl_runner.token_to_kv_pool


# ---- KV indices and pools ----
def init_kv_indices(sgl_runner) -> None:
    """0.5.22 on: the runner's KV index translator, over its request pool (call once ``req_to_token`` is the
    harness's: the translator keeps a reference). Before: nothing, backends read the request pool themselves."""
    if features.has("kv_index_translator"):
        sgl_runner.init_kv_index_translator()


def bind_kv_indices(sgl_runner, forward_batch, graph: bool) -> None:
    """As every batch of SGLang's scheduler: from 0.5.22 the translator bound to the batch's own plan, or, for a
    graph runner's static batch, to the runner's slots; 0.5.19 to 0.5.21 rebind an eager batch's write slots as
    ``ForwardBatch.init_new`` does (``rebind_write_loc``, a no-op unless the allocator translates); before, no
    translator."""
    if features.has("kv_index_binding"):
        translator = sgl_runner.kv_index_translator
        (translator.bind_runner_slots if graph else translator.bind_own_plan)(forward_batch)
    elif features.has("kv_index_translator") and not graph:
        sgl_runner.kv_index_translator.rebind_write_loc(forward_batch)


def refresh_kv_pointers(kv) -> None:
    """After the adapter swaps the harness's buffers into an MHA pool: the pool's pointer tables, by the pool's
    own methods (0.5.22 on), else as the older ``_create_buffers`` computes them inline."""
    if features.has("kv_buffer_descs"):
        kv._kv_buffer_descs = kv._build_kv_buffer_descs()
        kv._init_data_ptrs_and_strides()
        return
    kv.k_data_ptrs = torch.tensor([x.data_ptr() for x in kv.k_buffer], dtype=torch.uint64, device=kv.device)
    kv.v_data_ptrs = torch.tensor([x.data_ptr() for x in kv.v_buffer], dtype=torch.uint64, device=kv.device)
    kv.data_ptrs = torch.cat([kv.k_data_ptrs, kv.v_data_ptrs], dim=0)
    kv.data_strides = torch.tensor([x[0].numel() * x.element_size() for x in kv.k_buffer + kv.v_buffer],
                                   device=kv.device)


def clear_state_slots(pool, slots: torch.Tensor) -> None:
    """Clear fresh requests' linear-attention state slots as the installed scheduler does: ``clear_slots`` (0.5.14
    on), or the zeroing ``MambaPool.alloc`` does when it hands a slot out (up to 0.5.13)."""
    if features.has("mamba_clear_slots"):
        pool.clear_slots(slots)
        return
    for name in ("conv", "temporal"):
        state = getattr(pool.mamba_cache, name)
        for tensor in (state if isinstance(state, (list, tuple)) else [state]):
            tensor[:, slots] = 0


# ---- constructors whose arguments were renamed or added ----
def accepted(cls, kwargs: dict, renames: dict[str, str] | None = None) -> dict:
    """``kwargs`` for ``cls`` of the installed release: renamed where it spells a parameter the old way
    (``renames``: ours -> old), and without keywords it does not take (each such keyword is one the adapter
    passes at its default meaning: a feature the release does not have)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    out = {}
    for key, value in kwargs.items():
        if key not in params and renames and renames.get(key) in params:
            key = renames[key]
        if key in params:
            out[key] = value
    return out


# update_mamba_state_after_mtp_verify's first argument, each request's last accepted step, was accepted_steps in
# 0.5.10 (eagle_worker.py passes accepted_length - 1, the same indices); req_pool_indices came in 0.5.17
COMMIT_RENAMES = {"last_correct_step_indices": "accepted_steps"}
# EagleVerifyInput's tree links were spelled retrive_* up to 0.5.13
VERIFY_RENAMES = {f"retrieve_{x}": f"retrive_{x}" for x in ("index", "next_token", "next_sibling", "cum_len")}
# NgramVerifyInput's too, and its mask was tree_mask (0.5.10)
NGRAM_RENAMES = VERIFY_RENAMES | {"custom_mask": "tree_mask"}


# ---- the graph metadata contract ----
def plan_out_graph(backend, forward_batch, in_capture: bool) -> None:
    """What SGLang's decode graph runner asks of a backend outside the graph, at capture and before each replay:
    the three-method contract's ``init_forward_metadata_out_graph(fb, in_capture)`` (0.5.14 on), or, up to 0.5.13,
    ``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph`` with the arguments that runner passed
    (cuda_graph_runner.py, capture_one_batch_size and replay_prepare)."""
    fb = forward_batch
    if features.chosen("graph_contract") == "three_method_graph_contract":
        backend.init_forward_metadata_out_graph(fb, in_capture=in_capture)
    elif in_capture:
        backend.init_forward_metadata_capture_cuda_graph(
            fb.batch_size, fb.input_ids.shape[0], fb.req_pool_indices, fb.seq_lens, None, fb.forward_mode,
            fb.spec_info)
    else:
        backend.init_forward_metadata_replay_cuda_graph(
            fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_sum, None, fb.forward_mode, fb.spec_info,
            seq_lens_cpu=fb.seq_lens_cpu)


def plan_in_graph(backend, forward_batch) -> None:
    """The planning a graph captures (``init_forward_metadata_in_graph``, 0.5.14 on); the older contract plans
    everything before the replay, so nothing runs inside the graph."""
    if features.chosen("graph_contract") == "three_method_graph_contract":
        backend.init_forward_metadata_in_graph(forward_batch)


# ---- the runner ----
def init_runner_caches(sgl_runner) -> None:
    """What the release's ``ModelRunner.__init__`` (which the adapter skips) sets that backends read: 0.5.14's
    linear-attention registry result, started empty (``_linear_attn_registry_cache = _UNSET``, read by
    ``linear_attn_model_spec``), and the parallel layout."""
    import sglang.srt.model_executor.model_runner as model_runner

    unset = getattr(model_runner, "_UNSET", None)
    if unset is not None:
        sgl_runner._linear_attn_registry_cache = unset
    # The parallel layout of one GPU, where a release keeps it on the runner for its backends to read (FlashAttention's
    # attn_cp_size): 0.5.10 to 0.5.15 copy server_args.attn_cp_size onto it (1 by default); 0.5.16 to 0.5.20 hand it a
    # ParallelState (distributed/parallel_state_wrapper.py), whose trivial() is SGLang's own single-GPU state; later
    # releases read it from the runtime context (get_parallel()).
    sgl_runner.attn_cp_size = 1
    sgl_runner.tp_size = 1  # what ModelRunner.__init__ keeps of its tp_size argument; FA3 reads it in 0.5.11 to 0.5.15
    if features.chosen("parallel_layout") == "parallel_state":
        from sglang.srt.distributed.parallel_state_wrapper import ParallelState

        sgl_runner.ps = ParallelState.trivial()


@cache
def request_pool_padding() -> int:
    """Rows a request pool adds to the requests it is sized for: 1 from 0.5.12 on (row 0 pads CUDA-graph
    batches, ``_alloc_size = size + 1``), 0 in 0.5.10 and 0.5.11 (``size`` rows, all allocatable). Read off a pool of
    the installed release rather than detected in its source: the row is allocated inside ``__init__``."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=1, max_context_len=1, device="cpu", enable_memory_saver=False)
    return pool.req_to_token.shape[0] - 1


def fit_state_mapping(pool, rows: int) -> None:
    """The request -> state slot map of a hybrid request pool, one entry per request row. From 0.5.14 it is sized
    by the request pool; up to 0.5.13 by the state pool (``torch.zeros(mamba_size)``), which a server sizes at
    least as large as its request pool, while the adapter's state pool is the harness's (one slot per request
    row, slot 0 reserved, and as many as the harness's state pool has): there the map is sized to the request rows,
    as the later releases size it."""
    mapping = pool.req_index_to_mamba_index_mapping
    if mapping.shape[0] != rows:
        pool.req_index_to_mamba_index_mapping = torch.zeros(rows, dtype=mapping.dtype, device=mapping.device)
