"""``harness export`` of a plan: the ``metadata`` property of a dense SGLang leaf (its eager plan of an EXTEND, MIXED or
DECODE batch) and its ``graph_metadata`` property (the plan a decode CUDA graph replays with).

The file builds the backend with SGLang's dense unit-test kit, as an outputs file does, and hands it the ForwardBatch
the harness handed it: SGLang's own fields as the recorder read them just before the plan (request rows, lengths,
write slots, positions), each request row's KV slots loaded into the kit's request pool. Then the backend plans:
``init_forward_metadata``; under a graph, what SGLang's decode graph runner asks (``init_cuda_graph_state``, then
``init_forward_metadata_out_graph(in_capture=True)`` and ``init_forward_metadata_in_graph`` over the static batch of
the captured size, every row padding; the real batch copied into the static tensors, the rest padded as the runner
pads it; ``out_graph`` and ``in_graph`` again, as a replay). The plan is read as the harness reads it (the backend's
``forward_metadata``: Triton's token-level indptrs and slots) and judged by the harness's own check
(properties/metadata.py ``check_plan`` and its helpers, copied into the file) against the batch the harness meant:
each request's keys are its request row's slots, indptrs start at 0 and do not decrease, and a replay's padded rows
are held to what SGLang's kit holds every replayed plan to. Under a graph, SGLang's kit's own check
(``runner_modes/metadata_invariants.py``) runs too, where the installed release has it.

This module holds what is particular to these files (which cases, the template, the server line); harness/export.py
replays the case, records and renders, as for every other kind.
"""

from __future__ import annotations

import string

PROPERTIES = ("metadata", "graph_metadata")
# The batches each property's file plans (a decode graph: SGLang's DecodeCudaGraphRunner)
MODES = {"metadata": ("extend", "mixed", "decode"), "graph_metadata": ("decode",)}
# The SGLang leaves whose forward_metadata the file reads the way the harness's adapter does (token-level indptrs)
PLANNERS = ("triton",)
STEP = {"extend": "a prefill (extend) step", "mixed": "a mixed prefill+decode step (--enable-mixed-chunk)",
        "decode": "a decode step"}


def graph_property(composition: str, prop: str) -> bool:
    return prop == "graph_metadata" and composition.startswith("graph(") and composition.endswith(")")


def exportable_reason(leaf: str | None, prop: str, mode: str, kv_cache_dtype: str) -> str | None:
    """Why a plan case of SGLang's ``leaf`` cannot be exported (yet), or None."""
    if leaf is None:
        return (f"export covers the plans of a dense SGLang leaf ({', '.join(f'sglang.{x}' for x in PLANNERS)}) and "
                f"its decode graph, not other compositions")
    if leaf not in PLANNERS:
        return (f"export reads the plans of {', '.join(f'sglang.{x}' for x in PLANNERS)} (token-level indptrs and "
                f"slots), not sglang.{leaf}'s")
    if mode not in MODES[prop]:
        return f"export covers the {prop} property in {', '.join(MODES[prop])} batches, not {mode}"
    if kv_cache_dtype != "auto":
        return f"export covers plans over an auto KV cache, not {kv_cache_dtype}"
    return None


def server_configuration(leaf: str, spec, graph: bool, captured: int | None) -> str:
    parts = [f"python -m sglang.launch_server --attention-backend {leaf}"]
    if spec.page_size > 1:
        parts.append(f"--page-size {spec.page_size}")
    layer = next(layer for layer in spec.layers if layer.kind == "mha")
    model = f"{layer.num_q_heads} query / {layer.num_kv_heads} KV heads of dim {layer.head_dim}, dtype {spec.dtype}"
    if getattr(layer, "sliding_window", None) is not None:
        model += f", a sliding window of {layer.sliding_window}"
    step = STEP[spec.mode.value]
    if graph:
        step = (f"{step} of {spec.batch_size} request(s) replayed in the decode CUDA graph captured for {captured} "
                f"(CUDA graphs on, the default; --cuda-graph-max-bs {captured} or more)")
    else:
        step = f"{step}, run eagerly (--disable-cuda-graph, or a batch no graph was captured for)"
    return f"{' '.join(parts)}, a model with {model}; {step}"


