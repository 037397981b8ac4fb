"""A plan is made from the batch at hand, never kept from an earlier batch of the same shapes.

Backends cache: wrappers planned once per shape, kernel variants picked at plan time, index buffers reused across
batches. A cache keyed on shapes alone hands the next batch of the same shapes the last one's plan, and the answer
is silently wrong (FlashInfer's own reject-or-correct fuzzer found three such bugs in its cuDNN path). So this
property runs two batches through one backend object, as a server does: first another batch of the drawn batch's
shapes (as many requests, tokens and keys, the same layers and weights) that differs from it in everything else,
then the drawn batch:

- its requests in another order (each keeps its lengths, so per-request lengths, trees and images move),
- another page layout (``BatchSpec.kv_layout``), other request rows, other data (another seed),
- the drawn batch's MHA layers' q, k, v handed over as views of one fused projection
  (``engine.model.fused_views``), as a model's ``qkv.split`` makes them, where the first batch's were contiguous.

The drawn batch is moved into the first one's pools (the backend was built over them) and must give its own
reference's outputs and states within the dtype's bound. What a plan keeps legitimately (the model's window,
the cache dtype, the weights) is the same in both batches.
"""

from __future__ import annotations

import dataclasses

from backends.registry import Composition
from batch.case import Case
from batch.forward_batch import ModelRunner
from batch.spec import KV_LAYOUTS, BatchSpec, ImageSpan
from engine.execute import execute
from engine.materialize import materialize
from properties.graph import pool_tensors
from properties.outputs import judge
from properties.run import Run
from properties.verdict import Verdict
from reference.batch import reference_outputs

REPLAN = "replan"


def same_shapes(spec: BatchSpec) -> BatchSpec:
    """Another batch of ``spec``'s shapes: requests rotated by one, the next page layout, another seed."""
    B = spec.batch_size
    order = [(i + 1) % B for i in range(B)]  # request i of the new batch is request order[i] of ``spec``

    def moved(values):
        return tuple(values[j] for j in order)
    changes = dict(prefix_lens=moved(spec.prefix_lens), extend_lens=moved(spec.extend_lens),
                   kv_layout=KV_LAYOUTS[(KV_LAYOUTS.index(spec.kv_layout) + 1) % len(KV_LAYOUTS)],
                   seed=(spec.seed + 1) % 2**31)
    if spec.spec is not None:
        changes["spec"] = dataclasses.replace(spec.spec, parents=moved(spec.spec.parents),
                                              accept_lens=moved(spec.spec.accept_lens))
    if spec.mrope is not None:  # old request r is new request order.index(r) = (r - 1) % B
        images = tuple(ImageSpan((im.request - 1) % B, im.offset, im.t, im.h, im.w) for im in spec.mrope.images)
        changes["mrope"] = dataclasses.replace(spec.mrope, images=images)
    return dataclasses.replace(spec, **changes)


def moved_into(first: Case, second: Case) -> Case:
    """``second`` held in ``first``'s pools and weights: its request rows, state map, KV and state pools copied
    into ``first``'s tensors (the ones the backend was built over), its batch pointing at them."""
    fb1, fb2 = first.forward_batch, second.forward_batch
    pairs = [(fb1.req_to_token, fb2.req_to_token), (fb1.req_to_state_slot, fb2.req_to_state_slot)]
    pools2 = pool_tensors(fb2)
    pairs += [(t, pools2[name]) for name, t in pool_tensors(fb1).items()]
    for into, src in pairs:
        if into.shape != src.shape:  # the harness's own error: same_shapes made a batch of other shapes
            raise AssertionError(f"a batch of the same shapes needs pools of other shapes: {tuple(src.shape)} "
                                 f"into {tuple(into.shape)}")
        into.copy_(src)
    fb = dataclasses.replace(fb2, req_to_token=fb1.req_to_token, req_to_state_slot=fb1.req_to_state_slot,
                             token_to_kv_pool=fb1.token_to_kv_pool, mamba_pool=fb1.mamba_pool)
    return dataclasses.replace(second, forward_batch=fb)


def replan_applies(composition: Composition, mode) -> str | None:
    """Leaves and wrappers directly over leaves: where plans are made and kept (a leaf's own caches; TBO's children
    and hybrid's halves, each planned per batch). A deeper nest adds no plan of its own, only CI time."""
    if any(not child.is_leaf for child in composition.children):
        return "replan runs on leaves and one wrapper over leaves: a nested wrapper keeps no plan of its own"
    return None


def replan_gives_the_new_batch(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    """The batch checked is ``spec`` (so a failure's request and token indices are its own); the batch before it
    is ``same_shapes(spec)``, whose weights both use (one model)."""
    before = same_shapes(spec)
    first = materialize(before, device)
    backend = composition.build(before, ModelRunner.of(first.forward_batch, before.layers))
    try:
        execute(composition, first, backend)
    except Exception as e:
        e.harness_batch = "before"  # a crash of the batch before the drawn one: judged by that batch (Property.before)
        raise
    second = dataclasses.replace(materialize(spec, device), weights=first.weights)
    reference = reference_outputs(second)  # from the batch's own pools, before they move
    second = moved_into(first, second)
    execution = execute(composition, second, backend, fused_qkv=True)
    return judge(REPLAN, Run(second, execution, reference), composition, device,
                 f"after a batch of the same shapes through the same backend (requests in another order, "
                 f"{before.kv_layout} pages, other data), q/k/v as fused views: vs float64 reference")
