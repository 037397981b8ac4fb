"""The known-failure ledger (docs/findings/known-failures.toml): every entry is well formed, its case still
fails here exactly as the entry describes (else the bug is fixed and the entry must go), and the match is
narrow (a failure elsewhere in the same row stays a finding)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from backends.registry import parse
from batch.spec import BatchSpec, ForwardMode, LightningLayer, MHALayer, MLALayer, SpecInput, draft_forest
from properties import PROPERTIES
from properties.verdict import Verdict
from search import ledger
from search.casefile import CaseFile

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ledger.known_failures()


def test_the_ledger_parses_and_rejects_what_it_cannot_check():
    assert ENTRIES, "the ledger is empty: the SGLang triage found disagreements"
    with pytest.raises(ledger.LedgerError, match="unknown condition"):
        ledger.parse_ledger('[[known]]\nid="x"\ncomposition="a"\nproperties=[]\ncondition="nope"\ncase="c"\n'
                            'upstream="u"\nreason="r"\ntriage="t"\n')
    with pytest.raises(ledger.LedgerError, match="missing"):
        ledger.parse_ledger('[[known]]\nid="x"\n')
    entry = '[[known]]\nid="x"\ncomposition="a"\nproperties=[]\ncondition="mixed_two_chunk"\ncase="c"\n' \
            'upstream="u"\nreason="r"\ntriage="t"\n'
    with pytest.raises(ledger.LedgerError, match="devices must be a list of cpu/cuda"):
        ledger.parse_ledger(entry + 'devices="cuda"\n')  # a string would read as the devices c, u, d, a
    with pytest.raises(ledger.LedgerError, match="devices must be a list of cpu/cuda"):
        ledger.parse_ledger(entry + 'devices=["gpu"]\n')
    with pytest.raises(ledger.LedgerError, match="stale_with names no entry"):
        ledger.parse_ledger(entry + 'stale_with="nope"\n')


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_entry_is_well_formed(entry):
    if "*" not in entry.composition:
        parse(entry.composition)  # a term that names real backends
    assert set(entry.properties) <= set(PROPERTIES)
    assert set(entry.modes) <= {m.value for m in ForwardMode}
    assert (ROOT / entry.triage).is_file(), f"{entry.id}: triage page {entry.triage} is missing"
    case = CaseFile.read(entry.case_path)
    assert entry.covers(case.composition, case.spec.mode.value, case.property)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_entry_still_fails_as_described(entry, device):
    case = CaseFile.read(entry.case_path)
    composition = parse(case.composition)
    reason = composition.unavailable_reason(device)
    if reason:
        pytest.skip(f"{entry.id}: {reason}")
    if entry.devices and device not in entry.devices:
        pytest.skip(f"{entry.id}: known on {'/'.join(entry.devices)} only")
    if entry.stale_with:
        pytest.skip(f"{entry.id}: judged stale by {entry.stale_with}'s case (its own depends on GPU memory layout)")
    verdict = PROPERTIES[case.property].run(composition, case.spec, device)
    if not entry.applies_to(ledger.engine_version()):  # a release with the fix: its case is the fix's test
        # It must not fail by this entry's mechanism; where the same case also shows a bug that still lives, it
        # may fail by that one (a live entry), never by nothing known.
        assert not entry.matches(case.composition, case.spec.mode.value, case.property, case.spec,
                                 dataclasses.replace(verdict, ok=False), device), \
            f"{entry.id} was fixed in {entry.fixed_in}, but its case fails so on {ledger.engine_version()} " \
            f"(a regression): {verdict}"
        if not verdict.ok:
            other = ledger.match(case.composition, case.spec.mode.value, case.property, case.spec, verdict, device)
            assert other is not None and other.id != entry.id, \
                f"{entry.id} was fixed in {entry.fixed_in}, but its case fails on {ledger.engine_version()} " \
                f"by no live entry: {verdict}"
        return
    assert not verdict.ok, f"{entry.id} no longer fails: the bug is fixed upstream; remove the entry ({verdict})"
    assert entry.matches(case.composition, case.spec.mode.value, case.property, case.spec, verdict, device), \
        f"{entry.id}: its case fails differently now: {verdict}"


def test_a_failure_outside_the_condition_is_not_known():
    spec = BatchSpec(ForwardMode.DECODE, (30,), (1,), (MHALayer(0, 4, 2, 32, 32, sliding_window=4),
                                                       MHALayer(1, 4, 2, 32, 32)))
    failing = lambda where: Verdict("outputs", False, "out of bounds", 1.0, 1e-6, where)  # noqa: E731
    assert ledger.match("sglang.triton", "decode", "outputs", spec, failing("layer 0: request 0"), "cpu") is not None
    assert ledger.match("sglang.triton", "decode", "outputs", spec, failing("layer 1: request 0"), "cpu") is None
    assert ledger.match("sglang.torch_native", "decode", "outputs", spec, failing("layer 0: request 0"), "cpu") is None
    assert ledger.match("sglang.triton", "decode", "cache", spec, failing("layer 0: request 0"), "cpu") is None


def test_e4m3_arithmetic_is_known_only_within_its_envelope():
    gqa = BatchSpec(ForwardMode.DECODE, (30,), (1,), (MHALayer(0, 4, 2, 32, 32),), kv_cache_dtype="fp8_e4m3")
    failing = lambda error: Verdict("outputs", False, "out of bounds", error, 1e-6, "layer 0: request 0")  # noqa: E731
    assert ledger.match("sglang.triton", "decode", "outputs", gqa, failing(0.1), "cpu") is not None
    assert ledger.match("sglang.triton", "decode", "outputs", gqa, failing(0.6), "cpu") is None  # e.g. a scale lost
    mha = BatchSpec(ForwardMode.DECODE, (30,), (1,), (MHALayer(0, 2, 2, 32, 32),), kv_cache_dtype="fp8_e4m3")
    assert ledger.match("sglang.triton", "decode", "outputs", mha, failing(0.1), "cpu") is None  # its kernel is exact
    auto = BatchSpec(ForwardMode.DECODE, (30,), (1,), (MHALayer(0, 4, 2, 32, 32),))
    assert ledger.match("sglang.triton", "decode", "outputs", auto, failing(0.1), "cpu") is None
    # A decode replay and its eager twin round the probabilities within KV splits that differ on a GPU (the padded
    # batch's): held to one e4m3 rounding, u = 2^-4 (seen on the H200 at 32769 keys: 1.93e-2, harness-out/gpu109.sh)
    replayed = lambda error: Verdict("graph_replay", False, "decode batch replayed: out of bounds", error,  # noqa: E731
                                     0.0156, "replay with new inputs layer 0: request 0, token 0, head 3, dim 5")
    for graph in ("graph(sglang.triton)", "graph(tbo(sglang.triton))"):
        known = ledger.match(graph, "decode", "graph_replay", gqa, replayed(0.0193), "cuda")
        assert known is not None and known.id == "sglang-triton-fp8-e4m3-decode-replay"
        assert ledger.match(graph, "decode", "graph_replay", gqa, replayed(0.1), "cuda") is None  # not the 0.25
        assert ledger.match(graph, "decode", "graph_replay", mha, replayed(0.0193), "cuda") is None
        assert ledger.match(graph, "decode", "graph_replay", auto, replayed(0.0193), "cuda") is None
        assert ledger.match(graph, "decode", "graph_replay", gqa, replayed(0.0193), "cpu") is None  # splits fixed
    # a verify's or an extend's replay runs no split kernel: nothing differs from its eager twin
    verify = BatchSpec(ForwardMode.TARGET_VERIFY, (30,), (2,), (MHALayer(0, 4, 2, 32, 32),), kv_cache_dtype="fp8_e4m3",
                       spec=SpecInput(2, 1, 1, ((-1, 0),), (2,)))
    assert ledger.match("graph(sglang.triton)", "target_verify", "graph_replay", verify, replayed(0.0193),
                        "cuda") is None


def test_draft_extend_is_known_only_over_an_fp8_cache():
    # docs/findings/sglang-triton-draft-extend-v2.md: the draft extend itself is right; only e4m3 arithmetic is known
    layers, spec = (MHALayer(0, 4, 2, 32, 32),), SpecInput(2, 1, 1, ((-1, 0),), (2,))
    fp8 = BatchSpec(ForwardMode.DRAFT_EXTEND, (1,), (2,), layers, spec=spec, kv_cache_dtype="fp8_e4m3")
    auto = BatchSpec(ForwardMode.DRAFT_EXTEND, (1,), (2,), layers, spec=spec)
    failing = Verdict("outputs", False, "out of bounds", 0.03, 1e-6, "layer 0: request 0, token 0")
    assert ledger.match("sglang.triton", "draft_extend", "outputs", fp8, failing, "cpu") is not None
    assert ledger.match("sglang.triton", "draft_extend", "outputs", auto, failing, "cpu") is None


LIGHT = "hybrid(sglang.triton,sglang.lightning)"
LIGHT_LAYERS = (MHALayer(0, 4, 2, 32, 32), LightningLayer(1, 2, 128))


def test_lightning_fp8_decode_is_known_only_in_decode_over_an_fp8_cache():
    # docs/findings/sglang-lightning-fp8-decode.md: decode rounds q and the output to e4m3 (two roundings, <= 2^-3)
    decode = BatchSpec(ForwardMode.DECODE, (9,), (1,), LIGHT_LAYERS, kv_cache_dtype="fp8_e4m3")
    failing = lambda error, where="layer 1: request 0, token 0": Verdict(  # noqa: E731
        "outputs", False, "out of bounds", error, 1e-3, where)
    assert ledger.match(LIGHT, "decode", "outputs", decode, failing(0.05), "cpu") is not None
    assert ledger.match(LIGHT, "decode", "outputs", decode, failing(0.3), "cpu") is None  # more than two e4m3 roundings
    full_layer = ledger.match(LIGHT, "decode", "outputs", decode, failing(0.05, "layer 0: request 0, token 0"), "cpu")
    assert full_layer is None or full_layer.id != "sglang-lightning-fp8-decode"  # (Triton's own e4m3 entry may)
    auto = BatchSpec(ForwardMode.DECODE, (9,), (1,), LIGHT_LAYERS)
    assert ledger.match(LIGHT, "decode", "outputs", auto, failing(0.05), "cpu") is None
    extend = BatchSpec(ForwardMode.EXTEND, (9,), (4,), LIGHT_LAYERS, kv_cache_dtype="fp8_e4m3")
    assert ledger.match(LIGHT, "extend", "outputs", extend, failing(0.05), "cpu") is None  # extend does not cast q
    then_decode = Verdict("prefill_then_decode", False, "first chunk [3], then decode [1]: out of bounds", 0.05,
                          1e-3, "chunked layer 1: request 0, token 3")
    assert ledger.match(LIGHT, "extend", "prefill_then_decode", extend, then_decode, "cpu") is not None


def test_single_token_verify_is_known_only_for_one_draft_token():
    # docs/findings/sglang-lightning-single-token-verify.md: seg_la takes its decode kernel when tokens == requests
    def verify(d):
        return BatchSpec(ForwardMode.TARGET_VERIFY, (5,), (d,), LIGHT_LAYERS,
                         spec=SpecInput(d, 1, max(d - 1, 1), (tuple(range(-1, d - 1)),), (1,)))
    states = Verdict("outputs", False, "out of bounds", 1.0, 1e-3, "layer 1 request 0 ssm steps: index (0, 1, 2, 3)")
    assert ledger.match(LIGHT, "target_verify", "outputs", verify(1), states, "cpu") is not None
    assert ledger.match(LIGHT, "target_verify", "outputs", verify(2), states, "cpu") is None
    full = Verdict("outputs", False, "out of bounds", 1.0, 1e-3, "layer 0: request 0, token 0")
    assert ledger.match(LIGHT, "target_verify", "outputs", verify(1), full, "cpu") is None
    moved = Verdict("cache", False, "layer 1 ssm_states: slot 3 changed but must not (verify leaves it alone)",
                    where="state slot 3")
    assert ledger.match(LIGHT, "target_verify", "cache", verify(1), moved, "cpu") is not None


def test_idle_crash_is_known_only_with_lightning_layers():
    # matched by what failed, whatever line it sits at in a release (0.5.22: :1474, 0.5.23: :1483)
    crash = Verdict("outputs", False, "crashed: AttributeError: 'NoneType' object has no attribute 'new_empty' "
                                      "(hybrid_linear_attn_backend.py:1474 in forward: `return mixed_qkv.new_empty(`)")
    idle = BatchSpec(ForwardMode.IDLE, (), (), LIGHT_LAYERS)
    assert ledger.match(LIGHT, "idle", "outputs", idle, crash, "cpu") is not None
    mha_only = BatchSpec(ForwardMode.IDLE, (), (), LIGHT_LAYERS[:1])
    assert ledger.match(LIGHT, "idle", "outputs", mha_only, crash, "cpu") is None
    full_branch = Verdict("outputs", False, "crashed: AttributeError: 'NoneType' object has no attribute 'new_empty' "
                                            "(hybrid_linear_attn_backend.py:1486 in forward: "
                                            "`return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)`)")
    # the full layers' answer
    assert ledger.match(LIGHT, "idle", "outputs", idle, full_branch, "cpu") is None


def test_a_known_bug_in_one_layer_does_not_hide_a_new_one_in_another():
    # The worst comparison is the known fp8 decode of the lightning layer; the MHA layer of the same batch fails
    # too, under a composition whose full child has no entry for it: a finding, not a known failure.
    term = "hybrid(sglang.torch_native,sglang.lightning)"
    decode = BatchSpec(ForwardMode.DECODE, (9,), (1,), LIGHT_LAYERS, kv_cache_dtype="fp8_e4m3")

    def failing(*comparisons):  # (where, relative L2 error, its bound), as properties.verdict.Worst lists them
        listed = tuple((where, "rel_l2", error, bound, error) for where, error, bound in comparisons)
        return Verdict("outputs", False, "out of bounds", comparisons[0][1], comparisons[0][2], comparisons[0][0],
                       {"failing": listed}, "rel_l2", comparisons[0][1])
    lightning = ("layer 1: request 0, token 0, head 1", 0.05, 3.9e-3)
    assert ledger.match(term, "decode", "outputs", decode, failing(lightning), "cpu") is not None
    assert ledger.match(term, "decode", "outputs", decode,
                        failing(lightning, ("layer 1: request 0, token 0, head 0", 0.04, 3.9e-3)), "cpu") is not None
    # ... but not a state it leaves alone
    assert ledger.match(term, "decode", "outputs", decode,
                        failing(lightning, ("layer 1 request 0 ssm state:", 0.04, 3.9e-3)), "cpu") is None
    assert ledger.match(term, "decode", "outputs", decode,
                        failing(lightning, ("layer 0: request 0, token 0, head 2", 1e-5, 1e-6)), "cpu") is None


def test_tbo_verify_token_blocks_is_known_only_for_the_compile_error_at_long_context():
    layers, chain = (MHALayer(0, 4, 2, 32, 32),), SpecInput(2, 1, 1, ((-1, 0),), (1,))
    crash = Verdict("outputs", False, "crashed: UnsupportedLanguageConstruct: at 35:4: if TOKEN_BLOCK_PARALLEL: "
                                      "`if` conditionals can only accept values of type {int, bool, NoneType}, not "
                                      "objects of type Tensor (compiler.py:80)")
    long = BatchSpec(ForwardMode.TARGET_VERIFY, (16384,), (2,), layers, spec=chain, context_len=32768)
    short = BatchSpec(ForwardMode.TARGET_VERIFY, (100,), (2,), layers, spec=chain)
    assert ledger.match("tbo(sglang.flashinfer)", "target_verify", "outputs", long, crash, "cuda") is not None
    assert ledger.match("tbo(sglang.flashinfer)", "target_verify", "outputs", short, crash, "cuda") is None
    assert ledger.match("sglang.flashinfer", "target_verify", "outputs", long, crash, "cuda") is None  # TBO only


def test_tbo_start_loc_explains_any_failure_of_a_plainly_cut_linear_batch_on_cuda_only():
    # On CUDA the unrebased start locations make GDN's kernels write past the half's tensors, so a full layer's
    # output or KV buffer can be the casualty (H100, 2026-11-24); on the CPU the interpreter stops at the first
    # out-of-bounds access, and only failures in the linear layers (or that access) are this bug.
    from batch.spec import LinearLayer
    layers = (MHALayer(0, 4, 2, 32, 32), LinearLayer(1, 2, 4, 16, 16))
    plain = BatchSpec(ForwardMode.EXTEND, (0, 0, 0), (40, 3, 41), layers)
    two_chunk = BatchSpec(ForwardMode.EXTEND, (0,), (80,), layers)
    full_nan = Verdict("outputs", False, "out of bounds", float("nan"), 0.0156, "layer 0: request 0, token 0, head 0")
    term = "tbo(hybrid(sglang.triton,sglang.gdn))"
    cuda = ledger.match(term, "extend", "outputs", plain, full_nan, "cuda")
    assert cuda is not None and cuda.id == "sglang-tbo-linear-child-start-loc-cuda-writes" and cuda.corrupts_process
    slot = Verdict("cache", False, "layer 0 k_buffer: slot 0, not in out_cache_loc, changed at slot 0")
    assert ledger.match(term, "extend", "cache", plain, slot, "cuda") is not None
    # a req_to_token row overwritten while the layers ran (an H200, harness-out/gpu95.sh, gpu96.sh: a reserved page 0)
    row = Verdict("metadata", False, "request 0's req_to_token row changed during the forward pass (column 0 holds 0, "
                                     "materialized 17): a stray write; no plan is checked against it")
    assert ledger.match(term, "mixed", "metadata", dataclasses.replace(plain, mode=ForwardMode.MIXED), row,
                        "cuda") is not None
    assert ledger.match(term, "extend", "metadata", plain, row, "cpu") is None
    # a full layer's finite wrong output is not what stray writes look like: it stays a finding
    full_wrong = Verdict("outputs", False, "out of bounds", 0.05, 0.0156, "layer 0: request 0, token 0, head 0")
    assert ledger.match(term, "extend", "outputs", plain, full_wrong, "cuda") is None
    assert ledger.match(term, "extend", "outputs", plain, full_nan, "cpu") is None
    assert ledger.match(term, "extend", "outputs", two_chunk, full_nan, "cuda") is None  # a single request: no cut
    assert ledger.match("tbo(sglang.triton)", "extend", "outputs", plain, full_nan, "cuda") is None  # no hybrid


def test_triton_reading_layer0_is_known_only_when_layer0_is_a_lightning_layer():
    """0.5.10 - 0.5.17 (an H200 found it): TritonAttnBackend asks a lightning hybrid's KV pool for layer 0."""
    crash = Verdict("metadata", False, "crashed: ValueError: layer_id=0 not in full attention layers: dict_keys([1]) "
                                       "(memory_pool.py:1985 in _transfer_full_attention_id: `raise ValueError(`)")
    first_lightning = BatchSpec(ForwardMode.DECODE, (1,), (1,), (LightningLayer(0, 8, 128), MHALayer(1, 8, 2, 128, 128)))
    first_full = BatchSpec(ForwardMode.DECODE, (1,), (1,), (MHALayer(0, 8, 2, 128, 128), LightningLayer(1, 8, 128)))
    condition = ledger.CONDITIONS["triton_reads_layer0_kv"]
    assert condition(first_lightning, crash) and not condition(first_full, crash)
    other = Verdict("metadata", False, "crashed: ValueError: layer_id=2 not in full attention layers: dict_keys([1])")
    assert not condition(first_lightning, other)


