"""``harness export`` of a draft loop's plans: the ``metadata`` property of an MLA leaf's multi-step draft container
(EAGLE's draft worker, ``--speculative-algorithm EAGLE`` on an MLA model), eagerly planned.

The file builds the container the server builds: SGLang's ``DraftBackendFactory(draft_runner, topk, num_steps)
.create_decode_backend()`` over a runner from SGLang's MLA unit-test kit (``MockMLAModelRunner``) whose draft backend
is the leaf's, with the speculative flags the server sets. It hands the container the draft batch the harness handed
it (``prepare_for_draft``'s: mode DECODE, ``seq_lens`` the committed lengths, every branch's draft slots, an
``EagleDraftInput``), each request row's KV slots loaded into the kit's request pool, and plans once
(``init_forward_metadata``), as the draft worker does before its steps. Then it reads step i's plan from
``attn_backends[i]`` the way the harness's adapter reads it (TRT-LLM MLA's ``forward_decode_metadata``: each
request's key count and the page-table row) and judges it with the harness's own ``check_plan`` (copied in) against
what step i must read: its request's committed prefix and its branch's draft tokens of steps 0..i, the last of them
its own.

Where the leaf's kernels cannot run (TRT-LLM MLA and CuTe DSL MLA run on Blackwell only) the harness plans it at plan
level (backends/sglang/plans.py), and so does the file: SGLang asked the GPU's capability as on Blackwell, FlashInfer's
MLA wrappers (which it builds and never plans here) as inert stand-ins where FlashInfer is not installed, the TRT-LLM
kernels' workspace and JIT module none: the harness's own stand-ins (``asked_as``, ``flashinfer_absent``), copied in.
Nothing that plans is replaced; a stand-in that is called raises.
"""

from __future__ import annotations

import string

PROPERTIES = ("metadata",)
# The MLA leaves whose draft container the file builds and whose step plans it reads (TRT-LLM MLA's form)
LEAVES = {"sglang.trtllm_mla": "trtllm_mla", "sglang.cutedsl_mla": "cutedsl_mla"}
# Leaves planned without their kernels (as on Blackwell), in the harness and in the file
PLAN_LEVEL = frozenset({"trtllm_mla", "cutedsl_mla"})
MLA_KIT_SINCE = "0.5.23"  # the release the files were checked on (the kit's MLA fixture, mla_attention)


def covers(composition: str, prop: str, mode: str) -> bool:
    """Whether a case is a draft-loop plan case (this module's kind)."""
    return mode == "draft_decode" and prop in PROPERTIES and composition in LEAVES


def draft_case(composition: str, mode: str) -> bool:
    """A draft-loop case of an MLA leaf export knows, whatever its property."""
    return mode == "draft_decode" and composition in LEAVES


def exportable_reason(composition: str, prop: str, mode: str, kv_cache_dtype: str, draft_window: int) -> str | None:
    if composition not in LEAVES:
        return (f"export covers the draft loop's plans of {', '.join(LEAVES)} (their containers' step plans), not "
                f"{composition}'s")
    if prop not in PROPERTIES:
        return f"export covers the {' and '.join(PROPERTIES)} property of a draft loop, not {prop}"
    if kv_cache_dtype != "auto":
        return f"export covers draft-loop plans over an auto KV cache, not {kv_cache_dtype}"
    if draft_window:
        return "export covers draft loops without a server draft window"
    return None


def server_configuration(leaf: str, spec) -> str:
    s = spec.spec
    layer = next(layer for layer in spec.layers if layer.kind == "mla")
    return (f"python -m sglang.launch_server --attention-backend {leaf} --page-size {spec.page_size} "
            f"--speculative-algorithm EAGLE --speculative-num-steps {s.spec_steps} --speculative-eagle-topk {s.topk} "
            f"--speculative-num-draft-tokens {s.topk * (s.spec_steps - 1) + 1}, an MLA model (DeepSeek-style: "
            f"{layer.num_heads} heads, kv_lora_rank {layer.kv_lora_rank}, rope dim {layer.qk_rope_head_dim}), dtype "
            f"{spec.dtype}; the draft worker's multi-step draft decode of {spec.batch_size} request(s) (its "
            f"{s.spec_steps - 1} draft step(s) past the first token), run eagerly (--disable-cuda-graph, or a batch no "
            f"draft graph was captured for)")


