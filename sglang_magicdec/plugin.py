"""`sglang.srt.plugins` entry point, run by SGLang early in every process (launcher, scheduler,
detokenizer), so whatever we register here exists wherever SGLang looks for it."""

from __future__ import annotations

import functools
import weakref

import torch

from sglang_magicdec.platforms import ATTENTION_BACKEND, CPU_ATTENTION_BACKENDS


def load() -> None:
    """Register our flags among SGLang's server arguments (`config`), MAGICDEC, our attention
    backends (the CPU ones; the wrapper SGLang's fa3,
    flashinfer and triton backends get while MAGICDEC runs), the request checks SGLang lacks
    (`validation`), our Prometheus metrics (`metrics`) and, on our CPU platform, the CPU
    defaults."""
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_magicdec import config, metrics, spec_algo, validation
    from sglang_magicdec.attention import create_backend
    from sglang_magicdec.gpu_attention import wrap_dense_backends
    from sglang_magicdec.platforms import is_active

    add_attention_backend_choices(list(CPU_ATTENTION_BACKENDS))
    for name in CPU_ATTENTION_BACKENDS:
        register_attention_backend(name)(functools.partial(create_backend, name=name))
    wrap_dense_backends()
    config.register()
    spec_algo.register()
    validation.register()
    metrics.register()
    HookRegistry.register(INTERNAL_STATE_SPECULATIVE, add_server_info, HookType.AFTER)
    for method, hook in RADIX_CACHE_HOOKS.items():
        HookRegistry.register(f"{RADIX_CACHE}.{method}", hook, HookType.AFTER)
    HookRegistry.register(PREFIX_MATCH_LIMIT, _max_prefix_len, HookType.AROUND)
    if is_active():
        from sglang_magicdec.platforms import torch_ops

        _register_cpu_defaults()
        torch_ops.register()


INTERNAL_STATE_SPECULATIVE = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController._add_speculative"
)


def add_server_info(result, controller, state: dict, *args, **kwargs):
    """Our worker's own acceptance counters in `/get_server_info`: SGLang's
    `avg_spec_accept_length` only folds in every `--decode-log-interval` decode batches."""
    server_info = getattr(controller.scheduler.draft_worker, "server_info", None)
    if server_info is not None:
        info = server_info()
        state["magicdec"] = info
        if info["verify_rounds"]:
            state["avg_spec_accept_length"] = info["avg_accept_length"]
    return result


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
# listening when it is collected, or earlier through `unsubscribe_from_radix_cache`.
_radix_cache_listeners: list[weakref.ref[RadixCacheListener]] = []


def subscribe_to_radix_cache(listener: RadixCacheListener) -> None:
    if listener not in _listeners():
        _radix_cache_listeners.append(weakref.ref(listener))


def unsubscribe_from_radix_cache(listener: RadixCacheListener) -> None:
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


def _max_prefix_len(original, req, *args, **kwargs) -> int:
    limit = original(req, *args, **kwargs)
    for listener in _listeners():
        limit = listener.max_prefix_len(req, limit)
    return limit


def _register_cpu_defaults() -> None:
    """Default `device` and the attention backend on our CPU platform.

    SGLang resolves both in named pipeline steps that run before the platform's own
    `apply_server_args_defaults`, and the CPU step would pick `intel_amx` (the kernel package we
    cannot build), so these two steps are wrapped: the narrowest seam SGLang offers for it.
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    @register_resolution_hook("handle_missing_default_values")
    def default_device_cpu(server_args, previous) -> None:
        if resolving_view(server_args).device is None:
            declare_resolution(server_args, "magicdec_cpu_platform", device="cpu")
        previous(server_args)

    @register_resolution_hook("handle_cpu_backends")
    def default_attention_backend(server_args, previous) -> None:
        if resolving_view(server_args).attention_backend is None:
            declare_resolution(
                server_args, "magicdec_cpu_platform", attention_backend=ATTENTION_BACKEND
            )
        previous(server_args)
