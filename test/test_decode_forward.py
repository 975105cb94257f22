"""Our decode forward of Llama and Qwen2 models (`platforms/decode_forward.py`) computes what
SGLang's own layers compute, bit for bit, in SGLang's model runner; and leaves to SGLang what it
does not run as SGLang would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from magicdec_kernels.loader import native
from sglang_magicdec.platforms import decode_forward

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(native() is None, reason="the native CPU kernels did not build or load")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["llama", "qwen2-head_dim64", "qwen2-head_dim128"])
def test_logits_are_identical_to_sglangs_layers(request, tiny_qwen2, model, dtype):
    """A ragged batch's decode steps, and after every second one a MagicDec round built by
    `round_batches` as the worker builds it (γ = 3 draft DECODE steps over per-layer,
    per-KV-head slot lists, then the TARGET_VERIFY of the 4 tokens): each forward run through
    both paths on the same batch."""
    if model == "llama":
        folder = request.getfixturevalue("tiny_llama")
    else:
        folder = tiny_qwen2(int(model.removeprefix("qwen2-head_dim")))
    run = subprocess.run(
        [sys.executable, "-m", "test.decode_forward_check", str(folder), dtype],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["planned"], f"{model} should run our decode forward"
    forwards = result["forwards"]
    # 4 decode steps; 2 rounds of 3 draft steps and a verify each.
    assert {kind: len(runs) for kind, runs in forwards.items()} == {
        "decode": 4,
        "draft": 6,
        "verify": 2,
    }
    for kind, runs in forwards.items():
        # [identical logits, our forward's runs in SGLang's path, in ours]
        assert runs == [[True, 0, 1]] * len(runs), kind
    # Draft and verify forwards take their positions from MagicDecInput, in both paths.
    assert result["positions_taken"] == [True] * 16


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
    got = decode_forward.model_forward(
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
        got = decode_forward.model_forward(
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


@pytest.fixture
def unwarned(monkeypatch):
    """A process that has not yet warned that a plan could not be made."""
    monkeypatch.setattr(decode_forward, "_warned_unplannable", False)


def test_a_plan_sglang_no_longer_allows_runs_sglangs_forward_with_one_warning(
    monkeypatch, caplog, unwarned
):
    """What the plan reads of SGLang's layers is private; where a read fails (here a model
    without `pp_group`, as after a rename), SGLang's forward runs, and the process says once
    what was missing."""
    monkeypatch.delenv(decode_forward.STRICT_ENV, raising=False)
    monkeypatch.setattr(decode_forward, "_is_ours", lambda forward_batch: True)
    input_ids = torch.zeros(3, dtype=torch.int64)
    models = []
    for _ in range(2):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList()
        models.append(model)
        got = decode_forward.model_forward(
            lambda *args: "sglang's", model, input_ids, input_ids, _forward_batch("decode")
        )
        assert got == "sglang's" and decode_forward._PLANS[model] is None
    warnings = [r for r in caplog.records if r.name == decode_forward.__name__]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    assert "AttributeError" in warnings[0].message and "pp_group" in warnings[0].message


def test_under_tests_a_plan_that_cannot_be_made_raises(monkeypatch, caplog, unwarned):
    monkeypatch.setenv(decode_forward.STRICT_ENV, "1")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    with pytest.raises(AttributeError, match="pp_group"):
        decode_forward.plan_of(model)
    assert not caplog.records


def test_the_test_suite_runs_strict():
    """`conftest.py` sets it; servers the tests start inherit it."""
    import os

    assert os.environ.get(decode_forward.STRICT_ENV) == "1"


def test_a_forced_fused_op_backend_is_not_planned():
    """`BaseFusedOp.forward` runs a forced backend (`SGLANG_FORCE_FUSED_OP_BACKEND`) instead of
    the op's `_forward_method`: SGLang's layers would not run our forwards, so neither does the
    plan (which then reads nothing of the model: `object()` would raise)."""
    from sglang.kernels import fused_op
    from sglang.kernels.spec import KernelBackend

    previous = fused_op.get_fused_op_backend()
    assert previous is None
    with pytest.raises(AttributeError):
        decode_forward.plan_of(object())
    fused_op.set_fused_op_backend(KernelBackend.TORCH)
    try:
        assert decode_forward.plan_of(object()) is None
    finally:
        fused_op.set_fused_op_backend(previous)
