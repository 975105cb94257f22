"""Builds and loads MagicDec's native CPU kernels (the C++ in csrc/, bound in csrc/module.cpp).

`native()` builds the extension once (later loads only check the sources) and loads it, or says in
one warning why it cannot and returns None: a missing compiler or headers, a read-only tree, a CPU
with neither AVX2 nor AVX-512. The ops that use it are in `cpu_native`.

    python -m magicdec_kernels.loader build   # what `make install` runs
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

BUILD_DIR = Path(__file__).parent / "_native"
SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("module.cpp", "slot_attention.cpp", "few_rows_linear.cpp", "layer_ops.cpp")
]
EXTENSION_NAME = "magicdec_cpu_kernels"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them ("avx512_bf16", "amx_bf16", ...); empty where
    /proc/cpuinfo is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def build(verbose: bool = False) -> ModuleType:
    """Compile (if the sources or the headers they include changed) and load the extension."""
    cpp_extension = _import_cpp_extension()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # at::parallel_for is inline: under torch's OpenMP backend its `omp parallel` is compiled into
    # the extension, which then shares torch's libgomp (already loaded) and thread count.
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(source.resolve()) for source in SOURCES],
        build_directory=str(BUILD_DIR),
        # No -march=native: each kernel is compiled per instruction set (csrc/multiversion.h).
        extra_cflags=["-O3", *openmp],
        extra_ldflags=openmp,
        is_python_module=True,
        verbose=verbose,
    )


def _import_cpp_extension() -> ModuleType:
    # Its import warns "No CUDA runtime is found" on CPU machines that have a CUDA_HOME: noise in
    # every server process here, where only the host compiler is used.
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_logger.setLevel(level)
    return cpp_extension


@functools.cache
def native() -> ModuleType | None:
    """The loaded extension, or None (with one warning saying why) where it cannot run well."""
    try:
        module = build()
    except Exception as error:  # a missing compiler, headers, a read-only tree...
        logger.warning("native CPU kernels unavailable (build failed: %s)", _reason(error))
        return None
    if module.best_isa() == "scalar":
        logger.warning("native CPU kernels unavailable (this CPU has neither AVX2 nor AVX-512)")
        return None
    return module


def _reason(error: Exception) -> str:
    """One line of a build error: the compiler's first error, else the message's last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return repr(error)
    compiler_errors = [line for line in lines if "error:" in line]
    return (compiler_errors[0] if compiler_errors else lines[-1])[:300]


def _main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m magicdec_kernels.loader build", file=sys.stderr)
        return 2
    start = time.perf_counter()
    module = build()
    seconds = time.perf_counter() - start
    print(f"{EXTENSION_NAME}: ready in {BUILD_DIR} ({module.best_isa()}, {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
