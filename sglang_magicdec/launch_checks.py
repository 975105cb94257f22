"""What a launch, and each attention layer at run time, checks of a model: that its heads split
over the tensor-parallel ranks, and that its attention is what MagicDec's draft kernels compute.
Each refusal is one line (`launch_server` and `spec_algo` turn it into the launcher's error).
"""

from __future__ import annotations

from pathlib import Path


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
