"""`magicdec_cpu`: an SGLang attention backend that reads an explicit KV-slot list per request.

Registered in SGLang's attention registry by the plugin and chosen by default on our CPU platform.
Decode, target-verify and the MagicDec draft's decode steps (which hand in their own slots
through `spec_info.head_slots / kv_lens`, per layer and KV head, padded) run the native kernel
(`magicdec_kernels.cpu_native`): each (request, KV head) read once for all its query rows.
Extend (prefill chunks, compute-bound) reduces to `index_attention_torch` over each request's
slot list, planned once per forward (shared by every layer).

`magicdec_cpu_torch` is the same backend on torch ops alone (`index_attention_torch` for decode
and verify, `sparse_decode_attention` for the draft), and what `magicdec_cpu` falls back to, with
one logged line, where the native kernel is not built or the CPU lacks AVX2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from magicdec_kernels import cpu_native
from magicdec_kernels.index_attention import AttentionPlan, index_attention_torch, plan_requests
from magicdec_kernels.sparse_decode import sparse_decode_attention
from sglang_magicdec.model import unsupported_attention
from sglang_magicdec.platforms import ATTENTION_BACKEND

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass
class SlotLists:
    """Per-forward attention metadata: ragged query rows and KV slots of each request."""

    q_indptr: torch.Tensor  # CPU int64 [batch + 1]
    kv_indptr: torch.Tensor  # CPU int64 [batch + 1]
    kv_indices: torch.Tensor  # int64 [total] on the KV device
    plan: AttentionPlan  # how the keys are read, shared by all layers


@dataclass
class DraftSlots:
    """A MagicDec draft step: request b's KV head h in layer l reads
    head_slots[l, b, h, :kv_lens[b]] (dims of size 1 broadcast)."""

    head_slots: torch.Tensor
    kv_lens: torch.Tensor
    q_indptr: torch.Tensor  # [B + 1]: one query row per request


@dataclass
class PaddedSlots:
    """Decode or verify for the native kernel: request b's query rows q_indptr[b]..[b+1] read
    head_slots[b, 0, :kv_lens[b]], its committed slots then its query tokens' own."""

    q_indptr: torch.Tensor
    head_slots: torch.Tensor  # [B, 1, W] int64
    kv_lens: torch.Tensor


def padded_slot_lists(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    prefix_lens: list[int],
    q_lens: list[int],
    out_cache_loc: torch.Tensor,
) -> PaddedSlots:
    """`build_slot_lists`'s lists, padded to one width (one gather of the rows for the batch)."""
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    width = max(kv_lens, default=0)
    head_slots = req_to_token[req_pool_indices, :width].to(torch.int64)
    q_start = 0
    for b, (prefix_len, q_len) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        head_slots[b, prefix_len : prefix_len + q_len] = out_cache_loc[q_start : q_start + q_len]
        q_start += q_len
    q_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    q_indptr[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0)
    return PaddedSlots(q_indptr, head_slots[:, None], torch.tensor(kv_lens, dtype=torch.int64))


def build_slot_lists(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    prefix_lens: list[int],
    q_lens: list[int],
    out_cache_loc: torch.Tensor,
) -> SlotLists:
    """Each request attends to its `prefix_len` cached slots, then to the slots just written
    for its `q_len` new tokens (`out_cache_loc`, requests back to back)."""
    q_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    q_indptr[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0)
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    kv_indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.tensor(kv_lens, dtype=torch.int64).cumsum(0)
    pieces = []
    q_bounds = q_indptr.tolist()
    for r, (pool_idx, prefix_len) in enumerate(zip(req_pool_indices, prefix_lens, strict=True)):
        pieces.append(req_to_token[pool_idx, :prefix_len])
        pieces.append(out_cache_loc[q_bounds[r] : q_bounds[r + 1]])
    kv_indices = torch.cat(pieces).to(torch.int64) if pieces else out_cache_loc.new_empty(0)
    return SlotLists(
        q_indptr, kv_indptr, kv_indices, plan_requests(q_indptr, kv_indptr, kv_indices)
    )


class IndexAttnBackend(AttentionBackend):
    """Torch attention over explicit slot lists, for CPU (see module docstring)."""

    def __init__(self, model_runner: ModelRunner, native: bool):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        # `native()` logs, once, why the kernel cannot run when it cannot.
        self.native = native and cpu_native.native() is not None
        self.forward_metadata: SlotLists | PaddedSlots | DraftSlots | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        spec_info = forward_batch.spec_info
        batch = forward_batch.batch_size
        if mode.is_decode() and getattr(spec_info, "head_slots", None) is not None:
            self.forward_metadata = DraftSlots(
                spec_info.head_slots, spec_info.kv_lens, torch.arange(batch + 1)
            )
            return
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        if mode.is_decode():
            q_lens = [1] * batch
            prefix_lens = [s - 1 for s in seq_lens]
        elif mode.is_target_verify():
            q_lens = [spec_info.draft_token_num] * batch
            prefix_lens = seq_lens
        else:
            q_lens = list(forward_batch.extend_seq_lens_cpu)
            prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
        build = build_slot_lists
        if self.native and (mode.is_decode() or mode.is_target_verify()):
            build = padded_slot_lists
        self.forward_metadata = build(
            self.req_to_token,
            forward_batch.req_pool_indices.tolist(),
            prefix_lens,
            q_lens,
            forward_batch.out_cache_loc,
        )

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        unsupported = unsupported_attention(layer)
        if unsupported is not None:
            raise NotImplementedError(
                f"magicdec_cpu computes plain causal self-attention, not {unsupported}"
            )
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
            )
        meta = self.forward_metadata
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if isinstance(meta, DraftSlots):
            head_slots = meta.head_slots[layer.layer_id if meta.head_slots.shape[0] > 1 else 0]
            if self.native:
                cpu_native.slot_attention(
                    q, k_cache, v_cache, meta.q_indptr, head_slots, meta.kv_lens,
                    layer.scaling, out,
                )  # fmt: skip
            else:
                head_slots = head_slots.expand(-1, layer.tp_k_head_num, -1)
                sparse_decode_attention(
                    q, k_cache, v_cache, head_slots, meta.kv_lens, layer.scaling, out=out
                )
            return out.view(q.shape[0], -1)
        if isinstance(meta, PaddedSlots):
            # The native kernel, or its torch reference for shapes it does not take (head dims
            # not a multiple of 16, fp16): same lists, same result.
            cpu_native.slot_attention(
                q, k_cache, v_cache, meta.q_indptr, meta.head_slots, meta.kv_lens,
                layer.scaling, out,
            )  # fmt: skip
            return out.view(q.shape[0], -1)
        index_attention_torch(
            q,
            k_cache,
            v_cache,
            meta.q_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            layer.scaling,
            out=out,
            plan=meta.plan,
        )
        return out.view(q.shape[0], -1)

    forward_decode = _forward
    forward_extend = _forward

    def support_triton(self) -> bool:
        return False


def create_backend(model_runner: ModelRunner, name: str = ATTENTION_BACKEND) -> IndexAttnBackend:
    return IndexAttnBackend(model_runner, native=name == ATTENTION_BACKEND)
