"""Plain torch references of the native CPU ops that only tests use (the runtime falls back to
SGLang's own torch code instead; `slot_attention_torch`, which the runtime runs, stays beside its
kernel in `magicdec_kernels.cpu_native`), and the float64 attention oracle. Each reference has
its op's signature and says what the op computes; the tests compare the ops against them."""

from __future__ import annotations

import torch


def few_rows_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x·weightᵀ: `cpu_native.few_rows_linear`'s product."""
    return torch.mm(x, weight.t(), out=out)


def rms_norm_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `cpu_native.rms_norm` computes (see its docstring)."""
    h = x.float() if residual is None else x.float() + residual.float()
    residual_out = None if residual is None else h.to(x.dtype)
    normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if cast_before_weight:
        return weight * normed.to(x.dtype), residual_out
    return (normed * weight).to(x.dtype), residual_out


def rotary_embedding_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    neox_style: bool,
) -> bool:
    """What `cpu_native.rotary_embedding` computes (see its docstring)."""
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions].to(query.dtype).split(half, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    for rows in (query, key):
        rotated = rows.view(rows.shape[0], -1, head_size)[..., : 2 * half]
        if neox_style:
            x1, x2 = rotated[..., :half].clone(), rotated[..., half:].clone()
            rotated[..., :half], rotated[..., half:] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        else:
            x1, x2 = rotated[..., 0::2].clone(), rotated[..., 1::2].clone()
            rotated[..., 0::2], rotated[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return True


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """What `cpu_native.silu_and_mul` computes (see its docstring)."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """What `cpu_native.store_kv` computes (see its docstring)."""
    k_cache[loc] = k
    v_cache[loc] = v
    return True


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
