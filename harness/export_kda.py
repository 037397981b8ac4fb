"""``harness export`` of a KDA layer under SGLang's hybrid wrapper: ``hybrid(sglang.X,sglang.kda)`` (X a dense leaf),
the ``outputs`` property, in EXTEND, MIXED or DECODE, over an ``auto`` or an ``fp8_e4m3`` KV cache (the full-attention
layers' cache: a KDA layer keeps none, and the file sets the server's choice on the runner as SGLang does).

The file builds SGLang's classes as a Kimi Linear server does, with SGLang's KDA unit-test kit
(``sglang.test.kits.attention_unittest.attention_methods.kda_attention``: its ``MockKDAModelRunner``,
``TinyKDAModelConfig``, ``KDAAttentionCase``, ``_make_forward_batch``): the full-attention backend the server names,
``KDAAttnBackend``, and ``HybridLinearAttnBackend`` over the two with the model's full-attention layers. It loads what
SGLang was handed when the harness replayed the case: the layer's ``RadixLinearAttention`` parameters (its conv
weights, ``A_log``, ``dt_bias``, the safe gate's bound), its inputs as Kimi Linear's ``KimiDeltaAttention`` hands them
over (``mixed_qkv`` q|k|v before the conv, the forget gate's raw input ``a``, the step size's raw input ``b``), and
each request's conv and recurrent states as SGLang's pool held them before the layer. It runs the one layer under
SGLang's forward context, and checks what the harness's ``outputs`` property checks: the output rows, and each
request's recurrent and conv states after the batch, against a float64 KDA layer written out in the file (the conv
with its carried window and SiLU, L2-normalised q and k, the per-channel gate, the delta rule one token at a time),
with the harness's bounds and their reason. On a CPU the file also installs the harness's corrections of Triton's
interpreter for the fla kernels SGLang vendors (backends/sglang/interpreter_shims.py, copied in).

This module holds what is particular to these files (which cases they cover, the recording of a call, the file's
template, the server line); harness/export.py replays the case, measures and renders, as for every other kind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# What the file checks besides the outputs (its bounds block, harness/export.py LINEAR_BOUNDS)
STATES = "Each request's recurrent and conv states after the batch"
NAME = "KDA"  # in the refusal lines of export
MODES_NOTE = " (a verify's per-token states are not exported yet)"  # why the other modes are refused
# Who builds the hybrid, and its linear child (harness/export.py LINEAR_BUILD)
SERVER, BACKEND_CLASS = "a Kimi Linear server", "KDAAttnBackend"
LAYER_KIND = "kda"
# hybrid(sglang.X,sglang.kda): X is the full-attention leaf
COMPOSITION = re.compile(r"^hybrid\(sglang\.(\w+),sglang\.kda\)$")
MODES = ("extend", "mixed", "decode")
KIT_MODULE, KIT_NAME = "kda_attention", "KDA unit-test kit"
# The first SGLang release checked to run these files (the KDA kit's runner with these arguments)
KIT_SINCE = "0.5.22"
STEP = {"extend": "a prefill (extend) step", "mixed": "a mixed prefill+decode step (--enable-mixed-chunk)",
        "decode": "a decode step"}


@dataclass
class KdaCall:
    """What SGLang was handed for one KDA layer of one batch: the layer's inputs as Kimi Linear hands them to its
    ``RadixLinearAttention`` (before the model's reshape of the gates), the layer's parameters, and each request's
    states at its slot before the layer, in SGLang's layouts."""

    layer_id: int
    mixed_qkv: torch.Tensor  # [T, 2 H K + H V]: q | k | v before the conv, the model's dtype
    a: torch.Tensor  # [T, H K]: the forget gate's raw input
    b: torch.Tensor  # [T, H]: the step size's raw input
    conv_weight: torch.Tensor  # [conv_dim, W]
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H K]
    layer: dict  # head counts and dims, the activation, the safe gate's bound, the hybrid's full-attention layers
    conv_states: torch.Tensor  # [B, W - 1, conv_dim]: token-major, oldest first, as SGLang's KDA pool keeps them
    ssm_states: torch.Tensor  # [B, H, V, K]: value-major, as SGLang's KDA pool keeps them


