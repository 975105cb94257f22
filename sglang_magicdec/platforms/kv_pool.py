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

The buffers of all layers are carved from one allocation advised into transparent huge pages
(`madvise(MADV_HUGEPAGE)`, before its pages are first touched), where Linux allows it: a KV
head's keys of one request span hundreds of 4 KiB pages, and with 2 MiB pages the kernels'
reads miss the TLB far less (`benchmark/bench_huge_pages.py`; `benchmark/results/huge_pages/`).
Elsewhere, or where the kernel says no, the pages are ordinary ones.

A forward's KV write is one native call (`cpu_native.store_kv`) instead of SGLang's two indexed
assignments into the permuted view, which at decode sizes cost their dispatch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from magicdec_kernels import cpu_native

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor whose pages were advised into transparent huge pages before
    being touched (2 MiB-aligned start); ordinary zeros where that is not possible."""
    madvise = _madvise()
    nbytes = numel * dtype.itemsize
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page yet
    offset = -raw.data_ptr() % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if madvise(raw.data_ptr() + offset, length, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
    return raw[offset : offset + nbytes].view(dtype).zero_()


class TorchMoveMHAPool(MHATokenToKVPool):
    def _init_kv_copy_and_warmup(self) -> None:
        self.use_native_move_kv_cache = True
        self._kv_copy_config = None

    def _create_buffers_normal(self) -> None:
        if self.kv_cache_layout != "nhd":
            return super()._create_buffers_normal()
        rows = self.size + self.page_size
        k_numel, v_numel = (
            self.layer_num * self.head_num * rows * dim for dim in (self.head_dim, self.v_head_dim)
        )
        if torch.device(self.device).type == "cpu":
            storage = huge_page_zeros(k_numel + v_numel, self.store_dtype)
        else:
            storage = torch.zeros(k_numel + v_numel, dtype=self.store_dtype, device=self.device)
        k_part, v_part = storage.split([k_numel, v_numel])

        def head_major(part: torch.Tensor, head_dim: int) -> list[torch.Tensor]:
            # [rows, Hkv, D] views of [Hkv, rows, D] storage: strides (D, rows * D, 1).
            layers = part.view(self.layer_num, self.head_num, rows, head_dim)
            return [layer.permute(1, 0, 2) for layer in layers.unbind(0)]

        self.k_buffer = head_major(k_part, self.head_dim)
        self.v_buffer = head_major(v_part, self.v_head_dim)

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
