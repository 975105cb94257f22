"""MagicDec's native CPU ops (C++ in csrc/, built and loaded by `loader`): attention over lists of
KV-pool slots (`slot_attention`), products of a few rows with a weight matrix (`few_rows_linear`),
and a decoder layer's per-token ops (`rms_norm`, `rotary_embedding`, `silu_and_mul`, `store_kv`).
Each runs the native kernel where it is loaded and takes the tensors; otherwise `slot_attention`
runs its torch reference (`slot_attention_torch`, also the whole of the `magicdec_cpu_torch`
backend) and the others return None (or False) so that the caller runs SGLang's torch code.
The other ops' torch references, which only tests use, are in test/references.py.

Slot attention (csrc/slot_attention.cpp).

One entry point serves plain decode, target verification and the sparse draft: request b's query
rows attend over the pool slots its list names, per KV head or shared by all heads. At long
context the cost of all three is reading K and V once, so the kernel reads each (request, KV
head)'s keys and values once for all of the request's query rows times the query heads of the GQA
group, straight from the pool by slot index (never gathered into a per-request copy), with an
online softmax over blocks of keys. Long lists are split into key chunks spread over torch's
threads and merged exactly by their log-sum-exps, so one long request still uses every core.

Layout:
    q           [Nq, Hq, D]          float32 or bfloat16; the requests' query rows back to back
    k_cache     [slots, Hkv, D]      float32 or bfloat16 (v_cache alike, head dim Dv); any
                                     strides with the last dim contiguous: our CPU pool is a
                                     head-major [Hkv, slots, D] store viewed this way
    q_indptr    [B + 1] int64 (CPU)  query rows of request b are q[q_indptr[b]:q_indptr[b + 1]]
    head_slots  [B, Hkv or 1, W] int64
                                     KV head h of request b reads slots head_slots[b, h, :n_b]
                                     (dim 1 of size 1: every head reads the same list)
    kv_lens     [B] int64 (CPU)      n_b
    out         [Nq, Hq, Dv]         q's dtype, written in place and returned

Query head j reads KV head j // (Hq // Hkv). Causality is aligned to the end of each list: query
row i of a request with q_len rows sees the first `n_b - q_len + i + 1` keys of its list (decode,
q_len 1, sees them all; in verification the last γ+1 entries are the query tokens themselves).
A row that sees no key gets zeros. Softmax and accumulation run in float32. Query rows outside
every request's range are not written. With bf16 q and KV (head dim a multiple of 32) on a CPU
with AVX512-BF16, both products are bf16 pair dot products (exact products, float32 sums), and
the probabilities are rounded to bf16 for the value product, as GPU flash attention does.
"""

from __future__ import annotations

import weakref

import torch

from magicdec_kernels.loader import capabilities, native
from magicdec_kernels.shapes import check_gqa


