"""Torch versions of the few SGLang helpers that only dispatch to Triton (CUDA) or to the AMX
CPU kernel package, and a faster CPU path for decode-sized linear layers, installed on our CPU
platform through `HookRegistry`.

SGLang 0.5.23 offers a platform seam for some of these (KV pool, cache locations) but not for
these module-level helpers or the unquantised linear method; a REPLACE or AROUND hook on each is
the narrowest change.
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


HOOKS = {
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func": assign_req_to_token_pool,
}
AROUND_HOOKS = {
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply": decode_sized_linear,
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head": decode_sized_lm_head,
}


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, replacement in HOOKS.items():
        HookRegistry.register(target, replacement, HookType.REPLACE)
    for target, wrapper in AROUND_HOOKS.items():
        HookRegistry.register(target, wrapper, HookType.AROUND)
