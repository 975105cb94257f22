"""Launcher errors are one line on stderr with exit code 2, never a traceback; --help shows ours."""

import subprocess

import pytest

from test.conftest import LAUNCH, REPO


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCH, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_help_shows_magicdec_group():
    result = _launch("--help")
    assert result.returncode == 0
    assert "\nMagicDec:\n" in result.stdout
    assert "--model-path" in result.stdout


@pytest.mark.parametrize(
    "args,reason",
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--tp-size", "two"], "invalid int value: 'two'"),
        (["--attention-backend", "nope"], "invalid choice: 'nope'"),
        (["--model-path", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_flag_is_one_line_error(args, reason):
    result = _launch(*args)
    assert result.returncode == 2, result.stderr
    stderr = result.stderr.strip()
    assert "Traceback" not in stderr
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("python -m sglang_magicdec.launch_server: error:")
    assert reason in stderr
