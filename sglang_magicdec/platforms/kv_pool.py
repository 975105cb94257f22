"""SGLang's MHA KV pool for the CPU platform: head-major storage, torch-native KV moves.

Head-major storage: each layer's K (and V) is stored as [Hkv, slots, D] and handed out as the
[slots, Hkv, D] view every SGLang backend expects (a permuted view: indexing by slot works
unchanged). On a CPU, decode attention is bound by reading K and V, and a request's prompt sits
in one contiguous range of slots; head-major, each KV head's keys of that range are one
contiguous block, which the attention kernels read at close to memory bandwidth, where the
token-major layout interleaves the heads and halves the rate (`benchmark/bench_cpu_backend.py`).

Speculative decoding makes SGLang warm up a Triton slot-copy kernel when the pool is built;
Triton has no CPU driver here. SGLang's own torch fallback (`move_kv_cache_native`) does the same
move, so this subclass skips the warm-up and selects the fallback.

A forward's KV write is one native call (`cpu_native.store_kv`) instead of SGLang's two indexed
assignments into the permuted view (~90 us per layer at decode sizes on two cores).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from magicdec_kernels import cpu_native


class TorchMoveMHAPool(MHATokenToKVPool):
    def _init_kv_copy_and_warmup(self) -> None:
        self.use_native_move_kv_cache = True
        self._kv_copy_config = None

    def _create_buffers_normal(self) -> None:
        if self.kv_cache_layout != "nhd":
            return super()._create_buffers_normal()
        rows = self.size + self.page_size

        def head_major(head_dim: int) -> torch.Tensor:
            storage = torch.zeros(
                (self.head_num, rows, head_dim), dtype=self.store_dtype, device=self.device
            )
            return storage.permute(1, 0, 2)  # [rows, Hkv, D], strides (D, rows * D, 1)

        self.k_buffer = [head_major(self.head_dim) for _ in range(self.layer_num)]
        self.v_buffer = [head_major(self.v_head_dim) for _ in range(self.layer_num)]

    def _store_kv_layer(self, layer_idx: int, loc, cache_k, cache_v) -> None:
        # SGLang's seam for a layout's own write: the rows are cast to the store dtype by now.
        heads = self.head_num
        if (
            self.kv_cache_layout == "nhd"
            and cache_k.numel() == loc.numel() * heads * self.head_dim
            and cache_v.numel() == loc.numel() * heads * self.v_head_dim
            and cpu_native.store_kv(
                self.k_buffer[layer_idx],
                self.v_buffer[layer_idx],
                loc,
                cache_k.reshape(-1, heads, self.head_dim),
                cache_v.reshape(-1, heads, self.v_head_dim),
            )
        ):
            return
        super()._store_kv_layer(layer_idx, loc, cache_k, cache_v)
