"""Installs our CPU platform's ops into SGLang (`plugin.load` calls `register` when the platform is
active): the torch helpers and few-row products of `torch_ops`, the native forwards of SGLang's
fused ops, the decode forward of Llama and Qwen2 models (`decode_forward`), and forked server
processes (`fork_server_processes`)."""

from __future__ import annotations

import multiprocessing

from sglang_magicdec.platforms import decode_forward, torch_ops

HOOKS = {
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func": (
        torch_ops.assign_req_to_token_pool
    ),
}
AROUND_HOOKS = {
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply": (
        torch_ops.decode_sized_linear
    ),
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head": (
        torch_ops.decode_sized_lm_head
    ),
    # Decode-sized forwards of Llama and Qwen2 models run their layers' ops directly.
    "sglang.srt.models.llama.LlamaModel.forward": decode_forward.model_forward,
    "sglang.srt.models.qwen2.Qwen2Model.forward": decode_forward.model_forward,
}

# Runs in the launcher after SGLang has set its environment and chosen "spawn", before it starts
# the scheduler and detokenizer processes.
SET_ENVS_AND_CONFIG = "sglang.srt.entrypoints.engine._set_envs_and_config"


def fork_server_processes(result, server_args, *args, **kwargs):
    """Start a CPU server's scheduler and detokenizer by fork, not SGLang's spawn.

    SGLang spawns because a CUDA context cannot cross a fork; a CPU server has none, and a spawned
    child imports SGLang again before it does anything: ~20 s of a ~50 s server start on a 2-core
    machine (SmolLM2: 52 s spawned, 33-36 s forked, on an AVX2 EPYC). A forked child starts from
    the launcher's state after `_set_envs_and_config`: our plugins loaded and hooks applied, and
    SGLang's environment (the Prometheus multiprocess folder included) already set."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).device == "cpu":
        multiprocessing.set_start_method("fork", force=True)
    return result


def register_fused_op_forwards() -> None:
    """SGLang's out-of-tree seam for a platform's forwards of its fused ops (taken over their
    torch `forward_native` on our platform, dispatch key "native")."""
    from sglang.kernels.fused_op import BaseFusedOp
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    from sglang_magicdec.platforms.cpu import DISPATCH_KEY

    BaseFusedOp.register_oot_forward(RMSNorm, torch_ops.rms_norm_forward, DISPATCH_KEY)
    BaseFusedOp.register_oot_forward(SiluAndMul, torch_ops.silu_and_mul_forward, DISPATCH_KEY)
    for cls in torch_ops.rotary_classes():
        BaseFusedOp.register_oot_forward(cls, torch_ops.rotary_forward, DISPATCH_KEY)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, replacement in HOOKS.items():
        HookRegistry.register(target, replacement, HookType.REPLACE)
    for target, wrapper in AROUND_HOOKS.items():
        HookRegistry.register(target, wrapper, HookType.AROUND)
    HookRegistry.register(SET_ENVS_AND_CONFIG, fork_server_processes, HookType.AFTER)
    register_fused_op_forwards()
