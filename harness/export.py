"""``harness export``: a case file as one standalone pytest file, for the engine's engineers.

The file needs torch and SGLang only, never this project. It builds SGLang's real classes the way SGLang's own
attention unit-test kit builds them (``sglang.test.kits.attention_unittest``, in the wheel from 0.5.14 on:
its ``MockModelRunner``, ``TinyModelConfig``, ``DenseAttentionCase`` and ``_make_forward_batch``), loads the
very tensors SGLang saw when the harness replayed the case (q, k, v of the layer that failed, the cached keys and
values, each token's KV slot), runs that one layer through ``RadixAttention`` under SGLang's forward context, and
checks it against a float64 attention written out in the file, with the harness's bound and its reason.

How the tensors are taken: the case is replayed through the harness (``properties.run.run_case``) while
:class:`Recorder` listens at the adapter's one call into SGLang (``SglangBackend._run``), where it reads what
SGLang is handed (q, k, v, the planned ``ForwardBatch``, the KV pool before that layer writes to it). So the
exported batch is SGLang's input, not a re-derivation of it.

Conformance gaps (a wrapper that leaves to SGLang's base class what its children override, or lacks a member
SGLang's callers probe for with ``hasattr``) need no batch: the file imports the SGLang classes the harness built
for the composition and runs the same structural check, against the installed SGLang's own base class and
sources, so it follows any release where those classes exist.

A class-level composition (``sglang.hpc_ops``, ``tbo(sglang.wave)``: backends/sglang/classes.py) is never
built: its file runs the harness's class check itself (``class_call_problems``, copied in from
properties/conformance.py when the file is written) on the same classes, and the wrapper check on the members the
harness found hidden. So does a plan-level one (``sglang.trtllm_mla``, ``tbo(sglang.fa3)``: backends/sglang/plans.py),
whose classes the property reads the same way before it builds them.

What it covers today (anything else is refused with one line, exit 2):

* the ``outputs`` and ``refuse_or_correct`` properties of a plain dense SGLang leaf (``sglang.torch_native``,
  ``sglang.triton``, ``sglang.flashinfer``, ``sglang.flex_attention``, ``sglang.trtllm_mha``), in EXTEND, DECODE,
  MIXED, TARGET_VERIFY or DRAFT_EXTEND (SGLang's DRAFT_EXTEND_V2), over an ``auto`` or an ``fp8_e4m3`` KV cache:
  - a refuse_or_correct file passes when SGLang raises (a loud refusal; an error of the file's own code is not
    one) or answers within the bound, and fails with the refusal property's words ("answered without refusing
    (logit cap not supported); ...") otherwise;
  - over an fp8 cache the file swaps SGLang's fp8 pool into the kit's runner, sets the layer's checkpoint KV
    scales as SGLang's loader leaves them, stores the cached e4m3 values as they are, and its reference reads them
    times the scales (the new tokens as the cache stores them), as the harness's reference does; on a CPU a Triton
    case also gets the harness's correction of Triton's interpreted fp8 cast (interpreter_shims.py, shim 6);
  - a verify or draft-extend batch keeps SGLang's seq_lens and positions and rebuilds its spec info with SGLang's
    verify input of its speculative algorithm (``EagleVerifyInput``, ``FrozenKVMTPVerifyInput``, ``NgramVerifyInput``:
    the draft tree's custom mask and retrieve links, as the harness handed them; ``DFlashVerifyInput``: the block,
    the batch's host lengths widened by it) or
    ``EagleDraftExtendInput``; the reference places each draft token at the cached length plus its depth;
* the ``outputs`` property of two-batch overlap over one of those leaves (``tbo(sglang.X)``) in EXTEND, DECODE or
  MIXED: the file builds ``TboAttnBackend`` over the leaf, splits the batch with SGLang's own splitter and runs each
  half under its child backend; the recorder joins the two halves' q, k, v in order;
* the ``outputs`` property of a lightning layer under SGLang's hybrid wrapper over one of those leaves
  (harness/export_lightning.py), and of a KDA layer so (harness/export_kda.py; on a CPU its file also installs the
  harness's corrections of Triton's interpreter for the fla kernels, copied in);
* a case that crashed inside SGLang: the file runs into the same crash (the layer SGLang crashed in);
* the ``metadata`` property of ``sglang.triton`` (an eager plan of an EXTEND, MIXED or DECODE batch) and its
  ``graph_metadata`` property (a decode graph's plan at a padded replay): harness/export_metadata.py;
* the ``metadata`` property of an MLA leaf's draft loop (``sglang.trtllm_mla``, ``sglang.cutedsl_mla``: the draft
  worker's multi-step container from SGLang's factory over the kit's MLA runner, each step's plan judged against its
  own keys): harness/export_draft.py;
* the ``conformance`` property of any SGLang composition, class-level ones included.

The other kinds named by issue 27 (other backends' plans and those of other speculative batches, graph replay's
outputs, the TBO split property and TBO over other compositions, GDN, Mamba-2 and short-convolution layers, MLA's
outputs, the draft loop's outputs) are not exported yet.
"""

from __future__ import annotations

import json
import math
import os
import re
import string
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.sglang.runtime import SERVER_ALGORITHMS
from harness import export_draft, export_kda, export_lightning, export_metadata
from harness.options import UsageError

# The SGLang leaves whose classes SGLang's kit builds from a DenseAttentionCase: their attention-backend names
DENSE_LEAVES = {"sglang.torch_native": "torch_native", "sglang.triton": "triton", "sglang.flashinfer": "flashinfer",
                "sglang.flex_attention": "flex_attention", "sglang.trtllm_mha": "trtllm_mha"}
# The properties whose file runs one layer against a float64 reference; refuse_or_correct also takes a raise
OUTPUT_PROPERTIES = ("outputs", "refuse_or_correct")
PROPERTIES = (*OUTPUT_PROPERTIES, "conformance")
REFUSAL = "refuse_or_correct"
MODES = ("extend", "decode", "mixed", "target_verify", "draft_extend")
# Two-batch overlap over a dense leaf: the batches its file splits with SGLang's own splitter
TBO_MODES = ("extend", "decode", "mixed")
# "auto": the cache in the model's dtype; fp8_e4m3: --kv-cache-dtype fp8_e4m3, with the layer's checkpoint scales
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# Up to this many tensor elements the data is written into the file itself; above, into one .pt beside it.
INLINE_ELEMENTS = 4096
# The first SGLang release whose wheel ships the attention unit-test kit the file builds with.
KIT_SINCE = "0.5.14"
# Where a server reaches each leaf: the flag that selects it.
SERVER_FLAG = {"torch_native": "--attention-backend torch_native", "triton": "--attention-backend triton",
               "flashinfer": "--attention-backend flashinfer", "flex_attention": "--attention-backend flex_attention",
               "trtllm_mha": "--attention-backend trtllm_mha"}


def dense_leaf(composition: str) -> tuple[str | None, bool]:
    """A dense leaf's SGLang name and whether it runs under two-batch overlap (``tbo(sglang.X)``), or (None, False)
    for any other composition."""
    tbo = composition.startswith("tbo(") and composition.endswith(")")
    leaf = DENSE_LEAVES.get(composition[4:-1] if tbo else composition)
    return (leaf, tbo) if leaf else (None, False)


def _plan_leaf(composition: str, prop: str) -> str | None:
    """The dense leaf's SGLang name of a plan case (``graph(sglang.X)`` for graph_metadata), or None."""
    graph = export_metadata.graph_property(composition, prop)
    return DENSE_LEAVES.get(composition.removeprefix("graph(").removesuffix(")") if graph else composition)


def exportable_reason(composition: str, prop: str, mode: str, kv_cache_dtype: str, draft_window: int = 0) -> str | None:
    """Why a case of this kind cannot be exported (yet), or None (``draft_window``: a draft loop's server draft
    window, 0 for none)."""
    if prop == "conformance":
        if "sglang." not in composition or composition.startswith("graph("):
            return f"export covers the conformance of SGLang's own classes, not {composition}"
        return None
    if export_draft.draft_case(composition, mode):
        return export_draft.exportable_reason(composition, prop, mode, kv_cache_dtype, draft_window)
    if prop in export_metadata.PROPERTIES:
        return export_metadata.exportable_reason(_plan_leaf(composition, prop), prop, mode, kv_cache_dtype)
    kind, full = _linear_kind(composition)
    if kind is not None:
        return _linear_exportable_reason(kind, full, prop, mode, kv_cache_dtype)
    leaf, tbo = dense_leaf(composition)
    if leaf is None:
        return (f"export covers the dense SGLang leaves ({', '.join(DENSE_LEAVES)}), two-batch overlap over one, and "
                f"lightning or KDA under SGLang's hybrid wrapper over one, not {composition} (other wrappers, MLA and "
                f"other linear attention are not exported yet)")
    if tbo and (prop != "outputs" or mode not in TBO_MODES):
        return (f"export covers the outputs property of two-batch overlap in {', '.join(TBO_MODES)} batches, not {prop} "
                f"in {mode}")
    if prop not in PROPERTIES:
        return f"export covers the {', '.join(PROPERTIES)} property, not {prop}"
    if mode not in MODES:
        return f"export covers {', '.join(MODES)} batches, not {mode} (draft-loop batches are not exported yet)"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"export covers a KV cache of {' or '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype}"
    return None


@dataclass
class LayerCall:
    """What SGLang was handed for one layer of one batch."""

    layer_id: int
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D], the batch's new tokens
    v: torch.Tensor  # [T, Hk, Dv]
    radix: dict  # RadixAttention's constructor arguments as the adapter passed them
    slots: list[list[int]]  # each request's KV slot per position (cached: its req_to_token row; new: out_cache_loc)
    cached_k: list[torch.Tensor]  # each request's keys at its cached positions, read from the pool before the layer
    cached_v: list[torch.Tensor]  # (as stored: float8_e4m3fn in an fp8 cache)
    kv_scales: tuple[float, float] | None  # the layer's k_scale, v_scale (an fp8 cache), as the adapter set them
    spec: dict | None = None  # a speculative batch's SGLang inputs (speculative_inputs), None for any other
    spec_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    halves: list = field(default_factory=list)  # the TBO halves whose calls q, k, v hold, in order (or the backend)


def speculative_inputs(sfb) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """What SGLang's ForwardBatch ``sfb`` carries for speculative decoding, as the file rebuilds it: its seq_lens
    (a verify's count the cached tokens only), and the spec info's fields: EagleVerifyInput's draft tree (custom
    mask, retrieve links, steps, topk, draft tokens), EagleDraftExtendInput's accepted tokens per request. Tensors
    apart (positions included: a draft token's is seq_len + its depth, not its row). ``(None, {})`` for a batch
    without spec info."""
    info, bs = sfb.spec_info, sfb.batch_size
    if info is None:
        return None, {}
    # The committed lengths (a DFlash verify's host copy is widened by its block: the device's are these)
    spec = {"seq_lens": [int(n) for n in sfb.seq_lens[:bs].tolist()]}
    tensors = {"positions": sfb.positions.detach().cpu().clone()}
    if sfb.forward_mode.is_target_verify():
        spec.update(verify_input=type(info).__name__, draft_token_num=int(info.draft_token_num))
        if spec["verify_input"] in ("EagleVerifyInput", "FrozenKVMTPVerifyInput"):
            spec.update(spec_steps=int(info.spec_steps), topk=int(info.topk))
        if info.custom_mask is not None:
            tensors["custom_mask"] = info.custom_mask.detach().cpu().clone()
        for name in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "retrieve_cum_len"):
            # (spelled retrive_* up to 0.5.13; a DFlash block has no tree links, an n-gram tree no cum_len)
            found = getattr(info, name, getattr(info, name.replace("retrieve", "retrive"), None))
            if found is not None:
                tensors[name] = found.detach().cpu().clone()
    else:  # a draft extend (DRAFT_EXTEND_V2)
        spec["num_accept_tokens"] = [int(a) for a in info.num_accept_tokens_cpu]
    return spec, tensors


