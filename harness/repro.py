"""Replaying a case file: rerun its property and show where the outputs differ."""

from __future__ import annotations

from pathlib import Path

import torch

from backends.registry import parse
from harness.options import UsageError
from properties import PROPERTIES
from properties.run import run_case
from properties.tolerances import layer_bound, widen_for_cancellation
from properties.verdict import CHECK_WORDS, compare, token_starts
from search import ledger
from search.casefile import CaseFile


def describe(spec) -> str:
    def heads(l) -> str:
        if l.kind != "mha":
            return f"{l.kind}#{l.layer_id}"
        extras = [f"window {l.sliding_window}"] if l.sliding_window else []
        extras += [f"logit cap {l.logit_cap:g}"] if l.logit_cap else []
        extras += [f"kv scales {l.k_scale:g}/{l.v_scale:g}"] if spec.kv_cache_dtype != "auto" else []
        return f"{l.kind}#{l.layer_id} {l.num_q_heads}/{l.num_kv_heads}x{l.head_dim}" + \
            (f" ({', '.join(extras)})" if extras else "")
    layers = ", ".join(heads(l) for l in spec.layers)
    cache = f", {spec.kv_cache_dtype} cache" if spec.kv_cache_dtype != "auto" else ""
    return (f"{spec.mode.value}, {spec.batch_size} request(s), prefix {list(spec.prefix_lens)}, "
            f"extend {list(spec.extend_lens)}, page {spec.page_size} ({spec.kv_layout}), {spec.dtype}{cache}, "
            f"layers [{layers}]")


def replay(case: CaseFile, device: str, dump_dir: Path | None, known_passes: bool = False) -> int:
    """Replay ``case`` and print where it differs; the exit status is 1 if it fails (0 for a failure a ledger entry
    explains when ``known_passes``: a replay alone asks whether the case has a bug no entry explains)."""
    composition = parse(case.composition)
    if case.property not in PROPERTIES:
        raise UsageError(f"case names unknown property {case.property!r}; known: {', '.join(PROPERTIES)}")
    reason = composition.unavailable_reason(device) or \
        (None if PROPERTIES[case.property].crosses_declarations else composition.unsupported_reason(case.spec))
    if reason:
        raise UsageError(f"cannot replay {case.composition} here: {reason}")
    print(f"composition: {case.composition}\nproperty:    {case.property}\nbatch:       {describe(case.spec)}")
    verdict = PROPERTIES[case.property].run(composition, case.spec, device)
    print(f"verdict:     {verdict}")
    known = None if verdict.ok else ledger.match(case.composition, case.spec.mode.value, case.property, case.spec,
                                                 verdict, device)
    if known is not None:
        print(f"known:       {known.id} (docs/findings/known-failures.toml)")
    status = 0 if verdict.ok or (known is not None and known_passes) else 1
    for frame in verdict.details.get("traceback", ()):
        print(f"  at {frame}")
    if known_passes:
        return status  # the verdict is the answer asked for: no per-layer diff (a second run of the case)
    try:
        run = run_case(composition, case.spec, device)
    except Exception as e:  # noqa: BLE001 - the verdict above already reported it
        print(f"(no per-layer diff: the plain run crashed with {type(e).__name__}: {e})")
        return status
    starts = token_starts(case.spec)
    print(f"{'layer':>6} {'rel_l2':>10} {'bound':>10} {'element':>10} {'bound':>10}  element nearest its bound")
    for layer, out, ref in zip(case.spec.layers, run.execution.outputs, run.reference.outputs):
        bound = widen_for_cancellation(layer_bound(composition, case.spec, layer, device), ref,
                                       run.reference.magnitudes.get(layer.layer_id))
        c = compare(out, ref, bound, starts, scale=run.reference.element_scales.get(layer.layer_id),
                    score_size=run.reference.score_sizes.get(layer.layer_id))
        failed = [CHECK_WORDS[check] for check, ratio in c.ratios().items() if ratio > 1.0]
        print(f"{layer.layer_id:>6} {c.rel_l2:>10.3e} {bound.rel_l2:>10.3e} {c.element_error:>10.3e} "
              f"{c.element_bound:>10.3e}  {c.where}{'  <-- ' + ', '.join(failed) + ' out of bounds' if failed else ''}")
    if dump_dir is not None:
        try:
            dump_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"spec": case.spec.to_json(), "outputs": [o.cpu() for o in run.execution.outputs],
                        "reference": [r.cpu() for r in run.reference.outputs],
                        "inputs": [{k: t.cpu() for k, t in i.tensors.items()} for i in run.case.inputs]},
                       dump_dir / "tensors.pt")
        except OSError as e:  # checked before the replay; this is what the check cannot foresee (a full disk)
            raise UsageError(f"--dump {dump_dir}: cannot write there: {e.strerror or e}") from None
        print(f"tensors saved to {dump_dir / 'tensors.pt'}")
    return status
