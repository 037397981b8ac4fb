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

A class-level composition (``sglang.trtllm_mla``, ``tbo(sglang.trtllm_mha)``: backends/sglang/classes.py) is never
built: its file runs the harness's class check itself (``class_call_problems``, copied in from
properties/conformance.py when the file is written) on the same classes, and the wrapper check on the members the
harness found hidden.

What it covers today (anything else is refused with one line, exit 2): the ``outputs`` property of a plain
dense SGLang leaf (``sglang.torch_native``, ``sglang.triton``, ``sglang.flashinfer``) in EXTEND, DECODE or MIXED,
with an ``auto`` KV cache; the ``conformance`` property of any SGLang composition, class-level ones included. The other kinds named by
issue 27 (metadata invariants, graph replay, TBO splits, linear attention, MLA, verify trees) are not exported yet.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.options import UsageError

# The SGLang leaves whose classes SGLang's kit builds from a DenseAttentionCase: their attention-backend names
DENSE_LEAVES = {"sglang.torch_native": "torch_native", "sglang.triton": "triton", "sglang.flashinfer": "flashinfer"}
PROPERTIES = ("outputs", "conformance")
MODES = ("extend", "decode", "mixed")
# Up to this many tensor elements the data is written into the file itself; above, into one .pt beside it.
INLINE_ELEMENTS = 4096
# The first SGLang release whose wheel ships the attention unit-test kit the file builds with.
KIT_SINCE = "0.5.14"
# Where a server reaches each leaf: the flag that selects it.
SERVER_FLAG = {"torch_native": "--attention-backend torch_native", "triton": "--attention-backend triton",
               "flashinfer": "--attention-backend flashinfer"}


def exportable_reason(composition: str, prop: str, mode: str, kv_cache_dtype: str) -> str | None:
    """Why a case of this kind cannot be exported (yet), or None."""
    if prop == "conformance":
        if "sglang." not in composition or composition.startswith("graph("):
            return f"export covers the conformance of SGLang's own classes, not {composition}"
        return None
    if composition not in DENSE_LEAVES:
        return (f"export covers the plain dense SGLang leaves ({', '.join(DENSE_LEAVES)}), not {composition} "
                f"(wrappers, MLA and linear attention are not exported yet)")
    if prop not in PROPERTIES:
        return f"export covers the {', '.join(PROPERTIES)} property, not {prop}"
    if mode not in MODES:
        return f"export covers {', '.join(MODES)} batches, not {mode} (verify trees and draft extends are not yet)"
    if kv_cache_dtype != "auto":
        return f"export covers an auto KV cache, not {kv_cache_dtype}"
    return None


@dataclass
class LayerCall:
    """What SGLang was handed for one layer of one batch."""

    layer_id: int
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D], the batch's new tokens
    v: torch.Tensor  # [T, Hk, Dv]
    radix: dict  # RadixAttention's constructor arguments as the adapter passed them
    slots: list[list[int]]  # each request's KV slot per position (its req_to_token row up to its length)
    cached_k: list[torch.Tensor]  # each request's keys at its cached positions, read from the pool before the layer
    cached_v: list[torch.Tensor]


@dataclass
class Recorder:
    """Listens at ``SglangBackend._run`` (the adapter's call into SGLang) and keeps each layer's first call."""

    calls: dict[int, LayerCall] = field(default_factory=dict)

    @contextmanager
    def listening(self, prefix_lens: list[int]):
        from unittest import mock

        from backends.sglang.adapter import SglangBackend

        original = SglangBackend._run
        recorder = self

        def _run(backend, q, k, v, layer, forward_batch, save_kv_cache, via=None):
            if layer.layer_id not in recorder.calls and layer.kind == "mha":
                sfb = backend.batches[id(forward_batch)]
                runner = backend.sgl_runner
                seq_lens = [int(n) for n in sfb.seq_lens_cpu[:sfb.batch_size].tolist()]
                rows = sfb.req_pool_indices[:sfb.batch_size].tolist()
                table = runner.req_to_token_pool.req_to_token
                slots = [table[r, :n].tolist() for r, n in zip(rows, seq_lens)]
                pool = runner.token_to_kv_pool
                kbuf, vbuf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
                cached = [torch.tensor(s[:p], dtype=torch.int64, device=kbuf.device) for s, p in zip(slots, prefix_lens)]
                radix = backend._layer(layer)
                recorder.calls[layer.layer_id] = LayerCall(
                    layer.layer_id, q.detach().cpu().clone(), k.detach().cpu().clone(), v.detach().cpu().clone(),
                    {"num_heads": radix.tp_q_head_num, "num_kv_heads": radix.tp_k_head_num,
                     "head_dim": radix.head_dim, "v_head_dim": radix.v_head_dim, "scaling": float(radix.scaling),
                     "logit_cap": float(radix.logit_cap or 0.0),
                     "sliding_window_size": int(radix.sliding_window_size)},
                    slots, [kbuf[c].cpu().clone() for c in cached], [vbuf[c].cpu().clone() for c in cached])
            return original(backend, q, k, v, layer, forward_batch, save_kv_cache, via)

        with mock.patch.object(SglangBackend, "_run", _run):
            yield self