def test_a_draft_worker_misroute_is_known_by_the_lightning_childs_symptom_too():
    """On an H200 (0.5.10) the draft worker's full layer reached seg_la, which unpacks q as [T, H, D]."""
    crash = Verdict("cache", False, "crashed: ValueError: not enough values to unpack (expected 3, got 2) "
                                    "(seg_la.py:669 in seg_la_fwd: `length, qo_heads, HEAD_DIM = q.shape`)")
    spec = BatchSpec(ForwardMode.DECODE, (1,), (1,), (MHALayer(0, 8, 2, 128, 128),), draft_worker=True)
    condition = ledger.CONDITIONS["draft_worker_misrouted"]
    assert condition(spec, crash)
    assert not condition(dataclasses.replace(spec, draft_worker=False), crash)


def test_a_draft_worker_misroute_is_known_by_the_kda_childs_symptom_too():
    """0.5.10, CPU: the draft worker's full layer reached KDAAttnBackend, which reads a linear layer's conv weights."""
    for missing in ("conv_weights", "q_dim"):
        crash = Verdict("outputs", False, f"crashed: AttributeError: 'RadixAttention' object has no attribute "
                                          f"'{missing}' (module.py:1967 in __getattr__: `raise AttributeError(`)")
        spec = BatchSpec(ForwardMode.DECODE, (1,), (1,), (MHALayer(0, 4, 2, 32, 32),), draft_worker=True)
        condition = ledger.CONDITIONS["draft_worker_misrouted"]
        assert condition(spec, crash)
        assert not condition(dataclasses.replace(spec, draft_worker=False), crash)
    other = Verdict("outputs", False, "crashed: AttributeError: 'RadixAttention' object has no attribute 'k_scale'")
    assert not condition(spec, other)