@dataclass
class LinearCall:
    """What SGLang was handed for one lightning layer of one batch (a linear layer: no KV cache, a state per
    request in SGLang's mamba pool)."""

    layer_id: int
    q: torch.Tensor  # [T, H, D], as the model hands it (float32)
    k: torch.Tensor  # [T, H, D]
    v: torch.Tensor  # [T, H, D]
    layer: dict  # RadixAttention's arguments, the model's layer count, the hybrid's full-attention layers
    states: torch.Tensor  # [B, H, K, V]: each request's state at its slot before the layer, as SGLang holds it
    spec: dict | None = None
    spec_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Recorder:
    """Listens at ``SglangBackend._run`` (the adapter's call into SGLang) and keeps each layer's first call; the
    layer whose call has begun and not returned is ``running`` (after a crash: the layer SGLang crashed in)."""

    calls: dict[int, LayerCall] = field(default_factory=dict)
    linear_calls: dict = field(default_factory=dict)  # layer id -> LinearCall (lightning) or export_kda.KdaCall
    running: int | None = None
    kda_backend: tuple | None = None  # (adapter, wrapper it runs under) of the KDA layer running
    # Each plan SGLang's backend was asked for (eager, or a graph's capture and replays): its ForwardBatch's fields as
    # handed, and the request rows it reads; and the harness's view of each batch whose plan it checked
    plans: list[dict] = field(default_factory=list)
    checked: list[dict] = field(default_factory=list)

    @contextmanager
    def listening(self, prefix_lens: list[int], new_lens: list[int]):
        from unittest import mock

        from backends.sglang.adapter import SglangBackend

        original = SglangBackend._run
        recorder = self

        def _run(backend, q, k, v, layer, forward_batch, save_kv_cache, via=None):
            if layer.kind == "mha":
                tbo = getattr(backend, "parent", None)  # a TBO half: SGLang gets the batch's tokens in two calls
                call = recorder.calls.get(layer.layer_id)
                if call is None:
                    # The slots and cached K/V of the whole batch (a half's own batch holds its requests only)
                    sfb = (next(iter(tbo.primary.batches.values())) if tbo is not None
                           else backend.batches[id(forward_batch)])
                    recorder.calls[layer.layer_id] = _layer_call(backend, sfb, q, k, v, layer, prefix_lens, new_lens)
                    recorder.calls[layer.layer_id].halves.append(backend)
                elif tbo is not None and not any(h is backend for h in call.halves):  # the other half, in order
                    call.halves.append(backend)
                    call.q, call.k, call.v = (torch.cat([mine, new.detach().cpu()])
                                              for mine, new in ((call.q, q), (call.k, k), (call.v, v)))
            if layer.layer_id not in recorder.linear_calls and layer.kind == "lightning":
                recorder.linear_calls[layer.layer_id] = _linear_call(backend, q, k, v, layer, forward_batch, via)
            recorder.running = layer.layer_id
            out = original(backend, q, k, v, layer, forward_batch, save_kv_cache, via)
            recorder.running = None
            return out

        from backends.sglang.adapter import SglangKda

        run_kda, call_kda = SglangBackend._run_kda, SglangKda.call_layer

        def _run_kda(backend, layer, forward_batch, mixed_qkv, a, b, via=None):
            # The call into SGLang is the leaf's call_layer, under this backend: it records with this backend's pool
            recorder.running, recorder.kda_backend = layer.layer_id, (backend, via)
            out = run_kda(backend, layer, forward_batch, mixed_qkv, a, b, via)
            recorder.running = recorder.kda_backend = None
            return out

        def call_layer(block, projected, sfb):
            backend, via = recorder.kda_backend
            if block.attn.layer_id not in recorder.linear_calls:
                pool, full_layers = backend.sgl_runner.req_to_token_pool, (via or backend.inner).full_attn_layers
                recorder.linear_calls[block.attn.layer_id] = export_kda.record(block, projected, sfb, pool, full_layers)
            return call_kda(block, projected, sfb)

        import properties.metadata
        from backends.sglang import compat

        plan, out_graph, check_plan = SglangBackend._plan, compat.plan_out_graph, properties.metadata.check_plan

        def _plan(backend, forward_batch, planner, static=False):
            def recorded(sfb):
                recorder.plans.append(_plan_fields(sfb, "static" if static else "eager",
                                                   backend.sgl_runner.req_to_token_pool.req_to_token))
                return planner(sfb)
            return plan(backend, forward_batch, recorded, static)

        def plan_out_graph(backend, sfb, in_capture):
            # (SGLang's backend keeps the request pool's table it plans from)
            recorder.plans.append(_plan_fields(sfb, "capture" if in_capture else "replay", backend.req_to_token))
            return out_graph(backend, sfb, in_capture)

        def checking(meta, fb):
            recorder.checked.append(_checked_fields(fb))
            return check_plan(meta, fb)

        with mock.patch.object(SglangBackend, "_run", _run), mock.patch.object(SglangBackend, "_plan", _plan), \
                mock.patch.object(SglangBackend, "_run_kda", _run_kda), \
                mock.patch.object(SglangKda, "call_layer", staticmethod(call_layer)), \
                mock.patch.object(compat, "plan_out_graph", plan_out_graph), \
                mock.patch.object(properties.metadata, "check_plan", checking):
            yield self


# The fields of SGLang's ForwardBatch a plan file rebuilds (tensors with their dtype), and the harness batch's fields
# properties.metadata.check_plan reads
PLAN_TENSORS = ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_prefix_lens", "extend_seq_lens",
                "extend_start_loc")
CHECKED_FIELDS = ("batch_size", "extend_num_tokens", "num_padding", "extend_seq_lens_cpu", "extend_prefix_lens_cpu",
                  "page_size", "seq_lens_cpu", "req_pool_indices")


def _as_list(x):
    return x.tolist() if isinstance(x, torch.Tensor) else (list(x) if isinstance(x, (list, tuple)) else x)


def _plan_fields(sfb, stage: str, table: torch.Tensor) -> dict:
    """SGLang's ForwardBatch ``sfb`` as handed to a plan (read before it: a plan may write into it), with each request
    row it names as far as the batch reads it (its seq_len, or the longest read of that row)."""
    fields = {"stage": stage, "forward_mode": sfb.forward_mode.name, "batch_size": int(sfb.batch_size),
              "num_tokens": int(sfb.input_ids.shape[0]), "seq_lens_sum": int(sfb.seq_lens_sum),
              "seq_lens_cpu": _as_list(sfb.seq_lens_cpu), "num_padding": getattr(sfb, "num_padding", None),
              "extend_prefix_lens_cpu": _as_list(getattr(sfb, "extend_prefix_lens_cpu", None)),
              "extend_seq_lens_cpu": _as_list(getattr(sfb, "extend_seq_lens_cpu", None)), "dtypes": {}}
    for name in PLAN_TENSORS:
        t = getattr(sfb, name, None)
        if isinstance(t, torch.Tensor):
            fields[name] = t.tolist()
            fields["dtypes"][name] = str(t.dtype).removeprefix("torch.")
    reads: dict[int, int] = {}
    for row, n in zip(fields["req_pool_indices"], fields["seq_lens"]):
        reads[int(row)] = max(reads.get(int(row), 0), int(n))
    fields["rows"] = {row: table[row, :n].tolist() for row, n in sorted(reads.items())}
    return fields


def _checked_fields(fb) -> dict:
    """The harness's view of a batch whose plan properties.metadata.check_plan judged: what it reads of it."""
    return {name: _as_list(getattr(fb, name, None)) for name in CHECKED_FIELDS}


def _layer_call(backend, sfb, q, k, v, layer, prefix_lens: list[int], new_lens: list[int]) -> LayerCall:
    """An MHA layer's call, read before SGLang runs it: its q, k, v, its RadixAttention, each request's KV slots (the
    cached ones from its request row, the new ones from ``sfb.out_cache_loc``) and its cached K/V from the pool."""
    runner = backend.sgl_runner
    rows = sfb.req_pool_indices[:sfb.batch_size].tolist()
    table = runner.req_to_token_pool.req_to_token
    # Each request's cached tokens' slots from its request row, then its new tokens' write slots (a verify's seq_lens
    # count only the cached tokens)
    out_loc = sfb.out_cache_loc.tolist()
    starts = [sum(new_lens[:i]) for i in range(len(new_lens))]
    slots = [table[r, :p].tolist() + out_loc[s:s + n] for r, p, s, n in zip(rows, prefix_lens, starts, new_lens)]
    pool = runner.token_to_kv_pool
    kbuf, vbuf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    cached = [torch.tensor(s[:p], dtype=torch.int64, device=kbuf.device) for s, p in zip(slots, prefix_lens)]
    radix = backend._layer(layer)
    scales = getattr(radix, "k_scale_float", None), getattr(radix, "v_scale_float", None)
    return LayerCall(
        layer.layer_id, q.detach().cpu().clone(), k.detach().cpu().clone(), v.detach().cpu().clone(),
        {"num_heads": radix.tp_q_head_num, "num_kv_heads": radix.tp_k_head_num, "head_dim": radix.head_dim,
         "v_head_dim": radix.v_head_dim, "scaling": float(radix.scaling), "logit_cap": float(radix.logit_cap or 0.0),
         "sliding_window_size": int(radix.sliding_window_size)},
        slots, [kbuf[c].cpu().clone() for c in cached], [vbuf[c].cpu().clone() for c in cached],
        None if scales[0] is None else (float(scales[0]), float(scales[1])), *speculative_inputs(sfb))


def _linear_call(backend, q, k, v, layer, forward_batch, via) -> LinearCall:
    """A lightning layer's call, read before SGLang runs it: its q, k, v, its RadixAttention, and each request's
    state where SGLang's pool holds it (the slot its request row maps to)."""
    sfb = backend.batches[id(forward_batch)]
    runner = backend.sgl_runner
    pool = runner.req_to_token_pool
    rows = sfb.req_pool_indices[:sfb.batch_size]
    slots = pool.req_index_to_mamba_index_mapping[rows].long()
    radix = backend._layer(layer)
    wrapper = via or backend.inner
    return LinearCall(
        layer.layer_id, q.detach().cpu().clone(), k.detach().cpu().clone(), v.detach().cpu().clone(),
        {"num_heads": radix.tp_q_head_num, "head_dim": radix.head_dim, "scaling": float(radix.scaling),
         "num_hidden_layers": int(runner.model_config.hf_config.num_hidden_layers),
         "layerwise_decay": bool(getattr(runner.model_config.hf_config, "lightning_layerwise_decay", True)),
         "full_attn_layers": [int(i) for i in wrapper.full_attn_layers]},
        pool.mamba2_layer_cache(layer.layer_id).temporal[slots].detach().cpu().clone(), *speculative_inputs(sfb))


@dataclass
class Export:
    """One exported case: the pytest file's text and the tensors it loads."""

    text: str
    tensors: dict[str, torch.Tensor]
    inline: bool
    failed: bool  # whether the harness's replay, at export, failed the case's check
    summary: str  # what it measured there, one line
    # the exception SGLang raised in the replay (a crash case: the file runs into it), else None
    crashed: str | None = None


def crash_type(reason: str) -> str:
    """The exception's name in a crash reason (properties/blame.py ``crash_reason``: ``crashed: TYPE: ...``)."""
    return reason.removeprefix("crashed: ").split(":", 1)[0].strip()


# How --check runs a written file: each failure as one line, ``path:line: TYPE: message`` at the frame that raised
# (pytest's --tb=line), and the short summary's FAILED/ERROR lines (-rfE) to count them by
CHECK_ARGS = ("--tb=line", "-rfE")


def unlike_the_replay(export: Export, output: str, file_name: str) -> str | None:
    """Why a failing exported file (``file_name``, run with :data:`CHECK_ARGS`) did not fail as the harness's replay
    did, or None where every failure is the case's mechanism: the file's own check (an ``AssertionError`` raised in
    the file itself: an assert inside SGLang or its kit is not the file's check) or the crash the case recorded (its
    exception, wherever SGLang raised it). A collection or setup error (``ERROR``) never is."""
    summary = output[output.rfind("short test summary info"):] if "short test summary info" in output else ""
    failed = re.findall(r"^(FAILED|ERROR) (\S+)", summary, flags=re.M)
    if not failed:
        return "pytest's summary names no failing test"
    errored = [test for outcome, test in failed if outcome == "ERROR"]
    if errored:
        return f"{errored[0]} errored (collection or setup), not failed by the case's check"
    # the FAILURES section, up to the next section's header (warnings, the summary)
    section = re.search(r"^=+ FAILURES =+$(.*?)^=+ ", output, flags=re.M | re.S)
    raised = re.findall(r"^(\S+\.py):\d+: ([A-Za-z_][\w.]*)(?::|$)", section.group(1) if section else "",
                        flags=re.M)
    if len(raised) < len(failed):
        return f"{len(failed)} test(s) failed but pytest named where only {len(raised)} raised"
    for path, exception in raised:
        name = exception.rsplit(".", 1)[-1]
        own = Path(path).name == file_name
        if name == "AssertionError" and own:
            continue
        if export.crashed is not None and name == export.crashed:
            continue
        where = "the file's own check" if own else Path(path).name
        return (f"a test failed with {name} raised in {where}, not the file's own check (an AssertionError in "
                f"{file_name})" + (f" or the recorded crash ({export.crashed})" if export.crashed else ""))
    return None


def _compact_slots(slots: list[list[int]], page_size: int, padding: bool = False) -> list[list[int]]:
    """The same slot layout with the pages renumbered 1, 2, ... in order of first use (page 0 stays SGLang's
    padding page), so it fits the pool SGLang's kit allocates; offsets inside a page and which positions share a
    page are kept. ``padding``: the layout uses page 0 itself (a graph's padded rows), which stays page 0."""
    pages: dict[int, int] = {0: 0} if padding else {}
    first = 0 if padding else 1
    out = []
    for row in slots:
        new_row = []
        for slot in row:
            page, offset = divmod(slot, page_size)
            new_row.append(pages.setdefault(page, len(pages) + first) * page_size + offset)
        out.append(new_row)
    return out