@dataclass
class Export:
    """One exported case: the pytest file's text and the tensors it loads."""

    text: str
    tensors: dict[str, torch.Tensor]
    inline: bool
    failed: bool  # whether the harness's replay, at export, failed the case's check
    summary: str  # what it measured there, one line


def _compact_slots(slots: list[list[int]], page_size: int) -> list[list[int]]:
    """The same slot layout with the pages renumbered 1, 2, ... in order of first use (page 0 stays SGLang's
    padding page), so it fits the pool SGLang's kit allocates; offsets inside a page and which positions share a
    page are kept."""
    pages: dict[int, int] = {}
    out = []
    for row in slots:
        new_row = []
        for slot in row:
            page, offset = divmod(slot, page_size)
            new_row.append(pages.setdefault(page, len(pages) + 1) * page_size + offset)
        out.append(new_row)
    return out


def _server_configuration(name: str, spec, radix: dict) -> str:
    parts = [f"python -m sglang.launch_server {SERVER_FLAG[name]}"]
    if spec.page_size > 1:
        parts.append(f"--page-size {spec.page_size}")
    model = [f"{radix['num_heads']} query / {radix['num_kv_heads']} KV heads of dim {radix['head_dim']}",
             f"dtype {spec.dtype}"]
    if radix["sliding_window_size"] >= 0:
        model.append(f"sliding window {radix['sliding_window_size']} (a Gemma-2/Mistral-style SWA layer)")
    if radix["logit_cap"]:
        model.append(f"attention logit soft-cap {radix['logit_cap']:g} (Gemma-2/Grok-style)")
    step = {"decode": "a decode step", "extend": "a prefill (extend) step", "mixed": "a mixed prefill+decode step "
            "(--enable-mixed-chunk)"}[spec.mode.value]
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
    reason = exportable_reason(case.composition, case.property, spec.mode.value, spec.kv_cache_dtype)
    if reason:
        raise UsageError(f"cannot export {case.composition} {case.property}: {reason}")
    composition = parse(case.composition)
    why = composition.unavailable_reason(device) or composition.unsupported_reason(spec)
    if why:
        raise UsageError(f"cannot replay {case.composition} here to record SGLang's inputs: {why}")
    if case.property == "conformance":
        return _build_conformance(case, composition, device, case_path)
    return _build_outputs(case, composition, device, case_path)


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


