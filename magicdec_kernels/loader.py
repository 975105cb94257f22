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
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

BUILD_DIR = Path(__file__).parent / "_native"
CSRC = Path(__file__).parent / "csrc"
SOURCE_NAMES = ("module.cpp", "slot_attention.cpp", "few_rows_linear.cpp", "layer_ops.cpp")
EXTENSION_NAME = "magicdec_cpu_kernels"


@dataclass(frozen=True)
class Capabilities:
    """What this CPU runs, as the native module reads it from CPUID: the one place Python learns
    it (nothing else parses /proc/cpuinfo).

    isa          the instruction set the native kernels run ("avx512bf16", "avx512", "avx2"), or
                 "none" where they are not loaded
    avx512_bf16  `vdpbf16ps` bf16 products
    amx_bf16     AMX bf16 tiles, which oneDNN's bf16 products (torch's F.linear) use
    """

    isa: str
    avx512_bf16: bool
    amx_bf16: bool

    @property
    def bf16_products(self) -> bool:
        """bf16 multiplied natively, not widened to float32."""
        return self.avx512_bf16 or self.amx_bf16

    def few_rows_max(self, dtype: torch.dtype) -> int:
        """Rows up to which a linear layer takes the native few-row product (0: never). Below it
        a row's result does not depend on its batch, so a verify row computes exactly what a
        decode step of its token would; without AMX it is also the faster product at every row
        count a decode, draft or verify step has. With AMX, oneDNN's bf16 tiles are faster past
        ~8 rows and take them (`benchmark/results/amx/kernels.txt`)."""
        if self.isa == "none" or dtype not in (torch.float32, torch.bfloat16):
            return 0
        return 8 if dtype == torch.bfloat16 and self.amx_bf16 else 64


@functools.cache
def capabilities() -> Capabilities:
    """This CPU's capabilities; where the native module does not load, none (float32 serving,
    no native product)."""
    module = native()
    if module is None:
        return Capabilities(isa="none", avx512_bf16=False, amx_bf16=False)
    return Capabilities(**module.capabilities())


def build(
    verbose: bool = False,
    csrc: Path = CSRC,
    build_dir: Path = BUILD_DIR,
    name: str = EXTENSION_NAME,
) -> ModuleType:
    """Compile (if the sources or the headers they include changed) and load the extension; by
    default this tree's, otherwise the sources in `csrc` (another revision's, for
    `benchmark/bench_builds.py`) as module `name` built in `build_dir`."""
    cpp_extension = _import_cpp_extension()
    build_dir.mkdir(parents=True, exist_ok=True)
    # at::parallel_for is inline: under torch's OpenMP backend its `omp parallel` is compiled into
    # the extension, which then shares torch's libgomp (already loaded) and thread count.
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return cpp_extension.load(
        name=name,
        sources=[str((csrc / source).resolve()) for source in SOURCE_NAMES],
        build_directory=str(build_dir),
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
