"""`sglang.srt.platforms` entry point: a torch-native CPU platform for machines with no GPU.

SGLang's own CPU engine (`SGLANG_USE_CPU_ENGINE=1`) needs a source-built AMX kernel package; this
platform instead runs the stock model code on plain torch ops, with our attention backend.
"""

from __future__ import annotations

import os

PLATFORM_NAME = "magicdec_cpu"
ATTENTION_BACKEND = "magicdec_cpu"  # the native kernel (magicdec_kernels/cpu_native.py)
TORCH_ATTENTION_BACKEND = "magicdec_cpu_torch"  # the same semantics on torch ops alone
CPU_ATTENTION_BACKENDS = (ATTENTION_BACKEND, TORCH_ATTENTION_BACKEND)
PLATFORM_CLASS = "sglang_magicdec.platforms.cpu.MagicDecCpuPlatform"


def activate() -> str | None:
    """Return our CPU platform class when nothing better is there, else None.

    It stays out of the way on a GPU machine, when the user asked for SGLang's own CPU engine,
    and when `SGLANG_PLATFORM` names another platform (SGLang then never calls us anyway).
    """
    selected = os.environ.get("SGLANG_PLATFORM")
    if selected and selected != PLATFORM_NAME:
        return None
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        return None
    if selected != PLATFORM_NAME:
        import torch

        if torch.cuda.is_available():
            return None
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            return None
    return PLATFORM_CLASS


def is_active() -> bool:
    """Whether the current SGLang platform is ours (resolves it on first call)."""
    from sglang.srt.platforms import current_platform

    return type(current_platform).__module__ == __name__ + ".cpu"
