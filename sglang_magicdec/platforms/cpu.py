"""The torch-native CPU platform class (see `sglang_magicdec.platforms`).

SGLang imports this module while it resolves its platform, on its first import; so import SGLang
(or `sglang_magicdec.platforms`) before this module, never this module first.
"""

from __future__ import annotations

import os

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from magicdec_kernels.loader import Capabilities, capabilities
from sglang_magicdec.platforms import ATTENTION_BACKEND

DEFAULT_MEM_FRACTION = 0.25
# With `--max-total-tokens` the pool's size is the user's; the fraction only checks that loading
# left enough free RAM. On a CPU that RAM is the whole machine's, so a neighbour allocating while
# this server loads (a second server zeroing its KV pool) fails a 0.25 check that this server's
# own weights never would: the check then keeps a tenth of the free RAM back, not three quarters.
FIXED_POOL_MEM_FRACTION = 0.9
# SGLang's CPU ranks bind their threads to this, one '|'-separated group per rank; unset, it
# allows one rank per NUMA node (this machine has one).
THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
# SGLang's fused ops look up an out-of-tree platform's forwards under this key
# (`hooks.register_fused_op_forwards`); without one registered they run `forward_native`.
DISPATCH_KEY = "native"


def threads_bind(cores: list[int], ranks: int) -> str:
    """`ranks` groups of the `cores` this process may use, contiguous, as SGLang's bind list
    ("0-3|4-7"); with fewer cores than ranks, ranks share them round-robin."""
    cores = sorted(cores)
    if len(cores) < ranks:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        group = cores[start : start + size + (rank < extra)]
        start += len(group)
        groups.append(f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0]))
    return "|".join(groups)


def default_dtype(cpu: Capabilities) -> str:
    """`--dtype auto` on our platform: bfloat16 on a CPU with native bf16 products (half the
    bytes of float32 per step, and greedy output the bf16 model's), float32 elsewhere (where bf16
    arithmetic is emulated and no faster)."""
    return "bfloat16" if cpu.bf16_products else "float32"


class MagicDecCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device operations from SGLang, but out-of-tree (`OOT`), so that SGLang's
    `is_cpu()` branches, which call the AMX kernel package, are never taken."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()  # no Triton, no graph capture

    def apply_server_args_defaults(self, server_args) -> None:
        # `device` and the attention backend are defaulted earlier, by resolution hooks in
        # `sglang_magicdec.plugin`: SGLang reads them before this method runs.
        server_args.disable_cuda_graph = True
        server_args.disable_overlap_schedule = True
        # The scheduler busy-polls when idle; on a CPU that steals the cores from everything else.
        server_args.sleep_on_idle = True
        if server_args.dtype == "auto":
            # SGLang's "auto" halves float32 checkpoints to float16 for GPUs; a CPU gains nothing
            # from fp16, but one that multiplies bf16 natively decodes bf16 ~2x faster than fp32.
            server_args.dtype = default_dtype(capabilities())
        ranks = server_args.tp_size * server_args.dp_size * server_args.pp_size
        if ranks > 1 and THREADS_BIND not in os.environ:
            # Set in the launcher, which starts the ranks: `--tp 2` needs no extra environment.
            os.environ[THREADS_BIND] = threads_bind(list(os.sched_getaffinity(0)), ranks)
        if server_args.mem_fraction_static is None:
            # SGLang's GPU default (~0.7 of free memory for KV) would take most of the machine's
            # RAM and make a start take 10+ s just to zero it.
            fixed_pool = server_args.max_total_tokens is not None
            server_args.mem_fraction_static = (
                FIXED_POOL_MEM_FRACTION if fixed_pool else DEFAULT_MEM_FRACTION
            )

    def get_kv_pool_cls(self, *, kind: str):
        if kind != "mha":
            return None
        from sglang_magicdec.platforms.kv_pool import TorchMoveMHAPool

        return TorchMoveMHAPool

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return ATTENTION_BACKEND

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm.upper() == "MAGICDEC"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return DISPATCH_KEY
