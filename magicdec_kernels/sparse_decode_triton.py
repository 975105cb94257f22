"""Per-KV-head sparse decode attention in Triton: the MagicDec draft step's attention on GPU.

The operation of `cpu_native.slot_attention` for one query row per request, whose torch reference
`slot_attention_torch` (with q_indptr = arange(B + 1)) the tests compare it with. Layout:
    q            [B, Hq, D]             one query token per request
    k_cache      [pool_slots, Hkv, D]   SGLang's KV pool of one layer (v_cache alike, Dv)
    head_slots   [B, Hkv, W] int64      KV head h of request b reads slots head_slots[b, h, :n_b]
    kv_lens      [B] int                n_b: the slots of request b (the rest is padding)
    result       [B, Hq, Dv]            in q's dtype; a request with no slots gets zeros
One program per (request, KV head) walks that head's slot list in blocks with an online
softmax; the `group` q heads sharing the KV head are rows of one tile, so each K and V block is
read from the pool once for all of them. Scores and the weighted sum use broadcasted multiply and
sum in float32 (a decode step is bound by reading K and V, not by these flops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from magicdec_kernels.shapes import check_gqa

# The broadcasted products are [BLOCK_G, BLOCK_N, BLOCK_D] tiles held in registers; keep them at
# about this many elements (64 float32 registers a thread at 4 warps) by shrinking BLOCK_N.
MAX_PRODUCT_TILE = 8192
MIN_BLOCK_KEYS = 8
MAX_BLOCK_KEYS = 64


@triton.jit
def _sparse_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    indices_ptr,
    lens_ptr,
    out_ptr,
    scale,
    head_dim,
    v_dim,
    group,
    stride_q_req,
    stride_q_head,
    stride_q_dim,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_v_slot,
    stride_v_head,
    stride_v_dim,
    stride_idx_req,
    stride_idx_head,
    stride_idx_col,
    stride_out_req,
    stride_out_head,
    stride_out_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    group_rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    v_dims = tl.arange(0, BLOCK_DV)
    cols = tl.arange(0, BLOCK_N)
    row_valid = group_rows < group
    q_heads = kv_head * group + group_rows

    end = tl.load(lens_ptr + request).to(tl.int64)

    q_tile = tl.load(
        q_ptr
        + request * stride_q_req
        + q_heads[:, None] * stride_q_head
        + dims[None, :] * stride_q_dim,
        mask=row_valid[:, None] & (dims[None, :] < head_dim),
        other=0.0,
    ).to(tl.float32)

    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    num_blocks = tl.cdiv(end, BLOCK_N)
    for block in range(0, num_blocks):
        col = block * BLOCK_N + cols
        col_valid = col < end
        slots = tl.load(
            indices_ptr
            + request * stride_idx_req
            + kv_head * stride_idx_head
            + col * stride_idx_col,
            mask=col_valid,
            other=0,
        ).to(tl.int64)
        k_tile = tl.load(
            k_ptr
            + slots[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + dims[None, :] * stride_k_dim,
            mask=col_valid[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        ).to(tl.float32)
        v_tile = tl.load(
            v_ptr
            + slots[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + v_dims[None, :] * stride_v_dim,
            mask=col_valid[:, None] & (v_dims[None, :] < v_dim),
            other=0.0,
        ).to(tl.float32)
        scores = tl.sum(q_tile[:, None, :] * k_tile[None, :, :], axis=2) * scale  # [G, N]
        scores = tl.where(col_valid[None, :], scores, float("-inf"))
        # Every block holds at least one valid column, so new_max is finite.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp(row_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v_tile[None, :, :], axis=1)
        row_max = new_max

    # A request without slots never entered the loop: its output is zeros, not 0/0.
    result = tl.where(row_sum[:, None] > 0, acc / tl.maximum(row_sum, 1e-30)[:, None], 0.0)
    tl.store(
        out_ptr
        + request * stride_out_req
        + q_heads[:, None] * stride_out_head
        + v_dims[None, :] * stride_out_dim,
        result.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (v_dims[None, :] < v_dim),
    )


def sparse_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v over each (request, KV head)'s slot list. Returns [B, Hq, Dv].

    `head_slots` and `kv_lens` should already be on q's device (they are moved if not).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[2]
    check_gqa(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    if out is None:
        out = q.new_empty(batch, num_q_heads, v_dim)
    if batch == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    block_dv = triton.next_power_of_2(v_dim)
    block_keys = MAX_PRODUCT_TILE // (block_g * max(block_d, block_dv))
    block_keys = min(MAX_BLOCK_KEYS, max(MIN_BLOCK_KEYS, triton.next_power_of_2(block_keys)))
    head_slots = head_slots.to(q.device)
    kv_lens = kv_lens.to(q.device)
    _sparse_decode_kernel[(batch, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        head_slots,
        kv_lens,
        out,
        scale,
        head_dim,
        v_dim,
        group,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *head_slots.stride(),
        *out.stride(),
        BLOCK_G=block_g,
        BLOCK_N=block_keys,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
    )
    return out
