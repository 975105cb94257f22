"""The radix cache's events, as SnapKV summaries and γ = auto's per-request state need to hear
them: a subscriber (`RadixCacheListener`) hears its process's cache take a request's tokens in,
free KV slots, release a request and be flushed, and may bound a prompt's prefix match. The
plugin entry point (`plugin.load`) registers the hooks below; subscribers import this module.
"""

from __future__ import annotations

import weakref

import torch

# SnapKV summaries and γ = auto's per-request state live beside the radix cache and follow its
# requests and its KV. SGLang documents `on_release` as the place to "drop per-request state
# kept outside the tree"; the rest has no public seam, so these are hooked directly:
# `checkpoint` (every insert of a request's computed tokens: after it, the request's
# `req_to_token` row points at the tree's copy of them, its duplicates freed),
# `_apply_cache_action` (every device KV slot the tree frees, by eviction or as a duplicate, is
# in one such action) and `reset` (flush_cache). The hooks are registered once per process and
# tell whoever subscribed (the SnapKV selection, γ = auto's controller).
RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"


class RadixCacheListener:
    """What a subscriber hears of its process's radix cache; each method does nothing unless
    overridden."""

    def max_prefix_len(self, req, limit: int) -> int:
        """How much of `req`'s prompt the cache may match, SGLang's own bound being `limit`."""
        return limit

    def request_released(self, rid: str) -> None:
        """SGLang freed the request's KV (finished, aborted or retracted)."""

    def tokens_cached(self, req, row: torch.Tensor) -> None:
        """The cache took `req`'s computed tokens into the tree; `row` is the request's
        `req_to_token` row, which now points at the tree's copy of them."""

    def kv_freed(self, slots: torch.Tensor) -> None:
        """The cache freed these KV pool slots (token slots, on the pool's device)."""

    def cache_reset(self) -> None:
        """The cache was flushed."""


# Held weakly: SGLang gives a speculative worker no shutdown call, so a subscriber stops
# listening when it is collected, or earlier through `unsubscribe`.
_radix_cache_listeners: list[weakref.ref[RadixCacheListener]] = []


def subscribe(listener: RadixCacheListener) -> None:
    if listener not in _listeners():
        _radix_cache_listeners.append(weakref.ref(listener))


def unsubscribe(listener: RadixCacheListener) -> None:
    _radix_cache_listeners[:] = [ref for ref in _radix_cache_listeners if ref() is not listener]


def _listeners() -> list[RadixCacheListener]:
    _radix_cache_listeners[:] = [ref for ref in _radix_cache_listeners if ref() is not None]
    return [listener for ref in _radix_cache_listeners if (listener := ref()) is not None]


def _request_released(result, cache, req, *args, **kwargs):
    for listener in _listeners():
        listener.request_released(req.rid)
    return result


def _tokens_cached(result, cache, req, *args, **kwargs):
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    for listener in _listeners():
        listener.tokens_cached(req, row)
    return result


def _kv_freed(result, cache, action, *args, **kwargs):
    slots = freed_full_kv_slots(action)
    if slots is not None:
        for listener in _listeners():
            listener.kv_freed(slots)
    return result


def freed_full_kv_slots(action) -> torch.Tensor | None:
    """The full-attention KV slots a radix-cache action frees, or None (another kind of
    action, another component's slots, or nothing)."""
    from sglang.srt.mem_cache.unified_cache.cache_action import (
        FreeComponentDeviceSlot,
        FreeDeviceKV,
        FreeDeviceKVFullOnly,
    )
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    if isinstance(action, FreeComponentDeviceSlot):
        if action.component_type != ComponentType.FULL:
            return None
    elif not isinstance(action, (FreeDeviceKV, FreeDeviceKVFullOnly)):
        return None
    indices = [indices.reshape(-1) for indices in action.indices if indices.numel()]
    return torch.cat(indices) if indices else None


def _cache_reset(result, *args, **kwargs):
    for listener in _listeners():
        listener.cache_reset()
    return result


RADIX_CACHE_HOOKS = {
    "on_release": _request_released,
    "checkpoint": _tokens_cached,
    "_apply_cache_action": _kv_freed,
    "reset": _cache_reset,
}

# Before matching a request's prompt in the radix cache, SGLang bounds the match in this method
# (the bound that keeps the last token, or everything from `logprob_start_len` on, recomputed).
# SnapKV lowers it for a prompt that must prefill its own observation window: the narrowest
# seam that decides how much of a prompt is prefilled.
PREFIX_MATCH_LIMIT = "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len"


def max_prefix_len(original, req, *args, **kwargs) -> int:
    limit = original(req, *args, **kwargs)
    for listener in _listeners():
        limit = listener.max_prefix_len(req, limit)
    return limit