def test_kdas_mixed_exponent_bases_are_known_in_a_kda_layer_of_a_multi_token_request_on_old_releases():
    """0.5.10, CPU: a KDA layer's prefill output off where a request's tokens decay against each other."""
    from batch.spec import KdaLayer
    off = Verdict("outputs", False, "outputs and states vs float64 reference: relative L2 error out of bounds",
                  where="layer 1: request 1, token 5, head 1, dim 3")
    layers = (MHALayer(0, 4, 1, 32, 32), KdaLayer(1, 2, 16, 16))
    spec = BatchSpec(ForwardMode.EXTEND, (0, 1), (1, 9), layers)
    condition = ledger.CONDITIONS["kda_chunk_decay"]
    assert condition(spec, off)
    assert not condition(BatchSpec(ForwardMode.EXTEND, (0, 1), (1, 1), layers), off)  # no decay inside a chunk
    in_mha = Verdict("outputs", False, "relative L2 error out of bounds", where="layer 0: request 1, token 5")
    assert not condition(spec, in_mha)
    entry = next(e for e in ledger.known_failures() if e.id == "sglang-kda-chunk-mixed-exp-bases")
    assert entry.applies_to("0.5.10") and not entry.applies_to("0.5.22")


def test_the_kda_prefill_graph_beta_entry_explains_kda_outputs_and_states_where_the_engine_ran_them_in_graph():
    """Where the engine ran KDA inside the prefill graph: a KDA layer's replayed output or recurrent state, not its
    conv state (written before beta is read), another layer, or a capture whose KDA layers broke out."""
    from batch.spec import KdaLayer
    spec = BatchSpec(ForwardMode.EXTEND, (0, 5), (3, 2), (KdaLayer(0, 2, 16, 16), MHALayer(1, 4, 2, 16, 16)))
    condition = ledger.CONDITIONS["kda_in_graph_beta"]

    def replay(where: str, in_graph=("kda",)) -> Verdict:
        return Verdict("graph_replay", False, "relative L2 error out of bounds", where=where,
                       details={"in_graph": in_graph})

    assert condition(spec, replay("replay layer 0: request 1, token 0, head 0, dim 3"))
    assert condition(spec, replay("replay with new inputs layer 0: request 0, token 2, head 1, dim 0"))
    assert condition(spec, replay("replay pool ssm0: index (3, 0, 0, 15)"))
    assert not condition(spec, replay("replay pool conv0: index (3, 0, 1)"))
    assert not condition(spec, replay("replay layer 1: request 0, token 1, head 0, dim 0"))  # the MHA layer
    assert not condition(spec, replay("replay layer 0: request 1, token 0, head 0, dim 3", in_graph=()))


