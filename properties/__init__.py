"""What must hold, as named properties of (composition, batch specification, device) -> Verdict.

Each entry says which compositions and batches it applies to; the test matrix and the command line take
their rows from ``PROPERTIES`` and ``applies``.
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from backends.base import DRAFTING_MODES, SERVING_MODES
from backends.registry import Composition
from batch.spec import RECURRENT_KINDS, BatchSpec, ForwardMode
from properties.blame import adapter_frame, crash_reason
from properties.cache import cache_writes_exact
from properties.conformance import conformance, dispatch, mode_dispatch
from properties.equivalence import (
    chunked_prefill_equals_whole,
    prefill_then_decode_equals_prefill,
    tbo_split_equals_unsplit,
    verify_chain_equals_extend,
)
from engine.draft_loop import DRAFT_GRAPH_MODES
from engine.graph_runner import GRAPH_MODES, PREFILL_GRAPH_MODES
from properties.graph import graph_plans_satisfy_invariants, graph_replay_equals_eager
from properties.linear_state import verify_commits_every_position
from properties.metadata import metadata_invariants
from properties.outputs import outputs_match_reference
from properties.refusal import REFUSAL, overreach_options, refusal_applies, refuses_or_computes_correctly
from properties.replan import REPLAN, replan_applies, replan_gives_the_new_batch, same_shapes
from properties.tree import tree_branch_equals_chain
from properties.verdict import Verdict

EXTEND_MODES = frozenset({ForwardMode.EXTEND})


@dataclass(frozen=True)
class Property:
    """A named check, the modes whose batches it needs, and the wrappers a composition must contain."""

    name: str
    check: Callable[[Composition, BatchSpec, str], Verdict]
    doc: str
    modes: frozenset[ForwardMode] = SERVING_MODES
    needs_wrapper: str | None = None  # e.g. "tbo": only compositions with that outer wrapper
    excludes_wrapper: str | None = None
    # pd(): a prefill/decode split only routes; a property that exercises one child's own code (its plan, its cache
    # writes, one child's runs compared with each other) is checked by that child's own rows, so it is not repeated
    # under every pair. What a split adds, routing and the handoff between its children, is in outputs (every
    # mode), prefill_then_decode (one child prefills, the other decodes from the cache it wrote), mode_dispatch
    # and conformance.
    per_child: bool = False
    strategy_options: tuple[tuple[str, object], ...] = ()  # extra keyword arguments of batch_specs
    needs_state: bool = False  # only compositions that serve a linear-attention (recurrent) layer kind
    under_graph: bool = False  # also on graph() compositions, its forward replayed in a captured graph
    class_level: bool = False  # needs only the classes (runs on class-level leaves, Capabilities.class_only)
    plan_level: bool = False  # needs only a plan, no kernel (runs on plan-level leaves, Capabilities.plan_only)
    # Rows decided by the composition itself beyond the fields above: (composition, mode) -> why not, or None
    row_applies: Callable[[Composition, ForwardMode], str | None] | None = None
    # Strategy options that depend on the row's composition and mode (merged over strategy_options)
    row_options: Callable[[Composition, ForwardMode], dict] | None = None
    # Draws batches outside the composition's declarations on purpose: a case of it replays though
    # Composition.unsupported_reason names what it crosses
    crosses_declarations: bool = False
    # Each example runs the composition twice, over batches the outputs rows also check once: searched as a slow
    # row where the profile has few examples for those (Profile.slow_row_examples, the ci profile's main job)
    runs_twice: bool = False
    # The batch the check runs through the same backend before the drawn one (replan's), made from the drawn one. A
    # crash there is marked (``details["batch"] == "before"``) and the ledger judges it by that batch, not the drawn.
    before: Callable[[BatchSpec], BatchSpec] | None = None

    def options(self, composition: Composition, mode: ForwardMode) -> dict:
        """Keyword arguments of the strategy this property adds for a row of ``composition`` in ``mode``."""
        return dict(self.strategy_options) | (self.row_options(composition, mode) if self.row_options else {})

    def applies(self, composition: Composition, mode: ForwardMode) -> str | None:
        """None if the property applies to this row, else why not."""
        if mode not in self.modes:
            return f"{self.name} needs {'/'.join(sorted(m.value for m in self.modes))} batches"
        class_only = composition.support().class_only
        if class_only and not self.class_level:
            return f"only its classes are checked: {class_only}"
        plan_only = composition.support().plan_only
        if plan_only and not self.plan_level:
            return f"only its planning runs: {plan_only}"
        if self.needs_state and not composition.attention_kinds() & RECURRENT_KINDS:
            return f"{self.name} needs linear-attention layers"
        outer = self.needs_wrapper in ("tbo", "graph", "pd")
        if outer and composition.name != self.needs_wrapper:
            return f"{self.name} needs a {self.needs_wrapper}() composition"
        if self.needs_wrapper and not outer and self.needs_wrapper not in composition.wrappers():
            return f"{self.name} needs a {self.needs_wrapper} wrapper"
        if composition.name == "graph" and self.needs_wrapper != "graph" and not self.under_graph:
            return "graph() compositions are checked by graph_replay"
        if self.excludes_wrapper and self.excludes_wrapper in composition.wrappers():
            return f"{self.name} does not run on {self.excludes_wrapper} compositions"
        pd = composition.name == "pd" or (composition.name == "graph" and composition.children[0].name == "pd")
        if self.per_child and pd:
            return f"{self.name} exercises one child's own code: checked by each child's own rows, not per pd() pair"
        return self.row_applies(composition, mode) if self.row_applies else None

    def run(self, composition: Composition, spec: BatchSpec, device: str) -> Verdict:
        """Run the check; a crash is a failing verdict that names the exception and where it was raised.

        On CUDA the case ends by waiting for its kernels, whatever its verdict: a kernel fault is reported
        asynchronously, and unless this case asks, the next case's first launch reports it. The device's answer
        is also the one reliable word on whether the context is still usable: a Triton launcher reports a fault
        in its own words ("Triton Error [CUDA]: ..."), and only the synchronize after it says "CUDA error"."""
        try:
            verdict = self.check(composition, spec, device)
        except Exception as e:  # noqa: BLE001 - any crash of a backend under test is a finding
            verdict = Verdict(self.name, False, crash_reason(e), details={"traceback": crash_frames(e)})
            if getattr(e, "harness_batch", None) == "before":
                verdict = dataclasses.replace(verdict, reason=f"{verdict.reason}, running the batch before the drawn "
                                                              f"one", details={**verdict.details, "batch": "before"})
            culprit = adapter_frame(e, composition)
            if culprit is not None:  # the harness's own code failed around an engine's classes: not the engine's bug
                verdict = Verdict(self.name, False, f"adapter error at {culprit}: {verdict.reason}",
                                  details={"adapter_error": culprit, "traceback": verdict.details["traceback"]})
        if device == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a fault of this case's kernels: the context is lost
                before = "" if verdict.ok else f"; before it, the case had failed: {verdict.reason}"
                verdict = dataclasses.replace(verdict, ok=False, reason=crash_reason(e) + before)
        return verdict


def crash_frames(e: BaseException, keep: int = 12) -> list[str]:
    """The innermost ``keep`` frames of a crash, ``path:line in function``, paths from the package folder (a
    replay prints them: the one-line reason names only the innermost frame, which says what failed, not who
    called it wrongly)."""
    frames = traceback.extract_tb(e.__traceback__)[-keep:]
    return [f"{'/'.join(f.filename.split('/')[-3:])}:{f.lineno} in {f.name}" for f in frames]


PROPERTIES: dict[str, Property] = {p.name: p for p in [
    Property("outputs", outputs_match_reference,
             "outputs finite, one row per token, within the dtype bound of the float64 reference; linear states too",
             modes=DRAFTING_MODES),
    Property("metadata", metadata_invariants,
             "planned indptrs, indices, last-page lengths, masks and state slots satisfy the invariants", per_child=True,
             plan_level=True, modes=DRAFTING_MODES),
    Property("cache", cache_writes_exact, "new K/V land exactly at out_cache_loc; no other slot or state changes",
             per_child=True, modes=DRAFTING_MODES),
    Property("conformance", conformance,
             "every protocol method exists, accepts the canonical call, and wrappers delegate it",
             modes=frozenset({ForwardMode.EXTEND}), class_level=True, plan_level=True),
    Property("dispatch", dispatch, "full layer ids reach the full backend, the others the linear backend",
             modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE}), needs_wrapper="hybrid"),
    Property("mode_dispatch", mode_dispatch,
             "a prefill/decode split plans and runs each batch on the backend configured for its mode, only there",
             needs_wrapper="pd"),
    Property("tbo_split", tbo_split_equals_unsplit, "joining the TBO children's outputs gives the unsplit output",
             modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY}), needs_wrapper="tbo"),
    Property("chunked_prefill", chunked_prefill_equals_whole, "extend e1 then e2 equals one extend of e1+e2",
             modes=EXTEND_MODES, excludes_wrapper="tbo", per_child=True),
    Property("prefill_then_decode", prefill_then_decode_equals_prefill, "extend n then decode 1 equals extend n+1",
             modes=EXTEND_MODES, excludes_wrapper="tbo"),
    Property("verify_chain", verify_chain_equals_extend,
             "verify of a chain equals extend of its tokens; the committed state is the accepted prefix's",
             modes=frozenset({ForwardMode.TARGET_VERIFY}), excludes_wrapper="tbo", per_child=True,
             strategy_options=(("chain", True),)),
    Property("verify_commit", verify_commits_every_position,
             "after one verify, committing any accepted position (and the radix cache's tracked copies) leaves "
             "each request's state slot holding the reference state there; nothing else changes",
             modes=frozenset({ForwardMode.TARGET_VERIFY}), needs_state=True,
             # TBO commits through its primary, whose plan is the whole batch: left out to keep CI's time
             excludes_wrapper="tbo", under_graph=True,
             strategy_options=(("chain", True), ("require_recurrent", True))),
    Property("tree_branch", tree_branch_equals_chain,
             "every draft-tree node's output equals its root-to-node branch extended as a chain (no reference)",
             modes=frozenset({ForwardMode.TARGET_VERIFY}), excludes_wrapper="tbo", per_child=True,
             strategy_options=(("tree", True),)),
    Property("graph_replay", graph_replay_equals_eager,
             "CUDA-graph replay equals eager on real rows (padding poisoned), pools end identical, new inputs "
             "give new outputs", modes=GRAPH_MODES | PREFILL_GRAPH_MODES | DRAFT_GRAPH_MODES, needs_wrapper="graph",
             # A graph holds a fixed number of tokens per request: draft extends of the whole draft window.
             strategy_options=(("fixed_width", True),)),
    Property("graph_metadata", graph_plans_satisfy_invariants,
             "every plan a graph makes, at capture and at a replay padded to the captured size, satisfies the "
             "metadata invariants, padded rows included (no layer runs)", modes=GRAPH_MODES | DRAFT_GRAPH_MODES,
             needs_wrapper="graph",
             strategy_options=(("fixed_width", True),), plan_level=True, per_child=True),
    Property(REPLAN, replan_gives_the_new_batch,
             "one backend object, then a second batch of the same shapes (requests reordered, other pages, rows, "
             "data, q/k/v as fused views): the second's outputs and states are its own, not a stale plan's",
             modes=frozenset(SERVING_MODES) - {ForwardMode.IDLE}, per_child=True, row_applies=replan_applies,
             runs_twice=True, before=same_shapes),
    Property(REFUSAL, refuses_or_computes_correctly,
             "a batch past one limit the backend declares (soft-cap, window, fp8 cache or its KV scales) "
             "is refused with an error or computed within the bound, never answered wrong", modes=DRAFTING_MODES,
             row_applies=refusal_applies, row_options=overreach_options, crosses_declarations=True),
]}
