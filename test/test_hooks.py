"""The SGLang internals we hook exist in the installed SGLang, and the radix-cache hooks tell
listeners only what they need to hear.

SGLang's `HookRegistry.apply_hooks` logs a target it cannot resolve and goes on, so a renamed
internal would silently drop our hook; this test is where such a rename fails loudly.
"""

from __future__ import annotations

import gc
import pkgutil
from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictResult
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_magicdec import config, plugin

OURS = "sglang_magicdec"


def our_hook_targets() -> list[str]:
    load_plugins()
    return sorted(
        target
        for target, hooks in HookRegistry._hooks.items()
        if any(getattr(hook, "__module__", "").startswith(OURS) for _, hook, _ in hooks)
    )


def test_hooks_cover_the_internals_the_design_names():
    targets = our_hook_targets()
    for expected in (
        f"{plugin.RADIX_CACHE}.on_release",
        f"{plugin.RADIX_CACHE}._evict",
        f"{plugin.RADIX_CACHE}.reset",
        plugin.PREFIX_MATCH_LIMIT,
        plugin.INTERNAL_STATE_SPECULATIVE,
        f"{config.SERVER_ARGS}.add_cli_args",
        f"{config.SERVER_ARGS}.from_cli_args",
    ):
        assert expected in targets


@pytest.mark.parametrize("target", our_hook_targets())
def test_hooked_sglang_internal_exists(target):
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    assert callable(getattr(owner, name, None)), f"SGLang 0.5.23 has no {target}"


class Recorder(plugin.RadixCacheListener):
    def __init__(self):
        self.freed = 0

    def kv_freed(self, allocator) -> None:
        self.freed += 1


@pytest.fixture
def recorder():
    listener = Recorder()
    plugin.subscribe_to_radix_cache(listener)
    yield listener
    plugin.unsubscribe_from_radix_cache(listener)


CACHE = SimpleNamespace(token_to_kv_pool_allocator=None)


def test_an_eviction_that_freed_nothing_is_not_reported(recorder):
    plugin._kv_evicted(EvictResult(num_tokens_evicted=0), CACHE)
    assert recorder.freed == 0
    plugin._kv_evicted(EvictResult(num_tokens_evicted=5), CACHE)
    assert recorder.freed == 1


def test_listeners_are_held_weakly_and_can_unsubscribe():
    """SGLang gives a speculative worker no shutdown call: a collected subscriber stops
    listening, and one that unsubscribes hears nothing more."""
    kept, dropped = Recorder(), Recorder()
    plugin.subscribe_to_radix_cache(kept)
    plugin.subscribe_to_radix_cache(kept)  # once only
    plugin.subscribe_to_radix_cache(dropped)
    del dropped
    gc.collect()
    assert plugin._listeners() == [kept]
    plugin._kv_evicted(EvictResult(num_tokens_evicted=5), CACHE)
    assert kept.freed == 1
    plugin.unsubscribe_from_radix_cache(kept)
    plugin._kv_evicted(EvictResult(num_tokens_evicted=5), CACHE)
    assert kept.freed == 1 and plugin._listeners() == []