METADATA = string.Template('''${kit_import}from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

BACKEND = "$backend"
DTYPE = torch.$dtype
PAGE_SIZE = $page_size
RADIX = $radix  # the model's attention layer, as the backend sizes its buffers by it
GRAPH = $graph  # a decode CUDA graph's plan (captured, then replayed), or an eager plan
# The request rows of SGLang's request pool the batch reads: each one's KV slot per position, as far as the plan reads
# it (pages renumbered from 1, offsets kept; row 0 and slot 0 are SGLang's padding)
ROWS = $rows
# SGLang's ForwardBatch as the harness handed it to the plan: $plans_note
PLANS = $plans
# What the plan must describe, as the harness read the batch it planned: each request's cached and new tokens (a
# graph's padded rows after the real ones, from the fill value), its request row, the new tokens
EXPECTED = $expected
WHERE = $where  # where the harness's verdict says the plan was made


# The harness's check of a plan (properties/metadata.py), as it is:
$check_source


def plan_of(meta, mode, window):
    """The backend's forward_metadata as the harness's adapter reads it (backends/sglang/adapter.py
    planned_metadata): token-level indptrs and slots; a decode plan lists the new token's key too (SGLang writes it
    before the kernel reads); with a sliding ``window``, its layers' own lists. A graph's buffers are sized for its
    largest capture: read as far as kv_indptr says."""
    windowed = {name: getattr(meta, name, None) if window else None
                for name in ("window_kv_indptr", "window_kv_indices", "window_kv_offsets")}
    plan = types.SimpleNamespace(qo_indptr=getattr(meta, "qo_indptr", None), kv_indptr=meta.kv_indptr,
                           kv_indices=meta.kv_indices, kv_last_page_len=None, kv_indices_are_pages=False,
                           kv_includes_new_tokens=mode.is_decode_or_idle(),
                           custom_mask=getattr(meta, "custom_mask", None),
                           mask_indptr=getattr(meta, "mask_indptr", None), state_slots=None, chunk={},
                           key_lens=None, key_indptr=None, window=window or None, **windowed)
    if GRAPH:
        plan.kv_indices = plan.kv_indices[:int(plan.kv_indptr[-1])]
        if plan.custom_mask is not None and plan.mask_indptr is not None:
            plan.custom_mask = plan.custom_mask[:int(plan.mask_indptr[-1])]
        if plan.window_kv_indptr is not None and plan.window_kv_indices is not None:
            plan.window_kv_indices = plan.window_kv_indices[:int(plan.window_kv_indptr[-1])]
    return plan


def tensor(fields, name):
    return torch.tensor(fields[name], dtype=getattr(torch, fields["dtypes"][name]), device=DEVICE)


def forward_batch(fields, static, runner):
    """SGLang's ForwardBatch of the recorded ``fields``, over ``static`` (a graph's static tensors, which each replay
    refills in place) where given; bound to the runner's KV index translator as SGLang binds a batch (0.5.22 on): a
    graph runner's static batch to the runner's slots, any other to its own plan."""
    mode = ForwardMode[fields["forward_mode"]]
    own = static if static is not None else {n: tensor(fields, n) for n in STATIC}
    batch = ForwardBatch(forward_mode=mode, batch_size=fields["batch_size"],
                         input_ids=torch.zeros(fields["num_tokens"], dtype=torch.int64, device=DEVICE),
                         req_pool_indices=own["req_pool_indices"], seq_lens=own["seq_lens"],
                         seq_lens_cpu=torch.tensor(fields["seq_lens_cpu"], dtype=getattr(torch, fields["dtypes"]["seq_lens"])),
                         out_cache_loc=own["out_cache_loc"], seq_lens_sum=fields["seq_lens_sum"],
                         positions=own["positions"])
    if fields.get("num_padding") is not None:  # SGLang's replay view (build_replay_fb_view) says how many rows pad
        batch.num_padding = fields["num_padding"]
    if mode.is_extend():
        batch.extend_prefix_lens = tensor(fields, "extend_prefix_lens")
        batch.extend_prefix_lens_cpu = list(fields["extend_prefix_lens_cpu"])
        batch.extend_seq_lens = tensor(fields, "extend_seq_lens")
        batch.extend_seq_lens_cpu = list(fields["extend_seq_lens_cpu"])
        batch.extend_start_loc = tensor(fields, "extend_start_loc")
        batch.extend_num_tokens = fields["num_tokens"]
    translator = getattr(runner, "kv_index_translator", None)
    bind = getattr(translator, "bind_runner_slots" if static is not None else "bind_own_plan", None)
    if bind is not None:
        bind(batch)
    return batch


STATIC = ("req_pool_indices", "seq_lens", "out_cache_loc", "positions")


def test_plan_satisfies_the_metadata_invariants():
    torch.manual_seed(0)
    last = PLANS[-1]
    mode = ForwardMode[last["forward_mode"]]
    real = EXPECTED["batch_size"] - (EXPECTED["num_padding"] or 0)
    # The kit sizes its request rows and its KV pool by max_context_len: long enough for every row and every slot
    longest = max([len(slots) for slots in ROWS.values()] + [max(s for slots in ROWS.values() for s in slots) + 1])
    max_context_len = -(-longest // PAGE_SIZE) * PAGE_SIZE
    case = kit.DenseAttentionCase(name="harness_export", backend=BACKEND, forward_mode=mode,
                                  num_heads=RADIX["num_heads"], num_kv_heads=RADIX["num_kv_heads"],
                                  page_size=PAGE_SIZE, prefix_lens=tuple(EXPECTED["extend_prefix_lens_cpu"][:real]),
                                  extend_lens=tuple(EXPECTED["extend_seq_lens_cpu"][:real]),
                                  sliding_window_size=RADIX["sliding_window_size"] if RADIX["sliding_window_size"] >= 0 else None)
    config = kit.TinyModelConfig(num_heads=RADIX["num_heads"], num_kv_heads=RADIX["num_kv_heads"],
                                 head_dim=RADIX["head_dim"], hidden_size=RADIX["num_heads"] * RADIX["head_dim"],
                                 context_len=max_context_len, sliding_window_size=case.sliding_window_size)
    # The request pool holds row 0 (padding) and every row the batch names
    runner = kit.MockModelRunner(case=case, model_config=config, dtype=DTYPE, device=DEVICE,
                                 max_context_len=max_context_len, head_dim=RADIX["head_dim"],
                                 disable_cuda_graph=not GRAPH, runner_batch_size=max(max(ROWS), real))
    table = runner.req_to_token_pool.req_to_token
    for row, slots in ROWS.items():
        table[row, :len(slots)] = torch.tensor(slots, dtype=table.dtype, device=table.device)
    backend = ATTENTION_BACKENDS[BACKEND](runner)
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        if GRAPH:  # as SGLang's decode graph runner: capture over the static batch, then a replay of the real one
            capture, replay = PLANS
            static = {name: tensor(capture, name) for name in STATIC}
            backend.init_cuda_graph_state(capture["batch_size"], capture["num_tokens"])
            batch = forward_batch(capture, static, runner)
            backend.init_forward_metadata_out_graph(batch, in_capture=True)
            backend.init_forward_metadata_in_graph(batch)
            for name in STATIC:  # the real batch into the static tensors, the rest padding
                static[name].copy_(tensor(replay, name))
            batch = forward_batch(replay, static, runner)
            backend.init_forward_metadata_out_graph(batch, in_capture=False)
            backend.init_forward_metadata_in_graph(batch)
        else:
            backend.init_forward_metadata(forward_batch(last, None, runner))
    meta = backend.forward_metadata
    expected = types.SimpleNamespace(**{k: v for k, v in EXPECTED.items() if k not in ("req_pool_indices", "seq_lens_cpu")},
                               req_pool_indices=torch.tensor(EXPECTED["req_pool_indices"]), req_to_token=table,
                               forward_mode=mode, spec_info=None, state_slots=None,
                               seq_lens_cpu=torch.tensor(EXPECTED["seq_lens_cpu"]))
    problem = check_plan(plan_of(meta, mode, getattr(backend, "sliding_window_size", None) or 0), expected)
    assert problem is None, f"{WHERE}{type(backend).__name__}: {problem}"
    if GRAPH:
        try:  # SGLang's own check of a replayed plan, where the kit has it
            from sglang.test.kits.attention_unittest.runner_modes.metadata_invariants import \\
                assert_cg_metadata_well_formed
        except ModuleNotFoundError:
            return
        assert_cg_metadata_well_formed(backend, bs=EXPECTED["batch_size"])
''')