def supports_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (else `slot_attention` uses torch)."""
    floats = (torch.float32, torch.bfloat16)
    return (
        not q.is_cuda
        and q.dtype in floats
        and k_cache.dtype in floats
        and v_cache.dtype == k_cache.dtype
        and q.shape[-1] % 16 == 0
        and v_cache.shape[-1] % 16 == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def slot_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in plain torch (the reference, and the `magicdec_cpu_torch` backend):
    the batch's lists gathered padded to one width and its query rows padded to the longest
    request's, then two batched matmuls and a masked softmax in float32."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[2]
    check_gqa(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    if out is None:
        out = q.new_empty(q.shape[0], num_q_heads, v_dim)
    batch, width = kv_lens.numel(), head_slots.shape[-1]
    q_lens = q_indptr[1:] - q_indptr[:-1]
    q_rows = int(q_lens.max()) if batch else 0
    if q_rows == 0:
        return out
    # Padded row i of request b is its row min(i, q_len - 1) (padding rows are dropped).
    row_index = torch.arange(q_rows)[None, :].minimum((q_lens - 1).clamp(min=0)[:, None])
    rows = (q_indptr[:-1, None] + row_index).clamp(max=max(q.shape[0] - 1, 0))
    queries = (
        q[rows.view(-1)]
        .view(batch, q_rows, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, num_kv_heads, group * q_rows, head_dim)
        .float()
    )  # the query heads of one KV head, and their rows, share a matmul
    # Entries past a list's length are never read: slot 0 stands in for whatever they hold.
    listed = torch.arange(width)[None, None, :] < kv_lens[:, None, None]
    lists = torch.where(listed, head_slots, 0).expand(batch, num_kv_heads, width)
    keys = _gather_rows(k_cache, lists).float()  # [B, Hkv, W, D]
    values = _gather_rows(v_cache, lists).float()
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
    # Row i of a request sees the first kv_len - q_len + i + 1 entries of its list.
    seen = (kv_lens - q_lens)[:, None] + torch.arange(q_rows)[None, :] + 1  # [B, q_rows]
    hidden = torch.arange(width)[None, None, :] >= seen[:, :, None]
    scores = scores.view(batch, num_kv_heads, group, q_rows, width)
    scores.masked_fill_(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row seeing nothing: zeros
    result = torch.matmul(probs.view(batch, num_kv_heads, group * q_rows, width), values)
    result = (
        result.view(batch, num_kv_heads, group, q_rows, v_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch * q_rows, num_q_heads, v_dim)
    )
    real = (torch.arange(q_rows)[None, :] < q_lens[:, None]).view(-1)
    out[rows.view(-1)[real]] = result[real].to(out.dtype)
    return out


def _gather_rows(cache: torch.Tensor, lists: torch.Tensor) -> torch.Tensor:
    """cache[lists[b, h, j], h] as [B, Hkv, W, D]: one index_select on the pool's storage."""
    batch, num_kv_heads, width = lists.shape
    slots, dim = cache.shape[0], cache.shape[2]
    heads = torch.arange(num_kv_heads)[None, :, None]
    by_head = cache.permute(1, 0, 2)
    if by_head.is_contiguous():  # our head-major pool: row h * slots + slot
        flat, index = by_head.reshape(num_kv_heads * slots, dim), heads * slots + lists
    elif cache.is_contiguous():  # token-major: row slot * Hkv + h
        flat, index = cache.view(slots * num_kv_heads, dim), lists * num_kv_heads + heads
    else:
        return by_head[heads, lists]
    return flat.index_select(0, index.reshape(-1)).view(batch, num_kv_heads, width, dim)


