"""The CPU platform plugin activates only where it should."""

import sys

import pytest

from sglang_magicdec import platforms
from test.helpers import ON_CPU_MACHINE


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    return monkeypatch


def test_activates_on_a_machine_without_gpu(clean_env):
    clean_env.setattr("torch.cuda.is_available", lambda: False)
    assert platforms.activate() == platforms.PLATFORM_CLASS


def test_stays_out_of_the_way_on_cuda(clean_env):
    clean_env.setattr("torch.cuda.is_available", lambda: True)
    assert platforms.activate() is None


def test_stays_out_when_sglang_cpu_engine_is_chosen(clean_env):
    clean_env.setattr("torch.cuda.is_available", lambda: False)
    clean_env.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert platforms.activate() is None


def test_stays_out_when_another_platform_is_selected(clean_env):
    clean_env.setenv("SGLANG_PLATFORM", "some_other_plugin")
    assert platforms.activate() is None


def test_explicit_selection_wins_even_with_cuda(clean_env):
    clean_env.setattr("torch.cuda.is_available", lambda: True)
    clean_env.setenv("SGLANG_PLATFORM", platforms.PLATFORM_NAME)
    assert platforms.activate() == platforms.PLATFORM_CLASS


@ON_CPU_MACHINE
def test_platform_class_is_the_active_one_here():
    import sglang  # noqa: F401 - resolves the platform the way a server does
    from sglang.srt.platforms import current_platform

    assert type(current_platform).__name__ == "MagicDecCpuPlatform"
    assert current_platform.get_default_attention_backend() == platforms.ATTENTION_BACKEND


@pytest.mark.parametrize(
    "cores,ranks,expected",
    [([0, 1], 2, "0|1"), (list(range(8)), 3, "0-2|3-5|6-7"), ([3, 1], 4, "1|3|1|3"), ([5], 1, "5")],
)
def test_threads_bind_splits_the_cores_between_ranks(cores, ranks, expected):
    from sglang_magicdec.platforms.cpu import threads_bind

    assert threads_bind(cores, ranks) == expected


@pytest.mark.parametrize(
    "flags,dtype",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD Zen 4, Intel Cooper Lake
        ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Intel Sapphire Rapids
        ({"avx2", "avx512f"}, "float32"),  # AVX-512 without bf16 products
        ({"avx2", "fma"}, "float32"),
        (set(), "float32"),  # no /proc/cpuinfo
    ],
)
def test_dtype_auto_is_bf16_where_the_cpu_multiplies_bf16(flags, dtype):
    from sglang_magicdec.platforms.cpu import default_dtype

    assert default_dtype(frozenset(flags)) == dtype


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (Linux smaps)."""
    flags, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the address"
    return flags


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self/smaps")
def test_the_kv_pool_storage_is_advised_into_huge_pages():
    """`huge_page_zeros`, which holds every layer's K and V on the CPU: zeros, 2 MiB-aligned,
    and a mapping the kernel has marked for transparent huge pages ("hg" in its VmFlags)."""
    import torch

    from sglang_magicdec.platforms.kv_pool import HUGE_PAGE, huge_page_zeros

    numel = 3 * HUGE_PAGE // 2 + 7  # three pages and a bit, in bf16
    zeros = huge_page_zeros(numel, torch.bfloat16)
    assert zeros.numel() == numel and zeros.dtype == torch.bfloat16
    assert zeros.data_ptr() % HUGE_PAGE == 0
    assert not zeros.any()
    assert "hg" in _vm_flags(zeros.data_ptr())
