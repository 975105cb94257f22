"""`magicdec_cpu`: an SGLang attention backend that reads an explicit KV-slot list per request.

Registered in SGLang's attention registry by the plugin and chosen by default on our CPU platform.
Decode, target-verify and the MagicDec draft's decode steps are one operation, attention over
padded slot lists (`HeadSlots`: a draft step's per layer and KV head, from its spec input; a
decode or verify step's one list per request, its committed slots then its query tokens' own),
run by one entry, `cpu_native.slot_attention`: the native kernel, each (request, KV head) read
once for all its query rows. Extend (prefill chunks, compute-bound) runs the same kernel over the
same lists where the kernel takes the KV pool's tensors (faster there than torch's fused CPU
attention: `benchmark/results/HISTORY.md`, block 1). Elsewhere (and under
`magicdec_cpu_torch`, whose reference would materialise a chunk's scores) extend runs
`index_attention_torch` over each request's slot list, planned once per forward (shared by every
layer).

`magicdec_cpu_torch` is the same backend with `slot_attention`'s torch reference
(`slot_attention_torch`) for decode, verify and draft. `magicdec_cpu` runs that reference too
wherever the native kernel is not built, the CPU lacks AVX2, or the tensors are ones it does not
take (`cpu_native.slot_attention` decides, logging once why the kernel cannot run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from magicdec_kernels import cpu_native
from magicdec_kernels.index_attention import AttentionPlan, index_attention_torch, plan_requests
from magicdec_kernels.loader import native as native_kernels
from sglang_magicdec.launch_checks import unsupported_attention
from sglang_magicdec.platforms import ATTENTION_BACKEND
from sglang_magicdec.spec_info import HeadSlots, draft_slots

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass
class SlotAttention:
    """Decode, verify or a draft step: request b's query rows q_indptr[b]..[b+1] attend over its
    lists in `slots`."""

    q_indptr: torch.Tensor  # CPU int64 [B + 1]
    slots: HeadSlots


@dataclass
class ExtendLists:
    """An extend forward: ragged query rows and the KV slots of each request, flattened."""

    q_indptr: torch.Tensor  # CPU int64 [batch + 1]
    kv_indptr: torch.Tensor  # CPU int64 [batch + 1]
    kv_indices: torch.Tensor  # int64 [total] on the KV device
    plan: AttentionPlan  # how the keys are read, shared by all layers


def q_indptr_of(q_lens: list[int]) -> torch.Tensor:
    q_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    q_indptr[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0)
    return q_indptr


def request_slot_lists(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    prefix_lens: list[int],
    q_lens: list[int],
    out_cache_loc: torch.Tensor,
) -> SlotAttention:
    """Each request's `prefix_len` committed slots, then the slots just written for its `q_len`
    new tokens (`out_cache_loc`, requests back to back), padded to one width (one gather of the
    rows for the batch)."""
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    width = max(kv_lens, default=0)
    lists = req_to_token[req_pool_indices, :width].to(torch.int64)
    q_start = 0
    for b, (prefix_len, q_len) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        lists[b, prefix_len : prefix_len + q_len] = out_cache_loc[q_start : q_start + q_len]
        q_start += q_len
    slots = HeadSlots(lists[None, :, None], torch.tensor(kv_lens, dtype=torch.int64))
    return SlotAttention(q_indptr_of(q_lens), slots)


def extend_lists(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    prefix_lens: list[int],
    q_lens: list[int],
    out_cache_loc: torch.Tensor,
) -> ExtendLists:
    """The same lists, flattened and planned for `index_attention_torch`."""
    q_indptr = q_indptr_of(q_lens)
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    kv_indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.tensor(kv_lens, dtype=torch.int64).cumsum(0)
    pieces = []
    q_bounds = q_indptr.tolist()
    for r, (pool_idx, prefix_len) in enumerate(zip(req_pool_indices, prefix_lens, strict=True)):
        pieces.append(req_to_token[pool_idx, :prefix_len])
        pieces.append(out_cache_loc[q_bounds[r] : q_bounds[r + 1]])
    kv_indices = torch.cat(pieces).to(torch.int64) if pieces else out_cache_loc.new_empty(0)
    return ExtendLists(
        q_indptr, kv_indptr, kv_indices, plan_requests(q_indptr, kv_indptr, kv_indices)
    )


class IndexAttnBackend(AttentionBackend):
    """Attention over explicit slot lists, for CPU (see module docstring)."""

    def __init__(self, model_runner: ModelRunner, native: bool):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.attend = cpu_native.slot_attention if native else cpu_native.slot_attention_torch
        # Built or loaded now, not at the first forward (or why not, logged).
        kernels = native_kernels() if native else None
        pool, first_layer = self.token_to_kv_pool, getattr(self.token_to_kv_pool, "start_layer", 0)
        keys, values = pool.get_key_buffer(first_layer), pool.get_value_buffer(first_layer)
        query = torch.empty(0, 1, keys.shape[-1], dtype=model_runner.dtype)
        # Whether extend runs the kernel too: never its torch reference, which would hold a
        # prefill chunk's whole score matrix.
        self.native_extend = kernels is not None and cpu_native.supports_native(query, keys, values)
        self.forward_metadata: SlotAttention | ExtendLists | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        batch = forward_batch.batch_size
        draft = draft_slots(forward_batch)
        if draft is not None:
            self.forward_metadata = SlotAttention(torch.arange(batch + 1), draft)
            return
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        if mode.is_decode():
            q_lens = [1] * batch
            prefix_lens = [s - 1 for s in seq_lens]
        elif mode.is_target_verify():
            q_lens = [forward_batch.spec_info.draft_token_num] * batch
            prefix_lens = seq_lens
        else:
            q_lens = list(forward_batch.extend_seq_lens_cpu)
            prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
        slot_lists = self.native_extend or mode.is_decode() or mode.is_target_verify()
        build = request_slot_lists if slot_lists else extend_lists
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
        if isinstance(meta, SlotAttention):
            self.attend(
                q, k_cache, v_cache, meta.q_indptr, meta.slots.for_layer(layer.layer_id),
                meta.slots.kv_lens, layer.scaling, out,
            )  # fmt: skip
        else:
            index_attention_torch(
                q, k_cache, v_cache, meta.q_indptr, meta.kv_indptr, meta.kv_indices,
                layer.scaling, out=out, plan=meta.plan,
            )  # fmt: skip
        return out.view(q.shape[0], -1)

    forward_decode = _forward
    forward_extend = _forward

    def support_triton(self) -> bool:
        return False


def create_backend(model_runner: ModelRunner, name: str = ATTENTION_BACKEND) -> IndexAttnBackend:
    return IndexAttnBackend(model_runner, native=name == ATTENTION_BACKEND)
