"""Extend (prefill) attention over an explicit list of KV-pool slots per request, in torch: the
`magicdec_cpu` backends' extend path (decode, verify and draft steps take `cpu_native.
slot_attention`). KV is never copied out of SGLang's pool into a per-request cache; the slot lists
index the pool directly.

Layout, as SGLang's backends use it:
    q          [num_q_tokens, num_q_heads, head_dim]      (requests back to back)
    k_cache    [pool_slots, num_kv_heads, head_dim]       (v_cache alike, v head dim may differ;
                                                           any strides: our CPU pool is a
                                                           head-major [Hkv, slots, D] store
                                                           viewed this way)
    q_indptr   [batch + 1]  query rows of request r are q[q_indptr[r]:q_indptr[r+1]]
    kv_indptr  [batch + 1]  slots of request r are kv_indices[kv_indptr[r]:kv_indptr[r+1]]
    kv_indices [total]      pool slot of each key, in sequence order

Causality is aligned to the end: the last `q_len` keys of a request are its query tokens, in
order, so query i sees the first `kv_len - q_len + i + 1` keys.

An extend over a long cached prefix with a few new tokens (a radix hit, a chat's next turn) costs
reading that prefix's K and V. SGLang hands a prompt's slots out as one contiguous range, so the
slot lists of a forward are planned once (shared by every layer) into:
- runs: long contiguous ranges of keys every query row sees, read in place by torch's fused CPU
  attention kernel (one call per run, split in two along the keys so both cores stream), which
  also returns each row's log-sum-exp;
- the rest (decoded tokens, the query tokens themselves, short pieces): gathered for the whole
  batch at once, padded and masked, one batched matmul;
and the partial results are merged exactly by their log-sum-exps (as FlashInfer merges states).
Requests with many query rows (prefill chunks) take one fused SDPA call on gathered KV instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

# A contiguous run at least this long is read in place; shorter pieces are gathered.
MIN_VIEW_RUN = 64
# A run at least this long is split in two along the keys (one half per core).
MIN_SPLIT_RUN = 2048
# Requests with more query rows than this (prefill chunks) use one fused SDPA call on gathered KV.
MAX_PLANNED_Q_LEN = 16

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class AttentionPlan:
    """How one forward's slot lists are read, computed once and shared by every layer.

    fused          requests (prefill chunks) that take one SDPA call on gathered KV
    requests       [P] the other requests, batched; `q_rows` query rows each (padded)
    q_gather       [P * q_rows] packed q row of each padded row (a real row of the same request
                   for padding rows, whose results are dropped)
    q_real         [P * q_rows] bool: the padded row is a real query row
    runs           (batched request, pool start, length, splits) read in place
    run_owner      [sum of splits] batched request of each run part
    gather_slots   [P, W] pool slots of each request's gathered keys (padding: slot 0)
    gather_hidden  [P, q_rows, W] bool: query row i must not see gathered key j
    """

    fused: list[int]
    requests: torch.Tensor
    q_rows: int
    q_gather: torch.Tensor
    q_real: torch.Tensor
    runs: list[tuple[int, int, int, int]]
    run_owner: torch.Tensor
    gather_slots: torch.Tensor
    gather_hidden: torch.Tensor


def plan_requests(
    q_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
) -> AttentionPlan:
    """Split every request's slot list into in-place runs and a gathered remainder."""
    q_bounds, kv_bounds = q_indptr.tolist(), kv_indptr.tolist()
    slots_np = kv_indices.cpu().numpy()
    fused, batched, q_lens = [], [], []
    for r in range(len(kv_bounds) - 1):
        q_len = q_bounds[r + 1] - q_bounds[r]
        if q_len > MAX_PLANNED_Q_LEN:
            fused.append(r)
        elif q_len > 0:
            batched.append(r)
            q_lens.append(q_len)
    q_rows = max(q_lens, default=1)
    runs, run_owner, rest_pos, rest_slots = [], [], [], []
    for p, r in enumerate(batched):
        start, end, q_len = kv_bounds[r], kv_bounds[r + 1], q_lens[p]
        # Keys every query row sees; the query tokens themselves are always gathered (masked).
        visible = slots_np[start : end - q_len]
        breaks = np.flatnonzero(np.diff(visible) != 1) + 1
        piece_starts = np.concatenate(([0], breaks)).tolist()
        piece_ends = np.concatenate((breaks, [len(visible)])).tolist()
        rest = []
        for first, last in zip(piece_starts, piece_ends, strict=True):
            length = last - first
            if length < MIN_VIEW_RUN:
                rest.append(np.arange(first, last))
                continue
            splits = 2 if length >= MIN_SPLIT_RUN else 1
            in_place = length // splits * splits
            runs.append((p, int(visible[first]), in_place, splits))
            run_owner += [p] * splits
            rest.append(np.arange(first + in_place, last))
        rest.append(np.arange(end - start - q_len, end - start))
        positions = np.concatenate(rest)
        rest_pos.append(positions)
        rest_slots.append(slots_np[start + positions])
    width = max((len(p) for p in rest_pos), default=1)
    gather_slots = torch.zeros(len(batched), width, dtype=torch.int64)
    gather_hidden = torch.ones(len(batched), q_rows, width, dtype=torch.bool)
    q_gather = torch.zeros(len(batched), q_rows, dtype=torch.int64)
    q_real = torch.zeros(len(batched), q_rows, dtype=torch.bool)
    for p, r in enumerate(batched):
        count, q_len = len(rest_pos[p]), q_lens[p]
        kv_len = kv_bounds[r + 1] - kv_bounds[r]
        gather_slots[p, :count] = torch.from_numpy(rest_slots[p])
        # Row i sees keys up to kv_len - q_len + i; padding rows see what the last row sees.
        last_visible = kv_len - q_len + torch.arange(q_rows).clamp(max=q_len - 1)
        gather_hidden[p, :, :count] = torch.from_numpy(rest_pos[p])[None, :] > last_visible[:, None]
        q_gather[p] = q_bounds[r] + torch.arange(q_rows).clamp(max=q_len - 1)
        q_real[p, :q_len] = True
    return AttentionPlan(
        fused=fused,
        requests=torch.tensor(batched, dtype=torch.int64),
        q_rows=q_rows,
        q_gather=q_gather.view(-1),
        q_real=q_real.view(-1),
        runs=runs,
        run_owner=torch.tensor(run_owner, dtype=torch.int64),
        gather_slots=gather_slots.to(kv_indices.device),
        gather_hidden=gather_hidden.to(kv_indices.device),
    )