def _server_configuration(name: str, spec, radix: dict, kv_scales: tuple[float, float] | None,
                          tbo: bool = False) -> str:
    parts = [f"python -m sglang.launch_server {SERVER_FLAG[name]}"] + (["--enable-two-batch-overlap"] if tbo else [])
    if spec.page_size > 1:
        parts.append(f"--page-size {spec.page_size}")
    if spec.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {spec.kv_cache_dtype}")
    model = [f"{radix['num_heads']} query / {radix['num_kv_heads']} KV heads of dim {radix['head_dim']}",
             f"dtype {spec.dtype}"]
    if kv_scales and kv_scales != (1.0, 1.0):
        model.append(f"checkpoint KV scales k_scale {kv_scales[0]:g}, v_scale {kv_scales[1]:g}")
    if radix["sliding_window_size"] >= 0:
        model.append(f"sliding window {radix['sliding_window_size']} (a Gemma-2/Mistral-style SWA layer)")
    if radix["logit_cap"]:
        model.append(f"attention logit soft-cap {radix['logit_cap']:g} (Gemma-2/Grok-style)")
    if spec.spec is not None and spec.spec.algorithm == "dflash":
        parts.append(f"--speculative-algorithm DFLASH --speculative-num-draft-tokens {spec.spec.draft_token_num} "
                     f"(the block size)")
    elif spec.spec is not None and spec.spec.algorithm == "ngram":
        parts.append(f"--speculative-algorithm NGRAM --speculative-ngram-max-bfs-breadth {spec.spec.topk} "
                     f"--speculative-num-draft-tokens {spec.spec.draft_token_num}")
    elif spec.spec is not None:
        parts.append(f"--speculative-algorithm {SERVER_ALGORITHMS[spec.spec.algorithm]} --speculative-num-steps "
                     f"{spec.spec.spec_steps} --speculative-eagle-topk {spec.spec.topk} "
                     f"--speculative-num-draft-tokens {spec.spec.draft_token_num}")
    step = {"decode": "a decode step", "extend": "a prefill (extend) step", "mixed": "a mixed prefill+decode step "
            "(--enable-mixed-chunk)", "target_verify": "the target model's verify of a draft tree",
            "draft_extend": "the draft model's extend over the accepted tokens"}[spec.mode.value]
    if spec.spec is not None and spec.spec.algorithm == "dflash":
        step = "the target model's verify of a DFlash block (a chain under the causal mask)"
    return f"{' '.join(parts)}, a model with {', '.join(model)}; {step}"


def _tensor_source(name: str, t: torch.Tensor) -> str:
    """``name: torch.tensor([...])`` with every value exact (a float's repr reads back bit for bit, and a
    float32/16 value is exactly a float), wrapped to the file's width."""
    values = ", ".join(repr(float(x)) if t.is_floating_point() else str(int(x)) for x in t.flatten().tolist())
    body = textwrap.fill(values, 112, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return f"    {name!r}: torch.tensor([\n{body}\n    ], dtype={t.dtype}).reshape{tuple(t.shape)},"


def build(case, device: str, case_path: Path | None = None) -> Export:
    """Replay ``case`` (a CaseFile, read from ``case_path``) on ``device``, recording what SGLang was handed or
    built; render the pytest file. A ledger entry whose case is that file gives the triage link."""
    from backends.registry import parse

    spec = case.spec
    reason = exportable_reason(case.composition, case.property, spec.mode.value, spec.kv_cache_dtype,
                               spec.spec.draft_window_size if spec.spec is not None else 0)
    if reason:
        raise UsageError(f"cannot export {case.composition} {case.property}: {reason}")
    composition = parse(case.composition)
    why = composition.unavailable_reason(device)
    # A refusal case crosses a limit the composition declares by construction: that is what it checks
    crossed = composition.unsupported_reason(spec)
    if case.property != REFUSAL:
        why = why or crossed
    elif crossed is None:
        why = why or "the batch crosses no limit the composition declares (nothing to refuse)"
    if why:
        raise UsageError(f"cannot replay {case.composition} here to record SGLang's inputs: {why}")
    if case.property == "conformance":
        return _build_conformance(case, composition, device, case_path)
    kind, _ = _linear_kind(case.composition)
    if kind is not None:
        return _build_linear(case, composition, device, case_path, kind)
    if export_draft.covers(case.composition, case.property, spec.mode.value):
        return _build_draft(case, composition, device, case_path)
    if case.property in export_metadata.PROPERTIES:
        return _build_metadata(case, composition, device, case_path)
    return _build_outputs(case, composition, device, case_path, crossed if case.property == REFUSAL else None)


def _header(case, device: str, case_path: Path | None, headline: str, server: str, measured: str,
            needs: str) -> str:
    """The file's docstring and its imports up to SGLang's: what it shows, where, and how to run it."""
    from search.ledger import engine_version, known_failures

    entries = [e for e in known_failures()
               if case_path is not None and e.case and e.case_path.resolve() == case_path.resolve()]
    versions = case.versions or {}
    commit = versions.get("sglang-commit")
    verdict = (case.verdict or {}).get("reason") or "(no verdict recorded: a case exported as it passes)"
    return PREAMBLE.substitute(
        title=f"{case.composition} {case.property} ({case.spec.mode.value}): {headline}",
        composition=case.composition, property=case.property, mode=case.spec.mode.value,
        engine=f"sglang {versions.get('sglang') or 'unknown'}" + (f" (commit {commit})" if commit else ""),
        exported_on=f"sglang {engine_version()} on {device}",
        server=textwrap.fill(server, 115, subsequent_indent="    "),
        triage=entries[0].triage if entries else "none yet (not in the known-failure ledger)",
        verdict=textwrap.fill(verdict, 110, initial_indent="    ", subsequent_indent="    "),
        measured=textwrap.fill(measured, 110, subsequent_indent="    "), needs=needs, device=device)


def _speculative_fields(spec, recorded: dict | None) -> dict[str, str]:
    """The template fields that make a file's batch speculative (its spec info rebuilt with SGLang's own input
    class from what SGLang was handed, ``recorded``), all empty for a batch without spec info."""
    if not recorded:
        return {"speculative": "", "speculative_runner": "", "use_speculative": "", "speculative_imports": "",
                "forward_batch_names": "ForwardMode"}
    algorithm = SERVER_ALGORITHMS[spec.spec.algorithm]
    return {"speculative": string.Template(speculative_template(spec)).substitute(spec=json.dumps(recorded),
                                                                                   algorithm=algorithm),
            "speculative_runner": string.Template(SPECULATIVE_RUNNER).substitute(algorithm=algorithm),
            "use_speculative": USE_SPECULATIVE, "forward_batch_names": "CaptureHiddenMode, ForwardMode",
            "speculative_imports": (f"from sglang.srt.speculative.{speculative_import(spec)}\n"
                                    "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n")}


def _replay(case, composition, device: str, recorder: Recorder, crossed: str | None = None):
    """Replay ``case`` under ``recorder``: ``(run, None)``, or ``(None, crash reason)`` when it crashed inside SGLang
    (what the file must show). A crash in the project's code raises: an adapter error is never handed over as
    SGLang's. A refusal case (``crossed``) that SGLang refused here is refused: nothing wrong to hand over."""
    from properties.blame import adapter_frame, crash_reason
    from properties.run import run_case

    with recorder.listening(list(case.spec.prefix_lens), list(case.spec.extend_lens)):
        try:
            return run_case(composition, case.spec, device), None
        except Exception as e:  # noqa: BLE001 - classified below
            if adapter_frame(e, composition) is not None:
                raise
            if crossed is not None:
                raise UsageError(f"cannot export {case.composition} {case.property}: SGLang refused the batch here "
                                 f"({crossed}), which passes: {crash_reason(e).removeprefix('crashed: ')}") from e
            return None, crash_reason(e)


def _build_outputs(case, composition, device: str, case_path: Path | None, crossed: str | None) -> Export:
    """An outputs case, or (``crossed``: the limit its batch crosses) a refuse_or_correct one: its file also passes
    when SGLang raises, and its failure leads with the refusal property's words."""
    from properties.tolerances import layer_bound, widen_for_cancellation
    from properties.verdict import compare, token_starts

    spec = case.spec
    recorder = Recorder()
    prefix_lens = list(spec.prefix_lens)  # the cached tokens of each request (a decode's too)
    measured = {}
    run, crashed = _replay(case, composition, device, recorder, crossed)
    if crashed is not None:  # the file runs into the same crash, in the layer SGLang crashed in
        layer_id = recorder.running
        if layer_id not in recorder.calls:
            raise UsageError(f"cannot export {case.composition} {case.property}: SGLang crashed outside an attention "
                             f"layer ({crashed})")
        layer = next(l for l in spec.layers if l.layer_id == layer_id)
        measured = {layer_id: (math.inf, None, layer_bound(composition, spec, layer, device))}
    # The layer to hand over: the one furthest out of (or nearest to) its bound, as the property measured it
    starts = token_starts(spec)
    for layer, out, ref in zip(spec.layers, *((run.execution.outputs, run.reference.outputs) if run else ((), ()))):
        if layer.kind != "mha" or layer.layer_id not in recorder.calls:
            continue
        bound = widen_for_cancellation(layer_bound(composition, spec, layer, device), ref,
                                       run.reference.magnitudes.get(layer.layer_id))
        c = compare(out, ref, bound, starts, scale=run.reference.element_scales.get(layer.layer_id),
                    score_size=run.reference.score_sizes.get(layer.layer_id))
        measured[layer.layer_id] = (max(c.ratios().values()), c, bound)
    if not measured:
        raise UsageError(f"cannot export {case.composition} {case.property}: no attention layer reached SGLang")
    layer_id = max(measured, key=lambda i: measured[i][0])
    _, comparison, bound = measured[layer_id]
    call = recorder.calls[layer_id]
    name, tbo = dense_leaf(case.composition)
    slots = _compact_slots(call.slots, spec.page_size)
    seq_lens = [len(s) for s in slots]
    new_lens = [n - p for n, p in zip(seq_lens, prefix_lens)]
    kv_dtype = call.cached_k[0].dtype if call.cached_k else None  # the cache's (float8_e4m3fn in an fp8 one)
    tensors = {"q": call.q, "k": call.k, "v": call.v,
               "cached_k": torch.cat(call.cached_k) if call.cached_k else call.k[:0].to(kv_dtype or call.k.dtype),
               "cached_v": torch.cat(call.cached_v) if call.cached_v else call.v[:0].to(kv_dtype or call.v.dtype),
               **call.spec_tensors}
    inline = sum(t.numel() for t in tensors.values()) <= INLINE_ELEMENTS
    window = call.radix["sliding_window_size"]
    data_source = "\n".join(_tensor_source(k, t) for k, t in tensors.items()) if inline else None
    if crashed is not None:
        failed, headline, measured_text = [crashed], crashed, f"the replay {crashed}"
    else:
        failed = [w for w, (value, limit) in (("relative L2 error", (comparison.rel_l2, bound.rel_l2)),
                                              ("element error", (comparison.element_error, comparison.element_bound)))
                  if value > limit]
        headline = (f"{failed[0]} out of bounds at layer {layer_id}: {comparison.where}" if failed
                    else f"within bounds on this engine (worst at {max(comparison.ratios().values()):.2f} of a bound)")
        measured_text = (f"rel_l2 {comparison.rel_l2:.3g} (bound {bound.rel_l2:.3g}), element "
                         f"{comparison.element_error:.3g} (bound {comparison.element_bound:.3g}) at "
                         f"{comparison.where or 'nowhere'}")
    # The refusal property's words for an answer it did not refuse (properties/refusal.py)
    answered = f"answered without refusing ({crossed}); outputs vs float64 reference: " if crossed else ""
    header = _header(case, device, case_path, answered + headline,
                     _server_configuration(name, spec, call.radix, call.kv_scales, tbo),
                     f"on the layer below, {measured_text}",
                     f"SGLang {KIT_SINCE} or newer, whose wheel ships the attention unit-test kit this file builds "
                     f"with")
    text = header + OUTPUTS.substitute(
        kit_import=KIT_IMPORT.substitute(module="dense_attention", kit="attention unit-test kit", since=KIT_SINCE),
        backend=name, mode_upper=SGLANG_MODE[spec.mode.value], dtype=spec.dtype,
        page_size=spec.page_size, prefix_lens=prefix_lens, new_lens=new_lens, slots=json.dumps(slots),
        radix=json.dumps(call.radix), layer_id=layer_id, rel_l2_bound=repr(bound.rel_l2),
        element_factor=repr(bound.element), score_factor=repr(bound.score),
        bound_reason=textwrap.fill(bound.reason, 106, initial_indent="# ", subsequent_indent="# "),
        window_note=("and within its sliding window W: a key at position j only from a query at a position p with "
                     "j >= p - W" if window >= 0 else "no sliding window"),
        parents=json.dumps([list(p) for p in spec.spec.parents]) if spec.mode.drafts_tree() else "None",
        **_speculative_fields(spec, call.spec),
        data=("TENSORS = {\n" + data_source + "\n}" if inline else
              "TENSORS = torch.load(Path(__file__).with_suffix('.pt'))  # the tensors, beside this file"),
        answered=repr(answered), crossed=repr(crossed), run_layer=REFUSED_OR_RUN if crossed else RUN,
        run_layer_def=TBO_RUN_LAYER if tbo else RUN_LAYER,
        make_backend="tbo_backend(runner)" if tbo else "ATTENTION_BACKENDS[BACKEND](runner)",
        test_name="test_refused_or_matches_float64_attention" if crossed else "test_outputs_match_float64_attention",
        kv_cache_dtype=spec.kv_cache_dtype, kv_scales=repr(call.kv_scales or (1.0, 1.0)),
        fp8_cache=FP8_CACHE if spec.kv_cache_dtype == "fp8_e4m3" else "",
        fp8_note=FP8_NOTE if spec.kv_cache_dtype == "fp8_e4m3" else "",
        # Under Triton's CPU interpreter, SGLang's Triton kernels cast to fp8 through the interpreter's faulty cast
        interpreter_cast=(_interpreter_cast()
                          if spec.kv_cache_dtype == "fp8_e4m3" and name == "triton" and device == "cpu" else ""),
        use_fp8_cache=USE_FP8_CACHE if spec.kv_cache_dtype == "fp8_e4m3" else "",
    )
    return Export(text, {k: t.contiguous() for k, t in tensors.items()}, inline, bool(failed),
                  f"layer {layer_id}: {measured_text}", crash_type(crashed) if crashed else None)


def _build_metadata(case, composition, device: str, case_path: Path | None) -> Export:
    """A plan case (harness/export_metadata.py): the property replayed under the recorder, which keeps what SGLang's
    backend was handed at each plan and the harness's view of the batch whose plan it judged; the file rebuilds the
    one and checks against the other."""
    from properties import PROPERTIES as CHECKS

    spec = case.spec
    graph = export_metadata.graph_property(case.composition, case.property)
    recorder = Recorder()
    with recorder.listening(list(spec.prefix_lens), list(spec.extend_lens)):
        verdict = CHECKS[case.property].run(composition, spec, device)
    if verdict.details.get("adapter_error"):  # the harness's own code: never handed over as SGLang's
        raise UsageError(f"cannot export {case.composition} {case.property}: the harness's own code failed in the "
                         f"replay ({verdict.reason[:200]})")
    stages = ("capture", "replay") if graph else ("eager",)
    plans = [next((p for p in reversed(recorder.plans) if p["stage"] == stage), None) for stage in stages]
    if any(p is None for p in plans) or not recorder.checked:
        raise UsageError(f"cannot export {case.composition} {case.property}: the replay made no "
                         f"{' and '.join(stages)} plan to hand over ({verdict.reason[:200]})")
    checked = recorder.checked[-1]
    if graph:
        plans[0]["rows"] = {**plans[0]["rows"], **plans[1]["rows"]}  # the pool as it stands at the replay
    # One renumbering of the pages for every slot the file names: the rows' and each plan's write slots
    rows = {row: slots for p in plans for row, slots in p["rows"].items()}
    lists = list(rows.values()) + [p["out_cache_loc"] for p in plans]
    renumbered = _compact_slots(lists, spec.page_size, padding=True)
    rows = dict(zip(rows, renumbered[:len(rows)]))
    for p, loc in zip(plans, renumbered[len(rows):]):
        p["out_cache_loc"] = loc
        del p["rows"], p["stage"]
    layer = next(layer for layer in spec.layers if layer.kind == "mha")
    # The model's one window (SGLang plans window lists for it whichever layer has it), not the first layer's
    window = next((l.sliding_window for l in spec.layers if getattr(l, "sliding_window", None) is not None), None)
    radix = {"num_heads": layer.num_q_heads, "num_kv_heads": layer.num_kv_heads, "head_dim": layer.head_dim,
             "sliding_window_size": -1 if window is None else window}
    where = (f"at replay at {checked['batch_size']} x 1 ({checked['num_padding'] or 0} padded row(s)): " if graph
             else "")
    leaf = _plan_leaf(case.composition, case.property)
    header = _header(case, device, case_path, verdict.reason, export_metadata.server_configuration(
        leaf, spec, graph, checked["batch_size"]), f"{'fails' if not verdict.ok else 'passes'}: {verdict.reason}",
        f"SGLang {KIT_SINCE} or newer, whose wheel ships the attention unit-test kit this file builds with")
    source = _source_of("_indptr_problem", "_sizes_problem", "_window_problem", "check_plan",
                        module="properties.metadata")
    text = header + export_metadata.METADATA.substitute(
        kit_import=KIT_IMPORT.substitute(module="dense_attention", kit="attention unit-test kit", since=KIT_SINCE),
        backend=leaf, dtype=spec.dtype, page_size=spec.page_size, radix=repr(radix), graph=graph,
        rows=_literal(rows), plans=_literal(plans), expected=_literal(checked), where=repr(where),
        plans_note=("at the graph's capture (its static batch, every row padding) and at the replay (the real "
                    "requests, then the padding)" if graph else "the eager batch"),
        check_source=source)
    return Export(text, {}, True, not verdict.ok, verdict.reason)


def _build_draft(case, composition, device: str, case_path: Path | None) -> Export:
    """A draft loop's plan case (harness/export_draft.py): the container planned as the property plans it; the file
    gets the draft batch SGLang was handed, the request rows it reads and, step by step, the keys each step must
    read (properties/metadata.py ``draft_step_batch``), all over one renumbering of the pages."""
    from backends.sglang import flashinfer as fi
    from properties import PROPERTIES as CHECKS
    from properties.metadata import draft_step_batch, planned_case

    spec = case.spec
    verdict = CHECKS[case.property].run(composition, spec, device)
    if verdict.details.get("adapter_error"):  # the harness's own code: never handed over as SGLang's
        raise UsageError(f"cannot export {case.composition} {case.property}: the harness's own code failed in the "
                         f"replay ({verdict.reason[:200]})")
    drafter, planned = planned_case(composition, spec, device)  # the same plan again, for what SGLang was handed
    sfb, fb = drafter.sfb, planned.forward_batch
    if sfb is None:
        raise UsageError(f"cannot export {case.composition} {case.property}: the replay planned no draft batch")
    steps = spec.spec.spec_steps - 1
    expected = []
    for step in range(steps):
        want = draft_step_batch(spec, fb, step)
        expected.append([want.req_to_token[b, :n + 1].tolist() for b, n in enumerate(want.extend_prefix_lens_cpu)])
    loc = sfb.out_cache_loc.to("cpu", torch.int64).tolist()
    # Each request row as far as a step's keys or a draft slot reach into it
    rows, per = {}, len(loc) // sfb.batch_size  # each request's topk * num_steps draft slots, in request order
    for r, row in enumerate(sfb.req_pool_indices.tolist()):
        full = fb.req_to_token[row].to("cpu", torch.int64).tolist()
        mine = loc[r * per:(r + 1) * per]
        reach = max(full.index(s) for s in mine + [k for keys in expected for k in keys[r * drafter.topk]])
        rows[row] = full[:reach + 1]
    flat = [k for keys in expected for branch in keys for k in branch]
    renumbered = _compact_slots(list(rows.values()) + [loc, flat], spec.page_size)
    rows = dict(zip(rows, renumbered[:len(rows)]))
    loc, flat = renumbered[len(rows)], iter(renumbered[len(rows) + 1])
    expected = [[[next(flat) for _ in branch] for branch in keys] for keys in expected]
    batch = {"batch_size": sfb.batch_size, "req_pool_indices": sfb.req_pool_indices.tolist(),
             "seq_lens": sfb.seq_lens.tolist(), "positions": sfb.positions.tolist(), "out_cache_loc": loc}
    layer = next(layer for layer in spec.layers if layer.kind == "mla")
    leaf = export_draft.LEAVES[case.composition]
    header = _header(case, device, case_path, verdict.reason, export_draft.server_configuration(leaf, spec),
                     f"{'fails' if not verdict.ok else 'passes'}: {verdict.reason}",
                     f"SGLang {export_draft.MLA_KIT_SINCE} or newer, whose wheel ships the attention unit-test kit's "
                     f"MLA fixture this file builds with")
    text = header + export_draft.DRAFT.substitute(
        kit_import=KIT_IMPORT.substitute(module="mla_attention", kit="attention unit-test kit's MLA fixture",
                                         since=export_draft.MLA_KIT_SINCE),
        backend=leaf, plan_level=leaf in export_draft.PLAN_LEVEL, dtype=spec.dtype, page_size=spec.page_size,
        mla=repr({"num_heads": layer.num_heads, "kv_lora_rank": layer.kv_lora_rank,
                  "qk_rope_head_dim": layer.qk_rope_head_dim}),
        topk=spec.spec.topk, num_steps=spec.spec.spec_steps, rows=_literal(rows), batch=_literal(batch),
        expected_keys=repr(expected),
        check_source=_source_of("_indptr_problem", "_sizes_problem", "_window_problem", "check_plan",
                                module="properties.metadata"),
        page_table_source=_source_of("page_table_lists", "flat_lists", module="backends.sglang.adapter"),
        wrapper_classes=repr(fi.FLASHINFER_WRAPPER_CLASSES), mla_wrapper_classes=repr(fi.FLASHINFER_MLA_WRAPPER_CLASSES),
        stand_in_source="\n\n".join([_source_of("asked_as", module="backends.sglang.plans")] + [
            _source_of(name, module="backends.sglang.flashinfer") for name in (
                "_AbsentFlashInferWrapper", "_no_counter_buffer", "_no_jit_module", "_UnpinnedTorch",
                "flashinfer_absent")]))
    return Export(text, {}, True, not verdict.ok, verdict.reason)


def _literal(value) -> str:
    """``value`` (ints, strings, None, lists and dicts of them) as a Python literal, a key or an item a line where it
    is a dict or a list of dicts (the file stays readable)."""
    if isinstance(value, dict) and value:
        return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in value.items()) + "}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[\n" + "".join(f"    {v!r},\n" for v in value) + "]"
    return repr(value)


