"""MagicDec's own command-line flags: parsed once by our launcher, beside SGLang's, and handed to
the scheduler processes (spawned, so through the environment) as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

ENV_VAR = "SGLANG_MAGICDEC_CONFIG"
GROUP_TITLE = "MagicDec"
GROUP_DESCRIPTION = (
    "Self-speculative decoding for long contexts: the target model drafts with a small, fixed "
    "subset of its own KV cache, then verifies the draft in one pass."
)


@dataclass(frozen=True)
class MagicDecConfig:
    """Every MagicDec knob, validated once at start."""

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> MagicDecConfig:
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()


def add_magicdec_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the `MagicDec` argument group (shown in --help)."""
    return parser.add_argument_group(GROUP_TITLE, GROUP_DESCRIPTION)


def config_from_args(args: argparse.Namespace) -> MagicDecConfig:
    """Build and validate the config; raises ValueError with a one-line reason."""
    return MagicDecConfig()
