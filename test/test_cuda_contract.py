"""MAGICDEC's CUDA launch, by contract, on this CPU: server arguments resolved exactly as a launch
on an H200 resolves them (`test/cuda_launch.py`), and the draft backend's wrapper of fa3 against
what fa3's `init_forward_metadata` reads (SGLang 0.5.23, `flashattention_backend.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_magicdec.gpu_attention import DENSE_BACKENDS, MagicDecAttnBackend
from sglang_magicdec.spec_info import MagicDecInput
from test.helpers import REPO

BACKENDS = (*DENSE_BACKENDS, None)  # None: SGLang's default on an H200 (fa3)


@pytest.fixture(scope="module")
def cuda_launches() -> dict:
    """(attention backend, MAGICDEC or not) -> the resolved fields, all from one process."""
    keys = [(backend, algorithm) for backend in BACKENDS for algorithm in ("MAGICDEC", None)]
    cases = [
        {"attention_backend": backend, "speculative_algorithm": algorithm}
        for backend, algorithm in keys
    ]
    run = subprocess.run(
        [sys.executable, "-m", "test.cuda_launch", json.dumps(cases)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(keys), run.stdout[-3000:] + run.stderr[-3000:]
    return dict(zip(keys, lines, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_magicdec_turns_off_both_graph_phases_on_cuda(cuda_launches, backend):
    resolved = cuda_launches[(backend, "MAGICDEC")]
    assert resolved["platform"] == "CudaSRTPlatform"
    assert "error" not in resolved, resolved
    assert resolved["attention_backend"] == (backend or "fa3")
    assert resolved["decode_graph"] == "disabled"
    assert resolved["prefill_graph"] == "disabled"
    assert resolved["speculative_num_draft_tokens"] == 4  # γ = 3 by default


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_magicdec_cuda_keeps_sglang_graph_defaults(cuda_launches, backend):
    """The harness really resolves as CUDA: SGLang's own defaults capture both phases."""
    resolved = cuda_launches[(backend, None)]
    assert resolved["platform"] == "CudaSRTPlatform"
    assert resolved["decode_graph"] == "full"
    assert resolved["prefill_graph"] == "breakable"
    assert resolved["disable_cuda_graph"] is False


class _RecordingFa3:
    """Reads what SGLang's fa3 `init_forward_metadata` reads for a TARGET_VERIFY with topk 1:
    its own `speculative_num_draft_tokens` (the verify width), nothing of a missing spec input."""

    def __init__(self, width: int):
        self.speculative_num_draft_tokens = width
        self.seen_widths: list[int] = []

    def init_forward_metadata(self, forward_batch) -> None:
        self.seen_widths.append(self.speculative_num_draft_tokens)


def _wrapper(dense) -> MagicDecAttnBackend:
    runner = SimpleNamespace(token_to_kv_pool=None, device="cpu")
    return MagicDecAttnBackend(runner, dense, "fa3")


def _verify_batch(spec_info):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info)


def test_fa3_narrow_verify_width_does_not_outlive_its_step():
    dense = _RecordingFa3(width=4)
    backend = _wrapper(dense)
    backend.init_forward_metadata(_verify_batch(MagicDecInput(draft_token_num=2)))
    assert dense.seen_widths == [2]
    assert dense.speculative_num_draft_tokens == 4
    backend.init_forward_metadata(_verify_batch(MagicDecInput(draft_token_num=4)))
    assert dense.seen_widths == [2, 4]


def test_fa3_verify_without_spec_input_uses_the_server_width():
    """SGLang's warm-up and autotune dummy runs build TARGET_VERIFY batches with no spec input."""
    dense = _RecordingFa3(width=4)
    _wrapper(dense).init_forward_metadata(_verify_batch(None))
    assert dense.seen_widths == [4]


def test_fa3_width_restored_when_metadata_fails():
    class Failing(_RecordingFa3):
        def init_forward_metadata(self, forward_batch) -> None:
            raise RuntimeError("out of memory")

    dense = Failing(width=4)
    with pytest.raises(RuntimeError):
        _wrapper(dense).init_forward_metadata(_verify_batch(MagicDecInput(draft_token_num=2)))
    assert dense.speculative_num_draft_tokens == 4


def test_draft_step_metadata_reads_only_the_spec_input():
    """A draft DECODE never reaches the dense backend's metadata (fa3 would size it by
    seq_lens and ignore the draft's slots)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dense = _RecordingFa3(width=4)
    backend = _wrapper(dense)
    head_slots = torch.zeros(1, 2, 1, 5, dtype=torch.int64)
    spec = MagicDecInput(draft_token_num=1, head_slots=head_slots, kv_lens=torch.tensor([3, 5]))
    backend.init_forward_metadata(SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=spec))
    assert dense.seen_widths == []
    assert backend.draft is not None and backend.draft.head_slots is head_slots
