"""Hybrid wrapper: full-attention layers to one backend, linear-attention layers to another.

Dispatch is by ``layer.layer_id in full_attn_layers``, never by the layer object's type (a linear layer
can arrive in the same wrapper class as an attention layer). A draft worker (MTP/NEXTN, all layer ids 0)
is built with ``full_attn_layers = [0]``.
"""

from __future__ import annotations

from backends.base import AttentionBackend, PlannedMetadata, call_accepting


class HybridLinearAttnBackend(AttentionBackend):
    is_wrapper = True

    def __init__(self, full_attn_backend: AttentionBackend, linear_attn_backend: AttentionBackend,
                 full_attn_layers: list[int]) -> None:
        self.full_attn_backend = full_attn_backend
        self.linear_attn_backend = linear_attn_backend
        self.full_attn_layers = set(full_attn_layers)

    @property
    def children(self) -> tuple[AttentionBackend, AttentionBackend]:
        """(full-attention backend, linear-attention backend)."""
        return self.full_attn_backend, self.linear_attn_backend

    def _backend_for(self, layer) -> AttentionBackend:
        return self.full_attn_backend if layer.layer_id in self.full_attn_layers else self.linear_attn_backend

    def init_forward_metadata(self, forward_batch) -> None:
        """Both children plan the whole batch."""
        self.full_attn_backend.init_forward_metadata(forward_batch)
        self.linear_attn_backend.init_forward_metadata(forward_batch)

    def init_mha_chunk_metadata(self, forward_batch, **kwargs) -> None:
        """The full-attention child's chunk plan, where it has one, with the keywords it accepts."""
        if hasattr(self.full_attn_backend, "init_mha_chunk_metadata"):
            call_accepting(self.full_attn_backend.init_mha_chunk_metadata, forward_batch, **kwargs)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        """``forward`` of the layer's child: the full-attention one for ids in ``full_attn_layers``, else the
        linear one (same arguments and result as the child's)."""
        return self._backend_for(layer).forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """The layer's child's ``forward_extend`` (chosen as in :meth:`forward`)."""
        return self._backend_for(layer).forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """The layer's child's ``forward_decode`` (chosen as in :meth:`forward`)."""
        return self._backend_for(layer).forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Both children."""
        for child in self.children:
            child.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Both children plan the graph batch."""
        for child in self.children:
            child.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Both children record their in-graph steps."""
        for child in self.children:
            child.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The full-attention child's."""
        return self.full_attn_backend.get_cuda_graph_seq_len_fill_value()

    @property
    def verify_mask(self):
        """The full-attention child's."""
        return self.full_attn_backend.verify_mask  # the linear side reads no mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Both children."""
        for child in self.children:
            child.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices=None,
                                            mamba_steps_to_track=None, model=None, req_pool_indices=None) -> None:
        """The linear child commits the verified states (SGLang's signature: the last accepted draft position per
        request, and the radix cache's tracked copies)."""
        self.linear_attn_backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model, req_pool_indices)

    def planned_metadata(self) -> PlannedMetadata:
        """The full-attention child's plan."""
        return self.full_attn_backend.planned_metadata()
