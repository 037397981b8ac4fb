"""``harness export`` of a lightning layer under SGLang's hybrid wrapper: ``hybrid(sglang.X,sglang.lightning)``
(X a dense leaf), the ``outputs`` property, in EXTEND, MIXED, DECODE, TARGET_VERIFY (EAGLE's chain: the lightning
backend refuses topk > 1) or IDLE, over an ``auto`` or an ``fp8_e4m3`` KV cache.

The file builds SGLang's classes as a Bailing/Ling server does, with SGLang's lightning unit-test kit
(``sglang.test.kits.attention_unittest.attention_methods.lightning_attention``: its ``MockLightningModelRunner``,
``TinyLightningModelConfig``, ``LightningAttentionCase``, ``_make_forward_batch``): the full-attention backend the
server names, ``LightningAttentionBackend``, and ``HybridLinearAttnBackend`` over the two with the model's
full-attention layers. It loads what SGLang was handed when the harness replayed the case (the layer's q, k, v
and each request's state as SGLang's pool held it before the layer), runs the one lightning layer through
``RadixAttention`` under SGLang's forward context, and checks what the harness's ``outputs`` property checks:
the output rows, and each request's state after the batch (a verify: its state after each draft token), against
a float64 recurrence written out in the file, with the harness's bounds and their reason. A case that crashed in
SGLang crashes the file the same way.

This module holds what is particular to these files (which cases they cover, the file's template, the server line);
harness/export.py replays the case, records and renders, as for every other kind.
"""

from __future__ import annotations

import re

from backends.sglang.runtime import SERVER_ALGORITHMS

# What the file checks besides the outputs (its bounds block, harness/export.py LINEAR_BOUNDS)
STATES = "Each request's state after the batch (a verify: after each draft token)"
NAME = "lightning"  # in the refusal lines of export
MODES_NOTE = ""  # why the other modes are refused
# Who builds the hybrid, and its linear child (harness/export.py LINEAR_BUILD)
SERVER, BACKEND_CLASS = "a Bailing/Ling server", "LightningAttentionBackend"
LAYER_KIND = "lightning"
# hybrid(sglang.X,sglang.lightning): X is the full-attention leaf
COMPOSITION = re.compile(r"^hybrid\(sglang\.(\w+),sglang\.lightning\)$")
MODES = ("extend", "mixed", "decode", "target_verify", "idle")
KIT_MODULE, KIT_NAME = "lightning_attention", "lightning unit-test kit"
# The first SGLang release checked to run these files (the lightning kit's runner with these arguments)
KIT_SINCE = "0.5.22"
STEP = {"extend": "a prefill (extend) step", "mixed": "a mixed prefill+decode step (--enable-mixed-chunk)",
        "decode": "a decode step", "target_verify": "the target model's verify of an EAGLE draft chain",
        "idle": "an idle step (a data-parallel attention rank without requests while the others run: "
                "--enable-dp-attention)"}


def server_configuration(full: str, spec, call) -> str:
    parts = [f"python -m sglang.launch_server --attention-backend {full}"]
    if spec.page_size > 1:
        parts.append(f"--page-size {spec.page_size}")
    if spec.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {spec.kv_cache_dtype}")
    if spec.spec is not None:
        parts.append(f"--speculative-algorithm {SERVER_ALGORITHMS[spec.spec.algorithm]} --speculative-num-steps "
                     f"{spec.spec.spec_steps} --speculative-eagle-topk {spec.spec.topk} "
                     f"--speculative-num-draft-tokens {spec.spec.draft_token_num}")
    layer = call.layer
    full_layers = (f"full attention at layers {layer['full_attn_layers']}" if layer["full_attn_layers"] else
                   "no full-attention layer in this case")
    model = (f"a Bailing/Ling-style hybrid model (lightning linear layers, {full_layers}; SGLang wraps the "
             f"backends in HybridLinearAttnBackend), its lightning layer "
             f"{call.layer_id} of {layer['num_hidden_layers']} with {layer['num_heads']} heads of dim "
             f"{layer['head_dim']}, dtype {spec.dtype}")
    return f"{' '.join(parts)}, {model}; {STEP[spec.mode.value]}"