def test_kdas_fused_intra_clamp_is_known_in_a_sharp_decay_layer_with_the_standard_gate():
    """0.5.23, CPU: one fresh request of 18 tokens, sharp decays, the standard gate: the output off at token 14."""
    from batch.spec import KdaLayer
    off = Verdict("outputs", False, "relative L2 error out of bounds", where="layer 0: request 0, token 14, head 0")
    condition = ledger.CONDITIONS["kda_sharp_decay_in_chunk"]
    sharp = BatchSpec(ForwardMode.EXTEND, (0,), (18,), (KdaLayer(0, 2, 16, 16, sharp_decay=True),))
    assert condition(sharp, off)
    for other in (KdaLayer(0, 2, 16, 16), KdaLayer(0, 2, 16, 16, lower_bound=-5.0, sharp_decay=True)):
        assert not condition(BatchSpec(ForwardMode.EXTEND, (0,), (18,), (other,)), off)  # mild, or the safe gate
    assert not condition(BatchSpec(ForwardMode.EXTEND, (3,), (1,), sharp.layers), off)  # one token: no sub-block
    wide = (KdaLayer(0, 64, 16, 16, sharp_decay=True),)  # 5 chunks x 64 heads > 256: the token-parallel path
    assert not condition(BatchSpec(ForwardMode.EXTEND, (0,), (300,), wide), off)


