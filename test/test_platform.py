"""The CPU platform plugin activates only where it should."""

import os
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
    "avx512_bf16,amx_bf16,dtype",
    [
        (True, False, "bfloat16"),  # AMD Zen 4, Intel Cooper Lake
        (True, True, "bfloat16"),  # Intel Sapphire Rapids
        (False, False, "float32"),  # AVX-512 or AVX2 without bf16 products
    ],
)
def test_dtype_auto_is_bf16_where_the_cpu_multiplies_bf16(avx512_bf16, amx_bf16, dtype):
    from magicdec_kernels.loader import Capabilities
    from sglang_magicdec.platforms.cpu import default_dtype

    cpu = Capabilities(isa="avx512", avx512_bf16=avx512_bf16, amx_bf16=amx_bf16)
    assert default_dtype(cpu) == dtype


def _linux_cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo").read().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@pytest.mark.skipif(
    not os.path.exists("/proc/cpuinfo"), reason="Linux's /proc/cpuinfo is the reference here"
)
def test_the_native_capability_query_agrees_with_linux():
    """CPUID as the native module reads it says what Linux says of bf16 products and AMX (a
    kernel that cannot save the tile state lists no amx flags), and the ISA the kernels run is
    the widest the flags allow."""
    from magicdec_kernels.loader import capabilities, native

    if native() is None:
        pytest.skip("the native CPU kernels did not build or load: nothing to query")
    flags = _linux_cpu_flags()
    cpu = capabilities()
    assert cpu.avx512_bf16 == ("avx512_bf16" in flags and "avx512f" in flags)
    assert cpu.amx_bf16 == ("amx_bf16" in flags and "amx_tile" in flags)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags
    expected = "avx512bf16" if avx512 and cpu.avx512_bf16 else "avx512" if avx512 else "avx2"
    assert cpu.isa == expected


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
