"""`benchmark.floors`: what a decode step reads, from a model folder, and the floors built on it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmark.floors import (
    Machine,
    ModelShape,
    ar_floor_tok_s,
    read_seconds,
    step_floors,
)

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 100, 32, 2, 4, 2
MODEL = ModelShape(weights=1_000_000, lm_head=200_000, layers=2, q_heads=4, kv_heads=2, head_dim=16)


def write_model(folder, tied: bool, head_dim: int | None = None) -> None:
    config = {
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_size": HIDDEN,
        "tie_word_embeddings": tied,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        tensors[f"model.layers.{layer}.mlp.down_proj.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN)
    save_file(tensors, str(folder / "model.safetensors"))


def test_a_tied_embedding_is_read_whole_an_untied_one_is_not(tmp_path):
    """A tied embedding is the LM head (read whole each step); an untied one is read a row per
    token, and its LM head whole."""
    layers = LAYERS * HIDDEN * 3 * HIDDEN
    (tmp_path / "tied").mkdir()
    (tmp_path / "untied").mkdir()
    write_model(tmp_path / "tied", tied=True)
    write_model(tmp_path / "untied", tied=False)
    for kind in ("tied", "untied"):
        model = ModelShape.of(tmp_path / kind)
        assert (model.weights, model.lm_head) == (layers + VOCAB * HIDDEN, VOCAB * HIDDEN)


def test_head_dim_from_config_or_hidden_size(tmp_path):
    write_model(tmp_path, tied=True)
    assert ModelShape.of(tmp_path).head_dim == HIDDEN // HEADS
    write_model(tmp_path, tied=True, head_dim=64)
    model = ModelShape.of(tmp_path)
    assert model.head_dim == 64
    assert model.kv_bytes_per_token("bfloat16") == 2 * LAYERS * KV_HEADS * 64 * 2


def test_floors_are_bytes_or_flops_whichever_is_slower():
    model = MODEL
    machine = Machine(bandwidth=1e9, peak={"float32": 1e9, "bfloat16": 1e12})
    kv = model.kv_bytes_per_token("float32")  # 2 * 2 * 2 * 16 * 4 = 512
    # One row over 1000 keys in fp32: 4 MB + 512 kB to read, 2 MFLOP + 0.5 MFLOP.
    floors = step_floors(machine, model, "float32", rows=1, keys_read=1000, row_keys=1000)
    assert floors.attention == pytest.approx((1000 * kv / 1e9, "bytes"))
    assert floors.linear == pytest.approx((4e6 / 1e9, "bytes"))
    # 64 rows: the products' 128 MFLOP outweigh the weights' 4 MB at this peak.
    many = step_floors(machine, model, "float32", rows=64, keys_read=1000, row_keys=64 * 1000)
    assert many.linear == pytest.approx((2 * 1e6 * 64 / 1e9, "FLOPs"))
    assert many.attention[1] == "FLOPs"
    # A prefill of 64 rows computes the LM head for its last row only.
    prefill = step_floors(machine, model, "float32", 64, 64, 64 * 65 / 2, head_rows=1)
    assert prefill.linear == pytest.approx((2 * (800_000 * 64 + 200_000) / 1e9, "FLOPs"))


def test_the_ar_floor_is_a_token_per_request_per_read_of_weights_and_kv():
    model = MODEL
    contexts = [1000, 3000]
    seconds = read_seconds(model, "bfloat16", sum(contexts), 1e9)
    assert seconds == pytest.approx((2e6 + 4000 * 256) / 1e9)
    assert ar_floor_tok_s(model, "bfloat16", contexts, 1e9) == pytest.approx(2 / seconds)
