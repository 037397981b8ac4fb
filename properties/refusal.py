"""Refuse or compute correctly: a batch just past what a backend declares must be refused, never answered wrong.

A serving engine's scheduler hands a backend whatever the model and the server's flags make: a soft-capped model
(Gemma 2, Grok) to a backend that has no soft-cap, an fp8 cache with per-layer scales to one that never reads
them, a sliding-window model to one whose masks know no window. Nothing between the scheduler and the kernel
checks the backend's limits. A backend that meets a batch it cannot compute must raise (the server then fails
loudly on its first such batch); returning an answer it did not compute is the silent-garbage bug class. So each
row of this property draws batches that cross one limit its backend declares (``OVERREACHES``: the matrix's
other rows never draw them) and accepts two outcomes: a raised error, or outputs within the dtype's bound of the
float64 reference. Only the third, an answer without a refusal that is wrong, fails.

Rows are the leaves' own: a wrapper's limits are its leaves' (``Support.of``), and what a wrapper adds is checked by
the wrapper's other rows. An error raised by the harness's own code around an engine's classes stays an adapter
error (``Property.run``), never a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from backends.base import Support
from backends.registry import Composition
from batch.spec import BatchSpec, ForwardMode
from engine.execute import execute
from engine.materialize import materialize
from properties.blame import adapter_frame, crash_reason
from properties.outputs import judge
from properties.run import Run
from properties.verdict import Verdict
from reference.batch import reference_outputs

REFUSAL = "refuse_or_correct"
_COMPUTING = frozenset(m for m in ForwardMode if m is not ForwardMode.IDLE)  # an idle batch computes nothing


@dataclass(frozen=True)
class Overreach:
    """One declared limit a batch can cross, and the batches that can cross it."""

    name: str
    modes: frozenset[ForwardMode]
    limited: Callable[[Support], bool]  # the composition declares the limit

    def crossable(self, support: Support, mode: ForwardMode) -> bool:
        # Every limit here is of MHA layers (an MLA model is handed neither a soft-cap, a window nor an fp8 cache)
        return mode in self.modes and "mha" in support.attention_kinds and self.limited(support)


# Each with the model or server flag that hands such a batch to the backend
OVERREACHES: dict[str, Overreach] = {o.name: o for o in [
    # a model with soft-capped attention logits (Gemma 2, Grok: RadixAttention's logit_cap)
    Overreach("logit_cap", _COMPUTING, lambda s: not s.logit_cap),
    # a model with sliding-window layers (Gemma 2/3, Mistral-style SWA, gpt-oss)
    Overreach("sliding_window", _COMPUTING, lambda s: not s.sliding_window),
    # a sliding-window model served with EAGLE draft trees (--speculative-eagle-topk above 1)
    Overreach("verify_window", frozenset({ForwardMode.TARGET_VERIFY}),
              lambda s: s.sliding_window and not s.verify_window),
    # a sliding-window draft model in the draft loop (EAGLE with a windowed draft, or an EAGLE3 draft under
    # --speculative-draft-window-size, which sets its layers' window)
    Overreach("draft_window", frozenset({ForwardMode.DRAFT_DECODE}),
              lambda s: s.sliding_window and not s.draft_window),
    # --kv-cache-dtype fp8_e4m3 (or a checkpoint whose kv_cache_quant_algo is FP8); models without MLA layers
    Overreach("fp8_kv_cache", _COMPUTING,
              lambda s: "fp8_e4m3" not in s.kv_cache_dtypes and "mla" not in s.attention_kinds),
    # the same with a checkpoint's per-layer KV scales (RadixAttention.k_scale / v_scale)
    Overreach("kv_scales", _COMPUTING,
              lambda s: not s.kv_scales and "fp8_e4m3" in s.kv_cache_dtypes and "mla" not in s.attention_kinds),
]}


def overreaches(composition: Composition, mode: ForwardMode) -> tuple[str, ...]:
    """The limits ``composition`` declares that a batch of ``mode`` can cross (empty for a wrapper: its leaves'
    rows check them)."""
    if not composition.is_leaf:
        return ()
    support = composition.support()
    return tuple(name for name, o in OVERREACHES.items() if o.crossable(support, mode))


def refusal_applies(composition: Composition, mode: ForwardMode) -> str | None:
    if not composition.is_leaf:
        return "a wrapper's limits are its leaves': each leaf's own rows cross them"
    if not overreaches(composition, mode):
        return f"declares no limit a {mode.value} batch can cross (OVERREACHES)"
    return None


def overreach_options(composition: Composition, mode: ForwardMode) -> dict:
    return {"overreach": overreaches(composition, mode)}


def refuses_or_computes_correctly(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    crossed = composition.unsupported_reason(spec)
    if crossed is None:
        return Verdict(REFUSAL, True, "the batch stays inside the declarations (nothing to refuse)")
    case = materialize(spec, device)
    reference = reference_outputs(case)
    try:
        execution = execute(composition, case)
    except Exception as e:  # noqa: BLE001 - a refusal is one of the two right outcomes
        if adapter_frame(e, composition) is not None:
            raise  # the harness's own code failed: Property.run reports it as an adapter error
        return Verdict(REFUSAL, True, f"refused ({crossed}): {crash_reason(e).removeprefix('crashed: ')}")
    return judge(REFUSAL, Run(case, execution, reference), composition, device,
                 f"answered without refusing ({crossed}); outputs vs float64 reference")