def _build_outputs(case, composition, device: str, case_path: Path | None) -> Export:
    from properties.run import run_case
    from properties.tolerances import layer_bound, widen_for_cancellation
    from properties.verdict import compare, token_starts

    spec = case.spec
    recorder = Recorder()
    prefix_lens = list(spec.prefix_lens)  # the cached tokens of each request (a decode's too)
    with recorder.listening(prefix_lens):
        run = run_case(composition, spec, device)
    # The layer to hand over: the one furthest out of (or nearest to) its bound, as the property measured it
    starts = token_starts(spec)
    measured = {}
    for layer, out, ref in zip(spec.layers, run.execution.outputs, run.reference.outputs):
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
    name = DENSE_LEAVES[case.composition]
    slots = _compact_slots(call.slots, spec.page_size)
    seq_lens = [len(s) for s in slots]
    new_lens = [n - p for n, p in zip(seq_lens, prefix_lens)]
    tensors = {"q": call.q, "k": call.k, "v": call.v,
               "cached_k": torch.cat(call.cached_k) if call.cached_k else call.k[:0],
               "cached_v": torch.cat(call.cached_v) if call.cached_v else call.v[:0]}
    inline = sum(t.numel() for t in tensors.values()) <= INLINE_ELEMENTS
    window = call.radix["sliding_window_size"]
    data_source = "\n".join(_tensor_source(k, t) for k, t in tensors.items()) if inline else None
    failed = [w for w, (value, limit) in (("relative L2 error", (comparison.rel_l2, bound.rel_l2)),
                                          ("element error", (comparison.element_error, comparison.element_bound)))
              if value > limit]
    headline = (f"{failed[0]} out of bounds at layer {layer_id}: {comparison.where}" if failed
                else f"within bounds on this engine (worst at {max(comparison.ratios().values()):.2f} of a bound)")
    measured_text = (f"rel_l2 {comparison.rel_l2:.3g} (bound {bound.rel_l2:.3g}), element "
                     f"{comparison.element_error:.3g} (bound {comparison.element_bound:.3g}) at "
                     f"{comparison.where or 'nowhere'}")
    header = _header(case, device, case_path, headline, _server_configuration(name, spec, call.radix),
                     f"on the layer below, {measured_text}",
                     f"SGLang {KIT_SINCE} or newer, whose wheel ships the attention unit-test kit this file builds "
                     f"with")
    text = header + OUTPUTS.substitute(
        kit_since=KIT_SINCE, backend=name, mode_upper=spec.mode.value.upper(), dtype=spec.dtype,
        page_size=spec.page_size, prefix_lens=prefix_lens, new_lens=new_lens, slots=json.dumps(slots),
        radix=json.dumps(call.radix), layer_id=layer_id, rel_l2_bound=repr(bound.rel_l2),
        element_factor=repr(bound.element), score_factor=repr(bound.score),
        bound_reason=textwrap.fill(bound.reason, 106, initial_indent="# ", subsequent_indent="# "),
        window_note=("a key at position j is visible from a query at position p when p - W <= j <= p"
                     if window >= 0 else "no sliding window"),
        data=("TENSORS = {\n" + data_source + "\n}" if inline else
              "TENSORS = torch.load(Path(__file__).with_suffix('.pt'))  # the tensors, beside this file"),
    )
    return Export(text, {k: t.contiguous() for k, t in tensors.items()}, inline, bool(failed),
                  f"layer {layer_id}: {measured_text}")


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
    if composition.support().class_only:
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


def _source_of(*names: str) -> str:
    """The source of functions of properties/conformance.py, to be copied into an exported file (which must not
    import this project), so the file runs the harness's own checks, not a copy that could drift."""
    import importlib
    import inspect

    module = importlib.import_module("properties.conformance")  # the module: the package exports a function of its name
    return "\n\n".join(textwrap.dedent(inspect.getsource(getattr(module, n))) for n in names)


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

import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
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

