"""Shared fixtures: real SGLang servers on free loopback ports, and the PG-19 data."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_magicdec.server_process import ServerProcess, start_server

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MAGICDEC_DATA", REPO.parent / "shared" / "data"))

# No model hub at run time: a test that reaches for the network must fail, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory) -> Iterator:
    """Start servers for one module; all are stopped when the module ends."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def factory(*args: str) -> ServerProcess:
        server = start_server(list(args), log_dir)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


def pg19_texts(length: str = "4K", count: int = 20) -> list[str]:
    path = DATA_DIR / "pg19" / f"pg19_{length}.jsonl"
    if not path.is_file():
        pytest.skip(f"PG-19 data not found at {path} (set MAGICDEC_DATA to the shared/data folder)")
    with path.open() as handle:
        return [json.loads(line)["text"] for line in handle][:count]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_magicdec.model import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())
