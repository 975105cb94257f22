"""`python -m sglang_magicdec.launch_server`: SGLang's HTTP server with our plugins and flags.

Every SGLang flag works unchanged; the `MagicDec` group adds ours. `--model-path` also takes an
embedded model's name (`sglang_magicdec.model.EMBEDDED_MODELS`); without it the embedded
Qwen2.5-Coder-0.5B-Instruct is served. A bad flag or value ends the launch with one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

PROG = "python -m sglang_magicdec.launch_server"


class LaunchError(Exception):
    """A user error at launch; its message is the one line printed."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise LaunchError(message)


def build_parser() -> argparse.ArgumentParser:
    """SGLang's server flags, with the MagicDec group our plugin adds to them
    (`config.register`); `--model-path` becomes optional."""
    from sglang.srt.server_args import ServerArgs

    from sglang_magicdec.config import add_magicdec_args
    from sglang_magicdec.model import DEFAULT_MODEL, EMBEDDED_MODELS

    parser = _OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    add_magicdec_args(parser)  # without our plugin loaded, --help still shows our flags
    model_path = parser._option_string_actions["--model-path"]
    model_path.required = False
    model_path.default = None
    model_path.help += (
        f" Or an embedded model's name: {', '.join(EMBEDDED_MODELS)}."
        f" Default: {DEFAULT_MODEL.name}."
    )
    return parser


def prepare(argv: list[str]):
    """Parse, validate and resolve everything; returns SGLang's resolved ServerArgs."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_magicdec.config import config_from_args
    from sglang_magicdec.launch_checks import check_tensor_parallel
    from sglang_magicdec.model import (
        DEFAULT_MODEL,
        EmbeddedModelError,
        embedded_model,
        embedded_model_path,
    )

    args = build_parser().parse_args(argv)
    try:
        config_from_args(args)  # SGLang's parse checks it again (config.register)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    sglang_argv = list(argv)
    if args.model_path is None:
        embedded = DEFAULT_MODEL
    elif Path(args.model_path).exists():  # a folder of that name is the user's model
        embedded = None
    else:
        embedded = embedded_model(args.model_path)
    if embedded is not None:
        try:
            # The last --model-path wins in argparse: this one, the converted folder.
            sglang_argv += ["--model-path", embedded_model_path(embedded)]
        except EmbeddedModelError as exc:
            raise LaunchError(str(exc)) from None
        if args.served_model_name is None:
            # SGLang names a model by its path: here, a cache folder no client should see.
            sglang_argv += ["--served-model-name", embedded.served_name]
    try:
        server_args = prepare_server_args(sglang_argv)
        server_args.resolve_once()
        check_tensor_parallel(
            server_args.model_path, server_args.tp_size, server_args.trust_remote_code
        )
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - SGLang validates with assorted exception types
        raise LaunchError(_first_line(exc)) from None
    return server_args


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    argv = list(sys.argv[1:] if argv is None else argv)
    # Import-time notices about GPU-only kernels; meaningless here and noisy. Loading our plugins
    # imports SGLang's engine on a CPU (`platforms.hooks.SET_ENVS_AND_CONFIG`), Triton's with it.
    warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
    warnings.filterwarnings("ignore", message="Triton is not supported", category=UserWarning)
    load_plugins()  # ours included: registers the attention backend before flags are parsed
    try:
        server_args = prepare(argv)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    from sglang.launch_server import run_server

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
