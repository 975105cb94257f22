"""`sglang.srt.plugins` entry point, run by SGLang early in every process it starts fresh
(launcher, and scheduler and detokenizer where they are spawned; a CPU server forks them from the
launcher, `platforms.hooks.fork_server_processes`), so whatever we register here exists wherever
SGLang looks for it."""

from __future__ import annotations

import functools

from sglang_magicdec.platforms import ATTENTION_BACKEND, CPU_ATTENTION_BACKENDS


def load() -> None:
    """Register our flags among SGLang's server arguments (`config`), MAGICDEC, our attention
    backends (the CPU ones; the wrapper SGLang's fa3,
    flashinfer and triton backends get while MAGICDEC runs), the request checks SGLang lacks
    (`validation`), our Prometheus metrics (`metrics`) and, on our CPU platform, the CPU
    defaults."""
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_magicdec import config, metrics, radix_events, spec_algo, validation
    from sglang_magicdec.attention import create_backend
    from sglang_magicdec.gpu_attention import wrap_dense_backends
    from sglang_magicdec.platforms import is_active

    add_attention_backend_choices(list(CPU_ATTENTION_BACKENDS))
    for name in CPU_ATTENTION_BACKENDS:
        register_attention_backend(name)(functools.partial(create_backend, name=name))
    wrap_dense_backends()
    config.register()
    spec_algo.register()
    validation.register()
    metrics.register()
    HookRegistry.register(INTERNAL_STATE_SPECULATIVE, add_server_info, HookType.AFTER)
    for method, hook in radix_events.RADIX_CACHE_HOOKS.items():
        HookRegistry.register(f"{radix_events.RADIX_CACHE}.{method}", hook, HookType.AFTER)
    HookRegistry.register(
        radix_events.PREFIX_MATCH_LIMIT, radix_events.max_prefix_len, HookType.AROUND
    )
    if is_active():
        from sglang_magicdec.platforms import hooks

        _register_cpu_defaults()
        hooks.register()


INTERNAL_STATE_SPECULATIVE = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController._add_speculative"
)


def add_server_info(result, controller, state: dict, *args, **kwargs):
    """Our worker's own acceptance counters in `/server_info`: SGLang's
    `avg_spec_accept_length` only folds in every `--decode-log-interval` decode batches."""
    server_info = getattr(controller.scheduler.draft_worker, "server_info", None)
    if server_info is not None:
        info = server_info()
        state["magicdec"] = info
        if info["verify_rounds"]:
            state["avg_spec_accept_length"] = info["avg_accept_length"]
    return result


def _register_cpu_defaults() -> None:
    """Default `device` and the attention backend on our CPU platform.

    SGLang resolves both in named pipeline steps that run before the platform's own
    `apply_server_args_defaults`, and the CPU step would pick `intel_amx` (the kernel package we
    cannot build), so these two steps are wrapped: the narrowest seam SGLang offers for it.
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    @register_resolution_hook("handle_missing_default_values")
    def default_device_cpu(server_args, previous) -> None:
        if resolving_view(server_args).device is None:
            declare_resolution(server_args, "magicdec_cpu_platform", device="cpu")
        previous(server_args)

    @register_resolution_hook("handle_cpu_backends")
    def default_attention_backend(server_args, previous) -> None:
        if resolving_view(server_args).attention_backend is None:
            declare_resolution(
                server_args, "magicdec_cpu_platform", attention_backend=ATTENTION_BACKEND
            )
        previous(server_args)
