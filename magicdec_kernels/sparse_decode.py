"""Decode attention where every KV head of a request reads its own list of pool slots (torch).

The MagicDec draft keeps, per KV head, the prompt keys that head found important (SnapKV) plus
the recent tokens, so the heads of one request attend over different slots, though always the
same number of them.

Layout:
    q                [B, Hq, D]              one query token per request
    k_cache          [pool_slots, Hkv, D]    SGLang's KV pool of one layer (v_cache alike, Dv)
    kv_indptr        [B + 1]                 request b owns columns kv_indptr[b]:kv_indptr[b+1]
    head_kv_indices  [Hkv, total] int64      KV head h of request b reads slots
                                             head_kv_indices[h, kv_indptr[b]:kv_indptr[b+1]]
    result           [B, Hq, Dv]             in q's dtype

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
    kv_indptr: torch.Tensor,
    head_kv_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v over each (request, KV head)'s slot list. Returns [B, Hq, Dv].

    `kv_indptr` is read on the host (its values drive the per-request loop): pass it on the CPU
    to avoid a device sync.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[2]
    _check_heads(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    if out is None:
        out = q.new_empty(batch, num_q_heads, v_dim)
    # Pairs with a [Hkv, n] slot block in advanced indexing: row h reads KV head h.
    kv_heads = torch.arange(num_kv_heads, device=k_cache.device)[:, None]
    bounds = kv_indptr.tolist()
    for request in range(batch):
        start, end = bounds[request], bounds[request + 1]
        if end == start:
            out[request].zero_()
            continue
        slots = head_kv_indices[:, start:end]
        keys = k_cache[slots, kv_heads].to(torch.float32)  # [Hkv, n, D]
        values = v_cache[slots, kv_heads].to(torch.float32)  # [Hkv, n, Dv]
        # One batched matmul per request: the group's q heads are the rows of their KV head.
        queries = q[request].reshape(num_kv_heads, group, head_dim).to(torch.float32)
        scores = torch.matmul(queries, keys.transpose(1, 2)).mul_(scale)  # [Hkv, group, n]
        probs = torch.softmax(scores, dim=-1)
        out[request] = torch.matmul(probs, values).reshape(num_q_heads, v_dim)
    return out


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    head_kv_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sparse_decode_triton` for CUDA tensors, `sparse_decode_torch` otherwise."""
    if q.is_cuda:
        from magicdec_kernels.sparse_decode_triton import sparse_decode_triton

        return sparse_decode_triton(q, k_cache, v_cache, kv_indptr, head_kv_indices, scale, out)
    return sparse_decode_torch(q, k_cache, v_cache, kv_indptr, head_kv_indices, scale, out)


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