def _linear_kind(composition: str):
    """The export module of a linear hybrid's composition (harness/export_lightning.py, harness/export_kda.py) and
    its full-attention leaf's SGLang name, or (None, None)."""
    for kind in (export_lightning, export_kda):
        m = kind.COMPOSITION.match(composition)
        if m:
            return kind, m.group(1)
    return None, None


def _linear_exportable_reason(kind, full: str, prop: str, mode: str, kv_cache_dtype: str) -> str | None:
    """Why a linear hybrid's case of this kind cannot be exported, or None."""
    if full not in DENSE_LEAVES.values():
        return (f"export covers a {kind.NAME} hybrid over a dense leaf ({', '.join(DENSE_LEAVES.values())}), not "
                f"sglang.{full}")
    if prop != "outputs":
        return f"export covers the outputs property of a {kind.NAME} hybrid, not {prop}"
    if mode not in kind.MODES:
        return f"export covers {', '.join(kind.MODES)} batches of a {kind.NAME} hybrid, not {mode}{kind.MODES_NOTE}"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"export covers a KV cache of {' or '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype}"
    return None


def _lightning_fields(spec, call, device: str) -> tuple[dict, dict]:
    """A lightning file's own template fields and tensors."""
    verify = spec.mode.is_target_verify()
    return ({"layer": repr(call.layer), "kv_cache_dtype": spec.kv_cache_dtype, **_speculative_fields(spec, call.spec),
             "draft_tokens": spec.extend_lens[0] if verify else "None",
             # Under Triton's CPU interpreter, seg_la's cast of q and its output to the fp8 cache dtype goes through
             # the interpreter's faulty cast, which the harness corrects (the dense exports' correction, copied in the
             # same way)
             "interpreter_cast": (_interpreter_cast() if spec.kv_cache_dtype == "fp8_e4m3" and device == "cpu"
                                  else "")},
            {"q": call.q, "k": call.k, "v": call.v, "states": call.states, **call.spec_tensors})


def _kda_fields(spec, call, device: str) -> tuple[dict, dict]:
    """A KDA file's own template fields and tensors; on a CPU, the interpreter's corrections the fla kernels need."""
    return ({**export_kda.fields(call, spec), "interpreter": _kda_interpreter() if device == "cpu" else ""},
            export_kda.tensors(call))


LINEAR_FIELDS = {"lightning": _lightning_fields, "kda": _kda_fields}