DRAFT = string.Template('''${kit_import}import contextlib
import importlib

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.draft_utils import DraftBackendFactory
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

BACKEND = "$backend"  # the server's --attention-backend; its draft worker's container is built for it
PLAN_LEVEL = $plan_level  # planned as on the GPU it runs on (Blackwell), its kernels not run
DTYPE = torch.$dtype
PAGE_SIZE = $page_size
MLA = $mla  # the model's MLA layer
TOPK, NUM_STEPS = $topk, $num_steps  # --speculative-eagle-topk, --speculative-num-steps
# The request rows of SGLang's request pool the draft batch reads: each one's KV slot per position, as far as the
# plans and the draft slots reach (pages renumbered from 1, offsets kept; row 0 and slot 0 are SGLang's padding)
ROWS = $rows
# The draft batch as the harness handed it to the container (prepare_for_draft's): the committed lengths, every
# request's TOPK * NUM_STEPS draft slots, the step-0 positions
BATCH = $batch
# What draft step i must read, branch by branch (request by request): the slots of its request's committed prefix,
# then of its branch's draft tokens of steps 0..i, the last of them its own (the harness's draft_step_batch)
EXPECTED_KEYS = $expected_keys


# The harness's check of a plan (properties/metadata.py), as it is:
$check_source


# The harness's reading of a page table (backends/sglang/adapter.py), as it is:
$page_table_source


# The harness's stand-ins for a plan-level leaf's build (backends/sglang/plans.py, backends/sglang/flashinfer.py), as
# they are: SGLang asked the GPU's capability as on the hardware the server runs the backend on; FlashInfer's wrapper
# classes inert where FlashInfer is absent (any use raises), the TRT-LLM kernels' workspace empty and their JIT
# module none, and without CUDA the MLA backend's pinned host buffers unpinned. Nothing that plans is replaced.
FLASHINFER_WRAPPER_CLASSES = $wrapper_classes
FLASHINFER_MLA_WRAPPER_CLASSES = $mla_wrapper_classes

$stand_in_source


@contextlib.contextmanager
def as_on_blackwell():
    """Where the leaf is planned without its kernels (PLAN_LEVEL), as on Blackwell, where the server runs it."""
    if not PLAN_LEVEL:
        yield
        return
    with asked_as((10, 0)), flashinfer_absent():
        yield


def plan_of(step):
    """Draft step ``step``'s plan as the harness's adapter reads TRT-LLM MLA's (backends/sglang/flashinfer.py
    trtllm_mla_plan): per request ``seq_lens_k`` keys read from the cache (the step's own new token included: SGLang
    writes it first) and the first ceil(keys / PAGE_SIZE) pages of its ``block_kv_indices`` row."""
    meta = step.forward_decode_metadata
    indptr, indices = page_table_lists(meta.block_kv_indices, meta.seq_lens_k, PAGE_SIZE)
    return types.SimpleNamespace(qo_indptr=None, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=None,
                                 kv_indices_are_pages=PAGE_SIZE > 1, kv_includes_new_tokens=True,
                                 custom_mask=None, mask_indptr=None, state_slots=None, chunk={},
                                 key_lens=meta.seq_lens_k, key_indptr=None, window=None, window_kv_indptr=None,
                                 window_kv_indices=None, window_kv_offsets=None)


def expected_step(keys):
    """What one draft step must read, as the harness's check takes it: a decode of every branch, branch b reading
    ``keys[b]`` (each branch a row of its own in a table of those slots)."""
    B = len(keys)
    table = torch.zeros(B, max(len(k) for k in keys), dtype=torch.int64)
    for i, k in enumerate(keys):
        table[i, :len(k)] = torch.tensor(k, dtype=torch.int64)
    prefix = [len(k) - 1 for k in keys]
    return types.SimpleNamespace(batch_size=B, extend_num_tokens=B, num_padding=0, extend_seq_lens_cpu=[1] * B,
                                 extend_prefix_lens_cpu=prefix, seq_lens_cpu=torch.tensor(prefix) + 1,
                                 state_slots=None, req_to_token=table, req_pool_indices=torch.arange(B),
                                 page_size=PAGE_SIZE, forward_mode=ForwardMode.DECODE, spec_info=None)


def test_each_draft_step_plans_its_own_keys():
    torch.manual_seed(0)
    B = BATCH["batch_size"]
    # The kit sizes its request rows and its KV pool by max_context_len: long enough for every row and every slot
    longest = max([len(slots) for slots in ROWS.values()] + [max(s for slots in ROWS.values() for s in slots) + 1])
    max_context_len = -(-longest // PAGE_SIZE) * PAGE_SIZE
    case = kit.MLAAttentionCase(name="harness_export", backend=BACKEND, forward_mode=ForwardMode.DECODE,
                                num_heads=MLA["num_heads"], page_size=PAGE_SIZE, prefix_lens=tuple(BATCH["seq_lens"]))
    config = kit.TinyMLAModelConfig(num_heads=MLA["num_heads"], kv_lora_rank=MLA["kv_lora_rank"],
                                    qk_rope_head_dim=MLA["qk_rope_head_dim"], hidden_size=64,
                                    context_len=max_context_len)
    with as_on_blackwell(), contextlib.ExitStack() as scope:
        runner = kit.MockMLAModelRunner(case=case, model_config=config, dtype=DTYPE, device=DEVICE,
                                        max_context_len=max_context_len, kv_lora_rank=MLA["kv_lora_rank"],
                                        qk_rope_head_dim=MLA["qk_rope_head_dim"], runner_batch_size=max(max(ROWS), B))
        # The draft worker's flags, as the server sets them, over the configuration the kit's runner published
        scope.enter_context(get_spec().override(speculative_algorithm="EAGLE", speculative_eagle_topk=TOPK,
                                                speculative_num_steps=NUM_STEPS,
                                                speculative_num_draft_tokens=TOPK * (NUM_STEPS - 1) + 1))
        runner.draft_attention_backend = BACKEND  # the draft runner's own backend (the factory reads it first)
        table = runner.req_to_token_pool.req_to_token
        for row, slots in ROWS.items():
            table[row, :len(slots)] = torch.tensor(slots, dtype=table.dtype, device=table.device)
        container = DraftBackendFactory(runner, TOPK, NUM_STEPS).create_decode_backend()
        seq_lens = torch.tensor(BATCH["seq_lens"], dtype=torch.int64, device=DEVICE)  # the scheduler's int64
        positions = torch.tensor(BATCH["positions"], dtype=torch.int64, device=DEVICE)
        batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=B,
                             input_ids=torch.zeros(B * TOPK, dtype=torch.int64, device=DEVICE),
                             req_pool_indices=torch.tensor(BATCH["req_pool_indices"], dtype=torch.int64,
                                                           device=DEVICE),
                             seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(),
                             out_cache_loc=torch.tensor(BATCH["out_cache_loc"], dtype=torch.int64, device=DEVICE),
                             seq_lens_sum=int(seq_lens.sum()), positions=positions)
        batch.req_to_token_pool, batch.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
        translator = getattr(runner, "kv_index_translator", None)
        if translator is not None:  # a batch binds to its own plan of KV locations (0.5.22 on)
            translator.bind_own_plan(batch)
        info = EagleDraftInput()
        info.num_tokens_per_req = info.num_tokens_for_logprob_per_req = TOPK
        info.positions = positions
        info.capture_hidden_mode = CaptureHiddenMode.LAST
        batch.spec_info, batch.spec_algorithm = info, SpeculativeAlgorithm.EAGLE
        with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=container.attn_backends[0])):
            container.init_forward_metadata(batch)  # once, before the steps, as the draft worker plans
    assert len(container.attn_backends) == NUM_STEPS - 1 == len(EXPECTED_KEYS)
    for i, step in enumerate(container.attn_backends):
        problem = check_plan(plan_of(step), expected_step(EXPECTED_KEYS[i]))
        assert problem is None, f"draft step {i}: {problem}"
''')