def index_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + causal) · v over each request's slot list. Returns [num_q, Hq, Dv].

    `q_indptr` and `kv_indptr` are CPU tensors (their values drive the planning); `plan` may
    carry `plan_requests(...)` of the same lists, computed once for all layers.
    """
    num_q_heads, v_dim = q.shape[1], v_cache.shape[2]
    if out is None:
        out = q.new_empty(q.shape[0], num_q_heads, v_dim)
    if plan is None:
        plan = plan_requests(q_indptr, kv_indptr, kv_indices)
    for r in plan.fused:
        q_start, q_end = int(q_indptr[r]), int(q_indptr[r + 1])
        slots = kv_indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])]
        out[q_start:q_end] = _fused_sdpa(q[q_start:q_end], k_cache, v_cache, slots, scale)
    if plan.requests.numel():
        rows = _batched_attention(q, k_cache, v_cache, plan, scale)
        out[plan.q_gather[plan.q_real]] = rows[plan.q_real].to(out.dtype)
    return out


def _batched_attention(q, k_cache, v_cache, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """[P * q_rows, Hq, Dv] attention of the batched requests' padded query rows (float32)."""
    batch, q_rows = plan.requests.numel(), plan.q_rows
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # [P, Hkv, group * q_rows, D]: the query heads of one KV head (and its rows) share a matmul.
    queries = (
        q.index_select(0, plan.q_gather)
        .view(batch, q_rows, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, num_kv_heads, group * q_rows, head_dim)
    )
    keys_by_head, values_by_head = k_cache.permute(1, 0, 2), v_cache.permute(1, 0, 2)
    width = plan.gather_slots.shape[1]
    slots = plan.gather_slots.view(-1)
    keys = keys_by_head.index_select(1, slots).view(num_kv_heads, batch, width, head_dim)
    values = values_by_head.index_select(1, slots).view(num_kv_heads, batch, width, v_dim)
    scores = torch.matmul(queries.float(), keys.transpose(0, 1).transpose(2, 3).float())
    scores = scores.mul_(scale).view(batch, num_kv_heads, group, q_rows, width)
    scores.masked_fill_(plan.gather_hidden[:, None, None], float("-inf"))
    scores = scores.view(batch, num_kv_heads, group * q_rows, width)
    lse = torch.logsumexp(scores, dim=-1)  # every row sees at least its own token: finite
    result = torch.matmul(scores.sub_(lse[..., None]).exp_(), values.transpose(0, 1).float())
    if plan.runs:
        run_out, run_lse = [], []
        for owner, start, length, splits in plan.runs:
            part = length // splits
            run_keys = keys_by_head[:, start : start + length].unflatten(1, (splits, part))
            run_values = values_by_head[:, start : start + length].unflatten(1, (splits, part))
            run_queries = queries[owner].expand(splits, -1, -1, -1)
            if run_keys.dtype != queries.dtype:
                run_keys, run_values = run_keys.to(queries.dtype), run_values.to(queries.dtype)
            attended, part_lse = _flash_cpu(
                run_queries, run_keys.transpose(0, 1), run_values.transpose(0, 1), scale=scale
            )
            run_out.append(attended)
            run_lse.append(part_lse)
        result = _merge(result, lse, torch.cat(run_out).float(), torch.cat(run_lse), plan)
    # [P, Hkv, group, q_rows, Dv] -> [P * q_rows, Hq, Dv]
    return (
        result.view(batch, num_kv_heads, group, q_rows, v_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch * q_rows, num_q_heads, v_dim)
    )


def _merge(out, lse, run_out, run_lse, plan: AttentionPlan) -> torch.Tensor:
    """Softmax over the union of key sets from per-set results and log-sum-exps."""
    owner = plan.run_owner
    top = lse.scatter_reduce(0, owner[:, None, None].expand_as(run_lse), run_lse, "amax")
    weight = (lse - top).exp_()
    run_weight = (run_lse - top.index_select(0, owner)).exp_()
    total = weight.index_add(0, owner, run_weight)
    merged = (out * weight[..., None]).index_add_(0, owner, run_out * run_weight[..., None])
    return merged.div_(total[..., None])


def _fused_sdpa(q, k_cache, v_cache, slots, scale: float) -> torch.Tensor:
    q_len, kv_len = q.shape[0], slots.numel()
    keys = k_cache.permute(1, 0, 2).index_select(1, slots).to(q.dtype)  # [Hkv, L, D]
    values = v_cache.permute(1, 0, 2).index_select(1, slots).to(q.dtype)
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