def _build_linear(case, composition, device: str, case_path: Path | None, kind) -> Export:
    """A linear hybrid's case (``kind``: harness/export_lightning.py or harness/export_kda.py): replay it recording
    what SGLang's hybrid was handed for its layers of that kind; render the file for the layer that failed (the worst
    against its bound, or the one SGLang crashed in)."""
    from properties.outputs import linear_state_comparisons
    from properties.tolerances import layer_bound, widen_for_cancellation
    from properties.verdict import Worst, compare, token_starts

    from backends.sglang.features import version_key
    from search.ledger import engine_version

    spec, name = case.spec, kind.LAYER_KIND
    installed = engine_version()
    if installed is not None and version_key(installed) < version_key(kind.KIT_SINCE):
        # The kits of older releases build their runners and hand their layers the gates otherwise (0.5.16's KDA kit
        # has no resolve_linear_attn_backends, and its model sigmoids beta before the layer): a file written here
        # would fail on its own imports or inputs, not by the case's mechanism
        raise UsageError(f"cannot export {case.composition} {case.property} on SGLang {installed}: the file builds "
                         f"with the {kind.KIT_NAME} as SGLang {kind.KIT_SINCE} and later ship it (export on such a "
                         f"release where the bug still lives)")
    # The file runs one linear layer: a case that failed at a layer of another kind would pass there
    failed_at = re.match(r"layer (\d+)", (case.verdict or {}).get("where") or "")
    kinds = {layer.layer_id: layer.kind for layer in spec.layers}
    if failed_at and kinds.get(int(failed_at.group(1))) not in (None, name):
        raise UsageError(f"cannot export {case.composition} {case.property}: the case failed at its "
                         f"{kinds[int(failed_at.group(1))]} layer {failed_at.group(1)}, and the export of a {name} "
                         f"hybrid covers its {name} layers")
    recorder = Recorder()
    run, crashed = _replay(case, composition, device, recorder)
    layers = {layer.layer_id: layer for layer in spec.layers}
    if crashed is not None:
        layer_id = recorder.running
        if layer_id is None or layer_id not in recorder.linear_calls:
            raise UsageError(f"cannot export {case.composition} {case.property}: SGLang crashed outside a {name} "
                             f"layer ({crashed})")
        measured = {layer_id: (float("inf"), crashed)}
    else:
        measured = {}
        starts = token_starts(spec)
        for layer_id in recorder.linear_calls:
            i = [l.layer_id for l in spec.layers].index(layer_id)
            out, ref = run.execution.outputs[i], run.reference.outputs[i]
            bound = widen_for_cancellation(layer_bound(composition, spec, layers[layer_id], device), ref,
                                           run.reference.magnitudes.get(layer_id))
            found = Worst()
            found.add(compare(out, ref, bound, starts, f"layer {layer_id}:"), bound)
            # Its states, as the outputs property compares them (properties/outputs.py)
            linear_state_comparisons(run, composition, device, found, [layers[layer_id]])
            state_bound = layer_bound(composition, spec, layers[layer_id], device)
            worst, worst_bound = max(found.items, key=lambda f: max(f[0].ratios().values()))
            text = (f"{worst.where}: rel_l2 {worst.rel_l2:.3g} (bound {worst_bound.rel_l2:.3g}), element "
                    f"{worst.element_error:.3g} (bound {worst.element_bound:.3g})")
            measured[layer_id] = (max(worst.ratios().values()), text, bound, state_bound, worst)
        if not measured:
            raise UsageError(f"cannot export {case.composition} {case.property}: no {name} layer reached SGLang")
    layer_id = max(measured, key=lambda i: measured[i][0])
    call = recorder.linear_calls[layer_id]
    if crashed is not None:
        headline, measured_text = crashed, f"the replay {crashed}"
        bound = state_bound = layer_bound(composition, spec, layers[layer_id], device)
    else:
        _, measured_text, bound, state_bound, worst = measured[layer_id]
        bad = [w for w, value, limit in (("relative L2 error", worst.rel_l2, worst.rel_l2_bound),
                                         ("element error", worst.element_error, worst.element_bound))
               if value > limit]
        headline = (f"{bad[0]} out of bounds at {worst.where}" if bad else
                    f"within bounds on this engine (worst at {measured[layer_id][0]:.2f} of a bound)")
    _, full = _linear_kind(case.composition)
    own, tensors = LINEAR_FIELDS[name](spec, call, device)
    inline = sum(t.numel() for t in tensors.values()) <= INLINE_ELEMENTS
    header = _header(case, device, case_path, headline, kind.server_configuration(full, spec, call),
                     f"on {name} layer {layer_id}, {measured_text}",
                     f"SGLang {kind.KIT_SINCE} or newer, whose wheel ships the {kind.KIT_NAME} this file builds with")
    text = header + string.Template(kind.TEMPLATE).substitute(
        kit_import=KIT_IMPORT.substitute(module=kind.KIT_MODULE, kit=kind.KIT_NAME, since=kind.KIT_SINCE),
        full=full, mode_upper=SGLANG_MODE.get(spec.mode.value, spec.mode.value.upper()),
        dtype=spec.dtype, page_size=spec.page_size, prefix_lens=list(spec.prefix_lens),
        new_lens=list(spec.extend_lens), layer_id=layer_id,
        bounds=LINEAR_BOUNDS.substitute(
            states=kind.STATES, rel_l2_bound=repr(bound.rel_l2), element_factor=repr(bound.element),
            state_rel_l2_bound=repr(state_bound.rel_l2), state_element_factor=repr(state_bound.element),
            bound_reason=textwrap.fill(bound.reason, 106, initial_indent="# ", subsequent_indent="# "),
            state_bound_reason=textwrap.fill(state_bound.reason, 106, initial_indent="# ", subsequent_indent="# ")),
        data=("TENSORS = {\n" + "\n".join(_tensor_source(k, t) for k, t in tensors.items()) + "\n}" if inline else
              "TENSORS = torch.load(Path(__file__).with_suffix('.pt'))  # the tensors, beside this file"),
        check=LINEAR_CHECK, build_backend=LINEAR_BUILD.substitute(server=kind.SERVER, linear=kind.BACKEND_CLASS),
        **own)
    return Export(text, {k: t.contiguous() for k, t in tensors.items()}, inline,
                  crashed is not None or "out of bounds" in headline, f"{name} layer {layer_id}: {measured_text}",
                  crash_type(crashed) if crashed else None)


def _class_at(obj) -> tuple[str, str]:
    return type(obj).__module__, type(obj).__qualname__


def _composition_server(composition) -> str:
    """How a server reaches a composition of SGLang's classes (its flags and the kind of model)."""
    term = str(composition)
    leaves = composition.leaves()
    full = next((l.split(".", 1)[1] for l in leaves if l.split(".", 1)[1] in ("torch_native", "triton", "flashinfer",
                                                                              "flashinfer_mla")), None)
    parts = ["python -m sglang.launch_server"] + ([f"--attention-backend {full}"] if full else [])
    model = "a dense model"
    if "sglang.gdn" in leaves:
        model = "a hybrid GDN model (Qwen3-Next/Qwen3.5-style: SGLang wraps the backends in HybridLinearAttnBackend)"
    elif "sglang.lightning" in leaves:
        model = "a hybrid lightning model (Bailing/Ling-style: SGLang wraps the backends in HybridLinearAttnBackend)"
    elif full == "flashinfer_mla":
        model = "a DeepSeek-style MLA model"
    if term.startswith("tbo("):
        parts.append("--enable-two-batch-overlap")
    return f"{' '.join(parts)}, {model}"


def _build_conformance(case, composition, device: str, case_path: Path | None) -> Export:
    support = composition.support()
    # A plan-level composition's classes are read as a class-level one's (properties.conformance), and its file is
    # that check: what a faulted class breaks shows there, with or without the fault installed while exporting
    if support.class_only or support.plan_only:
        return _build_class_conformance(case, composition, device, case_path)
    from batch.forward_batch import ModelRunner
    from batch.spec import ForwardMode
    from engine.materialize import materialize
    from properties.conformance import engine_conformance, hidden_overrides

    spec = case.spec
    verdict = engine_conformance(composition, spec, device)
    materialized = materialize(spec, device)
    backend = composition.build(spec, ModelRunner.of(materialized.forward_batch, spec.layers))
    backend.init_forward_metadata(materialized.forward_batch)
    wrapper, children, base = backend.engine_objects()
    pairs, todo = [], ([(wrapper, list(children))] if wrapper is not None else [])
    while todo:  # wrappers nest (TBO over the hybrid): each against its own children, as the harness checks them
        w, kids = todo.pop(0)
        pairs.append((w, kids))
        todo += [(k, backend.engine_children(k)) for k in kids if backend.engine_children(k)
                 and not any(k is p for p, _ in pairs)]
    # Per wrapper class: the backends under it, the members the harness finds unreachable there (a TBO
    # wrapper's three hybrid children are one class: checked once), and the backends whose hasattr-probed members
    # it owes (a prefill/decode split: its prefill backend's; see the adapter's probe_owners)
    probed = backend.engine_probed_members()
    wrappers = []
    for w, kids in pairs:
        owners = backend.probe_owners(w, kids)
        members = [m for m, _ in hidden_overrides(w, kids, base)]
        members += [m for m in probed if any(hasattr(k, m) for k in owners) and not hasattr(w, m)]
        entry = [list(_class_at(w)), [list(_class_at(k)) for k in kids], members, [list(_class_at(k)) for k in owners]]
        if entry not in wrappers:
            wrappers.append(entry)
    leaf = list(_class_at(children[0])) if wrapper is None else None
    serves_verify = ForwardMode.TARGET_VERIFY in composition.support().modes
    other = verdict.details.get("other_problems", 0) if verdict.details else 0
    if other:
        raise UsageError(f"cannot export {case.composition} conformance: the harness's verdict includes a call that "
                         f"failed on an instance ({verdict.reason[:200]}), which the class-level file does not make")
    header = _conformance_header(case, device, case_path, composition, verdict, "every member reachable on this engine")
    text = header + CONFORMANCE.substitute(
        base=json.dumps([base.__module__, base.__qualname__]), wrappers=json.dumps(wrappers),
        leaf=repr(leaf), serves_verify=serves_verify, classes="[]", forwarders="[]", class_checks="",
        assigned_on_instances=_source_of("assigned_on_instances"))
    return Export(text, {}, True, not verdict.ok, verdict.reason)


def _build_class_conformance(case, composition, device: str, case_path: Path | None) -> Export:
    """A class-level composition (backends/sglang/classes.py): nothing is built. The file reads the same classes
    and runs the harness's own class check on them (``class_call_problems`` and the functions it calls, copied
    into the file from properties/conformance.py, so the two cannot drift), and, under a wrapper, the wrapper
    check of the built compositions on the members the harness found hidden."""
    import importlib

    from backends.sglang import runtime

    c = importlib.import_module("properties.conformance")  # the module (the package exports a function of its name)
    verdict = c.class_conformance(composition)
    sgl = runtime.load()
    base = sgl.AttentionBackend
    classes = list(dict.fromkeys(c._classes_under(composition)))
    forwarders = [w for w in (sgl.HybridLinearAttnBackend, sgl.HybridAttnBackend) if w is not None]
    wrapper_classes = {"tbo": sgl.TboAttnBackend, "hybrid": sgl.HybridLinearAttnBackend, "pd": sgl.HybridAttnBackend}
    wrappers = []
    for node in c._wrapper_nodes(composition):
        kids = [k for child in node.children for k in c._classes_under(child)]
        owners = c._classes_under(node.children[0]) if node.name == "pd" else kids
        hidden = [m for m, _ in c.class_hidden(wrapper_classes[node.name], kids, owners, base,
                                               runtime.probed_members(), runtime.probed_on_full_backend())]
        if hidden:  # only what the harness found: its every-member check knows callers that SGLang's sources fix
            wrappers.append([list(_class_at_class(wrapper_classes[node.name])), [list(_class_at_class(k)) for k in kids],
                             hidden, [list(_class_at_class(k)) for k in owners]])
    checks = _source_of("_declared_calls", "_raises_not_implemented", "_strip_self", "class_call_problems")
    header = _conformance_header(case, device, case_path, composition, verdict, "every class takes SGLang's calls")
    text = header + CONFORMANCE.substitute(
        base=json.dumps([base.__module__, base.__qualname__]), wrappers=json.dumps(wrappers), leaf="None",
        serves_verify=False, classes=json.dumps([list(_class_at_class(k)) for k in classes]),
        forwarders=json.dumps([list(_class_at_class(w)) for w in forwarders]), class_checks=CLASS_CHECKS + checks,
        assigned_on_instances=_source_of("assigned_on_instances"))
    return Export(text, {}, True, not verdict.ok, verdict.reason)


def _conformance_header(case, device: str, case_path: Path | None, composition, verdict, passed: str) -> str:
    """The header of a conformance export: the verdict's reason, or ``passed`` when it passed."""
    headline = textwrap.shorten(verdict.reason, 120, placeholder=" ...") if not verdict.ok else passed
    return _header(case, device, case_path, headline, _composition_server(composition),
                   f"{'FAILED' if not verdict.ok else 'passed'}: {verdict.reason}",
                   "SGLang (any release with these classes); no GPU and no kernel: it reads classes and sources")


def _source_of(*names: str, module: str = "properties.conformance") -> str:
    """The source of functions of ``module`` (by default properties/conformance.py; the module itself: its package
    exports a function of its name), to be copied into an exported file (which must not import this project), so the
    file runs the harness's own checks and corrections (backends/sglang/interpreter_shims.py's for Triton's
    interpreter, properties/metadata.py's plan check), not a copy that could drift."""
    import importlib
    import inspect

    found = importlib.import_module(module)
    # (a Triton jit function's source is its Python function's, decorator included)
    return "\n\n".join(textwrap.dedent(inspect.getsource(getattr(getattr(found, n), "fn", getattr(found, n))))
                       for n in names)


