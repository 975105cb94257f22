"""Attention over an explicit list of KV-pool slots per request (torch implementation).

This is the operation every MagicDec piece reduces to: dense decode reads all of a request's
slots, the draft reads a small selection of them, verification reads all of them plus the γ+1
tokens being checked. KV is never copied out of SGLang's pool into a per-request cache; the slot
lists index the pool directly.

Layout, as SGLang's backends use it:
    q          [num_q_tokens, num_q_heads, head_dim]      (requests back to back)
    k_cache    [pool_slots, num_kv_heads, head_dim]       (v_cache alike, v head dim may differ)
    q_indptr   [batch + 1]  query rows of request r are q[q_indptr[r]:q_indptr[r+1]]
    kv_indptr  [batch + 1]  slots of request r are kv_indices[kv_indptr[r]:kv_indptr[r+1]]
    kv_indices [total]      pool slot of each key, in sequence order

Causality is aligned to the end: the last `q_len` keys of a request are its query tokens, in
order, so query i sees the first `kv_len - q_len + i + 1` keys. Decode is q_len = 1 (sees all).

On CPU the cost of attention at long context is reading K and V, and a gather (`k_cache[slots]`)
reads them twice and writes them once. SGLang hands a prompt's slots out as one contiguous range,
so a request's slot list is planned once per forward into long contiguous runs, read in place as
strided views, plus the scattered rest (decoded tokens), gathered. Softmax runs over the scores of
all pieces together, so the result is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

# A contiguous run at least this long is read in place; shorter pieces are gathered.
MIN_VIEW_RUN = 32
# Requests with more query rows than this (prefill chunks) use one fused SDPA call on gathered KV.
MAX_PLANNED_Q_LEN = 16


@dataclass
class KeyPieces:
    """One request's keys, in the order attention reads them.

    runs       (pool_start, length) of each contiguous run read in place
    scattered  pool slots of the remaining keys (gathered), or None
    key_pos    sequence index of every key in read order (runs, then scattered); set only when
               the request has several query rows, for the causal mask
    """

    runs: list[tuple[int, int]]
    scattered: torch.Tensor | None
    key_pos: torch.Tensor | None


def plan_pieces(slots: torch.Tensor, q_len: int) -> KeyPieces:
    """Split one request's slot list into in-place runs and a gathered remainder."""
    slots_np = slots.cpu().numpy()
    breaks = np.flatnonzero(np.diff(slots_np) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots_np)]))
    runs, run_pos, rest = [], [], []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if end - start >= MIN_VIEW_RUN:
            runs.append((int(slots_np[start]), end - start))
            run_pos.append(np.arange(start, end))
        elif end > start:
            rest.append(np.arange(start, end))
    rest_pos = np.concatenate(rest) if rest else None
    scattered = slots[torch.from_numpy(rest_pos)] if rest_pos is not None else None
    key_pos = None
    if q_len > 1:
        key_pos = torch.from_numpy(np.concatenate(run_pos + ([rest_pos] if rest else [])))
    return KeyPieces(runs, scattered, key_pos)


def plan_requests(
    q_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> list[KeyPieces | None]:
    """`plan_pieces` for every request with few query rows (None for prefill chunks)."""
    plans: list[KeyPieces | None] = []
    for r in range(kv_indptr.numel() - 1):
        q_len = int(q_indptr[r + 1] - q_indptr[r])
        if q_len > MAX_PLANNED_Q_LEN:
            plans.append(None)
            continue
        slots = kv_indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])]
        plans.append(plan_pieces(slots, q_len))
    return plans


def index_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plans: list[KeyPieces | None] | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + causal) · v over each request's slot list. Returns [num_q, Hq, Dv].

    `q_indptr` and `kv_indptr` are CPU tensors (their values drive the per-request loop);
    `plans` may carry `plan_requests(...)` of the same lists, computed once for all layers.
    """
    num_q_heads, v_dim = q.shape[1], v_cache.shape[2]
    if out is None:
        out = q.new_empty(q.shape[0], num_q_heads, v_dim)
    if plans is None:
        plans = plan_requests(q_indptr, kv_indptr, kv_indices)
    for r, pieces in enumerate(plans):
        q_start, q_end = int(q_indptr[r]), int(q_indptr[r + 1])
        if q_end == q_start:
            continue
        if pieces is None:
            slots = kv_indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])]
            out[q_start:q_end] = _fused_sdpa(q[q_start:q_end], k_cache, v_cache, slots, scale)
        else:
            out[q_start:q_end] = _pieces_attention(
                q[q_start:q_end], k_cache, v_cache, pieces, scale
            )
    return out


def _pieces_attention(q, k_cache, v_cache, pieces: KeyPieces, scale: float) -> torch.Tensor:
    q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    # [Hkv, group * q_len, D]: all query heads of one KV head share a single matmul.
    queries = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    queries = queries.reshape(num_kv_heads, group * q_len, head_dim) * scale
    key_views, value_views = [], []
    for start, length in pieces.runs:
        key_views.append(k_cache[start : start + length])
        value_views.append(v_cache[start : start + length])
    if pieces.scattered is not None:
        key_views.append(k_cache.index_select(0, pieces.scattered))
        value_views.append(v_cache.index_select(0, pieces.scattered))
    # [Hkv, L, D] views: transposing the pool slice is free, matmul reads it strided.
    scores = torch.cat(
        [torch.matmul(queries, keys.to(q.dtype).permute(1, 2, 0)) for keys in key_views], dim=-1
    )
    if pieces.key_pos is not None:
        kv_len = pieces.key_pos.numel()
        last_visible = torch.arange(kv_len - q_len, kv_len)
        hidden = pieces.key_pos[None, :] > last_visible[:, None]  # [q_len, L]
        scores = scores.view(num_kv_heads, group, q_len, kv_len).masked_fill(hidden, float("-inf"))
        scores = scores.view(num_kv_heads, group * q_len, kv_len)
    probs = torch.softmax(scores, dim=-1)
    result = None
    offset = 0
    for values in value_views:
        length = values.shape[0]
        part = torch.matmul(
            probs[..., offset : offset + length], values.to(q.dtype).transpose(0, 1)
        )
        result = part if result is None else result.add_(part)
        offset += length
    # [Hkv, group * q_len, Dv] -> [q_len, Hq, Dv]
    return (
        result.view(num_kv_heads, group, q_len, -1)
        .permute(2, 0, 1, 3)
        .reshape(q_len, num_q_heads, -1)
    )


def _fused_sdpa(q, k_cache, v_cache, slots, scale: float) -> torch.Tensor:
    q_len, kv_len = q.shape[0], slots.numel()
    keys = k_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
    values = v_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)
    if q_len == kv_len:
        mask, causal = None, True
    else:
        key_pos = torch.arange(kv_len, device=q.device)
        last_visible = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask, causal = key_pos[None, :] <= last_visible[:, None], False
    result = scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )
    return result[0].transpose(0, 1)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain softmax attention, one query row and head at a time, in float64: the test oracle."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_q_heads, v_cache.shape[2], dtype=torch.float64)
    for r in range(kv_indptr.numel() - 1):
        q_start, q_end = int(q_indptr[r]), int(q_indptr[r + 1])
        slots = kv_indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])]
        kv_len, q_len = slots.numel(), q_end - q_start
        for i in range(q_len):
            visible = slots[: kv_len - q_len + i + 1]
            for head in range(num_q_heads):
                keys = k_cache[visible, head // group].double()
                values = v_cache[visible, head // group].double()
                weights = torch.softmax(keys @ q[q_start + i, head].double() * scale, dim=0)
                out[q_start + i, head] = weights @ values
    return out