def test_a_draft_extend_graph_window_is_known_by_its_compile_error_on_a_gpu():
    """On an H200 (0.5.14) the window KV list handed as None stops the extend kernel's compilation."""
    crash = Verdict("graph_replay", False, "crashed: CompilationError: at 142:16: ... SLIDING_WINDOW_SIZE ... "
                                           "AttributeError(\"'NoneType' object has no attribute 'type'\")")
    chain = SpecInput(2, 1, 1, ((-1, 0),), (2,))
    windowed = BatchSpec(ForwardMode.DRAFT_EXTEND, (5,), (2,), (MHALayer(0, 4, 2, 16, 16, sliding_window=3),),
                         spec=chain)
    plain = BatchSpec(ForwardMode.DRAFT_EXTEND, (5,), (2,), (MHALayer(0, 4, 2, 16, 16),), spec=chain)
    condition = ledger.CONDITIONS["draft_extend_window_layer"]
    assert condition(windowed, crash) and not condition(plain, crash)


def test_flex_lowering_is_known_on_cuda_only_and_only_for_its_compile_error():
    # The case's own verdict (an Inductor lowering crash of SGLang's compiled flex_attention) is known on CUDA; the
    # same words on a CPU, or another Inductor crash, or another composition's, stay findings
    case = ROOT / "docs/findings/cases/sglang-flex-cuda-compile-lowering.json"
    import json

    reason = json.loads(case.read_text())["verdict"]["reason"]
    spec = BatchSpec(ForwardMode.EXTEND, (0, 31), (117, 107), (MHALayer(0, 8, 2, 128, 128),), page_size=16,
                     dtype="bfloat16")
    crash = Verdict("outputs", False, reason)
    term = "tbo(hybrid(sglang.flex_attention,sglang.gdn))"
    assert ledger.match(term, "extend", "outputs", spec, crash, "cuda").id == "sglang-flex-cuda-compile-lowering"
    assert ledger.match(term, "extend", "outputs", spec, crash, "cpu") is None
    other = Verdict("outputs", False, reason.replace("target: flex_attention", "target: aten.mm"))
    assert ledger.match(term, "extend", "outputs", spec, other, "cuda") is None
    assert ledger.match("sglang.triton", "extend", "outputs", spec, crash, "cuda") is None