def _interpreter_cast() -> str:
    """The file's correction of Triton's interpreted fp8 cast: the adapter's own shim, copied in, and its install."""
    return INTERPRETER_CAST + _source_of("_fp8_downcaster", module="backends.sglang.interpreter_shims") + INSTALL_CAST


def _kda_interpreter() -> str:
    """A KDA file's corrections of Triton's CPU interpreter: the adapter's own shims, copied in, and their install."""
    return KDA_INTERPRETER + _source_of("exp", "exp2", "log", "log2", "_mask_values", "_as_bool", "_torch_dtypes",
                                       "_as_torch", "_as_handle", "_bf16_cast", "_bf16_dot", "correct_fla",
                                       "correct_arithmetic", module="backends.sglang.interpreter_shims") + KDA_INSTALL


def _class_at_class(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def write(export: Export, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(export.text, encoding="utf-8")
    written = [out]
    if not export.inline:
        torch.save(export.tensors, out.with_suffix(".pt"))
        written.append(out.with_suffix(".pt"))
    return written


# A pytest plugin for --check --stand-ins: the harness's own stand-ins (backends.sglang.runtime) for packages SGLang
# imports that this machine's install of it lacks (the lent GPU image has no sgl_kernel, SGLang's CUDA wheel tied to
# its torch), installed before the exported file is imported; the project leaves sys.path again at once.
_STAND_INS_PLUGIN = """import sys
sys.path.insert(0, {root!r})
from backends.sglang.runtime import _install_shims
_install_shims()
sys.path.remove({root!r})
"""


def run_exported(path: Path | list[Path], timeout: float = 1800.0, extra: list[str] | None = None,
                 stand_ins: bool = False) -> tuple[int, str]:
    """Run an exported file as its receiver would: a fresh interpreter, in the file's folder, with this project
    off ``sys.path`` (not the working directory, and out of PYTHONPATH, whose other folders stay: on a machine
    where SGLang is an unpacked site folder, that is how it is found). Returns pytest's exit status and output.
    Several files of one folder run in one interpreter (one SGLang import, about 20 s on a CPU, for all of them)."""
    paths = [path] if isinstance(path, Path) else list(path)
    path = paths[0]
    if any(p.parent != path.parent for p in paths):
        raise ValueError("exported files run together must share a folder")
    project = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    kept = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and Path(d).resolve() != project]
    env["COLUMNS"] = "100000"  # pytest trims the short summary to the terminal's width: a check reads it whole
    if stand_ins:
        plugin_dir = path.parent / ".harness-stand-ins"
        plugin_dir.mkdir(exist_ok=True)
        (plugin_dir / "harness_stand_ins.py").write_text(_STAND_INS_PLUGIN.format(root=str(project)))
        kept.insert(0, str(plugin_dir))
        extra = ["-p", "harness_stand_ins", *(extra or [])]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(extra or []),
                           "--rootdir", str(path.parent), *(p.name for p in paths)], cwd=path.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


PREAMBLE = string.Template('''\
"""Reproducer: $title

Engine where the harness found it: $engine. Exported from $exported_on.
Harness case: composition $composition, property $property, mode $mode.
Server configuration that reaches this path: $server.
Triage: $triage
What the harness reported when it found the case:
$verdict
What the harness measured when exporting: $measured.

Run: python -m pytest -q THIS_FILE (needs torch and $needs).
On a CPU, SGLang's Triton kernels run under Triton's interpreter.
Fails while the bug is there; passes once it is fixed. Written by `harness export`; it imports nothing from it.
"""

from __future__ import annotations  # (the harness's checks copied in keep their annotations, never evaluated)

import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import traceback
import types
from pathlib import Path

import pytest
import torch

DEVICE = "$device"  # where the case was recorded
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels interpreted on a CPU
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
elif not torch.cuda.is_available():
    pytest.skip("recorded on a CUDA GPU; none is visible here", allow_module_level=True)
# Packages SGLang imports at import time but never calls on an attention path, where this machine lacks them:
# torchvision (multimodal helpers; it cannot be installed beside a CPU torch), IPython and sniffio, and on a CPU
# sgl_kernel (its CUDA kernels; imported by the host KV pool up to 0.5.13). Inert stand-ins: a call raises.
_ABSENT = {name for name in ("torchvision", "IPython", "sniffio") + (("sgl_kernel",) if DEVICE == "cpu" else ())
           if importlib.util.find_spec(name) is None}
if _ABSENT:
    class _Inert(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Inert(f"{self.__name__}.{name}")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self.__name__} is an inert stand-in: the package is not installed")

        def __mro_entries__(self, bases):
            return (object,)

    class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in _ABSENT:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = _Inert(spec.name)
            module.__version__ = "0.0.0"
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _InertFinder())

''')

# The file's import of one module of SGLang's attention unit-test kit: a release without it skips the file, saying
# so; SGLang failing to import fails it.
KIT_IMPORT = string.Template('''try:
    from sglang.test.kits.attention_unittest.attention_methods import $module as kit
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("sglang.test"):
        raise  # SGLang itself failed to import: not a missing kit
    pytest.skip(f"needs SGLang's $kit (sglang $since or newer): {e}", allow_module_level=True)
''')

OUTPUTS = string.Template('''${kit_import}from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import $forward_batch_names
$speculative_imports
BACKEND = "$backend"
MODE = ForwardMode.$mode_upper
DTYPE = torch.$dtype
PAGE_SIZE = $page_size
PREFIX_LENS = $prefix_lens  # cached tokens per request
NEW_LENS = $new_lens  # tokens this batch adds per request (their queries are the rows of q)
# Each request's draft tree (each draft token's parent, -1 for the root), None: the new tokens follow in order
PARENTS = $parents
SLOTS = $slots  # each request's KV slot for each position (pages renumbered from 1, offsets kept)
RADIX = $radix  # the layer (harness layer $layer_id), as RadixAttention is built
KV_CACHE_DTYPE = "$kv_cache_dtype"  # SGLang's --kv-cache-dtype ("auto": the model's dtype)
K_SCALE, V_SCALE = $kv_scales  # the layer's checkpoint KV scales: an fp8 cache stores k / K_SCALE, v / V_SCALE
# A batch past a limit SGLang's backend has (CROSSED, None: none): SGLang must refuse it (raise) or compute it right.
# A failure leads with ANSWERED: the harness's words for an answer it did not refuse.
CROSSED = $crossed
ANSWERED = $answered
# The bound, as the harness derives it (its properties/tolerances.py), for this layer on this device:
$bound_reason
# The element bound scales with each output element's magnitude m = sum_j p_j |v_j| (the probability-weighted
# size of the values it averages), plus the rounding of its row's scores, which scales with their size
# S = scaling * |q| * max_j |k_j| over the keys the row sees: (ELEMENT_FACTOR + SCORE_FACTOR * S) * m, both computed
# by the float64 reference below.$fp8_note
REL_L2_BOUND = $rel_l2_bound
ELEMENT_FACTOR = $element_factor
SCORE_FACTOR = $score_factor

$data
$speculative$fp8_cache$interpreter_cast
$run_layer_def

def as_stored(x, scale):
    """New keys or values as the KV cache gives them back, in float64: themselves in an auto cache; in an fp8 one,
    divided by the layer's scale, rounded to e4m3 and multiplied back (the model hands them over on that grid, so
    a backend that attends the call's k/v and one that reads the cache back see the same numbers)."""
    if KV_CACHE_DTYPE == "auto":
        return x.double()
    return (x.double() / scale).to(torch.float8_e4m3fn).double() * scale


def visibility(request):
    """Which of a request's keys (its cached ones, then its new ones) each of its new tokens attends before any
    window, and the positions of its queries and its keys. The new tokens follow the cached ones in order, each
    seeing the keys up to its own; in a draft tree (PARENTS) each draft token sits at the cached length plus its
    depth in the tree and sees the cached tokens, itself and its ancestors."""
    cached, new = PREFIX_LENS[request], NEW_LENS[request]
    if PARENTS is None:
        positions = torch.arange(cached + new)
        return positions[None, :] <= positions[cached:, None], positions[cached:], positions
    ancestors = torch.zeros(new, new, dtype=torch.bool)  # [draft token, draft key]: the token and its ancestors
    for token in range(new):
        node = token
        while node >= 0:
            ancestors[token, node] = True
            node = PARENTS[request][node]
    positions = cached + ancestors.sum(dim=1) - 1  # the cached length plus the depth
    attends = torch.cat([torch.ones(new, cached, dtype=torch.bool), ancestors], dim=1)
    return attends, positions, torch.cat([torch.arange(cached), positions])


def reference(q, keys, values, attends, query_positions, key_positions):
    """Float64 attention of one request: softmax(q.k * scaling, capped by logit_cap*tanh(s/logit_cap)) over the
    keys it attends ($window_note); returns the output, each element's m and each row's S."""
    q, keys, values = q.double(), keys.double(), values.double()
    group = RADIX["num_heads"] // RADIX["num_kv_heads"]
    keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, keys) * RADIX["scaling"]
    if RADIX["logit_cap"] > 0:
        scores = RADIX["logit_cap"] * torch.tanh(scores / RADIX["logit_cap"])
    visible = attends.clone()
    if RADIX["sliding_window_size"] >= 0:
        visible &= key_positions[None, :] >= query_positions[:, None] - RADIX["sliding_window_size"]
    p = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    out = torch.einsum("htl,lhd->thd", p, values)
    magnitude = torch.einsum("htl,lhd->thd", p, values.abs())
    seen = torch.where(visible, torch.linalg.vector_norm(keys, dim=-1).T[:, None, :], 0.0).amax(dim=-1)  # [Hq, T]
    sizes = abs(RADIX["scaling"]) * torch.linalg.vector_norm(q, dim=-1) * seen.T  # [T, Hq]
    return out, magnitude, sizes


def $test_name():
    torch.manual_seed(0)
    batch = len(PREFIX_LENS)
    seq_lens = [p + n for p, n in zip(PREFIX_LENS, NEW_LENS)]
    max_context_len = -(-max(seq_lens) // PAGE_SIZE) * PAGE_SIZE
    case = kit.DenseAttentionCase(name="harness_export", backend=BACKEND, forward_mode=MODE,
                                  num_heads=RADIX["num_heads"], num_kv_heads=RADIX["num_kv_heads"],
                                  page_size=PAGE_SIZE, prefix_lens=tuple(PREFIX_LENS), extend_lens=tuple(NEW_LENS),
                                  sliding_window_size=RADIX["sliding_window_size"] if RADIX["sliding_window_size"] >= 0 else None)
    config = kit.TinyModelConfig(num_heads=RADIX["num_heads"], num_kv_heads=RADIX["num_kv_heads"],
                                 head_dim=RADIX["head_dim"], hidden_size=RADIX["num_heads"] * RADIX["head_dim"],
                                 context_len=max_context_len, sliding_window_size=case.sliding_window_size)
    runner = kit.MockModelRunner(case=case, model_config=config, dtype=DTYPE, device=DEVICE,
                                 max_context_len=max_context_len, head_dim=RADIX["head_dim"])
$use_fp8_cache$speculative_runner    backend = $make_backend
    layer = RadixAttention(num_heads=RADIX["num_heads"], head_dim=RADIX["head_dim"], scaling=RADIX["scaling"],
                           num_kv_heads=RADIX["num_kv_heads"], layer_id=0, logit_cap=RADIX["logit_cap"],
                           v_head_dim=RADIX["v_head_dim"], sliding_window_size=RADIX["sliding_window_size"])
    if KV_CACHE_DTYPE == "fp8_e4m3":
        # What SGLang's BaseKVCacheMethod leaves on the layer after loading a checkpoint's KV scales
        # (layers/quantization/kv_cache.py, process_weights_after_loading), on the model's device, where a server's
        # are (TRT-LLM MHA's fused fp8 cache write takes them as device tensors)
        layer.k_scale = torch.nn.Parameter(torch.tensor(K_SCALE, device=DEVICE), requires_grad=False)
        layer.v_scale = torch.nn.Parameter(torch.tensor(V_SCALE, device=DEVICE), requires_grad=False)
        layer.k_scale_float, layer.v_scale_float = K_SCALE, V_SCALE
    forward_batch = kit._make_forward_batch(case, runner, max_context_len=max_context_len, device=DEVICE,
                                            loc_fn=lambda request, position: SLOTS[request][position])
$use_speculative    q, k, v = (TENSORS[name].to(DEVICE) for name in ("q", "k", "v"))
    cached_k, cached_v = TENSORS["cached_k"].to(DEVICE), TENSORS["cached_v"].to(DEVICE)
    cached_slots = torch.tensor([s for r in range(batch) for s in SLOTS[r][:PREFIX_LENS[r]]], dtype=torch.int64,
                                device=DEVICE)
    if cached_slots.numel():  # as they are stored (an fp8 cache's e4m3 values are written unchanged)
        runner.token_to_kv_pool.set_kv_buffer(layer, cached_slots, cached_k, cached_v)
$run_layer
    expected, magnitude, size, token, cached = [], [], [], 0, 0
    for r in range(batch):
        new = slice(token, token + NEW_LENS[r])
        keys = torch.cat([TENSORS["cached_k"][cached:cached + PREFIX_LENS[r]].double() * K_SCALE,
                          as_stored(TENSORS["k"][new], K_SCALE)])
        values = torch.cat([TENSORS["cached_v"][cached:cached + PREFIX_LENS[r]].double() * V_SCALE,
                            as_stored(TENSORS["v"][new], V_SCALE)])
        o, m, s = reference(TENSORS["q"][new], keys, values, *visibility(r))
        expected.append(o)
        magnitude.append(m)
        size.append(s)
        token, cached = token + NEW_LENS[r], cached + PREFIX_LENS[r]
    expected, magnitude, size = torch.cat(expected), torch.cat(magnitude), torch.cat(size)

    assert torch.isfinite(out).all(), "non-finite output"
    diff = (out - expected).abs()
    rel_l2 = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(expected).clamp_min(1e-300)).item()
    allowed = (ELEMENT_FACTOR + SCORE_FACTOR * size[..., None]) * magnitude
    ratio = torch.where(allowed > 0, diff / allowed.clamp_min(1e-300), torch.where(diff > 0, math.inf, 0.0))
    worst = torch.unravel_index(ratio.argmax(), ratio.shape)
    token, head, dim = (int(i) for i in worst)
    starts = [sum(NEW_LENS[:r]) for r in range(batch)]
    request = max(r for r in range(batch) if starts[r] <= token and NEW_LENS[r] > 0)
    where = f"request {request}, token {token - starts[request]}, head {head}, dim {dim}"
    assert rel_l2 <= REL_L2_BOUND, f"{ANSWERED}relative L2 error {rel_l2:.3g} > bound {REL_L2_BOUND:.3g} (worst element at {where}: {out[worst].item():.6g} vs float64 {expected[worst].item():.6g})"
    element, element_bound = diff[worst].item(), allowed[worst].item()
    assert element <= element_bound, f"{ANSWERED}element error {element:.3g} > bound {element_bound:.3g} at {where}: {out[worst].item():.6g} vs float64 {expected[worst].item():.6g}"
''')