def record(block, projected, sfb, pool, full_attn_layers) -> KdaCall:
    """A KDA layer's call, read as the model hands it to SGLang (``call_layer``'s ``projected``: q|k|v, beta, the
    forget gate, the norm's gate), with the parameters of its ``RadixLinearAttention`` and each request's states at
    the slot SGLang's request pool maps it to."""
    mixed_qkv, b, a, _ = projected
    attn = block.attn
    rows = sfb.req_pool_indices[:sfb.batch_size]
    slots = pool.req_index_to_mamba_index_mapping[rows].long()
    cache = pool.mamba2_layer_cache(attn.layer_id)
    conv = attn.conv_weights
    return KdaCall(
        attn.layer_id, mixed_qkv.detach().cpu().clone(), a.detach().cpu().clone(), b.detach().cpu().clone(),
        conv.detach().cpu().clone(), attn.A_log.detach().reshape(-1).cpu().clone(),
        attn.dt_bias.detach().reshape(-1).cpu().clone(),
        {"num_heads": attn.num_v_heads, "head_k_dim": attn.head_k_dim, "head_v_dim": attn.head_v_dim,
         "activation": attn.activation, "lower_bound": getattr(attn, "lower_bound", None),
         "full_attn_layers": [int(i) for i in full_attn_layers]},
        cache.conv[0][slots].detach().cpu().clone(), cache.temporal[slots].detach().cpu().clone())


def tensors(call: KdaCall) -> dict[str, torch.Tensor]:
    return {"mixed_qkv": call.mixed_qkv, "a": call.a, "b": call.b, "conv_weight": call.conv_weight, "A_log": call.A_log,
            "dt_bias": call.dt_bias, "conv_states": call.conv_states, "ssm_states": call.ssm_states}


def server_configuration(full: str, spec, call: KdaCall) -> str:
    parts = [f"python -m sglang.launch_server --attention-backend {full}"]
    if spec.page_size > 1:
        parts.append(f"--page-size {spec.page_size}")
    if spec.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {spec.kv_cache_dtype}")
    layer = call.layer
    full_layers = (f"full attention at layers {layer['full_attn_layers']}" if layer["full_attn_layers"] else
                   "no full-attention layer in this case")
    gate = ("the standard forget gate" if layer["lower_bound"] is None else
            f"the safe forget gate (lower_bound {layer['lower_bound']})")
    conv_dim, width = call.conv_weight.shape
    model = (f"a Kimi Linear-style hybrid model (KDA linear layers, {full_layers}; SGLang wraps the backends in "
             f"HybridLinearAttnBackend), its KDA layer {call.layer_id} with {layer['num_heads']} heads, key dim "
             f"{layer['head_k_dim']}, value dim {layer['head_v_dim']}, a conv of width {width}, {gate}, dtype "
             f"{spec.dtype}")
    return f"{' '.join(parts)}, {model}; {STEP[spec.mode.value]}"


def fields(call: KdaCall, spec) -> dict[str, str]:
    """The template's fields particular to a KDA file."""
    return {"layer": repr(call.layer), "conv_width": str(call.conv_weight.shape[1]),
            "kv_cache_dtype": spec.kv_cache_dtype}