def slot_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_indptr: torch.Tensor,
    head_slots: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The native kernel where it is loaded and takes these tensors, else `slot_attention_torch`.
    Returns out, [Nq, Hq, Dv]."""
    module = native() if supports_native(q, k_cache, v_cache) else None
    if module is None:
        return slot_attention_torch(q, k_cache, v_cache, q_indptr, head_slots, kv_lens, scale, out)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[2])
    return module.slot_attention(
        q, k_cache, v_cache, q_indptr, head_slots, kv_lens, float(scale), out
    )


def supports_few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` takes the native kernel for these tensors."""
    return (
        not x.is_cuda
        and x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= capabilities().few_rows_max(x.dtype)
        and weight.dtype == x.dtype
        and weight.layout == torch.strided
        and weight.stride(-1) == 1
        and x.is_contiguous()
    )


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x·weightᵀ by the native kernel where it is loaded and takes these tensors, else None:
    x [M, K] contiguous, weight [N, K] with contiguous rows, both float32 or both bfloat16;
    returns [M, N] in x's dtype. The weight is packed at its first use (`pack_rows`, kept while
    the weight lives and is not written to).

    Each output is one float32 dot product in a fixed order whatever M is, so a row's result does
    not depend on the rows sharing the call; bf16 results are rounded once, to nearest even."""
    module = native() if supports_few_rows(x, weight) else None
    if module is None:
        return None
    out = x.new_empty(x.shape[0], weight.shape[0])
    return module.few_rows_linear(x, packed_rows(weight), weight.shape[0], out)


PANEL = 16  # output rows per panel of a packed weight (csrc/few_rows_linear.cpp)


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] in the few-row product's layout: panels of PANEL rows (the last padded
    with zeros), each walked along K; float32 [N / 16, K, 16], bfloat16 [N / 16, K / 2, 16, 2]
    (pairs of k, K padded to even)."""
    rows, depth = weight.shape
    panels = -(-rows // PANEL)
    if weight.dtype == torch.bfloat16:
        padded = weight.new_zeros(panels * PANEL, depth + depth % 2)
        padded[:rows, :depth] = weight
        return padded.view(panels, PANEL, -1, 2).permute(0, 2, 1, 3).contiguous()
    padded = weight.new_zeros(panels * PANEL, depth)
    padded[:rows] = weight
    return padded.view(panels, PANEL, depth).transpose(1, 2).contiguous()


# Each weight's packed copy, by the weight's id: (a weak reference to the weight, the version it
# was packed from, the copy). A weight written in place (SGLang's weight updates) is packed again;
# a collected one's copy goes with it. One more copy of the weights decode-sized products read
# (the LM head's included); prefill keeps reading the originals.
_PACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def packed_rows(weight: torch.Tensor) -> torch.Tensor:
    """`pack_rows(weight)`, packed once per version of the weight."""
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        return entry[2]
    packed = pack_rows(weight)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _PACKED.get(key, (None,))[0] is ref:
            del _PACKED[key]

    _PACKED[key] = (weakref.ref(weight, forget), weight._version, packed)
    return packed


# A decoder layer's per-token ops (csrc/layer_ops.cpp): SGLang's torch versions of these are 5-20
# small torch ops each, whose dispatch, not arithmetic, costs 80-270 us per call at decode sizes;
# one native call costs a few. Each takes float32 or bfloat16 rows (2-D, the last dim contiguous)
# and rounds as its torch reference does; each returns None (or False) where the extension is not
# loaded or the tensors are not ones it takes, and the caller then runs the torch version.
LAYER_DTYPES = (torch.float32, torch.bfloat16)


def _takes_rows(*tensors: torch.Tensor) -> bool:
    return all(
        not t.is_cuda and t.dtype in LAYER_DTYPES and t.dim() == 2 and t.stride(-1) == 1
        for t in tensors
    )


def rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(out, residual_out): h = x (+ residual) in float32, residual_out = h in x's dtype, out =
    h / sqrt(mean(h²) + eps) times weight, rounded to x's dtype before the weight product when
    `cast_before_weight` (the weight then in x's dtype), after it otherwise. x [T, H]."""
    rows = (x,) if residual is None else (x, residual)
    if not _takes_rows(*rows) or weight.dtype not in LAYER_DTYPES or weight.dim() != 1:
        return None
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return None
    if cast_before_weight and weight.dtype != x.dtype:
        return None
    module = native()
    if module is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    module.rms_norm(x, residual, weight.contiguous(), eps, cast_before_weight, out, residual_out)
    return out, residual_out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    neox_style: bool,
) -> bool:
    """Rotates query [T, Hq * head_size] and key [T, Hk * head_size] in place: the first
    rotary_dim = cos_sin_cache.shape[1] dims of every head by cos_sin_cache[positions] (cos, then
    sin: rotary_dim / 2 each), neox style (dim i with i + rotary_dim / 2) or GPT-J style (2i
    with 2i + 1); each product and sum rounded to query's dtype. False where it did nothing."""
    if not _takes_rows(query, key, cos_sin_cache) or query.dtype != key.dtype:
        return False
    if positions.dtype != torch.int64 or positions.dim() != 1 or positions.is_cuda:
        return False
    module = native()
    if module is None:
        return False
    module.rotary_embedding(positions, query, key, cos_sin_cache, head_size, neox_style)
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :d]) * x[:, d:] for x [T, 2d], silu rounded to x's dtype before the product."""
    if not _takes_rows(x) or x.shape[-1] % 2:
        return None
    module = native()
    if module is None:
        return None
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    module.silu_and_mul(x, out)
    return out


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """k_cache[loc] = k and v_cache[loc] = v: caches [slots, Hkv, D] (any strides, the last dim
    contiguous: the head-major pool's view), k and v [T, Hkv, D] in their cache's dtype. False
    where it did nothing."""
    tensors = (k_cache, v_cache, k, v)
    if any(t.is_cuda or t.dim() != 3 or t.stride(-1) != 1 for t in tensors):
        return False
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or loc.dtype != torch.int64:
        return False
    module = native()
    if module is None:
        return False
    module.store_kv(k_cache, v_cache, loc, k, v)
    return True
