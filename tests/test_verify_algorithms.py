"""The speculative algorithms a target verify is drawn for (batch.spec.VERIFY_ALGORITHMS): EAGLE's, frozen-KV MTP's,
n-gram's and DFlash's verify inputs, each built as its worker builds it, and what a backend that takes one for
another gets wrong."""

from __future__ import annotations

import pytest
import torch

from backends.registry import parse
from batch.forward_batch import ModelRunner
from batch.spec import VERIFY_ALGORITHMS, BatchSpec, ForwardMode, MHALayer, SpecError, SpecInput
from engine.materialize import materialize
from harness.mutants.catalogue import SGLANG_CATALOGUE
from properties import PROPERTIES
from search.matrix import strategy_options
from search.profiles import PROFILES

MHA = MHALayer(0, 4, 2, 32, 32)
TREE = (-1, 0, 0, 1)  # two children of the root, one grandchild
CHAIN = (-1, 0, 1, 2)


def verify(algorithm: str, tree=TREE, prefix=(9, 14), topk=2) -> BatchSpec:
    steps = max(1, len(tree) - 1) if algorithm == "ngram" else 2 if tree == TREE else 3
    return BatchSpec(ForwardMode.TARGET_VERIFY, prefix, (len(tree),) * len(prefix), (MHA,),
                     spec=SpecInput(len(tree), 1 if tree == CHAIN else topk, steps, (tree,) * len(prefix),
                                    (2,) * len(prefix), algorithm=algorithm), seed=5)


@pytest.mark.parametrize("spec, message", [
    (dict(algorithm="medusa"), "spec.algorithm must be one of"),
    (dict(algorithm="dflash"), "dflash verifies one block, a chain"),
])
def test_a_verify_outside_its_algorithm_is_one_line(spec, message):
    s = dict(draft_token_num=4, topk=2, spec_steps=2, parents=(TREE, TREE), accept_lens=(2, 2)) | spec
    with pytest.raises(SpecError, match=message) as e:
        BatchSpec(ForwardMode.TARGET_VERIFY, (9, 14), (4, 4), (MHA,), spec=SpecInput(**s))
    assert "\n" not in str(e.value)


def test_the_draft_modes_are_eagles():
    with pytest.raises(SpecError, match="the draft modes are EAGLE's"):
        BatchSpec(ForwardMode.DRAFT_EXTEND, (9,), (2,), (MHA,), spec=SpecInput(3, 1, 2, ((-1, 0, 1),), (2,),
                                                                              algorithm="ngram"))


def test_our_backends_verify_every_algorithm_and_sglangs_tbo_eagles_alone():
    assert parse("triton").support().verify_algorithms == frozenset(VERIFY_ALGORITHMS)
    from backends.sglang import features

    options = strategy_options(parse("tbo(sglang.triton)"), PROFILES["ci"])
    # split_spec_info cuts EAGLE's input (and its frozen-KV MTP subclass's, where the release has it) only
    assert options["verify_algorithms"] == tuple(a for a in ("eagle", "frozen_kv_mtp")
                                                 if a in features.verify_algorithms())
    assert "ngram's verify not supported" in parse("tbo(sglang.triton)").unsupported_reason(verify("ngram"))


def test_a_release_without_an_algorithms_input_draws_none_of_it(monkeypatch):
    from backends.sglang import features

    monkeypatch.setattr(features, "verify_algorithms", lambda: frozenset({"eagle", "ngram"}))
    assert parse("sglang.triton").support().verify_algorithms == frozenset({"eagle", "ngram"})
    assert "dflash's verify not supported" in parse("sglang.triton").unsupported_reason(verify("dflash", CHAIN))


def _sglang_triton(device):
    comp = parse("sglang.triton")
    if comp.unavailable_reason(device):
        pytest.skip(comp.unavailable_reason(device))
    return comp


@pytest.mark.parametrize("algorithm, tree, cls", [
    ("eagle", TREE, "EagleVerifyInput"), ("frozen_kv_mtp", TREE, "FrozenKVMTPVerifyInput"),
    ("ngram", (-1, 0, 1, 2, 3, 1), "NgramVerifyInput"), ("dflash", CHAIN, "DFlashVerifyInput")])
def test_each_algorithm_hands_sglang_its_own_verify_input_and_is_answered(algorithm, tree, cls, device):
    comp = _sglang_triton(device)
    spec = verify(algorithm, tree)
    if comp.unsupported_reason(spec):
        pytest.skip(comp.unsupported_reason(spec))
    from backends.sglang.adapter import SglangTriton
    case = materialize(spec, device)
    backend = SglangTriton(ModelRunner.of(case.forward_batch, spec.layers))
    backend.init_forward_metadata(case.forward_batch)
    sfb = backend.batches[id(case.forward_batch)]
    assert type(sfb.spec_info).__name__ == cls
    from backends.sglang.runtime import SERVER_ALGORITHMS
    assert backend.sgl_runner.spec_algorithm.name == sfb.spec_algorithm.name == SERVER_ALGORITHMS[algorithm]
    D = len(tree)
    if algorithm == "dflash":
        # its worker widens the host lengths by the block and hands no custom mask: the causal one is the chain's
        assert sfb.spec_info.custom_mask is None
        assert sfb.seq_lens_cpu.tolist() == [9 + D, 14 + D] and sfb.seq_lens.tolist() == [9, 14]
        assert sfb.seq_lens_sum == 9 + 14 + 2 * D
    else:
        assert sfb.seq_lens_cpu.tolist() == [9, 14] and sfb.spec_info.custom_mask is not None
    for prop in ("outputs", "metadata", "cache"):
        verdict = PROPERTIES[prop].run(comp, spec, device)
        assert verdict.ok, f"{prop}: {verdict}"


def test_a_verify_planned_from_dflashs_widened_host_lengths_is_caught(device):
    comp = _sglang_triton(device)
    spec = verify("dflash", CHAIN)
    if comp.unsupported_reason(spec):
        pytest.skip(comp.unsupported_reason(spec))
    mutant = next(m for m in SGLANG_CATALOGUE if m.name == "sglang_triton_verify_plans_from_host_lengths")
    with mutant.patch():
        eagle = PROPERTIES["outputs"].run(comp, verify("eagle", CHAIN), device)
        dflash = PROPERTIES["outputs"].run(comp, spec, device)
        metadata = PROPERTIES["metadata"].run(comp, spec, device)
    assert eagle.ok, str(eagle)  # EAGLE's host and device lengths agree: the fault is invisible there
    assert not dflash.ok and "out of bounds" in dflash.reason, str(dflash)
    assert not metadata.ok and "kv_indices" in metadata.reason, str(metadata)