def test_a_speculative_window_is_known_only_where_the_request_trim_lets_a_token_past_its_window():
    # docs/findings/sglang-flashinfer-spec-window-unplanned.md: FlashInfer plans the window out of any verify. A
    # tree-mask verify input gets no start index for the request's trimmed keys: any draft token, the root too, is
    # wrong once prefix + depth passes the window. DFlash's gets one and is the request-granular trim exactly: its
    # root is right, a token at depth d sees up to d keys before its window. A graphed draft extend gets no start
    # index either: its token j is wrong once prefix + j passes the window.
    fi = "sglang.flashinfer"
    def verify(prefix, window, algorithm="eagle"):
        return BatchSpec(ForwardMode.TARGET_VERIFY, (prefix,), (3,), (MHALayer(0, 8, 2, 128, 128, sliding_window=window),),
                         dtype="bfloat16", spec=SpecInput(3, 1, 2, ((-1, 0, 1),), (1,), algorithm=algorithm))
    def at(token):
        return Verdict("refuse_or_correct", False, "out of bounds", 1.0, 1e-2, f"layer 0: request 0, token {token}")
    def known(spec, token):
        entry = ledger.match(fi, "target_verify", "refuse_or_correct", spec, at(token), "cuda")
        return entry and entry.id
    tree, dflash = "sglang-flashinfer-verify-window-unplanned", "sglang-flashinfer-dflash-verify-window-by-request"
    for algorithm in ("eagle", "frozen_kv_mtp", "ngram"):
        assert known(verify(2, 1, algorithm), 1) == tree
        assert known(verify(2, 1, algorithm), 0) == tree  # the root too (measured: 0.69 relative L2, gpu43.sh)
    assert known(verify(1, 4), 2) is None  # 1 + 2 <= 4: every key it sees is in its window
    assert known(verify(2, 4), 2) is None  # 2 + 2 <= 4
    assert known(verify(3, 4), 2) == tree and known(verify(5, 4), 0) == tree and known(verify(4, 4), 0) is None
    assert known(verify(2, 1, "dflash"), 1) == dflash
    assert known(verify(2, 1, "dflash"), 0) is None  # DFlash's root reads its own window: a failure there is new
    assert known(verify(2, 4, "dflash"), 2) is None and known(verify(3, 4, "dflash"), 2) == dflash
    def draft_extend(prefix, window):
        return BatchSpec(ForwardMode.DRAFT_EXTEND, (prefix,), (2,), (MHALayer(0, 8, 2, 128, 128, sliding_window=window),),
                         dtype="bfloat16", spec=SpecInput(2, 1, 1, ((-1, 0),), (2,)))
    graph = "graph(sglang.flashinfer)"
    assert ledger.match(graph, "draft_extend", "graph_replay", draft_extend(2, 1), at(1), "cuda") is not None
    assert ledger.match(graph, "draft_extend", "graph_replay", draft_extend(2, 1), at(0), "cuda") is not None  # 2 > 1
    assert ledger.match(graph, "draft_extend", "graph_replay", draft_extend(1, 2), at(1), "cuda") is None  # 1 + 1 <= 2
    # the eager draft extend plans its window per token (spec_info=None there): not this entry
    assert ledger.match(fi, "draft_extend", "outputs", draft_extend(2, 1), at(1), "cuda") is None


def test_mamba2_plans_a_plainly_cut_half_over_its_unrebased_start_locations():
    """H200 and CPU, 0.5.23: the second half's Mamba-2 planning raises where a request carries a prefix."""
    from batch.spec import Mamba2Layer
    layers = (Mamba2Layer(0, 4, 8, 2, 16), MHALayer(1, 4, 2, 32, 32))
    plain = BatchSpec(ForwardMode.EXTEND, (0, 0, 20), (40, 3, 41), layers)
    crash = Verdict("conformance", False, "crashed: IndexError: index 8 is out of bounds for dimension 0 with size 7 "
                                          "(mamba2_metadata.py:190 in _query_start_loc_to_chunk_indices_offsets: "
                                          "`chunk_offsets[_s] = s % chunk_size`)")
    known = ledger.match("tbo(hybrid(sglang.triton,sglang.mamba2))", "extend", "conformance", plain, crash, "cpu")
    assert known is not None and known.id == "sglang-tbo-gdn-child-start-loc"
    other = Verdict("conformance", False, "crashed: IndexError: index 8 is out of bounds (somewhere_else.py:1)")
    assert ledger.match("tbo(hybrid(sglang.triton,sglang.mamba2))", "extend", "conformance", plain, other, "cpu") \
        is None


def test_lfm2_state_by_request_row_is_known_only_in_short_conv_layers():
    from batch.spec import ShortConvLayer
    spec = BatchSpec(ForwardMode.DECODE, (1,), (1,), (ShortConvLayer(0, 16, 2), MHALayer(1, 4, 2, 32, 32)))
    condition = ledger.CONDITIONS["conv_state_by_request_row"]
    assert condition(spec, Verdict("outputs", False, "out of bounds", 1.26, 4e-7, "layer 0 request 0 conv state"))
    assert not condition(spec, Verdict("outputs", False, "out of bounds", 1.0, 4e-7, "layer 1: request 0, token 0"))
    assert condition(spec, Verdict("cache", False, "layer 0 conv_states: slot 2 changed but must not"))
    assert not condition(spec, Verdict("cache", False, "layer 1 k_buffer: slot 2 changed"))
    # and on the releases where it lives only: 0.5.22 rebuilt the layer on the backend's state handle
    entry = next(e for e in ledger.known_failures() if e.id == "sglang-lfm2-conv-state-by-request-row")
    assert entry.applies_to("0.5.10") and not entry.applies_to("0.5.23")


def test_lfm2_hybrids_reach_the_draft_worker_and_layer0_entries_by_their_own_symptoms():
    """0.5.10, CPU: an LFM2 hybrid's draft worker reaches Mamba2AttnBackend's refusal; its Triton backend, layer 0."""
    from batch.spec import ShortConvLayer
    refused = Verdict("outputs", False, "crashed: NotImplementedError: Mamba2AttnBackend's forward is called directly "
                                        "instead of through HybridLinearAttnBackend")
    draft = BatchSpec(ForwardMode.DECODE, (1,), (1,), (MHALayer(0, 4, 2, 32, 32),), draft_worker=True)
    assert ledger.CONDITIONS["draft_worker_misrouted"](draft, refused)
    layer0 = Verdict("metadata", False, "crashed: ValueError: layer_id=0 not in full attention layers: dict_keys([1]) "
                                        "(memory_pool.py:1333 in _transfer_full_attention_id: `raise ValueError(`)")
    first_conv = BatchSpec(ForwardMode.DECODE, (1,), (1,), (ShortConvLayer(0, 16), MHALayer(1, 4, 2, 32, 32)))
    assert ledger.CONDITIONS["triton_reads_layer0_kv"](first_conv, layer0)


def test_a_two_chunk_cut_between_requests_is_a_plain_cut():
    """CPU, 0.5.23: one-token extends [1, 1, 1] take the two-chunk rule, whose cut falls between requests; the second
    half's start locations were not rebased (its LFM2 conv read past its tokens)."""
    from batch.spec import ShortConvLayer
    spec = BatchSpec(ForwardMode.EXTEND, (0, 0, 0), (1, 1, 1), (ShortConvLayer(0, 16),))
    oob = Verdict("outputs", False, "crashed: InterpreterError: OutOfBounds('_causal_conv1d_fwd_kernel loads 32 "
                                    "element(s) outside its tensor arguments')")
    known = ledger.match("tbo(hybrid(sglang.torch_native,sglang.short_conv))", "extend", "outputs", spec, oob, "cpu")
    assert known is not None and known.id == "sglang-tbo-gdn-child-start-loc"
    chunked = dataclasses.replace(spec, prefix_lens=(0,), extend_lens=(80,))  # one request: cut inside it
    assert not ledger.CONDITIONS["tbo_linear_plain_split"](chunked, oob)


