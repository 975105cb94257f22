"""SnapKV importance scores of the prompt keys, seen from the last W prompt queries (torch).

SnapKV keeps, per KV head, the prompt keys that the final "observation window" of the prompt
attends to most. The score of a key is the attention probability it receives, summed over the W
window queries; the window keys themselves are always kept, so they are not scored.

Layout:
    q_window   [W, Hq, D]             queries of prompt positions L-W .. L-1, RoPE applied
    k_cache    [pool_slots, Hkv, D]   SGLang's KV pool of one layer
    key_slots  [L] int64              pool slot of each prompt position 0 .. L-1
    result     [Hq, L-W] float32      per q head, summed probability of each prefix key

Query i (position L-W+i) sees keys 0 .. L-W+i, so the window keys enter the softmax denominator
of the rows that see them. Probabilities are computed in float32 whatever the pool dtype.

`snapkv_window_scores` dispatches: the Triton kernel for CUDA tensors, this file's torch version
otherwise. The Triton module is imported only when a CUDA tensor arrives, so CPU servers never
import Triton kernels.
"""

from __future__ import annotations

import torch

from magicdec_kernels.shapes import check_gqa, check_window


def snapkv_window_scores_torch(
    q_window: torch.Tensor, k_cache: torch.Tensor, key_slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """Summed window-query probabilities of the L-W prefix keys: float32 [Hq, L-W].

    Materialises the [group, W, L] scores of one KV head at a time, so memory stays at one GQA
    group's worth rather than all heads'.
    """
    window, num_q_heads, _ = q_window.shape
    num_kv_heads = k_cache.shape[1]
    seq_len = key_slots.numel()
    check_gqa(num_q_heads, num_kv_heads)
    check_window(window, seq_len)
    group = num_q_heads // num_kv_heads
    prefix_len = seq_len - window
    device = q_window.device
    result = torch.empty(num_q_heads, prefix_len, dtype=torch.float32, device=device)
    if prefix_len == 0:
        return result
    # Row i (position prefix_len + i) must not see keys after itself.
    key_pos = torch.arange(seq_len, device=device)
    last_visible = torch.arange(prefix_len, seq_len, device=device)
    hidden = key_pos[None, :] > last_visible[:, None]  # [W, L]
    slots = key_slots.to(device=k_cache.device, dtype=torch.long)
    for kv_head in range(num_kv_heads):
        keys = k_cache[slots, kv_head].to(device=device, dtype=torch.float32)  # [L, D]
        heads = slice(kv_head * group, (kv_head + 1) * group)
        queries = q_window[:, heads].to(torch.float32).transpose(0, 1)  # [group, W, D]
        scores = torch.matmul(queries, keys.t()).mul_(scale)  # [group, W, L]
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[heads] = probs[..., :prefix_len].sum(dim=1)
    return result


def snapkv_window_scores(
    q_window: torch.Tensor, k_cache: torch.Tensor, key_slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """`snapkv_window_scores_triton` for CUDA tensors, `snapkv_window_scores_torch` otherwise."""
    if q_window.is_cuda:
        from magicdec_kernels.snapkv_scores_triton import snapkv_window_scores_triton

        return snapkv_window_scores_triton(q_window, k_cache, key_slots, scale)
    return snapkv_window_scores_torch(q_window, k_cache, key_slots, scale)
