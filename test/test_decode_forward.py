"""Our decode forward of Llama models (`platforms/decode_forward.py`) computes what SGLang's own
layers compute, bit for bit, in SGLang's model runner; and leaves to SGLang what it does not run
as SGLang would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from magicdec_kernels.cpu_native import native
from sglang_magicdec.platforms import decode_forward

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(native() is None, reason="the native CPU kernels did not build or load")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_identical_to_sglangs_layers(tiny_llama, dtype):
    """A ragged batch's decode steps, each forward run through both paths on the same batch."""
    run = subprocess.run(
        [sys.executable, "-m", "test.decode_forward_check", str(tiny_llama), dtype],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["planned"], "the tiny Llama model should run our decode forward"
    assert result["ours"] == 4, "our forward should have run once per decode step"
    assert result["identical"] == [True] * 4


def _forward_batch(mode: str):
    return SimpleNamespace(
        forward_mode=SimpleNamespace(
            is_decode=lambda: mode == "decode", is_target_verify=lambda: mode == "verify"
        )
    )


@pytest.mark.parametrize(
    "mode,tokens,embeds", [("extend", 8, False), ("decode", 65, False), ("decode", 4, True)]
)
def test_prefill_wide_batches_and_embeddings_run_sglangs_forward(monkeypatch, mode, tokens, embeds):
    monkeypatch.setattr(decode_forward, "_is_ours", lambda forward_batch: True)
    monkeypatch.setattr(decode_forward, "plan_of", lambda model: pytest.fail("planned"))
    calls = []

    def original(*args):
        calls.append(args)
        return "sglang's"

    input_ids = torch.zeros(tokens, dtype=torch.int64)
    embeddings = torch.zeros(tokens, 8) if embeds else None
    model = torch.nn.Linear(1, 1)
    got = decode_forward.llama_forward(
        original, model, input_ids, input_ids, _forward_batch(mode), embeddings
    )
    assert got == "sglang's" and len(calls) == 1


def test_a_model_it_cannot_plan_runs_sglangs_forward_and_is_planned_once(monkeypatch):
    monkeypatch.setattr(decode_forward, "_is_ours", lambda forward_batch: True)
    plans = []
    monkeypatch.setattr(decode_forward, "plan_of", lambda model: plans.append(model))
    model = torch.nn.Linear(1, 1)
    input_ids = torch.zeros(3, dtype=torch.int64)
    for _ in range(2):
        got = decode_forward.llama_forward(
            lambda *args: "sglang's", model, input_ids, input_ids, _forward_batch("verify")
        )
        assert got == "sglang's"
    assert plans == [model]


def test_a_forward_hook_in_the_model_refuses_the_plan():
    """Hooks would not run in the module calls our forward skips (but the SnapKV observer's
    pre-hooks, which act only on prefill)."""
    from sglang_magicdec.observer import WindowObserver

    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    assert not decode_forward._hooked(model)
    observer = WindowObserver.__new__(WindowObserver)
    model[0].register_forward_pre_hook(observer._capture, with_kwargs=True)
    assert not decode_forward._hooked(model)
    handle = model[0].register_forward_hook(lambda *args: None)
    assert decode_forward._hooked(model)
    handle.remove()
    model.register_forward_pre_hook(lambda *args: None)
    assert decode_forward._hooked(model)
