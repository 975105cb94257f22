"""`MAGICDEC` in SGLang's speculative-algorithm registry: server-argument rules and the worker."""

from __future__ import annotations

import logging

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_magicdec.config import ALGORITHM, DEFAULT_GAMMA

logger = logging.getLogger(__name__)


class MagicDecAlgo(CustomSpecAlgo):
    """A chain draft of γ tokens verified in one pass of γ + 1 tokens.

    SGLang 0.5.23's `CustomSpecAlgo` misses three methods the scheduler calls on every algorithm
    (`carries_draft_hidden_states`, `need_topk`, `create_future_map`); they are given here with
    the answers for a draft that has no hidden states and no tree.
    """

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(
        self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def handle_server_args(self, server_args) -> None:
        gamma = server_args.speculative_num_steps or DEFAULT_GAMMA
        server_args.speculative_num_steps = gamma
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = gamma + 1
        # Each round's drafts depend on the last round's accepted tokens.
        server_args.disable_overlap_schedule = True
        _disable_graphs(server_args)


def _disable_graphs(server_args) -> None:
    """Every forward of MAGICDEC runs eagerly, on every device.

    SGLang's decode graph runner would capture TARGET_VERIFY at width γ + 1 with no spec input
    (none exists for a plugin algorithm) and replay it for a plain γ = 0 step, which carries
    none either; a replayed graph also runs no Python, so the SnapKV observer's hooks would not
    see a prefill. Capture reads `cuda_graph_config`, which SGLang derived from
    `--disable-cuda-graph` earlier in resolution (`handle_cuda_graph_config`), so both of its
    phases are declared off here, as SGLang's `model_hook` does; the legacy boolean follows.
    `server_args` is SGLang's recorder for plugin writes: these assignments are declarations.
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    config = server_args.cuda_graph_config
    if config is None:
        return
    capturing = [
        phase
        for phase in (Phase.DECODE, Phase.PREFILL)
        if getattr(config, phase).backend != Backend.DISABLED
    ]
    if not capturing:
        return
    # On a CPU nothing would capture: say it only where graphs were really on the way.
    log = logger.warning if server_args.device in (None, "cuda") else logger.debug
    log(
        "%s turns CUDA graphs off (%s): graph capture with a MagicDec verify input is not "
        "implemented; every forward runs eagerly",
        ALGORITHM,
        ", ".join(capturing),
    )
    for phase in capturing:
        config = with_phase(config, phase, backend=Backend.DISABLED)
    server_args.cuda_graph_config = config
    server_args.disable_cuda_graph = True


def validate_server_args(server_args) -> None:
    """One-line errors for flag combinations MAGICDEC cannot serve."""
    steps = server_args.speculative_num_steps
    if steps is not None and steps < 1:
        raise ValueError(f"--speculative-num-steps (γ) must be >= 1 for {ALGORITHM}, got {steps}")
    if (server_args.speculative_eagle_topk or 1) != 1:
        raise ValueError(f"{ALGORITHM} drafts a chain: --speculative-eagle-topk must be 1")
    tokens = server_args.speculative_num_draft_tokens
    if tokens is not None and tokens != (steps or DEFAULT_GAMMA) + 1:
        raise ValueError(
            f"{ALGORITHM} verifies γ + 1 tokens: --speculative-num-draft-tokens must be "
            f"--speculative-num-steps + 1 (or unset)"
        )
    if server_args.speculative_draft_model_path is not None:
        raise ValueError(
            f"{ALGORITHM} drafts with the target model itself: drop --speculative-draft-model-path"
        )
    if str(server_args.kv_cache_dtype).startswith(("fp8", "fp4")):
        raise ValueError(
            f"{ALGORITHM}'s draft kernels read 16/32-bit KV: --kv-cache-dtype "
            f"{server_args.kv_cache_dtype} is not supported"
        )
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).attn_dp_size > 1:
        # Attention-DP ranks hold different batches, so their rounds (γ, draft steps) would
        # differ while their MLPs run collectives together.
        raise ValueError(f"{ALGORITHM} does not run with attention DP; use --dp or --tp")
    if server_args.pp_size > 1:
        raise ValueError(f"{ALGORITHM} does not run with pipeline parallelism (--pp-size > 1)")
    _check_prefix_cache(server_args)
    from sglang_magicdec.launch_checks import check_attention_features

    check_attention_features(server_args.model_path, ALGORITHM, server_args.trust_remote_code)
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    from sglang_magicdec.gpu_attention import check_attention_backends
    from sglang_magicdec.platforms import is_active

    check_attention_backends(attention_backends_of(server_args), cpu_platform=is_active())


def _check_prefix_cache(server_args) -> None:
    """MAGICDEC follows SGLang's `UnifiedRadixCache` (the hooks in `radix_events.RADIX_CACHE_HOOKS`:
    releases, evictions, flushes) to drop per-request state and SnapKV summaries that point at
    freed KV. These flags make SGLang build another prefix cache, whose own `on_release`/`reset`
    (LMCache) or whole class (FlexKV, a registered backend) those hooks would not see."""
    flags = {
        "--enable-lmcache": server_args.enable_lmcache,
        "--enable-flexkv": server_args.enable_flexkv,
        f"--radix-cache-backend {server_args.radix_cache_backend}": server_args.radix_cache_backend,
    }
    chosen = [flag for flag, on in flags.items() if on]
    if chosen:
        raise ValueError(
            f"{ALGORITHM} follows SGLang's UnifiedRadixCache; {chosen[0]} selects another "
            "prefix cache, whose releases and evictions it would not see"
        )


def worker_class(server_args):
    from sglang_magicdec.worker import MagicDecWorker

    return MagicDecWorker


def register() -> None:
    from sglang.srt.speculative.spec_registry import get_spec, register_algorithm

    if get_spec(ALGORITHM) is None:
        register_algorithm(
            ALGORITHM,
            supports_overlap=False,
            validate_server_args=validate_server_args,
            spec_class=MagicDecAlgo,
        )(worker_class)
