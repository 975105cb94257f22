"""Per-KV-head draft decode as a batch of one-KV-head rows: the form FlashInfer's decode reads.

SGLang's per-layer K and V buffers are `[slots, Hkv, D]` and contiguous, so `k.view(slots·Hkv,
1, D)` makes every (slot, KV head) pair one row, `slot·Hkv + h`, with no copy. Request b's KV
head h, with the `group` query heads that share it, then becomes row `b·Hkv + h` of a batched
decode with one KV head and `group` query heads, reading the rows `slot·Hkv + h` of its own slots:
a ragged CSR list (int32 offsets and indices) that FlashInfer's paged decode (page size 1) and
SGLang's Triton decode kernel both take.

Layout (as `sparse_decode_triton`): q [B, Hq, D]; head_slots [B, Hkv, W]; kv_lens [B].
"""

from __future__ import annotations

import torch

FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024


def flatten_head_slots(
    head_slots: torch.Tensor, kv_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [B·Hkv + 1], kv_indices) int32: row b·Hkv + h reads flat rows
    head_slots[b, h, j]·Hkv + h for j < kv_lens[b]."""
    batch, num_kv_heads, width = head_slots.shape
    device = head_slots.device
    heads = torch.arange(num_kv_heads, device=device)[None, :, None]
    flat_rows = head_slots * num_kv_heads + heads
    valid = torch.arange(width, device=device)[None, None, :] < kv_lens.to(device)[:, None, None]
    kv_indices = flat_rows[valid.expand_as(flat_rows)].to(torch.int32)
    row_lens = kv_lens.to(device=device, dtype=torch.int64).repeat_interleave(num_kv_heads)
    kv_indptr = torch.zeros(batch * num_kv_heads + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = row_lens.cumsum(0)
    return kv_indptr, kv_indices


def flat_rows(cache: torch.Tensor) -> torch.Tensor:
    """[slots, Hkv, D] -> [slots·Hkv, 1, D], the same memory."""
    slots, num_kv_heads, dim = cache.shape
    return cache.view(slots * num_kv_heads, 1, dim)


def flat_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, D] -> [B·Hkv, group, D]: query heads h·group .. (h+1)·group−1 share KV head h."""
    batch, num_q_heads, dim = q.shape
    return q.reshape(batch * num_kv_heads, num_q_heads // num_kv_heads, dim)


class FlashInferFlatDecode:
    """The draft's sparse decode through FlashInfer's batch decode (GPU only; FlashInfer is
    imported here, when the flashinfer backend is wrapped). Planned once per distinct slot list
    of a step: once for a list every layer shares (streaming), once per layer for SnapKV."""

    def __init__(self, device: torch.device):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor cores serve any group size (the flat rows have `group` query heads, 1 KV head).
        self.wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self.planned = False

    def new_step(self) -> None:
        self.planned = False

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        head_slots: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        queries = flat_queries(q, num_kv_heads)
        if not self.planned:
            kv_indptr, kv_indices = flatten_head_slots(head_slots, kv_lens)
            self.wrapper.plan(
                kv_indptr,
                kv_indices,
                torch.ones(queries.shape[0], dtype=torch.int32, device=q.device),
                queries.shape[1],
                1,
                head_dim,
                1,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
                sm_scale=scale,
            )
            self.planned = True
        paged = (flat_rows(k_cache).unsqueeze(1), flat_rows(v_cache).unsqueeze(1))
        result = self.wrapper.run(queries, paged)
        out.copy_(result.view_as(out))
        return out