OUTPUTS = string.Template('''try:
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("sglang.test"):
        raise  # SGLang itself failed to import: not a missing kit
    pytest.skip(f"needs SGLang's attention unit-test kit (sglang $kit_since or newer): {e}", allow_module_level=True)
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode

BACKEND = "$backend"
MODE = ForwardMode.$mode_upper
DTYPE = torch.$dtype
PAGE_SIZE = $page_size
PREFIX_LENS = $prefix_lens  # cached tokens per request
NEW_LENS = $new_lens  # tokens this batch adds per request (their queries are the rows of q)
SLOTS = $slots  # each request's KV slot for each position (pages renumbered from 1, offsets kept)
RADIX = $radix  # the layer (harness layer $layer_id), as RadixAttention is built
# The bound, as the harness derives it (its properties/tolerances.py), for this layer on this device:
$bound_reason
# The element bound scales with each output element's magnitude m = sum_j p_j |v_j| (the probability-weighted
# size of the values it averages), plus the rounding of its row's scores, which scales with their size
# S = scaling * |q| * max_j |k_j| over the keys the row sees: (ELEMENT_FACTOR + SCORE_FACTOR * S) * m, both computed
# by the float64 reference below.
REL_L2_BOUND = $rel_l2_bound
ELEMENT_FACTOR = $element_factor
SCORE_FACTOR = $score_factor

$data


def reference(q, keys, values, query_positions):
    """Float64 attention of one request: softmax(q.k * scaling, capped by logit_cap*tanh(s/logit_cap)) over the
    keys it sees ($window_note), causal by position; returns the output, each element's m and each row's S."""
    q, keys, values = q.double(), keys.double(), values.double()
    group = RADIX["num_heads"] // RADIX["num_kv_heads"]
    keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, keys) * RADIX["scaling"]
    if RADIX["logit_cap"] > 0:
        scores = RADIX["logit_cap"] * torch.tanh(scores / RADIX["logit_cap"])
    key_pos = torch.arange(keys.shape[0])
    visible = key_pos[None, :] <= query_positions[:, None]
    if RADIX["sliding_window_size"] >= 0:
        visible &= key_pos[None, :] >= query_positions[:, None] - RADIX["sliding_window_size"]
    p = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    out = torch.einsum("htl,lhd->thd", p, values)
    magnitude = torch.einsum("htl,lhd->thd", p, values.abs())
    seen = torch.where(visible, torch.linalg.vector_norm(keys, dim=-1).T[:, None, :], 0.0).amax(dim=-1)  # [Hq, T]
    sizes = abs(RADIX["scaling"]) * torch.linalg.vector_norm(q, dim=-1) * seen.T  # [T, Hq]
    return out, magnitude, sizes


def test_outputs_match_float64_attention():
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
    backend = ATTENTION_BACKENDS[BACKEND](runner)
    layer = RadixAttention(num_heads=RADIX["num_heads"], head_dim=RADIX["head_dim"], scaling=RADIX["scaling"],
                           num_kv_heads=RADIX["num_kv_heads"], layer_id=0, logit_cap=RADIX["logit_cap"],
                           v_head_dim=RADIX["v_head_dim"], sliding_window_size=RADIX["sliding_window_size"])
    forward_batch = kit._make_forward_batch(case, runner, max_context_len=max_context_len, device=DEVICE,
                                            loc_fn=lambda request, position: SLOTS[request][position])
    q, k, v = (TENSORS[name].to(DEVICE) for name in ("q", "k", "v"))
    cached_k, cached_v = TENSORS["cached_k"].to(DEVICE), TENSORS["cached_v"].to(DEVICE)
    cached_slots = torch.tensor([s for r in range(batch) for s in SLOTS[r][:PREFIX_LENS[r]]], dtype=torch.int64,
                                device=DEVICE)
    if cached_slots.numel():
        runner.token_to_kv_pool.set_kv_buffer(layer, cached_slots, cached_k, cached_v)
    T = q.shape[0]
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(forward_batch)
        out = layer(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), forward_batch)
    out = out.reshape(T, RADIX["num_heads"], RADIX["v_head_dim"]).double().cpu()

    expected, magnitude, size, token, cached = [], [], [], 0, 0
    for r in range(batch):
        new = slice(token, token + NEW_LENS[r])
        keys = torch.cat([TENSORS["cached_k"][cached:cached + PREFIX_LENS[r]], TENSORS["k"][new]])
        values = torch.cat([TENSORS["cached_v"][cached:cached + PREFIX_LENS[r]], TENSORS["v"][new]])
        positions = torch.arange(PREFIX_LENS[r], seq_lens[r])
        o, m, s = reference(TENSORS["q"][new], keys, values, positions)
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
    assert rel_l2 <= REL_L2_BOUND, f"relative L2 error {rel_l2:.3g} > bound {REL_L2_BOUND:.3g} (worst element at {where}: {out[worst].item():.6g} vs float64 {expected[worst].item():.6g})"
    element, element_bound = diff[worst].item(), allowed[worst].item()
    assert element <= element_bound, f"element error {element:.3g} > bound {element_bound:.3g} at {where}: {out[worst].item():.6g} vs float64 {expected[worst].item():.6g}"
''')

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
