"""MagicDec's own command-line flags: part of SGLang's server arguments wherever they are parsed
(our launcher, SGLang's own `python -m sglang.launch_server`), validated with one-line errors, and
carried on the ServerArgs record itself to every process SGLang hands it to (`register`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ALGORITHM = "MAGICDEC"
DRAFTS = ("streaming", "snapkv")
POOLS = ("avg", "max")
DEFAULT_GAMMA = 3
# The budgets `--magicdec-budget auto` chooses among (MagicDec's own sweep spans 256-4,096).
AUTO_BUDGETS = (256, 512, 1024, 2048, 4096)
GROUP_TITLE = "MagicDec"
GROUP_DESCRIPTION = (
    "Self-speculative decoding for long contexts (with --speculative-algorithm MAGICDEC): the "
    "target model drafts with a small, fixed subset of its own KV cache, then verifies the draft "
    "in one pass. γ is --speculative-num-steps (default 3)."
)


@dataclass(frozen=True)
class MagicDecConfig:
    """Every MagicDec knob.

    draft        KV-selection policy of the draft: "streaming" (sinks + recent window) or
                 "snapkv" (per layer and KV head, the prompt positions the prompt's last
                 queries attend to most, plus those queries' own window)
    budget       draft KV tokens per request for the prompt part (sinks or window included);
                 "auto": the cost model picks one of `AUTO_BUDGETS` with γ per batch
    sinks        streaming: attention-sink tokens at the start of the context
    obs_window   snapkv: the last prompt tokens whose queries score the earlier positions
    pool         snapkv: "avg" or "max" pooling of the scores along positions
    pool_kernel  snapkv: pooling width (odd, so a position's neighbourhood is centred)
    share_min_len  snapkv: a prompt at least this long keeps its summary for later requests
                 whose prompts extend it (a shared document, system prompt, earlier turns)
    gamma        "auto": the cost model picks γ ∈ {0..--speculative-num-steps} per batch;
                 a number N is --speculative-num-steps N; None: fixed γ from SGLang's flag
    min_context  below this many committed tokens the draft reads the whole context, i.e. the
                 request is decoded plainly (its draft is the target itself); None = the
                 (smallest) budget
    debug        check every draft selection against the request's live KV slots, and report
                 each (layer, KV head) SnapKV selection's digest (tests)
    """

    draft: str = "snapkv"
    budget: int | str = 512
    sinks: int = 16
    obs_window: int = 32
    pool: str = "avg"
    pool_kernel: int = 5
    share_min_len: int = 1024
    gamma: str | None = None
    min_context: int | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        if self.draft not in DRAFTS:
            raise ValueError(
                f"--magicdec-draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}"
            )
        if self.sinks < 0:
            raise ValueError(f"--magicdec-sinks must be >= 0, got {self.sinks}")
        if self.budget == "auto":
            if self.gamma != "auto":
                raise ValueError(
                    "--magicdec-budget auto needs --magicdec-gamma auto: the cost model chooses "
                    "both"
                )
        elif isinstance(self.budget, str) and not self.budget.isdigit():
            raise ValueError(f"--magicdec-budget must be 'auto' or an integer, got {self.budget!r}")
        elif isinstance(self.budget, str):
            object.__setattr__(self, "budget", int(self.budget))
        if self.min_budget <= self.sinks:
            raise ValueError(
                f"--magicdec-budget ({self.min_budget}) must be larger than --magicdec-sinks "
                f"({self.sinks}): the draft needs room for recent tokens"
            )
        if self.draft == "snapkv":
            self._check_snapkv()
        if self.gamma is not None and self.gamma != "auto":
            if not self.gamma.isdigit() or int(self.gamma) < 1:
                raise ValueError(
                    f"--magicdec-gamma must be 'auto' or an integer >= 1, got {self.gamma!r}"
                )
        if self.min_context is not None and self.min_context < 0:
            raise ValueError(f"--magicdec-min-context must be >= 0, got {self.min_context}")

    def _check_snapkv(self) -> None:
        if self.obs_window < 1 or self.obs_window >= self.min_budget:
            raise ValueError(
                f"--magicdec-obs-window must be in [1, budget {self.min_budget}), "
                f"got {self.obs_window}"
            )
        if self.pool not in POOLS:
            raise ValueError(
                f"--magicdec-pool must be one of {', '.join(POOLS)}, got {self.pool!r}"
            )
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"--magicdec-pool-kernel must be odd and >= 1, got {self.pool_kernel}")
        if self.share_min_len < self.obs_window:
            raise ValueError(
                f"--magicdec-share-min-len must be >= --magicdec-obs-window ({self.obs_window}), "
                f"got {self.share_min_len}"
            )

    @property
    def budgets(self) -> tuple[int, ...]:
        """The budgets a round may draft with: the one given, or `AUTO_BUDGETS`."""
        return AUTO_BUDGETS if self.budget == "auto" else (self.budget,)

    @property
    def min_budget(self) -> int:
        return self.budgets[0]

    @property
    def max_budget(self) -> int:
        """The budget summaries are selected at (a smaller one is a prefix of its ranking)."""
        return self.budgets[-1]

    @property
    def dense_below(self) -> int:
        """Committed length below which a request's draft is the whole context."""
        return self.min_budget if self.min_context is None else self.min_context

    @classmethod
    def of(cls, server_args) -> MagicDecConfig:
        """The config parsed with these server arguments; the defaults when none was (a record
        built in Python, e.g. `sglang.Engine(..., speculative_algorithm="MAGICDEC")`)."""
        return getattr(server_args, SERVER_ARGS_FIELD, None) or cls()


_FLAGS = {
    "draft": (
        "--magicdec-draft",
        dict(choices=DRAFTS, help=f"draft KV selection (default: {MagicDecConfig.draft})"),
    ),
    "budget": (
        "--magicdec-budget",
        dict(
            help="draft KV tokens per request for the prompt part, sinks included; 'auto' "
            f"(with --magicdec-gamma auto): the cost model picks one of {AUTO_BUDGETS} per batch "
            "(default: 512)",
        ),
    ),
    "sinks": (
        "--magicdec-sinks",
        dict(type=int, help="attention-sink tokens kept by the draft (default: 16)"),
    ),
    "obs_window": (
        "--magicdec-obs-window",
        dict(
            type=int, help="snapkv: last prompt tokens whose queries score the prompt (default: 32)"
        ),
    ),
    "pool": (
        "--magicdec-pool",
        dict(choices=POOLS, help="snapkv: pooling of scores along positions (default: avg)"),
    ),
    "pool_kernel": (
        "--magicdec-pool-kernel",
        dict(type=int, help="snapkv: pooling width, odd (default: 5)"),
    ),
    "share_min_len": (
        "--magicdec-share-min-len",
        dict(
            type=int,
            help="snapkv: prompts at least this long keep one summary, reused by every later "
            "request whose prompt extends it (default: 1024)",
        ),
    ),
    "gamma": (
        "--magicdec-gamma",
        dict(
            help="'auto': a calibrated cost model picks γ per batch, up to "
            "--speculative-num-steps (0 = plain decode when speculation does not pay); "
            "N: the same as --speculative-num-steps N (default: fixed γ)",
        ),
    ),
    "min_context": (
        "--magicdec-min-context",
        dict(
            type=int,
            help="below this context length a request is decoded plainly (default: the budget)",
        ),
    ),
    "debug": (
        "--magicdec-debug",
        dict(
            action="store_true",
            default=None,
            help="check every draft selection against live KV slots (slow; for tests)",
        ),
    ),
}


SNAPKV_ONLY = ("obs_window", "pool", "pool_kernel", "share_min_len")


def add_magicdec_args(parser: argparse.ArgumentParser) -> None:
    """Add the `MagicDec` argument group (shown in --help) unless `parser` has it already (our
    hook on `ServerArgs.add_cli_args` adds it to every launcher's parser); unset flags parse as
    None."""
    if _FLAGS["draft"][0] in parser._option_string_actions:
        return
    group = parser.add_argument_group(GROUP_TITLE, GROUP_DESCRIPTION)
    for field, (flag, options) in _FLAGS.items():
        group.add_argument(flag, dest=f"magicdec_{field}", **options)


def config_from_args(args: argparse.Namespace) -> MagicDecConfig | None:
    """Validated config when MAGICDEC is selected, None otherwise; raises ValueError with a
    one-line reason for bad values or MagicDec flags without the algorithm."""
    given = {
        field: getattr(args, f"magicdec_{field}")
        for field in _FLAGS
        if getattr(args, f"magicdec_{field}", None) is not None
    }
    algorithm = (getattr(args, "speculative_algorithm", None) or "").upper()
    if algorithm != ALGORITHM:
        if given:
            flags = ", ".join(_FLAGS[field][0] for field in given)
            raise ValueError(f"{flags} need --speculative-algorithm {ALGORITHM}")
        return None
    steps = getattr(args, "speculative_num_steps", None)
    if steps is not None and steps < 1:
        raise ValueError(f"--speculative-num-steps (γ) must be >= 1 for {ALGORITHM}, got {steps}")
    config = MagicDecConfig(**given)
    misplaced = [field for field in SNAPKV_ONLY if field in given and config.draft != "snapkv"]
    if misplaced:
        flags = ", ".join(_FLAGS[field][0] for field in misplaced)
        raise ValueError(f"{flags} apply to --magicdec-draft snapkv only")
    if config.gamma not in (None, "auto") and steps is not None and steps != int(config.gamma):
        raise ValueError(
            f"--magicdec-gamma {config.gamma} and --speculative-num-steps {steps} disagree"
        )
    return config


# SGLang keeps "bookkeeping" attributes (underscore names that are not fields) on a ServerArgs
# record, writable at any time and pickled with it to the scheduler processes
# (`ServerArgs.__reduce__`), as it does for `_launch_command`: our config rides there.
SERVER_ARGS_FIELD = "_magicdec_config"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


def register() -> None:
    """Make our flags part of SGLang's: `ServerArgs.add_cli_args` builds the parser of every
    launcher (ours and `sglang.launch_server`), `ServerArgs.from_cli_args` turns the parsed
    flags into the record. Both are hooked: SGLang has no seam for a plugin's flags."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{SERVER_ARGS}.add_cli_args", _add_to_parser, HookType.AFTER)
    HookRegistry.register(f"{SERVER_ARGS}.from_cli_args", _carry_config, HookType.AROUND)


def _add_to_parser(result, parser: argparse.ArgumentParser, *args, **kwargs):
    add_magicdec_args(parser)
    return result


def _carry_config(original, cls, args: argparse.Namespace, *rest, **kwargs):
    """The record of parsed flags, with our validated config on it. A bad value ends the launch
    with one line (SystemExit, as argparse does), whichever launcher parsed it."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if config is not None and config.gamma not in (None, "auto"):
        args.speculative_num_steps = int(config.gamma)
    server_args = original(cls, args, *rest, **kwargs)
    if config is not None:
        setattr(server_args, SERVER_ARGS_FIELD, config)
    return server_args
