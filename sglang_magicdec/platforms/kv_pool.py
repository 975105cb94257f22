"""SGLang's MHA KV pool with torch-native KV moves, for the CPU platform.

Speculative decoding makes SGLang warm up a Triton slot-copy kernel when the pool is built;
Triton has no CPU driver here. SGLang's own torch fallback (`move_kv_cache_native`) does the same
move, so this subclass skips the warm-up and selects the fallback.
"""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


class TorchMoveMHAPool(MHATokenToKVPool):
    def _init_kv_copy_and_warmup(self) -> None:
        self.use_native_move_kv_cache = True
        self._kv_copy_config = None
