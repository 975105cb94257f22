"""Torch versions of the few SGLang helpers that only dispatch to Triton (CUDA) or to the AMX
CPU kernel package, a faster CPU path for decode-sized linear layers, and native forwards for a
decoder layer's per-token ops, installed on our CPU platform.

SGLang 0.5.23 offers a platform seam for some of these (KV pool, cache locations) but not for
these module-level helpers or the unquantised linear method; a REPLACE or AROUND hook on each is
the narrowest change. Its fused ops (RMSNorm, rotary embedding, SiLU-and-mul) have their own seam
for an out-of-tree platform, `BaseFusedOp.register_oot_forward`, which takes precedence over
their torch `forward_native` on our platform (dispatch key "native"): each forward below calls
the native op (`magicdec_kernels.cpu_native`) where it takes the module's configuration and the
tensors, and `forward_native` otherwise.
"""

from __future__ import annotations

import torch

from magicdec_kernels import cpu_native


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """req_to_token[row_i, start_i:end_i] = the next (end_i - start_i) slots of out_cache_loc."""
    cursor = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + length].to(
            req_to_token.dtype
        )
        cursor += length


# Rows (tokens) up to which a product with a weight matrix takes a few-row path: decode, draft
# and verify steps.
MAX_WEIGHT_MAJOR_ROWS = 64


def few_rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x·Wᵀ for a few rows of x, or None where SGLang's own path should run.

    With a handful of rows a decode step's weight products are bound by reading W. The native
    kernel (`cpu_native.few_rows_linear`) reads it about at the bytes floor on both cores; where
    it is not loaded or not faster (bf16 past a few rows), the weight-major torch product runs:
    `F.linear` and `x @ W.T` on this CPU (MKL) run such shapes on one core, while W·xᵀ splits W's
    rows over both (`benchmark/bench_cpu_backend.py --kernels` measures all three)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if x.is_cuda or not 0 < rows <= MAX_WEIGHT_MAJOR_ROWS or weight.dim() != 2:
        return None
    if weight.dtype != x.dtype or weight.layout != torch.strided or weight.is_quantized:
        return None
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    product = cpu_native.few_rows_linear(flat, weight)
    if product is None:
        product = weight_major_product(flat, weight)
    return product.view(*x.shape[:-1], weight.shape[0])


def weight_major_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K]·Wᵀ as (W·xᵀ)ᵀ, row-major (a copy of a few rows: the ops that follow expect
    contiguous rows)."""
    return torch.mm(weight, x.t()).t().contiguous()


def decode_sized_linear(original, method, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
    """`UnquantizedLinearMethod.apply` with the few-row product for decode-sized inputs."""
    product = few_rows_product(x, layer.weight)
    if product is None:
        return original(method, layer, x, bias)
    return product if bias is None else product + bias


def decode_sized_lm_head(
    original, processor, hidden_states, lm_head, embedding_bias=None, **kwargs
) -> torch.Tensor:
    """`LogitsProcessor._compute_lm_head` with the few-row product, where SGLang would take
    its plain branch (`hidden_states @ lm_head.weight.T`: no LoRA, no quantised or fp32 head)."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    plain = (
        hasattr(lm_head, "weight")
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not processor.use_fp32_lm_head
        and getattr(processor, "rl_on_policy_target", None) is None
    )
    product = few_rows_product(hidden_states, lm_head.weight) if plain else None
    if product is None:
        return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)
    return product


# -- a decoder layer's per-token ops --------------------------------------------------------------
# At decode sizes SGLang's torch versions cost their dispatch, not their arithmetic; the native
# ones a few microseconds (`benchmark/results/HISTORY.md`, block 1).


def _as_rows(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """x as [tokens, width] rows without a copy, or None."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, width)
    except RuntimeError:
        return None


def rms_norm_forward(op, x, residual=None, post_residual_addition=None, quant_linear=None):
    """`RMSNorm.forward_native`, natively where nothing but the plain norm is configured."""
    plain = (
        post_residual_addition is None
        and op.variance_size_override is None
        and op.override_orig_dtype in (None, x.dtype)
        and not op.fp32_residual
        and x.shape[-1] == op.hidden_size
    )
    rows = _as_rows(x, op.hidden_size) if plain else None
    residual_rows = None if residual is None else _as_rows(residual, op.hidden_size)
    result = None
    if rows is not None and (residual is None or residual_rows is not None):
        result = cpu_native.rms_norm(
            rows, residual_rows, op.weight.data, op.variance_epsilon, op.cast_x_before_out_mul
        )
    if result is None:
        return op.forward_native(x, residual, post_residual_addition, quant_linear)
    out, residual_out = result
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(residual.shape)


def rotary_forward(
    op, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RotaryEmbedding.forward_native` in place, natively for the cached cos/sin of plain
    positions (what the classes `hooks` registers compute)."""
    if offsets is None and fused_set_kv_buffer_arg is None and not hasattr(op, "sin_cos_cache"):
        tokens = positions.numel()
        query_rows = query.view(tokens, -1) if query.is_contiguous() or query.dim() == 2 else None
        key_rows = key.view(tokens, -1) if key.is_contiguous() or key.dim() == 2 else None
        cache = op.cos_sin_cache
        if (
            query_rows is not None
            and key_rows is not None
            and cache.shape[-1] == op.rotary_dim
            and cpu_native.rotary_embedding(
                positions.reshape(-1), query_rows, key_rows, cache, op.head_size, op.is_neox_style
            )
        ):
            return query, key
    return op.forward_native(positions, query, key, offsets, fused_set_kv_buffer_arg)


def silu_and_mul_forward(op, x: torch.Tensor) -> torch.Tensor:
    """`SiluAndMul.forward_native`, natively."""
    rows = _as_rows(x, x.shape[-1])
    out = None if rows is None else cpu_native.silu_and_mul(rows)
    if out is None:
        return op.forward_native(x)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def rotary_classes() -> list[type]:
    """RotaryEmbedding and those of its subclasses that only change the cos/sin cache (the
    registry is keyed by exact class): Llama 3's, linear, YaRN and NTK scaling among them."""
    import sglang.srt.layers.rotary_embedding as package  # all its modules, so all subclasses
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    del package
    classes, pending = [], [RotaryEmbedding]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.forward is RotaryEmbedding.forward and (
            cls.forward_native is RotaryEmbedding.forward_native
        ):
            classes.append(cls)
    return classes
