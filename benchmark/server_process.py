"""Start `python -m sglang_magicdec.launch_server` (or SGLang's own launcher) as a child process
and wait until it serves.

Used by the tests and the benchmarks; handy for scripts that want a throwaway local server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from sglang_magicdec.model import SMOLLM2

LAUNCH = [sys.executable, "-m", "sglang_magicdec.launch_server"]
# SGLang's own: our plugin adds the MagicDec flags to it too; it needs --model-path.
SGLANG_LAUNCH = [sys.executable, "-m", "sglang.launch_server"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    _terminated: bool = False

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def generate(self, payload: dict, timeout: float = 900) -> dict:
        response = requests.post(f"{self.url}/generate", json=payload, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def server_info(self) -> dict:
        return requests.get(f"{self.url}/server_info", timeout=30).json()

    def stop(self, wait: bool = True) -> None:
        """SIGTERM: SGLang drains and exits, which takes it ~5 s (its shutdown watchdog polls
        every 5 s). `wait=False` returns at once, for a caller that starts other work meanwhile
        and calls stop() again later to wait; a server that has not exited 30 s later is killed."""
        if self.process.poll() is None and not self._terminated:
            self.process.terminate()
            self._terminated = True
        if not wait:
            return
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def children(self) -> list[psutil.Process]:
        """The processes the launcher started (scheduler, detokenizer, TP ranks); none once it
        has exited."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def scheduler(self) -> psutil.Process:
        """The scheduler: of the launcher's children, the one that has done the most work (it
        loaded the model)."""
        return max(self.children(), key=lambda child: child.cpu_times().user)

    def kill(self) -> None:
        """SIGKILL the launcher and the processes it started (scheduler, detokenizer), for a
        server with nothing to drain: one whose bind failed hangs instead of exiting on SIGTERM,
        which cost `stop()` its 30 s wait."""
        children = self.children()
        for process in [*children, self.process]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait()
        psutil.wait_procs(children, timeout=30)
        self._terminated = True


# The port is free when chosen, but a server binds it only once loaded (tens of seconds on a
# CPU); anything binding a free port meanwhile (e.g. a server starting beside it, which binds
# ports of its own) may take it first, and then uvicorn logs this and the process hangs in its
# shutdown instead of exiting.
BIND_FAILED = "error while attempting to bind on address"
PORT_ATTEMPTS = 3


def start_server(
    args: list[str],
    log_dir: Path,
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
    launch: list[str] = LAUNCH,
    model: str | None = SMOLLM2.name,
) -> ServerProcess:
    """Launch `launch` on a free loopback port (with `env` added to this process's
    environment) serving `model` where `args` name none: the small embedded model by default,
    which is what the tests and benchmarks run unless their claim needs another (None: the
    launcher's own default); again on another port if its port was taken before it bound it.
    Raises RuntimeError with the log tail if it fails."""
    if model is not None and "--model-path" not in args:
        args = ["--model-path", model, *args]
    for _attempt in range(PORT_ATTEMPTS):
        port = free_port()
        log_path = Path(log_dir) / f"server-{port}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [*launch, "--host", "127.0.0.1", "--port", str(port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
            )
        server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
        if _wait_until_serving(server, timeout_s):
            return server
    raise RuntimeError(f"every port taken before the server bound it:\n{server.log_tail()}")


def _wait_until_serving(server: ServerProcess, timeout_s: float) -> bool:
    """True once the server answers; False (stopped) if its port was taken before it bound it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            # /health answers 200 only once SGLang's own warm-up request has run: traffic sent
            # earlier queues ahead of it, and a warm-up that waits past SGLang's timeout (a long
            # prefill on a CPU) takes the server down.
            if requests.get(f"{server.url}/health", timeout=30).status_code == 200:
                return True
        except requests.RequestException:
            if BIND_FAILED in server.log_tail():
                server.kill()
                return False
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not answer within {timeout_s:.0f}s:\n{server.log_tail()}")