# The file's template (a string.Template's text; harness/export.py fills it). $kit_import: the import of the kit's
# kda_attention module as ``kit`` (harness/export.py, KIT_IMPORT); $check: harness/export.py's LINEAR_CHECK;
# $interpreter: on a CPU, the harness's corrections of Triton's interpreter (harness/export.py, _kda_interpreter)
TEMPLATE = '''${kit_import}from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape, Mamba2StateDType
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
$interpreter
FULL_BACKEND = "$full"  # the server's --attention-backend: the hybrid's full-attention child
MODE = ForwardMode.$mode_upper
DTYPE = torch.$dtype  # the model's dtype: of mixed_qkv, a, b and the conv states
PAGE_SIZE = $page_size
PREFIX_LENS = $prefix_lens  # tokens each request has before this batch (its states hold them)
NEW_LENS = $new_lens  # tokens this batch adds per request (the rows of mixed_qkv)
# The KDA layer (harness layer $layer_id) as its RadixLinearAttention is built (H heads, key dim K, value dim V), and
# the hybrid's full-attention layers
LAYER = $layer
LAYER_ID = $layer_id
CONV_WIDTH = $conv_width
KV_CACHE_DTYPE = "$kv_cache_dtype"  # SGLang's --kv-cache-dtype (the full-attention layers' cache; a KDA layer has none)
$bounds

# mixed_qkv [T, 2HK + HV] (q heads, k heads, v heads, before the conv), a [T, HK], b [T, H] as Kimi Linear's layer
# hands them over; the layer's conv_weight [2HK + HV, W], A_log [H], dt_bias [HK]; each request's states in SGLang's
# pool before the layer: conv_states [B, W - 1, 2HK + HV] (oldest input first), ssm_states [B, H, V, K]
$data

def reference(mixed_qkv, a, b, conv_state, ssm_state):
    """Float64 KDA layer (Kimi Linear, arXiv:2510.26692) of one request's tokens from its states: a causal depthwise
    conv over q|k|v continuing the carried window, then SiLU; q and k L2-normalised per head (x / sqrt(|x|^2 + 1e-6));
    beta = sigmoid(b); the per-channel log-decay g = -exp(A_log) * softplus(a + dt_bias), or with the safe gate
    lower_bound * sigmoid(exp(A_log) * (a + dt_bias)); then per head, token by token, with S [K, V]:
    S = diag(exp(g_t)) S; S = S + outer(k_t, beta_t (v_t - k_t S)); o_t = K^-0.5 q_t S.
    Returns the outputs [n, H, V], the recurrent state after the last token [H, V, K] and the conv window [W-1, C]
    (SGLang's layouts)."""
    H, K, V = LAYER["num_heads"], LAYER["head_k_dim"], LAYER["head_v_dim"]
    n = mixed_qkv.shape[0]
    weight = TENSORS["conv_weight"].double()
    window = torch.cat([conv_state.double(), mixed_qkv.double()])  # [W - 1 + n, C], oldest first
    conv = torch.stack([(window[t:t + CONV_WIDTH] * weight.T).sum(0) for t in range(n)]) if n else window[:0]
    y = conv * torch.sigmoid(conv) if LAYER["activation"] in ("silu", "swish") else conv
    q, k, v = y[:, :H * K].reshape(n, H, K), y[:, H * K:2 * H * K].reshape(n, H, K), y[:, 2 * H * K:].reshape(n, H, V)
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    x = a.double().reshape(n, H, K) + TENSORS["dt_bias"].double().reshape(H, K)
    A = torch.exp(TENSORS["A_log"].double())[:, None]
    g = -A * torch.nn.functional.softplus(x) if LAYER["lower_bound"] is None else \\
        LAYER["lower_bound"] * torch.sigmoid(A * x)
    beta = torch.sigmoid(b.double().reshape(n, H))
    S = ssm_state.double().transpose(-1, -2).clone()  # [H, K, V]
    outputs = []
    for t in range(n):
        S = torch.exp(g[t])[:, :, None] * S
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S)))
        outputs.append(K ** -0.5 * torch.einsum("hk,hkv->hv", q[t], S))
    o = torch.stack(outputs) if outputs else torch.zeros(0, H, V, dtype=torch.float64)
    return o, S.transpose(-1, -2), window[n:]

$check

$build_backend


def test_kda_outputs_and_states_match_float64():
    torch.manual_seed(0)
    batch = len(PREFIX_LENS)
    H, K, V = LAYER["num_heads"], LAYER["head_k_dim"], LAYER["head_v_dim"]
    seq_lens = [p + n for p, n in zip(PREFIX_LENS, NEW_LENS)]
    max_context_len = -(-max(seq_lens + [1]) // PAGE_SIZE) * PAGE_SIZE
    case = kit.KDAAttentionCase(name="harness_export", backend=FULL_BACKEND, forward_mode=MODE, num_k_heads=H,
                                num_v_heads=H, page_size=PAGE_SIZE, prefix_lens=tuple(PREFIX_LENS),
                                extend_lens=() if MODE.is_decode() else tuple(NEW_LENS))
    config = kit.TinyKDAModelConfig(num_heads=H, head_dim=K, context_len=max_context_len)
    runner = kit.MockKDAModelRunner(case=case, model_config=config, dtype=DTYPE, device=DEVICE,
                                    max_context_len=max_context_len, head_dim=K, head_k_dim=K, head_v_dim=V,
                                    runner_batch_size=max(batch, 1))
    # The kit's state pool holds one KDA layer, as layer 0, with a conv of width 2; a server's holds each by its layer
    # id with the model's conv width, so the pool is built again, as the kit builds it, for layer LAYER_ID.
    size = max(batch, 1)
    runner.req_to_token_pool = HybridReqToTokenPool(
        size=size, mamba_size=size, mamba_spec_state_size=size, max_context_len=max_context_len, device=DEVICE,
        enable_memory_saver=False,
        cache_params=KimiLinearCacheParams(
            shape=KimiLinearStateShape.create(tp_world_size=1, num_heads=H, head_dim=V, num_k_heads=H, head_k_dim=K,
                                              conv_kernel_size=CONV_WIDTH),
            layers=[LAYER_ID], dtype=Mamba2StateDType(conv=DTYPE, temporal=torch.float32)),
        mamba_layer_ids=[LAYER_ID], enable_mamba_extra_buffer=False, speculative_num_draft_tokens=None,
        enable_overlap_schedule=False)
    runner.init_kv_index_translator()
    if KV_CACHE_DTYPE == "fp8_e4m3":  # what --kv-cache-dtype sets on the model runner, which backends read
        runner.kv_cache_dtype, runner.kv_cache_dtype_str = torch.float8_e4m3fn, KV_CACHE_DTYPE
    backend = build_backend(runner)
    # Kimi Linear's KimiDeltaAttention builds it so (models/kimi_linear.py): A_log [1, 1, H, 1] and dt_bias float32
    gate = {} if LAYER["lower_bound"] is None else {"lower_bound": LAYER["lower_bound"]}
    layer = RadixLinearAttention(
        layer_id=LAYER_ID, num_q_heads=H, num_k_heads=H, num_v_heads=H, head_q_dim=K, head_k_dim=K, head_v_dim=V,
        conv_weights=TENSORS["conv_weight"].to(DEVICE), bias=None, activation=LAYER["activation"],
        A_log=TENSORS["A_log"].to(DEVICE).reshape(1, 1, H, 1), dt_bias=TENSORS["dt_bias"].to(DEVICE), **gate)
    forward_batch = kit._make_forward_batch(case, runner, max_context_len=max_context_len, device=DEVICE)
    cache = runner.req_to_token_pool.mamba2_layer_cache(LAYER_ID)
    slots = runner.req_to_token_pool.req_index_to_mamba_index_mapping[forward_batch.req_pool_indices].long()
    cache.conv[0][slots] = TENSORS["conv_states"].to(DEVICE, cache.conv[0].dtype)
    cache.temporal[slots] = TENSORS["ssm_states"].to(DEVICE, cache.temporal.dtype)
    mixed_qkv, a, b = (TENSORS[name].to(DEVICE) for name in ("mixed_qkv", "a", "b"))
    T = mixed_qkv.shape[0]
    # As KimiDeltaAttention hands them over: the gate per head [1, T, H, K] outside decode, beta [1, T, H]
    gate_in = a if MODE.is_decode() else a.unflatten(-1, (H, K)).unsqueeze(0)
    with torch.no_grad(), kit.forward_context(kit.ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(forward_batch)
        out = layer(forward_batch, mixed_qkv=mixed_qkv, a=gate_in, b=b.unsqueeze(0))
    out = out.reshape(-1, H, V)
    assert out.shape[0] == T, f"{out.shape[0]} output rows for {T} tokens"

    expected, token = [], 0
    for r in range(batch):
        rows = slice(token, token + NEW_LENS[r])
        o, ssm, conv = reference(mixed_qkv[rows].cpu(), a[rows].cpu(), b[rows].cpu(), TENSORS["conv_states"][r],
                                 TENSORS["ssm_states"][r])
        expected.append((o, ssm, conv))
        token += NEW_LENS[r]
    check(out, torch.cat([e[0] for e in expected]) if expected else out.new_zeros(0, H, V).double().cpu(),
          REL_L2_BOUND, ELEMENT_FACTOR, f"KDA layer {LAYER_ID} outputs")
    for r, (_, ssm, conv) in enumerate(expected):
        check(cache.temporal[slots[r]], ssm, STATE_REL_L2_BOUND, STATE_ELEMENT_FACTOR,
              f"request {r} recurrent state after the batch")
        check(cache.conv[0][slots[r]], conv, STATE_REL_L2_BOUND, STATE_ELEMENT_FACTOR,
              f"request {r} conv state after the batch")
'''