# The file's template (a string.Template's text; harness/export.py fills it). $kit_import: the import of the kit's
# lightning_attention module as ``kit`` (harness/export.py, KIT_IMPORT); $check: harness/export.py's LINEAR_CHECK
TEMPLATE = '''${kit_import}from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.lightning_backend import LightningAttentionBackend
from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import $forward_batch_names
from sglang.srt.runtime_context import get_parallel
$speculative_imports
# One attention rank, no decode context parallelism: the lightning kit states the first, the full-attention backends
# read the second (SGLang's dense kit states both the same way, for the whole process)
_PARALLEL = get_parallel().override(attn_tp_size=1, attn_tp_rank=0, attn_dcp_rank=0)
_PARALLEL.__enter__()

FULL_BACKEND = "$full"  # the server's --attention-backend: the hybrid's full-attention child
MODE = ForwardMode.$mode_upper
DTYPE = torch.$dtype  # the model's dtype (the lightning layer is handed q, k, v in float32 whatever it is)
PAGE_SIZE = $page_size
PREFIX_LENS = $prefix_lens  # tokens each request has before this batch (its state holds them)
NEW_LENS = $new_lens  # tokens this batch adds per request (the rows of q, k, v)
# The lightning layer (harness layer $layer_id) as RadixAttention is built, the model's layer count and whether
# its decay rates scale with depth (Bailing's lightning_layerwise_decay), and the hybrid's full-attention layers
LAYER = $layer
LAYER_ID = $layer_id
KV_CACHE_DTYPE = "$kv_cache_dtype"  # SGLang's --kv-cache-dtype (a linear layer keeps no KV cache)
DRAFT_TOKENS = $draft_tokens  # a verify's draft tokens per request (--speculative-num-draft-tokens)
$bounds

# q, k, v [T, H, D] as the model handed them; states [B, H, K, V]: each request's state in SGLang's pool before
# the layer (key-major, as LightningAttentionBackend keeps it)
$data
$speculative$interpreter_cast

def decay_rates():
    """Each head's decay rate lambda, float64: ALiBi's slopes for H heads (2^(-8/H), 2^(-16/H), ...; for H not a
    power of two, those of the power of two below, then every other one of twice as many), scaled by the
    layer's depth in the model, 1 - layer / (layers - 1) + 1e-5, when the model decays layer-wise."""
    def power_of_two(m):
        first = 2.0 ** (-8.0 / m)
        return [first ** (i + 1) for i in range(m)]

    n = LAYER["num_heads"]
    if n & (n - 1) == 0:
        slopes = power_of_two(n)
    else:
        below = 1 << (n.bit_length() - 1)
        slopes = power_of_two(below) + power_of_two(2 * below)[0::2][:n - below]
    rates = torch.tensor(slopes, dtype=torch.float64)
    if not LAYER["layerwise_decay"]:
        return rates
    if LAYER["num_hidden_layers"] <= 1:
        return rates * (1 + 1e-5)
    return rates * (1 - LAYER_ID / (LAYER["num_hidden_layers"] - 1) + 1e-5)


def reference(q, k, v, state):
    """Float64 lightning attention of one request's tokens from its state: per head, each token t does
    S = exp(-lambda) * S + outer(k_t, v_t), then o_t = scaling * q_t S. Returns the outputs [n, H, V] and the
    state after each token [n, H, K, V]."""
    keep = torch.exp(-decay_rates())[:, None, None]
    S, outputs, states = state.double().clone(), [], []
    for t in range(q.shape[0]):
        S = keep * S + torch.einsum("hk,hv->hkv", k[t].double(), v[t].double())
        outputs.append(LAYER["scaling"] * torch.einsum("hk,hkv->hv", q[t].double(), S))
        states.append(S)
    if not outputs:
        return q.new_zeros(0, *v.shape[1:], dtype=torch.float64), S.new_zeros(0, *S.shape)
    return torch.stack(outputs), torch.stack(states)


$check

$build_backend


def test_lightning_outputs_and_states_match_float64():
    torch.manual_seed(0)
    batch = len(PREFIX_LENS)
    H, D = LAYER["num_heads"], LAYER["head_dim"]
    seq_lens = [p + n for p, n in zip(PREFIX_LENS, NEW_LENS)]
    max_context_len = -(-max(seq_lens + [1]) // PAGE_SIZE) * PAGE_SIZE
    case = kit.LightningAttentionCase(name="harness_export", backend=FULL_BACKEND, forward_mode=MODE, num_heads=H,
                                      page_size=PAGE_SIZE, prefix_lens=tuple(PREFIX_LENS),
                                      extend_lens=() if MODE.is_decode() else tuple(NEW_LENS))
    config = kit.TinyLightningModelConfig(num_heads=H, head_dim=D, context_len=max_context_len,
                                          num_hidden_layers=LAYER["num_hidden_layers"])
    config.hf_config.lightning_layerwise_decay = LAYER["layerwise_decay"]
    runner = kit.MockLightningModelRunner(case=case, model_config=config, dtype=DTYPE, device=DEVICE,
                                          max_context_len=max_context_len, head_dim=D,
                                          runner_batch_size=max(batch, 1))
    # The kit's state pool holds one lightning layer, as layer 0; a server's holds each by its layer id (the
    # decay rates are the layer's), so the pool is built again, as the kit builds it, for layer LAYER_ID.
    size = max(batch, 1)
    runner.req_to_token_pool = HybridReqToTokenPool(
        size=size, mamba_size=size, mamba_spec_state_size=size, max_context_len=max_context_len, device=DEVICE,
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(
            shape=Mamba2StateShape.create(tp_world_size=1, intermediate_size=0, n_groups=0, num_heads=H, head_dim=D,
                                          state_size=D, conv_kernel=1),
            layers=[LAYER_ID], dtype=Mamba2StateDType(conv=DTYPE, temporal=torch.float32)),
        mamba_layer_ids=[LAYER_ID], enable_mamba_extra_buffer=False, speculative_num_draft_tokens=DRAFT_TOKENS,
        enable_overlap_schedule=False)
    runner.init_kv_index_translator()
    if KV_CACHE_DTYPE == "fp8_e4m3":  # what --kv-cache-dtype sets on the model runner, which backends read
        runner.kv_cache_dtype, runner.kv_cache_dtype_str = torch.float8_e4m3fn, KV_CACHE_DTYPE
$speculative_runner    backend = build_backend(runner)
    layer = RadixAttention(num_heads=H, head_dim=D, scaling=LAYER["scaling"], num_kv_heads=H, layer_id=LAYER_ID)
    forward_batch = kit._make_forward_batch(case, runner, max_context_len=max_context_len, device=DEVICE)
$use_speculative    cache = runner.req_to_token_pool.mamba2_layer_cache(LAYER_ID)
    slots = runner.req_to_token_pool.req_index_to_mamba_index_mapping[forward_batch.req_pool_indices].long()
    cache.temporal[slots] = TENSORS["states"].to(DEVICE, cache.temporal.dtype)
    q, k, v = (TENSORS[name].to(DEVICE) for name in ("q", "k", "v"))
    T = q.shape[0]
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(forward_batch)
        # As Bailing's lightning layer calls it: q by heads, k and v flat (models/bailing_moe_linear.py)
        out = layer(q, k.reshape(T, H * D), v.reshape(T, H * D), forward_batch)
    assert out.shape[0] == T, f"{out.shape[0]} output rows for {T} tokens"
    out = out.reshape(T, H, D)

    expected, steps, token = [], [], 0
    for r in range(batch):
        o, s = reference(q[token:token + NEW_LENS[r]].cpu(), k[token:token + NEW_LENS[r]].cpu(),
                         v[token:token + NEW_LENS[r]].cpu(), TENSORS["states"][r])
        expected.append(o)
        steps.append(s)
        token += NEW_LENS[r]
    check(out, torch.cat(expected) if expected else out.new_zeros(0, H, D).double().cpu(), REL_L2_BOUND,
          ELEMENT_FACTOR, f"lightning layer {LAYER_ID} outputs")
    for r in range(batch):
        if MODE.is_target_verify():  # SGLang keeps a verify's per-token states by batch row, the request's state intact
            check(cache.intermediate_ssm[r, :NEW_LENS[r]], steps[r], STATE_REL_L2_BOUND, STATE_ELEMENT_FACTOR,
                  f"request {r} state after each draft token")
        else:
            check(cache.temporal[slots[r]], steps[r][-1] if NEW_LENS[r] else TENSORS["states"][r].double(),
                  STATE_REL_L2_BOUND, STATE_ELEMENT_FACTOR, f"request {r} state after the batch")
'''