# How the file plans the batch and runs its layer: under the backend, or split in two halves under two-batch overlap.
RUN_LAYER = '''
def run_layer(backend, layer, forward_batch, q, k, v):
    """The layer over the batch as a model's forward runs it: SGLang's backend plans the batch, then RadixAttention
    runs under SGLang's forward context (which hands it to the backend). Returns o [T, Hq, Dv] in float64."""
    T = q.shape[0]
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(forward_batch)
        out = layer(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), forward_batch)
    return out.reshape(T, RADIX["num_heads"], RADIX["v_head_dim"]).double().cpu()
'''
TBO_RUN_LAYER = '''
def tbo_backend(runner):
    """What --enable-two-batch-overlap builds: SGLang's TboAttnBackend over the backend, a primary and one child
    per half of a split batch."""
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend

    def make():
        return ATTENTION_BACKENDS[BACKEND](runner)

    return TboAttnBackend(primary=make(), children=[make(), make()])


def run_layer(backend, layer, forward_batch, q, k, v):
    """The layer over the batch as a two-batch-overlap server runs it: SGLang's own splitter cuts the batch
    (compute_split_seq_index, then TboForwardBatchPreparer.prepare: each half a child ForwardBatch), TboAttnBackend
    plans the whole and each half, then each half's layer runs on the half's tokens under the forward context of its
    child backend (batch_overlap/operations.py); a batch SGLang does not split runs whole. Returns o [T, Hq, Dv] in
    float64, the halves' rows in order."""
    from sglang.srt.batch_overlap import two_batch_overlap as tbo

    T = q.shape[0]
    forward_batch.tbo_split_seq_index = tbo.compute_split_seq_index(
        forward_mode=forward_batch.forward_mode, num_tokens=T,
        extend_lens=forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None,
        token_num_per_seq=tbo.get_token_num_per_seq(forward_batch.forward_mode, forward_batch.spec_info))
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        tbo.TboForwardBatchPreparer.prepare(forward_batch)
        backend.init_forward_metadata(forward_batch)
        if not forward_batch.tbo_children:
            out = layer(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), forward_batch)
    if forward_batch.tbo_children:
        outs, start = [], 0
        for half, child in zip(forward_batch.tbo_children, backend.children):
            n = half.input_ids.shape[0]
            with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=child)):
                # (flatten, not reshape(n, -1): a half may hold no token, a decode of one request split in two)
                outs.append(layer(q[start:start + n].flatten(1), k[start:start + n].flatten(1),
                                  v[start:start + n].flatten(1), half))
            start += n
        out = torch.cat(outs)
    return out.reshape(T, RADIX["num_heads"], RADIX["v_head_dim"]).double().cpu()
'''
# How the file runs its layer: an outputs case runs it; a refusal case also takes SGLang's raising as a right answer.
RUN = """    out = run_layer(backend, layer, forward_batch, q, k, v)
"""
REFUSED_OR_RUN = """    try:
        out = run_layer(backend, layer, forward_batch, q, k, v)
    except Exception as e:  # refused, loudly: a server fails on its first such batch instead of answering wrong
        if Path(traceback.extract_tb(e.__traceback__)[-1].filename) == Path(__file__):
            raise  # raised by this file's own code (a release it does not fit), not by SGLang: no refusal
        print(f"refused ({CROSSED}): {type(e).__name__}: {e}")
        return
"""

# A speculative batch: the kit's ForwardBatch made into the one SGLang's EAGLE worker hands over, its spec info
# rebuilt with SGLang's own classes from what the harness handed them (SPEC, and TENSORS' positions and tree).
# (as --speculative-algorithm sets it)
SPECULATIVE_RUNNER = """    runner.spec_algorithm = SpeculativeAlgorithm.$algorithm
"""
USE_SPECULATIVE = """    as_speculative(forward_batch)
"""
TARGET_VERIFY = '''
SPEC = $spec  # SGLang's seq_lens (a verify's: the cached tokens) and its $verify_input's draft tree


def as_speculative(batch):
    """The batch as SGLang's EAGLE worker hands it to the target model for verification (as SGLang's kit builds it,
    speculative_target_verify_runner.py): seq_lens count the cached tokens only, each draft token sits at its
    request's seq_len plus its depth, and spec_info is an $verify_input whose custom mask holds, for each
    request, each draft token's row over its seq_len + draft_token_num keys, flattened."""
    batch.seq_lens = torch.tensor(SPEC["seq_lens"], dtype=torch.int32, device=DEVICE)
    batch.seq_lens_cpu = torch.tensor(SPEC["seq_lens"], dtype=torch.int32)
    batch.seq_lens_sum = sum(SPEC["seq_lens"])
    batch.positions = TENSORS["positions"].to(DEVICE)
    batch.spec_info = $verify_input(
        draft_token=batch.input_ids, custom_mask=TENSORS["custom_mask"].to(DEVICE), positions=batch.positions,
        retrieve_index=TENSORS["retrieve_index"].to(DEVICE),
        retrieve_next_token=TENSORS["retrieve_next_token"].to(DEVICE),
        retrieve_next_sibling=TENSORS["retrieve_next_sibling"].to(DEVICE),
        retrieve_cum_len=TENSORS["retrieve_cum_len"].to(DEVICE), spec_steps=SPEC["spec_steps"], topk=SPEC["topk"],
        draft_token_num=SPEC["draft_token_num"], capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=batch.seq_lens_sum, seq_lens_cpu=batch.seq_lens_cpu)
    batch.spec_algorithm = SpeculativeAlgorithm.$algorithm

'''
NGRAM_VERIFY = '''
SPEC = $spec  # SGLang's seq_lens (a verify's: the cached tokens) and its NgramVerifyInput's draft tree


def as_speculative(batch):
    """The batch as SGLang's n-gram worker hands it to the target model for verification (ngram_worker.py): seq_lens
    count the cached tokens only, each draft token sits at its request's seq_len plus its depth, and spec_info is an
    NgramVerifyInput whose custom mask holds, for each request, each draft token's row over its seq_len +
    draft_token_num keys, flattened."""
    batch.seq_lens = torch.tensor(SPEC["seq_lens"], dtype=torch.int32, device=DEVICE)
    batch.seq_lens_cpu = torch.tensor(SPEC["seq_lens"], dtype=torch.int32)
    batch.seq_lens_sum = sum(SPEC["seq_lens"])
    batch.positions = TENSORS["positions"].to(DEVICE)
    batch.spec_info = NgramVerifyInput(
        draft_token=batch.input_ids, custom_mask=TENSORS["custom_mask"].to(DEVICE), positions=batch.positions,
        retrieve_index=TENSORS["retrieve_index"].to(DEVICE),
        retrieve_next_token=TENSORS["retrieve_next_token"].to(DEVICE),
        retrieve_next_sibling=TENSORS["retrieve_next_sibling"].to(DEVICE), draft_token_num=SPEC["draft_token_num"])
    batch.spec_algorithm = SpeculativeAlgorithm.NGRAM

'''
DFLASH_VERIFY = '''
SPEC = $spec  # SGLang's seq_lens (the committed tokens) and DFlash's block size


def as_speculative(batch):
    """The batch as SGLang's DFlash worker hands the target model a block to verify (dflash_worker_v2.py): on the
    device seq_lens count the committed tokens; the worker widens their host copy (seq_lens_cpu, seq_lens_sum) by
    the block before it plans; spec_info is a DFlashVerifyInput with no custom mask (the block's causal one)."""
    block = SPEC["draft_token_num"]
    batch.seq_lens = torch.tensor(SPEC["seq_lens"], dtype=torch.int32, device=DEVICE)
    batch.seq_lens_cpu = torch.tensor(SPEC["seq_lens"], dtype=torch.int32) + block
    batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    batch.positions = TENSORS["positions"].to(DEVICE)
    batch.spec_info = DFlashVerifyInput(draft_token=batch.input_ids, positions=batch.positions, draft_token_num=block,
                                        custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL)
    batch.spec_algorithm = SpeculativeAlgorithm.DFLASH

'''
DRAFT_EXTEND = '''
SPEC = $spec  # SGLang's seq_lens (counting the accepted tokens) and each request's accepted tokens


def as_speculative(batch):
    """The batch as SGLang's EAGLE worker hands its draft model the tokens the target accepted (DRAFT_EXTEND_V2,
    as SGLang's kit builds it, speculative_draft_extend_runner.py): seq_lens already count them, and spec_info
    is an EagleDraftExtendInput of each request's accepted tokens."""
    accepted = torch.tensor(SPEC["num_accept_tokens"], dtype=torch.int32, device=DEVICE)
    batch.seq_lens = torch.tensor(SPEC["seq_lens"], dtype=torch.int32, device=DEVICE)
    batch.seq_lens_cpu = torch.tensor(SPEC["seq_lens"], dtype=torch.int32)
    batch.seq_lens_sum = sum(SPEC["seq_lens"])
    batch.positions = TENSORS["positions"].to(DEVICE)
    info = EagleDraftExtendInput(
        hidden_states=None, num_correct_drafts=accepted - 1, num_accept_tokens=accepted,
        num_accept_tokens_cpu=list(SPEC["num_accept_tokens"]), input_ids=batch.input_ids, seq_lens=batch.seq_lens,
        seq_lens_cpu=batch.seq_lens_cpu, req_pool_indices=batch.req_pool_indices, positions=batch.positions,
        capture_hidden_mode=CaptureHiddenMode.LAST, num_tokens_per_req=max(SPEC["num_accept_tokens"]),
        num_tokens_for_logprob_per_req=1)
    info.extend_seq_lens_tensor = accepted
    info.extend_seq_lens_cpu = list(SPEC["num_accept_tokens"])
    batch.spec_info = info
    batch.spec_algorithm = SpeculativeAlgorithm.EAGLE

'''
# SGLang's name of each exported mode (the harness's DRAFT_EXTEND is SGLang's DRAFT_EXTEND_V2, see the adapter)
SGLANG_MODE = {"extend": "EXTEND", "decode": "DECODE", "mixed": "MIXED", "target_verify": "TARGET_VERIFY",
               "draft_extend": "DRAFT_EXTEND_V2"}
# Each speculative algorithm's verify input: where SGLang keeps it, and the file's template that builds it
VERIFY_INPUTS = {"eagle": ("eagle_info", "EagleVerifyInput"), "frozen_kv_mtp": ("frozen_kv_mtp_info",
                                                                              "FrozenKVMTPVerifyInput"),
                 "ngram": ("ngram_info", "NgramVerifyInput"), "dflash": ("dflash_info", "DFlashVerifyInput")}


