"""The SGLang internals we hook exist in the installed SGLang, and the radix-cache hooks tell
listeners only what they need to hear.

SGLang's `HookRegistry.apply_hooks` logs a target it cannot resolve and goes on, so a renamed
internal would silently drop our hook; this test is where such a rename fails loudly.
"""

from __future__ import annotations

import gc
import pkgutil

import pytest
import torch
from sglang.srt.mem_cache.unified_cache.cache_action import (
    BackupKV,
    FreeComponentDeviceSlot,
    FreeDeviceKV,
    FreeDeviceKVFullOnly,
)
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
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
        f"{plugin.RADIX_CACHE}.checkpoint",
        f"{plugin.RADIX_CACHE}._apply_cache_action",
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
        self.freed: list[list[int]] = []

    def kv_freed(self, slots) -> None:
        self.freed.append(slots.tolist())


@pytest.fixture
def recorder():
    listener = Recorder()
    plugin.subscribe_to_radix_cache(listener)
    yield listener
    plugin.unsubscribe_from_radix_cache(listener)


def test_listeners_hear_the_full_kv_slots_each_cache_action_frees(recorder):
    """Evictions and duplicate frees both go through `_apply_cache_action`: listeners hear the
    full-attention slots of SGLang's own free actions, and nothing of other actions, other
    components' slots or empty frees."""
    free_kv = FreeDeviceKV(indices=[torch.tensor([4, 5]), torch.tensor([9])])
    plugin._kv_freed(None, None, free_kv)
    plugin._kv_freed(None, None, FreeDeviceKVFullOnly(indices=[torch.tensor([7])]))
    full = ComponentType.FULL
    plugin._kv_freed(None, None, FreeComponentDeviceSlot([torch.tensor([1, 2])], full))
    assert recorder.freed == [[4, 5, 9], [7], [1, 2]]
    plugin._kv_freed(None, None, FreeComponentDeviceSlot([torch.tensor([3])], ComponentType.SWA))
    plugin._kv_freed(None, None, FreeDeviceKV(indices=[torch.tensor([], dtype=torch.int64)]))
    plugin._kv_freed(None, None, BackupKV(node_ids=[1]))
    assert recorder.freed == [[4, 5, 9], [7], [1, 2]]


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
    free_kv = FreeDeviceKV(indices=[torch.tensor([4])])
    plugin._kv_freed(None, None, free_kv)
    assert kept.freed == [[4]]
    plugin.unsubscribe_from_radix_cache(kept)
    plugin._kv_freed(None, None, free_kv)
    assert kept.freed == [[4]] and plugin._listeners() == []