def test_a_crash_in_the_batch_replan_runs_first_is_judged_by_that_batch():
    # The H100 main job of 2026-11-27 (gpu53.sh): tbo(sglang.flashinfer)-mixed-replan crashed in FlashInfer's ragged
    # prefill (q.shape[0] 54 against qo_indptr[-1] 7). The drawn batch is no two-chunk cut, but replan first runs
    # the same batch with its requests rotated (same_shapes), which is: the known TBO two-chunk bug, reached there.
    spec = BatchSpec(ForwardMode.MIXED, (0,) * 10, (45, 1, 1, 1, 1, 1, 1, 1, 55, 1), (MHALayer(0, 8, 2, 128, 128),),
                     dtype="bfloat16")
    crash = "crashed: ValueError: q.shape[0] (54) does not match qo_indptr[-1] (7). (prefill.py:5208 in run)"
    before = Verdict("replan", False, crash + ", running the batch before the drawn one", details={"batch": "before"})
    found = ledger.match("tbo(sglang.flashinfer)", "mixed", "replan", spec, before, "cuda")
    assert found is not None and found.id == "sglang-tbo-mixed-two-chunk"
    # The same crash in the drawn batch itself is not that bug: the drawn batch is no two-chunk cut
    assert ledger.match("tbo(sglang.flashinfer)", "mixed", "replan", spec, Verdict("replan", False, crash), "cuda") is None


def test_a_hidden_indexer_is_known_only_under_the_hybrid_over_a_sparse_backend():
    # docs/findings/sglang-hybrid-hides-indexer-metadata.md: live up to 0.5.19, so read the entry, not the release
    entry = next(e for e in ENTRIES if e.id == "sglang-hybrid-hides-indexer-metadata")
    hides = lambda *members: Verdict("conformance", False, "hidden", details={"hidden": list(members)})  # noqa: E731
    condition = ledger.CONDITIONS[entry.condition]
    spec = CaseFile.read(entry.case_path).spec
    assert condition(spec, hides("get_indexer_metadata"))
    assert condition(spec, hides("get_indexer_metadata", "update_verify_buffers_to_fill_after_draft"))
    assert not condition(spec, hides("get_indexer_metadata", "forward_extend"))  # a member nobody triaged
    assert not condition(spec, hides("support_triton"))
    assert entry.covers("hybrid(sglang.nsa,sglang.kda)", "extend", "conformance")
    assert entry.covers("hybrid(sglang.dsa,sglang.gdn)", "extend", "conformance")
    assert not entry.covers("hybrid(sglang.qsa,sglang.gdn)", "extend", "conformance")
    assert not entry.covers("tbo(sglang.dsa)", "extend", "conformance")
    assert not entry.applies_to("0.5.20") and entry.applies_to("0.5.19")


def test_xqa_e4m3_decode_is_known_only_for_an_fp8_decode_within_its_envelope_on_cuda():
    # docs/findings/sglang-trtllm-mha-xqa-fp8-e4m3-arithmetic.md: XQA computes in e4m3 whatever the head grouping
    layers = (MHALayer(0, 2, 2, 32, 32),)
    fp8 = BatchSpec(ForwardMode.DECODE, (30,), (1,), layers, kv_cache_dtype="fp8_e4m3")
    failing = lambda error, reason="out of bounds": Verdict("outputs", False, reason, error, 1e-6,  # noqa: E731
                                                            "layer 0: request 0, token 0")
    name = "sglang.trtllm_mha"
    assert ledger.match(name, "decode", "outputs", fp8, failing(0.03), "cuda").id == \
        "sglang-trtllm-mha-xqa-fp8-e4m3-arithmetic"
    assert ledger.match(name, "decode", "outputs", fp8, failing(0.03), "cpu") is None  # its planning only, there
    assert ledger.match(name, "decode", "outputs", fp8, failing(0.6), "cuda") is None  # e.g. a scale lost
    auto = BatchSpec(ForwardMode.DECODE, (30,), (1,), layers)
    assert ledger.match(name, "decode", "outputs", auto, failing(0.03), "cuda") is None
    assert ledger.match(name, "decode", "outputs", fp8, failing(0.24), "cuda") is not None  # e4m3's envelope: 0.25
    assert ledger.match(name, "decode", "outputs", fp8, failing(0.26), "cuda") is None
    assert ledger.match(name, "decode", "tbo_split", fp8, failing(0.03), "cuda") is None  # split vs unsplit: both XQA
    # an extend computes exactly over the cache (fmha_v2); the decoded token (each request's last) of a
    # prefill-then-decode check does not, the first chunk's tokens do
    extend = BatchSpec(ForwardMode.EXTEND, (30,), (3,), layers, kv_cache_dtype="fp8_e4m3")
    assert ledger.match(name, "extend", "outputs", extend, failing(0.03), "cuda") is None
    chunked = lambda token: Verdict("prefill_then_decode", False, "first chunk [2], then decode [1]: out of bounds",  # noqa: E731
                                    0.03, 1e-6, f"layer 0: request 0, token {token}")
    assert ledger.match(name, "extend", "prefill_then_decode", extend, chunked(2), "cuda") is not None
    assert ledger.match(name, "extend", "prefill_then_decode", extend, chunked(1), "cuda") is None
    # each step of its draft loop is a decode through the same kernel (seen on the H200, harness-out/gpu94.sh)
    forest = draft_forest(1, 2)
    draft = BatchSpec(ForwardMode.DRAFT_DECODE, (30,), (1,), layers, kv_cache_dtype="fp8_e4m3",
                      spec=SpecInput(len(forest), 1, 2, (forest,), (1,)))
    assert ledger.match(name, "draft_decode", "outputs", draft, failing(0.034), "cuda") is not None
    assert ledger.match(name, "draft_decode", "outputs", draft, failing(0.6), "cuda") is None
    # a replay and its eager twin are two e4m3 computations, each within the envelope of the exact attention, which
    # differ where the kernel's configuration does (seen on the H200 at a padded replay: 6.7e-3 and 1.55e-2 between
    # them, each 3.4e-2 off the reference, harness-out/gpu97.sh, gpu99.sh); over a bf16 cache they agree
    replayed = lambda error: Verdict("graph_replay", False, "draft_decode batch replayed: out of bounds",  # noqa: E731
                                     error, 0.0156, "replay layer 0: request 1, token 0, head 3, dim 31")
    graph = f"graph({name})"
    assert ledger.match(graph, "draft_decode", "graph_replay", draft, replayed(0.02), "cuda").id == \
        "sglang-trtllm-mha-xqa-fp8-e4m3-arithmetic"
    assert ledger.match(graph, "decode", "graph_replay", fp8, replayed(0.02), "cuda") is not None
    assert ledger.match(graph, "draft_decode", "graph_replay", draft, replayed(0.6), "cuda") is None
    # replay vs eager is held to one e4m3 rounding (u = 2^-4), not the 0.25 envelope of either against the exact
    # attention: a replay that drops one of 32 keys a request (about 0.15) stays a finding
    assert ledger.match(graph, "draft_decode", "graph_replay", draft, replayed(0.06), "cuda") is not None
    assert ledger.match(graph, "draft_decode", "graph_replay", draft, replayed(0.15), "cuda") is None
    bf16_draft = dataclasses.replace(draft, kv_cache_dtype="auto")
    assert ledger.match(graph, "draft_decode", "graph_replay", bf16_draft, replayed(0.02), "cuda") is None