def speculative_template(spec) -> str:
    """The file's ``as_speculative`` for ``spec``'s mode and, in a verify, its algorithm's input."""
    if spec.mode.is_draft_extend():
        return DRAFT_EXTEND
    algorithm = spec.spec.algorithm
    if algorithm == "ngram":
        return NGRAM_VERIFY
    if algorithm == "dflash":
        return DFLASH_VERIFY
    return string.Template(TARGET_VERIFY).safe_substitute(verify_input=VERIFY_INPUTS[algorithm][1])


def speculative_import(spec) -> str:
    """``module import Name`` of the speculative input the file builds."""
    if spec.mode.is_draft_extend():
        return "eagle_info import EagleDraftExtendInput"
    module, name = VERIFY_INPUTS[spec.spec.algorithm]
    return f"{module} import {name}"


# An fp8 e4m3 KV cache: the kit's runner keeps the cache in the model's dtype, so the file swaps SGLang's fp8 pool in.
FP8_CACHE = '''

def use_fp8_cache(runner):
    """SGLang's fp8 e4m3 KV pool, as --kv-cache-dtype fp8_e4m3 builds it, in place of the kit's (in the model's
    dtype), before the backend is built: backends read runner.kv_cache_dtype when they are."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kit_pool = runner.token_to_kv_pool
    runner.kv_cache_dtype, runner.kv_cache_dtype_str = torch.float8_e4m3fn, "fp8_e4m3"
    runner.token_to_kv_pool = MHATokenToKVPool(size=kit_pool.size, page_size=PAGE_SIZE, dtype=torch.float8_e4m3fn,
                                               head_num=RADIX["num_kv_heads"], head_dim=RADIX["head_dim"],
                                               layer_num=1, device=DEVICE, enable_memory_saver=False,
                                               enable_alt_stream=False)
    if hasattr(runner, "kv_index_translator"):  # a release whose runner converts KV ids holds the pool there too
        runner.init_kv_index_translator()
'''
USE_FP8_CACHE = "    use_fp8_cache(runner)\n"
# Triton's interpreter's fp8 cast, corrected as the harness corrects it (the function is copied in from the adapter)
INTERPRETER_CAST = """

# Triton's CPU interpreter casts float32 to fp8 wrongly (Triton 3.8.0, runtime/interpreter.py _convert_float: the
# carry of a mantissa rounded up is ORed into the exponent field, so 1.97 becomes 1.0, not 2.0; ties go away from
# zero), where a GPU rounds to nearest even (cvt.rn.satfinite). SGLang's Triton kernels cast q and the softmax
# probabilities to the cache's fp8 dtype, so interpreted they would show errors a compiled kernel does not make.
# The harness replaces that cast (backends/sglang/interpreter_shims.py, shim 6; upstream triton-lang/triton#8322,
# PR #11897), and so does this file, with the harness's function, copied in:
import triton.language as tl  # noqa: E402 - the copied function reads it as a global


"""
INSTALL_CAST = """

from triton.runtime import interpreter  # noqa: E402

interpreter.InterpreterBuilder.create_fp_to_fp = _fp8_downcaster(interpreter.InterpreterBuilder.create_fp_to_fp)
"""
# A linear-attention file's bounds and their reasons (harness/export_lightning.py, harness/export_kda.py)
LINEAR_BOUNDS = string.Template(
    '''# The output bound, as the harness derives it (its properties/tolerances.py), for this layer on this device:
$bound_reason
# The element bound is ELEMENT_FACTOR times the largest |output| of the layer's float64 reference.
REL_L2_BOUND = $rel_l2_bound
ELEMENT_FACTOR = $element_factor
# $states, against the same float64 reference:
$state_bound_reason
STATE_REL_L2_BOUND = $state_rel_l2_bound
STATE_ELEMENT_FACTOR = $state_element_factor''')
# A linear-attention file's backend: the hybrid as the server builds it (harness/export_lightning.py, export_kda.py)
LINEAR_BUILD = string.Template('''def build_backend(runner):
    """What $server builds (attention_registry.py, attn_backend_wrapper): the full-attention backend it names, the
    linear backend ($linear), and SGLang's hybrid wrapper over them, routing by the full-attention layers."""
    full = ATTENTION_BACKENDS[FULL_BACKEND](runner)
    runner.linear_attn_backends = resolve_linear_attn_backends()
    return HybridLinearAttnBackend(full, $linear(runner), LAYER["full_attn_layers"])''')
# A linear-attention file's check of its outputs and states (harness/export_lightning.py, harness/export_kda.py)
LINEAR_CHECK = '''def check(actual, expected, rel_l2_bound, element_factor, what):
    """``actual`` within the bounds of the float64 ``expected``: relative L2, and each element within
    element_factor * max |expected|."""
    actual = actual.double().cpu()
    assert torch.isfinite(actual).all(), f"{what}: non-finite value"
    if expected.numel() == 0:
        return
    diff = (actual - expected).abs()
    rel_l2 = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(expected).clamp_min(1e-300)).item()
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    allowed = element_factor * expected.abs().max().item()
    at = f"{actual[worst].item():.6g} vs float64 {expected[worst].item():.6g}"
    assert rel_l2 <= rel_l2_bound, \\
        f"{what}: relative L2 error {rel_l2:.3g} > bound {rel_l2_bound:.3g} (worst element at {worst}: {at})"
    assert diff[worst].item() <= allowed, \\
        f"{what}: element error {diff[worst].item():.3g} > bound {allowed:.3g} at {worst}: {at}"
'''
# A KDA file's corrections of Triton's CPU interpreter for the fla kernels SGLang vendors, as the harness makes them
# (backends/sglang/interpreter_shims.py, shims 1, 2, 3, 4, 8 and 9; their functions are copied in after this text)
KDA_INTERPRETER = """
# On a CPU SGLang's fla kernels (its KDA prefill and recurrent step) and its causal conv run under Triton's interpreter,
# which the harness corrects where it cannot run them as a GPU does (backends/sglang/interpreter_shims.py); so does
# this file, with the harness's functions, copied in:
# - fla binds exp/exp2/log/log2 as module-level aliases of triton.language's functions at import (fla/op.py), which
#   the interpreter cannot swap: they become jit functions that call triton.language when interpreted;
# - fla enters torch.<device>.device(index) around each call, absent for a CPU: a null context;
# - triton.autotune benchmarks its configurations, which needs a GPU: the first one is kept;
# - a load/store mask built from a scalar comparison & a tensor (the causal conv's update kernel) reaches the
#   interpreter's C++ helper in a numpy type it refuses: cast to bool;
# - the interpreter keeps bfloat16 values as their uint16 bits, and tl.dot multiplies those bits as integers, and casts
#   between bfloat16 and float16 convert the integer (the KDA chunk kernels cast blocks to bfloat16 before their dots:
#   NaN past 16 tokens): such dots take the float32 values, such casts go through torch;
# - libdevice.exp (fla's KDA gate) is a declaration whose body the interpreter runs as Python: it would return None.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402 - the copied functions read it as a global


"""
KDA_INSTALL = """


def _correct_the_interpreter():
    import importlib
    import pkgutil

    from triton.runtime import interpreter

    fla = importlib.import_module("sglang.kernels.ops.attention.fla")
    for info in pkgutil.walk_packages(fla.__path__, fla.__name__ + "."):  # every module that may copy an alias
        importlib.import_module(info.name)
    correct_fla(fla.__name__)
    correct_arithmetic()
    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = lambda self, ptrs, mask, *rest: masked_load(self, ptrs, _as_bool(mask), *rest)
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: masked_store(self, ptrs, value,
                                                                                      _as_bool(mask), *rest)


_correct_the_interpreter()
"""
# Why an fp8 cache widens no bound: properties/tolerances.py's reasoning, in its words
FP8_NOTE = """
# An fp8 KV cache (fp8_e4m3) adds no tolerance: the rounding of storing is part of the contract, not an error.
# e4m3 keeps 3 mantissa bits, so rounding K and V to it moves the output by several percent, which as an allowance
# would hide most bugs. So the reference attends over exactly the values the cache holds (the cached e4m3 values
# times the layer's scale; the new tokens, handed over on the e4m3 grid, as stored), and the error a correct
# backend may show stays its own arithmetic, under the bound above. (A kernel that also computes in e4m3, rounding
# q and the softmax probabilities to it, is outside that contract.)"""


# The class check of a class-level composition: a test over CLASSES, then the harness's own functions, copied in.
CLASS_CHECKS = """

@pytest.mark.parametrize("class_at", CLASSES, ids=[c[1] for c in CLASSES])
def test_each_class_takes_the_calls_sglang_makes(class_at):
    base, cls = load(BASE), load(class_at)
    problems, _ = class_call_problems(cls, base, [load(f) for f in FORWARDERS], tuple(probed_members()))
    assert not problems, "; ".join(problems)


# From the harness's properties/conformance.py, as it was when this file was written:
"""

CONFORMANCE = string.Template(r'''import ast
import functools
import importlib
import inspect
import re
import textwrap

import sglang

BASE = $base  # SGLang's attention base class: its public members are the protocol
# Each SGLang wrapper as the harness built it for this composition (module, class), the backends under it, the
# members the harness found it does not make reachable (one test each, so a release that fixes one member passes
# that test whatever else it still gets wrong; a wrapper with none listed is checked on every member), and the
# backends whose hasattr-probed members it owes its callers (a prefill/decode split: its prefill backend's, since
# every probed member is read on the prefill or verify path, which it routes there).
WRAPPERS = $wrappers
LEAF = $leaf  # a backend without a wrapper (None when wrapped)
# Classes read where their kernels do not run (module, class), each held to every call SGLang makes of it; and
# SGLang's hybrid wrappers, which pass hasattr-probed calls on to their child with their own parameters.
CLASSES = $classes
FORWARDERS = $forwarders
SERVES_TARGET_VERIFY = $serves_verify  # the leaf must then define update_verify_buffers_to_fill_after_draft


def load(where):
    module, name = where
    return getattr(importlib.import_module(module), name)


def probed_members():
    """The members SGLang's callers look for on an attention backend with hasattr (init_mha_chunk_metadata, ...):
    protocol the base class does not define, read from the installed SGLang's sources."""
    probe = re.compile(r'hasattr\(\s*[\w.()]*attn_backend[\w.()]*\s*,\s*"(\w+)"')
    names = set()
    for path in Path(sglang.__file__).parent.joinpath("srt").rglob("*.py"):
        names.update(probe.findall(path.read_text(encoding="utf-8", errors="replace")))
    return sorted(names)


$assigned_on_instances

def unreachable(wrapper, children, base, member, owners):
    """Why ``member`` of a child is not reachable through ``wrapper`` (None: it is); ``owners``: the children whose
    probed members it owes."""
    copied = assigned_on_instances(wrapper)
    default = inspect.getattr_static(base, member, None)
    if default is not None:  # the base class defines it: an inherited default answers, never a child
        owner = next((c.__name__ for c in children if inspect.getattr_static(c, member, None) is not default), None)
        if owner and inspect.getattr_static(wrapper, member, None) is default and member not in copied:
            return f"{wrapper.__name__} does not make {member} reachable (overridden by {owner}): the {base.__name__} " \
                   f"default answers instead"
        return None
    # Probed with hasattr: an instance also answers through a __getattr__ that delegates to its children
    # (TboAttnBackend's does, from 0.5.15); one is read as delegating
    owner = next((c.__name__ for c in owners if hasattr(c, member) or member in assigned_on_instances(c)), None)
    delegates = getattr(wrapper, "__getattr__", None) is not None
    if owner and not (hasattr(wrapper, member) or member in copied or delegates):
        return f"{wrapper.__name__} has no {member}, which its child {owner} has: SGLang's hasattr-guarded call skips it"
    return None


CHECKS = [(w, kids, m, owners) for w, kids, members, owners in WRAPPERS for m in (members or [None])]
$class_checks


@pytest.mark.parametrize("wrapper_at, children_at, member, owners_at", CHECKS,
                         ids=[f"{w[1]}.{m or 'every-member'}" for w, _, m, _ in CHECKS])
def test_wrapper_reaches_what_its_backends_override(wrapper_at, children_at, member, owners_at):
    base, wrapper, children = load(BASE), load(wrapper_at), [load(c) for c in children_at]
    owners = [load(c) for c in owners_at]
    protocol = sorted(n for n, _ in inspect.getmembers(base) if not n.startswith("_"))
    members = [member] if member else protocol + probed_members()
    problems = [p for m in members if (p := unreachable(wrapper, children, base, m, owners))]
    assert not problems, "; ".join(problems)


@pytest.mark.skipif(LEAF is None or not SERVES_TARGET_VERIFY, reason="no unwrapped backend that serves target_verify")
def test_a_backend_that_serves_verify_defines_its_buffer_refresh():
    # SGLang's overlap plan stream calls this on every speculative verify; the base class raises
    base, leaf, method = load(BASE), load(LEAF), "update_verify_buffers_to_fill_after_draft"
    assert inspect.getattr_static(leaf, method, None) is not inspect.getattr_static(base, method, None), \
        f"{leaf.__name__} serves target_verify but leaves {method} to {base.__name__}, which raises NotImplementedError"
''')
