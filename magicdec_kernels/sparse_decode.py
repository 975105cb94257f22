"""Decode attention where every KV head of a request reads its own list of pool slots (torch).

The MagicDec draft keeps, per KV head, the prompt keys that head found important (SnapKV) plus
the recent tokens, so the heads of one request attend over different slots, though always the
same number of them. The lists of a batch are padded to one width, so a layer of the draft is one
gather and two batched matmuls for the whole batch, whatever its size.

Layout:
    q            [B, Hq, D]             one query token per request
    k_cache      [pool_slots, Hkv, D]   SGLang's KV pool of one layer (v_cache alike, Dv; any
                                        strides: our CPU pool is head-major underneath)
    head_slots   [B, Hkv, W] int64      KV head h of request b reads slots head_slots[b, h, :n_b]
    kv_lens      [B] int                n_b: the slots of request b (the rest is padding)
    result       [B, Hq, Dv]            in q's dtype

The q heads of GQA group h (h*group .. (h+1)*group-1) attend over KV head h's slots. Softmax and
the weighted sum run in float32. A request with no slots gets zeros.

`sparse_decode_attention` dispatches: the Triton kernel for CUDA tensors, this file's torch
version otherwise. The Triton module is imported only when a CUDA tensor arrives, so CPU servers
never import Triton kernels.
"""

from __future__ import annotations

import torch


def sparse_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v over each (request, KV head)'s slot list. Returns [B, Hq, Dv]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[2]
    _check_heads(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    width = head_slots.shape[-1]
    if out is None:
        out = q.new_empty(batch, num_q_heads, v_dim)
    keys = _gather(k_cache, head_slots).float()  # [B, Hkv, W, D]
    values = _gather(v_cache, head_slots).float()
    queries = q.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.matmul(queries, keys.transpose(2, 3)).mul_(scale)  # [B, Hkv, group, W]
    padding = torch.arange(width, device=q.device)[None, :] >= kv_lens.to(q.device)[:, None]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # no slots: zeros, not 0/0
    out.copy_(torch.matmul(probs, values).view(batch, num_q_heads, v_dim))
    return out


def _gather(cache: torch.Tensor, head_slots: torch.Tensor) -> torch.Tensor:
    """cache[head_slots[b, h, j], h] as [B, Hkv, W, D]: one index_select on the flat pool."""
    batch, num_kv_heads, width = head_slots.shape
    rows, dim = cache.shape[0], cache.shape[2]
    heads = torch.arange(num_kv_heads, device=head_slots.device)[None, :, None]
    by_head = cache.permute(1, 0, 2)
    if by_head.is_contiguous():  # head-major pool: row h * rows + slot
        flat, index = by_head.reshape(num_kv_heads * rows, dim), heads * rows + head_slots
    elif cache.is_contiguous():  # token-major pool: row slot * Hkv + h
        flat, index = cache.view(rows * num_kv_heads, dim), head_slots * num_kv_heads + heads
    else:
        return by_head[heads, head_slots]
    return flat.index_select(0, index.reshape(-1)).view(batch, num_kv_heads, width, dim)


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sparse_decode_triton` for CUDA tensors, `sparse_decode_torch` otherwise."""
    if q.is_cuda:
        from magicdec_kernels.sparse_decode_triton import sparse_decode_triton

        return sparse_decode_triton(q, k_cache, v_cache, head_slots, kv_lens, scale, out)
    return sparse_decode_torch(q, k_cache, v_cache, head_slots, kv_lens, scale, out)


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
