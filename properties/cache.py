"""Cache writes land exactly at ``out_cache_loc``; nothing else in the pools changes.

The KV pool after the forward must equal the snapshot taken before it, except that the slots of the new
tokens hold exactly the K/V the model handed over (MLA: the latent row); an fp8 cache holds them divided by
the layer's scale, in e4m3, compared bit for bit. Linear-attention pools may change
only at the batch's state slots (in TARGET_VERIFY only the intermediate pools may change, and only there, unless
the backend declares that verify advances the conv state to the last draft token's window).
"""

from __future__ import annotations

import torch

from backends.registry import Composition
from batch.spec import BatchSpec, is_recurrent
from engine.model import mha_qkv, mla_latent
from properties.run import run_case
from properties.verdict import Verdict

NAME = "cache"


def _first_difference(actual: torch.Tensor, expected: torch.Tensor) -> int | None:
    rows = (actual != expected).reshape(actual.shape[0], -1).any(dim=1)
    idx = torch.nonzero(rows)
    return int(idx[0]) if idx.numel() else None


def cache_writes_exact(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    run = run_case(composition, spec, device)
    case, fb = run.case, run.case.forward_batch
    loc = fb.out_cache_loc
    loc_list = loc.tolist()
    for layer, inp in zip(spec.layers, case.inputs):
        if is_recurrent(layer):  # a state, not a KV cache (properties/outputs.py compares states)
            continue
        before = case.kv_pool_before
        expected_k = before.k_buffers[layer.layer_id].clone()
        expected_v = None if before.v_buffers[layer.layer_id] is None else before.v_buffers[layer.layer_id].clone()
        if loc.numel():
            if layer.kind == "mha":
                _, k, v = mha_qkv(layer, inp, fb, spec.mrope_sections)
                if spec.kv_cache_dtype == "fp8_e4m3":  # the stored value is x / scale, in e4m3
                    k, v = k / layer.k_scale, v / layer.v_scale
                expected_k[loc], expected_v[loc] = k.to(expected_k.dtype), v.to(expected_v.dtype)
            else:
                expected_k[loc] = mla_latent(layer, inp, fb, spec.mrope_sections).to(expected_k.dtype)
        for name, actual, expected in (("k", fb.token_to_kv_pool.k_buffers[layer.layer_id], expected_k),
                                       ("v", fb.token_to_kv_pool.v_buffers[layer.layer_id], expected_v)):
            if expected is None:
                continue
            slot = _first_difference(actual, expected)
            if slot is not None:
                if slot in loc_list:
                    token = loc_list.index(slot)
                    why = f"slot {slot} (new token row {token}) does not hold the new {name}"
                else:
                    why = f"slot {slot}, not in out_cache_loc, changed"
                return Verdict(NAME, False, f"layer {layer.layer_id} {name}_buffer: {why}", where=f"slot {slot}")
    if fb.mamba_pool is not None:
        batch_slots = set(fb.state_slots.tolist())
        before, after = case.mamba_pool_before, fb.mamba_pool
        verify = spec.mode.is_target_verify()
        # Declared (Capabilities.verify_advances_conv_state): verify may move a batch slot's committed conv state
        # to the window after its last draft token, exactly the last per-step conv state it records.
        advances = verify and composition.support().verify_advances_conv_state
        last = dict(zip(fb.state_slots.tolist(), (n - 1 for n in spec.extend_lens)))
        groups = [("conv_states", before.conv_states, after.conv_states, verify),
                  ("ssm_states", before.ssm_states, after.ssm_states, verify),
                  ("intermediate_conv_states", before.intermediate_conv_states, after.intermediate_conv_states, not verify),
                  ("intermediate_ssm_states", before.intermediate_ssm_states, after.intermediate_ssm_states, not verify)]
        for name, b, a, frozen in groups:
            for layer_id in b:
                changed = (a[layer_id] != b[layer_id]).reshape(a[layer_id].shape[0], -1).any(dim=1)
                for slot in torch.nonzero(changed).flatten().tolist():
                    if advances and name == "conv_states" and slot in batch_slots and \
                            torch.equal(a[layer_id][slot], after.intermediate_conv_states[layer_id][slot, last[slot]]):
                        continue
                    if frozen or slot not in batch_slots:
                        return Verdict(NAME, False, f"layer {layer_id} {name}: slot {slot} changed but must not "
                                                    f"({'verify leaves it alone' if frozen else 'not a batch slot'})",
                                       where=f"state slot {slot}")
    return Verdict(NAME, True, "new K/V exactly at out_cache_loc; no other slot or state changed")
