"""The torch-native CPU platform class (see `sglang_magicdec.platforms`).

SGLang imports this module while it resolves its platform, on its first import; so import SGLang
(or `sglang_magicdec.platforms`) before this module, never this module first.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sglang_magicdec.platforms import ATTENTION_BACKEND

DEFAULT_MEM_FRACTION = 0.25


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
            # SGLang's "auto" halves float32 checkpoints to float16 for GPUs; CPUs gain nothing
            # from that here, and float32 keeps outputs exact.
            server_args.dtype = "float32"
        if server_args.mem_fraction_static is None:
            # SGLang's GPU default (~0.7 of free memory for KV) would take most of the machine's
            # RAM and make a start take 10+ s just to zero it.
            server_args.mem_fraction_static = DEFAULT_MEM_FRACTION

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
        return "native"
