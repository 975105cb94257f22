"""SnapKV window scores in Triton, without materialising the [Hq, W, L] score matrix.

Same operation and signature as `snapkv_scores.snapkv_window_scores_torch` (see that module for
the layout). All W window rows of a q head are one [BLOCK_W, D] tile, so every key block read
from the pool serves the whole window in a single `tl.dot`.

Pass 1 (grid: q head x key split) walks its share of the L keys, causally masked per row, and
keeps an online max and sum of exp per window row. Splitting the keys keeps the GPU busy when
there are few heads and L is long; the splits' (max, sum) pairs are merged on the host side with
two small torch ops.

Pass 2 (grid: q head x block of prefix keys) recomputes the scores of its prefix keys, which
every window row sees, turns them into probabilities with the row's final max and sum, and sums
them over the rows.

Keys are read in place through `key_slots`; no gathered copy of K is made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from magicdec_kernels.shapes import check_gqa, check_window

BLOCK_KEYS = 64
# tl.dot needs every tile dimension to be at least 16.
MIN_DOT_DIM = 16


@triton.jit
def _window_row_stats_kernel(
    q_ptr,
    k_ptr,
    slots_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    seq_len,
    prefix_len,
    window,
    head_dim,
    group,
    blocks_per_split,
    stride_q_row,
    stride_q_head,
    stride_q_dim,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_part_head,
    stride_part_split,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    q_head = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = q_head // group
    rows = tl.arange(0, BLOCK_W)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    row_valid = rows < window
    dim_valid = dims < head_dim

    q_tile = tl.load(
        q_ptr
        + rows[:, None] * stride_q_row
        + q_head * stride_q_head
        + dims[None, :] * stride_q_dim,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q_tile = q_tile.to(tl.float32)
    # Row i sits at position prefix_len + i and sees keys up to and including itself.
    last_visible = prefix_len + rows

    row_max = tl.full([BLOCK_W], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_W], tl.float32)
    first_key = split * blocks_per_split * BLOCK_N
    for block in range(0, blocks_per_split):
        key_pos = first_key + block * BLOCK_N + cols
        key_valid = key_pos < seq_len
        slots = tl.load(slots_ptr + key_pos, mask=key_valid, other=0).to(tl.int64)
        # K^T tile [BLOCK_D, BLOCK_N], read straight from the pool slots.
        k_tile = tl.load(
            k_ptr
            + slots[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + dims[:, None] * stride_k_dim,
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            scores = tl.dot(q_tile, k_tile.to(tl.float32), input_precision="ieee")
        else:
            # Equal 16-bit inputs: products are exact and accumulate in float32.
            scores = tl.dot(q_tile, k_tile)
        scores = scores * scale
        visible = key_valid[None, :] & (key_pos[None, :] <= last_visible[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf; shift by 0 instead so exp gives 0, not
        # the NaN of (-inf) - (-inf).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(
            tl.exp(scores - shift[:, None]), axis=1
        )
        row_max = new_max

    part_offsets = q_head * stride_part_head + split * stride_part_split + rows
    tl.store(part_max_ptr + part_offsets, row_max, mask=row_valid)
    tl.store(part_sum_ptr + part_offsets, row_sum, mask=row_valid)


@triton.jit
def _prefix_probs_kernel(
    q_ptr,
    k_ptr,
    slots_ptr,
    row_max_ptr,
    row_sum_ptr,
    out_ptr,
    scale,
    prefix_len,
    window,
    head_dim,
    group,
    stride_q_row,
    stride_q_head,
    stride_q_dim,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_out_head,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    q_head = tl.program_id(0)
    key_block = tl.program_id(1)
    kv_head = q_head // group
    rows = tl.arange(0, BLOCK_W)
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < window
    dim_valid = dims < head_dim

    q_tile = tl.load(
        q_ptr
        + rows[:, None] * stride_q_row
        + q_head * stride_q_head
        + dims[None, :] * stride_q_dim,
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q_tile = q_tile.to(tl.float32)
    row_max = tl.load(row_max_ptr + q_head * window + rows, mask=row_valid, other=0.0)
    row_sum = tl.load(row_sum_ptr + q_head * window + rows, mask=row_valid, other=1.0)

    key_pos = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_valid = key_pos < prefix_len
    slots = tl.load(slots_ptr + key_pos, mask=key_valid, other=0).to(tl.int64)
    k_tile = tl.load(
        k_ptr
        + slots[None, :] * stride_k_slot
        + kv_head * stride_k_head
        + dims[:, None] * stride_k_dim,
        mask=dim_valid[:, None] & key_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        scores = tl.dot(q_tile, k_tile.to(tl.float32), input_precision="ieee")
    else:
        scores = tl.dot(q_tile, k_tile)
    scores = scores * scale
    # Prefix keys are visible to every window row, so only padding rows need masking.
    probs = tl.exp(scores - row_max[:, None]) / row_sum[:, None]
    probs = tl.where(row_valid[:, None], probs, 0.0)
    tl.store(out_ptr + q_head * stride_out_head + key_pos, tl.sum(probs, axis=0), mask=key_valid)


def snapkv_window_scores_triton(
    q_window: torch.Tensor, k_cache: torch.Tensor, key_slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """Summed window-query probabilities of the L-W prefix keys: float32 [Hq, L-W]."""
    num_q_heads = q_window.shape[1]
    num_key_blocks = triton.cdiv(key_slots.numel(), BLOCK_KEYS)
    if q_window.is_cuda:
        # About four programs per SM in pass 1, but never a split without a key block.
        sm_count = torch.cuda.get_device_properties(q_window.device).multi_processor_count
        num_splits = min(num_key_blocks, max(1, triton.cdiv(4 * sm_count, num_q_heads)))
    else:
        # The CPU interpreter runs programs one after the other: splitting only adds overhead.
        num_splits = 1
    return window_scores_with_splits(q_window, k_cache, key_slots, scale, num_splits)


def window_scores_with_splits(
    q_window: torch.Tensor,
    k_cache: torch.Tensor,
    key_slots: torch.Tensor,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """`snapkv_window_scores_triton` with pass 1's keys cut into `num_splits` ranges."""
    window, num_q_heads, head_dim = q_window.shape
    num_kv_heads = k_cache.shape[1]
    seq_len = key_slots.numel()
    check_gqa(num_q_heads, num_kv_heads)
    check_window(window, seq_len)
    prefix_len = seq_len - window
    device = q_window.device
    result = torch.empty(num_q_heads, prefix_len, dtype=torch.float32, device=device)
    if prefix_len == 0:
        return result
    key_slots = key_slots.to(device=device, dtype=torch.int64).contiguous()

    block_w = max(MIN_DOT_DIM, triton.next_power_of_2(window))
    block_d = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    dot_in_fp32 = not (
        q_window.dtype == k_cache.dtype and q_window.dtype in (torch.float16, torch.bfloat16)
    )
    num_key_blocks = triton.cdiv(seq_len, BLOCK_KEYS)
    num_splits = max(1, min(num_splits, num_key_blocks))
    blocks_per_split = triton.cdiv(num_key_blocks, num_splits)
    # Recompute so that no split starts past the last key.
    num_splits = triton.cdiv(num_key_blocks, blocks_per_split)

    part_max = torch.empty(num_q_heads, num_splits, window, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    _window_row_stats_kernel[(num_q_heads, num_splits)](
        q_window,
        k_cache,
        key_slots,
        part_max,
        part_sum,
        scale,
        seq_len,
        prefix_len,
        window,
        head_dim,
        num_q_heads // num_kv_heads,
        blocks_per_split,
        *q_window.stride(),
        *k_cache.stride(),
        part_max.stride(0),
        part_max.stride(1),
        BLOCK_W=block_w,
        BLOCK_N=BLOCK_KEYS,
        BLOCK_D=block_d,
        DOT_IN_FP32=dot_in_fp32,
    )
    # Merge the splits: every row sees key 0, so the overall max is finite, and a split the row
    # could not see (max -inf) contributes exp(-inf) = 0.
    row_max = part_max.amax(dim=1)
    row_sum = (part_sum * torch.exp(part_max - row_max[:, None, :])).sum(dim=1)

    _prefix_probs_kernel[(num_q_heads, triton.cdiv(prefix_len, BLOCK_KEYS))](
        q_window,
        k_cache,
        key_slots,
        row_max.contiguous(),
        row_sum.contiguous(),
        result,
        scale,
        prefix_len,
        window,
        head_dim,
        num_q_heads // num_kv_heads,
        *q_window.stride(),
        *k_cache.stride(),
        result.stride(0),
        BLOCK_W=block_w,
        BLOCK_N=BLOCK_KEYS,
        BLOCK_D=block_d,
        DOT_IN_FP32=dot_in_fp32,
    )
    return result
