"""Shared fixtures: real SGLang servers on free loopback ports, and the PG-19 data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MAGICDEC_DATA", REPO.parent / "shared" / "data"))
LAUNCH = [sys.executable, "-m", "sglang_magicdec.launch_server"]
START_TIMEOUT_S = 300

# No model hub at run time: a test that reaches for the network must fail, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def generate(self, payload: dict, timeout: float = 600) -> dict:
        response = requests.post(f"{self.url}/generate", json=payload, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(args: list[str], log_dir: Path) -> Server:
    """Start `python -m sglang_magicdec.launch_server` and wait until it answers."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [*LAUNCH, "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not answer within {START_TIMEOUT_S}s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory) -> Iterator:
    """Start servers for one module; all are stopped when the module ends."""
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def factory(*args: str) -> Server:
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