def test_flashmla_mixed_crash_is_known_only_by_its_crash_in_the_decode_branch():
    mla = (MLALayer(0, 4, 16, 16, 64, 16),)
    mixed = BatchSpec(ForwardMode.MIXED, (0, 70), (5, 1), mla, page_size=64)
    crash = lambda reason: Verdict("outputs", False, f"crashed: {reason}")  # noqa: E731
    attr = ("AttributeError: 'PrefillMetadata' object has no attribute 'block_kv_indices' (flashmla_backend.py:587 in "
            "forward_extend: `block_table=self.forward_metadata.block_kv_indices[:bs],`)")
    view = ("RuntimeError: shape '[3, -1, 16, 192]' is invalid for input of size 12288 (flashmla_backend.py:546 in "
            "forward_extend: `reshape_q = q.view(bs, -1, layer.tp_q_head_num, layer.head_dim)`)")
    for reason in (attr, view):
        assert ledger.match("sglang.flashmla", "mixed", "outputs", mixed, crash(reason), "cuda") is not None
        assert ledger.match("tbo(sglang.flashmla)", "mixed", "cache", mixed, crash(reason), "cuda") is not None
    assert ledger.match("sglang.flashmla", "mixed", "outputs", mixed, crash("RuntimeError: CUDA error"), "cuda") is None
    # the same errors elsewhere than FlashMLA's decode branch are not this bug
    assert ledger.match("sglang.flashmla", "mixed", "outputs", mixed,
                        crash(attr.replace("flashmla_backend.py", "trtllm_mla_backend.py")), "cuda") is None
    assert ledger.match("sglang.flashmla", "mixed", "outputs", mixed,
                        crash(view.replace("in forward_extend", "in forward_decode")), "cuda") is None
    extend = BatchSpec(ForwardMode.EXTEND, (0, 70), (5, 1), mla, page_size=64)
    assert ledger.match("sglang.flashmla", "extend", "outputs", extend, crash(attr), "cuda") is None


def test_the_mla_draft_entries_are_known_only_where_the_step_plans_read_the_committed_prefix():
    # Read from the plans the failing property had (properties/metadata.py draft_plans_read), never from the words
    # of the reason: a plan short by another count, reading another request's keys, or outputs off with no plan to
    # read stay findings
    case = CaseFile.read(ROOT / "docs/findings/cases/sglang-trtllm-mla-draft-steps-read-committed-prefix.json")
    composition = parse(case.composition)
    if composition.unavailable_reason("cpu"):
        pytest.skip(composition.unavailable_reason("cpu"))
    verdict = PROPERTIES["metadata"].run(composition, case.spec, "cpu")
    assert not verdict.ok and verdict.details["draft_step_reads"] == "committed prefix", str(verdict)
    name, mode = "sglang.trtllm_mla", "draft_decode"
    assert ledger.match(name, mode, "metadata", case.spec, verdict, "cpu").id == \
        "sglang-trtllm-mla-draft-steps-read-committed-prefix"
    for other in (None, "committed prefix lengths"):  # no plan read, or the counts alone
        wrong = dataclasses.replace(verdict, details={"draft_step_reads": other})
        assert ledger.match(name, mode, "metadata", case.spec, wrong, "cpu") is None
    words_only = Verdict("outputs", False, "draft step 0: key lengths [9], expected [7]... out of bounds", 1e3, 1e-2)
    assert ledger.match(name, mode, "outputs", case.spec, words_only, "cuda") is None
    for counts in ("committed prefix lengths", "committed prefix"):  # a lone request's row is its prefix exactly
        assert ledger.match("graph(sglang.flashinfer_mla)", mode, "graph_replay", case.spec,
                            dataclasses.replace(verdict, details={"draft_step_reads": counts}),
                            "cuda").id == "sglang-flashinfer-mla-draft-graph-misaligned"
    assert ledger.match("sglang.triton_mla", mode, "metadata", case.spec, verdict, "cpu") is None  # its container is right
