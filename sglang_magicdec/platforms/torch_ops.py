"""Torch versions of the few SGLang speculative-decoding helpers that only dispatch to Triton
(CUDA) or to the AMX CPU kernel package, installed on our CPU platform through `HookRegistry`.

SGLang 0.5.23 offers a platform seam for some of these (KV pool, cache locations) but not for
these module-level helpers; a REPLACE hook on each is the narrowest change.
"""

from __future__ import annotations

import torch


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


HOOKS = {
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func": assign_req_to_token_pool,
}


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, replacement in HOOKS.items():
        HookRegistry.register(target, replacement, HookType.REPLACE)
