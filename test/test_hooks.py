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

from sglang_magicdec import config, plugin, radix_events
from sglang_magicdec.platforms import hooks

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
        f"{radix_events.RADIX_CACHE}.on_release",
        f"{radix_events.RADIX_CACHE}.checkpoint",
        f"{radix_events.RADIX_CACHE}._apply_cache_action",
        f"{radix_events.RADIX_CACHE}.reset",
        radix_events.PREFIX_MATCH_LIMIT,
        plugin.INTERNAL_STATE_SPECULATIVE,
        f"{config.SERVER_ARGS}.add_cli_args",
        f"{config.SERVER_ARGS}.from_cli_args",
        hooks.SET_ENVS_AND_CONFIG,
    ):
        assert expected in targets


def test_a_cpu_server_forks_its_scheduler_and_detokenizer():
    """SGLang's environment step, as our CPU platform hooks it, leaves the launcher starting its
    processes by fork: SGLang's spawn makes each child import SGLang again (~20 s a start)."""
    import multiprocessing
    import os
    import signal

    from sglang.srt.entrypoints import engine
    from sglang.srt.server_args import ServerArgs

    from sglang_magicdec.model import SMOLLM2, embedded_model_path

    load_plugins()
    server_args = ServerArgs(model_path=embedded_model_path(SMOLLM2))
    server_args.resolve_once()
    # The step also sets environment variables, limits and a SIGQUIT handler for the launcher.
    method, environ = multiprocessing.get_start_method(allow_none=True), dict(os.environ)
    sigquit = signal.getsignal(signal.SIGQUIT)
    try:
        engine._set_envs_and_config(server_args)
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(method, force=True)
        os.environ.clear()
        os.environ.update(environ)
        signal.signal(signal.SIGQUIT, sigquit)


@pytest.mark.parametrize("target", our_hook_targets())
def test_hooked_sglang_internal_exists(target):
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    assert callable(getattr(owner, name, None)), f"SGLang 0.5.23 has no {target}"


class Recorder(radix_events.RadixCacheListener):
    def __init__(self):
        self.freed: list[list[int]] = []

    def kv_freed(self, slots) -> None:
        self.freed.append(slots.tolist())


@pytest.fixture
def recorder():
    listener = Recorder()
    radix_events.subscribe(listener)
    yield listener
    radix_events.unsubscribe(listener)


def test_listeners_hear_the_full_kv_slots_each_cache_action_frees(recorder):
    """Evictions and duplicate frees both go through `_apply_cache_action`: listeners hear the
    full-attention slots of SGLang's own free actions, and nothing of other actions, other
    components' slots or empty frees."""
    free_kv = FreeDeviceKV(indices=[torch.tensor([4, 5]), torch.tensor([9])])
    radix_events._kv_freed(None, None, free_kv)
    radix_events._kv_freed(None, None, FreeDeviceKVFullOnly(indices=[torch.tensor([7])]))
    full = ComponentType.FULL
    radix_events._kv_freed(None, None, FreeComponentDeviceSlot([torch.tensor([1, 2])], full))
    assert recorder.freed == [[4, 5, 9], [7], [1, 2]]
    swa_free = FreeComponentDeviceSlot([torch.tensor([3])], ComponentType.SWA)
    radix_events._kv_freed(None, None, swa_free)
    radix_events._kv_freed(None, None, FreeDeviceKV(indices=[torch.tensor([], dtype=torch.int64)]))
    radix_events._kv_freed(None, None, BackupKV(node_ids=[1]))
    assert recorder.freed == [[4, 5, 9], [7], [1, 2]]


def test_listeners_are_held_weakly_and_can_unsubscribe():
    """SGLang gives a speculative worker no shutdown call: a collected subscriber stops
    listening, and one that unsubscribes hears nothing more."""
    kept, dropped = Recorder(), Recorder()
    radix_events.subscribe(kept)
    radix_events.subscribe(kept)  # once only
    radix_events.subscribe(dropped)
    del dropped
    gc.collect()
    assert radix_events._listeners() == [kept]
    free_kv = FreeDeviceKV(indices=[torch.tensor([4])])
    radix_events._kv_freed(None, None, free_kv)
    assert kept.freed == [[4]]
    radix_events.unsubscribe(kept)
    radix_events._kv_freed(None, None, free_kv)
    assert kept.freed == [[4]] and radix_events._listeners() == []
